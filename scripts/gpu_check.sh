#!/usr/bin/env bash
# One GPU session: the test suite at real sizes, then a tile sweep. Writes logs under $OUT.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash scripts/gpu_check.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests -q -n ${WORKERS:-8} -p no:cacheprovider -p no:warnings 2>&1 \
  | tee "$OUT/pytest.log" | tail -25
timeout ${TUNE_TIMEOUT:-240} python3 -m tileattn.bench.tune --headdim ${TUNE_HEADDIMS:-64 128 256} --seqlen 4096 \
  --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | grep -E "BEST|error" 
