"""The forward kernel: one fused pass of QKᵀ, score modifiers, mask, online softmax and ·V.

Every feature is a constexpr flag of the one kernel ``_attn_fwd``: windows and causal (MASK_LEFT /
MASK_RIGHT), softcap, ALiBi, dropout, GQA (a runtime group size), packed varlen batches (IS_VARLEN),
FlashMask (HAS_FLASHMASK), attention sinks (HAS_SINK) and FP8 inputs (IS_FP8).

FP8 (e4m3 q, k, v with descales, ``AttnParams.descales``): both matmuls run on FP8 tensor cores with fp32
accumulation. The scores are scaled by q_descale·k_descale with the softmax scale; p is rounded to e4m3
at 2**8 times its value (``common.online_softmax``'s P_LOG2, so that small probabilities stay above
e4m3's subnormals; the row sums carry the same factor) and the output is scaled by v_descale. FP8 tensor
cores read both operands key-major: with V_T the kernel reads a transposed copy of V
(``Settings.fp8_v_transposed``) instead of V, whose key-major shared-memory copy Triton otherwise makes
through registers.
"""

import torch
import triton
import triton.language as tl

from tileattn.kernels import common, flashmask
from tileattn.kernels.configs import fwd_config, gluon_fwd_config
from tileattn.kernels.launch import Launch, Launcher
from tileattn.params import AttnParams, Settings, cdiv


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q,
    K_base, V_base, k_desc, v_desc, stride_kn, stride_vn,
    i, offs_n_base, offs_d, lo, hi, Bounds, stride_bc,
    seqlen_q, seqlen_k,
    qk_scale, softcap_scale, softcap_log2, slope_log2,
    window_left, window_right,
    philox_seed, rng_base, row_groups, drop_threshold,
    HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DEFER_SCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_FLASHMASK: tl.constexpr, HAS_UPPER: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
    IS_FP8: tl.constexpr = False, V_T: tl.constexpr = False, VT_TMA: tl.constexpr = False,
    INTERPRET: tl.constexpr = False, EXP2_POLY: tl.constexpr = 0,
):  # fmt: skip
    """Online-softmax over key tiles [lo, hi): updates (acc, l_i, m_i) for one query block. With
    HAS_FLASHMASK, masked tiles also hide what the FlashMask bounds at ``Bounds`` hide.

    With USE_TMA the K/V tiles come through tensor descriptors (rows past seqlen_k and columns past
    HEAD_DIM read as zeros), otherwise through masked pointer loads. With DEFER_SCALE
    (``AttnParams.defer_scale``) the scores stay raw products and the scale joins the softmax's
    exponent, one FMA per score. EXP2_POLY of every 8 scores of a thread take their exponential from a
    polynomial on the FMA units (``kernels.exp2``)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        offs_n = start_n + offs_n_base
        if HAS_FLASHMASK and MASKED:  # the tile's column bounds, loaded before the matmul they wait for
            fm_bounds = common.flashmask_bounds(Bounds, stride_bc, offs_n[None, :], seqlen_k, HAS_UPPER)
        k = common.load_rows(
            k_desc, K_base, stride_kn, start_n, offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D, USE_TMA
        )  # [BLOCK_N, BLOCK_D]
        if V_T:  # [BLOCK_D, BLOCK_N] of the transposed copy; columns past seqlen_k are zeros
            vt = common.load_cols(
                v_desc, V_base, stride_vn, start_n, offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D, VT_TMA
            )
            v = tl.trans(vt)
        else:
            v = common.load_rows(
                v_desc, V_base, stride_vn, start_n, offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D, USE_TMA
            )  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] = q @ kᵀ
        s, _ = common.scores(
            qk, i[:, None], offs_n[None, :], seqlen_q, seqlen_k,
            1.0 if DEFER_SCALE else qk_scale, softcap_scale, softcap_log2, slope_log2,
            window_left, window_right,
            MASKED, HAS_SOFTCAP, HAS_ALIBI, MASK_LEFT, MASK_RIGHT,
        )  # fmt: skip
        if HAS_FLASHMASK and MASKED:
            lower_start, lower_end, upper_start, upper_end = fm_bounds
            hidden = common.flashmask_hides(i[:, None], lower_start, lower_end, upper_start, upper_end, HAS_UPPER)
            s = tl.where(hidden, float("-inf"), s)
        # p: [BLOCK_M, BLOCK_N]
        p, m_i, l_i, acc = common.online_softmax(
            s, m_i, l_i, acc, qk_scale if DEFER_SCALE else 1.0, P_LOG2 if IS_FP8 else 0, EXP2_POLY, INTERPRET
        )
        if HAS_DROPOUT:
            keep = common.dropout_keep(philox_seed, rng_base, i, start_n, row_groups, drop_threshold, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        if IS_FP8:
            acc = tl.dot(common.to_e4m3(p, INTERPRET), v, acc)  # [BLOCK_M, BLOCK_D] += p @ v
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


# FP8: p is rounded to e4m3 at 2**P_LOG2 times its value (common.online_softmax)
P_LOG2 = tl.constexpr(8)


# a fresh dropout seed per call must not select a different specialisation (seed % 16 == 0)
@triton.jit(do_not_specialize=["philox_seed"])
def _attn_fwd(
    Q, K, V, Out, Lse, Alibi, Descales, Sink, CuSeqlensQ, CuSeqlensK, TileEnds,
    Bounds, Runs, Counts, stride_bh, stride_bc, stride_rh, stride_ch, n_list,  #
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_ab,
    batch, nheads, group_size, max_seqlen_q, max_seqlen_k,
    sm_scale, softcap,
    window_left, window_right,
    drop_threshold, keep_scale, philox_seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DEFER_SCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_FLASHMASK: tl.constexpr, HAS_UPPER: tl.constexpr, HAS_SINK: tl.constexpr,
    IS_VARLEN: tl.constexpr, BATCH_PAD: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
    IS_FP8: tl.constexpr, V_T: tl.constexpr, INTERPRET: tl.constexpr, EXP2_POLY: tl.constexpr = 0,
):  # fmt: skip
    """Program (tile, head, batch) computes BLOCK_M query rows of one head.

    Dense: tile = query block, reversed when MASK_RIGHT so the longest causal rows start first.
    Varlen: tile is a flat index over all sequences' query blocks (``common.seq_tile``); the max lengths
    lay out the dropout counters, and each sequence's own lengths bound its rows and keys.
    """
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
    Q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    K_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_kn + h_k.to(tl.int64) * stride_kh
    if V_T:  # (batch, nheads_k, headdim, keys): stride_vn steps over head-dim rows, keys are columns
        V_base = V + b64 * stride_vb + k_start.to(tl.int64) + h_k.to(tl.int64) * stride_vh
    else:
        V_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vn + h_k.to(tl.int64) * stride_vh
    O_base = Out + b64 * stride_ob + q_start.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
    Lse_base = Lse + b64 * stride_lb + h * stride_lh + q_start

    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    m_start = m_block * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = common.load_tile(
        Q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, seqlen_q, offs_d, HEAD_DIM, True, PAD_D
    )  # [BLOCK_M, BLOCK_D]
    v_descale = 1.0
    if IS_FP8:  # Descales: (3, batch, nheads_k), q's, k's and v's
        per_input = batch * (nheads // group_size)
        d_base = Descales + b * (nheads // group_size) + h_k
        sm_scale = sm_scale * tl.load(d_base) * tl.load(d_base + per_input)
        v_descale = tl.load(d_base + 2 * per_input)
    qk_scale, softcap_scale, softcap_log2, slope_log2, rng_base = common.prologue(
        b, h, nheads, max_seqlen_q, row_groups, Alibi, stride_ab, sm_scale, softcap, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT
    )

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_desc = common.rows_desc(K_base, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    VT_TMA: tl.constexpr = USE_TMA and not IS_VARLEN  # (a packed sequence's columns are not 16-byte aligned)
    if V_T:
        v_desc = common.cols_desc(V_base, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, VT_TMA)
    else:
        v_desc = common.rows_desc(V_base, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)

    if HAS_FLASHMASK:  # the runs of the program's schedule (flat tile t): partial runs, then full ones
        t = pid if IS_VARLEN else b * tl.num_programs(0) + m_block
        ranges = common.tile_runs(Runs, Counts, t, stride_rh, stride_ch, n_list, h)
        bounds = Bounds + h * stride_bh + (k_start if IS_VARLEN else b64 * max_seqlen_k)
    else:
        bounds = Bounds
        ranges = common.key_range(
            m_start, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT
        )
    # Left edge of a window (masked), the fully visible middle (no element mask), the diagonal and the
    # ragged end of the keys (masked); under a FlashMask, its partial runs (masked) and full runs.
    for seg in tl.static_range(3):
        r_lo, r_hi = common.passes(seg, ranges, HAS_FLASHMASK)
        for r in range(r_lo, r_hi):
            seg_lo, seg_hi = common.pass_tiles(seg, r, ranges, BLOCK_N, HAS_FLASHMASK)
            acc, l_i, m_i = _fwd_tiles(
                acc, l_i, m_i, q,
                K_base, V_base, k_desc, v_desc, stride_kn, stride_vn,
                offs_m, offs_n, offs_d, seg_lo, seg_hi, bounds, stride_bc,
                seqlen_q, seqlen_k,
                qk_scale, softcap_scale, softcap_log2, slope_log2,
                window_left, window_right,
                philox_seed, rng_base, row_groups, drop_threshold,
                HEAD_DIM, PAD_D, BLOCK_M, BLOCK_N,
                seg != 1, MASK_LEFT, MASK_RIGHT,
                HAS_SOFTCAP, HAS_ALIBI, DEFER_SCALE,
                HAS_DROPOUT, HAS_FLASHMASK, HAS_UPPER,
                USE_TMA, WARP_SPEC, IS_FP8, V_T, VT_TMA, INTERPRET, EXP2_POLY,
            )  # fmt: skip

    alpha = 1.0  # (the accumulator's rescale for a sink, folded into the normalisation below)
    if HAS_SINK:  # the head's sink joins the denominator (FP8: at p's 2**P_LOG2 scale)
        m_i, l_i, alpha = common.add_sink(m_i, l_i, Sink + h, P_LOG2 if IS_FP8 else 0)
    # A row that saw no key (nor a sink) has l_i == 0: its output is 0 and its LSE +inf, so that the
    # backward pass's exp(s - lse) is 0 for it (the flash_attn convention).
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    if IS_FP8:  # (p and l carry 2**P_LOG2, which acc / l cancels)
        acc = acc * (alpha * v_descale * keep_scale / l_safe)[:, None]
        lse = tl.where(seen, (m_i + tl.log2(l_safe) - P_LOG2) * common.LN2, float("inf"))
    else:
        if HAS_DROPOUT:
            acc = acc * (alpha * keep_scale / l_safe)[:, None]
        elif HAS_SINK:
            acc = acc * (alpha / l_safe)[:, None]
        else:
            acc = acc / l_safe[:, None]
        lse = tl.where(seen, (m_i + tl.log2(l_safe)) * common.LN2, float("inf"))
    mask_m = offs_m < seqlen_q
    tl.store(Lse_base + offs_m, lse, mask=mask_m)
    o_ptrs = O_base + offs_m[:, None] * stride_om + offs_d[None, :]
    if PAD_D:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None])


FWD = Launcher(_attn_fwd)  # (kernels.launch: the build chosen once per launch key)


def attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams, s: Settings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward with the tiles ``s`` gives: ``plan_fwd``'s plan for this call, run once. Dense
    tensors are ``(batch, seqlen, nheads, headdim)``; varlen tensors (``p.cu_seqlens_q`` set) are ``(total,
    nheads, headdim)``. Returns ``(out, lse)`` with lse fp32 ``(batch, nheads, seqlen_q)`` dense or ``(nheads,
    total_q)`` varlen."""
    if not p.is_varlen and p.batch > s.grid_z_batch:
        return _dense_as_packed(q, k, v, p, s)
    return plan_fwd(q, k, v, p, s).run(q, k, v, p)


