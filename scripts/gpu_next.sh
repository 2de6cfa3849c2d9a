#!/usr/bin/env bash
# GPU checks to re-run after a kernel or table change, under 10 minutes (the parts that measured the
# 2026-11-30 changes ran and are recorded in docs/perf.md with their commands).
#   bash scripts/gpu_next.sh 2   (at most 540 s)
#     the GQA stress of the tables, the at-scale table tests (4k/8k-token GQA, every build), the GPU
#     suite, and the causal backward at head dim 128 with and without dQ reduce-adds at 1k and 2k
#     tokens (kernel times), with the tables as they are.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-2}" in
2)
  timeout 70 python3 scripts/gqa_stress.py 10 128,16,4 128,16,16 64,32,8 >"$OUT/gqa_stress.log" 2>&1
  timeout 160 python3 -m pytest tests/test_attention.py -q -n 4 -k "at_scale" -p no:cacheprovider -p no:warnings \
    >"$OUT/pytest_at_scale.log" 2>&1
  TILEATTN_HYPOTHESIS_SHARDS=2 TILEATTN_HYPOTHESIS_EXAMPLES=4 timeout 240 python3 -m pytest tests -q -n 14 \
    -k "not at_scale" -p no:cacheprovider -p no:warnings >"$OUT/pytest.log" 2>&1
  timeout 100 python3 scripts/bwd_variants.py --headdim 128 --cases causal --seqlen 1024 2048 \
    --variant "twopass=dkdvcausal@128:dq_atomic=0" >"$OUT/bwd_causal_short.log" 2>&1
  grep -v -i warn "$OUT/bwd_causal_short.log"
  grep -E "rounds|compiled" "$OUT/gqa_stress.log"
  tail -2 "$OUT/pytest_at_scale.log"
  tail -4 "$OUT/pytest.log"
  ;;
*)
  echo "usage: bash scripts/gpu_next.sh 2" >&2
  exit 2
  ;;
esac
