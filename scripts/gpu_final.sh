#!/usr/bin/env bash
# Registers/spills of the attention kernels with and without dropout, the bad-input / modules / dropout
# tests on the GPU, and the GPT-2 / BERT training steps with the thread-local dropout mask.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 60 python3 scripts/kernel_resources.py 2>&1 | tee "$OUT/resources.log" | tail -30
timeout 100 python3 -m pytest tests/test_errors.py tests/test_modules.py tests/test_dropout.py -q -n 8 -p no:cacheprovider \
  -p no:warnings 2>&1 | tee "$OUT/pytest.log" | tail -2
timeout 210 python3 scripts/reproduce_paper.py --parts gpt2 bert --out "$OUT/paper" 2>&1 | grep -v "^\[transformers\]" > "$OUT/paper.log"
tail -16 "$OUT/paper.log"
