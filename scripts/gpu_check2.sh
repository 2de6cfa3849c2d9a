#!/usr/bin/env bash
# Third GPU session: tests, the long-context run, the hd256 grid with its new tiles, Flex causal.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 240 python3 -m pytest tests -q -n 8 -p no:cacheprovider -p no:warnings 2>&1 | tee "$OUT/pytest.log" | tail -4
timeout 60 python3 scripts/long_context.py 2>&1 | tee "$OUT/long.log" | tail -3
timeout 100 python3 -m tileattn.bench --backends tileattn sdpa-cudnn sdpa-flash --headdim 256 --out "$OUT/grid256.jsonl" \
  > "$OUT/grid256.log" 2>&1; grep -E "^\|" "$OUT/grid256.log" | cut -c1-140
timeout 120 python3 -m tileattn.bench --backends flex tileattn --headdim 128 --seqlen 1024 4096 16384 --causal yes \
  --out "$OUT/flex.jsonl" > "$OUT/flex.log" 2>&1; grep -E "^\|" "$OUT/flex.log" | cut -c1-140
