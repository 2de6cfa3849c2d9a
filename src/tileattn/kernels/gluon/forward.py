"""The Hopper forward in Gluon: FlashAttention-3's warp-specialized design.

A persistent grid (one program per SM) walks the work items, 128-row query tiles of one head each (192
rows with three consumers) in ``schedule``'s order, each over the key tiles its rows see
(a sliding window's start at the first row's first key). A program has three partitions:
- a loader warp streams each item's Q by TMA, and its K/V tiles through a ``STAGES``-deep ring of
  shared-memory buffers (``k_ready``/``v_ready`` mbarriers say a stage is filled, ``k_free``/``v_free``
  that every consumer is done with it; ``q_ready``/``q_free`` the same for Q, so the next item's Q
  loads while the consumers finish the last one's P·V and write its output);
- two consumer warpgroups own 64 query rows each (the default partition and one worker; ``block_m=192``:
  three, at 160 registers instead of 240, FlashAttention-3's head-dim-64 build). Each runs the
  online softmax over the same K/V tiles with asynchronous wgmma: Q·Kᵀ from shared memory, P·V with P
  in registers (the accumulator layout of S is the A-operand layout of P·V, so P never leaves
  registers). A warpgroup issues Q·Kᵀ of tile j together with P·V of tile j - 1 and runs the softmax of
  tile j while P·V is still on the tensor cores (FlashAttention-3's intra-warpgroup pipelining); the
  warpgroups' softmaxes fall under each other's matmuls by the warp scheduler (an explicit ping-pong
  through mbarriers measured slower: docs/perf.md).

Only what the portable kernel's plain path does is here: (batch, seqlen, nheads, headdim) tensors
whose rows TMA can read as one 2-D matrix, or packed batches (varlen: ``(total, nheads, headdim)``,
sequence b's rows from cu_seqlens[b], the grid covering the longest sequence; a tile's rows past its
sequence are the next one's, which the scores mask and the stores skip), bf16/fp16, head dims 64, 96,
128 and 256, causal or not, sliding windows, GQA/MQA; ``eligible`` says when. Head dim 96 runs as two
column parts, 64 + 32 (Gluon's shapes are powers of two): two TMA tiles per tensor, Q·Kᵀ as two
accumulating wgmmas, P·V into two accumulators, so no column is computed for nothing (the portable
kernels pad it to 128). FP8 inputs (e4m3 with descales, head dims 64, 128 and 256) run both matmuls on
FP8 wgmma: V through a transposed copy made per call (FP8 wgmma reads its B operand key-major only), P
at 2**8 times its value in e4m3 through shared memory, the output bf16, as the portable FP8 forward. The
settings (``configs.HOPPER.fwd_gluon``, ``fwd_gluon_fp8``, ``gluon_min_seqlen_k``: ``configs.gluon_fwd_config``)
choose which calls the public API runs here. Everything else runs the portable kernels (``kernels.forward``). Gluon kernels do not run in
Triton's interpreter: they are tested on the GPU (tests/kernels/test_gluon_forward.py), their builds
without one (test_sm90_builds.py), their scalar logic on CPU (test_gluon_on_cpu.py).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tileattn.kernels.common import transposed_v, transposed_v_buffer
from tileattn.kernels.gluon import schedule
from tileattn.kernels.gluon.common import (
    LOG2E,
    TmaRows,
    exp2_mixed,
    plain_attention,
    rebased,
    start,
    tile_layout,
    tma_rows,
    turn_pass,
    turn_wait,
)
from tileattn.kernels.launch import Launch, Launcher
from tileattn.params import AttnParams, cdiv

LN2 = gl.constexpr(0.6931471805599453)
LOG2E_K = gl.constexpr(LOG2E)  # (the kernels read constexpr globals only)

WG_ROWS = 64  # query rows per consumer warpgroup (the wgmma M of one warpgroup)
BLOCK_MS = (128, 192)  # a work item's query rows: two or three consumer warpgroups
HEAD_DIMS = (64, 96, 128, 256)
# Gluon's tensors have power-of-two shapes: a head dim of 96 runs as two column parts, 64 + 32 (two TMA
# tiles and shared buffers per tensor, Q·Kᵀ as two accumulating wgmmas, P·V into two accumulators).
HEAD_PARTS = {64: (64, 0), 96: (64, 32), 128: (128, 0), 256: (256, 0)}
FP8_HEAD_DIMS = (64, 128, 256)  # FP8 (e4m3 q, k, v with descales): one column part
ONE_PER_TILE = 2**31 - 1  # ``programs`` for a grid of one program per work item


@gluon.jit
def _load(args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr, SPLIT: gl.constexpr,
          IS_FP8: gl.constexpr):  # fmt: skip
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, k_free, v_free,
     Out, Lse, CuQ, CuK, Sink, stride_ob, stride_om, stride_oh, stride_lb, stride_lh, stride_lse,
     nheads, group, batch, head_group, snake, max_q, max_k, window_left, window_right, qk_scale, q_lay, k_lay, v_lay,
     q2_desc, k2_desc, v2_desc, q2_smem, k2_smem, v2_smem, Descales, p_smem) = args  # fmt: skip
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    CONSUMERS: gl.constexpr = q_smem.type.shape[0]
    ITEM: gl.constexpr = CONSUMERS * ROWS  # a work item's query rows
    D0: gl.constexpr = q_desc.block_type.shape[1]  # (SPLIT: the second column part starts here)
    Q_BYTES: gl.constexpr = q_desc.block_type.nbytes + (q2_desc.block_type.nbytes if SPLIT else 0)
    K_BYTES: gl.constexpr = k_desc.block_type.nbytes + (k2_desc.block_type.nbytes if SPLIT else 0)
    V_BYTES: gl.constexpr = v_desc.block_type.nbytes + (v2_desc.block_type.nbytes if SPLIT else 0)
    num_m = gl.cdiv(max_q, ITEM)
    it = 0  # K/V tiles loaded so far: the ring's stage and phase
    done = 0  # work items so far: Q's phase
    for t in range(gl.program_id(0), num_m * nheads * batch, gl.num_programs(0)):
        q_base, h, b, q0, seqlen_q, k0, _, lo, n_tiles = schedule.work_item(
            t, num_m, nheads, batch, head_group, snake, max_q, max_k, CuQ, CuK, window_left, window_right, ITEM,
            BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN,
        )  # fmt: skip
        if schedule.live(q_base, seqlen_q, VARLEN):
            mbarrier.wait(q_free, (done & 1) ^ 1)  # every consumer issued its last Q·Kᵀ of the last item
            mbarrier.expect(q_ready, CONSUMERS * Q_BYTES)
            q_row, q_col = start(b, q0, h, q_lay, VARLEN)
            for wg in gl.static_range(CONSUMERS):  # each consumer warpgroup's ROWS rows
                tma.async_copy_global_to_shared(q_desc, [q_row + q_base + wg * ROWS, q_col], q_ready, q_smem.index(wg))
                if SPLIT:
                    tma.async_copy_global_to_shared(
                        q2_desc, [q_row + q_base + wg * ROWS, q_col + D0], q_ready, q2_smem.index(wg)
                    )
            k_row, k_col = start(b, k0, h // group, k_lay, VARLEN)
            if IS_FP8:  # V transposed: rows (batch entry, kv head, head dim), a sequence's keys along the columns
                v_row, v_col = start(b, 0, h // group, v_lay, VARLEN)
                if VARLEN:
                    v_col += k0
            else:
                v_row, v_col = start(b, k0, h // group, v_lay, VARLEN)
            for j in range(n_tiles):
                s = it % STAGES
                phase = (it // STAGES) & 1
                key = (lo + j) * BLOCK_N
                mbarrier.wait(k_free.index(s), phase ^ 1)  # every consumer is done with the stage's last K
                mbarrier.expect(k_ready.index(s), K_BYTES)
                tma.async_copy_global_to_shared(k_desc, [k_row + key, k_col], k_ready.index(s), k_smem.index(s))
                if SPLIT:
                    tma.async_copy_global_to_shared(
                        k2_desc, [k_row + key, k_col + D0], k_ready.index(s), k2_smem.index(s)
                    )
                mbarrier.wait(v_free.index(s), phase ^ 1)
                mbarrier.expect(v_ready.index(s), V_BYTES)
                if IS_FP8:
                    tma.async_copy_global_to_shared(v_desc, [v_row, v_col + key], v_ready.index(s), v_smem.index(s))
                else:
                    tma.async_copy_global_to_shared(v_desc, [v_row + key, v_col], v_ready.index(s), v_smem.index(s))
                if SPLIT:
                    tma.async_copy_global_to_shared(
                        v2_desc, [v_row + key, v_col + D0], v_ready.index(s), v2_smem.index(s)
                    )
                it += 1
            done += 1


@gluon.jit
def _scores(s_acc, j, first_row, rows, bounds, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
            MASK_RIGHT: gl.constexpr, MODE: gl.constexpr = 0):  # fmt: skip
    """Raw scores of key tile j, -inf where a key is past the sequence or outside the row's window (bounds:
    ``(seqlen_q, seqlen_k, window_left, window_right)``): row i sees key k iff ``i + shift - window_left
    <= k <= i + shift + window_right`` (the sides MASK_LEFT and MASK_RIGHT bound; causal: window_right 0),
    bottom-right aligned as flash_attn's (shift = seqlen_k - seqlen_q). MODE 0: the mask where the tile
    needs one (a branch); 1: the mask, without the branch; 2: none (the caller knows the tile needs none:
    ``_mask_phases``)."""
    seqlen_q, seqlen_k, window_left, window_right = bounds
    s = s_acc
    ROWS: gl.constexpr = s_acc.type.shape[0]
    start = j * BLOCK_N
    shift = seqlen_k - seqlen_q
    need = MODE == 1  # (MODE 1 and 2: a constant)
    # MODE 0: the tile needs a mask where it crosses the key tail, the first row's last key or the last row's first
    if MODE == 0:
        need = start + BLOCK_N > seqlen_k
        if MASK_RIGHT:
            need = need | (start + BLOCK_N - 1 > first_row + shift + window_right)
        if MASK_LEFT:
            need = need | (start < first_row + ROWS - 1 + shift - window_left)
    if need:
        key = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_acc.type.layout))
        hidden = key[None, :] >= seqlen_k
        if MASK_RIGHT:
            hidden = hidden | (key[None, :] > rows[:, None] + (shift + window_right))
        if MASK_LEFT:
            hidden = hidden | (key[None, :] < rows[:, None] + (shift - window_left))
        s = gl.where(hidden, float("-inf"), s)
    return s


@gluon.jit
def _mask_phases(lo, n_tiles, first_row, bounds, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):  # fmt: skip
    """Where a warpgroup's key loop (tiles 1 .. n_tiles - 1 of a work item, tile 0 at key tile ``lo``) needs
    no mask: tiles ``[a, b)``. Before a, a tile holds keys left of the last row's window (MASK_LEFT); from
    b, keys right of the first row's (MASK_RIGHT) or past the sequence. ``_scores``' ``need`` is False
    exactly on ``[a, b)``: it needs start >= L and start + BLOCK_N <= R below."""
    seqlen_q, seqlen_k, window_left, window_right = bounds
    shift = seqlen_k - seqlen_q
    a = 1
    if MASK_LEFT:  # the first tile whose keys all lie at or right of the last row's first key, L
        left = gl.maximum(first_row + ROWS - 1 + shift - window_left, 0)
        a = gl.maximum(gl.cdiv(left, BLOCK_N) - lo, 1)
    right = seqlen_k  # R: one past the first row's last key
    if MASK_RIGHT:
        right = gl.minimum(right, gl.maximum(first_row + shift + window_right + 1, 0))
    a = gl.minimum(a, n_tiles)
    b = gl.minimum(gl.maximum(right // BLOCK_N - lo, a), n_tiles)
    return a, b


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, P_LOG2: gl.constexpr = 0, POLY: gl.constexpr = 0):
    """One online-softmax step on raw scores: (p, alpha, m, l), m in raw units; the scale folds into one
    FMA per score (exp2(s * scale - m * scale)). Rows that saw no key yet keep m = -inf and give p = 0,
    alpha = 0. P_LOG2 (FP8): p and l at 2**P_LOG2 times their value, so that p rounded to e4m3 keeps small
    probabilities above its subnormals (the portable kernels' ``common.online_softmax``). POLY of every 8
    scores of a thread take p's exponential from a polynomial on the FMA units (``exp2_mixed``)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_scaled = gl.where(m_new == float("-inf"), 0.0, m_new * qk_scale)
    alpha = gl.exp2(m_i * qk_scale - m_scaled)
    if P_LOG2 != 0:
        m_scaled = m_scaled - P_LOG2
    p = exp2_mixed(s * qk_scale - m_scaled[:, None], POLY)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _v_operand(v_tile, IS_FP8: gl.constexpr):
    """P·V's B operand: a V tile ``[BLOCK_N, HEAD_DIM]``, or with FP8 a tile of V transposed ``[HEAD_DIM,
    BLOCK_N]`` viewed as ``[BLOCK_N, HEAD_DIM]`` (FP8 wgmma reads B key-major only)."""
    if IS_FP8:
        v_tile = v_tile.permute((1, 0))
    return v_tile


@gluon.jit
def _pv_wait(acc, acc2, p_op, SPLIT: gl.constexpr, IS_FP8: gl.constexpr):
    """``(acc, acc2)`` once the running P·V is done, its operands held until then (SPLIT: both
    accumulators; FP8: P in shared memory, nothing in registers to keep; else ``acc2`` passes through)."""
    if SPLIT:
        acc, acc2, p_op = warpgroup_mma_wait(0, deps=(acc, acc2, p_op))
    elif IS_FP8:
        acc = warpgroup_mma_wait(0, deps=(acc,))
    else:
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    return acc, acc2


@gluon.jit
def _p_operand(p, p_smem, dtype: gl.constexpr, p_layout: gl.constexpr, IS_FP8: gl.constexpr):
    """P·V's A operand: p in registers, or with FP8 in this warpgroup's shared buffer (Triton 3.6 cannot
    keep an 8-bit register operand alive across a wgmma wait), written once the last P·V has read it."""
    if IS_FP8:
        p_smem.store(p.to(dtype))
        fence_async_shared()  # (the generic proxy's writes, seen by the wgmma's async proxy)
        p_op = p_smem
    else:
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return p_op


@gluon.jit
def _consume(
    args,
    MASK_LEFT: gl.constexpr,
    MASK_RIGHT: gl.constexpr,
    VARLEN: gl.constexpr,
    HAS_SINK: gl.constexpr,
    SPLIT: gl.constexpr,
    PINGPONG: gl.constexpr,
    MASK_LOOPS: gl.constexpr,
    IS_FP8: gl.constexpr,
    WG: gl.constexpr,
    EXP2_POLY: gl.constexpr,
):
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, k_free, v_free,
     Out, Lse, CuQ, CuK, Sink, stride_ob, stride_om, stride_oh, stride_lb, stride_lh, stride_lse,
     nheads, group, batch, head_group, snake, max_q, max_k, window_left, window_right, qk_scale, q_lay, k_lay, v_lay,
     q2_desc, k2_desc, v2_desc, q2_smem, k2_smem, v2_smem, Descales, p_smem) = args  # fmt: skip
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]  # (SPLIT: the first column part's, D1 the second's)
    D1: gl.constexpr = q2_desc.block_type.shape[1] if SPLIT else 16  # (16: a placeholder, unused)
    PV_OPS: gl.constexpr = 2 if SPLIT else 1  # the wgmmas of one P·V
    ITEM: gl.constexpr = q_smem.type.shape[0] * ROWS  # a work item's query rows
    dtype: gl.constexpr = q_desc.dtype  # (P·V's: e4m3 with FP8 inputs)
    out_dtype: gl.constexpr = gl.bfloat16 if IS_FP8 else dtype
    P_LOG2: gl.constexpr = 8 if IS_FP8 else 0  # (FP8: p at 2**8 times its value, as the portable kernels)
    K_STEP: gl.constexpr = 32 if IS_FP8 else 16  # (a wgmma's K: 32 bytes of the inputs)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, K_STEP]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, K_STEP]
    )
    o2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D1, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if IS_FP8 else 2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o2_rows: gl.constexpr = gl.SliceLayout(1, o2_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(WG)
    q2 = q2_smem.index(WG)
    p_smem = p_smem.index(WG)  # (FP8: this warpgroup's P)
    num_m = gl.cdiv(max_q, ITEM)
    it = 0  # K/V tiles consumed so far: the ring's stage and phase
    done = 0
    if WG == 1:  # (PINGPONG: the first turn is the first warpgroup's)
        turn_pass(WG, PINGPONG)
    for t in range(gl.program_id(0), num_m * nheads * batch, gl.num_programs(0)):
        q_base, h, b, q0, seqlen_q, k0, seqlen_k, lo, n_tiles = schedule.work_item(
            t, num_m, nheads, batch, head_group, snake, max_q, max_k, CuQ, CuK, window_left, window_right, ITEM,
            BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN,
        )  # fmt: skip
        if schedule.live(q_base, seqlen_q, VARLEN):
            scale = qk_scale
            if IS_FP8:  # Descales: (3, batch, nheads_k), q's, k's and v's; q·k's fold into the scale
                per_input = batch * (nheads // group)
                d_base = Descales + b * (nheads // group) + h // group
                scale = qk_scale * gl.load(d_base) * gl.load(d_base + per_input)
                v_descale = gl.load(d_base + 2 * per_input)
            first_row = q_base + WG * ROWS  # this warpgroup's first query position
            bounds = (seqlen_q, seqlen_k, window_left, window_right)
            rows = first_row + gl.arange(0, ROWS, layout=s_rows)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=s_rows)
            l_i = gl.zeros([ROWS], gl.float32, layout=s_rows)
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            if SPLIT:
                acc2 = gl.zeros([ROWS, D1], gl.float32, layout=o2_layout)
            else:
                acc2 = acc  # (a placeholder: one column part has no second accumulator)
            mbarrier.wait(q_ready, done & 1)
            # Q·Kᵀ of tile j is issued with P·V of tile j - 1; the softmax of tile j runs while P·V does
            if n_tiles > 0:
                cur = it % STAGES
                mbarrier.wait(k_ready.index(cur), (it // STAGES) & 1)
                turn_wait(WG, PINGPONG)
                s_acc = warpgroup_mma(q, k_smem.index(cur).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                if SPLIT:
                    s_acc = warpgroup_mma(q2, k2_smem.index(cur).permute((1, 0)), s_acc, is_async=True)
                turn_pass(WG, PINGPONG)
                s_acc = warpgroup_mma_wait(0, deps=(s_acc,))
                mbarrier.arrive(k_free.index(cur), count=1)
                mbarrier.arrive(q_free, count=1, pred=n_tiles == 1)
                s = _scores(s_acc, lo, first_row, rows, bounds, BLOCK_N, MASK_LEFT, MASK_RIGHT)
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, scale, P_LOG2, EXP2_POLY)
                # MASK_LOOPS: the key loop in three loops, tiles that need a mask (branch-free), those that need
                # none (no mask code), and those that do, so that no branch splits the loop body: ptxas then
                # schedules part of the softmax before the P·V wait. Else one loop, the mask behind a branch.
                edges = (1, n_tiles)  # the loops' first tiles, and one past the last's last
                if MASK_LOOPS:
                    a, b_ = _mask_phases(lo, n_tiles, first_row, bounds, ROWS, BLOCK_N, MASK_LEFT, MASK_RIGHT)
                    edges = (1, a, b_, n_tiles)
                for phase in gl.static_range(len(edges) - 1):
                    for j in range(edges[phase], edges[phase + 1]):
                        prev = (it + j - 1) % STAGES
                        cur = (it + j) % STAGES
                        mbarrier.wait(k_ready.index(cur), ((it + j) // STAGES) & 1)
                        mbarrier.wait(v_ready.index(prev), ((it + j - 1) // STAGES) & 1)
                        p_op = _p_operand(p, p_smem, dtype, p_layout, IS_FP8)
                        turn_wait(WG, PINGPONG)
                        s_acc = warpgroup_mma(
                            q, k_smem.index(cur).permute((1, 0)), s_zero, use_acc=False, is_async=True
                        )
                        if SPLIT:
                            s_acc = warpgroup_mma(q2, k2_smem.index(cur).permute((1, 0)), s_acc, is_async=True)
                        acc = warpgroup_mma(p_op, _v_operand(v_smem.index(prev), IS_FP8), acc, is_async=True)
                        if SPLIT:
                            acc2 = warpgroup_mma(p_op, v2_smem.index(prev), acc2, is_async=True)
                        turn_pass(WG, PINGPONG)
                        # Q·Kᵀ of tile j done, P·V of j - 1 running
                        s_acc = warpgroup_mma_wait(PV_OPS, deps=(s_acc,))
                        mbarrier.arrive(k_free.index(cur), count=1)
                        mbarrier.arrive(q_free, count=1, pred=j == n_tiles - 1)
                        s = _scores(
                            s_acc, lo + j, first_row, rows, bounds, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                            (2 if phase == 1 else 1) if MASK_LOOPS else 0,
                        )  # fmt: skip
                        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, scale, P_LOG2, EXP2_POLY)
                        acc, acc2 = _pv_wait(acc, acc2, p_op, SPLIT, IS_FP8)
                        if SPLIT:
                            acc2 = acc2 * gl.convert_layout(alpha, o2_rows)[:, None]
                        mbarrier.arrive(v_free.index(prev), count=1)
                        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                last = (it + n_tiles - 1) % STAGES
                mbarrier.wait(v_ready.index(last), ((it + n_tiles - 1) // STAGES) & 1)
                p_op = _p_operand(p, p_smem, dtype, p_layout, IS_FP8)
                turn_wait(WG, PINGPONG)
                acc = warpgroup_mma(p_op, _v_operand(v_smem.index(last), IS_FP8), acc, is_async=True)
                if SPLIT:
                    acc2 = warpgroup_mma(p_op, v2_smem.index(last), acc2, is_async=True)
                turn_pass(WG, PINGPONG)
                acc, acc2 = _pv_wait(acc, acc2, p_op, SPLIT, IS_FP8)
                mbarrier.arrive(v_free.index(last), count=1)
            else:
                mbarrier.arrive(q_free, count=1)
            it += n_tiles
            done += 1

            m_i = m_i * scale  # (log2 domain; -inf where no key was seen)
            if HAS_SINK:  # the head's sink joins the denominator: rows that saw no key get LSE = sink
                sink = gl.load(Sink + h) * LOG2E_K
                m_new = gl.maximum(m_i, sink)
                alpha = gl.exp2(m_i - m_new)
                if IS_FP8:  # (at the sum's 2**P_LOG2)
                    l_i = l_i * alpha + gl.exp2(sink - m_new + P_LOG2)
                else:
                    l_i = l_i * alpha + gl.exp2(sink - m_new)
                m_i = m_new
            # A row that saw no key (nor a sink) has l == 0: output 0, LSE +inf (the portable kernels' convention)
            seen = l_i > 0.0
            l_safe = gl.where(seen, l_i, 1.0)
            norm = l_safe  # the output's divisor
            if IS_FP8:  # (p and l carry 2**P_LOG2, which acc / l cancels; V's descale scales the output)
                norm = l_safe / v_descale
            if HAS_SINK:  # (the accumulator's rescale to the sink's max, folded into the normalisation)
                out = acc * gl.convert_layout(alpha / norm, o_rows)[:, None]
                if SPLIT:
                    out2 = acc2 * gl.convert_layout(alpha / norm, o2_rows)[:, None]
            else:
                out = acc / gl.convert_layout(norm, o_rows)[:, None]
                if SPLIT:
                    out2 = acc2 / gl.convert_layout(norm, o2_rows)[:, None]
            if IS_FP8:
                lse = gl.where(seen, (m_i + gl.log2(l_safe) - P_LOG2) * LN2, float("inf"))
            else:
                lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("inf"))
            # (packed batches: batch strides 0 and rows from the sequence's first, q0)
            r0 = q0 if VARLEN else 0
            o_row = first_row + gl.arange(0, ROWS, layout=o_rows)
            o_ptrs = Out + b.to(gl.int64) * stride_ob + h * stride_oh + (r0 + o_row).to(gl.int64)[:, None] * stride_om
            o_col = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            gl.store(o_ptrs + o_col[None, :], out.to(out_dtype), mask=(o_row < seqlen_q)[:, None])
            if SPLIT:  # the second column part
                o2_row = first_row + gl.arange(0, ROWS, layout=o2_rows)
                o2_ptrs = (
                    Out + b.to(gl.int64) * stride_ob + h * stride_oh + (r0 + o2_row).to(gl.int64)[:, None] * stride_om
                )
                o2_col = HEAD_DIM + gl.arange(0, D1, layout=gl.SliceLayout(0, o2_layout))
                gl.store(o2_ptrs + o2_col[None, :], out2.to(out_dtype), mask=(o2_row < seqlen_q)[:, None])
            lse_ptr = Lse + b.to(gl.int64) * stride_lb + h * stride_lh
            gl.store(lse_ptr + (r0 + rows).to(gl.int64) * stride_lse, lse, mask=rows < seqlen_q)


@gluon.jit
def _fwd_kernel(
    q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, Out, Lse, CuQ, CuK, Sink,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh, stride_lse,
    nheads, group, batch, head_group, max_q, max_k, window_left, window_right, qk_scale,
    q_batch_rows, q_head_rows, q_head_cols, k_batch_rows, k_head_rows, k_head_cols,
    v_batch_rows, v_head_rows, v_head_cols, Descales,
    STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    CONSUMERS: gl.constexpr, HAS_SINK: gl.constexpr = False, SPLIT: gl.constexpr = False,
    PINGPONG: gl.constexpr = False, MASK_LOOPS: gl.constexpr = False, IS_FP8: gl.constexpr = False,
    P_LAYOUT: gl.constexpr = None, SNAKE: gl.constexpr = False, EXP2_POLY: gl.constexpr = 0,
):  # fmt: skip
    """``q2_desc``, ``k2_desc``, ``v2_desc``: the tensors' second column part (``SPLIT``: head dim 96 as
    64 + 32, ``HEAD_PARTS``); None without SPLIT. ``IS_FP8``: e4m3 q, k and V transposed (``v_desc`` reads
    ``[HEAD_DIM, BLOCK_N]`` tiles of a ``(batch, nheads_k, headdim, seqlen_k)`` copy), ``Descales`` fp32
    ``(3, batch, nheads_k)``, ``P_LAYOUT`` the shared layout of each consumer's e4m3 P; the output bf16.
    ``EXP2_POLY``: of every 8 scores of a thread, this many take their exponential from a polynomial."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(
        v_desc.dtype, [STAGES, v_desc.block_type.shape[0], v_desc.block_type.shape[1]], v_desc.layout
    )  # ([BLOCK_N, HEAD_DIM] tiles, or with FP8 [HEAD_DIM, BLOCK_N] ones of V transposed)
    if IS_FP8:
        p_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS, ROWS, BLOCK_N], P_LAYOUT)
    else:
        p_smem = q_smem  # (unused)
    if SPLIT:
        D1: gl.constexpr = q2_desc.block_type.shape[1]
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [CONSUMERS, ROWS, D1], q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [STAGES, BLOCK_N, D1], k2_desc.layout)
        v2_smem = gl.allocate_shared_memory(v2_desc.dtype, [STAGES, BLOCK_N, D1], v2_desc.layout)
    else:
        q2_smem = q_smem
        k2_smem = k_smem
        v2_smem = v_smem
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_free, count=CONSUMERS)  # one arrival per consumer warpgroup, as the stages' free barriers
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=CONSUMERS)
        mbarrier.init(v_free.index(i), count=CONSUMERS)

    args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, k_free, v_free,
            Out, Lse, CuQ, CuK, Sink, stride_ob, stride_om, stride_oh, stride_lb, stride_lh, stride_lse,
            nheads, group, batch, head_group, SNAKE, max_q, max_k, window_left, window_right, qk_scale,
            (q_batch_rows, q_head_rows, q_head_cols), (k_batch_rows, k_head_rows, k_head_cols),
            (v_batch_rows, v_head_rows, v_head_cols), q2_desc, k2_desc, v2_desc, q2_smem, k2_smem, v2_smem,
            Descales, p_smem)  # fmt: skip
    if CONSUMERS == 3:  # (FlashAttention-3's head-dim-64 forward: 192-row items, 160 registers a consumer)
        gl.warp_specialize(
            [
                (
                    _consume,
                    (args, MASK_LEFT, MASK_RIGHT, VARLEN, HAS_SINK, SPLIT, False, MASK_LOOPS, IS_FP8, 0, EXP2_POLY),
                ),
                (
                    _consume,
                    (args, MASK_LEFT, MASK_RIGHT, VARLEN, HAS_SINK, SPLIT, False, MASK_LOOPS, IS_FP8, 1, EXP2_POLY),
                ),
                (
                    _consume,
                    (args, MASK_LEFT, MASK_RIGHT, VARLEN, HAS_SINK, SPLIT, False, MASK_LOOPS, IS_FP8, 2, EXP2_POLY),
                ),
                (_load, (args, MASK_LEFT, MASK_RIGHT, VARLEN, SPLIT, IS_FP8)),
            ],
            [4, 4, 1],
            [160, 160, 24],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _consume,
                    (args, MASK_LEFT, MASK_RIGHT, VARLEN, HAS_SINK, SPLIT, PINGPONG, MASK_LOOPS, IS_FP8, 0, EXP2_POLY),
                ),
                (
                    _consume,
                    (args, MASK_LEFT, MASK_RIGHT, VARLEN, HAS_SINK, SPLIT, PINGPONG, MASK_LOOPS, IS_FP8, 1, EXP2_POLY),
                ),
                (_load, (args, MASK_LEFT, MASK_RIGHT, VARLEN, SPLIT, IS_FP8)),
            ],
            [4, 1],
            [240, 24],
        )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def eligible(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, p: AttnParams) -> bool:
    """Whether the Gluon forward computes this call: ``plain_attention`` at head dim 64, 96, 128 or 256, or
    FP8 at 64, 128 or 256 (packed batches: the tensors as ``p.as_4d`` views them), q, k and v each one TMA
    matrix (``tma_rows``; FP8: q and k, V is read through a transposed copy)."""
    return eligible_rows(q4, k4, v4, p) is not None


def eligible_rows(
    q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, p: AttnParams
) -> tuple[TmaRows, TmaRows, TmaRows] | None:
    """q, k and v as the 2-D matrices TMA reads (``tma_rows``) where ``eligible`` holds, else None (FP8:
    V's is its transposed copy's, ``transposed_rows``)."""
    if not plain_attention(q4, p, HEAD_DIMS, fp8_head_dims=FP8_HEAD_DIMS):
        return None
    rows = (tma_rows(q4), tma_rows(k4), transposed_rows(v4) if p.is_fp8 else tma_rows(v4))
    return None if None in rows else rows


def transposed_rows(v4: torch.Tensor, vt: torch.Tensor | None = None) -> TmaRows:
    """V ``(batch, seqlen_k, nheads_k, headdim)`` transposed (``kernels.common.transposed_v``: ``(batch,
    nheads_k, headdim, seqlen_k)``, rows of 16-byte multiples), as the 2-D matrix TMA reads: a row per
    (batch entry, kv head, head-dim column), the keys along it. ``vt``: the copy (None: a buffer of its
    geometry on the meta device, for a plan's descriptor: shape and strides from it, each call's address
    from that call's copy)."""
    batch, seqlen, nheads_k, headdim = v4.shape
    if vt is None:
        vt = transposed_v_buffer(v4, device="meta")
    rows = vt.as_strided((batch * nheads_k * headdim, seqlen), (vt.stride(2), 1))
    return TmaRows(rows, nheads_k * headdim, headdim, 0)


def attn_fwd(
    q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, p: AttnParams, *, block_m: int = 128, block_n: int = 128,
    stages: int = 2, programs: int | None = None, rows: tuple | None = None, pingpong: bool = False,
    mask_loops: bool = False, l2_bytes: int = 0, snake: bool = False, exp2_poly: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out, lse)`` of an ``eligible`` call: out as q4, lse fp32 ``(batch, nheads, seqlen_q)``, or for a
    packed batch (q4 ``(1, total_q, nheads, headdim)``, sequences from ``p.cu_seqlens_q``/``_k``, the grid
    covering ``p.seqlen_q`` rows of each) ``(nheads, total_q)``. ``programs``: the grid (default: one
    program per SM, or fewer where there is less work; ``ONE_PER_TILE``: one per work item, each starting
    where a non-persistent launch would put it). ``block_m``: a work item's query rows, ``WG_ROWS`` per
    consumer warpgroup: 128 (two warpgroups at 240 registers) or 192 (three at 160, FlashAttention-3's
    head-dim-64 build). ``pingpong``: the two consumer warpgroups take turns issuing their wgmmas (named
    barriers), so that one's softmax runs under the other's matmuls (FlashAttention-3's ping-pong; two
    warpgroups only). ``mask_loops``: the key loop as three loops (tiles that need a mask, those that need
    none, those that do) with no branch in their bodies, so that ptxas can schedule the softmax under the
    running P·V (with one loop and the mask behind a branch it waits for the P·V first). ``l2_bytes``:
    the K/V a causal call's groups of heads keep in L2 (``schedule.head_group``; 0: all heads in one
    group; the settings: ``Settings.gluon_l2_bytes``). ``snake``: a persistent causal grid's programs take
    every other wave's items in reverse, in groups of heads ``schedule.balanced_group`` picks for an even
    load. ``exp2_poly``: of every 8 scores of a thread, this many take their exponential from a polynomial on
    the FMA units instead of MUFU (``kernels.exp2``). ``rows``: what ``eligible_rows`` returned for these
    tensors (made here if None).
    The call's ``Plan``, run once."""
    if rows is None:
        rows = (tma_rows(q4), tma_rows(k4), transposed_rows(v4) if p.is_fp8 else tma_rows(v4))
    plan = Plan(
        q4, k4, v4, p, rows, block_m=block_m, block_n=block_n, stages=stages, programs=programs, pingpong=pingpong,
        mask_loops=mask_loops, l2_bytes=l2_bytes, snake=snake, exp2_poly=exp2_poly,
    )  # fmt: skip
    out, lse = plan.run(q4, k4, v4, p)
    return out.view(q4.shape), lse


class Plan:
    """The Gluon forward of one call signature (``attn_fwd``'s arguments): tiles, grid, constexprs, the
    TMA descriptors' templates and the launch's fixed arguments, decided once; ``run(q, k, v, p)``
    allocates the outputs and launches for a call with the same metadata, reading only its tensors (q, k,
    v as ``p.as_4d`` views them or not, the sinks, cu_seqlens). Its outputs are ``kernels.forward``'s:
    out shaped as q, lse as ``p.lse_shape``."""

    __slots__ = ("launch", "descs", "out_shape", "lse_shape", "varlen", "fp8")

    def __init__(
        self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, p: AttnParams, rows: tuple, *,
        block_m: int = 128, block_n: int = 128, stages: int = 2, programs: int | None = None,
        pingpong: bool = False, mask_loops: bool = False, l2_bytes: int = 0, snake: bool = False,
        exp2_poly: int = 0,
    ):  # fmt: skip
        if block_m not in BLOCK_MS:
            raise ValueError(
                f"block_m must be one of {BLOCK_MS} (consumer warpgroups of {WG_ROWS} rows), got {block_m}"
            )
        consumers = block_m // WG_ROWS
        if pingpong and consumers != 2:
            raise ValueError(
                f"pingpong takes turns between two consumer warpgroups (block_m=128), got block_m={block_m}"
            )
        headdim = q4.shape[3]
        nheads, nheads_k = q4.shape[2], k4.shape[2]
        self.varlen = p.is_varlen
        self.fp8 = p.is_fp8
        if self.fp8 and headdim not in FP8_HEAD_DIMS:
            raise ValueError(f"FP8 inputs take head dims {FP8_HEAD_DIMS} here (one column part), got {headdim}")
        self.out_shape = q4.shape[1:] if p.is_varlen else q4.shape
        self.lse_shape = p.lse_shape(q4)
        q2, k2, v2 = rows
        # one descriptor per tensor and column part (head dim 96: 64 + 32; the others: one part)
        parts = [d for d in HEAD_PARTS[headdim] if d]

        def desc(rows: TmaRows, block: list[int]) -> TensorDescriptor:
            return TensorDescriptor.from_tensor(rows.matrix, block, tile_layout(*block, q4.dtype))

        self.descs = tuple(
            d
            for cols in parts
            for d in (
                desc(q2, [WG_ROWS, cols]),
                desc(k2, [block_n, cols]),
                desc(v2, [cols, block_n] if self.fp8 else [block_n, cols]),  # (FP8: tiles of V transposed)
            )
        )
        items = cdiv(p.seqlen_q, block_m) * nheads * p.batch
        grid = (min(items, programs or _sm_count(q4.device)),)
        # (out and lse contiguous: out's (batch, row, head) strides, lse's (batch, head) strides and row stride)
        out_strides = (0 if p.is_varlen else q4.shape[1] * nheads * headdim, nheads * headdim, headdim)
        lse_strides = (0, self.lse_shape[1], 1) if p.is_varlen else (nheads * p.seqlen_q, p.seqlen_q, 1)
        heads = schedule.head_group(p.batch, nheads, nheads_k, p.seqlen_k, headdim, q4.element_size(), l2_bytes)
        causal = p.window_right >= 0 > p.window_left
        snake_order = snake and causal and not p.is_varlen and grid[0] < items  # (packed: lengths on the device)
        if snake_order:
            heads = schedule.balanced_group(
                cdiv(p.seqlen_q, block_m), p.batch * nheads, heads, grid[0], block_m, block_n, p.seqlen_k - p.seqlen_q
            )
        fixed = (
            *out_strides, *lse_strides,
            nheads, nheads // nheads_k, p.batch, heads, p.seqlen_q, p.seqlen_k,
            max(p.window_left, 0), max(p.window_right, 0), p.softmax_scale * LOG2E, *q2[1:], *k2[1:], *v2[1:],
        )  # fmt: skip
        constexprs = dict(
            STAGES=stages, MASK_LEFT=p.window_left >= 0, MASK_RIGHT=p.window_right >= 0, VARLEN=p.is_varlen,
            CONSUMERS=consumers, HAS_SINK=p.learnable_sink is not None, SPLIT=len(parts) > 1, PINGPONG=pingpong,
            MASK_LOOPS=mask_loops, IS_FP8=self.fp8, SNAKE=snake_order, EXP2_POLY=exp2_poly,
            # (named in every build, None where unused: a launch that leaves a parameter unnamed gets no plan)
            P_LAYOUT=tile_layout(WG_ROWS, block_n, torch.float8_e4m3fn) if self.fp8 else None,
        )  # fmt: skip
        # (the register file over 12 or 16 warps)
        self.launch = Launch(LAUNCHER, grid, fixed, constexprs, num_warps=4, maxnreg=168 if consumers == 2 else 128)

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = q.device
        out = torch.empty(self.out_shape, device=device, dtype=torch.bfloat16 if self.fp8 else q.dtype)
        lse = torch.empty(self.lse_shape, device=device, dtype=torch.float32)
        if self.fp8:  # (V's transposed copy, made per call: FP8 wgmma reads P·V's B operand key-major)
            v = transposed_v(v if v.dim() == 4 else v.unsqueeze(0))
        descs = tuple(rebased(d, t) for d, t in zip(self.descs, (q, k, v, q, k, v)))
        cu_q, cu_k = (p.cu_seqlens_q, p.cu_seqlens_k) if self.varlen else (lse, lse)
        sink = p.learnable_sink if p.learnable_sink is not None else lse
        descales = p.descales if self.fp8 else lse
        # (one column part: no second descriptors, None in their place, nothing made per call for them)
        self.launch((*descs, *(None,) * (6 - len(descs)), out, lse, cu_q, cu_k, sink), (descales,))
        return out, lse


LAUNCHER = Launcher(_fwd_kernel)  # (kernels.launch: the build chosen once per launch key)
