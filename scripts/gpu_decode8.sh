#!/usr/bin/env bash
# The decode GPU tests (every cached launch checked against Triton's choice), the decode call's host
# time, the interleaved decode rows with the settings as they are, and the benchmark CLI's decode table
# (under 6 minutes on one H200):
#   bash scripts/gpu_decode8.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 170 python3 -m pytest tests/test_kvcache.py -q -n 8 -p no:cacheprovider -p no:warnings 2>&1 \
  | tee "$OUT/pytest_kvcache.log" | tail -3
timeout 60 python3 scripts/host_overhead.py --decode 2>&1 | grep -v -i warn | tee "$OUT/host_decode.log"
timeout 100 python3 scripts/decode_ab.py --rounds 5 --out "$OUT/decode_ab.jsonl" "" > "$OUT/decode_ab.log" 2>&1
timeout 150 python3 -m tileattn.bench --decode --out "$OUT/bench_decode.jsonl" > "$OUT/bench_decode.log" 2>&1
tail -8 "$OUT/decode_ab.log"
grep -E "^\| [0-9]" "$OUT/bench_decode.log" | grep -E "tileattn( paged16| paged256)?( do_bench)? |cudnn|copy" | cut -c1-75
