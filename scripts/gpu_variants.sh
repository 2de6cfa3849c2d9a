#!/usr/bin/env bash
# Backward tile variants at head dims 256 and 64, and the decode split heuristic's waves, in one call
# (under 8 minutes on one H200; docs/perf.md records the outcome):
#   bash scripts/gpu_variants.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python3 scripts/bwd_variants.py --headdim 256 --seqlen 2048 8192 \
  --cases dense causal varlen varlen-causal \
  --variant "n32=dkdv@256:block_n=32" \
  --variant "m32=dkdv@256:block_m=32" \
  --variant "dqm64=dq@256:block_m=64,dq@256:num_stages=2" \
  --variant "dqn32=dq@256:block_n=32,dq@256:num_stages=2" \
  --variant "m32dqn32=dkdv@256:block_m=32,dq@256:block_n=32,dq@256:num_stages=2" 2>&1 \
  | grep -v -i "warn" | tee "$OUT/bwd_variants_256.log"
timeout 150 python3 scripts/bwd_variants.py --headdim 64 --seqlen 1024 4096 16384 --cases dense causal \
  --variant "n128w8=dkdv@64:block_n=128,dkdv@64:num_warps=8" \
  --variant "n128w8dq=dkdvcausal@64:block_n=128,dkdvcausal@64:num_warps=8,dkdvcausal@64:dq_atomic=2" \
  --variant "n128w8cap=dkdv@64:block_n=128,dkdv@64:num_warps=8,dkdv@64:maxnreg=128" 2>&1 \
  | grep -v -i "warn" | tee "$OUT/bwd_variants_64.log"
timeout 150 python3 scripts/decode_variants.py --out "$OUT/decode_variants" "" "waves=2" "stages=2,waves=3" 2>&1 \
  | tail -30 | tee "$OUT/decode_variants.log"
