#!/usr/bin/env bash
# One GPU session of measurements: the papers' grid against SDPA's backends, the varlen comparison,
# a head-dim-256 tile sweep and FlexAttention at head dim 128. Logs and JSON lines go under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout ${GRID_TIMEOUT:-300} python3 -m tileattn.bench --backends tileattn sdpa-cudnn sdpa-flash \
  --out "$OUT/grid.jsonl" > "$OUT/grid.log" 2>&1
tail -80 "$OUT/grid.log" | grep -E "^\|" | cut -c1-150
timeout ${VARLEN_TIMEOUT:-60} python3 -m tileattn.bench --varlen --out "$OUT/varlen.jsonl" 2>&1 | tee "$OUT/varlen.log" | grep -E "^\||lengths"
timeout ${TUNE_TIMEOUT:-100} python3 -m tileattn.bench.tune --headdim 256 --seqlen 4096 --json "$OUT/tune256.json" \
  > "$OUT/tune256.log" 2>&1; grep BEST "$OUT/tune256.log"
timeout ${FLEX_TIMEOUT:-150} python3 -m tileattn.bench --backends flex tileattn --headdim 128 --seqlen 1024 4096 16384 \
  --out "$OUT/flex.jsonl" > "$OUT/flex.log" 2>&1; grep -E "^\|" "$OUT/flex.log" | cut -c1-150
