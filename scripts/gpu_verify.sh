#!/usr/bin/env bash
# First GPU call after interpreter-only changes: the whole suite, a correctness + speed spot check of the
# training kernels, and the decode step with the fused append.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 330 python3 -m pytest tests -q -n 12 -p no:cacheprovider -p no:warnings 2>&1 | tee "$OUT/pytest.log" | tail -8
timeout 90 python3 scripts/gpu_quickcheck.py 2>&1 | tee "$OUT/quickcheck.log" | tail -5
timeout 90 python3 scripts/decode_append_bench.py 2>&1 | tee "$OUT/append.log" | tail -4
