#!/usr/bin/env bash
# Dropout cost breakdown (alternative keep-mask builders, timing only), then the property tests on
# the GPU (four dense shards, varlen batches, kvcache calls).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 280 python3 scripts/dropout_variants.py 2>&1 | tee "$OUT/dropout_variants.log" | tail -24
for d in "$OUT"/cache_*; do
  [ -d "$d" ] && { find "$d" -name "*.ttgir" -o -name "*.json" | xargs -r tar czf "$d.tgz"; rm -rf "$d"; }
done
timeout 270 python3 -m pytest tests -q -n 8 -p no:cacheprovider -p no:warnings -k "property and cuda" --durations=6 2>&1 \
  | tee "$OUT/pytest_property.log" | tail -12
