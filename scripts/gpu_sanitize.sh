#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over scripts/sanitize.py (training, varlen and KV-cache kernels).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for tool in memcheck racecheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-130} compute-sanitizer --tool $tool --print-limit 20 \
    python3 scripts/sanitize.py > "$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|workload done" "$OUT/sanitizer_$tool.log"
done
