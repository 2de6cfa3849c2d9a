"""A FlashMask on the device: its kernels' form with its value checks (``canonical``, one launch and one
host read), and the tile schedules of its calls: which tiles each program of a launch visits, masked or not.

A program of the forward (or the dQ pass) owns a query tile and walks key tiles; a program of the dK/dV
pass owns a key tile and walks query tiles. For each program, ``tile_runs`` classifies every tile on
the other side from the min / max of each bound over the key tile (O(seqlen_k / BLOCK_N) numbers),
together with the causal / window band and the ragged ends of the sequences:

- skipped: a bound interval hides every row of the tile from every column (lower: max start <= first row
  and min end > last row), or the window does; no load and no matmul;
- full: no interval can touch the tile's rows (min start > last row or max end <= first row), the
  window band covers it and neither side is ragged: it runs without the element mask;
- partial: anything else, run with the element mask (``common.flashmask_hides``).

Consecutive tiles of one kind make a run. A program's schedule is its runs, the partial ones first and
then the full ones (int32 ``(nheads_mask, programs, tiles, 2)`` [first, end) pairs, and the two counts
per program), built on the device in two launches and no host sync (``_key_tile_stats_kernel``, once
per key-tile width and shared by the launches of a call, then ``_schedule_kernel``), and remembered per
mask tensor (``SCHEDULES``). The kernels loop over the runs, and within a run over contiguous tiles as
they do without a mask, so the loads of a run pipeline as in the dense kernel; the schedule's size is
that of the launch's tile grid. ``reference_tile_runs`` builds the same schedule with torch ops (the
tests' reference).

Key tiles are numbered ``b + start_k[b] // BLOCK_N + n`` (tile ``n`` of sequence ``b``): increasing,
distinct, fewer than ``cdiv(tokens, BLOCK_N) + batch``, and found from ``cu_seqlens_k`` alone (no prefix
sum over the tiles of the sequences before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileattn import checks
from tileattn.checks import CheckedOnce
from tileattn.flashmask import uses_upper
from tileattn.kernels.common import seq_bounds
from tileattn.kernels.launch import Launcher
from tileattn.params import AttnParams, FlashMask, cdiv, next_power_of_2

# list tiles a schedule program classifies at once (it loops past that)
LIST_CHUNK = 1024
# sequences of a packed batch a schedule program scans at once for its own sequence (it loops past that)
SEQ_CHUNK = 1024


@triton.jit
def _canonical_kernel(
    Idx, Bounds, Summary,
    stride_ib, stride_ih, stride_ij, stride_ic, stride_bh, stride_bc,  #
    columns_per_row, tokens, nheads_mask,
    C: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``tileattn.flashmask.canonical`` for tokens ``[program_id(0) * BLOCK, ...)`` of mask head
    ``program_id(1)``, and the numbers ``checks.flashmask_values`` reads, merged by atomic minima into
    ``Summary`` (int32, preset to INT_MAX): the least value, minus the greatest, and per pair of
    ``checks.flashmask_pairs`` the first flat column whose start passes its end. Token ``t`` is
    column ``t % columns_per_row`` of batch row ``t // columns_per_row`` (a packed mask: one row)."""
    EMPTY: tl.constexpr = 2**30
    h = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask_t = offs_t < tokens
    row = offs_t // columns_per_row
    j = offs_t - row * columns_per_row
    idx_ptrs = Idx + row.to(tl.int64) * stride_ib + h.to(tl.int64) * stride_ih + j.to(tl.int64) * stride_ij
    flat = (row * nheads_mask + h) * columns_per_row + j  # (the row of idx.reshape(-1, C))
    c0 = tl.load(idx_ptrs, mask=mask_t, other=0)  # [BLOCK]
    low = tl.min(tl.where(mask_t, c0, 2147483647), 0)
    high = tl.max(tl.where(mask_t, c0, -2147483647), 0)
    if C > 1:
        c1 = tl.load(idx_ptrs + stride_ic, mask=mask_t, other=0)
        low = tl.minimum(low, tl.min(tl.where(mask_t, c1, 2147483647), 0))
        high = tl.maximum(high, tl.max(tl.where(mask_t, c1, -2147483647), 0))
    if C == 4:
        c2 = tl.load(idx_ptrs + 2 * stride_ic, mask=mask_t, other=0)
        c3 = tl.load(idx_ptrs + 3 * stride_ic, mask=mask_t, other=0)
        low = tl.minimum(low, tl.minimum(tl.min(tl.where(mask_t, c2, 2147483647), 0),
                                         tl.min(tl.where(mask_t, c3, 2147483647), 0)))  # fmt: skip
        high = tl.maximum(high, tl.maximum(tl.max(tl.where(mask_t, c2, -2147483647), 0),
                                           tl.max(tl.where(mask_t, c3, -2147483647), 0)))  # fmt: skip
    tl.atomic_min(Summary, low)
    tl.atomic_min(Summary + 1, -high)
    # the four bounds (an empty interval: (EMPTY, EMPTY) below, (0, 0) above)
    lower_start = c0
    lower_end = tl.full([BLOCK], EMPTY, tl.int32)
    upper_start = tl.zeros([BLOCK], dtype=tl.int32)
    upper_end = tl.zeros([BLOCK], dtype=tl.int32)
    if C == 4 or (C == 2 and CAUSAL):
        lower_end = c1
        bad = mask_t & (c0 > c1)
        tl.atomic_min(Summary + 2, tl.min(tl.where(bad, flat, 2147483647), 0))
    if C == 4:
        upper_start = c2
        upper_end = c3
        bad = mask_t & (c2 > c3)
        tl.atomic_min(Summary + 3, tl.min(tl.where(bad, flat, 2147483647), 0))
    if C == 2 and not CAUSAL:
        upper_end = c1
    lower_none = lower_start >= lower_end
    upper_none = upper_start >= upper_end
    bounds_ptrs = Bounds + h.to(tl.int64) * stride_bh + offs_t
    tl.store(bounds_ptrs, tl.where(lower_none, EMPTY, lower_start), mask=mask_t)
    tl.store(bounds_ptrs + stride_bc, tl.where(lower_none, EMPTY, lower_end), mask=mask_t)
    tl.store(bounds_ptrs + 2 * stride_bc, tl.where(upper_none, 0, upper_start), mask=mask_t)
    tl.store(bounds_ptrs + 3 * stride_bc, tl.where(upper_none, 0, upper_end), mask=mask_t)


