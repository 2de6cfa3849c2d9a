#!/usr/bin/env bash
# The GPU calls of the decode work of 2026-11-30 (docs/perf.md, "Decode: paged pipelines, TMA for
# whole-tile pages, the combine as a dependent launch"), one per argument, each under 10 minutes on one
# H200; outputs under $OUT (the first call ran the GPU tests and decode_variants.py "" "fused=0"
# "pstages=5,lookahead=0" at commit 1d8381d, whose settings are gone). Each run's "" is the defaults of
# its day: TMA for contiguous caches was on in runs 2-3, full grids took three stages in runs 2-6.
# Today's defaults repeat run 3's with "" "tma=1" "ptma=0" "plong=0", run 7's with "fstages=0" first.
#   bash scripts/gpu_decode_runs.sh 7
# 2: GPU tests, then the bench-method rows of TMA reads and deeper pipelines (decode_variants.py);
# 3: GPU tests, interleaved A/B (decode_ab.py) of TMA reads and paged stages;
# 4: GPU tests, A/B of the dependent combine and the TMA settings, compute-sanitizer;
# 5: A/B of paged stages and warps, the call's host time, the benchmark CLI's decode table;
# 6: GPU tests, host time, the A/B rows as set, the CLI's decode table;
# 7: GPU tests with the launcher's direct path, host time, A/B of full-grid stages, memcheck.
# 8, 9 (2026-12-01, the host path): GPU tests and the benchmark CLI's decode table; memcheck and host time.
# 10: GPU tests (with the small-page TMA build's), A/B of decode.PAGED_SMALL_TMA (since removed).
# 11: GPU tests, then the int32 paged offsets against the tree in $BASE (default ab_base: a copy of the
#     source before them, e.g. `git archive 3058b17 src | tar x -C ab_base`), alternating trees, then host time.
# 12: with the int32 offsets, the table read ahead at full grids (with two stages), and small grids'
#     long programs at three stages with the table read ahead instead of five.
# 13: GPU tests (with caches past 2**31 elements), then three trees alternating: this one, ab_mid (this
#     one with SAME_KV_STRIDES off) and ab_base (the source before the int32 offsets).
# 14: GPU tests, the benchmark CLI's decode rows, and the host time twice.
# 15: with the int32 offsets: pages of 256 through pointer loads, seven stages for long paged programs,
#     two waves of splits.
# 16: GPU tests (caches past 2**31 elements, kv heads outermost), then 64-bit offsets forced on every
#     layout (the build a pool of more than 2**31 elements takes) against the int32 ones.
# 17 (2026-12-01, third run): GPU tests (decode, cache manager, reliability: kv heads outermost past
#     2**31 elements), then compute-sanitizer memcheck (with the 64-bit offset and paged TMA builds).
# 18: pages of 16 with the table in pool order against the shuffled table and contiguous caches, and four
#     stages, at the rows where pages of 16 trail.
# 19: the property tests again (fresh examples), then paged caches with 64-key tiles (decode.PAGED_BLOCK_N,
#     removed after it: docs/perf.md).
# 20: the GPU tests of run 17 in one pytest call (tests past 2**31 elements now take turns), then splits
#     of two key tiles and two blocks per SM for the short programs of 1 x 8k.
# 21: paged caches whose input copies share one block table (hot in L2) against a table per copy.
# 22: GPU tests (decode, cache manager, errors), the append step's CUDA-graph time with q rotated in the
#     attention kernel against the tree in $BASE (default ab_base: the source before it), memcheck of the
#     KV-cache kernels, host time of both trees.
# 23: the GPU tests not yet run on the final code of 2026-12-01 (the q-rotating builds at head dim 128,
#     caches past 2**31 elements), then the benchmark CLI's decode rows and the host time.
# 24 (2026-12-01, fourth run): five and seven stages for the short paged programs of 1 x 8k (in the
#     call that stages FlashAttention-4: STAGE_THEN="bash scripts/gpu_decode_runs.sh 24" bash
#     scripts/gpu_fa4.sh stage; then `bash scripts/gpu_fa4.sh decode` times the decode rows with FA4).
# 25: paged caches whose splits read their block-table entries once before the key loop and take each
#     row's page by tl.gather (decode.PAGED_TABLE_SLOTS, "pslots", since removed; pslots=0 is the lookup
#     per tile), at every row.
# 26: FlashAttention-4 and cuDNN in each row of an A/B at the full grids (after the wheels' first call:
#     THEN="bash scripts/gpu_decode_runs.sh 26" bash scripts/gpu_fa4.sh decode): two stages with two
#     blocks per SM for every full-grid program, and TMA reads of contiguous caches.
# 27: splits that take every num_splits-th key tile (decode.DECODE_INTERLEAVE) against runs of
#     consecutive tiles (interleave=0), at the rows with splits.
# 28: GPU tests (decode, cache manager) with interleaved splits for pages smaller than a key tile, then
#     the A/B of run 27 again for paged caches.
# 29: the final code of 2026-12-01's fourth run: the GPU tests that run 28 failed on their plan
#     assertion and the split test, memcheck of the KV-cache kernels, the CLI's decode table.
# 30: interleaved splits at 1 x 8k again, each setting twice under two names (the CLI's pages of 16 read
#     1971 after them against 1997-2005 before, in calls on other machines).
# 31 (2026-12-01, fifth run): GPU tests (decode, cache manager, errors) and memcheck of the KV-cache
#     kernels with masked segments' tiles dealt by tile index (after run 30).
# 32: block-table sectors prefetched into L2 at a program's start (tl2), and short programs' later K/V
#     tiles prefetched into L2 (kvl2: programs of up to that many tiles; kvskip: tiles left to the
#     pipeline; both since removed), at 1 x 8k; then tl2 at the long rows of paged caches.
# 33: key tiles of 64 columns for 1 x 8k's short programs (sbn), at three to five stages; tl2 again.
# 34: key tiles of 32 and 64 columns for 1 x 8k, 64 at two stages, and tl2 with them.
# 35: 64-column tiles for 1 x 8k with paged programs built as long ones (ptiles=1: five stages, the
#     table's reads pipelined by Triton instead of read ahead by hand), seven stages, tl2.
# 36: GPU tests (decode, cache manager) with 64-key tiles for short programs and the table prefetched
#     into L2 as defaults, then both against the builds before them at rows of two to eight tiles per
#     program (rows outside the benchmark's).
# 37: the final code: GPU error tests, memcheck of the KV-cache kernels (their small caches take the
#     64-key tiles and the table prefetch), the CLI's decode table.
# 38: Nsight Compute of 1 x 8k's paged split kernels on the final code, then pages of 16 there without
#     the hand-written table read-ahead, and with two or eight warps.
# 39: pages of 16 with 64-key tiles in runs of consecutive tiles (interleave=0: two tiles' entries share a
#     sector, and the table prefetch covers the row) against interleaved ones.
# 40: after a review: the table prefetch's interleaved indices in int64 and masked below 0; GPU decode
#     tests (with the planning test of short programs) and the prefetch's A/B at 1 x 8k again.
# 41: interleaved splits in runs of two or four consecutive tiles (unit): with 64-key tiles over pages of
#     16 a split's first two tiles then share a table sector; the partition tests on the GPU first.
# 42: runs of two tiles at the long rows of pages of 16 (128-key tiles, interleaved) and at 1 x 8k again.
# 43: GPU tests (decode, cache manager) with runs of two tiles as the default (two property examples
#     failed: an empty segment clamped inside a tile was counted as one tile).
# 44: after that fix: the property tests and the empty-segment test on the GPU.
# 45: GPU tests (decode, cache manager) with runs of two tiles; runs of one against two and the combine's
#     rows per program (crows: 16 / 2 / 1) at the one-wave rows; the CLI's decode table.
# 46: the combine in fewer programs (cvals: values per load 16384 / 32768; cwarps), and short 64-key
#     tiles at two programs per SM (32 splits at 1 x 8k: waves=2,mintiles=2,swaves=2; the cwarps and
#     swaves settings are removed since).
# 47: full grids of paged caches with 64-key tiles and more stages (pfbn, pfstages), the one-wave rows
#     without the hand-written table read-ahead (pra=0; the L2 prefetch kept).
# 48: the block table's sectors prefetched into L1 (tl1=1: prefetch.global.L1) instead of L2, with and
#     without the read-ahead. (The settings of runs 47-48, pfbn, pfstages, pra and tl1, are removed since.)
# 49: on the final code (runs of two tiles, the combine at 16384 values per load): GPU tests (decode,
#     cache manager), the CLI's decode table.
# 50: test_errors, memcheck of the KV-cache kernels, the five rows' A/B against the combine's old loads.
# 51: the eager call's host time, this tree against the one in $BASE (default ab_base: `git archive
#     d11acd4 src | tar x -C ab_base`, carried), alternating twice.
# 52: every decode launch as a programmatic dependent of the kernel ahead (chain=1), back to back, after
#     a torch kernel (the chain broken before each call) and with the append, in the five rows.
# 53: the attention kernel alone as a programmatic dependent (chain=1 after run 52: the combine no longer
#     lets the next call launch, the append is not a dependent), the same layouts at 1 x 8k, 1 x 128k,
#     64 x 4k. (The setting is decode.DECODE_PDL_ATTN since, short name pdlattn, on by default; run 52's
#     chained combine and append are removed.)
# 54: with it on: GPU tests (decode, cache manager, the compiled decode ops, errors), memcheck of the
#     KV-cache kernels, the CLI's decode table.
# 55: the five rows' A/B of the final code against the attention kernel launched plainly (pdlattn=0).
# 56: (owed) the test of inputs rewritten by the kernels right before each call in a CUDA graph, the decode
#     tests again, memcheck.
# 57 (2026-12-01, seventh run): the owed test, then splits planned for fewer or more SMs (sms).
# 58 (2026-12-01, eighth run): 64-key tiles in three blocks per SM (fbn, sms, spt, stiles); lost (the
#     full grids' setting, decode.FULL_GRID_BLOCK_N, short name fbn, is removed since).
# 59: scripts/decode_tail.py, the probe of the grid's shape: a plain K/V stream and its programs' ends.
# 60: the probe ladder (tiles dealt in turn, the online softmax), the graphs' kernels' device times, and
#     runs of consecutive tiles (interleave=0) against tiles dealt in turn at the one-wave rows (only pages
#     smaller than a key tile are dealt in turn: the other layouts run one build under both names).
# 61: the GPU tests of the final code of 2026-12-01's eighth run (the kvcache tests at head dims 59, 96
#     and 111, the cache manager, the bench scripts' settings).
# 62: scripts/decode_pages_probe.py: a shuffled pool of pages of 16 streamed a kv head at a time (the
#     split kernel's pattern) against a whole page for all kv heads at a time.
# 63: the merge in the launch as a cluster: the probe's splits of a kv head launched as one cluster, which
#     sums their partials after a cluster barrier, against the probe without a merge and tileattn.
# 64 (2026-12-02): where the pool's pages lie (tileattn.bench.decode._pool's orders): the benchmark's
#     shuffle, pages in order, as PagedKVCache deals them to sequences growing together (lockstep), and
#     shuffled only within each 2 MiB of the pool, with tileattn's kernels (the call also ran run 65's
#     probe, which failed: its graphs replayed tables that the script had freed, fixed since).
# 65: the same orders for the per-head page probe (scripts/decode_pages_probe.py) at 64 x 4k.
# 66: every decode row and layout against cuDNN in one interleaved A/B (7 rounds), and the bench tests.
# 67: GPU tests after a review's fixes (window sides as wide as the keys unbounded, PagedKVCache's forks
#     appended with their parent, table rows padded with -1), and memcheck of the test whose tables hold
#     -1 and 2**31 - 1 past each sequence's pages.
# 68: GPU tests of a second review's fixes (dropout under graph capture refused, a dropout_p that rounds
#     to 0 refused) and of the varlen references that resolve windows at max_seqlen_k.
set -uo pipefail
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

