"""What the Gluon backward's two builds share (``gluon.backward``: two warpgroups of 64 keys each;
``gluon.backward_split``: both on 64 keys, each with half the head dim): the loader partition, which
query tiles a key block sees, the scores' mask, and the TMA reduce-add that adds a dQ tile into the fp32
buffer."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as gl_core
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from tileattn.kernels.gluon.common import LOG2E, sequence, start
from tileattn.kernels.gluon.rows import row_start

WG_KEYS = 64  # keys per consumer warpgroup (the wgmma M of one warpgroup)
LOG2E_C = gl.constexpr(LOG2E)


@gl_core.builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord] += src`` by a TMA bulk reduction from shared memory (cp.reduce.async.bulk.tensor):
    the op Gluon's builder has but Triton 3.6's ``hopper.tma`` does not export. Complete (its read of
    ``src`` done) after ``tma.store_wait``."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def query_tiles(n_start, seqlen_q, seqlen_k, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
           MASK_RIGHT: gl.constexpr):  # fmt: skip
    """The query tiles ``[first, end)`` that see a key of the block of ``BLOCK_N`` keys starting at n_start
    (query i sees key j iff ``i + shift - window_left <= j <= i + shift + window_right``, the sides
    MASK_LEFT and MASK_RIGHT bound, shift = seqlen_k - seqlen_q; causal: window_right 0): from the tile
    whose last row reaches the block's first key, to the one whose first row still reaches its last;
    none where the block starts past the sequence's keys (a packed batch's grid covers its longest)."""
    window_left, window_right = window
    shift = seqlen_k - seqlen_q
    first = 0
    if MASK_RIGHT:
        first = gl.maximum(n_start - shift - window_right, 0) // BLOCK_M
    end = gl.cdiv(seqlen_q, BLOCK_M)
    if MASK_LEFT:
        end = gl.minimum(end, gl.cdiv(gl.maximum(n_start + BLOCK_N - shift + window_left, 0), BLOCK_M))
    if n_start >= seqlen_k:
        end = 0
    return first, end


@gluon.jit
def loader(args, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, LSE_TMA: gl.constexpr, VARLEN: gl.constexpr):
    (q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc,
     q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
     kv_ready, q_ready, do_ready, free, ds_ready,
     DQacc, DK, DV, Lse, Delta, CuQ, CuK, stride_dqm, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
     nheads, group, seqlen_q, seqlen_k, window, lse_stride, qk_scale, sm_scale, layouts, rng_smem, rng) = args  # fmt: skip
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]  # the program's keys: one or two K tiles
    STAGES: gl.constexpr = q_smem.type.shape[0]
    n_start = gl.program_id(0) * BLOCK_N
    h_k = gl.program_id(1)
    b = gl.program_id(2)
    q0, seqlen_q, k0, seqlen_k = sequence(CuQ, CuK, b, seqlen_q, seqlen_k, VARLEN)
    q_lay, do_lay, k_lay, v_lay = layouts  # (where each tensor's heads lie in its TMA matrix: TmaRows)
    # the block's K and V, once: each warpgroup's half as its own tile (or the split build's one tile)
    k_row, k_col = start(b, k0, h_k, k_lay, VARLEN)
    v_row, v_col = start(b, k0, h_k, v_lay, VARLEN)
    mbarrier.expect(kv_ready, (BLOCK_N // KEYS) * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for i in gl.static_range(BLOCK_N // KEYS):
        key = n_start + i * KEYS
        tma.async_copy_global_to_shared(k_desc, [k_row + key, k_col], kv_ready, k_smem.slice(i * KEYS, KEYS))
        tma.async_copy_global_to_shared(v_desc, [v_row + key, v_col], kv_ready, v_smem.slice(i * KEYS, KEYS))
    m_lo, num_m = query_tiles(n_start, seqlen_q, seqlen_k, window, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    it = 0  # (Q, dO) tiles loaded so far: the ring's stage and phase
    for g in range(group):
        h = h_k * group + g
        lse_row = row_start(b, h, nheads, q0, lse_stride, VARLEN, LSE_TMA)  # (b, h)'s LSE and Δ in their flat rows
        q_row, q_col = start(b, q0, h, q_lay, VARLEN)
        do_row, do_col = start(b, q0, h, do_lay, VARLEN)
        for m in range(m_lo, num_m):
            s = it % STAGES
            m_start = m * BLOCK_M
            mbarrier.wait(free.index(s), ((it // STAGES) & 1) ^ 1)  # both consumers are done with the stage
            if LSE_TMA:  # (16-byte-aligned starts where lse_stride is a multiple of 4, as dense_rows makes it)
                mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q_row + m_start, q_col], q_ready.index(s), q_smem.index(s))
                tma.async_copy_global_to_shared(lse_desc, [lse_row + m_start], q_ready.index(s), lse_smem.index(s))
                mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    do_desc, [do_row + m_start, do_col], do_ready.index(s), do_smem.index(s)
                )
                tma.async_copy_global_to_shared(delta_desc, [lse_row + m_start], do_ready.index(s), delta_smem.index(s))
            else:  # the consumers load the tile's LSE and Δ themselves
                mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [q_row + m_start, q_col], q_ready.index(s), q_smem.index(s))
                mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    do_desc, [do_row + m_start, do_col], do_ready.index(s), do_smem.index(s)
                )
            it += 1


@gluon.jit
def masked_scores(s, keys, cols, m_start, key_start, seqlen_q, seqlen_k, window, KEYS: gl.constexpr,
            BLOCK_M: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):  # fmt: skip
    """Raw transposed scores (keys x queries), -inf where a key or a query is past its sequence (the
    tile's LSE and Δ there are another head's) or the key is outside the query's window (as ``query_tiles``
    says, bottom-right aligned as flash_attn's); tiles that need no mask pass."""
    window_left, window_right = window
    shift = seqlen_k - seqlen_q
    need = (key_start + KEYS > seqlen_k) | (m_start + BLOCK_M > seqlen_q)
    if MASK_RIGHT:  # the tile's first query does not see its last key
        need = need | (key_start + KEYS - 1 > m_start + shift + window_right)
    if MASK_LEFT:  # its last query does not see its first key
        need = need | (key_start < m_start + BLOCK_M - 1 + shift - window_left)
    if need:
        hidden = (keys[:, None] >= seqlen_k) | (cols[None, :] >= seqlen_q)
        if MASK_RIGHT:
            hidden = hidden | (keys[:, None] > cols[None, :] + (shift + window_right))
        if MASK_LEFT:
            hidden = hidden | (keys[:, None] < cols[None, :] + (shift - window_left))
        s = gl.where(hidden, float("-inf"), s)
    return s


