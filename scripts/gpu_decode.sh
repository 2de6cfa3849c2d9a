#!/usr/bin/env bash
# KV cache / decode session: kvcache tests and the pending >2^31 varlen test on the GPU, the decode
# benchmark against cuDNN / FA2 / Flex, and a tile + split sweep of the decode kernel.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python3 -m pytest tests/test_kvcache.py tests/test_errors.py -q -n 8 -p no:cacheprovider -p no:warnings \
  2>&1 | tee "$OUT/pytest_kvcache.log" | tail -4
timeout 90 python3 -m pytest tests/test_reliability.py -q -k "int32" -p no:cacheprovider -p no:warnings \
  2>&1 | tee "$OUT/pytest_int32.log" | tail -3
timeout 150 python3 -m tileattn.bench --decode --out "$OUT/decode.jsonl" > "$OUT/decode.log" 2>&1
grep -vE "^\|" "$OUT/decode.log" | tail -5
timeout 130 python3 scripts/decode_sweep.py > "$OUT/sweep.log" 2>&1; tail -3 "$OUT/sweep.log"
grep -E "^\|" "$OUT/decode.log"