tests() {  # the decode GPU tests (tests/conftest.py checks every cached launch against Triton's choice)
  local log=$OUT/pytest_${LOG:-kvcache}.log
  timeout "$1" python3 -m pytest "${@:2}" -q -n 8 -rf -p no:cacheprovider -p no:warnings > "$log" 2>&1
  grep -E "^FAILED|passed|failed" "$log" | tail -6
}
ab() {  # interleaved A/B: log name, then decode_ab.py's arguments
  local name=$1
  shift
  timeout "${AB_LIMIT:-150}" python3 scripts/decode_ab.py --out "$OUT/$name.jsonl" "$@" > "$OUT/$name.log" 2>&1
  tail -18 "$OUT/$name.log"
}
host() {
  timeout 60 python3 scripts/host_overhead.py --decode 2>&1 | grep -v -i warn | tee "$OUT/host_decode.log"
}
memcheck() {  # compute-sanitizer memcheck of the KV-cache kernels (scripts/sanitize.py --kvcache)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$1" compute-sanitizer --tool memcheck --print-limit 20 \
    python3 scripts/sanitize.py --kvcache > "$OUT/sanitizer_memcheck.log" 2>&1
  echo "memcheck exit $?"
  grep -E "ERROR SUMMARY|workload done" "$OUT/sanitizer_memcheck.log"
}
cli() {
  timeout 150 python3 -m tileattn.bench --decode --out "$OUT/bench_decode.jsonl" > "$OUT/bench_decode.log" 2>&1
  grep -E "^\| [0-9]" "$OUT/bench_decode.log" | grep -E "tileattn( paged16| paged256)?( do_bench)? |cudnn|copy" \
    | cut -c1-75
}

