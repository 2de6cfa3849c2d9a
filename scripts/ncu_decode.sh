#!/usr/bin/env bash
# Nsight Compute over the decode split kernel of one row in each cache layout (scripts/ncu_decode.py):
# the details page of each, and the SASS with its stall samples, under $OUT.
#   bash scripts/ncu_decode.sh 1 131072 "tileattn" "tileattn paged16" "tileattn paged256"
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
batch=$1 len=$2
shift 2
for layout in "$@"; do
  name=$(echo "$layout" | tr ' ' _)_${batch}x${len}
  timeout 150 ncu --clock-control none --kernel-name regex:_attn_fwd_kvcache --launch-skip 3 --launch-count 1 \
    --set full --import-source no -f -o "$OUT/$name" python3 scripts/ncu_decode.py "$layout" "$batch" "$len" \
    > "$OUT/$name.ncu.log" 2>&1
  echo "$layout: ncu exit $?"
  ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name.details.txt" 2>&1
  ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Shared Memory Configuration Size|Dynamic Shared" \
    "$OUT/$name.details.txt" | head -14
done
