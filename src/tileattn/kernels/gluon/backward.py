"""The Hopper backward in Gluon: FlashAttention-3's warp-specialized dK/dV/dQ kernel.

One program per (block of 128 keys, kv head, batch entry) walks every query head of its GQA group and
every 64-row query tile that can see its keys (causal: from the first tile whose last row reaches the
block's first key; a sliding window's left side: up to the last tile whose first row reaches its last
key), with dK and dV accumulated in registers across all of them. A program has three
partitions:
- a loader warp brings the block's K and V once by TMA, then streams (Q tile, dO tile) pairs, with the
  tile's LSE and Δ (1-D copies from their flat rows; or ``LSE_TMA=False``: the consumers load those
  with masked loads), through a ``STAGES``-deep ring of shared-memory buffers (``q_ready``/``do_ready``
  mbarriers say a stage is filled, ``free`` that both consumers are done with it);
- two consumer warpgroups own 64 keys each (the default partition and one worker). With the keys as
  the wgmma M dimension the per-key accumulators stay in registers: per query tile a warpgroup computes
  Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (shared-memory operands), Pᵀ = exp(Sᵀ - LSE) and dSᵀ = Pᵀ ∘ (dPᵀ - Δ) in
  registers, dV += Pᵀ·dO and dK += dSᵀ·Q with Pᵀ and dSᵀ as register A operands (the accumulator layout
  of Sᵀ is the A-operand layout of those products). Both warpgroups write their dSᵀ into one
  [128 keys × BLOCK_M] shared-memory buffer (two, alternating; ``ds_ready`` says both halves are in),
  and each computes half of dQ's columns over all 128 keys, dS·K[:, half], which it adds into an fp32
  dQ buffer in global memory: by TMA reduce-adds (``DQ_TMA``; one bulk reduction per tile from a
  shared-memory staging buffer) or fp32 atomic adds; with ``DQ_FIRST`` dK is issued after dQ, so that the
  add runs under it (FlashAttention-3's order). The order of those adds varies run to run: dQ is
  not bitwise reproducible (``deterministic=True`` never comes here).

At head dim 256 one warpgroup's dK and dV of 64 keys would fill all its registers: ``attn_bwd`` launches
the split build there (``gluon.backward_split``). The loader partition, the tile ranges and
the scores' mask are both builds' (``gluon.backward_common``).

Only plain attention is here: (batch, seqlen, nheads, headdim) tensors whose rows TMA can read as one
2-D matrix, or packed batches (varlen: ``(total, nheads, headdim)``, sequence b's rows from
cu_seqlens[b], the grid covering the longest sequence), bf16/fp16, head dims 64, 128 and 256, causal or not,
sliding windows, GQA/MQA, dropout (the mask ``tileattn.rng`` describes, drawn as the forward kernels draw
it: ``gluon.dropout``); ``eligible`` says when. Rows of that 2-D matrix past a sequence's end belong
to the next sequence (or are zero-filled by TMA at the end of the tensor), and a tile's LSE and Δ past
its sequence are the next head's or sequence's (or padding): the tiles that cross a sequence's end mask
those queries and keys (P = 0), so they contribute nothing (the dQ reduce-adds add exact zeros to the
next entry's rows). Rows that saw no key have LSE +inf: P = 0.

TMA needs every copy's innermost start to be 16-byte aligned (a copy that starts elsewhere is an
illegal instruction on the H200, and no check catches it before). The 2-D copies start at multiples of
the head dim; the 1-D LSE/Δ copies come from rows laid out for them (``gluon.rows``).
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

from tileattn.kernels.gluon import backward_split
from tileattn.kernels.gluon.backward_common import LOG2E_C, WG_KEYS, add_dq, loader, masked_scores, query_tiles, ring
from tileattn.kernels.gluon.common import LOG2E, TmaRows, plain_attention, rebased, sequence, tile_layout, tma_rows
from tileattn.kernels.gluon.dropout import WORD_SMEM, dropout_kept, dropout_words, kept
from tileattn.kernels.gluon.rows import ROW_LAYOUT, dense_rows, packed_rows, row_start
from tileattn.kernels.launch import Launch, Launcher
from tileattn.params import AttnParams, KernelConfig, cdiv

HEAD_DIMS = (64, 128, 256)
SPLIT_HEAD_DIMS = backward_split.HEAD_DIMS  # the split build's: 64 keys a program
DQ_CHUNKS = backward_split.DQ_CHUNKS


@gluon.jit
def _consume(
    args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_TMA: gl.constexpr, LSE_TMA: gl.constexpr,
    VARLEN: gl.constexpr, DROPOUT: gl.constexpr, DQ_FIRST: gl.constexpr, WG: gl.constexpr,
):  # fmt: skip
    (q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc,
     q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
     kv_ready, q_ready, do_ready, free, ds_ready,
     DQacc, DK, DV, Lse, Delta, CuQ, CuK, stride_dqm, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
     nheads, group, seqlen_q, seqlen_k, window, lse_stride, qk_scale, sm_scale, layouts, rng_smem, rng) = args  # fmt: skip
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    DQ_COLS: gl.constexpr = HEAD_DIM // 2  # the dQ columns this warpgroup computes, over both halves' keys
    STAGES: gl.constexpr = q_smem.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    key_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [4], [0]))  # a tile's LSE/Δ (loads)
    n_start = gl.program_id(0) * 2 * KEYS
    h_k = gl.program_id(1)
    b = gl.program_id(2)
    q0, seqlen_q, k0, seqlen_k = sequence(CuQ, CuK, b, seqlen_q, seqlen_k, VARLEN)
    key_start = n_start + WG * KEYS  # this warpgroup's first key
    keys = key_start + gl.arange(0, KEYS, layout=key_rows)
    k = k_smem.slice(WG * KEYS, KEYS)  # [KEYS, HEAD_DIM]: this warpgroup's keys
    v = v_smem.slice(WG * KEYS, KEYS)
    k_cols = k_smem.slice(WG * DQ_COLS, DQ_COLS, dim=1)  # [2 * KEYS, DQ_COLS]: all keys, this warpgroup's dQ columns
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    m_lo, num_m = query_tiles(n_start, seqlen_q, seqlen_k, window, BLOCK_M, 2 * KEYS, MASK_LEFT, MASK_RIGHT)
    mbarrier.wait(kv_ready, 0)
    it = 0  # (Q, dO) tiles consumed so far: the ring's stage and phase, and the dS buffer's
    seed, row_groups, rng_rows, drop_threshold, inv_keep = rng  # (dropout: tileattn.rng)
    for g in range(group):
        h = h_k * group + g
        lse_row = row_start(b, h, nheads, q0, lse_stride, VARLEN, LSE_TMA).to(gl.int64)
        rng_row = (b * nheads + h).to(gl.int64) * rng_rows * row_groups  # (b, h)'s first dropout counter
        for m in range(m_lo, num_m):
            s = it % STAGES
            phase = (it // STAGES) & 1
            m_start = m * BLOCK_M
            cols = m_start + gl.arange(0, BLOCK_M, layout=q_cols)
            if not LSE_TMA:  # one element a thread, in flight with the waits and the first products
                in_seq = m_start + offs < seqlen_q
                lse_ld = gl.load(Lse + lse_row + m_start + offs, mask=in_seq, other=float("inf"))
                delta_ld = gl.load(Delta + lse_row + m_start + offs, mask=in_seq, other=0.0)
            q = q_smem.index(s)
            do = do_smem.index(s)
            if DROPOUT:  # (before the products: their accumulators would leave too few registers)
                dropout_words(seed, rng_row, m_start, key_start, row_groups, rng_smem, WG)
            # Sᵀ and dPᵀ issued together; the exponent runs while dPᵀ is on the tensor cores
            mbarrier.wait(q_ready.index(s), phase)
            # [KEYS, BLOCK_M] = k @ qᵀ, then [KEYS, BLOCK_M] = v @ dOᵀ
            st = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(s), phase)
            dpt = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(1, deps=(st,))
            st = masked_scores(
                st, keys, cols, m_start, key_start, seqlen_q, seqlen_k, window, KEYS, BLOCK_M, MASK_LEFT, MASK_RIGHT
            )
            if LSE_TMA:
                lse_in = lse_smem.index(s).load(q_cols)
            else:
                lse_in = gl.convert_layout(lse_ld, q_cols)
            lse2 = lse_in * LOG2E_C  # +inf for rows that saw no key: P = 0
            pt = gl.exp2(st * qk_scale - lse2[None, :])  # [KEYS, BLOCK_M], 0 where hidden
            if DROPOUT:  # dV sees the kept weights, rescaled; pt keeps the mask in its sign bit (pt >= +0)
                pt = gl.where(dropout_kept(rng_smem, drop_threshold, s_layout, WG), pt, -pt)
                p_op = gl.convert_layout((gl.where(kept(pt), pt, 0.0) * inv_keep).to(dtype), op_layout)
            else:
                p_op = gl.convert_layout(pt.to(dtype), op_layout)
            dpt = warpgroup_mma_wait(0, deps=(dpt,))
            dv = warpgroup_mma(p_op, do, dv, is_async=True)  # [KEYS, HEAD_DIM] += pᵀ @ dO
            if LSE_TMA:
                delta_in = delta_smem.index(s).load(q_cols)
            else:
                delta_in = gl.convert_layout(delta_ld, q_cols)
            if DROPOUT:  # dP through the mask (a dropped weight's gradient is 0; a weight of 0 needs none)
                dpt = gl.where(kept(pt), dpt * inv_keep, 0.0)
                pt = gl.abs(pt)
            ds = (pt * (dpt - delta_in[None, :])).to(dtype)  # [KEYS, BLOCK_M] = dSᵀ
            ds_op = gl.convert_layout(ds, op_layout)
            if not DQ_FIRST:
                dk = warpgroup_mma(ds_op, q, dk, is_async=True)  # [KEYS, HEAD_DIM] += dsᵀ @ q
            # both warpgroups' dSᵀ in one [2 * KEYS, BLOCK_M] buffer (two, alternating: a warpgroup writes
            # one only after both have passed the other's ds_ready, so after both read it last time)
            ds_buf = ds_smem.index(it % 2)
            ds_buf.slice(WG * KEYS, KEYS).store(ds)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(it % 2), count=1)
            mbarrier.wait(ds_ready.index(it % 2), (it // 2) & 1)
            # [BLOCK_M, DQ_COLS] = ds @ k[:, cols]: this warpgroup's half of dQ's columns, over all 2 * KEYS keys
            dq = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
            if DQ_FIRST:  # dK after dQ, so that dQ's add runs under it
                dk = warpgroup_mma(ds_op, q, dk, is_async=True)
                dv, p_op, dq = warpgroup_mma_wait(1, deps=(dv, p_op, dq))
                dq = dq * sm_scale
            else:
                dv, dk, p_op, ds_op = warpgroup_mma_wait(1, deps=(dv, dk, p_op, ds_op))
                mbarrier.arrive(free.index(s), count=1)  # Q and dO read for the last time
                dq = warpgroup_mma_wait(0, deps=(dq,)) * sm_scale
            add_dq(dq, dq_smem, dq_desc, DQacc, q0, m_start, seqlen_q, stride_dqm, h * HEAD_DIM + WG * DQ_COLS,
                   DQ_TMA, WG)  # fmt: skip
            if DQ_FIRST:
                dk, ds_op = warpgroup_mma_wait(0, deps=(dk, ds_op))
                mbarrier.arrive(free.index(s), count=1)
            it += 1
    if DQ_TMA:
        tma.store_wait(0)

    # dK = dSᵀ·Q · scale, dV = Pᵀ·dO; keys past the sequence are not written
    d_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    out_rows = key_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    mask = (out_rows < seqlen_k)[:, None]
    dk_ptrs = DK + h_k * stride_dkh + (k0 + out_rows).to(gl.int64)[:, None] * stride_dkn
    gl.store(dk_ptrs + d_cols[None, :], (dk * sm_scale).to(dtype), mask=mask)
    dv_ptrs = DV + h_k * stride_dvh + (k0 + out_rows).to(gl.int64)[:, None] * stride_dvn
    gl.store(dv_ptrs + d_cols[None, :], dv.to(dtype), mask=mask)


@gluon.jit
def _consume_default(args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_TMA: gl.constexpr,
                     LSE_TMA: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr,
                     DQ_FIRST: gl.constexpr):  # fmt: skip
    _consume(args, MASK_LEFT, MASK_RIGHT, DQ_TMA, LSE_TMA, VARLEN, DROPOUT, DQ_FIRST, 0)


@gluon.jit
def _consume_worker(args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_TMA: gl.constexpr,
                    LSE_TMA: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr,
                    DQ_FIRST: gl.constexpr):  # fmt: skip
    _consume(args, MASK_LEFT, MASK_RIGHT, DQ_TMA, LSE_TMA, VARLEN, DROPOUT, DQ_FIRST, 1)


# dropout's values must not select builds (a fresh seed per call, seed % 16 == 0; a dropout-free call's
# row_groups of its key length)
@gluon.jit(do_not_specialize=["philox_seed", "row_groups", "rng_rows", "drop_threshold"])
def _bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc, DQacc, DK, DV, Lse, Delta, CuQ, CuK,
    stride_dqm, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    nheads, group, seqlen_q, seqlen_k, window_left, window_right, lse_stride, qk_scale, sm_scale,
    q_batch_rows, q_head_rows, q_head_cols, do_batch_rows, do_head_rows, do_head_cols,
    k_batch_rows, k_head_rows, k_head_cols, v_batch_rows, v_head_rows, v_head_cols,
    philox_seed, row_groups, rng_rows, drop_threshold, inv_keep,
    STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_TMA: gl.constexpr,
    LSE_TMA: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr, DQ_FIRST: gl.constexpr = False,
):  # fmt: skip
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2 * KEYS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2 * KEYS, HEAD_DIM], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * KEYS, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * KEYS, BLOCK_M], ds_layout)
    if DQ_TMA:  # each warpgroup's staging buffer for its dQ reduce-adds
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
    else:
        dq_smem = ds_smem
    if DROPOUT:  # each warpgroup's dropout draws of its tile
        rng_smem = gl.allocate_shared_memory(gl.uint32, [2 * 16, BLOCK_M], WORD_SMEM)
    else:
        rng_smem = ds_smem
    lse_smem, delta_smem, kv_ready, q_ready, do_ready, free = ring(lse_desc, delta_desc, ds_smem, STAGES, BLOCK_M,
                                                                   LSE_TMA)  # fmt: skip
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both warpgroups' halves of dSᵀ written

    args = (q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc,
     q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
            kv_ready, q_ready, do_ready, free, ds_ready,
            DQacc, DK, DV, Lse, Delta, CuQ, CuK, stride_dqm, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
            nheads, group, seqlen_q, seqlen_k, (window_left, window_right), lse_stride, qk_scale, sm_scale,
            ((q_batch_rows, q_head_rows, q_head_cols), (do_batch_rows, do_head_rows, do_head_cols),
             (k_batch_rows, k_head_rows, k_head_cols), (v_batch_rows, v_head_rows, v_head_cols)),
            rng_smem, (philox_seed, row_groups, rng_rows, drop_threshold, inv_keep))  # fmt: skip
    gl.warp_specialize(
        [
            (_consume_default, (args, MASK_LEFT, MASK_RIGHT, DQ_TMA, LSE_TMA, VARLEN, DROPOUT, DQ_FIRST)),
            (_consume_worker, (args, MASK_LEFT, MASK_RIGHT, DQ_TMA, LSE_TMA, VARLEN, DROPOUT, DQ_FIRST)),
            (loader, (args, MASK_LEFT, MASK_RIGHT, LSE_TMA, VARLEN)),
        ],
        [4, 1],
        [240, 24],
    )


def eligible(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, p: AttnParams) -> bool:
    """Whether the Gluon backward computes this call: ``plain_attention`` at head dim 64 or 128, dropout or
    not, or 256 (the split build), not ``deterministic``, q, k, v and dO (4-D: varlen as one batch of packed rows) each one TMA
    matrix."""
    return eligible_rows(q4, k4, v4, do4, p) is not None


def eligible_rows(
    q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, p: AttnParams
) -> tuple[TmaRows, TmaRows, TmaRows, TmaRows] | None:
    """q, k, v and dO as the 2-D matrices TMA reads (``tma_rows``) where ``eligible`` holds, else None."""
    if p.deterministic or not plain_attention(q4, p, HEAD_DIMS, dropout=True):
        return None
    if p.batch > 65535 or k4.shape[2] > 65535:  # (the grid's z and y)
        return None
    rows = (tma_rows(q4), tma_rows(k4), tma_rows(v4), tma_rows(do4))
    return None if None in rows else rows


def config_options(cfg: KernelConfig) -> dict:
    """``attn_bwd``'s build options for a ``Settings.bwd_gluon`` (or ``bwd_gluon_dropout``) entry."""
    return dict(
        block_m=cfg.block_m, block_n=cfg.block_n, stages=cfg.num_stages, dq_tma=cfg.dq_atomic != 1,
        dq_first=cfg.dq_first, dq_chunk=cfg.dq_chunk,
    )  # fmt: skip


