#!/usr/bin/env bash
# Dropout with 8 columns per Philox draw: bit-exactness and reference tests on the GPU, speed against
# FA2 with dropout, and the GPT-2 / BERT training steps again.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 120 python3 -m pytest tests/test_dropout.py tests/test_reliability.py -q -n 8 -p no:cacheprovider -p no:warnings \
  -k "dropout or determinis or grouped or philox" 2>&1 | tee "$OUT/pytest_dropout.log" | tail -4
timeout 90 python3 scripts/dropout_bench.py 2>&1 | tee "$OUT/dropout_bench.log"
timeout 240 python3 scripts/reproduce_paper.py --parts gpt2 bert --out "$OUT/paper" 2>&1 | grep -v "^\[transformers\]" > "$OUT/paper.log"
tail -16 "$OUT/paper.log"
