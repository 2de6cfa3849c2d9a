"""Rotary position embedding (RoPE), with ``flash_attn.layers.rotary``'s conventions.

``cos``/``sin`` are tables ``(seqlen_ro, rotary_dim / 2)``: entry ``[t, f]`` is the angle of frequency f
at position t. The first ``rotary_dim`` channels of each head are rotated, the rest pass through.
Interleaved (GPT-J) style pairs channels (0, 1), (2, 3), ...; non-interleaved (GPT-NeoX) style pairs
channel f with f + rotary_dim / 2. The rotation is computed in fp32 and rounded once to x's dtype.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x ``(..., rotary_dim)`` in fp32, cos/sin ``(..., rotary_dim / 2)`` broadcasting against it."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rotary_at(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotates ``x (batch, seqlen, nheads, headdim)`` at integer ``positions (batch, seqlen)`` (indices
    into the tables); returns a new tensor of x's dtype."""
    half = cos.shape[-1]
    rot = 2 * half
    c = cos[positions].float().unsqueeze(-2)  # (batch, seqlen, 1, half)
    s = sin[positions].float().unsqueeze(-2)
    out = x.clone()
    out[..., :rot] = _rotate(x[..., :rot].float(), c, s, interleaved).to(x.dtype)
    return out


def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Rotary embedding of ``x (batch, seqlen, nheads, headdim)``: token s of sequence b sits at position
    ``seqlen_offsets (+ [b]) + s``. ``cos``/``sin``: ``(seqlen_ro, rotary_dim / 2)`` with
    ``rotary_dim <= headdim``; ``seqlen_offsets``: an int or an integer tensor ``(batch,)``."""
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(f"cos and sin must share a shape (seqlen_ro, rotary_dim / 2), got {cos.shape}, {sin.shape}")
    if 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(f"rotary_dim ({2 * cos.shape[1]}) must be at most the head dim ({x.shape[-1]})")
    batch, seqlen = x.shape[:2]
    pos = torch.arange(seqlen, device=x.device).unsqueeze(0)
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape not in ((), (batch,)) or seqlen_offsets.is_floating_point():
            raise ValueError(
                f"seqlen_offsets must be an int or an integer tensor (batch,) = ({batch},), got "
                f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}"
            )
        pos = pos + seqlen_offsets.to(device=x.device, dtype=torch.long).view(-1, 1)
    else:
        pos = pos + int(seqlen_offsets)
    pos = pos.expand(batch, seqlen)
    if seqlen and int(pos.max()) >= cos.shape[0]:
        raise ValueError(f"cos/sin have {cos.shape[0]} positions but position {int(pos.max())} is needed")
    return rotary_at(x, cos, sin, pos, interleaved)
