"""The Gluon backward's split build for head dim 256, where one warpgroup's dK and dV of 64 keys would
take all its registers: one program per (64 keys, kv head, batch entry), both consumer warpgroups on
those keys, each keeping dK and dV of half the head dim. Per query tile a warpgroup computes Sᵀ and dPᵀ
of half the tile's queries, both write their Pᵀ and dSᵀ columns into shared [64 keys × BLOCK_M] tiles
(``ds_ready``: both halves in; ``ds_free``: both warpgroups' products have read them), and each takes
those tiles as shared-memory A operands for its columns of dV and dK, and of dQ in chunks of
``DQ_CHUNK`` columns, each added into the fp32 dQ buffer. The loader, the tile ranges and the mask are
the other build's (``gluon.backward_common``); ``gluon.backward.attn_bwd`` launches it. Dropout draws
its mask on each warpgroup's half tile (``gluon.dropout``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tileattn.kernels.gluon.backward_common import LOG2E_C, add_dq, loader, masked_scores, query_tiles, ring
from tileattn.kernels.gluon.common import sequence
from tileattn.kernels.gluon.dropout import WORD_SMEM, dropout_kept, dropout_words, kept
from tileattn.kernels.gluon.rows import row_start
from tileattn.kernels.launch import Launcher

HEAD_DIMS = (256,)
DQ_CHUNKS = (32, 64)  # dQ columns per product and reduce-add (``attn_bwd``'s dq_chunk)


@gluon.jit
def _split_dq(ds_smem, k_smem, dq_zero, COL: gl.constexpr):
    """Issues the split build's dQ columns ``[COL, COL + DQ_CHUNK)`` of one query tile: ``[BLOCK_M, DQ_CHUNK]
    = dS·K[:, cols]`` over the program's keys (asynchronous; ``add_dq`` adds the result)."""
    DQ_CHUNK: gl.constexpr = dq_zero.type.shape[1]
    return warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(COL, DQ_CHUNK, dim=1), dq_zero, use_acc=False,
                         is_async=True)  # fmt: skip


