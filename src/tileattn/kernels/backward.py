"""The backward pass: Δ = rowsum(dO ∘ O), then a dK/dV pass and a dQ pass that both recompute
P = exp(S - LSE) from Q, K and the saved LSE (no N×N tensor is ever stored).

The dK/dV program owns one block of keys of one kv head and walks the query tiles of every query head
in its GQA group, so grouped gradients are summed in registers; the dQ program owns one block of
queries. A dK/dV config with ``dq_atomic`` (in the tables for causal calls at head dim 128) instead adds
each tile's dQ into an fp32 buffer from the dK/dV pass and skips the dQ pass: the order of those adds
varies, so dQ may differ in its last bits run to run. ``deterministic=True`` never takes it; the two
passes use no atomics, so their gradients are bitwise reproducible.
Features are the forward kernel's constexpr flags, through the same helpers.
"""

from dataclasses import replace

import torch
import triton
import triton.language as tl

from tileattn.kernels import common, flashmask
from tileattn.kernels.configs import bwd_dkdv_config, bwd_dq_config
from tileattn.kernels.launch import Launch, Launcher
from tileattn.params import AttnParams, Settings, cdiv


@triton.jit
def _bwd_preprocess(
    Out, DOut, Delta,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_db, stride_dh,
    seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Δ[b, h, i] = Σ_d dO[b, i, h, d] · O[b, i, h, d], in fp32 (rows are tokens of the packed layout
    in varlen mode, where seqlen is the total). Row offsets are 64-bit: a packed batch can span more
    than 2**31 elements."""
    m_block = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(
        Out + b * stride_ob + h.to(tl.int64) * stride_oh + rows * stride_om + offs_d[None, :], mask=mask, other=0.0
    )
    do = tl.load(
        DOut + b * stride_dob + h.to(tl.int64) * stride_doh + rows * stride_dom + offs_d[None, :], mask=mask, other=0.0
    )
    # o, do: [BLOCK_M, BLOCK_D]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b * stride_db + h * stride_dh + offs_m, delta, mask=offs_m < seqlen)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v,
    Q_base, DO_base, q_desc, do_desc, Lse_base, Delta_base, DQ_base, dq_desc,
    stride_qm, stride_dom, stride_dqm,
    sm_scale,
    offs_m_base, offs_n, offs_d, lo, hi, fm_bounds,
    seqlen_q, seqlen_k,
    qk_scale, softcap_scale, softcap_log2, slope_log2,
    window_left, window_right,
    philox_seed, rng_base, row_groups, drop_threshold, keep_scale,
    HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_FLASHMASK: tl.constexpr, HAS_UPPER: tl.constexpr,
    Q_MAJOR: tl.constexpr, USE_TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    """Accumulates dK, dV of one key block over query tiles [lo, hi) of one query head (Q/dO through
    descriptors with USE_TMA). With HAS_FLASHMASK, masked tiles also hide what the key block's FlashMask
    bounds ``fm_bounds`` hide (loaded once, in the score tile's key orientation).

    By default the score tile is transposed (keys are rows), so P and dS feed the dK / dV dots from
    registers. With Q_MAJOR it is queries x keys, as in the forward: dropout's draws are then the ones
    each thread holds (``common.dropout_keep``) instead of being evaluated in several lanes, and P and
    dS reach the dots transposed (through shared memory).

    With DQ_ATOMIC (1: fp32 atomic adds, 2: TMA reduce-adds through ``dq_desc``) each tile also adds its
    dS·K·scale to the fp32 dQ accumulator, so the dQ pass is not needed (its QKᵀ and dO·Vᵀ are not
    recomputed); the order of the adds varies run to run."""
    n_start = tl.min(offs_n, 0)  # the key block's first column, a multiple of BLOCK_N (dropout counters)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m_base
        q = common.load_rows(
            q_desc, Q_base, stride_qm, start_m, offs_m, seqlen_q, offs_d, HEAD_DIM, MASKED, PAD_D, USE_TMA
        )  # [BLOCK_M, BLOCK_D]
        do = common.load_rows(
            do_desc, DO_base, stride_dom, start_m, offs_m, seqlen_q, offs_d, HEAD_DIM, MASKED, PAD_D, USE_TMA
        )  # [BLOCK_M, BLOCK_D]
        if MASKED:
            lse = tl.load(Lse_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
            delta = tl.load(Delta_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
        else:
            lse = tl.load(Lse_base + offs_m)
            delta = tl.load(Delta_base + offs_m)
        # The score tile, its query / key indices, LSE and Δ broadcast along its query axis, and dP.
        if Q_MAJOR:
            qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] = q @ kᵀ
            rows_i = offs_m[:, None]
            cols_j = offs_n[None, :]
            lse_b = lse[:, None]
            delta_b = delta[:, None]
            dp = tl.dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_N] = dO @ vᵀ
        else:
            qk = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M] = k @ qᵀ
            rows_i = offs_m[None, :]
            cols_j = offs_n[:, None]
            lse_b = lse[None, :]
            delta_b = delta[None, :]
            dp = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M] = v @ dOᵀ
        s, t = common.scores(
            qk, rows_i, cols_j, seqlen_q, seqlen_k,
            qk_scale, softcap_scale, softcap_log2, slope_log2,
            window_left, window_right,
            MASKED, HAS_SOFTCAP, HAS_ALIBI, MASK_LEFT, MASK_RIGHT,
        )  # fmt: skip
        if HAS_FLASHMASK and MASKED:
            lower_start, lower_end, upper_start, upper_end = fm_bounds
            hidden = common.flashmask_hides(rows_i, lower_start, lower_end, upper_start, upper_end, HAS_UPPER)
            s = tl.where(hidden, float("-inf"), s)
        p = tl.exp2(s - lse_b * common.LOG2E)  # 0 for rows with lse=+inf
        pv = p  # the weights dV sees: p with dropout applied
        if HAS_DROPOUT:
            keep = common.dropout_keep(
                philox_seed, rng_base, offs_m, n_start, row_groups, drop_threshold, BLOCK_M, BLOCK_N
            )
            if not Q_MAJOR:
                keep = tl.trans(keep)
            inv_keep = keep_scale
            pv = tl.where(keep, p * inv_keep, 0.0)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta_b)
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)  # d(softcap·tanh(x/softcap))/dx
        if Q_MAJOR:
            dv = tl.dot(tl.trans(pv.to(do.dtype)), do, dv)  # [BLOCK_N, BLOCK_D] += pᵀ @ dO
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)  # [BLOCK_N, BLOCK_D] += dsᵀ @ q
        else:
            dv = tl.dot(pv.to(do.dtype), do, dv)
            dk = tl.dot(ds.to(q.dtype), q, dk)
        if DQ_ATOMIC != 0:
            if Q_MAJOR:
                dq = tl.dot(ds.to(q.dtype), k) * sm_scale  # [BLOCK_M, BLOCK_D] = ds @ k
            else:
                dq = tl.dot(tl.trans(ds.to(q.dtype)), k) * sm_scale
            if DQ_ATOMIC == 2:
                dq_desc.atomic_add([start_m, 0], dq)
            else:
                dq_mask = offs_m[:, None] < seqlen_q
                if PAD_D:
                    dq_mask = dq_mask & (offs_d[None, :] < HEAD_DIM)
                tl.atomic_add(DQ_base + offs_m[:, None] * stride_dqm + offs_d[None, :], dq, mask=dq_mask, sem="relaxed")
    return dk, dv


# a fresh dropout seed per call must not select a different specialisation (seed % 16 == 0)
@triton.jit(do_not_specialize=["philox_seed"])
def _attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, Lse, Delta, Alibi, CuSeqlensQ, CuSeqlensK, TileEnds, DQacc,
    Bounds, Runs, Counts, stride_bh, stride_bc, stride_rh, stride_ch, n_list,  #
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    stride_ab,
    batch, nheads, group_size, max_seqlen_q, max_seqlen_k,
    sm_scale, softcap,
    window_left, window_right,
    drop_threshold, keep_scale, philox_seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_FLASHMASK: tl.constexpr, HAS_UPPER: tl.constexpr,
    IS_VARLEN: tl.constexpr, BATCH_PAD: tl.constexpr,
    Q_MAJOR: tl.constexpr, USE_TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    """Program (key tile, kv head, batch): dK, dV of BLOCK_N keys, summed over the GQA group; with
    DQ_ATOMIC also each query head's dQ, added into the fp32 ``DQacc`` (``_dkdv_tiles``)."""
    pid = tl.program_id(0)
    h_k = tl.program_id(1)
    row_groups = 4 * ((max_seqlen_k + 63) // 64)  # dropout counters per row: 16 columns per Philox draw
    if IS_VARLEN:
        b, n_block = common.seq_tile(pid, CuSeqlensK, TileEnds, batch, BLOCK_N, BATCH_PAD)
        if b >= batch:  # one of the grid's spare programs
            return
    else:
        b = tl.program_id(2)
        n_block = pid
    q_start, seqlen_q, k_start, seqlen_k = common.seq_bounds(
        b, CuSeqlensQ, CuSeqlensK, max_seqlen_q, max_seqlen_k, IS_VARLEN
    )
    b64 = b.to(tl.int64)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    n_start = n_block * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    K_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + h_k.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + h_k.to(tl.int64) * stride_vh
    k = common.load_tile(
        K_base + offs_n[:, None] * stride_kn + offs_d[None, :], offs_n, seqlen_k, offs_d, HEAD_DIM, True, PAD_D
    )  # [BLOCK_N, BLOCK_D]
    v = common.load_tile(
        V_base + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n, seqlen_k, offs_d, HEAD_DIM, True, PAD_D
    )  # [BLOCK_N, BLOCK_D]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # the score constants here, the ALiBi slope and dropout counters for each query head below (the flags
    # each call turns off leave the other part out)
    qk_scale, softcap_scale, softcap_log2 = common.prologue(
        b, h_k, nheads, max_seqlen_q, row_groups, Alibi, stride_ab, sm_scale, softcap, HAS_SOFTCAP, False, False
    )[:3]
    query_ranges = common.query_range(
        n_start, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT
    )
    for g in range(0, group_size):
        h = h_k * group_size + g
        Q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
        DO_base = DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
        Lse_base = Lse + b64 * stride_lb + h * stride_lh + q_start
        Delta_base = Delta + b64 * stride_lb + h * stride_lh + q_start
        slope_log2, rng_base = common.prologue(
            b, h, nheads, max_seqlen_q, row_groups, Alibi, stride_ab, sm_scale, softcap, False, HAS_ALIBI, HAS_DROPOUT
        )[3:]
        q_desc = common.rows_desc(Q_base, seqlen_q, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        do_desc = common.rows_desc(DO_base, seqlen_q, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        DQ_base = DQacc + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqm + h.to(tl.int64) * stride_dqh
        dq_desc = common.rows_desc(DQ_base, seqlen_q, stride_dqm, HEAD_DIM, BLOCK_M, BLOCK_D, DQ_ATOMIC == 2)
        if HAS_FLASHMASK:  # the key tile's runs of query tiles under head h's mask (flat tile t)
            t = pid if IS_VARLEN else b * tl.num_programs(0) + n_block
            ranges = common.tile_runs(Runs, Counts, t, stride_rh, stride_ch, n_list, h)
            bounds = Bounds + h * stride_bh + (k_start if IS_VARLEN else b64 * max_seqlen_k)
            cols = offs_n[None, :] if Q_MAJOR else offs_n[:, None]  # the score tile's key axis
            fm_bounds = common.flashmask_bounds(bounds, stride_bc, cols, seqlen_k, HAS_UPPER)
        else:
            ranges, fm_bounds = query_ranges, (0, 0, 0, 0)
        for seg in tl.static_range(3):
            r_lo, r_hi = common.passes(seg, ranges, HAS_FLASHMASK)
            for r in range(r_lo, r_hi):
                seg_lo, seg_hi = common.pass_tiles(seg, r, ranges, BLOCK_M, HAS_FLASHMASK)
                dk, dv = _dkdv_tiles(
                    dk, dv, k, v,
                    Q_base, DO_base, q_desc, do_desc, Lse_base, Delta_base, DQ_base, dq_desc,
                    stride_qm, stride_dom, stride_dqm,
                    sm_scale,
                    offs_m, offs_n, offs_d, seg_lo, seg_hi, fm_bounds,
                    seqlen_q, seqlen_k,
                    qk_scale, softcap_scale, softcap_log2, slope_log2,
                    window_left, window_right,
                    philox_seed, rng_base, row_groups, drop_threshold, keep_scale,
                    HEAD_DIM, PAD_D, BLOCK_M, BLOCK_N,
                    seg != 1, MASK_LEFT, MASK_RIGHT,
                    HAS_SOFTCAP, HAS_ALIBI,
                    HAS_DROPOUT, HAS_FLASHMASK, HAS_UPPER,
                    Q_MAJOR, USE_TMA, DQ_ATOMIC,
                )  # fmt: skip
    dk = dk * sm_scale
    mask = offs_n[:, None] < seqlen_k
    if PAD_D:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    DK_base = DK + b64 * stride_dkb + k_start.to(tl.int64) * stride_dkn + h_k.to(tl.int64) * stride_dkh
    DV_base = DV + b64 * stride_dvb + k_start.to(tl.int64) * stride_dvn + h_k.to(tl.int64) * stride_dvh
    tl.store(DK_base + offs_n[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV_base + offs_n[:, None] * stride_dvn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta,
    K_base, V_base, k_desc, v_desc, stride_kn, stride_vn,
    offs_m, offs_n_base, offs_d, lo, hi, Bounds, stride_bc,
    seqlen_q, seqlen_k,
    qk_scale, softcap_scale, softcap_log2, slope_log2,
    window_left, window_right,
    philox_seed, rng_base, row_groups, drop_threshold, keep_scale,
    HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_FLASHMASK: tl.constexpr, HAS_UPPER: tl.constexpr,
    USE_TMA: tl.constexpr,
):  # fmt: skip
    """Accumulates dQ of one query block over key tiles [lo, hi) (K/V through descriptors with USE_TMA;
    with HAS_FLASHMASK, masked tiles also hide what the FlashMask bounds at ``Bounds`` hide)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        if HAS_FLASHMASK and MASKED:  # the tile's column bounds, loaded before the matmul they wait for
            fm_bounds = common.flashmask_bounds(Bounds, stride_bc, offs_n[None, :], seqlen_k, HAS_UPPER)
        k = common.load_rows(
            k_desc, K_base, stride_kn, start_n, offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D, USE_TMA
        )  # [BLOCK_N, BLOCK_D]
        v = common.load_rows(
            v_desc, V_base, stride_vn, start_n, offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D, USE_TMA
        )  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] = q @ kᵀ
        s, t = common.scores(
            qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k,
            qk_scale, softcap_scale, softcap_log2, slope_log2,
            window_left, window_right,
            MASKED, HAS_SOFTCAP, HAS_ALIBI, MASK_LEFT, MASK_RIGHT,
        )  # fmt: skip
        if HAS_FLASHMASK and MASKED:
            lower_start, lower_end, upper_start, upper_end = fm_bounds
            hidden = common.flashmask_hides(offs_m[:, None], lower_start, lower_end, upper_start, upper_end, HAS_UPPER)
            s = tl.where(hidden, float("-inf"), s)
        p = tl.exp2(s - lse2[:, None])  # [BLOCK_M, BLOCK_N]
        dp = tl.dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_N] = dO @ vᵀ
        if HAS_DROPOUT:
            keep = common.dropout_keep(
                philox_seed, rng_base, offs_m, start_n, row_groups, drop_threshold, BLOCK_M, BLOCK_N
            )
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq)  # [BLOCK_M, BLOCK_D] += ds @ k
    return dq


# a fresh dropout seed per call must not select a different specialisation (seed % 16 == 0)
@triton.jit(do_not_specialize=["philox_seed"])
def _attn_bwd_dq(
    Q, K, V, DO, DQ, Lse, Delta, Alibi, CuSeqlensQ, CuSeqlensK, TileEnds,
    Bounds, Runs, Counts, stride_bh, stride_bc, stride_rh, stride_ch, n_list,  #
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    stride_ab,
    batch, nheads, group_size, max_seqlen_q, max_seqlen_k,
    sm_scale, softcap,
    window_left, window_right,
    drop_threshold, keep_scale, philox_seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_FLASHMASK: tl.constexpr, HAS_UPPER: tl.constexpr,
    IS_VARLEN: tl.constexpr, BATCH_PAD: tl.constexpr,
    USE_TMA: tl.constexpr,
):  # fmt: skip
    """Program (query tile, head, batch): dQ of BLOCK_M query rows of one head."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    row_groups = 4 * ((max_seqlen_k + 63) // 64)  # dropout counters per row: 16 columns per Philox draw
    if IS_VARLEN:
        b, m_block = common.seq_tile(pid, CuSeqlensQ, TileEnds, batch, BLOCK_M, BATCH_PAD)
        if b >= batch:  # one of the grid's spare programs
            return
    else:
        b = tl.program_id(2)
        m_block = pid
        if MASK_RIGHT:
            m_block = tl.num_programs(0) - 1 - pid
    q_start, seqlen_q, k_start, seqlen_k = common.seq_bounds(
        b, CuSeqlensQ, CuSeqlensK, max_seqlen_q, max_seqlen_k, IS_VARLEN
    )
    h_k = h // group_size
    b64 = b.to(tl.int64)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    m_start = m_block * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    Q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    DO_base = DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
    K_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + h_k.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + h_k.to(tl.int64) * stride_vh
    q = common.load_tile(
        Q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, seqlen_q, offs_d, HEAD_DIM, True, PAD_D
    )  # [BLOCK_M, BLOCK_D]
    do = common.load_tile(
        DO_base + offs_m[:, None] * stride_dom + offs_d[None, :], offs_m, seqlen_q, offs_d, HEAD_DIM, True, PAD_D
    )  # [BLOCK_M, BLOCK_D]
    mask_m = offs_m < seqlen_q
    lse2 = tl.load(Lse + b64 * stride_lb + h * stride_lh + q_start + offs_m, mask=mask_m, other=0.0)
    lse2 = lse2 * common.LOG2E
    delta = tl.load(Delta + b64 * stride_lb + h * stride_lh + q_start + offs_m, mask=mask_m, other=0.0)
    qk_scale, softcap_scale, softcap_log2, slope_log2, rng_base = common.prologue(
        b, h, nheads, max_seqlen_q, row_groups, Alibi, stride_ab, sm_scale, softcap, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT
    )

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_desc = common.rows_desc(K_base, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_desc = common.rows_desc(V_base, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    if HAS_FLASHMASK:  # the runs of the program's schedule (flat tile t) and its sequence's bounds
        t = pid if IS_VARLEN else b * tl.num_programs(0) + m_block
        ranges = common.tile_runs(Runs, Counts, t, stride_rh, stride_ch, n_list, h)
        bounds = Bounds + h * stride_bh + (k_start if IS_VARLEN else b64 * max_seqlen_k)
    else:
        bounds = Bounds
        ranges = common.key_range(
            m_start, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT
        )
    for seg in tl.static_range(3):
        r_lo, r_hi = common.passes(seg, ranges, HAS_FLASHMASK)
        for r in range(r_lo, r_hi):
            seg_lo, seg_hi = common.pass_tiles(seg, r, ranges, BLOCK_N, HAS_FLASHMASK)
            dq = _dq_tiles(
                dq, q, do, lse2, delta,
                K_base, V_base, k_desc, v_desc, stride_kn, stride_vn,
                offs_m, offs_n, offs_d, seg_lo, seg_hi, bounds, stride_bc,
                seqlen_q, seqlen_k,
                qk_scale, softcap_scale, softcap_log2, slope_log2,
                window_left, window_right,
                philox_seed, rng_base, row_groups, drop_threshold, keep_scale,
                HEAD_DIM, PAD_D, BLOCK_M, BLOCK_N,
                seg != 1, MASK_LEFT, MASK_RIGHT,
                HAS_SOFTCAP, HAS_ALIBI,
                HAS_DROPOUT, HAS_FLASHMASK, HAS_UPPER,
                USE_TMA,
            )  # fmt: skip
    dq = dq * sm_scale
    mask = mask_m[:, None]
    if PAD_D:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    DQ_base = DQ + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqm + h.to(tl.int64) * stride_dqh
    tl.store(DQ_base + offs_m[:, None] * stride_dqm + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=mask)


# (kernels.launch: each kernel's build chosen once per launch key)
PREPROCESS, DKDV, DQ = Launcher(_bwd_preprocess), Launcher(_attn_bwd_dkdv), Launcher(_attn_bwd_dq)


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    s: Settings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launches the backward with the tiles ``s`` gives: ``plan_bwd``'s plan for this call, run once.
    Layouts as in ``forward.attn_fwd``; returns (dq, dk, dv), in the inputs' dtype and strides, and the
    gradient of the attention sinks (``sink_grad``) or None."""
    if not p.is_varlen and p.batch > s.grid_z_batch:
        return _dense_as_packed(dout, q, k, v, out, lse, p, s)
    return plan_bwd(dout, q, k, v, out, lse, p, s).run(dout, q, k, v, out, lse, p)


def plan_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    s: Settings,
):
    """What a backward with this call's metadata launches under settings ``s``, decided once: Δ's
    preprocess, then the Gluon backward's plan on sm90 where it computes the call
    (``kernels.gluon.backward.Plan``; settings ``s.bwd_gluon``, with dropout ``s.bwd_gluon_dropout``), else
    the portable dK/dV and dQ passes (``BwdPlan``). ``plan.run(dout, q, k, v, out, lse, p)`` runs it for any
    call with the same metadata (dout's strides and alignment included). Not for dense batches past
    ``s.grid_z_batch`` (``attn_bwd`` runs those as packed)."""
    cfg = (s.bwd_gluon_dropout if p.dropout_p > 0 else s.bwd_gluon).get(q.shape[-1])
    if cfg is not None and not p.deterministic and q.is_cuda and lse.is_contiguous():
        from tileattn.kernels import gluon

        if gluon.available():
            from tileattn.kernels.gluon import backward as hopper

            q4, k4, v4, do4 = (p.as_4d(t) for t in (q, k, v, dout))
            rows = hopper.eligible_rows(q4, k4, v4, do4, p)
            if rows is not None:
                plan = hopper.Plan(q4, k4, v4, do4, lse, p, rows, **hopper.config_options(cfg))
                return GluonBwdPlan(plan, _Delta(p.as_4d(out), do4, lse, p, s), p)
    return BwdPlan(dout, q, k, v, out, lse, p, s)


class _Delta:
    """Δ = rowsum(dO ∘ O) of one call signature (``_bwd_preprocess``), shaped and strided as the LSE."""

    __slots__ = ("launch", "lse_shape")

    def __init__(self, o4: torch.Tensor, do4: torch.Tensor, lse: torch.Tensor, p: AttnParams, s: Settings):
        rows = o4.shape[1]
        block_pre = 16 if s.interpret else 64
        self.lse_shape = lse.shape
        self.launch = Launch(
            PREPROCESS,
            (cdiv(rows, block_pre), o4.shape[2], o4.shape[0]),
            (*o4.stride()[:3], *do4.stride()[:3], *p.lse_strides(lse), rows),
            dict(HEAD_DIM=o4.shape[3], BLOCK_D=p.block_d, BLOCK_M=block_pre),
        )

    def __call__(self, o4: torch.Tensor, do4: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        delta = torch.empty_like(lse)
        self.launch((o4, do4, delta))
        return delta


def delta(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, p: AttnParams, s: Settings) -> torch.Tensor:
    """Δ = rowsum(dO ∘ O) in fp32, shaped and strided as ``lse`` (``_bwd_preprocess``), for one call."""
    o4, do4 = p.as_4d(out), p.as_4d(dout)
    return _Delta(o4, do4, lse, p, s)(o4, do4, lse)


def _pass_grid(p: AttnParams, cfg, by_keys: bool, rows: int, heads: int, s: Settings):
    """``(grid, BATCH_PAD, tiles)`` of a backward pass whose programs own key tiles (``by_keys``, dK/dV) or
    query tiles (dQ) of ``rows`` tokens per row of the 4-d tensors: a packed batch's flat tiles
    (``common.seq_tile``), or the tiles times the batch; ``tiles`` = (tile rows for ``varlen_schedule``'s
    prefix sums or 0, block_m, block_n, programs), what ``BwdPlan._launch`` reads."""
    block = cfg.block_n if by_keys else cfg.block_m
    if p.is_varlen:
        grid = (cdiv(rows, block) + p.batch, heads, 1)
    else:
        grid = (cdiv(p.seqlen_k if by_keys else p.seqlen_q, block), heads, p.batch)
    cu_seqlens = p.cu_seqlens_k if by_keys else p.cu_seqlens_q
    _, batch_pad = common.varlen_schedule(cu_seqlens, p.batch, block, s.varlen_scan_batch)
    tiles = (block if p.is_varlen and batch_pad == 0 else 0, cfg.block_m, cfg.block_n, grid[0] * grid[2])
    return grid, batch_pad, tiles


class GluonBwdPlan:
    """Δ's preprocess, then the Gluon backward's plan (``plan_bwd``)."""

    __slots__ = ("delta", "plan", "varlen")

    def __init__(self, plan, delta: _Delta, p: AttnParams):
        self.plan, self.delta, self.varlen = plan, delta, p.is_varlen

    def run(self, dout, q, k, v, out, lse, p: AttnParams):
        o4, do4 = (out.unsqueeze(0), dout.unsqueeze(0)) if self.varlen else (out, dout)
        delta = self.delta(o4, do4, lse)
        dq, dk, dv = self.plan.run(do4, q, k, v, lse, delta, p)
        return dq, dk, dv, sink_grad(lse, delta, p)


class BwdPlan:
    """The portable backward of one call signature: Δ's preprocess, the dK/dV pass (which may add dQ too,
    by fp32 atomic or TMA reduce-adds) and the dQ pass, their tiles, grids, constexprs and fixed arguments
    decided once (``plan_bwd``); ``run`` allocates and launches, reading only the call's tensors and seed."""

    __slots__ = (
        "delta", "dkdv", "dq", "dq_atomic", "varlen", "batch", "mask", "dkdv_tiles", "dq_tiles", "dkdv_fixed",
        "dq_fixed",
    )  # fmt: skip

    def __init__(self, dout, q, k, v, out, lse, p: AttnParams, s: Settings):
        q4, k4, v4, do4, o4 = (p.as_4d(t) for t in (q, k, v, dout, out))
        # (the gradients as torch.empty_like makes them from q, k and v: their strides where those are dense)
        dq4, dk4, dv4 = (p.as_4d(torch.empty_like(t, device="meta")) for t in (q, k, v))
        batch, nheads, headdim = p.batch, q4.shape[2], q4.shape[3]
        nheads_k = k4.shape[2]
        self.varlen, self.batch = p.is_varlen, batch
        self.delta = _Delta(o4, do4, lse, p, s)
        self.mask = p.flashmask is not None
        # the arguments after the pointers and strides, as both kernels take them (the seed comes per call)
        sizes_and_scalars = (
            batch, nheads, nheads // nheads_k, p.seqlen_q, p.seqlen_k,
            p.softmax_scale, p.softcap,
            p.window_left, p.window_right,
            float(p.drop_threshold), p.keep_scale,
        )  # fmt: skip
        flags = dict(
            HEAD_DIM=headdim, BLOCK_D=p.block_d,
            MASK_LEFT=p.window_left >= 0, MASK_RIGHT=p.window_right >= 0,
            HAS_SOFTCAP=p.softcap > 0, HAS_ALIBI=p.alibi_slopes is not None,
            HAS_DROPOUT=p.dropout_p > 0,
            HAS_FLASHMASK=p.flashmask is not None, HAS_UPPER=p.flashmask is not None and p.flashmask.has_upper,
            IS_VARLEN=p.is_varlen,
        )  # fmt: skip
        no_mask = (0, 0, 0, 0, 1)  # (a FlashMask schedule's strides and run count without one)

        cfg = bwd_dkdv_config(p, s)
        # dQ from the dK/dV pass through fp32 adds (not with deterministic: their order varies), or a dQ pass
        dq_atomic = 0 if p.deterministic else cfg.dq_atomic
        dq_acc = None
        if dq_atomic:
            dq_acc = torch.empty(q4.shape, device=q4.device, dtype=torch.float32)
            # TMA reduce-adds need sm90+ and aligned rows, else the dQ pass (faster than atomic adds); the
            # interpreter does not emulate them and runs the atomic adds in their place
            if dq_atomic == 2 and s.interpret:
                dq_atomic = 1
            elif dq_atomic == 2 and not common.use_tma(replace(cfg, tma=True), dq_acc):
                dq_atomic, dq_acc = 0, None
        self.dq_atomic = dq_atomic
        grid, batch_pad, self.dkdv_tiles = _pass_grid(p, cfg, True, k4.shape[1], nheads_k, s)
        self.dkdv_fixed = (
            *p.strides(q4),
            *p.strides(k4),
            *p.strides(v4),
            *p.strides(do4),
            *p.strides(dk4),
            *p.strides(dv4),
            *(p.strides(dq_acc) if dq_acc is not None else (0, 0, 0)),
            *p.lse_strides(lse),
            p.alibi_batch_stride(),
            *sizes_and_scalars,
        )
        self.dkdv = Launch(
            DKDV, grid, no_mask + self.dkdv_fixed,
            dict(
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                Q_MAJOR=cfg.q_major, USE_TMA=common.use_tma(cfg, q4, do4), DQ_ATOMIC=dq_atomic,
                BATCH_PAD=batch_pad, **flags,
            ),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
        )  # fmt: skip
        self.dq = None
        if dq_atomic:
            return
        cfg = bwd_dq_config(p, s)
        grid, batch_pad, self.dq_tiles = _pass_grid(p, cfg, False, q4.shape[1], nheads, s)
        self.dq_fixed = (
            *p.strides(q4),
            *p.strides(k4),
            *p.strides(v4),
            *p.strides(do4),
            *p.strides(dq4),
            *p.lse_strides(lse),
            p.alibi_batch_stride(),
            *sizes_and_scalars,
        )
        self.dq = Launch(
            DQ, grid, no_mask + self.dq_fixed,
            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_TMA=common.use_tma(cfg, k4, v4), BATCH_PAD=batch_pad, **flags),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
        )  # fmt: skip

    def run(self, dout, q, k, v, out, lse, p: AttnParams):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if self.varlen:
            q4, k4, v4, o4, do4, dq4, dk4, dv4 = (t.unsqueeze(0) for t in (q, k, v, out, dout, dq, dk, dv))
        else:
            q4, k4, v4, o4, do4, dq4, dk4, dv4 = q, k, v, out, dout, dq, dk, dv
        delta = self.delta(o4, do4, lse)
        dsink = sink_grad(lse, delta, p)
        alibi = p.alibi_slopes if p.alibi_slopes is not None else lse
        dq_acc = None
        if self.dq_atomic:
            dq_acc = torch.zeros(q4.shape, device=q4.device, dtype=torch.float32)
        tensors = (q4, k4, v4, do4, dk4, dv4, lse, delta, alibi, p.cu_seqlens_q, p.cu_seqlens_k)
        seed = (p.philox_seed,)
        self._launch(self.dkdv, DKDV, self.dkdv_tiles, self.dkdv_fixed, p.cu_seqlens_k, tensors,
                     (dq_acc if dq_acc is not None else dk4,), lse, p, True, seed)  # fmt: skip
        if dq_acc is not None:
            dq4.copy_(dq_acc)
            return dq, dk, dv, dsink
        tensors = (q4, k4, v4, do4, dq4, lse, delta, alibi, p.cu_seqlens_q, p.cu_seqlens_k)
        self._launch(self.dq, DQ, self.dq_tiles, self.dq_fixed, p.cu_seqlens_q, tensors, (), lse, p, False, seed)
        return dq, dk, dv, dsink

    def _launch(self, launch, launcher, tiles, fixed, cu_seqlens, tensors, extra, lse, p, by_keys, seed) -> None:
        """One pass: its tile schedule of a large packed batch, then the launch (a FlashMask's schedule
        through the ``Launcher``, which keys its ints as Triton specialises them)."""
        tile_ends = cu_seqlens
        if tiles[0]:
            tile_ends, _ = common.varlen_schedule(cu_seqlens, self.batch, tiles[0], 0)
        tensors = tensors + (tile_ends,) + extra
        if not self.mask:
            launch(tensors + (lse, lse, lse), seed)
            return
        mask_args = flashmask.launch_args(p, tiles[1], tiles[2], by_keys, tiles[3], lse)
        launcher(launch.grid, tensors + mask_args + fixed + seed, launch.constexprs, **launch.options)


def sink_grad(lse: torch.Tensor, delta: torch.Tensor, p: AttnParams) -> torch.Tensor | None:
    """The attention sinks' gradient, fp32 ``(nheads,)``, or None without them. A sink's probability in a
    row is ``exp(sink - lse)`` (the LSE includes the sink) and it has no value, so dL/dsink sums
    ``-exp(sink - lse) · Δ`` over the head's rows, Δ = rowsum(dO ∘ O) (rows that see nothing have LSE +inf:
    0). Two reads of the per-row LSE and Δ, no pass over the head dim."""
    if p.learnable_sink is None:
        return None
    sink = p.learnable_sink.view(-1, 1) if p.is_varlen else p.learnable_sink.view(1, -1, 1)
    weighted = torch.exp(sink - lse) * delta
    return -(weighted.sum(1) if p.is_varlen else weighted.sum((0, 2)))


def _dense_as_packed(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    s: Settings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``forward._dense_as_packed``: a dense batch too large for the grid's z axis."""
    rows = [t.reshape(-1, *t.shape[2:]) for t in (dout, q, k, v, out)]
    lse = lse.transpose(0, 1).reshape(lse.shape[1], -1)  # (nheads, batch * seqlen_q)
    dq, dk, dv, dsink = attn_bwd(*rows, lse, common.packed_lengths(p, q.device), s)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dsink
