#!/usr/bin/env bash
# The decode kernels' GPU tests, then the decode rows for TMA reads (contiguous, and paged caches whose
# pages hold whole key tiles) against pointer loads, and for deeper pipelines, with cuDNN and do_bench rows
# in the same run (under 9 minutes on one H200):
#   bash scripts/gpu_decode4.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python3 -m pytest tests/test_kvcache.py -q -n 8 -p no:cacheprovider -p no:warnings 2>&1 \
  | tee "$OUT/pytest_kvcache.log" | tail -4
timeout 320 python3 scripts/decode_variants.py --out "$OUT/decode_variants" "" "tma=0" "stages=4" "ptstages=4" \
  > "$OUT/decode_variants.log" 2>&1
tail -22 "$OUT/decode_variants.log"