case "${1:?run number 2-68}" in
  2)
    tests 200 tests/test_kvcache.py
    timeout 320 python3 scripts/decode_variants.py --out "$OUT/decode_variants" "" "tma=0" "stages=4" "ptstages=4" \
      > "$OUT/decode_variants.log" 2>&1
    tail -22 "$OUT/decode_variants.log" ;;
  3) tests 170 tests/test_kvcache.py; ab decode_ab "" "tma=0" "ptma=0" "plong=0" ;;
  4) tests 150 tests/test_kvcache.py; ab decode_ab "" "pdl=0" "tma=1" "ptma=0"; SAN_TIMEOUT=150 bash scripts/gpu_sanitize.sh ;;
  5)
    ab decode_ab_paged --layouts "tileattn paged16" "tileattn paged256" -- "" "plong=7" "pwarps=8" "plong=7,pwarps=8"
    host
    cli ;;
  6) tests 170 tests/test_kvcache.py; host; ab decode_ab --rounds 5 ""; cli ;;
  7)
    tests 170 tests/test_kvcache.py tests/test_cache.py
    host
    ab decode_ab --layouts tileattn -- "" "fstages=2" "fstages=2,ftiles=128"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 140 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 scripts/sanitize.py > "$OUT/sanitizer_memcheck.log" 2>&1
    echo "memcheck exit $?"
    grep -E "ERROR SUMMARY|workload done" "$OUT/sanitizer_memcheck.log" ;;
  8) tests 170 tests/test_kvcache.py tests/test_cache.py; cli ;;
  9)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 scripts/sanitize.py > "$OUT/sanitizer_memcheck.log" 2>&1
    echo "memcheck exit $?"
    grep -E "ERROR SUMMARY|workload done" "$OUT/sanitizer_memcheck.log"
    host; host ;;
  10) echo "run 10's setting (decode.PAGED_SMALL_TMA) was removed after it (docs/perf.md)" >&2; exit 2 ;;
  11)
    tests 170 tests/test_kvcache.py
    for tree in new base new base; do
      src=$PWD/src
      [ "$tree" = base ] && src=$PWD/${BASE:-ab_base}/src
      PYTHONPATH=$src timeout 120 python3 scripts/decode_ab.py --rounds 3 --out "$OUT/decode_ab_$tree.jsonl" \
        --layouts "tileattn paged16" "tileattn paged256" tileattn -- "" > "$OUT/decode_ab_$tree.log" 2>&1
      echo "$tree: $(grep -E '^[0-9]+x' "$OUT/decode_ab_$tree.log" | tr '\n' ';')"
    done
    host ;;
  12) ab decode_ab_prefetch -- "" "pprefetch=100" "pprefetch=100,stages=2" "plong=0" ;;
  13)
    tests 200 tests/test_kvcache.py tests/test_cache.py
    for tree in new mid base new mid base; do
      src=$PWD/src
      [ "$tree" != new ] && src=$PWD/ab_$tree/src
      PYTHONPATH=$src timeout 120 python3 scripts/decode_ab.py --rounds 3 --out "$OUT/decode_ab_$tree.jsonl" \
        --layouts "tileattn paged16" "tileattn paged256" tileattn -- "" > "$OUT/decode_ab_$tree.log" 2>&1
      echo "$tree: $(grep -E '^[0-9]+x' "$OUT/decode_ab_$tree.log" | sed 's/tileattn //; s/: table / /' | tr '\n' ';')"
    done ;;
  14) tests 200 tests/test_kvcache.py tests/test_cache.py; cli; host; host ;;
  15) ab decode_ab_paged2 --layouts "tileattn paged16" "tileattn paged256" -- "" "ptma=0" "plong=7" "waves=2" ;;
  16)
    tests 240 tests/test_kvcache.py tests/test_cache.py
    ab decode_ab_offs64 --rows 1x8192 1x131072 64x4096 -- "" "offs64=1" ;;
  17)
    tests 250 tests/test_kvcache.py tests/test_cache.py
    LOG=reliability tests 250 tests/test_reliability.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 scripts/sanitize.py > "$OUT/sanitizer_memcheck.log" 2>&1
    echo "memcheck exit $?"
    grep -E "ERROR SUMMARY|workload done" "$OUT/sanitizer_memcheck.log" ;;
  18)
    ab decode_ab_order --rows 1x8192 64x4096 64x16384 \
      --layouts "tileattn paged16" "tileattn paged16 in order" tileattn -- "" "stages=4" ;;
  19) echo "run 19's setting (decode.PAGED_BLOCK_N) was removed after it (docs/perf.md)" >&2; exit 2 ;;
  20)
    LOG=all tests 470 tests/test_kvcache.py tests/test_cache.py tests/test_reliability.py
    ab decode_ab_short --rounds 5 --rows 1x8192 -- "" "stages=2" "mintiles=2" "mintiles=2,stages=2,waves=2" \
      "mintiles=2,waves=2" ;;
  21)
    ab decode_ab_table --rows 1x8192 1x131072 64x4096 --layouts "tileattn paged16" "tileattn paged16 shared table" \
      "tileattn paged256" "tileattn paged256 shared table" tileattn -- "" ;;
  22)
    tests 170 tests/test_kvcache.py tests/test_cache.py tests/test_errors.py
    for tree in new base new base; do
      src=$PWD/src
      [ "$tree" = base ] && src=$PWD/${BASE:-ab_base}/src
      echo "$tree: $(PYTHONPATH=$src timeout 40 python3 scripts/decode_append_bench.py 2>&1 | tr '\n' ';')"
    done | tee "$OUT/append_bench.log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 110 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 scripts/sanitize.py --kvcache > "$OUT/sanitizer_memcheck.log" 2>&1
    echo "memcheck exit $?"
    grep -E "ERROR SUMMARY|workload done" "$OUT/sanitizer_memcheck.log"
    for tree in new base; do
      src=$PWD/src
      [ "$tree" = base ] && src=$PWD/${BASE:-ab_base}/src
      PYTHONPATH=$src timeout 50 python3 scripts/host_overhead.py --decode 2>&1 | grep -v -i warn > "$OUT/host_$tree.log"
      echo "$tree host: $(grep -i append "$OUT/host_$tree.log")"
    done ;;
  23)
    tests 300 tests/test_kvcache.py tests/test_cache.py tests/test_errors.py
    cli
    host ;;
  24)
    ab decode_ab_ptiles --rounds 5 --rows 1x8192 --layouts "tileattn paged16" "tileattn paged256" -- "" "ptiles=4" \
      "ptiles=4,plong=7" ;;
  25)
    timeout 450 python3 scripts/decode_ab.py --out "$OUT/decode_ab_slots.jsonl" --layouts "tileattn paged16" \
      "tileattn paged256" -- "pslots=0" "" "pslots=4096" > "$OUT/decode_ab_slots.log" 2>&1
    tail -24 "$OUT/decode_ab_slots.log" ;;
  26)
    timeout 400 python3 scripts/decode_ab.py --out "$OUT/decode_ab_fa4.jsonl" --rows 64x4096 64x16384 --rounds 5 \
      --anchors sdpa-cudnn fa4 -- "" "fstages=2,ftiles=1000" "tma=1" > "$OUT/decode_ab_fa4.log" 2>&1
    tail -24 "$OUT/decode_ab_fa4.log" ;;
  27)
    timeout 400 python3 scripts/decode_ab.py --out "$OUT/decode_ab_interleave.jsonl" --rounds 5 \
      --rows 1x8192 1x131072 8x32768 -- "interleave=0" "" > "$OUT/decode_ab_interleave.log" 2>&1
    tail -14 "$OUT/decode_ab_interleave.log" ;;
  28)
    tests 300 tests/test_kvcache.py tests/test_cache.py
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_interleave2.jsonl" --rounds 5 --rows 1x8192 \
      1x131072 8x32768 --layouts "tileattn paged16" "tileattn paged16 in order" -- "interleave=0" "" \
      > "$OUT/decode_ab_interleave2.log" 2>&1
    tail -7 "$OUT/decode_ab_interleave2.log" ;;
  29)
    tests 200 tests/test_kvcache.py -k "lookup_branches or split_decoding or matches_reference"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 130 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 scripts/sanitize.py --kvcache > "$OUT/sanitizer_memcheck.log" 2>&1
    echo "memcheck exit $?"
    grep -E "ERROR SUMMARY|workload done" "$OUT/sanitizer_memcheck.log"
    cli ;;
  30)
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_interleave3.jsonl" --rounds 8 --rows 1x8192 \
      --layouts "tileattn paged16" "tileattn paged256" -- "" "interleave=0" "interleave=1" "interleave=0,mintiles=4" \
      > "$OUT/decode_ab_interleave3.log" 2>&1
    tail -12 "$OUT/decode_ab_interleave3.log" ;;
  31)
    tests 330 tests/test_kvcache.py tests/test_cache.py tests/test_errors.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 130 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 scripts/sanitize.py --kvcache > "$OUT/sanitizer_memcheck.log" 2>&1
    echo "memcheck exit $?"
    grep -E "ERROR SUMMARY|workload done" "$OUT/sanitizer_memcheck.log" ;;
  32)
    timeout 300 python3 scripts/decode_ab.py --out "$OUT/decode_ab_l2.jsonl" --rounds 6 --rows 1x8192 \
      -- "tl2=0" "" "kvl2=8" "kvl2=8,kvskip=0" > "$OUT/decode_ab_l2.log" 2>&1
    tail -12 "$OUT/decode_ab_l2.log"
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_l2long.jsonl" --rounds 4 --rows 1x131072 8x32768 \
      --layouts "tileattn paged16" "tileattn paged256" -- "tl2=0" "" > "$OUT/decode_ab_l2long.log" 2>&1
    tail -8 "$OUT/decode_ab_l2long.log" ;;
  33)
    timeout 300 python3 scripts/decode_ab.py --out "$OUT/decode_ab_short.jsonl" --rounds 6 --rows 1x8192 \
      -- "" "tl2=0" "sbn=64" "sbn=64,stages=4" "sbn=64,stages=5" > "$OUT/decode_ab_short.log" 2>&1
    tail -19 "$OUT/decode_ab_short.log" ;;
  34)
    timeout 300 python3 scripts/decode_ab.py --out "$OUT/decode_ab_short2.jsonl" --rounds 8 --rows 1x8192 \
      -- "sbn=64" "sbn=64,tl2=0" "sbn=32" "sbn=64,stages=2" "" > "$OUT/decode_ab_short2.log" 2>&1
    tail -19 "$OUT/decode_ab_short2.log" ;;
  35)
    timeout 300 python3 scripts/decode_ab.py --out "$OUT/decode_ab_short3.jsonl" --rounds 8 --rows 1x8192 \
      -- "sbn=64" "sbn=64,ptiles=1" "sbn=64,ptiles=1,plong=7" "sbn=64,ptiles=1,tl2=0" "" \
      > "$OUT/decode_ab_short3.log" 2>&1
    tail -19 "$OUT/decode_ab_short3.log" ;;
  36)
    tests 300 tests/test_kvcache.py tests/test_cache.py
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_short4.jsonl" --rounds 5 \
      --rows 1x8192 1x16384 2x8192 4x4096 2x4096 -- "" "sbn=0" "sbn=0,tl2=0" > "$OUT/decode_ab_short4.log" 2>&1
    tail -22 "$OUT/decode_ab_short4.log" ;;
  37)
    LOG=errors tests 150 tests/test_errors.py
    memcheck 150
    cli ;;
  38)
    bash scripts/ncu_decode.sh 1 8192 "tileattn paged16" "tileattn paged256" | grep -E "ncu exit|Duration|DRAM Thr"
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_short5.jsonl" --rounds 8 --rows 1x8192 \
      --layouts "tileattn paged16" "tileattn paged256" -- "" "pprefetch=0" "pwarps=8" "pwarps=2" \
      > "$OUT/decode_ab_short5.log" 2>&1
    tail -12 "$OUT/decode_ab_short5.log" ;;
  39)
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_short6.jsonl" --rounds 8 --rows 1x8192 2x4096 \
      --layouts "tileattn paged16" "tileattn" -- "" "interleave=0" > "$OUT/decode_ab_short6.log" 2>&1
    tail -8 "$OUT/decode_ab_short6.log" ;;
  40)
    tests 250 tests/test_kvcache.py
    timeout 150 python3 scripts/decode_ab.py --out "$OUT/decode_ab_l2b.jsonl" --rounds 6 --rows 1x8192 \
      --layouts "tileattn paged16" "tileattn paged256" -- "" "tl2=0" > "$OUT/decode_ab_l2b.log" 2>&1
    tail -8 "$OUT/decode_ab_l2b.log" ;;
  41)
    tests 120 tests/test_kvcache.py -k "partition or gpu_plans or lookup_branches"
    timeout 150 python3 scripts/decode_ab.py --out "$OUT/decode_ab_unit.jsonl" --rounds 8 --rows 1x8192 2x4096 \
      --layouts "tileattn paged16" -- "" "unit=2" "unit=4" > "$OUT/decode_ab_unit.log" 2>&1
    tail -6 "$OUT/decode_ab_unit.log" ;;
  42)
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_unit2.jsonl" --rounds 4 \
      --rows 1x8192 1x131072 8x32768 --layouts "tileattn paged16" -- "" "unit=2" > "$OUT/decode_ab_unit2.log" 2>&1
    tail -5 "$OUT/decode_ab_unit2.log" ;;
  43) tests 200 tests/test_kvcache.py tests/test_cache.py ;;
  44) tests 75 tests/test_kvcache.py -k "property_random_kvcache or skip_empty or partition" ;;
  45)
    tests 220 tests/test_kvcache.py tests/test_cache.py
    timeout 180 python3 scripts/decode_ab.py --out "$OUT/decode_ab_crows.jsonl" --rounds 6 \
      --rows 1x8192 2x4096 1x131072 -- "" "unit=1" "crows=2" "crows=1" > "$OUT/decode_ab_crows.log" 2>&1
    tail -16 "$OUT/decode_ab_crows.log"
    cli ;;
  46)
    timeout 300 python3 scripts/decode_ab.py --out "$OUT/decode_ab_cvals.jsonl" --rounds 6 \
      --rows 1x8192 2x4096 1x131072 -- "" "cvals=16384" "cvals=32768" "cvals=16384,cwarps=8" \
      "waves=2,mintiles=2,swaves=2" > "$OUT/decode_ab_cvals.log" 2>&1
    tail -19 "$OUT/decode_ab_cvals.log" ;;
  47)
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_pfull.jsonl" --rounds 5 --rows 64x4096 64x16384 \
      --layouts "tileattn paged16" "tileattn paged256" -- "" "pfbn=64" "pfbn=64,pfstages=5" "pfbn=64,pfstages=4" \
      "pfstages=4" > "$OUT/decode_ab_pfull.log" 2>&1
    tail -13 "$OUT/decode_ab_pfull.log"
    timeout 150 python3 scripts/decode_ab.py --out "$OUT/decode_ab_pra.jsonl" --rounds 6 --rows 1x8192 2x4096 \
      --layouts "tileattn paged16" "tileattn paged256" -- "" "pra=0" > "$OUT/decode_ab_pra.log" 2>&1
    tail -7 "$OUT/decode_ab_pra.log" ;;
  48)
    timeout 250 python3 scripts/decode_ab.py --out "$OUT/decode_ab_tl1.jsonl" --rounds 6 \
      --rows 1x8192 2x4096 1x131072 8x32768 --layouts "tileattn paged16" "tileattn paged256" \
      -- "" "tl1=1" "tl1=1,pra=0" > "$OUT/decode_ab_tl1.log" 2>&1
    tail -10 "$OUT/decode_ab_tl1.log" ;;
  49)
    tests 240 tests/test_kvcache.py tests/test_cache.py
    cli ;;
  50)
    LOG=errors tests 150 tests/test_errors.py
    memcheck 150
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_final.jsonl" --rounds 5 \
      -- "" "cvals=8192" > "$OUT/decode_ab_final.log" 2>&1
    tail -9 "$OUT/decode_ab_final.log" ;;
  51)
    for t in "${BASE:-ab_base}/src" src "${BASE:-ab_base}/src" src; do
      echo "== $t"
      PYTHONPATH=$PWD/$t timeout 100 python3 scripts/host_overhead.py --decode 2>&1 | grep "decode 1x8k"
    done ;;
  52)
    timeout 400 python3 scripts/decode_ab.py --out "$OUT/decode_ab_chain.jsonl" --rounds 5 --layouts tileattn \
      "tileattn paged16" "tileattn paged256" "tileattn after a kernel" "tileattn paged16 after a kernel" \
      "tileattn append" "tileattn paged16 append" -- "" "chain=1" > "$OUT/decode_ab_chain.log" 2>&1
    tail -23 "$OUT/decode_ab_chain.log" ;;
  53)
    timeout 300 python3 scripts/decode_ab.py --out "$OUT/decode_ab_chain2.jsonl" --rounds 6 --layouts tileattn \
      "tileattn paged16" "tileattn paged256" "tileattn after a kernel" "tileattn paged16 after a kernel" \
      "tileattn append" "tileattn paged16 append" --rows 1x8192 1x131072 64x4096 -- "" "pdlattn=1" \
      > "$OUT/decode_ab_chain2.log" 2>&1
    tail -23 "$OUT/decode_ab_chain2.log" ;;
  54)
    tests 240 tests/test_kvcache.py tests/test_cache.py tests/test_compile.py -k "not graph_break"
    LOG=errors tests 100 tests/test_errors.py
    memcheck 120
    cli ;;
  55)
    timeout 200 python3 scripts/decode_ab.py --out "$OUT/decode_ab_final2.jsonl" --rounds 5 -- "" "pdlattn=0" \
      > "$OUT/decode_ab_final2.log" 2>&1
    tail -10 "$OUT/decode_ab_final2.log" ;;
  56)
    tests 60 tests/test_kvcache.py -k inputs_written
    tests 240 tests/test_kvcache.py tests/test_cache.py
    memcheck 120 ;;
  57)  # does a one-wave grid's speed follow its program count? (16 splits: 128 programs at 1 x 128k)
    tests 60 tests/test_kvcache.py -k inputs_written
    ab sms --rounds 5 --layouts tileattn "tileattn paged16" --rows 1x8192 1x131072 -- "" "sms=120" "sms=112" \
      "sms=136" ;;
  58)  # 64-key tiles in more blocks per SM: 192 KiB in flight per SM where the builds now keep 128 KiB
    # full grids: three blocks per SM, two tiles in flight each (paged: the table read ahead), or two of three
    AB_LIMIT=240 ab fullbn --rounds 5 --rows 64x4096 64x16384 -- "" "fbn=64,pprefetch=100,fstages=3" \
      "fbn=64,pprefetch=100,fstages=4,stages=4"
    # one-wave grids: splits for three (two) resident blocks per SM of 64-key tiles, the table read ahead
    AB_LIMIT=240 ab smallbn --rounds 5 --rows 1x131072 8x32768 -- "" "sms=396,plong=0,spt=1000,stiles=1000" \
      "sms=264,plong=0,spt=1000,stiles=1000" "sms=264,plong=0,spt=1000,stiles=1000,stages=4" ;;
  59)  # a probe of the grid's shape: a plain K/V stream, its programs' end times (scripts/decode_tail.py)
    timeout 240 python3 scripts/decode_tail.py --rows 1x131072 8x32768 --splits 0 48 --block-n 128 64 \
      --out "$OUT/tail.jsonl" > "$OUT/tail.log" 2>&1
    tail -14 "$OUT/tail.log" ;;
  60)  # the probe ladder: tiles dealt in turn and the online softmax, each graph's kernels' device times
    timeout 300 python3 scripts/decode_tail.py --rows 1x131072 8x32768 --splits 0 --block-n 128 --profile \
      --kinds plain interleave softmax softmax+interleave --out "$OUT/tail.jsonl" > "$OUT/tail.log" 2>&1
    tail -40 "$OUT/tail.log"
    AB_LIMIT=200 ab interleave --rounds 5 --rows 1x131072 8x32768 -- "" "interleave=0" ;;
  61)  # the decode tests on the GPU, with those added since run 57
    tests 420 tests/test_kvcache.py tests/test_cache.py tests/test_bench.py ;;
  62)  # whole pages for all kv heads against a kv head at a time (scripts/decode_pages_probe.py)
    timeout 400 python3 scripts/decode_pages_probe.py --rows 64x4096 64x16384 1x131072 --stages 2 3 \
      --out "$OUT/pages.jsonl" > "$OUT/pages.log" 2>&1
    tail -30 "$OUT/pages.log" ;;
  63)  # splits as clusters that merge after a cluster barrier (scripts/decode_tail.py --kinds cluster)
    timeout 240 python3 scripts/decode_tail.py --rows 1x131072 8x32768 1x8192 --splits 0 --block-n 128 \
      --kinds plain cluster interleave cluster+interleave --out "$OUT/tail.jsonl" > "$OUT/tail.log" 2>&1
    echo "exit $?"; tail -24 "$OUT/tail.log" ;;
  64)  # is the shuffled pool's cost the spread of its pages over the pool (translation) or their order?
    AB_LIMIT=380 ab placement --rounds 5 --rows 64x4096 64x16384 1x131072 --layouts "tileattn" \
      "tileattn paged16" "tileattn paged16 in order" "tileattn paged16 lockstep" "tileattn paged16 shuffled in 2 MiB" \
      "tileattn paged256" "tileattn paged256 in order" "tileattn paged256 lockstep" -- "" ;;
  65)  # the per-head page probe over the same orders
    timeout 150 python3 scripts/decode_pages_probe.py --rows 64x4096 --stages 3 --packed 0 \
      --orders shuffled "in order" lockstep 64 --out "$OUT/pages.jsonl" > "$OUT/pages.log" 2>&1
    tail -12 "$OUT/pages.log" ;;
  66)  # the closing table: each row and layout with cuDNN's graph in the same rounds
    AB_LIMIT=300 ab final --rounds 7 -- ""
    tests 120 tests/test_bench.py ;;
  67)  # the review's fixes on the GPU
    tests 330 tests/test_kvcache.py tests/test_cache.py tests/test_errors.py
    LOG=window tests 120 tests/test_attention.py tests/test_varlen.py -k window
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider tests/test_kvcache.py -k not_read > "$OUT/sanitizer_table.log" 2>&1
    echo "memcheck exit $?"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer_table.log" | tail -4 ;;
  68)  # the second review's fixes on the GPU
    LOG=dropout tests 200 tests/test_dropout.py tests/test_errors.py
    LOG=varlen tests 300 tests/test_varlen.py tests/test_reliability.py -k "varlen or property or window" ;;
  *) echo "runs 2-68" >&2; exit 2 ;;
esac
