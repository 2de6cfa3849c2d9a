#!/usr/bin/env bash
# The decode kernels' GPU tests, interleaved A/B timing of the decode settings (TMA reads, paged stages),
# (under 8 minutes on one H200):
#   bash scripts/gpu_decode5.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 170 python3 -m pytest tests/test_kvcache.py -q -n 8 -p no:cacheprovider -p no:warnings 2>&1 \
  | tee "$OUT/pytest_kvcache.log" | tail -3
timeout 280 python3 scripts/decode_ab.py --out "$OUT/decode_ab.jsonl" "" "tma=0" "ptma=0" "plong=0" \
  > "$OUT/decode_ab.log" 2>&1
tail -18 "$OUT/decode_ab.log"
