#!/usr/bin/env bash
# The thread-local dropout mask (16 columns per Philox draw in the MMA layout): bit-exactness and reference
# tests, its speed against the previous mask, FA2 with dropout and no dropout; then the property tests in
# shards (dense, varlen, kvcache) with fresh examples.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 100 python3 -m pytest tests/test_dropout.py tests/test_reliability.py -q -n 8 -p no:cacheprovider -p no:warnings \
  -k "dropout or determinis or grouped or philox" 2>&1 | tee "$OUT/pytest_dropout.log" | tail -3
timeout 150 python3 scripts/dropout_variants.py --only anchors current consecutive16 2>&1 | tee "$OUT/dropout_variants.log" | tail -9
rm -rf "$OUT"/cache_*
TILEATTN_HYPOTHESIS_SHARDS=5 TILEATTN_HYPOTHESIS_EXAMPLES=${EXAMPLES:-16} timeout ${PROP_TIMEOUT:-240} \
  python3 -m pytest tests -q -n 15 -p no:cacheprovider -p no:warnings -k "property and cuda" --durations=15 2>&1 \
  | tee "$OUT/pytest_property.log" | grep -v Warning | tail -22
