"""Tile schedules of FlashMask calls: which tiles each program of a launch visits, masked or not.

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
per program), built on the device with a few dozen torch ops and no host sync, and remembered per mask
tensor (``SCHEDULES``). The kernels loop over the runs, and within a run over contiguous tiles as they
do without a mask, so the loads of a run pipeline as in the dense kernel; the schedule's size is that of
the launch's tile grid.
"""

from __future__ import annotations

import torch

from tileattn.checks import CheckedOnce
from tileattn.params import AttnParams, FlashMask, cdiv


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


# schedules remembered per (startend_row_indices, cu_seqlens) tensors while they are alive and unmodified, and
# per launch shape: a model's layers, and a backward after its forward, reuse them instead of building again
SCHEDULES = CheckedOnce(limit=8)


def tile_runs(
    p: AttnParams, block_m: int, block_n: int, by_keys: bool, programs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``build_tile_runs``, remembered (``SCHEDULES``) per mask and cu_seqlens tensors and launch shape
    (built each time for a FlashMask given in the kernels' form only, without its ``startend_row_indices``)."""
    if p.startend_row_indices is None:
        return build_tile_runs(p, block_m, block_n, by_keys, programs, device)
    tensors = (p.startend_row_indices, p.cu_seqlens_q, p.cu_seqlens_k)
    shape = (p.mask_causal, p.batch, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)
    args = (*shape, block_m, block_n, by_keys, programs, device)
    return SCHEDULES(tensors, args, lambda: build_tile_runs(p, block_m, block_n, by_keys, programs, device))


def build_tile_runs(
    p: AttnParams, block_m: int, block_n: int, by_keys: bool, programs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule of one launch over ``programs`` flat tiles (the grid's tile axis times its batch
    axis: program ``t`` is tile ``t - first[b]`` of sequence ``b``, as ``common.seq_tile`` maps it).
    ``by_keys``: programs own key tiles of ``block_n`` and walk query tiles of ``block_m`` (dK/dV);
    otherwise the reverse. Returns ``(runs, counts)`` (``_runs``) of tile indices within the sequence."""
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