def plan_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams, s: Settings):
    """What a forward with this call's metadata launches under settings ``s``, decided once: the Gluon
    forward's plan on sm90 where it computes the call (``kernels.gluon.forward.Plan``), else ``FwdPlan``.
    ``plan.run(q, k, v, p)`` runs it for any call with the same metadata (shapes, strides, dtypes, 16-byte
    alignments, options, device); only p's tensors and dropout seed are read then. Not for dense batches
    past ``s.grid_z_batch`` (``attn_fwd`` runs those as packed)."""
    q4, k4, v4 = (p.as_4d(t) for t in (q, k, v))
    entry = gluon_fwd_config(p, s, q.shape[-1]) if q.is_cuda else None
    if entry is not None:
        from tileattn.kernels import gluon

        if gluon.available():
            from tileattn.kernels.gluon import forward as hopper

            rows = hopper.eligible_rows(q4, k4, v4, p)
            if rows is not None:
                cfg, short = entry
                return hopper.Plan(
                    q4, k4, v4, p, rows, block_m=cfg.block_m, block_n=cfg.block_n, stages=cfg.num_stages,
                    programs=None if short else hopper.ONE_PER_TILE, pingpong=cfg.pingpong,
                    mask_loops=cfg.mask_loops, l2_bytes=s.gluon_l2_bytes, snake=s.gluon_snake,
                    exp2_poly=cfg.exp2_poly,
                )  # fmt: skip
    return FwdPlan(q4, k4, v4, p, s)


