"""Shared ``@triton.jit`` helpers: work scheduling, the kernels' prologue, tile loads, mask predicates, loop
bounds, score modifiers (scale, softcap, ALiBi) and Philox dropout. Every kernel that needs one of these calls it from
here; the mask semantics are those of ``tileattn.reference.local_mask``.

Conventions: ``i`` is a query row and ``j`` a key column, both counted from the start of their own
sequence; the diagonal sits at ``j = i + seqlen_k - seqlen_q`` (bottom-right alignment). Scores are kept
in the log2 domain (natural-log scores times log2(e)) so the softmax uses ``exp2``.
"""

from dataclasses import replace

import torch
import triton
import triton.language as tl

from tileattn.kernels import exp2
from tileattn.kernels.launch import ensure_scratch_allocator
from tileattn.params import AttnParams, next_power_of_2

# log2(e) and ln(2): scores live in the log2 domain, the LSE leaves in natural log. Constexpr globals, the
# only globals a kernel may read (an annotation ``LOG2E: tl.constexpr = ...`` passes the interpreter but
# not the compiler); host code reads ``LOG2E.value``.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def use_tma(cfg, *tensors: torch.Tensor) -> bool:
    """Whether a kernel launched with ``cfg`` reads the row tiles of ``tensors`` through TMA descriptors
    (``rows_desc``): asked for by the config, an NVIDIA GPU with TMA (sm90+; the interpreter emulates
    it), 16-byte aligned data, positive strides that are multiples of 16 bytes, contiguous head dim.
    Descriptors built on the device need a global scratch allocator: one backed by PyTorch's caching
    allocator is installed unless the caller has set their own."""
    if not cfg.tma or torch.version.hip:
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s <= 0 or s * size % 16 for s in t.stride()[:-1]):
            return False
        if t.device.type == "cuda" and torch.cuda.get_device_capability(t.device)[0] < 9:
            return False
    ensure_scratch_allocator()
    return True


@triton.jit
def seq_tile(
    pid,
    CuSeqlens,
    TileEnds,
    batch,
    BLOCK: tl.constexpr,
    BATCH_PAD: tl.constexpr,
):
    """Maps a flat tile index to (sequence, block within it) for packed batches.

    The grid has ``cdiv(total, BLOCK) + batch`` programs, an upper bound of the real tile count
    ``sum_b cdiv(len_b, BLOCK)``, so every program has work except a few at the end (which get
    ``seq == batch``): one long sequence among many short ones leaves no program idle.

    Up to ``BATCH_PAD`` sequences, the program counts the tiles of every sequence from ``CuSeqlens`` in
    registers. ``BATCH_PAD == 0`` (batches beyond what registers hold, ``tile_ends``): ``TileEnds`` holds
    each sequence's inclusive prefix sum of tiles, and a binary search finds the sequence.
    """
    if BATCH_PAD == 0:
        seq = 0  # first sequence whose tiles end after pid
        hi = batch
        while seq < hi:
            mid = (seq + hi) // 2
            if tl.load(TileEnds + mid) <= pid:
                seq = mid + 1
            else:
                hi = mid
        block = pid - tl.load(TileEnds + seq - 1, mask=seq > 0, other=0)
    else:
        offs_b = tl.arange(0, BATCH_PAD)
        mask_b = offs_b < batch
        starts = tl.load(CuSeqlens + offs_b, mask=mask_b, other=0)
        ends = tl.load(CuSeqlens + offs_b + 1, mask=mask_b, other=0)
        n_blocks = (ends - starts + BLOCK - 1) // BLOCK  # [BATCH_PAD]
        cum_blocks = tl.cumsum(n_blocks, 0)  # inclusive prefix sum
        seq = tl.sum((cum_blocks <= pid).to(tl.int32), 0)
        block = pid - tl.sum(tl.where(offs_b < seq, n_blocks, 0), 0)
    return seq, block


def varlen_schedule(cu_seqlens: torch.Tensor | None, batch: int, block: int, scan_limit: int):
    """``(TileEnds, BATCH_PAD)`` for ``seq_tile``: batches of up to ``scan_limit`` sequences are scanned
    in registers (``BATCH_PAD`` = next power of two, ``TileEnds`` unused); larger ones get the int32
    inclusive prefix sums of their tile counts, computed on the device (no host sync), and
    ``BATCH_PAD = 0``. Dense calls: ``(None, 1)``."""
    if cu_seqlens is None:
        return None, 1
    if batch <= scan_limit:
        return cu_seqlens, next_power_of_2(batch)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.cumsum(torch.div(lengths + (block - 1), block, rounding_mode="floor"), 0, dtype=torch.int32), 0