@gluon.jit
def _consume_split(
    args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_TMA: gl.constexpr, LSE_TMA: gl.constexpr,
    VARLEN: gl.constexpr, DROPOUT: gl.constexpr, DQ_FIRST: gl.constexpr, WG: gl.constexpr,
):  # fmt: skip
    """The split build's consumer (head dim 256, where one warpgroup's dK and dV of 64 keys would take all
    its registers): both warpgroups own the program's 64 keys, and each keeps dK and dV of half the head
    dim. Per query tile, warpgroup WG computes Sᵀ and dPᵀ for its half of the queries (K·Qᵀ and V·dOᵀ
    over the whole head dim), writes its Pᵀ and dSᵀ columns into shared tiles of all 64 x BLOCK_M, and,
    once both halves are in, adds Pᵀ·dO and dSᵀ·Q into its columns of dV and dK and computes its columns
    of dQ = dS·K in chunks of DQ_CHUNK, each added into the fp32 dQ buffer; the stage's Q and dO go back
    to the loader as soon as dV and dK have read them, so that the next tile's arrive under this one's
    remaining dQ chunks (docs/perf.md, "Gluon backward"). Dropout as the other build
    draws it (``gluon.dropout``), on each warpgroup's [64 keys × BLOCK_M / 2] tile: the shared Pᵀ holds the
    kept weights, rescaled."""
    (q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc,
     q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
     kv_ready, q_ready, do_ready, free, ds_ready,
     DQacc, DK, DV, Lse, Delta, CuQ, CuK, stride_dqm, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
     nheads, group, seqlen_q, seqlen_k, window, lse_stride, qk_scale, sm_scale, layouts, pds, dropout) = args  # fmt: skip
    p_smem, ds_free = pds  # (the loader takes these two as its dropout arguments and ignores them)
    rng_smem, rng = dropout
    seed, row_groups, rng_rows, drop_threshold, inv_keep = rng
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    HALF_M: gl.constexpr = BLOCK_M // 2  # the queries of this warpgroup's Sᵀ and dPᵀ
    D_HALF: gl.constexpr = HEAD_DIM // 2  # this warpgroup's columns of dK, dV and dQ
    DQ_CHUNK: gl.constexpr = dq_desc.block_type.shape[1]
    gl.static_assert(D_HALF // DQ_CHUNK > (1 if DQ_FIRST else 0), "a dQ chunk after dV and dK")
    STAGES: gl.constexpr = q_smem.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_HALF, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_CHUNK, 16]
    )
    key_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs = gl.arange(0, HALF_M, layout=gl.BlockedLayout([1], [32], [4], [0]))  # this half's LSE/Δ (loads)
    n_start = gl.program_id(0) * KEYS
    h_k = gl.program_id(1)
    b = gl.program_id(2)
    q0, seqlen_q, k0, seqlen_k = sequence(CuQ, CuK, b, seqlen_q, seqlen_k, VARLEN)
    keys = n_start + gl.arange(0, KEYS, layout=key_rows)
    s_zero = gl.zeros([KEYS, HALF_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_CHUNK], gl.float32, layout=dq_layout)
    dk = gl.zeros([KEYS, D_HALF], gl.float32, layout=acc_layout)
    dv = gl.zeros([KEYS, D_HALF], gl.float32, layout=acc_layout)
    m_lo, num_m = query_tiles(n_start, seqlen_q, seqlen_k, window, BLOCK_M, KEYS, MASK_LEFT, MASK_RIGHT)
    mbarrier.wait(kv_ready, 0)
    it = 0  # (Q, dO) tiles consumed so far: the ring's stage and phase, and the Pᵀ/dSᵀ tiles' phase
    for g in range(group):
        h = h_k * group + g
        lse_row = row_start(b, h, nheads, q0, lse_stride, VARLEN, LSE_TMA).to(gl.int64)
        rng_row = (b * nheads + h).to(gl.int64) * rng_rows * row_groups  # (b, h)'s first dropout counter
        for m in range(m_lo, num_m):
            s = it % STAGES
            phase = (it // STAGES) & 1
            m_start = m * BLOCK_M
            half_start = m_start + WG * HALF_M  # this warpgroup's first query
            cols = half_start + gl.arange(0, HALF_M, layout=q_cols)
            if not LSE_TMA:
                in_seq = half_start + offs < seqlen_q
                lse_ld = gl.load(Lse + lse_row + half_start + offs, mask=in_seq, other=float("inf"))
                delta_ld = gl.load(Delta + lse_row + half_start + offs, mask=in_seq, other=0.0)
            q = q_smem.index(s)
            do = do_smem.index(s)
            if DROPOUT:  # (before the products, as the other build)
                dropout_words(seed, rng_row, half_start, n_start, row_groups, rng_smem, WG)
            mbarrier.wait(q_ready.index(s), phase)
            # [KEYS, HALF_M] = k @ q[half]ᵀ, then [KEYS, HALF_M] = v @ dO[half]ᵀ
            st = warpgroup_mma(k_smem, q.slice(WG * HALF_M, HALF_M).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)  # fmt: skip
            mbarrier.wait(do_ready.index(s), phase)
            dpt = warpgroup_mma(v_smem, do.slice(WG * HALF_M, HALF_M).permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)  # fmt: skip
            st = warpgroup_mma_wait(1, deps=(st,))
            st = masked_scores(
                st, keys, cols, half_start, n_start, seqlen_q, seqlen_k, window, KEYS, HALF_M, MASK_LEFT, MASK_RIGHT
            )
            if LSE_TMA:
                lse_in = lse_smem.index(s).slice(WG * HALF_M, HALF_M).load(q_cols)
                delta_in = delta_smem.index(s).slice(WG * HALF_M, HALF_M).load(q_cols)
            else:
                lse_in = gl.convert_layout(lse_ld, q_cols)
                delta_in = gl.convert_layout(delta_ld, q_cols)
            pt = gl.exp2(st * qk_scale - (lse_in * LOG2E_C)[None, :])  # [KEYS, HALF_M], 0 where hidden
            if DROPOUT:  # dV sees the kept weights, rescaled; pt keeps the mask in its sign bit (pt >= +0)
                pt = gl.where(dropout_kept(rng_smem, drop_threshold, s_layout, WG), pt, -pt)
                p_kept = gl.where(kept(pt), pt, 0.0) * inv_keep
            else:
                p_kept = pt
            dpt = warpgroup_mma_wait(0, deps=(dpt,))
            if DROPOUT:  # dP through the mask (a dropped weight's gradient is 0)
                dpt = gl.where(kept(pt), dpt * inv_keep, 0.0)
                pt = gl.abs(pt)
            ds = pt * (dpt - delta_in[None, :])  # [KEYS, HALF_M] = dSᵀ
            # both halves into the shared Pᵀ and dSᵀ tiles, once both warpgroups' last products read them
            mbarrier.wait(ds_free, (it & 1) ^ 1)
            p_smem.slice(WG * HALF_M, HALF_M, dim=1).store(p_kept.to(dtype))
            ds_smem.slice(WG * HALF_M, HALF_M, dim=1).store(ds.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_ready, count=1)
            mbarrier.wait(ds_ready, it & 1)
            # [KEYS, D_HALF] += pᵀ @ dO[:, cols], then [KEYS, D_HALF] += dsᵀ @ q[:, cols]
            # (DQ_FIRST: dQ's first chunk issued before dV and dK, so that its reduce-add runs under them)
            if DQ_FIRST:
                dq = _split_dq(ds_smem, k_smem, dq_zero, WG * D_HALF)
            dv = warpgroup_mma(p_smem, do.slice(WG * D_HALF, D_HALF, dim=1), dv, is_async=True)
            dk = warpgroup_mma(ds_smem, q.slice(WG * D_HALF, D_HALF, dim=1), dk, is_async=True)
            if DQ_FIRST:
                dq = warpgroup_mma_wait(2, deps=(dq,)) * sm_scale
                add_dq(dq, dq_smem, dq_desc, DQacc, q0, m_start, seqlen_q, stride_dqm, h * HEAD_DIM + WG * D_HALF,
                       DQ_TMA, WG)  # fmt: skip
            for c in gl.static_range(1 if DQ_FIRST else 0, D_HALF // DQ_CHUNK):
                # [BLOCK_M, DQ_CHUNK] = ds @ k[:, chunk]
                dq = _split_dq(ds_smem, k_smem, dq_zero, WG * D_HALF + c * DQ_CHUNK)
                if c == (1 if DQ_FIRST else 0):  # dV and dK done (the chunk just issued runs on): the stage's
                    dv, dk = warpgroup_mma_wait(1, deps=(dv, dk))  # Q and dO read for the last time, the
                    mbarrier.arrive(free.index(s), count=1)  # loader refills it under this tile's dQ
                dq = warpgroup_mma_wait(0, deps=(dq,)) * sm_scale
                add_dq(dq, dq_smem, dq_desc, DQacc, q0, m_start, seqlen_q, stride_dqm,
                       h * HEAD_DIM + WG * D_HALF + c * DQ_CHUNK, DQ_TMA, WG)  # fmt: skip
            mbarrier.arrive(ds_free, count=1)  # this warpgroup's products have read Pᵀ and dSᵀ
            it += 1
    if DQ_TMA:
        tma.store_wait(0)

    # this warpgroup's columns of dK = dSᵀ·Q · scale and dV = Pᵀ·dO; keys past the sequence are not written
    d_cols = WG * D_HALF + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, acc_layout))
    out_rows = n_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    mask = (out_rows < seqlen_k)[:, None]
    dk_ptrs = DK + h_k * stride_dkh + (k0 + out_rows).to(gl.int64)[:, None] * stride_dkn
    gl.store(dk_ptrs + d_cols[None, :], (dk * sm_scale).to(dtype), mask=mask)
    dv_ptrs = DV + h_k * stride_dvh + (k0 + out_rows).to(gl.int64)[:, None] * stride_dvn
    gl.store(dv_ptrs + d_cols[None, :], dv.to(dtype), mask=mask)


