"""MLA decoding in Gluon, programs of 64 query rows (``kernels.decode.mla``'s schedule, outputs and partials).

The portable kernel's 64-row build (two warpgroups over the ``[64, 512]`` accumulator) computes q·kᵀ twice:
Triton lays a chained dot's warps along its rows (``warpsPerCTA [8, 1]``), and 64 rows over 8 warps give
each warpgroup the whole ``[64, 64]`` score tile, which with a 576-wide latent is over half the work of a
key tile; the build also spills (624 bytes a thread on Triton 3.6, docs/perf.md "Compiler resources").
Here the layouts are chosen, as FlashMLA's split does:

- the two warpgroups share every tile: the scores ``[64, 64]`` split by key columns (each warpgroup 32 keys
  of every row, warps ``[4, 2]``), the output ``[64, 512]`` by value columns (each 256);
- q (the program's 64 rows, ``[64, 512]`` + ``[64, 64]`` rotary) stays in shared memory for every key tile
  of a sequence; key tiles (a page of 64 cache rows each) arrive by TMA into ``STAGES`` buffers (two: the
  next page in flight while one is computed, 224 KB of shared memory in all);
- P goes through shared memory (bf16/fp16), as both warpgroups multiply all 64 keys' P by their half of
  the values, which are the same shared key tile's first 512 columns.

One key tile: Q·Kᵀ (``[64, 576] x [576, 64]``, each warpgroup its 32 keys), the online softmax (row max and
sum across the warpgroups), P to shared memory, P·V (``[64, 64] x [64, 512]``, each warpgroup its 256
values). Rows of a sequence's last page past its length are zeroed in shared memory first (a cache's unused
rows may hold any bits: 0·NaN is NaN). What the call needs that this kernel does not do (the deferred index
checks) runs in the portable module's ``_check_parts``; the combine starts when this kernel ends (no early
dependent launch). Only DeepSeek's geometry runs here (``eligible``): one kv head, a 512-wide latent with 64
rotary dims, pages of 64 rows laid out contiguously, bf16/fp16. ``MLASettings.gluon`` sends the 64-row
programs here, ``gluon_narrow`` those of fewer rows too (memory-bound decoding: 16 heads pad to a wgmma's
64 rows, compute the memory bound leaves idle). Gluon kernels do not run in Triton's interpreter: this one
is tested on the GPU against the reference (tests/api/test_mla.py) and as built for sm_90a without one
(tests/kernels/test_sm90_builds.py).
"""

from __future__ import annotations

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

from tileattn.kernels.gluon.common import tile_layout
from tileattn.kernels.launch import Launcher

D_LATENT = 512  # the values: the latent's first 512 dims
D_ROPE = 64  # the rotary dims after them
ROWS = 64  # query rows per program (one wgmma M; two warpgroups split the columns)
PAGE = 64  # cache rows per page: one key tile
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _part_keys(Seqlens, b, begin_idx, end_idx, begin_seq, end_seq, capacity, BLOCK_N: gl.constexpr):
    """``(seqlen_k, lo, k_end)`` of sequence b in the part: ``kernels.decode.mla._part_keys``, in Gluon."""
    seqlen_k = gl.minimum(gl.maximum(gl.load(Seqlens + b), 0), capacity)
    k_end = seqlen_k
    if b == end_idx:
        k_end = gl.minimum(gl.maximum(end_seq, 0), seqlen_k)
        if k_end < seqlen_k:  # a split point rounds down to a whole tile, as the next part's start does
            k_end = k_end // BLOCK_N * BLOCK_N
    lo = 0
    if b == begin_idx:
        lo = gl.minimum(gl.maximum(begin_seq, 0), k_end) // BLOCK_N * BLOCK_N
    return seqlen_k, lo, k_end


