#!/usr/bin/env bash
# The decode GPU tests with launches taking the direct path (every hit checked against Triton's choice),
# the decode call's host time, full-grid stages for contiguous caches (interleaved A/B), then memcheck over
# the sanitizer workload (contiguous TMA builds included); under 7 minutes on one H200:
#   bash scripts/gpu_decode9.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 170 python3 -m pytest tests/test_kvcache.py tests/test_cache.py -q -n 8 -p no:cacheprovider -p no:warnings \
  2>&1 | tee "$OUT/pytest_kvcache.log" | tail -3
timeout 60 python3 scripts/host_overhead.py --decode 2>&1 | grep -v -i warn | tee "$OUT/host_decode.log"
timeout 80 python3 scripts/decode_ab.py --layouts tileattn --out "$OUT/decode_ab.jsonl" "" "fstages=2" \
  "fstages=2,ftiles=128" > "$OUT/decode_ab.log" 2>&1
tail -6 "$OUT/decode_ab.log"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 140 compute-sanitizer --tool memcheck --print-limit 20 \
  python3 scripts/sanitize.py > "$OUT/sanitizer_memcheck.log" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|workload done" "$OUT/sanitizer_memcheck.log"
