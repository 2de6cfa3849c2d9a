"""The backward's LSE and Δ as flat rows for 1-D TMA copies.

A tile's LSE and Δ reach the Gluon backward's loader by one 1-D TMA copy each, from
``row_start(b, h, ...) + m * BLOCK_M`` in their flat rows. TMA needs a copy's start 16-byte aligned (a copy
that starts elsewhere is an illegal instruction on the H200, and no check catches it before): a dense
``(batch, nheads, seqlen_q)`` LSE is read as it is where seqlen_q is a multiple of 4, else from a
zero-padded copy (``dense_rows``); a packed batch's sequences start anywhere, so theirs are copied to
aligned starts (``packed_rows``, one kernel, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tileattn.kernels.launch import Launcher
from tileattn.params import AttnParams, cdiv

ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)  # a tile's LSE or Δ


@gluon.jit
def row_start(b, h, nheads, q0, lse_stride, VARLEN: gl.constexpr, LSE_TMA: gl.constexpr):
    """Where (b, h)'s LSE and Δ start in their flat rows: ``(batch, nheads, lse_stride)``, or varlen
    ``(nheads, lse_stride)``, sequence b at cu_seqlens_q[b] (``q0``), or read by TMA at ``_aligned_start``
    (``packed_rows`` lays them out so)."""
    if VARLEN:
        if LSE_TMA:
            return h * lse_stride + _aligned_start(q0, b)
        else:
            return h * lse_stride + q0
    else:
        return (b * nheads + h) * lse_stride


@triton.jit
def _aligned_start(q0, b):
    """Where a packed batch's sequence b (first row ``q0`` = cu_seqlens_q[b]) starts in LSE/Δ rows laid out
    for TMA: the multiple of 4 at or after ``q0 + 3b`` (16-byte aligned; each sequence moved on by at
    most 3 rows from the last, so none overlaps the next)."""
    return (q0 + 3 * b + 3) // 4 * 4


@triton.jit
def _packed_rows_kernel(Lse, Delta, LseRows, DeltaRows, CuQ, total_q, width, BLOCK: tl.constexpr):
    """Copies sequence b's part of head h's LSE and Δ rows (``(nheads, total_q)``) to ``_aligned_start``
    in rows of ``width``, writing zeros up to where the next sequence starts (the last: to the rows'
    end), so that every value a tile may read is finite."""
    pid, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch = tl.num_programs(2)
    q0 = tl.load(CuQ + b)
    q1 = tl.load(CuQ + b + 1)
    start = _aligned_start(q0, b)
    end = tl.where(b + 1 < batch, _aligned_start(q1, b + 1), width)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_seq = offs < q1 - q0
    src = h.to(tl.int64) * total_q + q0 + offs
    dst = h.to(tl.int64) * width + start + offs
    keep = start + offs < end
    tl.store(LseRows + dst, tl.load(Lse + src, mask=in_seq, other=0.0), mask=keep)
    tl.store(DeltaRows + dst, tl.load(Delta + src, mask=in_seq, other=0.0), mask=keep)


def dense_rows(t: torch.Tensor, block_m: int, aligned: bool) -> tuple[torch.Tensor, int]:
    """A contiguous ``(batch, nheads, seqlen_q)`` fp32 tensor as flat rows for 1-D TMA copies, and their
    stride: the tensor itself where its rows start 16-byte aligned (seqlen_q a multiple of 4; TMA faults
    on a copy that starts elsewhere) and it holds at least a tile, else (``aligned``) a zero-padded copy
    with rows of whole tiles. The padding is read only by queries past the sequence, which are masked."""
    batch, nheads, seqlen_q = t.shape
    if not aligned or (seqlen_q % 4 == 0 and t.numel() >= block_m):
        return t.view(-1), seqlen_q
    stride = cdiv(seqlen_q, block_m) * block_m
    rows = t.new_zeros((batch * nheads, stride))
    rows[:, :seqlen_q] = t.view(batch * nheads, seqlen_q)
    return rows.view(-1), stride


_PACKED_ROWS = Launcher(_packed_rows_kernel)


def packed_rows(
    lse: torch.Tensor, delta: torch.Tensor, p: AttnParams, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A packed batch's ``(nheads, total_q)`` LSE and Δ as flat rows for 1-D TMA copies, and their stride:
    sequence b at ``_aligned_start`` of each row (16-byte aligned), zeros between the sequences (one
    kernel, no host sync: the starts come from cu_seqlens_q on the device)."""
    nheads, total_q = lse.shape
    batch = p.batch
    # past _aligned_start of a sequence after the last, and at least one tile's copy (block_m: 64 or 128)
    width = max(cdiv(total_q + 3 * batch + 3, 4) * 4, block_m)
    lse_rows = torch.empty((nheads, width), device=lse.device, dtype=torch.float32)
    delta_rows = torch.empty_like(lse_rows)
    block = 256
    # what one sequence's programs write, from its start to the next one's (the last: to the rows' end):
    # its rows and at most 9 of padding, or at most the rows' minimum width
    span = max(p.seqlen_q + 9, block_m)
    _PACKED_ROWS(
        (cdiv(span, block), nheads, batch),
        (lse, delta, lse_rows, delta_rows, p.cu_seqlens_q, total_q, width),
        dict(BLOCK=block),
        num_warps=4,
    )
    return lse_rows.view(-1), delta_rows.view(-1), width
