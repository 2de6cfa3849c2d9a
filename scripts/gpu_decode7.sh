#!/usr/bin/env bash
# Paged decode variants (interleaved A/B), the decode call's host time, then the benchmark CLI's decode
# table with the settings as they are (under 8 minutes on one H200):
#   bash scripts/gpu_decode7.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 150 python3 scripts/decode_ab.py --layouts "tileattn paged16" "tileattn paged256" \
  --out "$OUT/decode_ab_paged.jsonl" "" "plong=7" "pwarps=8" "plong=7,pwarps=8" > "$OUT/decode_ab_paged.log" 2>&1
timeout 60 python3 scripts/host_overhead.py --decode 2>&1 | grep -v -i warn | tee "$OUT/host_decode.log"
timeout 240 python3 -m tileattn.bench --decode --out "$OUT/bench_decode.jsonl" > "$OUT/bench_decode.log" 2>&1
tail -12 "$OUT/decode_ab_paged.log"
grep -E "^\|" "$OUT/bench_decode.log" | cut -c1-110 | tail -52 | grep -E "backend|tileattn |cudnn|copy" 
