#!/usr/bin/env bash
# FlashAttention-4 (flash_attn.cute) as an anchor on the H200, which has no package registry. The wheels
# are fetched on a machine with pip (see below) and carried in two calls, since the CUTLASS DSL library
# wheel is over one call's carry limit:
#   call 1, carry [".whl/fa4a"]:   bash scripts/gpu_fa4.sh stage
#   call 2 within 30 s, carry [".whl/wheels"]:   bash scripts/gpu_fa4.sh bench
# (`decode` instead of `bench`: the benchmark CLI's decode table, whose fa4 rows then run; with
# THEN="command", that command instead, with FA4 on PYTHONPATH.)
# .whl/fa4a holds the first part of `tar cJ` of the unzipped nvidia-cutlass-dsl-libs-cu13 wheel
# (`split -b 33M`), .whl/wheels the second part and the wheels of flash-attn-4 (pre-release),
# nvidia-cutlass-dsl, nvidia-cutlass-dsl-libs-base/-core, quack-kernels, apache-tvm-ffi and
# torch-c-dlpack-ext (pip download --no-deps --only-binary=:all: --python-version 3.12 ...).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/fa4
case "${1:-}" in
stage)
  cp .whl/fa4a/cu13.part.aa /tmp/fa4/ && ls -la /tmp/fa4
  # optional work for the rest of this call (the machine stays warm for the bench call after it)
  [ -n "${STAGE_THEN:-}" ] && bash -c "$STAGE_THEN"
  ;;
bench|decode)
  [ -f /tmp/fa4/cu13.part.aa ] || { echo "stage first (the machine went cold?)"; exit 2; }
  rm -rf /tmp/site && mkdir -p /tmp/site
  # the wheels first: pip --target --upgrade replaces whole package folders, so the DSL libraries go on top
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/wheels/*.whl || exit 1
  cat /tmp/fa4/cu13.part.aa .whl/wheels/cu13.part.ab | tar xJf - -C /tmp/site || exit 1
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/src PYTHONUNBUFFERED=1
  python3 -c "from flash_attn.cute import flash_attn_func; print('fa4 import ok')" || exit 1
  if [ "$1" = decode ] && [ -n "${THEN:-}" ]; then  # another command that wants FA4, e.g. a decode A/B
    bash -c "$THEN"
    exit
  fi
  if [ "$1" = decode ]; then
    timeout ${BENCH_TIMEOUT:-480} python3 -m tileattn.bench --decode --out "$OUT/bench_decode_fa4.jsonl" \
      > "$OUT/bench_decode_fa4.log" 2>&1
    grep -E "^\| [0-9]" "$OUT/bench_decode_fa4.log" | grep -E "tileattn( paged16| paged256)?( do_bench)? |cudnn|fa4|copy" \
      | cut -c1-80
    exit
  fi
  # VARIANTS="dkdv@256:block_n=32 ...": the tables changed as scripts/features_variant.py changes them
  bench=(-m tileattn.bench)
  [ -n "${VARIANTS:-}" ] && bench=(scripts/features_variant.py $VARIANTS -- --grid)
  timeout ${BENCH_TIMEOUT:-480} python3 "${bench[@]}" --backends tileattn fa4 sdpa-cudnn sdpa-flash \
    --headdim ${HEADDIMS:-128 64} --seqlen ${SEQLENS:-1024 4096 16384} --causal both --mode fwd+bwd \
    --out "$OUT/bench_fa4" 2>&1 | tee "$OUT/bench_fa4.log" | tail -40
  ;;
*)
  echo "usage: bash scripts/gpu_fa4.sh stage|bench|decode"; exit 2
  ;;
esac