@triton.jit
def _first_key_tile(b, CuSeqlensK, seqlen_k, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The number of sequence ``b``'s first key tile, ``b + start_k[b] // BLOCK_N`` (module docstring)."""
    if IS_VARLEN:
        start_k = tl.load(CuSeqlensK + b)
    else:
        start_k = b * seqlen_k
    return b + start_k // BLOCK_N


@triton.jit
def _key_tile_stats_kernel(
    Bounds, Stats, CuSeqlensK,
    stride_bh, stride_bc, stride_sh, stride_sc,  #
    batch, seqlen_k,
    BLOCK_N: tl.constexpr, HAS_UPPER: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """Min and max of each bound over key tile ``program_id(0)`` of mask head ``program_id(1)``:
    ``Stats[h, 2 * c]`` the min of bound ``c``, ``Stats[h, 2 * c + 1]`` its max. Ids past the last
    tile, or between sequences, are left unwritten (no schedule reads them)."""
    g = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    # the sequence: the last b whose first tile is at most g (a binary search; the first tiles increase)
    lo = 0
    hi = batch
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_key_tile(mid, CuSeqlensK, seqlen_k, BLOCK_N, IS_VARLEN) <= g:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    n = g - _first_key_tile(b, CuSeqlensK, seqlen_k, BLOCK_N, IS_VARLEN)
    _q_start, _len_q, start_k, len_k = seq_bounds(b, CuSeqlensK, CuSeqlensK, 0, seqlen_k, IS_VARLEN)
    if not IS_VARLEN:  # (a dense mask's key tokens are b * seqlen_k + j)
        start_k = b * seqlen_k
    if n * BLOCK_N < len_k:
        offs_j = n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_j = offs_j < len_k
        bounds_ptrs = Bounds + h * stride_bh + start_k + offs_j
        stats_ptrs = Stats + h * stride_sh + g
        for c in tl.static_range(4 if HAS_UPPER else 2):
            bound = tl.load(bounds_ptrs + c * stride_bc, mask=mask_j, other=0)  # [BLOCK_N]
            tl.store(stats_ptrs + (2 * c) * stride_sc, tl.min(tl.where(mask_j, bound, 2147483647), 0))
            tl.store(stats_ptrs + (2 * c + 1) * stride_sc, tl.max(tl.where(mask_j, bound, -1), 0))  # (bounds >= 0)


@triton.jit
def _tile_kinds(
    o, own, len_q, len_k, first_key_tile, Stats, stride_sc, n_list, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BY_KEYS: tl.constexpr, HAS_UPPER: tl.constexpr,
):  # fmt: skip
    """The kind of list tiles ``o`` (a vector) of the program that owns tile ``own``: 0 skipped, 1 partial,
    2 full (``reference_tile_runs``'s rules); tiles outside ``[0, n_list)`` are skipped."""
    if BY_KEYS:
        m_tile = o
        n_tile = own
    else:
        m_tile = own
        n_tile = o
    m0 = m_tile * BLOCK_M
    n0 = n_tile * BLOCK_N
    m1 = tl.minimum(m0 + BLOCK_M, len_q)  # ends of the real rows / columns
    n1 = tl.minimum(n0 + BLOCK_N, len_k)
    skip = (o < 0) | (o >= n_list) | (m0 >= len_q) | (n0 >= len_k)
    full = n0 + BLOCK_N <= len_k
    if BY_KEYS:  # (a dK/dV program masks ragged query rows; a query program just does not store them)
        full = full & (m0 + BLOCK_M <= len_q)
    diag = len_k - len_q
    if window_right >= 0:
        skip = skip | (n0 > m1 - 1 + diag + window_right)
        full = full & (n1 - 1 <= m0 + diag + window_right)
    if window_left >= 0:
        skip = skip | (n1 - 1 < m0 + diag - window_left)
        full = full & (n0 >= m1 - 1 + diag - window_left)
    # the bounds' min / max over the key tile (the mask hides every row of the tile / none of them)
    stats_ptrs = Stats + first_key_tile + n_tile + o * 0
    mask_s = skip == 0  # (not ~skip: Triton 3.9's interpreter refuses that mask's dtype)
    for c in tl.static_range(0, 4 if HAS_UPPER else 2, 2):
        start_min = tl.load(stats_ptrs + (2 * c) * stride_sc, mask=mask_s, other=0)
        start_max = tl.load(stats_ptrs + (2 * c + 1) * stride_sc, mask=mask_s, other=0)
        end_min = tl.load(stats_ptrs + (2 * c + 2) * stride_sc, mask=mask_s, other=0)
        end_max = tl.load(stats_ptrs + (2 * c + 3) * stride_sc, mask=mask_s, other=0)
        skip = skip | ((start_max <= m0) & (end_min >= m1))
        full = full & ((start_min >= m1) | (end_max <= m0))
    return tl.where(skip, 0, tl.where(full, 2, 1))


@triton.jit
def _kinds_around(
    o, own, len_q, len_k, first_key_tile, Stats, stride_sc, n_list, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BY_KEYS: tl.constexpr, HAS_UPPER: tl.constexpr,
):  # fmt: skip
    """``_tile_kinds`` of tiles ``o - 1``, ``o`` and ``o + 1``: where runs start and end."""
    before = _tile_kinds(o - 1, own, len_q, len_k, first_key_tile, Stats, stride_sc, n_list, window_left, window_right,
                         BLOCK_M, BLOCK_N, BY_KEYS, HAS_UPPER)  # fmt: skip
    kind = _tile_kinds(o, own, len_q, len_k, first_key_tile, Stats, stride_sc, n_list, window_left, window_right,
                       BLOCK_M, BLOCK_N, BY_KEYS, HAS_UPPER)  # fmt: skip
    after = _tile_kinds(o + 1, own, len_q, len_k, first_key_tile, Stats, stride_sc, n_list, window_left, window_right,
                        BLOCK_M, BLOCK_N, BY_KEYS, HAS_UPPER)  # fmt: skip
    return before, kind, after


@triton.jit
def _schedule_kernel(
    Stats, Runs, Counts, CuSeqlensQ, CuSeqlensK,
    stride_sh, stride_sc, stride_rh, stride_ch,  #
    batch, seqlen_q, seqlen_k, n_list, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BY_KEYS: tl.constexpr, HAS_UPPER: tl.constexpr,
    IS_VARLEN: tl.constexpr, CHUNK: tl.constexpr, SEQ_CHUNK: tl.constexpr,
):  # fmt: skip
    """The runs of program ``t = program_id(0)`` of a launch under mask head ``program_id(1)``: its list
    tiles classified (``_tile_kinds``), each run's [first, end) at ``Runs[h, t, r]``, the partial runs
    first, in order, then the full ones, and ``Counts[h, t] = (partial runs, full runs)``."""
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    BLOCK_OWN: tl.constexpr = BLOCK_N if BY_KEYS else BLOCK_M
    # program t: the sequence whose tiles (counted on the owner's side) end after t, and its tile in it
    if IS_VARLEN:
        Cu = CuSeqlensK if BY_KEYS else CuSeqlensQ
        b = 0
        tiles_before = 0  # the tiles of the sequences before b
        carry = 0
        for s0 in range(0, batch, SEQ_CHUNK):
            offs_s = s0 + tl.arange(0, SEQ_CHUNK)
            mask_s = offs_s < batch
            lengths = tl.load(Cu + offs_s + 1, mask=mask_s, other=0) - tl.load(Cu + offs_s, mask=mask_s, other=0)
            tiles = (lengths + BLOCK_OWN - 1) // BLOCK_OWN  # [SEQ_CHUNK]
            done = mask_s & (carry + tl.cumsum(tiles, 0) <= t)  # sequences whose tiles end by t
            b += tl.sum(done.to(tl.int32), 0)
            tiles_before += tl.sum(tl.where(done, tiles, 0), 0)
            carry += tl.sum(tiles, 0)
        own = t - tiles_before
    else:
        tiles = tl.cdiv(seqlen_k if BY_KEYS else seqlen_q, BLOCK_OWN)
        b = t // tiles
        own = t - b * tiles
    counts_ptr = Counts + h * stride_ch + 2 * t
    if b >= batch:  # (a spare program: no work)
        tl.store(counts_ptr, 0)
        tl.store(counts_ptr + 1, 0)
    else:
        _q_start, len_q, _k_start, len_k = seq_bounds(b, CuSeqlensQ, CuSeqlensK, seqlen_q, seqlen_k, IS_VARLEN)
        first_key_tile = _first_key_tile(b, CuSeqlensK, seqlen_k, BLOCK_N, IS_VARLEN)
        stats = Stats + h * stride_sh
        runs_ptr = Runs + h * stride_rh + t.to(tl.int64) * (2 * n_list)
        # pass 1: how many partial runs (the full ones are stored after them)
        n_partial = 0
        for c0 in range(0, n_list, CHUNK):
            o = c0 + tl.arange(0, CHUNK)
            # (names of their own: a name assigned before a loop is carried through it, with one type)
            kind_before, kind_here, kind_after = _kinds_around(
                o, own, len_q, len_k, first_key_tile, stats, stride_sc, n_list, window_left, window_right,
                BLOCK_M, BLOCK_N, BY_KEYS, HAS_UPPER,
            )  # fmt: skip
            n_partial += tl.sum(((kind_here == 1) & (kind_before != 1)).to(tl.int32), 0)
        # pass 2: a run's start and its end get the same rank among the runs of its kind
        n_starts_p = 0
        n_ends_p = 0
        n_starts_f = 0
        n_ends_f = 0
        for c0 in range(0, n_list, CHUNK):
            o = c0 + tl.arange(0, CHUNK)
            before, kind, after = _kinds_around(o, own, len_q, len_k, first_key_tile, stats, stride_sc, n_list,
                                                window_left, window_right, BLOCK_M, BLOCK_N, BY_KEYS, HAS_UPPER)  # fmt: skip
            for k in tl.static_range(1, 3):
                start = (kind == k) & (before != k)
                end = (kind == k) & (after != k)
                base_s = n_starts_p if k == 1 else n_partial + n_starts_f
                base_e = n_ends_p if k == 1 else n_partial + n_ends_f
                rank_s = base_s + tl.cumsum(start.to(tl.int32), 0) - 1
                rank_e = base_e + tl.cumsum(end.to(tl.int32), 0) - 1
                tl.store(runs_ptr + 2 * rank_s, o, mask=start)
                tl.store(runs_ptr + 2 * rank_e + 1, o + 1, mask=end)
                if k == 1:
                    n_starts_p += tl.sum(start.to(tl.int32), 0)
                    n_ends_p += tl.sum(end.to(tl.int32), 0)
                else:
                    n_starts_f += tl.sum(start.to(tl.int32), 0)
                    n_ends_f += tl.sum(end.to(tl.int32), 0)
        tl.store(counts_ptr, n_partial)
        tl.store(counts_ptr + 1, n_starts_f)


# (kernels.launch: each build chosen once per launch key, then launched without JITFunction.run's host time)
CANONICAL, STATS, SCHEDULE = Launcher(_canonical_kernel), Launcher(_key_tile_stats_kernel), Launcher(_schedule_kernel)

# schedules remembered per (startend_row_indices, cu_seqlens) tensors while they are alive and unmodified, and
# per launch shape: a model's layers, and a backward after its forward, reuse them instead of building again
SCHEDULES = CheckedOnce(limit=16)


def canonical(startend_row_indices: torch.Tensor, causal: bool, varlen: bool, seqlen_q: int) -> FlashMask:
    """``tileattn.flashmask.canonical`` in one launch, values checked (``checks.flashmask_values``) from the
    numbers the launch gathers: one host read (``startend_row_indices`` as ``checks.check_startend_row_indices``
    admits it)."""
    idx = startend_row_indices
    if varlen:
        heads, tokens, columns = idx.shape
        strides, per_row = (0, *idx.stride()), tokens
    else:
        batch, heads, seqlen_k, columns = idx.shape
        strides, per_row, tokens = idx.stride(), seqlen_k, batch * seqlen_k
    bounds = torch.empty((heads, 4, tokens), dtype=torch.int32, device=idx.device)
    summary = torch.full((4,), 2**31 - 1, dtype=torch.int32, device=idx.device)
    if tokens:
        block = 1024
        CANONICAL(
            (cdiv(tokens, block), heads),
            (idx, bounds, summary, *strides, bounds.stride(0), bounds.stride(1), per_row, tokens, heads),
            dict(C=columns, CAUSAL=causal, BLOCK=block),
        )
    low, minus_high, *bad = summary.tolist()
    checks.flashmask_values(idx, causal, seqlen_q, [low, -minus_high, *(-1 if b == 2**31 - 1 else b for b in bad)])
    return FlashMask(bounds, uses_upper(columns, causal))


def tile_runs(
    p: AttnParams, block_m: int, block_n: int, by_keys: bool, programs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``build_tile_runs``, remembered (``SCHEDULES``) per mask and cu_seqlens tensors and launch shape, the
    key tiles' statistics too (shared by the launches with the same ``block_n``); built each time for a
    FlashMask given in the kernels' form only, without its ``startend_row_indices``."""
    if p.startend_row_indices is None:
        return build_tile_runs(p, block_m, block_n, by_keys, programs, key_tile_stats(p, block_n))
    tensors = (p.startend_row_indices, p.cu_seqlens_q, p.cu_seqlens_k)
    shape = (p.mask_causal, p.batch, p.seqlen_q, p.seqlen_k, device)

    def build() -> tuple[torch.Tensor, torch.Tensor]:  # (the statistics looked up only when a schedule is built)
        stats = SCHEDULES(tensors, (*shape, block_n), lambda: key_tile_stats(p, block_n))
        return build_tile_runs(p, block_m, block_n, by_keys, programs, stats)

    args = (*shape, p.window_left, p.window_right, block_m, block_n, by_keys, programs)
    return SCHEDULES(tensors, args, build)


def key_tile_stats(p: AttnParams, block_n: int) -> torch.Tensor:
    """The min and max of each bound of ``p.flashmask`` over every key tile of ``block_n`` tokens: int32
    ``(nheads_mask, 8 or 4, tiles)`` (``_key_tile_stats_kernel``; 4 rows without the upper interval),
    tiles numbered as the module docstring says."""
    fm = p.flashmask
    n_ids = cdiv(fm.bounds.shape[-1], block_n) + p.batch
    stats = torch.empty((fm.heads, 8 if fm.has_upper else 4, n_ids), dtype=torch.int32, device=fm.bounds.device)
    STATS(
        (n_ids, fm.heads),
        (
            fm.bounds, stats, p.cu_seqlens_k if p.is_varlen else stats,
            fm.bounds.stride(0), fm.bounds.stride(1), stats.stride(0), stats.stride(1),
            p.batch, p.seqlen_k,
        ),
        dict(BLOCK_N=block_n, HAS_UPPER=fm.has_upper, IS_VARLEN=p.is_varlen),
    )  # fmt: skip
    return stats


def build_tile_runs(
    p: AttnParams, block_m: int, block_n: int, by_keys: bool, programs: int, stats: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule of one launch over ``programs`` flat tiles (the grid's tile axis times its batch
    axis: program ``t`` is tile ``t - first[b]`` of sequence ``b``, as ``common.seq_tile`` maps it), in
    one launch of ``_schedule_kernel`` on ``key_tile_stats(p, block_n)``. ``by_keys``: programs own key
    tiles of ``block_n`` and walk query tiles of ``block_m`` (dK/dV); otherwise the reverse. Returns int32
    ``runs`` ``(nheads_mask, programs, n_list, 2)``, [first, end) tile indices within the sequence, the
    partial runs first and then the full ones (entries past the counts unset), and ``counts``
    ``(nheads_mask, programs, 2)``: how many of each."""
    fm = p.flashmask
    n_list = max(1, cdiv(p.seqlen_q if by_keys else p.seqlen_k, block_m if by_keys else block_n))
    device = fm.bounds.device
    runs = torch.empty((fm.heads, programs, n_list, 2), dtype=torch.int32, device=device)
    counts = torch.empty((fm.heads, programs, 2), dtype=torch.int32, device=device)
    cu_q, cu_k = (p.cu_seqlens_q, p.cu_seqlens_k) if p.is_varlen else (counts, counts)
    SCHEDULE(
        (programs, fm.heads),
        (
            stats, runs, counts, cu_q, cu_k,
            stats.stride(0), stats.stride(1), runs.stride(0), counts.stride(0),
            p.batch, p.seqlen_q, p.seqlen_k, n_list, p.window_left, p.window_right,
        ),
        dict(
            BLOCK_M=block_m, BLOCK_N=block_n, BY_KEYS=by_keys, HAS_UPPER=fm.has_upper, IS_VARLEN=p.is_varlen,
            CHUNK=max(16, min(LIST_CHUNK, next_power_of_2(n_list))),
            SEQ_CHUNK=max(16, min(SEQ_CHUNK, next_power_of_2(p.batch))),
        ),
    )  # fmt: skip
    return runs, counts


def launch_args(
    p: AttnParams, block_m: int, block_n: int, by_keys: bool, programs: int, placeholder: torch.Tensor
) -> tuple:
    """The kernels' FlashMask arguments ``(Bounds, Runs, Counts, stride_bh, stride_bc, stride_rh,
    stride_ch, n_list)`` for a launch (``tile_runs``); head strides are 0 for one mask shared by every
    head. Calls without a FlashMask pass ``placeholder`` for the pointers (never read)."""
    fm = p.flashmask
    if fm is None:
        return placeholder, placeholder, placeholder, 0, 0, 0, 0, 1
    runs, counts = tile_runs(p, block_m, block_n, by_keys, programs, placeholder.device)
    per_head = fm.heads > 1
    return (
        fm.bounds,
        runs,
        counts,
        fm.bounds.stride(0) if per_head else 0,
        fm.bounds.stride(1),
        runs.stride(0) if per_head else 0,
        counts.stride(0) if per_head else 0,
        runs.shape[-2],
    )


# the reference: the same schedule from torch ops


def _sequences(p: AttnParams, device: torch.device):
    """Each sequence's query length, key length and first key token (int64 ``(batch,)`` tensors)."""
    if p.is_varlen:
        cu_q, cu_k = p.cu_seqlens_q.long(), p.cu_seqlens_k.long()
        return cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1], cu_k[:-1]
    ones = torch.ones(p.batch, dtype=torch.int64, device=device)
    return ones * p.seqlen_q, ones * p.seqlen_k, torch.arange(p.batch, device=device) * p.seqlen_k


def _key_tile_stats(fm: FlashMask, len_k, start_k, block_n: int):
    """Min and max of each bound over every key tile: int32 ``(nheads_mask, 4, tiles)`` each, tiles
    numbered sequence by sequence (``first_tile[b] + n``), and each sequence's first tile."""
    device = len_k.device
    tokens = fm.bounds.shape[-1]
    tiles_k = (len_k + block_n - 1) // block_n
    first_tile = torch.cumsum(tiles_k, 0) - tiles_k
    n_tiles = cdiv(tokens, block_n) + len_k.numel()  # an upper bound of sum(tiles_k), known on the host
    tok = torch.arange(tokens, device=device)
    seq = torch.searchsorted(start_k + len_k, tok, right=True)  # tokens past the last sequence: batch
    in_seq = seq < len_k.numel()
    seq = seq.clamp(max=len_k.numel() - 1)
    tile = torch.where(in_seq & (tok >= start_k[seq]), first_tile[seq] + (tok - start_k[seq]) // block_n, n_tiles)
    index = tile.view(1, 1, -1).expand_as(fm.bounds)
    shape = (*fm.bounds.shape[:2], n_tiles + 1)  # one spare slot for padding tokens
    lo = fm.bounds.new_zeros(shape).scatter_reduce_(2, index, fm.bounds, "amin", include_self=False)
    hi = fm.bounds.new_zeros(shape).scatter_reduce_(2, index, fm.bounds, "amax", include_self=False)
    return lo, hi, first_tile


def reference_tile_runs(
    p: AttnParams, block_m: int, block_n: int, by_keys: bool, programs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``build_tile_runs``'s schedule built with torch ops (its reference in the tests; runs past the
    counts hold other tile indices)."""
    fm = p.flashmask
    len_q, len_k, start_k = _sequences(p, device)
    lo, hi, first_k_tile = _key_tile_stats(fm, len_k, start_k, block_n)
    block_prog, block_list = (block_n, block_m) if by_keys else (block_m, block_n)
    len_prog = len_k if by_keys else len_q
    n_list = max(1, cdiv(p.seqlen_q if by_keys else p.seqlen_k, block_list))

    # program t: sequence and tile within it (spare programs past the last tile get no work)
    tiles_prog = (len_prog + block_prog - 1) // block_prog
    ends = torch.cumsum(tiles_prog, 0)
    t = torch.arange(programs, device=device)
    seq = torch.searchsorted(ends, t, right=True)
    real = seq < p.batch
    seq = seq.clamp(max=p.batch - 1)
    own = (t - (ends[seq] - tiles_prog[seq]))[:, None]  # (programs, 1)
    other = torch.arange(n_list, device=device)[None, :]  # (1, n_list)
    m_tile, n_tile = (other, own) if by_keys else (own, other)
    seq = seq[:, None]
    lq, lk = len_q[seq], len_k[seq]
    m0, n0 = m_tile * block_m, n_tile * block_n
    m1, n1 = torch.minimum(m0 + block_m, lq), torch.minimum(n0 + block_n, lk)  # ends of the real rows / columns
    skip = ~real[:, None] | (m0 >= lq) | (n0 >= lk)
    full = (n0 + block_n <= lk) & ((m0 + block_m <= lq) if by_keys else True)

    diag = lk - lq
    if p.window_right >= 0:
        skip |= n0 > m1 - 1 + diag + p.window_right
        full &= n1 - 1 <= m0 + diag + p.window_right
    if p.window_left >= 0:
        skip |= n1 - 1 < m0 + diag - p.window_left
        full &= n0 >= m1 - 1 + diag - p.window_left

    key_tile = (first_k_tile[seq] + n_tile).clamp(max=lo.shape[-1] - 1)  # (programs, n_list) or (programs, 1)

    def stat(table: torch.Tensor, c: int) -> torch.Tensor:  # (nheads_mask, programs, n_list)
        return table[:, c][:, key_tile]

    intervals = ((0, 1), (2, 3)) if fm.has_upper else ((0, 1),)
    for start, end in intervals:
        skip = skip | ((stat(hi, start) <= m0) & (stat(lo, end) >= m1))  # hides every row of the tile
        full = full & ((stat(lo, start) >= m1) | (stat(hi, end) <= m0))  # hides none of its rows
    skip = skip.expand(fm.heads, programs, n_list)
    kind = torch.where(skip, 0, torch.where(full, 2, 1)).to(torch.int8)  # 0 skipped, 1 partial, 2 full
    return _runs(kind)


def _runs(kind: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive tiles of one kind along the last dim of ``kind`` (0 skipped, 1 partial, 2 full):
    int32 ``(..., n, 2)`` [first, end) tile pairs, the partial runs first and then the full ones, and
    int32 ``(..., 2)``: how many of each."""
    n = kind.shape[-1]
    before = torch.nn.functional.pad(kind, (1, 0))[..., :-1]  # (skipped before the first tile)
    starts = (kind != 0) & (kind != before)
    index = torch.arange(n, device=kind.device)
    # each tile's next change of kind, and so each run's end: a reversed running minimum of change positions
    change = torch.where(kind[..., 1:] != kind[..., :-1], index[1:], n)
    change = torch.cat([change, index.new_full((*kind.shape[:-1], 1), n)], -1)
    next_change = torch.flip(torch.cummin(torch.flip(change, [-1]), -1).values, [-1])
    order = torch.where(starts, kind - 1, 2).to(torch.int8)  # partial runs, full runs, the rest
    first = torch.sort(order, dim=-1, stable=True).indices
    runs = torch.stack([first, next_change.gather(-1, first)], -1).to(torch.int32)
    counts = torch.stack([(starts & (kind == 1)).sum(-1), (starts & (kind == 2)).sum(-1)], -1).to(torch.int32)
    return runs.contiguous(), counts.contiguous()
