#!/usr/bin/env bash
# Open questions from the dropout round: where the BERT-large step's time goes with tileattn against SDPA
# (profile), and which backward tiles suit dropout (the dK/dV kernel spills at 255 registers with it).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python3 scripts/profile_step.py --model bert --impls sdpa tileattn --out "$OUT/prof" 2>&1 \
  | grep -v "^\[transformers\]\|USDT" | tee "$OUT/profile.log"
timeout 300 python3 -m tileattn.bench.tune --headdim 64 128 --seqlen 2048 --causal --dropout 0.1 \
  --json "$OUT/tune_dropout.json" 2>&1 | tee "$OUT/tune_dropout.log" | grep BEST
