"""Attention against a KV cache: decoding and chunked/paged prefill (forward only).

``_attn_fwd_kvcache`` reads keys and values from a cache, contiguous ``(batch_cache, capacity, nheads_k,
d)`` or paged ``(num_pages, PAGE_SIZE, nheads_k, d)`` through a block table, and computes one block of
*packed* query rows: row r of a block is token ``r // group`` of query head ``hk * group + r % group``,
so the GQA group's query heads share every K/V tile they read (one read of the cache per kv head, the
bandwidth that decoding is bound by). Split-KV (Flash-Decoding): the third grid axis cuts each
sequence's key range into ``num_splits`` parts (runs of key tiles, or every num_splits-th tile for small
pages: ``DECODE_INTERLEAVE``) that write partial outputs and LSEs; ``_combine`` merges them (on sm90+
as a programmatic dependent launch, ``DECODE_PDL``). Masks, softcap and ALiBi go through the same
helpers as the training kernels (``kernels.common``); each sequence's keys are ``[leftpad, seqlens_k)``
of its cache row, counted from leftpad, with masks aligned to the bottom-right corner as everywhere
else. K/V tiles come through pointer loads, or TMA descriptors where the settings below allow
(long programs; pages that hold whole key tiles). On sm90+ the split kernel is itself a programmatic
dependent of the kernel ahead of it in the stream (``DECODE_PDL_ATTN``: it waits for it before reading
anything). Launches go through ``kernels.launch.Launcher``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tileattn.kernels import common
from tileattn.kernels.configs import (
    AttnParams,
    KernelConfig,
    cdiv,
    interpreting,
    next_power_of_2,
    padded_headdim,
    remember,
)
from tileattn.kernels.launch import Launcher


@dataclass
class CacheLayout:
    """Where each sequence's keys live, validated by the API.

    seqlens_k: int32 ``(batch,)`` and new_tokens: each sequence's keys end at ``seqlens_k[b] +
    new_tokens`` in its cache row (cache_seqlens, and the tokens just appended); leftpad: int32
    ``(batch,)`` start, or None for 0; batch_idx: int32 ``(batch,)`` cache row of each sequence, or None
    for row b; block_table: int32 ``(batch, max_pages)`` or None; num_splits: 0 = heuristic;
    max_seqlen_k: the longest key range if known on the host (else the capacity is assumed); plans: a
    dict in which the launches of calls with the same metadata as this one are planned once
    (``attn_fwd_kvcache``; the API keeps one per call signature), or None to plan them for this call
    only; q_rotary: ``(cos, sin, interleaved, per_token)`` to rotate q at ``seqlens_k[b]`` (plus its token
    index if per_token) as it is read (dense q only), or None."""

    seqlens_k: torch.Tensor
    new_tokens: int = 0
    leftpad: torch.Tensor | None = None
    batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    num_splits: int = 0
    max_seqlen_k: int | None = None
    plans: dict | None = None
    q_rotary: tuple | None = None


@triton.jit
def _cache_rows(
    K_base,
    V_base,
    Table_row,
    offs_n_base,
    k_start,
    start_n,
    table_pages,
    num_pages,
    stride_kn,
    stride_vn,
    stride_kp,
    stride_vp,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    MASK_TABLE: tl.constexpr,
    OFFS_64: tl.constexpr,
):
    """``(K_tile, rows_k, V_tile, rows_v)``: the key tile at column ``start_n`` (a multiple of BLOCK_N,
    columns counted from k_start) is at ``K_tile + rows_k`` (row starts, elements) in the K cache, and
    likewise in V. Through the block table when PAGED, pages clamped to the pool so that a bad table
    never reads outside it, and table reads masked past the table's ``table_pages`` entries with
    MASK_TABLE (entries past the sequence are read but feed only masked rows). A tile inside one page
    (pages of whole tiles, k_start = 0) takes one lookup; pages that divide the tile split the position
    into page index and slot, so the slots' offsets stay loop-invariant.

    Offsets are int32 unless OFFS_64 (a cache whose offsets from the kv head's start could pass 2**31):
    64-bit products were about a quarter of a paged key tile's instructions (docs/perf.md). With
    OFFS_64 a one-lookup tile's page start moves into ``K_tile`` (once per tile) and the per-row
    products are unsigned wide multiplies (``_wide_product``)."""
    first = k_start + offs_n_base  # loop-invariant
    K_tile = K_base
    V_tile = V_base
    if PAGED:
        ONE_LOOKUP: tl.constexpr = PAGE_SIZE % BLOCK_N == 0 and not HAS_LEFTPAD  # the tile lies in one page
        if ONE_LOOKUP:
            idx = start_n // PAGE_SIZE
            slot = start_n % PAGE_SIZE + offs_n_base
        elif BLOCK_N % PAGE_SIZE == 0:
            idx = first // PAGE_SIZE + start_n // PAGE_SIZE
            slot = first % PAGE_SIZE
        else:
            idx = (first + start_n) // PAGE_SIZE
            slot = (first + start_n) % PAGE_SIZE
        if MASK_TABLE:
            page = tl.load(Table_row + idx, mask=idx < table_pages, other=0)
        else:
            page = tl.load(Table_row + idx)
        page = _pool_page(page, num_pages)
        if OFFS_64 and ONE_LOOKUP:  # the page's start as a 64-bit pointer, once per tile
            K_tile = K_base + page.to(tl.int64) * stride_kp
            V_tile = V_base + page.to(tl.int64) * stride_vp
            rows_k = _wide_product(slot, stride_kn)
            rows_v = _wide_product(slot, stride_vn)
        elif OFFS_64:
            rows_k = _wide_product(page, stride_kp) + _wide_product(slot, stride_kn)
            rows_v = _wide_product(page, stride_vp) + _wide_product(slot, stride_vn)
        else:
            rows_k = page * stride_kp + slot * stride_kn
            rows_v = page * stride_vp + slot * stride_vn
    else:
        pos = first + start_n
        if OFFS_64:
            pos = pos.to(tl.int64)
        rows_k = pos * stride_kn
        rows_v = pos * stride_vn
    return K_tile, rows_k, V_tile, rows_v


@triton.jit
def _table_to_l2(
    Table_row,
    table_pages,
    k_start,
    split,
    num_splits,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    UNIT: tl.constexpr,
):
    """Prefetches into L2 (``prefetch.global.L2``, nothing waits on it) block-table sectors of this row
    that the program will read: with INTERLEAVE the sector of the first entry of each of its first 128
    key tiles (all of a tile's entries when they fit in that sector: 64-key tiles over pages of 16),
    else the row's first 128 sectors (1024 entries) whatever range the split reads, since a run of
    consecutive tiles starts where the sequence's length puts it. Entries outside ``[0, table_pages)``
    are not prefetched. The table's loads in the key loop then wait on L2, not DRAM: Triton issues each
    right before the K/V copies that take its pages."""
    j = tl.arange(0, 128)
    if INTERLEAVE:
        idx = (k_start + (split + j * num_splits).to(tl.int64) * (UNIT * BLOCK_N)) // PAGE_SIZE
    else:
        idx = j * 8
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r",
        [Table_row + idx, ((idx >= 0) & (idx < table_pages)).to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _wide_product(index, stride):
    """``index * stride`` in int64 for a non-negative ``index`` below 2**31 and a non-negative stride,
    with the index zero-extended: a wide multiply and one more multiply-add per element, without the
    sign handling of a signed 64-bit product. (``tl.cast``: Triton passes a stride equal to 1 as a
    constant; an index is int64 when the block table spans 2**31 keys.)"""
    wide = index.to(tl.int32).to(tl.uint32, bitcast=True).to(tl.uint64)  # (int64 when capacity is)
    return (wide * tl.cast(stride, tl.int64).to(tl.uint64, bitcast=True)).to(tl.int64, bitcast=True)


@triton.jit
def _pool_page(page, num_pages):
    """Table entries clamped to the pool's pages with one unsigned minimum: a negative entry wraps past
    the pool and reads its last page, as an entry past it does. (``num_pages - 1`` through tl.cast:
    Triton passes an int argument equal to 1 as a constant.)"""
    last = tl.cast(num_pages - 1, tl.int32).to(tl.uint32)
    return tl.minimum(page.to(tl.uint32, bitcast=True), last).to(tl.int32, bitcast=True)


@triton.jit
def _unit_tile(unit_lo, j, r0, gap, UNIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column of a split's j-th tile when splits take runs of UNIT consecutive tiles in turn: from its
    first tile (column unit_lo, r0 tiles into its run), each run's end skips the ``gap`` tiles of the
    other splits."""
    return unit_lo + (j + (j + r0) // UNIT * gap) * BLOCK_N


@triton.jit
def _unit_share(t, split, num_splits, UNIT: tl.constexpr):
    """Tiles below tile t that split owns when splits take runs of UNIT tiles in turn."""
    cycle = UNIT * num_splits
    return t // cycle * UNIT + tl.minimum(tl.maximum(t % cycle - split * UNIT, 0), UNIT)


@triton.jit
def _kv_tiles(
    acc,
    l_i,
    m_i,
    q,
    K_base,
    V_base,
    k_desc,
    v_desc,
    Table_row,
    stride_kn,
    stride_vn,
    stride_kp,
    stride_vp,
    k_start,
    num_pages,
    i,
    offs_n_base,
    offs_d,
    lo,
    hi,
    step,
    unit_lo,
    unit_r0,
    unit_gap,
    table_pages,
    seqlen_q,
    seqlen_k,
    qk_scale,
    softcap_scale,
    softcap_log2,
    slope_log2,
    window_left,
    window_right,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    OFFS_64: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr,
    USE_TMA: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    DEFER_SCALE: tl.constexpr,
    UNIT: tl.constexpr,
):
    """Online softmax over the key tiles at lo, lo + step, ... below hi (columns counted from k_start;
    step is BLOCK_N, or a multiple with interleaved splits). With UNIT > 1 (splits interleaved in runs
    of UNIT tiles) the loop counts tiles instead, j in range(lo, hi, step) = range(0, count, 1), and
    tile j starts at column ``_unit_tile(unit_lo, j, unit_r0, unit_gap)``. With PREFETCH_TABLE the
    block table is read one tile ahead, so that a tile's K/V loads do not wait on its page lookup:
    faster when few programs run (latency-bound), slower at full occupancy (measured, docs/perf.md).
    With USE_TMA the tiles come through the descriptors ``k_desc`` / ``v_desc``: for contiguous caches
    over the sequence's keys (rows past seqlen_k read as zeros), for paged ones over the pool's rows of
    this kv head (unmasked tiles only; the page lookup gives the tile's first row). The pointer
    addresses computed for the other tiles are dropped as dead code where unused."""
    first = lo
    if UNIT > 1:
        first = unit_lo
    K_tile, rows_k, V_tile, rows_v = _cache_rows(
        K_base,
        V_base,
        Table_row,
        offs_n_base,
        k_start,
        first,
        table_pages,
        num_pages,
        stride_kn,
        stride_vn,
        stride_kp,
        stride_vp,
        PAGE_SIZE,
        BLOCK_N,
        PAGED,
        HAS_LEFTPAD,
        True,  # (used only with PREFETCH_TABLE; an empty segment's first tile may lie past the table row)
        OFFS_64,
    )
    for j in range(lo, hi, step):
        start_n = j
        next_n = j + step
        if UNIT > 1:
            start_n = _unit_tile(unit_lo, j, unit_r0, unit_gap, UNIT, BLOCK_N)
            next_n = _unit_tile(unit_lo, j + 1, unit_r0, unit_gap, UNIT, BLOCK_N)
        offs_n = start_n + offs_n_base
        if not PREFETCH_TABLE:
            K_tile, rows_k, V_tile, rows_v = _cache_rows(
                K_base,
                V_base,
                Table_row,
                offs_n_base,
                k_start,
                start_n,
                table_pages,
                num_pages,
                stride_kn,
                stride_vn,
                stride_kp,
                stride_vp,
                PAGE_SIZE,
                BLOCK_N,
                PAGED,
                HAS_LEFTPAD,
                MASKED or PREFETCH_TABLE,
                OFFS_64,
            )
        if USE_TMA and PAGED and not MASKED:
            # a whole tile of keys lies in one page (PAGE_SIZE a multiple of BLOCK_N, no leftpad); the
            # masked edge tiles take the pointer loads, which zero the rows past the sequence
            pos = k_start + start_n
            page = tl.load(Table_row + pos // PAGE_SIZE)
            row = _pool_page(page, num_pages) * PAGE_SIZE + pos % PAGE_SIZE
            k = k_desc.load([row, 0])  # [BLOCK_N, BLOCK_D]
            v = v_desc.load([row, 0])
        elif USE_TMA and not PAGED:
            k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_D]
            v = v_desc.load([start_n, 0])
        else:
            k = common.load_tile(
                K_tile + rows_k[:, None] + offs_d[None, :], offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D
            )  # [BLOCK_N, BLOCK_D]
            v = common.load_tile(
                V_tile + rows_v[:, None] + offs_d[None, :], offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D
            )
        if PREFETCH_TABLE:
            K_tile, rows_k, V_tile, rows_v = _cache_rows(
                K_base,
                V_base,
                Table_row,
                offs_n_base,
                k_start,
                next_n,
                table_pages,
                num_pages,
                stride_kn,
                stride_vn,
                stride_kp,
                stride_vp,
                PAGE_SIZE,
                BLOCK_N,
                PAGED,
                HAS_LEFTPAD,
                MASKED or PREFETCH_TABLE,
                OFFS_64,
            )
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        s, _ = common.scores(
            qk,
            i[:, None],
            offs_n[None, :],
            seqlen_q,
            seqlen_k,
            1.0 if DEFER_SCALE else qk_scale,
            softcap_scale,
            softcap_log2,
            slope_log2,
            window_left,
            window_right,
            MASKED,
            HAS_SOFTCAP,
            HAS_ALIBI,
            MASK_LEFT,
            MASK_RIGHT,
        )
        p, m_i, l_i, acc = common.online_softmax(s, m_i, l_i, acc, qk_scale if DEFER_SCALE else 1.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["new_tokens"])
def _attn_fwd_kvcache(
    Q,
    K,
    V,
    Out,
    Lse,
    Alibi,
    SeqlensK,
    LeftPad,
    BatchIdx,
    Table,
    CuSeqlensQ,
    Cos,
    Sin,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_os,
    stride_ob,
    stride_om,
    stride_oh,
    stride_ls,
    stride_lb,
    stride_lh,
    stride_ab,
    stride_tb,
    stride_rot,
    nheads_k,
    group_size,
    seqlen_q,
    capacity,
    num_rows_cache,
    new_tokens,
    rot_half,
    rot_len,
    sm_scale,
    softcap,
    window_left,
    window_right,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    OFFS_64: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr,
    USE_TMA: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    DEFER_SCALE: tl.constexpr,
    ROTARY_Q: tl.constexpr,
    ROT_INTERLEAVED: tl.constexpr,
    ROT_PER_TOKEN: tl.constexpr,
    TABLE_TO_L2: tl.constexpr,
    UNIT: tl.constexpr,
    WAIT_PRIOR: tl.constexpr,
):
    """Program (row block, batch·kv head, split). Without SPLIT it writes the normalised output and
    LSE; with SPLIT, fp32 partials (LSE -inf for a split that saw no key) for ``_combine``, over a run
    of consecutive key tiles, or with INTERLEAVE over the tiles ``split``, ``split + num_splits``, ...
    (so that without leftpad or a left window its first tile does not depend on the sequence's length,
    and the table read ahead of the loop goes out with the length's read); UNIT > 1 (INTERLEAVE builds
    only) deals runs of UNIT consecutive tiles in turn instead of single tiles.

    ``stride_kb``/``stride_vb`` are the page strides when PAGED, the cache-row strides otherwise. A
    sequence's keys end at ``SeqlensK[b] + new_tokens`` (the tokens just appended; not specialised on, so
    calls with and without an append share a build). ``capacity`` bounds that end and ``num_rows_cache``
    the pages / cache rows: out-of-range values are clamped so that the kernel never reads outside the
    cache (the API rejects them beforehand).

    ROTARY_Q: q is rotated as it is loaded, at position ``SeqlensK[b]`` (plus its token index with
    ROT_PER_TOKEN) of the ``(rot_len, rot_half)`` tables ``Cos`` / ``Sin`` (row stride ``stride_rot``),
    as ``_rotate_rows`` rotates the new keys (in fp32, rounded once to q's dtype; here the compiler may
    fuse a multiply and an add, which it does not there); positions are clamped to the tables.

    WAIT_PRIOR: launched as a programmatic dependent of the kernel ahead (``DECODE_PDL_ATTN``), which may
    still be writing any of the inputs: before ``griddepcontrol.wait`` only prefetches of the table's
    sectors go out (without leftpad, whose start is a load), no load."""
    if LAUNCH_DEPENDENTS:  # the combine, launched as a dependent, may start (it waits for our writes)
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = bh // nheads_k
    hk = bh % nheads_k
    b64 = b.to(tl.int64)
    Table_row = Table + b64 * stride_tb
    table_pages = capacity // PAGE_SIZE  # (paged: the block table's width)
    EARLY_TABLE_TO_L2: tl.constexpr = WAIT_PRIOR and TABLE_TO_L2 and not HAS_LEFTPAD
    if WAIT_PRIOR:  # launched as a programmatic dependent: nothing is read before the kernel ahead ends
        if EARLY_TABLE_TO_L2:  # (a prefetch reads nothing: the table may still be written ahead of us)
            _table_to_l2(Table_row, table_pages, 0, split, num_splits, BLOCK_N, PAGE_SIZE, INTERLEAVE, UNIT)
        tl.extra.cuda.gdc_wait()
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + b)
        seqlen_q = tl.load(CuSeqlensQ + b + 1) - q_start
    else:
        q_start = 0
    n_rows = seqlen_q * group_size
    r_start = pid_m * BLOCK_M
    if r_start >= n_rows:
        return

    cached = tl.load(SeqlensK + b)
    k_end = tl.minimum(tl.maximum(cached + new_tokens, 0), capacity)
    k_start = 0
    if HAS_LEFTPAD:
        k_start = tl.minimum(tl.maximum(tl.load(LeftPad + b), 0), k_end)
    seqlen_k = k_end - k_start
    if SAME_KV_STRIDES:  # (one set of row offsets serves both caches)
        stride_vb = stride_kb
        stride_vn = stride_kn
        stride_vh = stride_kh
    if PAGED:
        K_base = K + hk.to(tl.int64) * stride_kh
        V_base = V + hk.to(tl.int64) * stride_vh
    else:
        row = b64
        if HAS_BATCH_IDX:
            row = tl.minimum(tl.maximum(tl.load(BatchIdx + b), 0), num_rows_cache - 1).to(tl.int64)
        K_base = K + row * stride_kb + hk.to(tl.int64) * stride_kh
        V_base = V + row * stride_vb + hk.to(tl.int64) * stride_vh
    k_desc = K_base
    v_desc = V_base
    if USE_TMA and PAGED:  # every page's rows of this kv head, as one [num_pages · PAGE_SIZE, d] array
        k_desc = tl.make_tensor_descriptor(
            K_base, [num_rows_cache * PAGE_SIZE, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D]
        )
        v_desc = tl.make_tensor_descriptor(
            V_base, [num_rows_cache * PAGE_SIZE, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D]
        )
    elif USE_TMA:  # the keys of this sequence and kv head: rows [k_start, k_end) of its cache row
        k_desc = common.rows_desc(K_base + k_start * stride_kn, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, True)
        v_desc = common.rows_desc(V_base + k_start * stride_vn, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, True)
    if TABLE_TO_L2 and not EARLY_TABLE_TO_L2:  # the table entries this program will read, into L2 first
        _table_to_l2(Table_row, table_pages, k_start, split, num_splits, BLOCK_N, PAGE_SIZE, INTERLEAVE, UNIT)

    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_r = r_start + tl.arange(0, BLOCK_M)
    mask_r = offs_r < n_rows
    i = offs_r // group_size  # token
    h = hk * group_size + offs_r % group_size  # query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_q = b64 * stride_qb + (q_start + i).to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    mask_q = mask_r[:, None]
    if PAD_D:
        mask_q = mask_q & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + row_q[:, None] + offs_d[None, :], mask=mask_q, other=0.0)
    if ROTARY_Q:
        pos = cached
        if ROT_PER_TOKEN:
            pos = cached + i
        q = _rotated(
            q,
            Q + row_q[:, None],
            Cos,
            Sin,
            pos[:, None],
            rot_len,
            stride_rot,
            offs_d,
            rot_half,
            mask_r[:, None],
            ROT_INTERLEAVED,
        ).to(q.dtype)

    qk_scale = sm_scale * 1.4426950408889634
    softcap_scale = 0.0
    softcap_log2 = 0.0
    if HAS_SOFTCAP:
        softcap_scale = sm_scale / softcap
        softcap_log2 = softcap * 1.4426950408889634
    slope_log2 = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if HAS_ALIBI:
        slope_log2 = (tl.load(Alibi + b * stride_ab + h, mask=mask_r, other=0.0) * 1.4426950408889634)[:, None]

    # Key tiles of this block's tokens, then this split's share of them (whole tiles): with INTERLEAVE
    # the tiles t with t mod num_splits = split, else a run of consecutive tiles.
    m_first = r_start // group_size
    m_last = (tl.minimum(r_start + BLOCK_M, n_rows) - 1) // group_size
    lo, full_lo, full_hi, hi = common.key_bounds(
        m_first, m_last, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N, MASK_LEFT, MASK_RIGHT
    )
    if INTERLEAVE:
        step = num_splits * BLOCK_N
        if UNIT > 1:
            step = 1  # (the loop counts tiles: _kv_tiles)
        s_lo = lo
        s_hi = hi
    else:
        step = BLOCK_N
        per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
        s_lo = tl.minimum(lo + split * per_split, hi)
        s_hi = tl.minimum(s_lo + per_split, hi)
        full_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), s_hi)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for seg in tl.static_range(3):
        a, z = common.segment(seg, s_lo, full_lo, full_hi, s_hi)
        unit_lo = a
        unit_r0 = 0
        unit_gap = 0
        if UNIT > 1:  # runs of UNIT tiles in turn: loop over this split's count of tiles
            ta = tl.cdiv(a, BLOCK_N)  # (a segment's start is a tile's unless it is empty, clamped to hi)
            t0 = ta // (UNIT * num_splits) * (UNIT * num_splits) + split * UNIT  # its run in ta's cycle
            t0 = tl.where(ta >= t0 + UNIT, t0 + UNIT * num_splits, tl.maximum(t0, ta))
            unit_lo = t0 * BLOCK_N
            unit_r0 = t0 % UNIT
            unit_gap = (num_splits - 1) * UNIT
            z = _unit_share(tl.cdiv(z, BLOCK_N), split, num_splits, UNIT) - _unit_share(ta, split, num_splits, UNIT)
            a = 0
        elif INTERLEAVE:  # tile t of any segment is split (t mod num_splits)'s (t counted from column 0)
            a += (split + num_splits - a // BLOCK_N % num_splits) % num_splits * BLOCK_N
        acc, l_i, m_i = _kv_tiles(
            acc,
            l_i,
            m_i,
            q,
            K_base,
            V_base,
            k_desc,
            v_desc,
            Table_row,
            stride_kn,
            stride_vn,
            stride_kb,
            stride_vb,
            k_start,
            num_rows_cache,
            i,
            offs_n,
            offs_d,
            a,
            z,
            step,
            unit_lo,
            unit_r0,
            unit_gap,
            table_pages,
            seqlen_q,
            seqlen_k,
            qk_scale,
            softcap_scale,
            softcap_log2,
            slope_log2,
            window_left,
            window_right,
            HEAD_DIM,
            PAD_D,
            BLOCK_N,
            PAGE_SIZE,
            PAGED,
            OFFS_64,
            HAS_LEFTPAD,
            PREFETCH_TABLE,
            USE_TMA,
            seg != 1,
            HAS_SOFTCAP,
            HAS_ALIBI,
            MASK_LEFT,
            MASK_RIGHT,
            DEFER_SCALE,
            UNIT,
        )

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    acc = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    if SPLIT:
        lse = tl.where(seen, lse, float("-inf"))
    else:
        lse = tl.where(seen, lse, float("inf"))
    split64 = split.to(tl.int64)
    lse_ptrs = Lse + split64 * stride_ls + b64 * stride_lb + h * stride_lh + q_start + i
    tl.store(lse_ptrs, lse, mask=mask_r)
    row_o = split64 * stride_os + b64 * stride_ob + (q_start + i).to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
    tl.store(Out + row_o[:, None] + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=mask_q)


@triton.jit
def _combine(
    OutP,
    LseP,
    Out,
    Lse,
    stride_ps,
    stride_ls,
    n_rows,
    nheads,
    seqlen_q,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Merges split partials of rows [pid·BLOCK_R, ...) of the contiguous output, viewed as rows of
    HEAD_DIM in (batch, token, head) order; LSE is (batch, head, token) (varlen: batch 1, tokens = total).
    The partial outputs are read CHUNK splits at a time, as one [BLOCK_R, CHUNK, BLOCK_D] load. With
    USE_PDL (a programmatic dependent launch) it first waits for the split kernel's writes."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < n_rows
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    h = offs_r % nheads
    t = (offs_r // nheads) % seqlen_q
    b = offs_r // (nheads * seqlen_q)
    lse_idx = (b * nheads + h).to(tl.int64) * seqlen_q + t
    lse = tl.load(
        LseP + offs_s[None, :].to(tl.int64) * stride_ls + lse_idx[:, None],
        mask=mask_r[:, None] & (offs_s[None, :] < num_splits),
        other=float("-inf"),
    )  # [BLOCK_R, SPLITS_PAD]
    m = tl.max(lse, 1)
    seen = m > float("-inf")
    m_safe = tl.where(seen, m, 0.0)
    total = tl.sum(tl.exp(lse - m_safe[:, None]), 1)
    total_safe = tl.where(seen, total, 1.0)
    mask_d = offs_d < HEAD_DIM
    rows = offs_r.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_R, BLOCK_D]
    offs_c = tl.arange(0, CHUNK)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        mask_c = mask_r[:, None] & (s0 + offs_c[None, :] < num_splits)  # [BLOCK_R, CHUNK]
        lse_c = tl.load(
            LseP + (s0 + offs_c[None, :]).to(tl.int64) * stride_ls + lse_idx[:, None], mask=mask_c, other=float("-inf")
        )
        w = tl.exp(lse_c - m_safe[:, None]) / total_safe[:, None]  # [BLOCK_R, CHUNK]
        o = tl.load(
            OutP + (s0 + offs_c[None, :, None]).to(tl.int64) * stride_ps + rows[:, None, :],
            mask=mask_c[:, :, None] & mask_d[None, None, :],
            other=0.0,
        )  # [BLOCK_R, CHUNK, BLOCK_D]
        acc += tl.sum(w[:, :, None] * o, 1)
    tl.store(Out + rows, acc.to(Out.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])
    tl.store(Lse + lse_idx, tl.where(seen, m_safe + tl.log(total_safe), float("inf")), mask=mask_r)


_LAUNCH_KVCACHE = Launcher(_attn_fwd_kvcache)
_LAUNCH_COMBINE = Launcher(_combine)


# Splits the combine reads per load (one [rows, splits, head dim] tile; rounded up to a power of two, at
# most COMBINE_MAX_VALUES values per load). 16 loads a [rows, splits, head dim] tile at once from more
# programs (fewer rows each): +25 % at 1 x 8k (two programs merged 16 splits one at a time), +2-4 % at
# 1 x 128k, the other decode rows unchanged (docs/perf.md, "decode combine"). 1 is the earlier layout
# (rows of 16 / 8, one split at a time).
COMBINE_SPLITS_PER_LOAD = 16
# Rows (query head · token) a combine program merges at most (a power of two), and fp32 values per
# [rows, splits, head dim] load at most (168 registers, no spills at 16384, head dim 128). 1 x 8k (32
# rows, 16 splits) takes four programs of eight rows: against eight of four (8192 values), pages of 16
# and 256 +0.9 % at 1 x 8k and +0.3-1.2 % at 1 x 128k, contiguous caches level; two programs (32768)
# -9 %, more programs of fewer rows -3 % to -8 %, eight warps -4 % to -6 % (docs/perf.md).
COMBINE_MAX_ROWS = 16
COMBINE_MAX_VALUES = 16384


def _combine_tiles(num_splits: int, block_d: int) -> tuple[int, int]:
    """(rows per program, splits per load) of ``_combine``, both powers of two: at most
    COMBINE_MAX_VALUES fp32 partial values per load, at most COMBINE_MAX_ROWS rows."""
    chunk = min(
        next_power_of_2(max(1, COMBINE_SPLITS_PER_LOAD)),
        next_power_of_2(max(1, num_splits)),
        max(1, COMBINE_MAX_VALUES // block_d),
    )
    if chunk == 1:
        return min(COMBINE_MAX_ROWS, 16 if block_d <= 128 else 8), 1
    return max(1, min(COMBINE_MAX_ROWS, COMBINE_MAX_VALUES // (chunk * block_d))), chunk


_INTERPRET = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
_MAX_SPLITS = 128


# Pipeline stages of the decode kernel's key loop. 3 is what the decode table in docs/perf.md was measured
# with (136 KiB of shared memory at head dim 128: one block per SM); 2 halves the buffers (72 KiB; two
# blocks per SM at the 189 registers of that build).
DECODE_STAGES = 3
# Waves of programs the split heuristic aims for (one program per SM per wave, as DECODE_STAGES' shared
# memory allows): 1 is the measured table; a second wave trades more partial writes for finer splits.
DECODE_WAVES = 1
DECODE_MIN_SPLIT_TILES = 4  # key tiles a split keeps at least (choose_splits)
# Splits of paged caches whose pages are smaller than a key tile take every num_splits-th tile (split s:
# tiles s, s + num_splits, ...) instead of a run of consecutive tiles: a split's first table entries are
# then known before the sequence's length is read (without leftpad or a left window), so the two reads
# overlap instead of following each other (the table's read ahead of the loop, PREFETCH_TABLE). Pages of
# 16 at 1 x 8k +2-6 %; contiguous caches lost 4 % there and pages of 256 1 %, so they keep consecutive
# tiles (docs/perf.md).
DECODE_INTERLEAVE = True
# Interleaved splits take runs of DECODE_INTERLEAVE_UNIT consecutive tiles in turn (split s: runs s,
# s + num_splits, ...): with 64-key tiles over pages of 16 a run's two tiles share one table sector, so
# the second lookup (the prologue's too) finds it read. Two against one, pages of 16: +1.3 % at 1 x 8k,
# +2.0 % at 2 x 4k, level at 1 x 128k (+0.3-1.2 % at those rows and 8 x 32k in an earlier run; pages of 256
# and contiguous caches do not interleave) (docs/perf.md).
DECODE_INTERLEAVE_UNIT = 2
# Contiguous caches at head dim 128 (where it was measured) in grids of two waves or more whose programs
# have at most FULL_GRID_TILES key tiles: FULL_GRID_STAGES stages (0: DECODE_STAGES). Two stages (72 KiB,
# two blocks per SM) shorten the last wave's tail: 64 x 4k (512 programs, 3.9 waves of one block per SM)
# +2 %; 64 x 16k level with them.
FULL_GRID_STAGES = 2
FULL_GRID_TILES = 32
# K/V tiles through TMA descriptors (common.use_tma decides per call: sm90+, aligned rows), for programs
# of at least DECODE_TMA_TILES key tiles (each program builds its descriptors on the device: a write to
# global scratch and a fence, which short programs do not earn back). PAGED_TMA: paged caches whose
# pages hold whole key tiles (page size a multiple of BLOCK_N, pages contiguous, no cache_leftpad) in
# grids under two waves, at PAGED_TMA_STAGES (the page lookup feeds the tile's coordinates). It gained
# 6 % at 1 x 128k and 8 x 32k with pages of 256 over the pointer loads' 64-bit page offsets; since those
# are int32 (one lookup per tile), the pointer loads read 1-2 % faster at 1 x 128k and under 1 % at
# 8 x 32k, so off. DECODE_TMA: contiguous caches, 1 % slower than pointer loads in three rows and level
# in two, so off (docs/perf.md).
DECODE_TMA = False
PAGED_TMA = False
PAGED_TMA_STAGES = 5
DECODE_TMA_TILES = 16
# Programmatic dependent launch of the split combine (sm90+): its programs start while the split kernel
# runs and wait (griddepcontrol.wait) until its partials are written, instead of launching after it.
DECODE_PDL = True
# The attention kernel as a programmatic dependent launch of the kernel before it in the stream (sm90+):
# it starts as that kernel ends, without the launch gap between them, prefetches its block-table sectors
# into L2 (prefetches read nothing) and waits (griddepcontrol.wait) before it reads anything, since that
# kernel may be writing q, the caches or the table. 1 x 8k +0.6-2.8 % in every layout, whether the kernel
# ahead is the last call's combine, a torch kernel or the append; the other rows level (docs/perf.md).
# (The combine and the append as dependents too, each letting the next kernel launch early: +2-8 % for
# calls back to back, but -15-17 % with the append, so neither is.)
DECODE_PDL_ATTN = True
# Paged caches: Triton pipelines a load that feeds another load's address (the block table, then K/V)
# with (stages - 1) // 2 iterations of distance for each, so at three stages K/V get one buffer and the
# table lookup waits in every iteration. Long programs in a small grid take PAGED_LONG_STAGES (five: two
# K/V tiles in flight, as three stages give contiguous caches); the others keep DECODE_STAGES and, in
# grids under PAGED_PREFETCH_WAVES waves, read the table one tile ahead by hand (PREFETCH_TABLE).
# Measured in docs/perf.md.
PAGED_LONG_STAGES = 5
PAGED_LONG_TILES = 16  # key tiles per program from which a program counts as long
PAGED_WARPS = 4  # warps of the paged pointer-load builds
PAGED_PREFETCH_WAVES = 2
# Paged caches in grids under PAGED_PREFETCH_WAVES waves (the setting also gates the read-ahead above;
# NVIDIA only: inline PTX): each program first prefetches the block-table sectors it will read into L2
# (``_table_to_l2``), so that the lookups in its key loop, which Triton issues right before the K/V
# copies they address (whatever the hand-written read-ahead), wait on L2 instead of DRAM. Pages of 16 at
# 1 x 8k with 64-key tiles: +4.6 %; pages of 256 and the long rows level.
PAGED_TABLE_L2 = True
# One-wave grids whose programs have at most SHORT_TILES key tiles of the config's size (1 x 8k: four of
# 128; SHORT_SMALL_PAGE_TILES for pages smaller than such a tile) take tiles of SHORT_BLOCK_N keys (0:
# the config's; never more than it) at the same stages: half the bytes in flight per stage, but the
# first tile lands and the last one's work ends sooner (pages of 64 then no longer interleave). Four
# tiles (1 x 8k, 2 x 4k): +2-4 % in every layout. Eight (1 x 16k, 2 x 8k, 4 x 4k): contiguous and pages
# of 256 +0.4-3.8 %, pages of 16 -2 %. 32-key tiles, and 64-key tiles at two, four or five stages, lost
# (docs/perf.md).
SHORT_BLOCK_N = 64
SHORT_TILES = 8
SHORT_SMALL_PAGE_TILES = 4
# 64-bit cache offsets for every call, not only for caches whose offsets could pass 2**31 (to time them)
OFFS_64_ALWAYS = False


@functools.cache
def _config_for(rows: int, block_d: int, interpret: bool, stages: int, tma: bool) -> KernelConfig:
    if interpret:
        return dataclasses.replace(_INTERPRET, tma=tma)
    block_m = min(64, max(16, next_power_of_2(rows)))
    block_n = 128 if block_d <= 128 else 64
    return KernelConfig(block_m, block_n, num_warps=4, num_stages=stages, tma=tma)


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: NVIDIA sm90+ GPUs with a Triton that has the grid dependency
    controls (not the interpreter)."""
    return (
        device.type == "cuda"
        and not interpreting()
        and not torch.version.hip
        and hasattr(tl.extra.cuda, "gdc_wait")
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(programs: int, max_seqlen_k: int, block_n: int, sm_count: int) -> int:
    """As many splits as keep the programs within DECODE_WAVES waves (one program per SM per wave),
    with at least four key tiles per split. Measured on the H200 (docs/perf.md, decode sweep): one wave;
    1x8k and 1x128k want 8-16 splits, 8x32k 2, and batches of 64 sequences none (their 512 programs
    already fill the GPU)."""
    if programs >= DECODE_WAVES * sm_count:
        return 1
    tiles = cdiv(max(max_seqlen_k, 1), block_n)
    return max(1, min(DECODE_WAVES * sm_count // programs, tiles // DECODE_MIN_SPLIT_TILES, _MAX_SPLITS))


# Module names a decode plan depends on besides the call's metadata: the settings above (changed at run
# time by scripts/decode_variants_settings.py and by tests) and the helpers tests replace.
_PLAN_INPUTS = (
    "DECODE_STAGES",
    "DECODE_WAVES",
    "DECODE_MIN_SPLIT_TILES",
    "DECODE_INTERLEAVE",
    "DECODE_INTERLEAVE_UNIT",
    "FULL_GRID_STAGES",
    "FULL_GRID_TILES",
    "DECODE_TMA",
    "PAGED_TMA",
    "PAGED_TMA_STAGES",
    "DECODE_TMA_TILES",
    "DECODE_PDL",
    "DECODE_PDL_ATTN",
    "PAGED_LONG_STAGES",
    "PAGED_LONG_TILES",
    "PAGED_WARPS",
    "PAGED_PREFETCH_WAVES",
    "PAGED_TABLE_L2",
    "SHORT_BLOCK_N",
    "SHORT_TILES",
    "SHORT_SMALL_PAGE_TILES",
    "OFFS_64_ALWAYS",
    "COMBINE_SPLITS_PER_LOAD",
    "COMBINE_MAX_ROWS",
    "COMBINE_MAX_VALUES",
    "_config_for",
    "_has_pdl",
    "_sm_count",
)
_plan_inputs = operator.itemgetter(*_PLAN_INPUTS)  # (a tuple of their values, from globals())
_MAX_PLANS = 64  # plans kept per call signature and settings; beyond that the oldest go


def _remember(table: dict, key, value):
    return remember(table, key, value, _MAX_PLANS)


class _Launch:
    """One launch of a plan: the kernel's scalar arguments and constexprs fixed, its tensor arguments
    given per call. The first call launches through the ``Launcher``; later calls launch the build that
    call bound (``launch.Bound``), valid because a plan is only reused for calls whose tensors have the
    same dtypes and alignments (its key)."""

    __slots__ = ("launcher", "grid", "fixed", "constexprs", "options", "bound")

    def __init__(self, launcher: Launcher, grid: tuple, fixed: tuple, constexprs: dict, **options):
        self.launcher, self.grid, self.fixed = launcher, grid, fixed
        self.constexprs, self.options = constexprs, options
        self.bound = None

    def __call__(self, tensors: tuple) -> None:
        if self.bound is not None:
            self.bound(tensors + self.fixed)
        else:
            self.bound = self.launcher.bind(self.grid, tensors + self.fixed, self.constexprs, **self.options)


@dataclass
class _Base:
    """What a decode call's metadata fixes before its split count: packed query rows, programs per
    split, the LSE's shape, and the plans built so far by (num_splits, key tiles per program)."""

    cfg: KernelConfig
    programs: int
    lse_shape: tuple
    sm_count: int
    plans: dict = dataclasses.field(default_factory=dict)
    split_counts: dict = dataclasses.field(default_factory=dict)

    def splits(self, p: AttnParams, c: CacheLayout) -> tuple[int, int]:
        """(num_splits, key tiles per program at most) of a call."""
        key = (c.num_splits, c.max_seqlen_k)
        counts = self.split_counts.get(key)
        if counts is None:
            counts = _remember(self.split_counts, key, self._splits(p, c))
        return counts

    def _splits(self, p: AttnParams, c: CacheLayout) -> tuple[int, int]:
        block_n = self.cfg.block_n
        num_splits = c.num_splits
        if num_splits == 0:
            max_k = c.max_seqlen_k if c.max_seqlen_k is not None else p.seqlen_k
            num_splits = choose_splits(self.programs, max_k, block_n, self.sm_count)
        num_splits = max(1, min(num_splits, _MAX_SPLITS, cdiv(max(p.seqlen_k, 1), block_n)))
        return num_splits, cdiv(max(c.max_seqlen_k or p.seqlen_k, 1), block_n * num_splits)


def _new_base(q4: torch.Tensor, k_cache: torch.Tensor, p: AttnParams) -> _Base:
    rows = q4.shape[2] // k_cache.shape[2] * p.seqlen_q
    cfg = _config_for(rows, p.block_d, interpreting(), DECODE_STAGES, DECODE_TMA or PAGED_TMA)
    programs = cdiv(rows, cfg.block_m) * p.batch * k_cache.shape[2]
    return _Base(cfg, programs, p.lse_shape(q4), _sm_count(q4.device))


def attn_fwd_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: AttnParams, c: CacheLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(batch, seqlen_q, nheads, d)`` (or ``(total_q, nheads, d)`` with p.cu_seqlens_q); caches as in
    the module docstring. Returns ``(out, lse)`` laid out like the training forward's.

    With ``c.plans`` (the API's table for calls whose arguments have the same shapes, strides, dtypes,
    devices, alignments and options as this one) the launches are planned once per split count, key
    tiles per program and module settings: later calls only allocate the outputs and launch."""
    q4 = p.as_4d(q)
    table = c.plans
    base = None
    if table is not None:
        settings = _plan_inputs(globals())
        base = table.get(settings)
    if base is None:
        base = _new_base(q4, k_cache, p)
        if table is not None:
            _remember(table, settings, base)
    device = q.device
    num_splits, tiles = base.splits(p, c)
    out = torch.empty(q.shape, device=device, dtype=q.dtype)  # contiguous: _combine addresses it flat
    o4 = p.as_4d(out)
    lse = torch.empty(base.lse_shape, device=device, dtype=torch.float32)
    split = num_splits > 1
    if split:  # the partial LSEs, then (16-byte aligned) the partial outputs: one allocation
        n_lse = num_splits * lse.numel()
        at = cdiv(n_lse, 4) * 4
        l_target = torch.empty(at + num_splits * out.numel(), device=device, dtype=torch.float32)
        o_target = l_target[at:]
    else:
        o_target, l_target = o4, lse
    plan = base.plans.get((num_splits, tiles))
    if plan is None:
        plan = _plan(base, q4, k_cache, v_cache, o4, lse, p, c, num_splits, tiles)
        if table is not None:
            _remember(base.plans, (num_splits, tiles), plan)
    seqlens = c.seqlens_k
    plan[0](
        (
            q4,
            k_cache,
            v_cache,
            o_target,
            l_target,
            p.alibi_slopes if p.alibi_slopes is not None else lse,
            seqlens,
            c.leftpad if c.leftpad is not None else seqlens,
            c.batch_idx if c.batch_idx is not None else seqlens,
            c.block_table if c.block_table is not None else seqlens,
            p.cu_seqlens_q if p.cu_seqlens_q is not None else seqlens,
            *(c.q_rotary[:2] if c.q_rotary is not None else (seqlens, seqlens)),
        )
    )
    if split:
        plan[1]((o_target, l_target, o4, lse))
    return out, lse


def _offsets_past_int32(t: torch.Tensor, paged: bool) -> bool:
    """Whether an offset the decode kernel computes in int32 could pass 2**31: from its kv head's start
    (int64), over pages, slots and the head dim of a paged cache, or over positions and the head dim
    within a cache row (whose start is int64 too)."""
    dims = (0, 1, 3) if paged else (1, 3)
    return sum(max(t.shape[i] - 1, 0) * abs(t.stride(i)) for i in dims) >= 2**31


def _plan(
    base: _Base,
    q4: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o4: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    c: CacheLayout,
    num_splits: int,
    tiles: int,
) -> tuple[_Launch, _Launch | None]:
    """The split kernel's launch and the combine's (None without splits) for this call's metadata. The
    partial outputs and LSEs (flat buffers) are addressed by the strides given here: each split's slice
    is laid out like o4 / lse."""
    nheads, headdim = q4.shape[2], q4.shape[3]
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    interpret = interpreting()
    cfg = base.cfg
    paged = c.block_table is not None
    rot_cos, _, rot_interleaved, rot_per_token = c.q_rotary or (None, None, False, False)
    split = num_splits > 1
    pdl = split and DECODE_PDL and _has_pdl(q4.device)
    pdl_attn = DECODE_PDL_ATTN and _has_pdl(q4.device)
    if split:
        o_strides = (o4.numel(), *p.strides(o4))
        l_strides = (lse.numel(), *p.lse_strides(lse))
    else:
        o_strides = (0, *p.strides(o4))
        l_strides = (0, *p.lse_strides(lse))
    if paged:
        page_size, num_rows = k_cache.shape[1], k_cache.shape[0]
        capacity = c.block_table.shape[1] * page_size
        table_stride = c.block_table.stride(0)
    else:
        page_size, num_rows, capacity = 1, k_cache.shape[0], k_cache.shape[1]
        table_stride = c.seqlens_k.stride(0)
    small_grid = base.programs * num_splits < 2 * base.sm_count
    short = SHORT_SMALL_PAGE_TILES if paged and page_size < cfg.block_n else SHORT_TILES
    if SHORT_BLOCK_N and base.programs * num_splits <= base.sm_count and tiles <= short and not interpret:
        cfg = dataclasses.replace(cfg, block_n=min(SHORT_BLOCK_N, cfg.block_n))
    prefetch_grid = base.programs * num_splits < PAGED_PREFETCH_WAVES * base.sm_count
    long_paged = paged and small_grid and PAGED_LONG_STAGES > 0 and tiles >= PAGED_LONG_TILES
    if paged:
        use_tma = (
            tiles >= DECODE_TMA_TILES
            and small_grid
            and PAGED_TMA
            and page_size % cfg.block_n == 0
            and c.leftpad is None
            and k_cache.stride(0) == page_size * k_cache.stride(1)
            and v_cache.stride(0) == page_size * v_cache.stride(1)
            and common.use_tma(cfg, k_cache, v_cache)
        )
        stages = PAGED_TMA_STAGES if use_tma else PAGED_LONG_STAGES if long_paged else cfg.num_stages
    else:
        use_tma = DECODE_TMA and tiles >= DECODE_TMA_TILES and common.use_tma(cfg, k_cache, v_cache)
        full_short = FULL_GRID_STAGES > 0 and p.block_d == 128 and not small_grid and tiles <= FULL_GRID_TILES
        stages = FULL_GRID_STAGES if full_short else cfg.num_stages
    interleave = split and DECODE_INTERLEAVE and paged and page_size < cfg.block_n
    m_blocks = base.programs // (p.batch * nheads_k)
    attn = _Launch(
        _LAUNCH_KVCACHE,
        (m_blocks, p.batch * nheads_k, num_splits),
        (
            *p.strides(q4),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            *o_strides,
            *l_strides,
            p.alibi_batch_stride(),
            table_stride,
            rot_cos.stride(0) if rot_cos is not None else 0,
            nheads_k,
            group,
            p.seqlen_q,
            capacity,
            num_rows,
            c.new_tokens,
            rot_cos.shape[1] if rot_cos is not None else 0,
            rot_cos.shape[0] if rot_cos is not None else 0,
            p.softmax_scale,
            p.softcap,
            p.window_left,
            p.window_right,
        ),
        {
            "HEAD_DIM": headdim,
            "BLOCK_D": p.block_d,
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "PAGE_SIZE": page_size,
            "PAGED": paged,
            "OFFS_64": OFFS_64_ALWAYS or _offsets_past_int32(k_cache, paged) or _offsets_past_int32(v_cache, paged),
            "SAME_KV_STRIDES": k_cache.stride() == v_cache.stride(),
            "PREFETCH_TABLE": paged and prefetch_grid and not long_paged and not use_tma,
            "USE_TMA": use_tma,
            "HAS_LEFTPAD": c.leftpad is not None,
            "HAS_BATCH_IDX": c.batch_idx is not None,
            "MASK_LEFT": p.window_left >= 0,
            "MASK_RIGHT": p.window_right >= 0,
            "HAS_SOFTCAP": p.softcap > 0,
            "HAS_ALIBI": p.alibi_slopes is not None,
            "IS_VARLEN": p.is_varlen,
            "SPLIT": split,
            "INTERLEAVE": interleave,
            "LAUNCH_DEPENDENTS": pdl,
            "DEFER_SCALE": p.defer_scale,
            "ROTARY_Q": rot_cos is not None,
            "ROT_INTERLEAVED": bool(rot_interleaved),
            "ROT_PER_TOKEN": bool(rot_per_token),
            "UNIT": DECODE_INTERLEAVE_UNIT if interleave else 1,
            "WAIT_PRIOR": pdl_attn,
            "TABLE_TO_L2": paged and prefetch_grid and PAGED_TABLE_L2 and not interpret and not torch.version.hip,
        },
        num_warps=PAGED_WARPS if paged and not use_tma and not interpret else cfg.num_warps,
        num_stages=cfg.num_stages if interpret else stages,
        **({"launch_pdl": True} if pdl_attn else {}),
    )
    if not split:
        return attn, None
    n_rows = o4.numel() // headdim
    block_r, chunk = _combine_tiles(num_splits, p.block_d)
    combine = _Launch(
        _LAUNCH_COMBINE,
        (cdiv(n_rows, block_r), 1, 1),
        (o4.numel(), lse.numel(), n_rows, nheads, q4.shape[1], num_splits),
        {
            "HEAD_DIM": headdim,
            "BLOCK_D": p.block_d,
            "BLOCK_R": block_r,
            "SPLITS_PAD": max(2, next_power_of_2(num_splits)),
            "CHUNK": chunk,
            "USE_PDL": pdl,
        },
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return attn, combine


@triton.jit
def _rotary_pairs(offs_d, rot_half, INTERLEAVED: tl.constexpr):
    """For each channel of ``offs_d``: the channel it rotates with, its frequency (column of the cos/sin
    tables) and the sign of the partner's term, GPT-J pairs (0, 1), (2, 3)... if INTERLEAVED, else
    GPT-NeoX halves. Channels from ``2 * rot_half`` on do not rotate (the caller masks them)."""
    if INTERLEAVED:
        partner = offs_d ^ 1
        freq = offs_d // 2
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
    else:
        lower = offs_d < rot_half
        partner = tl.where(lower, offs_d + rot_half, offs_d - rot_half)
        freq = tl.where(lower, offs_d, offs_d - rot_half)
        sign = tl.where(lower, -1.0, 1.0)
    return partner, freq, sign


@triton.jit
def _rotated(x, X, Cos, Sin, pos, rot_len, stride_c, offs_d, rot_half, enabled, INTERLEAVED: tl.constexpr):
    """``x`` (read at ``X + offs_d``, channels last) rotated in fp32 at position ``pos`` of the
    ``(rot_len, rot_half)`` tables ``Cos`` / ``Sin`` (row stride ``stride_c``; the position clamped to
    their rows) as ``x·cos ∓ partner·sin``, in the channels below ``2 * rot_half`` where ``enabled``;
    the other channels are x itself. ``X``, ``pos`` and ``enabled`` broadcast against x without its
    channel axis (scalars for one row, ``[rows, 1]`` for a block)."""
    partner, freq, sign = _rotary_pairs(offs_d, rot_half, INTERLEAVED)
    rot = (offs_d < 2 * rot_half) & enabled
    row_c = tl.minimum(tl.maximum(pos, 0), rot_len - 1).to(tl.int64) * stride_c
    xp = tl.load(X + partner, mask=rot, other=0.0).to(tl.float32)
    c = tl.load(Cos + row_c + freq, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(Sin + row_c + freq, mask=rot, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    return tl.where(rot, xf * c + (sign * xp) * s, xf)


@triton.jit
def _rotate_rows(
    Src,
    Dst,
    Src2,
    Dst2,
    Seqlens,
    BatchIdx,
    Table,
    Cos,
    Sin,
    stride_sb,
    stride_st,
    stride_sh,
    stride_db,
    stride_dt,
    stride_dh,
    stride_s2b,
    stride_s2t,
    stride_s2h,
    stride_d2b,
    stride_d2t,
    stride_d2h,
    stride_tb,
    stride_c,
    seqlen,
    nheads,
    rot_half,
    rot_len,
    capacity,
    num_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
):
    """Writes row (b, t, h) of ``Src`` into the cache ``Dst`` at position ``pos = Seqlens[b] + t``,
    rotated (if ROTARY) at that position: ``Dst[row, pos, h]`` of a contiguous cache (row = BatchIdx[b]
    or b), or of the page ``Table[b, pos // PAGE_SIZE]`` at slot ``pos % PAGE_SIZE`` (PAGED). Programs of
    grid axis 2 index 1 copy ``Src2`` to ``Dst2`` the same way, unrotated (the new values beside the new
    keys, in one launch). The rotation is computed in fp32 as ``x·cos ∓ partner·sin`` and rounded once,
    like ``tileattn.rotary`` (launched without FMA contraction, so the bits match it). Writes whose
    position (``< capacity``), cache row or page (``< num_rows``) is out of range are dropped, and the
    rotary position is clamped to the tables' ``rot_len`` rows: the API refuses such values, and under
    CUDA graph capture, where it cannot read them, nothing outside the cache or the tables is touched."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.program_id(2) == 0
    b = pid // seqlen
    t = pid % seqlen
    pos = tl.load(Seqlens + b) + t
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)
    # (selected, not branched: a stride of 2**31 or more is an int64 argument, the other's may be int32)
    src = tl.where(
        first,
        Src + b64 * stride_sb + t64 * stride_st + h64 * stride_sh,
        Src2 + b64 * stride_s2b + t64 * stride_s2t + h64 * stride_s2h,
    )
    dst_base = tl.where(first, Dst, Dst2)
    sdb = tl.where(first, stride_db, stride_d2b)
    sdt = tl.where(first, stride_dt, stride_d2t)
    sdh = tl.where(first, stride_dh, stride_d2h)
    x = tl.load(src + offs_d, mask=mask_d, other=0.0)
    if ROTARY:  # (the keys only: the values of grid axis 2 index 1 are copied as they are)
        x = _rotated(x, src, Cos, Sin, pos, rot_len, stride_c, offs_d, rot_half, first, INTERLEAVED)
    in_range = (pos >= 0) & (pos < capacity)
    safe_pos = tl.where(in_range, pos, 0)
    if PAGED:
        page = tl.load(Table + b64 * stride_tb + safe_pos // PAGE_SIZE)
        in_range = in_range & (page >= 0) & (page < num_rows)
        dst = dst_base + page.to(tl.int64) * sdb + (safe_pos % PAGE_SIZE).to(tl.int64) * sdt + h64 * sdh
    else:
        row = b
        if HAS_BATCH_IDX:
            row = tl.load(BatchIdx + b)
        in_range = in_range & (row >= 0) & (row < num_rows)
        dst = dst_base + row.to(tl.int64) * sdb + safe_pos.to(tl.int64) * sdt + h64 * sdh
    tl.store(dst + offs_d, x.to(Dst.dtype.element_ty), mask=mask_d & in_range)


_LAUNCH_ROTATE = Launcher(_rotate_rows)


def _rotate_launch(src, dst, block_table, rotary, has_batch_idx, pair) -> _Launch:
    batch, seqlen, nheads, headdim = src.shape
    paged = block_table is not None
    cos = rotary[0] if rotary is not None else None
    src2, dst2 = pair
    return _Launch(
        _LAUNCH_ROTATE,
        (batch * seqlen, nheads, 2),
        (
            *src.stride()[:3],
            *dst.stride()[:3],
            *src2.stride()[:3],
            *dst2.stride()[:3],
            block_table.stride(0) if paged else 0,
            cos.stride(0) if cos is not None else 0,
            seqlen,
            nheads,
            cos.shape[1] if cos is not None else 0,
            cos.shape[0] if cos is not None else 0,
            block_table.shape[1] * dst.shape[1] if paged else dst.shape[1],
            dst.shape[0],
        ),
        {
            "HEAD_DIM": headdim,
            "BLOCK_D": padded_headdim(headdim),
            "ROTARY": rotary is not None,
            "INTERLEAVED": bool(rotary[2]) if rotary is not None else False,
            "PAGED": paged,
            "PAGE_SIZE": dst.shape[1] if paged else 1,
            "HAS_BATCH_IDX": has_batch_idx,
        },
        num_warps=1,
        enable_fp_fusion=False,
    )


def kvcache_append(k_cache, v_cache, k, v, rotary, seqlens, batch_idx, block_table, plans=None):
    """The in-place append of ``flash_attn_with_kvcache``: k rotated (``rotary``: ``(cos, sin,
    interleaved)`` or None) and v written at ``seqlens[b] + t``, in one launch of ``_rotate_rows``
    (q is rotated by the attention kernel as it reads it, ``CacheLayout.q_rotary``); same interface and
    results as ``tileattn.cpu.kvcache_append``. ``plans`` as ``CacheLayout.plans``: the launch is
    planned once per table."""
    if k is None or k.numel() == 0:
        return
    launch = plans.get("append") if plans is not None else None
    if launch is None:
        launch = _rotate_launch(k, k_cache, block_table, rotary, batch_idx is not None, (v, v_cache))
        if plans is not None:
            _remember(plans, "append", launch)
    cos, sin = (rotary[0], rotary[1]) if rotary is not None else (seqlens, seqlens)
    launch(
        (
            k,
            k_cache,
            v,
            v_cache,
            seqlens,
            batch_idx if batch_idx is not None else seqlens,
            block_table if block_table is not None else seqlens,
            cos,
            sin,
        )
    )
