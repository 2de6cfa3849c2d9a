#!/usr/bin/env bash
# First GPU call after interpreter-only changes: the whole suite (property tests with few examples per
# shard), a correctness + speed spot check of the training kernels, the dropout backward with the dK/dV
# kernel in each orientation, and the kernels' registers / spills.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TILEATTN_HYPOTHESIS_EXAMPLES=6 timeout 330 python3 -m pytest tests -q -n 14 -p no:cacheprovider -p no:warnings \
  --durations=5 2>&1 | tee "$OUT/pytest.log" | grep -v Warning | tail -10
timeout 60 python3 scripts/gpu_quickcheck.py 2>&1 | tee "$OUT/quickcheck.log" | tail -4
timeout 120 python3 scripts/dropout_variants.py --only current qmajor 2>&1 | tee "$OUT/dropout_qmajor.log" | tail -6
rm -rf "$OUT"/cache_*
timeout 60 python3 scripts/kernel_resources.py 2>&1 | tee "$OUT/resources.log" | tail -12