@gluon.jit
def _consume_split_default(args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_TMA: gl.constexpr,
                           LSE_TMA: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr,
                           DQ_FIRST: gl.constexpr):  # fmt: skip
    _consume_split(args, MASK_LEFT, MASK_RIGHT, DQ_TMA, LSE_TMA, VARLEN, DROPOUT, DQ_FIRST, 0)


@gluon.jit
def _consume_split_worker(args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_TMA: gl.constexpr,
                          LSE_TMA: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr,
                          DQ_FIRST: gl.constexpr):  # fmt: skip
    _consume_split(args, MASK_LEFT, MASK_RIGHT, DQ_TMA, LSE_TMA, VARLEN, DROPOUT, DQ_FIRST, 1)


@gluon.jit(do_not_specialize=["philox_seed", "row_groups", "rng_rows", "drop_threshold"])
def _bwd_split_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc, DQacc, DK, DV, Lse, Delta, CuQ, CuK,
    stride_dqm, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    nheads, group, seqlen_q, seqlen_k, window_left, window_right, lse_stride, qk_scale, sm_scale,
    q_batch_rows, q_head_rows, q_head_cols, do_batch_rows, do_head_rows, do_head_cols,
    k_batch_rows, k_head_rows, k_head_cols, v_batch_rows, v_head_rows, v_head_cols,
    philox_seed, row_groups, rng_rows, drop_threshold, inv_keep,
    STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, DQ_TMA: gl.constexpr,
    LSE_TMA: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr, DQ_FIRST: gl.constexpr,
):  # fmt: skip
    """``_bwd_kernel``'s split build (``_consume_split``): one program per 64 keys, both consumer
    warpgroups on those keys, each with half the head dim of dK and dV. ``DQ_FIRST``: each tile's first
    dQ chunk is issued before dV and dK, its reduce-add running under them."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    DQ_CHUNK: gl.constexpr = dq_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [KEYS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [KEYS, HEAD_DIM], v_desc.layout)
    pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_M], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [KEYS, BLOCK_M], pt_layout)  # Pᵀ of the tile, both halves
    ds_smem = gl.allocate_shared_memory(dtype, [KEYS, BLOCK_M], pt_layout)  # dSᵀ
    if DQ_TMA:  # each warpgroup's staging buffer for its dQ reduce-adds
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_CHUNK], dq_desc.layout)
    else:
        dq_smem = ds_smem
    if DROPOUT:  # each warpgroup's dropout draws of its half tile
        rng_smem = gl.allocate_shared_memory(gl.uint32, [2 * 16, BLOCK_M // 2], WORD_SMEM)
    else:
        rng_smem = ds_smem
    lse_smem, delta_smem, kv_ready, q_ready, do_ready, free = ring(lse_desc, delta_desc, ds_smem, STAGES, BLOCK_M,
                                                                   LSE_TMA)  # fmt: skip
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ds_ready, count=2)  # both warpgroups' halves of Pᵀ and dSᵀ written
    mbarrier.init(ds_free, count=2)  # both warpgroups' products have read them

    args = (q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc,
            q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
            kv_ready, q_ready, do_ready, free, ds_ready,
            DQacc, DK, DV, Lse, Delta, CuQ, CuK, stride_dqm, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
            nheads, group, seqlen_q, seqlen_k, (window_left, window_right), lse_stride, qk_scale, sm_scale,
            ((q_batch_rows, q_head_rows, q_head_cols), (do_batch_rows, do_head_rows, do_head_cols),
             (k_batch_rows, k_head_rows, k_head_cols), (v_batch_rows, v_head_rows, v_head_cols)),
            (p_smem, ds_free), (rng_smem, (philox_seed, row_groups, rng_rows, drop_threshold, inv_keep)))  # fmt: skip
    gl.warp_specialize(
        [
            (_consume_split_default, (args, MASK_LEFT, MASK_RIGHT, DQ_TMA, LSE_TMA, VARLEN, DROPOUT, DQ_FIRST)),
            (_consume_split_worker, (args, MASK_LEFT, MASK_RIGHT, DQ_TMA, LSE_TMA, VARLEN, DROPOUT, DQ_FIRST)),
            (loader, (args, MASK_LEFT, MASK_RIGHT, LSE_TMA, VARLEN)),
        ],
        [4, 1],
        [240, 24],
    )


LAUNCHER = Launcher(_bwd_split_kernel)  # (kernels.launch: the build chosen once per launch key)
