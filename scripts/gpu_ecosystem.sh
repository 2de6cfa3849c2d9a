#!/usr/bin/env bash
# Ecosystem session: compile / transformers / modules / shim / cache tests on the GPU, then the papers'
# end-to-end reproduction (scripts/reproduce_paper.py).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 170 python3 -m pytest tests/test_compile.py tests/test_transformers.py tests/test_modules.py tests/test_shim.py \
  tests/test_cache.py -q -n 8 -p no:cacheprovider -p no:warnings 2>&1 | tee "$OUT/pytest_eco.log" | tail -8
timeout 400 python3 scripts/reproduce_paper.py --out "$OUT/paper" 2>&1 | grep -v "^\[transformers\]" > "$OUT/paper.log"
tail -45 "$OUT/paper.log"