def transposed_v(v4: torch.Tensor) -> torch.Tensor:
    """V ``(batch, seqlen_k, nheads_k, headdim)`` as ``(batch, nheads_k, headdim, seqlen_k)`` with rows of
    16-byte multiples (so TMA can read it), a view of a padded copy: how FP8 tensor cores read V, key-major
    (the portable forward with ``Settings.fp8_v_transposed``, the Gluon forward)."""
    vt = transposed_v_buffer(v4)
    vt.copy_(v4.permute(0, 2, 3, 1))
    return vt


def transposed_v_buffer(v4: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """``transposed_v``'s buffer for V of this shape, uninitialised, on ``device`` (default: V's; "meta"
    for a plan's descriptor, whose address is replaced per call)."""
    batch, seqlen, nheads_k, headdim = v4.shape
    padded = -(-seqlen * v4.element_size() // 16) * 16 // v4.element_size()
    return torch.empty(batch, nheads_k, headdim, padded, device=device or v4.device, dtype=v4.dtype)[..., :seqlen]


def packed_lengths(p: AttnParams, device: torch.device) -> AttnParams:
    """``p`` of a dense batch, restated as a packed batch of equal lengths (``cu_seqlens`` on ``device``).
    Dropout counters and masks depend only on (sequence, row, column) and the max lengths, so the
    packed call computes exactly what the dense one would."""
    cu_q = torch.arange(0, p.batch + 1, device=device, dtype=torch.int32) * p.seqlen_q
    cu_k = torch.arange(0, p.batch + 1, device=device, dtype=torch.int32) * p.seqlen_k
    return replace(p, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@triton.jit
def seq_bounds(b, CuSeqlensQ, CuSeqlensK, max_seqlen_q, max_seqlen_k, IS_VARLEN: tl.constexpr):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``b``: its first query and key row in the
    packed layout and its own lengths (varlen), or 0 and the call's lengths (dense)."""
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + b)
        seqlen_q = tl.load(CuSeqlensQ + b + 1) - q_start
        k_start = tl.load(CuSeqlensK + b)
        seqlen_k = tl.load(CuSeqlensK + b + 1) - k_start
    else:
        q_start = 0
        seqlen_q = max_seqlen_q
        k_start = 0
        seqlen_k = max_seqlen_k
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def prologue(
    b, h, nheads, max_seqlen_q, row_groups,
    Alibi, stride_ab,
    sm_scale, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    """The constants of query head ``h`` of sequence ``b``, ``(qk_scale, softcap_scale, softcap_log2,
    slope_log2, rng_base)``: the score constants of ``scores`` (sm_scale·log2(e); with a softcap
    sm_scale / softcap and softcap·log2(e), else 0.0), the ALiBi slope·log2(e) (else 0.0) and the first
    Philox counter of the head's dropout draws (``dropout_keep``; else 0). Counters are laid out by the
    padded lengths, ``row_groups = 4·ceil(max_seqlen_k / 64)`` per query row and ``max_seqlen_q`` rows a
    head (varlen: the max lengths), so each sequence of a packed batch draws from its own range.

    The kernels call it where these values were computed inline before (after their first tile loads):
    ptxas schedules around a helper's boundaries, so elsewhere it would change the compiled kernels."""
    qk_scale = sm_scale * LOG2E
    softcap_scale = 0.0
    softcap_log2 = 0.0
    if HAS_SOFTCAP:
        softcap_scale = sm_scale / softcap
        softcap_log2 = softcap * LOG2E
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h) * LOG2E
    rng_base = 0
    if HAS_DROPOUT:
        rng_base = (b.to(tl.int64) * nheads + h) * max_seqlen_q * row_groups
    return qk_scale, softcap_scale, softcap_log2, slope_log2, rng_base


@triton.jit
def load_tile(ptrs, offs_rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr):
    """Loads a [rows, BLOCK_D] tile, masking rows past ``n_rows`` (if CHECK_ROWS) and the padded head dim."""
    if CHECK_ROWS:
        if PAD_D:
            mask = (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
        else:
            mask = offs_rows[:, None] < n_rows
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        if PAD_D:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def rows_desc(
    base,
    n_rows,
    stride_row,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """With USE_TMA, a TMA descriptor over one sequence's rows of one head, ``[n_rows, HEAD_DIM]`` with
    row stride ``stride_row``, read in [BLOCK_R, BLOCK_D] tiles (rows past n_rows and columns past
    HEAD_DIM are zeros; the launcher checks the 16-byte alignment TMA needs, ``use_tma``); without it,
    ``base`` itself, for ``load_rows``'s pointer loads."""
    desc = base
    if USE_TMA:
        rows = tl.maximum(n_rows, 1)  # an empty varlen sequence visits no tile
        desc = tl.make_tensor_descriptor(base, [rows, HEAD_DIM], [stride_row, 1], [BLOCK_R, BLOCK_D])
    return desc


@triton.jit
def cols_desc(
    base,
    n_cols,
    stride_row,
    HEAD_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """``rows_desc`` of a transposed tensor, ``[HEAD_DIM, n_cols]`` with row stride ``stride_row``, read
    in [BLOCK_D, BLOCK_C] tiles (with USE_TMA; else ``base``, for ``load_cols``)."""
    desc = base
    if USE_TMA:
        cols = tl.maximum(n_cols, 1)
        desc = tl.make_tensor_descriptor(base, [HEAD_DIM, cols], [stride_row, 1], [BLOCK_D, BLOCK_C])
    return desc


@triton.jit
def load_cols(
    desc,
    base,
    stride_row,
    start,
    offs_cols,
    n_cols,
    offs_d,
    HEAD_DIM: tl.constexpr,
    CHECK_COLS: tl.constexpr,
    PAD_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """The [BLOCK_D, cols] tile of a transposed tensor starting at column ``start`` (``offs_cols = start
    + arange``; columns past ``n_cols`` and rows past HEAD_DIM read as zeros)."""
    if USE_TMA:
        tile = desc.load([0, start])
    else:
        ptrs = base + offs_d[:, None] * stride_row + offs_cols[None, :]
        if CHECK_COLS:
            if PAD_D:
                mask = (offs_cols[None, :] < n_cols) & (offs_d[:, None] < HEAD_DIM)
            else:
                mask = offs_cols[None, :] < n_cols
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif PAD_D:
            tile = tl.load(ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def load_rows(
    desc,
    base,
    stride_row,
    start,
    offs_rows,
    n_rows,
    offs_d,
    HEAD_DIM: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    PAD_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """The [rows, BLOCK_D] tile starting at row ``start`` (``offs_rows = start + arange``): through the
    descriptor with USE_TMA, else a masked pointer load (``load_tile``)."""
    if USE_TMA:
        tile = desc.load([start, 0])
    else:
        tile = load_tile(
            base + offs_rows[:, None] * stride_row + offs_d[None, :],
            offs_rows,
            n_rows,
            offs_d,
            HEAD_DIM,
            CHECK_ROWS,
            PAD_D,
        )
    return tile


@triton.jit
def visible(i, j, seqlen_q, seqlen_k, window_left, window_right, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """True where row i sees column j (``i``, ``j`` broadcast); see ``reference.local_mask``."""
    centre = i + (seqlen_k - seqlen_q)
    mask = (i < seqlen_q) & (j < seqlen_k)
    if MASK_RIGHT:
        mask = mask & (j <= centre + window_right)
    if MASK_LEFT:
        mask = mask & (j >= centre - window_left)
    return mask


@triton.jit
def key_range(
    m_start,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """Key tiles a query block [m_start, m_start + BLOCK_M) must visit, in three segments.

    Returns ``(lo, full_lo, full_hi, hi)``: tiles in [lo, full_lo) and [full_hi, hi) need the element
    mask; tiles in [full_lo, full_hi) are visible to every row and run without it. Tiles outside
    [lo, hi) are fully masked and never visited. lo, full_lo and full_hi are multiples of BLOCK_N
    (full_lo may equal hi)."""
    m_last = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1
    return key_bounds(m_start, m_last, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N, MASK_LEFT, MASK_RIGHT)


@triton.jit
def key_bounds(
    m_first,
    m_last,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """``key_range`` for the query rows [m_first, m_last] (the decode kernel packs several heads of a
    token into one block, so its blocks do not cover BLOCK_M consecutive rows)."""
    diag = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if MASK_RIGHT:
        hi = tl.minimum(hi, m_last + diag + window_right + 1)
        full_hi = tl.minimum(full_hi, (m_first + diag + window_right + 1) // BLOCK_N * BLOCK_N)
    if MASK_LEFT:
        lo = tl.maximum(m_first + diag - window_left, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(m_last + diag - window_left, 0), BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_range(
    n_start,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """Query tiles a key block [n_start, n_start + BLOCK_N) receives gradient from: the transpose of
    ``key_range``, returning ``(lo, full_lo, full_hi, hi)`` in multiples of BLOCK_M likewise."""
    diag = seqlen_k - seqlen_q
    n_last = n_start + BLOCK_N - 1
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q // BLOCK_M * BLOCK_M
    if n_last >= seqlen_k:  # a partial key block needs the mask on every tile
        full_hi = 0
    if MASK_RIGHT:
        lo = tl.maximum(n_start - diag - window_right, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n_last - diag - window_right, 0), BLOCK_M) * BLOCK_M
    if MASK_LEFT:
        hi = tl.minimum(hi, n_last - diag + window_left + 1)
        full_hi = tl.minimum(full_hi, tl.maximum(n_start - diag + window_left + 1, 0) // BLOCK_M * BLOCK_M)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def flashmask_bounds(Bounds, stride_bc, j, seqlen_k, HAS_UPPER: tl.constexpr):
    """The FlashMask bounds ``(lower_start, lower_end, upper_start, upper_end)`` of key columns ``j`` (any
    shape; columns past seqlen_k hide nothing): ``Bounds`` points at the sequence's first key token of the
    head's int32 rows (``params.FlashMask``), ``stride_bc`` apart. Without HAS_UPPER the upper pair is 0."""
    mask_j = j < seqlen_k
    lower_start = tl.load(Bounds + j, mask=mask_j, other=0)
    lower_end = tl.load(Bounds + stride_bc + j, mask=mask_j, other=0)
    upper_start = tl.zeros_like(lower_start)
    upper_end = tl.zeros_like(lower_start)
    if HAS_UPPER:
        upper_start = tl.load(Bounds + 2 * stride_bc + j, mask=mask_j, other=0)
        upper_end = tl.load(Bounds + 3 * stride_bc + j, mask=mask_j, other=0)
    return lower_start, lower_end, upper_start, upper_end


@triton.jit
def flashmask_hides(i, lower_start, lower_end, upper_start, upper_end, HAS_UPPER: tl.constexpr):
    """True where query rows ``i`` fall in a column's hidden intervals (broadcast, as ``visible``); the
    semantics of ``tileattn.flashmask.hidden``."""
    hidden = (i >= lower_start) & (i < lower_end)
    if HAS_UPPER:
        hidden = hidden | ((i >= upper_start) & (i < upper_end))
    return hidden


@triton.jit
def tile_runs(Runs, Counts, t, stride_rh, stride_ch, n_list, h):
    """``(Runs_t, n_masked, n_runs)`` of program ``t`` (head ``h``'s mask) in a FlashMask schedule
    (``kernels.flashmask``): its runs of tiles as [first, end) pairs, the first ``n_masked`` of them
    partial (the element mask applies), the others up to ``n_runs`` full."""
    counts = Counts + h * stride_ch + 2 * t
    n_masked = tl.load(counts)
    n_runs = n_masked + tl.load(counts + 1)
    return Runs + h * stride_rh + t.to(tl.int64) * (2 * n_list), n_masked, n_runs


@triton.jit
def passes(seg: tl.constexpr, ranges, HAS_FLASHMASK: tl.constexpr):
    """``[r_lo, r_hi)``, the passes of segment ``seg`` (``tl.static_range(3)``) of a tile loop over
    ``ranges``: under a FlashMask, ``tile_runs``'s ``(Runs_t, n_masked, n_runs)`` and one pass per run
    (segment 0 the partial runs, 1 the full ones, 2 none); otherwise ``key_range``'s or ``query_range``'s
    ``(lo, full_lo, full_hi, hi)`` and one pass over the segment (a loop the compiler drops)."""
    if HAS_FLASHMASK:
        runs, n_masked, n_runs = ranges
        r_lo, r_hi = segment(seg, 0, n_masked, n_runs, n_runs)
    else:
        r_lo = 0
        r_hi = 1
    return r_lo, r_hi


@triton.jit
def pass_tiles(seg: tl.constexpr, r, ranges, BLOCK: tl.constexpr, HAS_FLASHMASK: tl.constexpr):
    """The rows ``[lo, hi)`` that pass ``r`` of segment ``seg`` (``passes``) visits, multiples of BLOCK:
    run ``r`` of the FlashMask schedule (its end may pass a ragged sequence's end: such tiles are in
    partial runs), or the segment itself."""
    if HAS_FLASHMASK:
        runs, n_masked, n_runs = ranges
        seg_lo = tl.load(runs + 2 * r) * BLOCK
        seg_hi = tl.load(runs + 2 * r + 1) * BLOCK
    else:
        lo, full_lo, full_hi, hi = ranges
        seg_lo, seg_hi = segment(seg, lo, full_lo, full_hi, hi)
    return seg_lo, seg_hi


@triton.jit
def tanh(x):
    """tanh through exp2 (no libdevice, so it also runs under the interpreter); saturates to ±1."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def scores(
    qk,
    i,
    j,
    seqlen_q,
    seqlen_k,
    qk_scale,
    softcap_scale,
    softcap_log2,
    slope_log2,
    window_left,
    window_right,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """Turns raw products ``qk = q·k`` into log2-domain scores, in the API's order: scale, softcap,
    ALiBi, then the mask (-inf where hidden, only if MASKED). Returns ``(s, t)`` where ``t`` is the
    softcap's tanh (needed by the backward pass; ``qk`` when there is no softcap).

    qk_scale = softmax_scale·log2(e), or 1.0 when the caller leaves the scale to ``online_softmax``
    (AttnParams.defer_scale); softcap_scale = softmax_scale / softcap;
    softcap_log2 = softcap·log2(e); slope_log2 = ALiBi slope·log2(e)."""
    if HAS_SOFTCAP:
        t = tanh(qk * softcap_scale)
        s = t * softcap_log2
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        s -= slope_log2 * tl.abs(i + (seqlen_k - seqlen_q) - j).to(tl.float32)
    if MASKED:
        s = tl.where(
            visible(i, j, seqlen_q, seqlen_k, window_left, window_right, MASK_LEFT, MASK_RIGHT), s, float("-inf")
        )
    return s, t


@triton.jit
def online_softmax(
    s, m_i, l_i, acc, scale, P_LOG2: tl.constexpr = 0, POLY: tl.constexpr = 0, INTERPRET: tl.constexpr = False
):
    """One key tile of the online softmax over scores ``s [BLOCK_M, BLOCK_N]`` that become log2-domain
    scores times ``scale`` (> 0): returns ``p = exp2(s·scale - m_new)`` and the running max, sum and
    accumulator rescaled to ``m_new``; the caller adds ``p @ v`` to the accumulator.

    ``scale`` lets the caller leave a positive softmax scale to this function (``AttnParams.defer_scale``):
    the row max is taken over the raw products (a positive scale keeps the order) and ``s·scale - m_new``
    is one fused multiply-add per element instead of a multiply and a subtraction; otherwise 1.0.

    m_i starts at a large finite negative value instead of -inf, so a row whose tiles are all masked
    keeps alpha = exp2(0) = 1 and p = exp2(-inf) = 0 rather than NaN from (-inf) - (-inf).

    ``P_LOG2`` > 0 returns p (and the sum) times 2**P_LOG2, which the caller divides out: FP8 p keeps
    values down to 2**-9 (e4m3's smallest subnormal), so p up to 2**8 keeps 2**-17 of the row max.

    ``POLY``: of every 8 scores of a thread, this many take p's exponential from a polynomial on the FMA
    units (``kernels.exp2``; all of them under the interpreter, ``INTERPRET``)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    alpha = tl.exp2(m_i - m_new)
    if P_LOG2 != 0:
        p = exp2.exp2_mixed(tl.fma(s, scale, -(m_new - P_LOG2)[:, None]), POLY, INTERPRET)
    else:
        p = exp2.exp2_mixed(tl.fma(s, scale, -m_new[:, None]), POLY, INTERPRET)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def add_sink(m_i, l_i, sink_ptrs, P_LOG2: tl.constexpr = 0):
    """Adds attention sinks to finished rows of the online softmax (log2 domain): the logit at
    ``sink_ptrs`` (natural log, per row or one for all; no value vector) becomes one more term of the
    denominator. Returns ``(m, l, alpha)``: the new max and sum, and the factor by which the caller
    rescales its accumulator. A row that saw no key gets ``l = 2**P_LOG2`` at ``m = sink`` (output 0, LSE
    the sink); a sink of -inf changes nothing. ``P_LOG2``: the scale the sum carries (FP8's p)."""
    sink = tl.load(sink_ptrs) * LOG2E
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink - m_new + P_LOG2), alpha


@triton.jit
def to_e4m3(x, ROUND_FIRST: tl.constexpr):
    """fp32 ``x`` in float8 e4m3, saturated at ±448 and rounded to nearest (the GPU's conversion,
    ``cvt.rn.satfinite``). With ROUND_FIRST the saturation and rounding are done in fp32 first (ties away
    from zero), for Triton's interpreter, whose conversion drops the carry when a value rounds up to the
    next power of two (124.5 becomes 64, not 128)."""
    if ROUND_FIRST:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        mag = tl.abs(x)
        exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(mag, 1e-30))), -6.0)  # subnormals: spacing 2**-9
        ulp = tl.exp2(exponent - 3.0)
        mag = tl.floor(mag / ulp + 0.5) * ulp
        x = tl.where(x < 0, -mag, mag)
    return x.to(tl.float8e4nv)


@triton.jit
def segment(seg: tl.constexpr, lo, full_lo, full_hi, hi):
    """Bounds of loop segment ``seg`` (``tl.static_range(3)``) of a tile range split by ``key_range`` /
    ``query_range``: 0 the masked edge [lo, full_lo), 1 the unmasked middle [full_lo, full_hi), 2 the
    masked edge [full_hi, hi). The kernels compile the tile loop once per segment, masking only edges."""
    if seg == 0:
        seg_lo = lo
        seg_hi = full_lo
    elif seg == 1:
        seg_lo = full_lo
        seg_hi = full_hi
    else:
        seg_lo = full_hi
        seg_hi = hi
    return seg_lo, seg_hi


@triton.jit
def dropout_keep(
    seed, rng_base, offs_m, start_n, row_groups, drop_threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Keep-mask ``[BLOCK_M, BLOCK_N]`` of Philox dropout for rows ``offs_m`` and columns
    ``start_n + arange(BLOCK_N)`` (start_n and BLOCK_N multiples of 64) of one (batch, head); see
    ``tileattn.rng`` for the mapping, which this helper and the torch replica share.

    One ``randint4x`` gives 16 8-bit draws. They go to the 16 columns ``64j + 8i + 2c + h`` (i < 8,
    h < 2) of counter ``(row, j, c)``: in Hopper's MMA accumulator layout one thread holds exactly these
    columns of its row, so the compiler evaluates each Philox counter once, in the thread that needs it,
    instead of converting the mask's layout or recomputing a draw in several lanes.
    ``rng_base`` comes from ``prologue``; ``row_groups`` is the kernels' own."""
    tl.static_assert(BLOCK_N % 64 == 0, "dropout needs key tiles of a multiple of 64 columns")
    J: tl.constexpr = BLOCK_N // 64
    g = (start_n // 64 + tl.arange(0, J))[:, None] * 4 + tl.arange(0, 4)[None, :]  # [J, C]
    counters = rng_base + offs_m.to(tl.int64)[:, None, None] * row_groups + g[None, :, :]  # [BLOCK_M, J, C]
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    i = tl.arange(0, 8)[None, None, :, None]
    word = tl.where(
        i < 4,
        tl.where(i < 2, w0[:, :, None, :], w1[:, :, None, :]),
        tl.where(i < 6, w2[:, :, None, :], w3[:, :, None, :]),
    )  # [BLOCK_M, J, I, C]: word i // 2
    shift = ((i % 2) * 2)[:, :, :, :, None] * 8 + tl.arange(0, 2)[None, None, None, None, :] * 8
    bits = ((word[:, :, :, :, None] >> shift.to(tl.uint32)) & 0xFF).to(tl.float32)  # [BLOCK_M, J, I, C, H]
    # a byte at or above the threshold (``AttnParams.drop_threshold``, flash_attn's rule) is kept
    return tl.reshape(bits, [BLOCK_M, BLOCK_N]) >= drop_threshold
