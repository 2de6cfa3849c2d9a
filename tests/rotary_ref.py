"""The rotary tests' reference, written from the definition and sharing no code with tileattn: the
positions of every token (dense or packed, with offsets) by plain loops, and the rotation of each channel
pair as a complex multiplication, in float64 (the oracle) or, for the tolerance rule's PyTorch error, as
real products and sums in the input's own precision.

A pair is channels (2f, 2f + 1) when interleaved (GPT-J), (f, f + rotary_dim / 2) otherwise (GPT-NeoX); the
pair ``a + ib`` of frequency f at position p becomes ``(a + ib)(cos[p, f] + i sin[p, f])`` (``- i sin``
for the conjugate rotation); channels past rotary_dim pass through.
"""

from __future__ import annotations

import torch


def dense_positions(batch: int, seqlen: int, offsets) -> torch.Tensor:
    """``(batch, seqlen)``: token t of sequence b at ``offsets[b] + t`` (offsets an int or a list)."""
    offs = [offsets] * batch if isinstance(offsets, int) else list(offsets)
    return torch.tensor([[offs[b] + t for t in range(seqlen)] for b in range(batch)], dtype=torch.long)


def packed_positions(cu_seqlens: list[int], total: int, offsets) -> torch.Tensor:
    """``(total,)``: token t of sequence b (rows ``cu[b]..cu[b+1]``) at ``offsets[b] + t``; rows past the
    last sequence get -1 (no rotation)."""
    batch = len(cu_seqlens) - 1
    offs = [offsets] * batch if isinstance(offsets, int) else list(offsets)
    pos = [-1] * total
    for b in range(batch):
        for t in range(cu_seqlens[b + 1] - cu_seqlens[b]):
            pos[cu_seqlens[b] + t] = offs[b] + t
    return torch.tensor(pos, dtype=torch.long)


def _pairs(head: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    half = head.shape[-1] // 2
    if interleaved:
        return head[..., 0::2], head[..., 1::2]
    return head[..., :half], head[..., half:]


def _unpairs(a: torch.Tensor, b: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((a, b), dim=-1)


def rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
    exact: bool = True,
    conjugate: bool = False,
) -> torch.Tensor:
    """x ``(..., nheads, headdim)`` rotated at ``positions`` (x's shape without the last two axes; -1 or
    any row outside the tables: unrotated). ``exact``: in float64 (complex128), returning float64; else
    in x's dtype with real arithmetic (plain PyTorch's error). Differentiable in x."""
    half = cos.shape[-1]
    rot = 2 * half
    inside = (positions >= 0) & (positions < cos.shape[0])
    rows = positions.clamp(0, cos.shape[0] - 1).to(x.device)
    inside = inside.to(x.device).unsqueeze(-1)
    dtype = torch.float64 if exact else x.dtype
    c = torch.where(inside, cos.to(dtype)[rows], torch.ones((), dtype=dtype, device=x.device)).unsqueeze(-2)
    s = torch.where(inside, sin.to(dtype)[rows], torch.zeros((), dtype=dtype, device=x.device)).unsqueeze(-2)
    if conjugate:
        s = -s
    a, b = _pairs(x[..., :rot].to(dtype), interleaved)
    if exact:
        z = torch.complex(a, b) * torch.complex(c, s)
        a, b = z.real, z.imag
    else:
        a, b = a * c - b * s, a * s + b * c
    return torch.cat((_unpairs(a, b, interleaved), x[..., rot:].to(dtype)), dim=-1)


def tables(seqlen_ro: int, rotary_dim: int, dtype: torch.dtype, device="cpu", scale: float = 7.0):
    """Random angle tables ``(seqlen_ro, rotary_dim / 2)`` (cos, sin) in ``dtype``."""
    angle = torch.rand(seqlen_ro, rotary_dim // 2, device=device) * scale
    return angle.cos().to(dtype), angle.sin().to(dtype)