def attn_bwd(
    do4: torch.Tensor, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, p: AttnParams, *, block_m: int = 64, block_n: int | None = None, stages: int = 2,
    dq_tma: bool = True, lse_load: str = "tma", dq_first: bool = False, dq_chunk: int = 64,
    rows: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` of an ``eligible`` call, contiguous, shaped as q4, k4, v4, in the inputs' dtype.

    do4, q4: ``(batch, seqlen_q, nheads, headdim)``; k4, v4: ``(batch, seqlen_k, nheads_k, headdim)``;
    varlen (``p.cu_seqlens_q``, ``p.cu_seqlens_k``): ``(1, total, heads, headdim)``, the packed rows.
    lse: the forward's fp32 natural-log LSE, ``(batch, nheads, seqlen_q)`` or varlen ``(nheads,
    total_q)`` (+inf for rows that saw no key); delta: fp32 ``rowsum(dO ∘ O)`` of the same shape
    (``backward._bwd_preprocess``).
    block_m: query rows per tile (64); block_n: keys per program (None: the only one each build takes, 128,
    64 per consumer warpgroup; head dim 256, the split build: 64, both warpgroups on them, each with half
    the head dim of dK and dV);
    stages: the (Q, dO) ring's depth (fewer where shared memory has no room for it: ``shared_bytes``); dq_tma:
    dQ added by TMA reduce-adds (else fp32 atomic adds);
    lse_load: how a tile's LSE and Δ arrive, one of ``LSE_LOADS``: ``"tma"`` by 1-D TMA copies from rows
    that start 16-byte aligned (zero-padded copies of lse and delta where seqlen_q is not a multiple of 4
    or the rows are shorter than a tile; varlen, rows in which each sequence starts aligned,
    ``packed_rows``), ``"load"`` by masked loads in the consumers (more registers: the consumers
    spill), ``"tma-unaligned"`` by 1-D TMA copies from the dense flat rows as given (a copy whose start is
    not 16-byte aligned is an illegal instruction on the H200: kept only to show that on the GPU; varlen
    as ``"tma"``). dq_first: each tile's dK issued after its dQ, whose add then runs under dK (the split
    build: its first dQ chunk issued before dV and dK, the add under them); dq_chunk: the split build's dQ
    columns per product and add, one of ``DQ_CHUNKS`` (32: half the staging tiles' shared memory, room for a
    second stage). rows: what ``eligible_rows`` returned for these tensors (made here if None)."""
    if rows is None:
        rows = (tma_rows(q4), tma_rows(k4), tma_rows(v4), tma_rows(do4))
    plan = Plan(
        q4, k4, v4, do4, lse, p, rows, block_m=block_m, block_n=block_n, stages=stages, dq_tma=dq_tma,
        lse_load=lse_load, dq_first=dq_first, dq_chunk=dq_chunk,
    )  # fmt: skip
    if delta.shape != lse.shape or not delta.is_contiguous():
        names = "(nheads, total_q)" if p.is_varlen else "(batch, nheads, seqlen_q)"
        raise ValueError(f"lse and delta must be {names} = {tuple(lse.shape)}, contiguous")
    dq, dk, dv = plan.run(do4, q4, k4, v4, lse, delta, p)
    return dq.view(q4.shape), dk.view(k4.shape), dv.view(v4.shape)


class Plan:
    """The Gluon backward of one call signature (``attn_bwd``'s arguments): the build, grid, the TMA
    descriptors' templates and the launch's fixed arguments, decided once; ``run(do, q, k, v, lse, delta,
    p)`` allocates dQ's fp32 buffer and dK, dV and launches for a call with the same metadata (q, k, v and
    dO as ``p.as_4d`` views them or not; the returned gradients are shaped as those given)."""

    __slots__ = ("launch", "descs", "dq_desc", "lse_desc", "delta_desc", "dq_shape", "k_shape", "varlen",
                 "block_m", "lse_load", "lse_tma")  # fmt: skip

    def __init__(
        self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, do4: torch.Tensor, lse: torch.Tensor,
        p: AttnParams, rows: tuple, *, block_m: int = 64, block_n: int | None = None, stages: int = 2,
        dq_tma: bool = True, lse_load: str = "tma", dq_first: bool = False, dq_chunk: int = 64,
    ):  # fmt: skip
        batch, seqlen_q, nheads, headdim = q4.shape
        split = headdim in SPLIT_HEAD_DIMS
        if block_n is None:
            block_n = WG_KEYS if split else 2 * WG_KEYS
        if split and block_n != WG_KEYS:
            raise ValueError(f"block_n must be {WG_KEYS} at head dim {headdim} (the split build), got {block_n}")
        if not split and block_n != 2 * WG_KEYS:
            raise ValueError(f"block_n must be {2 * WG_KEYS} (two warpgroups of {WG_KEYS} keys), got {block_n}")
        if split and block_m != 64:
            raise ValueError(f"block_m must be 64 at head dim {headdim} (the split build), got {block_m}")
        if split and dq_chunk not in DQ_CHUNKS:
            raise ValueError(f"dq_chunk must be one of {DQ_CHUNKS} (the split build), got {dq_chunk}")
        if lse_load not in LSE_LOADS:
            raise ValueError(f"lse_load must be one of {LSE_LOADS}, got {lse_load!r}")
        if not lse.is_contiguous():
            raise ValueError("lse must be contiguous")
        lse_shape = (nheads, seqlen_q) if p.is_varlen else (batch, nheads, seqlen_q)
        if lse.shape != lse_shape:
            names = "(nheads, total_q)" if p.is_varlen else "(batch, nheads, seqlen_q)"
            raise ValueError(f"lse and delta must be {names} = {lse_shape}")
        dropout, lse_tma = p.dropout_p > 0, lse_load != "load"
        dq_cols = dq_chunk if split else headdim // 2  # (the columns of one dQ product and add)
        while stages > 1 and shared_bytes(block_m, headdim, stages, dq_tma, lse_tma, dropout, dq_cols) > SHARED_LIMIT:
            stages -= 1  # (dropout's draws take the room of a stage at head dim 128)
        if shared_bytes(block_m, headdim, stages, dq_tma, lse_tma, dropout, dq_cols) > SHARED_LIMIT:
            raise ValueError(f"block_m={block_m} at head dim {headdim} needs more shared memory than an SM has")
        self.varlen, self.block_m, self.lse_load, self.lse_tma = p.is_varlen, block_m, lse_load, lse_tma
        self.dq_shape, self.k_shape = q4.shape, k4.shape
        nheads_k = k4.shape[2]
        q2, k2, v2, do2 = rows
        q_layout = tile_layout(block_m, headdim, q2.matrix.dtype)
        kv_layout = tile_layout(WG_KEYS, headdim, q2.matrix.dtype)
        self.descs = (
            TensorDescriptor.from_tensor(q2.matrix, [block_m, headdim], q_layout),
            TensorDescriptor.from_tensor(k2.matrix, [WG_KEYS, headdim], kv_layout),
            TensorDescriptor.from_tensor(v2.matrix, [WG_KEYS, headdim], kv_layout),
            TensorDescriptor.from_tensor(do2.matrix, [block_m, headdim], q_layout),
        )
        # (dQ's fp32 buffer, contiguous: flash_attn's layout, as the dQ adds address it; its template is made
        # over a buffer of the same shape on the meta device, whose address is never read)
        dq_rows = torch.empty(batch * seqlen_q, nheads * headdim, device="meta", dtype=torch.float32)
        self.dq_desc = TensorDescriptor(dq_rows, list(dq_rows.shape), [nheads * headdim, 1], [block_m, dq_cols],
                                        _dq_layout(block_m, dq_cols))  # fmt: skip
        lse_rows, delta_rows, lse_stride = self._rows(lse, lse, p)
        self.lse_desc = TensorDescriptor(lse_rows, [lse_rows.numel()], [1], [block_m], ROW_LAYOUT)
        self.delta_desc = self.lse_desc
        fixed = (  # (dQ's buffer, dK and dV contiguous: their row and head strides)
            nheads * headdim, nheads_k * headdim, headdim, nheads_k * headdim, headdim,
            nheads, nheads // nheads_k, p.seqlen_q, p.seqlen_k, max(p.window_left, 0), max(p.window_right, 0),
            lse_stride, p.softmax_scale * LOG2E,
            p.softmax_scale, *q2[1:], *do2[1:], *k2[1:], *v2[1:],
        )  # fmt: skip
        self.launch = Launch(
            backward_split.LAUNCHER if split else LAUNCHER,
            (cdiv(p.seqlen_k, WG_KEYS if split else 2 * WG_KEYS), nheads_k, p.batch),
            fixed,
            dict(
                STAGES=stages, MASK_LEFT=p.window_left >= 0, MASK_RIGHT=p.window_right >= 0, DQ_TMA=dq_tma,
                LSE_TMA=lse_tma, VARLEN=p.is_varlen, DROPOUT=p.dropout_p > 0,
                DQ_FIRST=dq_first,
            ),  # fmt: skip
            num_warps=4,
            maxnreg=168,
        )  # fmt: skip

    def _rows(self, lse: torch.Tensor, delta: torch.Tensor, p: AttnParams) -> tuple:
        """LSE and Δ as flat rows of ``lse_stride`` elements, a tile's read by one 1-D copy (or by loads)."""
        block_m = self.block_m
        if p.is_varlen:
            if self.lse_tma:
                return packed_rows(lse, delta, p, block_m)
            return lse.view(-1), delta.view(-1), lse.shape[1]
        lse_rows, lse_stride = dense_rows(lse, block_m, aligned=self.lse_load == "tma")
        delta_rows, _ = dense_rows(delta, block_m, aligned=self.lse_load == "tma")
        return lse_rows, delta_rows, lse_stride

    def run(self, do, q, k, v, lse: torch.Tensor, delta: torch.Tensor, p: AttnParams):
        """``(dq, dk, dv)``, contiguous, shaped as q, k, v (dq in q's dtype)."""
        device = q.device
        dq_acc = torch.zeros(self.dq_shape, device=device, dtype=torch.float32)
        dk = torch.empty(self.k_shape, device=device, dtype=k.dtype)
        dv = torch.empty(self.k_shape, device=device, dtype=v.dtype)
        lse_rows, delta_rows, _ = self._rows(lse, delta, p)
        q_desc, k_desc, v_desc, do_desc = (rebased(d, t) for d, t in zip(self.descs, (q, k, v, do)))
        dq_desc = rebased(self.dq_desc, dq_acc)
        lse_desc, delta_desc = rebased(self.lse_desc, lse_rows), rebased(self.lse_desc, delta_rows)
        cu_q, cu_k = (p.cu_seqlens_q, p.cu_seqlens_k) if self.varlen else (lse_rows, lse_rows)
        self.launch(
            (q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc, dq_acc, dk, dv, lse_rows, delta_rows,
             cu_q, cu_k),
            (p.philox_seed, 4 * cdiv(p.seqlen_k, 64), p.seqlen_q, p.drop_threshold, p.keep_scale),
        )  # fmt: skip
        return dq_acc.to(q.dtype).view(q.shape), dk.view(k.shape), dv.view(v.shape)


LSE_LOADS = ("tma", "load", "tma-unaligned")
SHARED_LIMIT = 232448 - 1024  # the H200's shared memory per block, less room for the mbarriers and alignment


def shared_bytes(
    block_m: int, headdim: int, stages: int, dq_tma: bool, lse_tma: bool, dropout: bool, dq_cols: int
) -> int:
    """The shared memory of a build, in bytes (without its mbarriers): the (Q, dO) ring, the block's K and
    V, two dSᵀ buffers (the split build: Pᵀ and dSᵀ), the dQ staging tiles (one per warpgroup, dq_cols
    wide), the ring's LSE and Δ tiles and the dropout draws."""
    split = headdim in SPLIT_HEAD_DIMS
    keys = WG_KEYS if split else 2 * WG_KEYS
    total = 2 * stages * block_m * headdim * 2 + 2 * keys * headdim * 2 + 2 * keys * block_m * 2
    total += 2 * block_m * dq_cols * 4 if dq_tma else 0
    total += 2 * stages * block_m * 4 if lse_tma else 0
    return total + (keys * block_m if dropout else 0)


@functools.cache
def _dq_layout(rows: int, headdim: int):
    """The shared-memory layout of an fp32 ``rows × headdim`` dQ staging tile (made once: ~7 µs of host
    time a call otherwise)."""
    return gl.NVMMASharedLayout.get_default_for([rows, headdim], gl.float32)


LAUNCHER = Launcher(_bwd_kernel)  # (kernels.launch: the build chosen once per launch key)