@gluon.jit
def add_dq(dq, dq_smem, dq_desc, DQacc, q0, m_start, seqlen_q, stride_dqm, col, DQ_TMA: gl.constexpr,
           WG: gl.constexpr):  # fmt: skip
    """Adds a finished dQ tile (``[BLOCK_M, cols]`` fp32, softmax_scale applied; the query tile at ``m_start``
    of the sequence whose rows start at ``q0``) into the fp32 dQ buffer at column ``col`` of all heads': a
    TMA reduce-add from warpgroup WG's staging tile (``DQ_TMA``), or atomic adds on the sequence's rows."""
    BLOCK_M: gl.constexpr = dq.type.shape[0]
    COLS: gl.constexpr = dq.type.shape[1]
    if DQ_TMA:
        dq_buf = dq_smem.index(WG)
        tma.store_wait(0)  # the last reduce-add has read the staging buffer
        dq_buf.store(dq)
        fence_async_shared()
        tma_reduce_add(dq_desc, [q0 + m_start, col], dq_buf)
    else:
        dq_layout: gl.constexpr = dq.type.layout
        rows = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        dq_cols = col + gl.arange(0, COLS, layout=gl.SliceLayout(0, dq_layout))
        dq_ptrs = DQacc + (q0 + rows).to(gl.int64)[:, None] * stride_dqm
        gl.atomic_add(dq_ptrs + dq_cols[None, :], dq, mask=(rows < seqlen_q)[:, None], sem="relaxed")


@gluon.jit
def ring(lse_desc, delta_desc, placeholder, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, LSE_TMA: gl.constexpr):
    """The ``loader``'s ring besides the Q and dO buffers: each stage's LSE and Δ tiles (``LSE_TMA``; else
    ``placeholder``, unused) and the mbarriers, initialised: ``kv_ready`` (the block's K and V in),
    ``q_ready``/``do_ready`` (a stage's Q and dO in, each with its LSE or Δ) and ``free`` (both consumer
    warpgroups are done with a stage)."""
    if LSE_TMA:
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    else:
        lse_smem = placeholder
        delta_smem = placeholder
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)  # one arrival per consumer warpgroup
    return lse_smem, delta_smem, kv_ready, q_ready, do_ready, free
