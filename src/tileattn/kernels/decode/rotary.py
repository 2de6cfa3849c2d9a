"""Rotary embedding inside the decode kernels: the split kernel rotates q as it reads it, the append
rotates the new keys as it writes them. One rotation for both, in fp32 as ``x·cos ∓ partner·sin``, so
that queries and keys meet at the same positions with the same rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotary_pairs(offs_d, rot_half, INTERLEAVED: tl.constexpr):
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
def rotated(
    x, X, Cos, Sin,
    pos, rot_len, stride_c,
    offs_d, rot_half, enabled,
    INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """``x`` (read at ``X + offs_d``, channels last) rotated in fp32 at position ``pos`` of the
    ``(rot_len, rot_half)`` tables ``Cos`` / ``Sin`` (row stride ``stride_c``; the position clamped to
    their rows) as ``x·cos ∓ partner·sin``, in the channels below ``2 * rot_half`` where ``enabled``;
    the other channels are x itself. ``X``, ``pos`` and ``enabled`` broadcast against x without its
    channel axis (scalars for one row, ``[rows, 1]`` for a block)."""
    partner, freq, sign = rotary_pairs(offs_d, rot_half, INTERLEAVED)
    # (!= 0 keeps the mask boolean under Triton's interpreter, which broadcasts a scalar comparison such
    # as the append's ``enabled`` as int32: Triton 3.9's interpreter refuses that as a mask. No-op compiled.)
    rot = ((offs_d < 2 * rot_half) & enabled) != 0
    row_c = tl.minimum(tl.maximum(pos, 0), rot_len - 1).to(tl.int64) * stride_c
    xp = tl.load(X + partner, mask=rot, other=0.0).to(tl.float32)
    c = tl.load(Cos + row_c + freq, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(Sin + row_c + freq, mask=rot, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    return tl.where(rot, xf * c + (sign * xp) * s, xf)