@gluon.jit
def _q_rows(Q_b, row0, group, n_rows, stride_qm, stride_qh, COL0: gl.constexpr, BLOCK_M: gl.constexpr,
            COLS: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Columns ``COL0 .. COL0 + COLS`` of the program's query rows (row r: token ``r // group``, head ``r %
    group``) in ``layout``; rows past ``n_rows`` as 0."""
    r = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    row = (r // group).to(gl.int64) * stride_qm + (r % group).to(gl.int64) * stride_qh
    col = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    return gl.load(Q_b + row[:, None] + col[None, :], mask=(r < n_rows)[:, None], other=0.0)


@gluon.jit
def _fetch(k_desc, e_desc, k_smem, e_smem, ready, Table_row, tile, table_pages, num_pages):
    """Key tile ``tile`` of a sequence into a stage: its page from the block table, clamped to the pool as
    ``paging.pool_page`` does (one unsigned minimum: a negative entry reads the last page)."""
    col = gl.minimum(tile, table_pages - 1)
    last = gl.cast(num_pages - 1, gl.int32).to(gl.uint32)  # (gl.cast: an int argument equal to 1 is a constant)
    page = gl.minimum(gl.load(Table_row + col).to(gl.uint32, bitcast=True), last).to(gl.int32, bitcast=True)
    mbarrier.expect(ready, k_desc.block_type.nbytes + e_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [page * k_desc.block_type.shape[0], 0], ready, k_smem)
    tma.async_copy_global_to_shared(e_desc, [page * e_desc.block_type.shape[0], 0], ready, e_smem)


@gluon.jit
def _mla_kernel(
    k_desc, e_desc, Q, Out, Lse, OutP, LseP, Table, Seqlens, Meta, SplitOffsets,
    stride_qb, stride_qm, stride_qh, stride_tb, stride_meta,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh, stride_ps, stride_pls,
    batch, group, seqlen_q, num_pages, table_pages, num_slots, qk_scale,
    CAUSAL: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Program (row block, kv head 0, part): ``kernels.decode.mla._mla_fwd``'s contract (the part's row of
    ``Meta``, outputs or fp32 partials, every index clamped) for 64 query rows over 8 warps.
    ``k_desc`` reads ``[PAGE, 512]`` tiles of the cache's rows, ``e_desc`` ``[PAGE, 64]`` of their
    rotary dims (row ``page * PAGE + n``)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D_V: gl.constexpr = k_desc.block_type.shape[1]
    D_E: gl.constexpr = e_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = 64
    dtype: gl.constexpr = k_desc.dtype
    # the scores split by keys, the output by values, between the two warpgroups
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_V // 2, 16]
    )
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_load: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # [8, 256] a pass
    e_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # [32, 64] a pass
    q_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, D_V], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_V], dtype)
    )
    qe_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, D_E], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_E], dtype)
    )
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    )
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], k_desc.layout)
    e_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_E], e_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    pid_m = gl.program_id(0)
    part = gl.program_id(2)
    nheads = group  # (one kv head)
    n_rows = seqlen_q * group
    meta = Meta + part * stride_meta
    begin_idx = gl.maximum(gl.load(meta), 0)
    begin_seq = gl.load(meta + 1)
    end_idx = gl.minimum(gl.load(meta + 2), batch - 1)
    end_seq = gl.load(meta + 3)
    begin_split = gl.load(meta + 4)
    capacity = table_pages * BLOCK_N
    row0 = pid_m * BLOCK_M
    m_first = row0 // group
    m_last = (gl.minimum(row0 + BLOCK_M, n_rows) - 1) // group
    r_s = row0 + gl.arange(0, BLOCK_M, layout=s_rows)  # the query rows as the scores hold them
    i_s = r_s // group  # (their tokens: the causal mask)
    key_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    it = 0  # key tiles so far: the stages' index and phase
    for b in range(begin_idx, end_idx + 1):
        b64 = b.to(gl.int64)
        seqlen_k, lo, k_end = _part_keys(Seqlens, b, begin_idx, end_idx, begin_seq, end_seq, capacity, BLOCK_N)
        causal_end = seqlen_k - seqlen_q + 1  # token i sees keys below causal_end + i
        hi = k_end
        full_hi = k_end
        if CAUSAL:
            hi = gl.minimum(hi, gl.maximum(causal_end + m_last, 0))
            full_hi = gl.minimum(full_hi, gl.maximum(causal_end + m_first, 0))
        full_hi = gl.maximum(lo + (full_hi - lo) // BLOCK_N * BLOCK_N, lo)  # whole unmasked tiles
        hi = gl.maximum(hi, full_hi)
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        Table_row = Table + b64 * stride_tb
        # the first STAGES tiles in flight while q is stored (the last sequence's tiles are all consumed)
        for t in gl.static_range(STAGES):
            if t < n_tiles:
                stage = (it + t) % STAGES
                _fetch(k_desc, e_desc, k_smem.index(stage), e_smem.index(stage), ready.index(stage), Table_row,
                       lo // BLOCK_N + t, table_pages, num_pages)  # fmt: skip
        # (the row offsets made here and after the key loop, not kept through it: its registers are full)
        Q_b = Q + b64 * stride_qb
        q_smem.store(_q_rows(Q_b, row0, group, n_rows, stride_qm, stride_qh, 0, BLOCK_M, D_V, q_load))
        qe_smem.store(_q_rows(Q_b, row0, group, n_rows, stride_qm, stride_qh, D_V, BLOCK_M, D_E, e_load))
        fence_async_shared()  # (the generic proxy's writes, seen by the wgmmas' async proxy)
        gl.thread_barrier()  # (every warp's rows, before either warpgroup's wgmma reads them)
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=s_rows)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
        acc = gl.zeros([BLOCK_M, D_V], gl.float32, layout=o_layout)
        for j in range(n_tiles):
            stage = it % STAGES
            mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
            start_n = lo + j * BLOCK_N
            keys = k_smem.index(stage)
            if start_n + BLOCK_N > k_end:  # the sequence's (or part's) last page: rows past its end as 0
                rows_past = (start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, e_load))) >= k_end
                for c in gl.static_range(D_V // D_E):  # (in [64, 64] parts: few registers beside acc)
                    cols = keys.slice(c * D_E, D_E, dim=1)
                    cols.store(gl.where(rows_past[:, None], 0.0, cols.load(e_load)).to(dtype))
                fence_async_shared()
                gl.thread_barrier()
            s_acc = warpgroup_mma(q_smem, keys.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_acc = warpgroup_mma(qe_smem, e_smem.index(stage).permute((1, 0)), s_acc, is_async=True)
            s_acc = warpgroup_mma_wait(0, deps=(s_acc,))
            s = s_acc * qk_scale  # (log2 domain)
            if start_n + BLOCK_N > full_hi:  # keys past the part's end, or (CAUSAL) past a row token's last
                seen = (start_n + key_s)[None, :] < k_end
                if CAUSAL:
                    seen = seen & ((start_n + key_s)[None, :] < causal_end + i_s[:, None])
                s = gl.where(seen, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p_smem.store(p.to(dtype))  # (both warpgroups' last P·V read it: waited for below, then a barrier)
            fence_async_shared()
            gl.thread_barrier()  # (all 64 keys' P, before either warpgroup's P·V)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            acc = warpgroup_mma(p_smem, keys, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            gl.thread_barrier()  # (both warpgroups done with the stage and with P)
            if j + STAGES < n_tiles:
                _fetch(k_desc, e_desc, keys, e_smem.index(stage), ready.index(stage), Table_row,
                       lo // BLOCK_N + j + STAGES, table_pages, num_pages)  # fmt: skip
            it += 1

        seen_any = l_i > 0.0
        l_safe = gl.where(seen_any, l_i, 1.0)
        out = acc / gl.convert_layout(l_safe, o_rows)[:, None]
        lse = (m_i + gl.log2(l_safe)) * LN2  # (natural log)
        r_o = row0 + gl.arange(0, BLOCK_M, layout=o_rows)
        col_o = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
        first = gl.load(SplitOffsets + b)
        lse_at = b64 * stride_lb + (r_s % group) * stride_lh + r_s // group
        if gl.load(SplitOffsets + b + 1) - first <= 1:  # the sequence is this part's alone: the output
            row_o = (r_o // group).to(gl.int64) * stride_om + (r_o % group).to(gl.int64) * stride_oh
            O_b = Out + b64 * stride_ob + row_o[:, None]
            gl.store(O_b + col_o[None, :], out.to(Out.dtype.element_ty), mask=(r_o < n_rows)[:, None])
            gl.store(Lse + lse_at, gl.where(seen_any, lse, float("inf")), mask=r_s < n_rows)
        else:  # a split: fp32 partials in its slot, for the combine
            slot = first
            if b == begin_idx:
                slot += begin_split
            slot = gl.minimum(gl.maximum(slot, 0), num_slots - 1).to(gl.int64)
            row_p = ((r_o // group) * nheads + r_o % group).to(gl.int64) * D_V  # (token, head) contiguous
            P_b = OutP + slot * stride_ps + row_p[:, None]
            gl.store(P_b + col_o[None, :], out, mask=(r_o < n_rows)[:, None])
            lse_p = LseP + slot * stride_pls + (r_s % group) * seqlen_q + r_s // group
            gl.store(lse_p, gl.where(seen_any, lse, float("-inf")), mask=r_s < n_rows)
        gl.thread_barrier()  # (every warp done with q before the next sequence's is stored)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


LAUNCHER = Launcher(_mla_kernel)


def eligible(q: torch.Tensor, kv: torch.Tensor, head_dim_v: int) -> bool:
    """Whether this call's programs can run here (64 query rows each, fewer padded): DeepSeek's geometry
    (one kv head, 512 values and 64 rotary dims), pages of 64 cache rows laid out one after another
    (``kv`` viewable as ``(pages * 64, 576)`` rows for TMA), bf16/fp16."""
    d = q.shape[-1]
    num_pages, page_size, nheads_k, d_k = kv.shape
    return (
        head_dim_v == D_LATENT
        and d == d_k == D_LATENT + D_ROPE
        and nheads_k == 1
        and page_size == PAGE
        and q.dtype in (torch.bfloat16, torch.float16)
        and kv.dtype == q.dtype
        and kv.stride() == (PAGE * d, d, d, 1)
        and kv.data_ptr() % 16 == 0
    )


def mla_fwd_gluon(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    out_p: torch.Tensor,
    lse_p: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale_log2: float,
    causal: bool,
    stages: int = 2,
) -> None:
    """Launches the kernel for an ``eligible`` call into ``kernels.decode.mla.mla_fwd``'s outputs and
    partials (the combine is the caller's)."""
    if stages not in (1, 2):
        raise ValueError(f"stages must be 1 or 2 (a third stage of 72 KB passes shared memory's 227 KB), got {stages}")
    batch, seqlen_q, nheads, d = q.shape
    num_pages = kv.shape[0]
    rows = kv.view(num_pages * PAGE, d)
    k_desc = TensorDescriptor.from_tensor(rows[:, :D_LATENT], [PAGE, D_LATENT], tile_layout(PAGE, D_LATENT, kv.dtype))
    e_desc = TensorDescriptor.from_tensor(rows[:, D_LATENT:], [PAGE, D_ROPE], tile_layout(PAGE, D_ROPE, kv.dtype))
    per_slot = seqlen_q * nheads
    num_parts = metadata.shape[0]
    LAUNCHER(
        ((seqlen_q * nheads + ROWS - 1) // ROWS, 1, num_parts),
        (
            k_desc,
            e_desc,
            q,
            out,
            lse,
            out_p,
            lse_p,
            block_table,
            seqlens,
            metadata,
            num_splits,
            *q.stride()[:3],
            block_table.stride(0),
            metadata.stride(0),
            *out.stride()[:3],
            *lse.stride()[:2],
            per_slot * D_LATENT,
            per_slot,
            batch,
            nheads,
            seqlen_q,
            num_pages,
            block_table.shape[1],
            batch + num_parts,
            softmax_scale_log2,
        ),  # fmt: skip
        {"CAUSAL": causal, "STAGES": stages},
        num_warps=8,
    )