class FwdPlan:
    """The portable forward of one call signature: tiles, grid, constexprs and the launch's fixed
    arguments, decided once (``plan_fwd``); ``run`` allocates the outputs and launches, reading only the
    call's tensors (q, k, v, ALiBi slopes, sinks, FP8 descales, cu_seqlens, FlashMask) and dropout seed."""

    __slots__ = (
        "launch",
        "fixed",
        "mask_tiles",
        "out_shape",
        "out_dtype",
        "lse_shape",
        "varlen",
        "v_t",
        "batch",
        "tiles",
    )

    def __init__(self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, p: AttnParams, s: Settings):
        batch, nheads, headdim = p.batch, q4.shape[2], q4.shape[3]
        self.varlen, self.batch = p.is_varlen, batch
        self.out_shape = q4.shape[1:] if p.is_varlen else q4.shape
        self.out_dtype = torch.bfloat16 if p.is_fp8 else q4.dtype
        self.lse_shape = p.lse_shape(q4)
        cfg = fwd_config(p, s)
        self.v_t = v_t = p.is_fp8 and s.fp8_v_transposed
        if v_t:
            v4 = common.transposed_v(v4)
        use_tma = common.use_tma(cfg, k4, v4)
        if cfg.tma and not use_tma:
            cfg = fwd_config(p, s, tma_ok=False)
        if p.is_varlen:
            grid = (cdiv(q4.shape[1], cfg.block_m) + batch, nheads, 1)
        else:
            grid = (cdiv(p.seqlen_q, cfg.block_m), nheads, batch)
        _, batch_pad = common.varlen_schedule(p.cu_seqlens_q, batch, cfg.block_m, s.varlen_scan_batch)
        # (varlen batches past the register scan: the tiles' prefix sums, made per call on the device)
        self.tiles = cfg.block_m if p.is_varlen and batch_pad == 0 else 0
        o_strides = _contiguous_strides(self.out_shape, p)
        lse_strides = (
            (0, self.lse_shape[1]) if p.is_varlen else (self.lse_shape[1] * self.lse_shape[2], self.lse_shape[2])
        )
        fixed = (
            *p.strides(q4),
            *p.strides(k4),
            *(_vt_strides(v4, p) if v_t else p.strides(v4)),
            *o_strides,
            *lse_strides,
            p.alibi_batch_stride(),
            batch, nheads, nheads // k4.shape[2], p.seqlen_q, p.seqlen_k,
            p.softmax_scale, p.softcap,
            p.window_left, p.window_right,
            float(p.drop_threshold), p.keep_scale,
        )  # fmt: skip
        constexprs = dict(
            HEAD_DIM=headdim, BLOCK_D=p.block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            MASK_LEFT=p.window_left >= 0, MASK_RIGHT=p.window_right >= 0,
            HAS_SOFTCAP=p.softcap > 0, HAS_ALIBI=p.alibi_slopes is not None, DEFER_SCALE=p.defer_scale,
            HAS_DROPOUT=p.dropout_p > 0,
            HAS_FLASHMASK=p.flashmask is not None, HAS_UPPER=p.flashmask is not None and p.flashmask.has_upper,
            HAS_SINK=p.learnable_sink is not None, IS_VARLEN=p.is_varlen, BATCH_PAD=batch_pad,
            USE_TMA=use_tma, WARP_SPEC=cfg.warp_spec,
            IS_FP8=p.is_fp8, V_T=v_t, INTERPRET=s.interpret, EXP2_POLY=cfg.exp2_poly,
        )  # fmt: skip
        self.fixed = fixed
        # a FlashMask's schedule (its tensors and ints, ``flashmask.launch_args``) comes with each call's mask
        self.mask_tiles = (cfg.block_m, cfg.block_n, False, grid[0] * grid[2]) if p.flashmask is not None else None
        no_mask = (0, 0, 0, 0, 1)  # (the schedule's strides and run count without one)
        self.launch = Launch(
            FWD, grid, no_mask + fixed, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            maxnreg=cfg.maxnreg,
        )  # fmt: skip

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = q.device
        out = torch.empty(self.out_shape, device=device, dtype=self.out_dtype)
        lse = torch.empty(self.lse_shape, device=device, dtype=torch.float32)
        q4, k4, v4, o4 = (t.unsqueeze(0) for t in (q, k, v, out)) if self.varlen else (q, k, v, out)
        if self.v_t:
            v4 = common.transposed_v(v4)
        tile_ends = p.cu_seqlens_q
        if self.tiles:
            tile_ends, _ = common.varlen_schedule(p.cu_seqlens_q, self.batch, self.tiles, 0)
        tensors = (
            q4, k4, v4, o4, lse,
            p.alibi_slopes if p.alibi_slopes is not None else lse,
            p.descales if p.descales is not None else lse,
            p.learnable_sink if p.learnable_sink is not None else lse,
            p.cu_seqlens_q, p.cu_seqlens_k, tile_ends,
        )  # fmt: skip
        if self.mask_tiles is None:
            self.launch(tensors + (lse, lse, lse), (p.philox_seed,))
        else:  # (through the Launcher, which keys the schedule's ints as Triton specialises them)
            mask_args = flashmask.launch_args(p, *self.mask_tiles, lse)
            launch = self.launch
            FWD(launch.grid, tensors + mask_args + self.fixed + (p.philox_seed,), launch.constexprs, **launch.options)
        return out, lse


