"""Where the decode kernel finds a key tile in a KV cache: rows of a contiguous cache ``(batch_cache,
capacity, nheads_k, d)``, or slots of ``(num_pages, PAGE_SIZE, nheads_k, d)`` pages through a block table
(``cache_rows``; table entries clamped to the pool by ``pool_page``); which tiles a split takes when
splits take runs of tiles in turn (``unit_tile``, ``unit_share``); the block-table prefetch into L2
(``table_to_l2``). On the host, ``offsets_past_int32`` says when these offsets need 64 bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cache_rows(
    K_base, V_base, Table_row,
    offs_n_base, k_start, start_n,
    table_pages, num_pages,
    stride_kn, stride_vn, stride_kp, stride_vp,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    MASK_TABLE: tl.constexpr, OFFS_64: tl.constexpr,
):  # fmt: skip
    """``(K_tile, rows_k, V_tile, rows_v)``: the key tile at column ``start_n`` (a multiple of BLOCK_N,
    columns counted from k_start) is at ``K_tile + rows_k`` (row starts, elements) in the K cache, and
    likewise in V. Through the block table when PAGED, pages clamped to the pool so that a bad table
    never reads outside it, and table reads masked past the table's ``table_pages`` entries with
    MASK_TABLE (entries past the sequence are read but feed only masked rows). A tile inside one page
    (pages of whole tiles, k_start = 0) takes one lookup; pages that divide the tile split the position
    into page index and slot, so the slots' offsets stay loop-invariant.

    Offsets are int32 unless OFFS_64 (a cache whose offsets from the kv head's start could pass 2**31):
    64-bit products would cost a paged key tile a large share of its instructions. With OFFS_64 a
    one-lookup tile's page start moves into ``K_tile`` (once per tile) and the per-row products are
    unsigned wide multiplies (``wide_product``)."""
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
        page = pool_page(page, num_pages)
        if OFFS_64 and ONE_LOOKUP:  # the page's start as a 64-bit pointer, once per tile
            K_tile = K_base + page.to(tl.int64) * stride_kp
            V_tile = V_base + page.to(tl.int64) * stride_vp
            rows_k = wide_product(slot, stride_kn)
            rows_v = wide_product(slot, stride_vn)
        elif OFFS_64:
            rows_k = wide_product(page, stride_kp) + wide_product(slot, stride_kn)
            rows_v = wide_product(page, stride_vp) + wide_product(slot, stride_vn)
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
def table_to_l2(
    Table_row, table_pages,
    k_start, split, num_splits,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
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
def wide_product(index, stride):
    """``index * stride`` in int64 for a non-negative ``index`` below 2**31 and a non-negative stride,
    with the index zero-extended: a wide multiply and one more multiply-add per element, without the
    sign handling of a signed 64-bit product. (``tl.cast``: Triton passes a stride equal to 1 as a
    constant; an index is int64 when the block table spans 2**31 keys.)"""
    wide = index.to(tl.int32).to(tl.uint32, bitcast=True).to(tl.uint64)  # (int64 when capacity is)
    return (wide * tl.cast(stride, tl.int64).to(tl.uint64, bitcast=True)).to(tl.int64, bitcast=True)


@triton.jit
def pool_page(page, num_pages):
    """Table entries clamped to the pool's pages with one unsigned minimum: a negative entry wraps past
    the pool and reads its last page, as an entry past it does. (``num_pages - 1`` through tl.cast:
    Triton passes an int argument equal to 1 as a constant.)"""
    last = tl.cast(num_pages - 1, tl.int32).to(tl.uint32)
    return tl.minimum(page.to(tl.uint32, bitcast=True), last).to(tl.int32, bitcast=True)


@triton.jit
def unit_tile(unit_lo, j, r0, gap, UNIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column of a split's j-th tile when splits take runs of UNIT consecutive tiles in turn: from its
    first tile (column unit_lo, r0 tiles into its run), each run's end skips the ``gap`` tiles of the
    other splits."""
    return unit_lo + (j + (j + r0) // UNIT * gap) * BLOCK_N


@triton.jit
def unit_share(t, split, num_splits, UNIT: tl.constexpr):
    """Tiles below tile t that split owns when splits take runs of UNIT tiles in turn."""
    cycle = UNIT * num_splits
    return t // cycle * UNIT + tl.minimum(tl.maximum(t % cycle - split * UNIT, 0), UNIT)


def offsets_past_int32(t: torch.Tensor, paged: bool) -> bool:
    """Whether an offset the decode kernel computes in int32 could pass 2**31: from its kv head's start
    (int64), over pages, slots and the head dim of a paged cache, or over positions and the head dim
    within a cache row (whose start is int64 too)."""
    dims = (0, 1, 3) if paged else (1, 3)
    return sum(max(t.shape[i] - 1, 0) * abs(t.stride(i)) for i in dims) >= 2**31
