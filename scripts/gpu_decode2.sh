#!/usr/bin/env bash
# Decode tuning, second pass: block_n x stages x num_splits jointly, and paged caches.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 400 python3 scripts/decode_sweep.py 2>&1 | grep -v Warn | tee "$OUT/sweep2.log"