def _contiguous_strides(shape: tuple, p: AttnParams) -> tuple[int, int, int]:
    """``p.strides`` of a contiguous tensor of ``shape`` (varlen: ``(total, nheads, d)``)."""
    if p.is_varlen:
        total, nheads, d = shape
        return 0, nheads * d, d
    _, seqlen, nheads, d = shape
    return seqlen * nheads * d, nheads * d, d


def _vt_strides(vt: torch.Tensor, p: AttnParams) -> tuple[int, int, int]:
    """(batch, head-dim row, head) strides of a ``common.transposed_v`` V (batch stride 0 when varlen)."""
    s = vt.stride()
    return (0 if p.is_varlen else s[0]), s[2], s[1]


def _dense_as_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams, s: Settings
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense batch too large for the grid's z axis, run as a packed batch of equal lengths."""
    if p.batch * max(p.seqlen_q, p.seqlen_k) >= 2**31:
        raise NotImplementedError(
            f"batch {p.batch} x seqlen {max(p.seqlen_q, p.seqlen_k)}: batches above {s.grid_z_batch} run as a packed "
            "batch with int32 offsets, which needs fewer than 2**31 tokens; split the batch into several calls"
        )
    packed = common.packed_lengths(p, q.device)
    rows = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    out, lse = attn_fwd(*rows, packed, s)
    lse = lse.view(lse.shape[0], p.batch, p.seqlen_q).transpose(0, 1).contiguous()  # (batch, nheads, seqlen_q)
    return out.view(q.shape), lse
