#!/usr/bin/env bash
# The reliability session (2 GPUs, for the cuda:1 test): the whole test suite on the GPU (determinism,
# tensors past 2**31 elements, streams, devices, property tests), then compute-sanitizer.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest tests -q -n 12 -p no:cacheprovider -p no:warnings --durations=8 2>&1 \
  | tee "$OUT/pytest.log" | tail -16
for tool in memcheck racecheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-90} compute-sanitizer --tool $tool --print-limit 20 \
    python3 scripts/sanitize.py > "$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|workload done" "$OUT/sanitizer_$tool.log"
done
