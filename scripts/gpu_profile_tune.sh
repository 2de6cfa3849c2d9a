#!/usr/bin/env bash
# Open questions from the dropout round: where the BERT-large step's time goes with tileattn against SDPA
# (profile), and which backward tiles and dK/dV orientation (q_major) suit dropout (the dK/dV kernel
# spills at 255 registers with it).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# One part per call (each fits the 10-minute limit): bash scripts/gpu_profile_tune.sh profile | tune
part=${1:-profile}
[ "$part" = profile ] && timeout 300 python3 scripts/profile_step.py --model bert --impls sdpa tileattn --out "$OUT/prof" 2>&1 \
  | grep -v "^\[transformers\]\|USDT" | tee "$OUT/profile.log"
[ "$part" = tune ] && timeout 560 python3 -m tileattn.bench.tune --headdim 64 128 --seqlen 2048 --causal --dropout 0.1 \
  --json "$OUT/tune_dropout.json" 2>&1 | tee "$OUT/tune_dropout.log" | grep BEST
