#!/usr/bin/env bash
# The GPU checks left open when device time ran out (docs/perf.md, 2026-11-29). Run first on a freshly
# started machine: the TMA forward's one failed check happened in the first command of a cold machine.
#   1. the feature rows with the TMA forward on, as in that run (head dims 128, 64, 256);
#   2. the feature rows as the tables are (TMA off), with cu_seqlens now checked once per tensor;
#   3. host time per call (direct path vs custom op) and the TMA stress comparison;
#   4. the GPU test suite (the kernels' rows_desc helper changed after the last GPU run).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python3 scripts/features_tma.py on --headdim 128 64 256 --out "$OUT/features_tma.jsonl" 2>&1 \
  | tee "$OUT/features_tma.log" | tail -32
timeout 200 python3 scripts/features_tma.py off --headdim 128 64 256 --out "$OUT/features.jsonl" 2>&1 \
  | tee "$OUT/features.log" | tail -32
timeout 90 python3 scripts/host_overhead.py --compare-op --profile 2>&1 | tee "$OUT/host.log" | head -60
timeout 100 python3 scripts/tma_stress.py 40 2>&1 | tee "$OUT/tma_stress.log" | tail -3
TILEATTN_HYPOTHESIS_SHARDS=2 TILEATTN_HYPOTHESIS_EXAMPLES=4 timeout 200 python3 -m pytest tests -q -n 14 \
  -p no:cacheprovider -p no:warnings 2>&1 | tee "$OUT/pytest.log" | tail -4
