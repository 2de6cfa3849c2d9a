#!/usr/bin/env bash
# The forward's TMA / warp-specialised variants on the GPU: their tests, a spot check of the training
# kernels, then scripts/tma_probe.py (every variant against the table entry and cuDNN).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 150 python3 -m pytest tests/test_attention.py -q -n 8 -k "tma_variants" -p no:cacheprovider -p no:warnings \
  2>&1 | tee "$OUT/pytest_tma.log" | grep -v Warning | tail -12
timeout ${PROBE_TIMEOUT:-450} python3 scripts/tma_probe.py --out "$OUT" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/tma_probe.log" \
  | grep -v '^{' | tail -60
