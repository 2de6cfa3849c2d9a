#!/usr/bin/env bash
# GPU checks of table candidates (docs/perf.md, 2026-11-30), each part under 10 minutes:
#   bash scripts/gpu_next.sh 1   (at most 540 s)
#     1. the GQA stress (fresh inputs, SDPA reference, two calls compared) of head dim 128's forward with
#        TMA, two stages and a 128-register cap (two blocks per SM, spill-free: compile_report.py), and of
#        head dim 64's forward and dQ capped at 128 registers;
#     2. head dim 128's forward over the grid's seqlens (1k-16k, causal and not) against cuDNN: the table,
#        two stages + cap 128 (pointer loads), the same with TMA, TMA alone;
#     3. head dim 128's feature rows with the TMA + two stages + cap 128 forward against the table;
#     4. the decode rows with the combine reading 16 splits per load against 1 (repeat of 2026-11-30).
#   bash scripts/gpu_next.sh 2   (at most 560 s; after the tables took the winners of part 1)
#     5. the GQA stress of the tables, the at-scale table tests (4k/8k-token GQA, every build), the GPU
#        suite, head dim 128's forward grid and the decode rows with the tables as they are.
#   bash scripts/gpu_next.sh 3   (at most 230 s; with configs._FWD_CAUSAL[128] = KernelConfig(64, 64, 4, 3,
#   tma=True), the candidate its comment names, added to the tables first)
#     6. head dim 128's causal forward table: its at-scale tests, the attention tests on the GPU, and the
#        causal grid cells 1k-4k against cuDNN.
#   bash scripts/gpu_next.sh 4   (at most 330 s)
#     7. dQ from the dK/dV pass (KernelConfig.dq_atomic 1 and 2): its GPU tests, then the backward at
#        head dims 64, 128 and 256, 2k and 8k tokens, against the tables and cuDNN.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
V128="fwd@128:tma=1 fwd@128:num_stages=2 fwd@128:maxnreg=128"
V64="fwd@16,32,64:maxnreg=128 dq@16,32,64:maxnreg=128"
case "${1:-1}" in
1)
  SET="$V128" timeout 80 python3 scripts/gqa_stress.py 10 128,16,4 128,16,16 2>&1 \
    | tee "$OUT/gqa_stress_v128.log" | grep -E "rounds|round|Error|compiled"
  SET="$V64" timeout 50 python3 scripts/gqa_stress.py 10 64,32,8 64,32,32 2>&1 \
    | tee "$OUT/gqa_stress_v64.log" | grep -E "rounds|round|Error|compiled"
  GRID="--grid --headdim 128 --seqlen 1024 2048 4096 8192 16384 --mode fwd --backends tileattn sdpa-cudnn"
  i=0
  for variant in "" "fwd@128:num_stages=2 fwd@128:maxnreg=128" "$V128" "fwd@128:tma=1"; do
    i=$((i + 1))
    echo "== forward variant $i: ${variant:-the table}"
    timeout 80 python3 scripts/features_variant.py $variant -- $GRID --out "$OUT/fwd128_grid$i.jsonl" 2>&1 \
      | grep -E "^\| hd" | awk '{print}' | tail -20
  done
  timeout 70 python3 -m tileattn.bench --features --headdim 128 --out "$OUT/features128.jsonl" 2>&1 | tail -9
  timeout 70 python3 scripts/features_variant.py $V128 -- --headdim 128 --out "$OUT/features128_v.jsonl" 2>&1 | tail -9
  timeout 100 python3 scripts/decode_variants.py --out "$OUT/decode_variants.jsonl" "" combine=16 "" combine=16 2>&1 \
    | tee "$OUT/decode_variants.log" | grep -E "tileattn \[|sdpa" | tail -40
  ;;
2)
  timeout 70 python3 scripts/gqa_stress.py 10 128,16,4 128,16,16 64,32,8 >"$OUT/gqa_stress.log" 2>&1
  timeout 120 python3 -m pytest tests/test_attention.py -q -n 4 -k "at_scale" -p no:cacheprovider -p no:warnings \
    >"$OUT/pytest_at_scale.log" 2>&1
  TILEATTN_HYPOTHESIS_SHARDS=2 TILEATTN_HYPOTHESIS_EXAMPLES=4 timeout 240 python3 -m pytest tests -q -n 14 \
    -k "not at_scale" -p no:cacheprovider -p no:warnings >"$OUT/pytest.log" 2>&1
  timeout 60 python3 -m tileattn.bench --headdim 128 --seqlen 1024 2048 4096 8192 16384 --mode fwd \
    --backends tileattn sdpa-cudnn --out "$OUT/fwd128_grid.jsonl" >"$OUT/fwd128_grid.log" 2>&1
  timeout 60 python3 scripts/decode_variants.py --out "$OUT/decode.jsonl" "" >"$OUT/decode.log" 2>&1
  grep -E "^\| hd" "$OUT/fwd128_grid.log"
  grep -E "tileattn \[|sdpa-cudnn " "$OUT/decode.log" | grep "^|"
  grep -E "rounds|compiled" "$OUT/gqa_stress.log"
  tail -2 "$OUT/pytest_at_scale.log"
  tail -4 "$OUT/pytest.log"
  ;;
3)
  timeout 90 python3 -m pytest tests/test_attention.py -q -n 4 -k "at_scale and 128" -p no:cacheprovider \
    -p no:warnings >"$OUT/pytest_at_scale.log" 2>&1
  timeout 90 python3 -m pytest tests/test_attention.py -q -n 14 -k "not at_scale" -p no:cacheprovider \
    -p no:warnings >"$OUT/pytest_attention.log" 2>&1
  timeout 45 python3 -m tileattn.bench --headdim 128 --seqlen 1024 2048 4096 --causal yes --mode fwd \
    --backends tileattn sdpa-cudnn >"$OUT/causal128.log" 2>&1
  grep -E "^\| hd" "$OUT/causal128.log"
  tail -2 "$OUT/pytest_at_scale.log"
  tail -2 "$OUT/pytest_attention.log"
  ;;
4)
  timeout 120 python3 -m pytest tests -q -n 14 -k "dq_atomic or dq-atomic" -p no:cacheprovider -p no:warnings \
    >"$OUT/pytest_dq_atomic.log" 2>&1
  G="--headdim 64 128 256 --seqlen 2048 8192 --mode bwd"
  timeout 70 python3 -m tileattn.bench $G --backends tileattn sdpa-cudnn >"$OUT/bwd_table.log" 2>&1
  for m in 2 1; do
    timeout 70 python3 scripts/features_variant.py dkdv:dq_atomic=$m -- --grid $G --backends tileattn \
      >"$OUT/bwd_dq_atomic$m.log" 2>&1
  done
  for f in bwd_table bwd_dq_atomic2 bwd_dq_atomic1; do
    echo "== $f"
    grep -E "^\| hd" "$OUT/$f.log" | grep tileattn
  done
  tail -2 "$OUT/pytest_dq_atomic.log"
  ;;
*)
  echo "usage: bash scripts/gpu_next.sh 1|2|3|4" >&2
  exit 2
  ;;
esac
