#!/usr/bin/env bash
# KV cache session, final pass: the whole test suite, the paged decoding example and the decode
# benchmark with the tuned tiles and split heuristic.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 330 python3 -m pytest tests -q -n 12 -p no:cacheprovider -p no:warnings 2>&1 | tee "$OUT/pytest.log" | tail -6
timeout 60 python3 examples/paged_decode.py 2>&1 | tee "$OUT/example.log" | tail -3
timeout 150 python3 -m tileattn.bench --decode --out "$OUT/decode.jsonl" > "$OUT/decode.log" 2>&1
grep -E "^\|" "$OUT/decode.log"
