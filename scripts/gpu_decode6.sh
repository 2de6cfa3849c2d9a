#!/usr/bin/env bash
# The decode GPU tests, interleaved A/B timing of the combine's dependent launch and the TMA settings,
# then compute-sanitizer over the workload (TMA decode builds and the dependent launch included):
#   bash scripts/gpu_decode6.sh        (under 9 minutes on one H200)
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 150 python3 -m pytest tests/test_kvcache.py -q -n 8 -p no:cacheprovider -p no:warnings 2>&1 \
  | tee "$OUT/pytest_kvcache.log" | tail -3
timeout 120 python3 scripts/decode_ab.py --out "$OUT/decode_ab.jsonl" "" "pdl=0" "tma=1" "ptma=0" \
  > "$OUT/decode_ab.log" 2>&1
SAN_TIMEOUT=150 bash scripts/gpu_sanitize.sh
tail -18 "$OUT/decode_ab.log"
