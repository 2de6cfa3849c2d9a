"""The PyTorch path of rotary position embedding (RoPE): what CPU tensors run, and the rotation the decode
path applies on CPU (``rotary_at``).

Conventions of ``flash_attn.layers.rotary``: ``cos``/``sin`` are tables ``(seqlen_ro, rotary_dim / 2)``,
entry ``[t, f]`` the angle of frequency f at position t. The first ``rotary_dim`` channels of each head
rotate, the rest pass through. Interleaved (GPT-J) style pairs channels (0, 1), (2, 3), ...;
non-interleaved (GPT-NeoX) style pairs channel f with f + rotary_dim / 2. A pair (x0, x1) becomes
``(x0·cos - x1·sin, x0·sin + x1·cos)``, computed in fp32 (each product and sum rounded as written, the
Triton kernels launch without FMA contraction to match) and rounded once to x's dtype. The conjugate
rotation (the backward) uses ``-sin``. Positions outside the table are left unrotated, as in flash_attn's
kernel; the API refuses them before anything runs.
"""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x ``(..., rotary_dim)`` in fp32, cos/sin ``(..., rotary_dim / 2)`` fp32 broadcasting against it;
    returns the rotated fp32 tensor ``(..., rotary_dim)``."""
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    x0, x1 = x.chunk(2, dim=-1)
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


def _tables_at(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, conjugate: bool = False):
    """fp32 cos/sin rows at integer ``positions`` (any shape), with a trailing head axis: ``positions.shape
    + (1, rotary_dim / 2)``. Positions outside the table read cos 1, sin 0 (no rotation)."""
    inside = ((positions >= 0) & (positions < cos.shape[0])).unsqueeze(-1)
    rows = positions.clamp(0, max(cos.shape[0] - 1, 0))
    c = torch.where(inside, cos[rows].float(), 1.0)
    s = torch.where(inside, sin[rows].float(), 0.0)
    return c.unsqueeze(-2), (-s if conjugate else s).unsqueeze(-2)


def rotary_at(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotates ``x (batch, seqlen, nheads, headdim)`` at integer ``positions (batch, seqlen)`` (rows of the
    ``(seqlen_ro, rotary_dim / 2)`` tables); returns a new tensor of x's dtype."""
    rot = 2 * cos.shape[-1]
    c, s = _tables_at(cos, sin, positions)
    out = x.clone()
    out[..., :rot] = rotate(x[..., :rot].float(), c, s, interleaved).to(x.dtype)
    return out


def positions(
    x: torch.Tensor,
    seqlen_offsets: torch.Tensor | None,
    seqlen_offset: int,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """The table row of every token of ``x``: ``(batch, seqlen)`` for x ``(batch, seqlen, nheads,
    headdim)``, or ``(total,)`` for packed x ``(total, nheads, headdim)`` with ``cu_seqlens``; token t of
    sequence b sits at ``seqlen_offsets[b] + t`` (a ``(batch,)`` tensor), else ``seqlen_offset + t``;
    packed rows past ``cu_seqlens[-1]`` (padding) at a negative position."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
        seq = torch.arange(batch, device=device).unsqueeze(1)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        tokens = torch.arange(x.shape[0], device=device)
        if cu.numel() < 2:  # no sequences: every row is padding
            return torch.full_like(tokens, -1)
        seq = torch.searchsorted(cu[1:], tokens, right=True).clamp(max=max(cu.numel() - 2, 0))
        pos = tokens - cu[seq]
    if seqlen_offsets is not None:
        pos = pos + seqlen_offsets.to(device=device, dtype=torch.long)[seq]
    else:
        pos = pos + seqlen_offset
    if cu_seqlens is not None:  # rows past the last sequence (padding): outside the tables, not rotated
        pos = torch.where(tokens < cu[-1], pos, -1)
    return pos


def apply_rotary(
    out: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    seqlen_offsets: torch.Tensor | None,
    seqlen_offset: int,
    cu_seqlens: torch.Tensor | None,
    interleaved: bool,
    conjugate: bool,
) -> None:
    """Writes x rotated into ``out`` (x's shape; ``out`` may be x itself, in place). ``x``: ``(batch,
    seqlen, nheads, headdim)`` or packed ``(total, nheads, headdim)`` with int32 ``cu_seqlens (batch +
    1,)``; the positions as in ``positions``; channels past ``rotary_dim`` are copied (left as they are in
    place)."""
    rot = 2 * cos.shape[-1]
    c, s = _tables_at(cos, sin, positions(x, seqlen_offsets, seqlen_offset, cu_seqlens), conjugate)
    rotated = rotate(x[..., :rot].float(), c, s, interleaved).to(out.dtype)
    if out is not x and rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    out[..., :rot] = rotated
