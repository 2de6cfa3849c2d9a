"""The order in which the Gluon forward's programs take their work items (query blocks of one head).

A non-causal call keeps each head's query blocks together, so that its K/V is read from memory once and
from L2 after. A causal call takes the blocks with the most keys first (longest-first, for balance at
the end of the grid), but not across all heads at once: at 2k keys and 128 heads one wave of 132 programs
then holds one block of each head, and each next wave reads every head's K/V again after 128 others went
through L2 (head dim 128, causal 2k on an H100: 240-320 TFLOP/s, ~1.1 GB of K/V reads for 137 GFLOP).
With ``l2_bytes`` the heads are walked in groups whose K/V fits it (FlashAttention-3's
longest-processing-time scheduler; 32 MiB is its budget): longest-first within a group, one group after
the other (``configs.HOPPER.gluon_l2_bytes``; on an H100 1.24-1.32x the order over all heads at causal 1k,
1.08-1.13x at 4k, level at 16k: docs/perf.md, "Decisions"). ``l2_bytes`` 0: every head in one group.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tileattn.kernels.gluon.common import sequence


def head_group(
    batch: int, nheads: int, nheads_k: int, seqlen_k: int, headdim: int, elem_bytes: int, l2_bytes: int
) -> int:
    """How many of a causal call's (batch entry, head) pairs its longest-first order walks together: as
    many key/value heads as ``l2_bytes`` holds (each ``seqlen_k`` rows of K and V), times the query heads
    that share one (GQA), at least one key/value head's; all of them where ``l2_bytes`` is 0."""
    pairs = batch * nheads
    if l2_bytes <= 0:
        return pairs
    kv_heads = max(1, l2_bytes // max(1, 2 * seqlen_k * headdim * elem_bytes))
    return min(pairs, kv_heads * (nheads // nheads_k))


# An item's cost beyond its key tiles, in tile times: its first Q·Kᵀ and softmax and its last P·V and
# epilogue, which no matmul overlaps (fitted to the causal columns of an H100: docs/perf-history/gluon.md)
ITEM_COST = 3.0


@functools.lru_cache(maxsize=64)  # (a plan is made per call on some paths: the search once per shape)
def balanced_group(num_m: int, pairs: int, most: int, programs: int, block_m: int, block_n: int, shift: int) -> int:
    """The group size (at most ``most`` pairs) whose grouped longest-first order, taken by ``programs``
    programs in snake order (``work_item`` with ``snake``), loads the busiest program least: each dense causal
    item costs its key tiles plus ``ITEM_COST`` (``shift``: seqlen_k - seqlen_q, the diagonal's offset)."""
    m = torch.arange(num_m)
    tiles = ((torch.clamp((m + 1) * block_m + shift, min=0) + block_n - 1) // block_n).to(torch.float64)
    t = torch.arange(num_m * pairs)
    wave, lane = t // programs, t % programs
    width = torch.clamp(num_m * pairs - wave * programs, max=programs)  # (the last wave's items)
    program = torch.where(wave % 2 == 1, width - 1 - lane, lane)
    best, best_load = most, float("inf")
    for g in range(1, most + 1):
        group_items = num_m * g
        first = (t // group_items) * g
        in_group = torch.clamp(pairs - first, max=g)
        cost = tiles[num_m - 1 - (t % group_items) // in_group] + ITEM_COST
        load = torch.zeros(programs, dtype=torch.float64).index_add_(0, program, cost).max().item()
        if load < best_load * 0.999:  # (ties: the larger group, which keeps more heads' K/V in L2)
            best, best_load = g, load
        elif load <= best_load * 1.001:
            best = g
    return best


@gluon.jit
def work_item(t, num_m, nheads, batch, head_group, SNAKE: gl.constexpr, max_q, max_k, CuQ, CuK, window_left,
              window_right, ITEM: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
              MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr):  # fmt: skip
    """Work item t: ``(query block start, head, batch entry, first query row, seqlen_q, first key row,
    seqlen_k, first key tile, key tiles)``, the key tiles those the block's rows see (``_scores`` says
    which keys a row sees). A packed batch's grid covers its longest sequence (``max_q``): the blocks
    that start past their sequence's rows are empty (the partitions skip them). Causal calls: groups of
    ``head_group`` (batch entry, head) pairs one after the other (the last one may be smaller), in each
    the blocks with the most keys first; with ``SNAKE`` the programs take every other wave of items
    (one item each) in reverse, so that who takes a long item in one wave takes a short one in the next.
    The others: a head's query blocks together."""
    if MASK_RIGHT and not MASK_LEFT:
        pairs = nheads * batch
        if SNAKE:  # every other wave of the programs' items reversed, within the wave's items
            programs = gl.num_programs(0)
            wave = t // programs
            if wave % 2 == 1:
                t = wave * programs + gl.minimum(programs, num_m * pairs - wave * programs) - 1 - t % programs
        group_items = num_m * head_group
        first = (t // group_items) * head_group  # the group's first pair
        in_group = gl.minimum(head_group, pairs - first)
        r = t % group_items
        m_block = num_m - 1 - r // in_group
        hb = first + r % in_group
    else:
        m_block = t % num_m
        hb = t // num_m
    b = hb // nheads
    q0, seqlen_q, k0, seqlen_k = sequence(CuQ, CuK, b, max_q, max_k, VARLEN)
    q_base = m_block * ITEM
    shift = seqlen_k - seqlen_q  # (bottom-right alignment: row i's diagonal is key i + shift)
    n_end = seqlen_k
    if MASK_RIGHT:  # past the last row's last key
        n_end = gl.minimum(n_end, gl.maximum(q_base + ITEM + shift + window_right, 0))
    lo = 0
    if MASK_LEFT:  # the first row's first key
        lo = gl.maximum(q_base + shift - window_left, 0) // BLOCK_N
    return q_base, hb % nheads, b, q0, seqlen_q, k0, seqlen_k, lo, gl.maximum(gl.cdiv(n_end, BLOCK_N) - lo, 0)


@gluon.jit
def live(q_base, seqlen_q, VARLEN: gl.constexpr):
    """Whether a work item has rows to compute: a packed batch's blocks past their sequence have none (a
    dense call's always do: there the answer is a constant, and the partitions have no branch)."""
    is_live = True
    if VARLEN:
        is_live = q_base < seqlen_q
    return is_live
