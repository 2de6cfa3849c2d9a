"""Counter-based dropout RNG shared by every path.

The Triton kernels draw dropout decisions with ``tl.rand(seed, offset)`` (Philox4x32-10). This module
computes the very same numbers with PyTorch integer ops, so that the CPU path, the reference and the
tests all see the dropout mask the GPU kernels use. Nothing is stored between forward and backward:
each element's decision is a pure function of ``(seed, offset)``.

Dropout draws 8 random bits per attention element and gets 16 elements from one Philox evaluation
(four 32-bit words, four bytes each), FlashAttention-2's economy: Philox is integer work, and one
evaluation per element cost more than the tensor-core math it gated. Which bytes keep their element is
flash_attn's rule (``params.dropout_threshold``): the kept fraction is ``dropout_p`` rounded down to the
bytes' resolution, and the kept weights are rescaled by ``1 / (1 - dropout_p)`` as given.

Which 16 elements share an evaluation follows the kernels' register layout: on Hopper a thread of the
MMA accumulator holds, of each row, the column pairs ``8i + 2c + {0, 1}`` for one ``c < 4``. So counter
``(row, j, c)`` serves columns ``64j + 8i + 2c + h`` (``i < 8``, ``h < 2``): word ``i // 2``, byte
``2 (i % 2) + h``. A thread then evaluates only the counters it needs, each once.

Offsets: element ``(b, h, i, j)`` of an attention with ``nheads`` heads, padded to ``seqlen_q`` x
``seqlen_k`` (the max lengths in varlen mode) has ``offset = ((b * nheads + h) * seqlen_q + i) * row + j``
with ``row = 64 * ceil(seqlen_k / 64)``. Its Philox counter is ``4 * (offset // 64) + (offset % 8) // 2``.
"""

from __future__ import annotations

import torch

from tileattn.params import dropout_threshold

_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
# Triton's uint_to_uniform_float scale: the largest value with (2**31 - 1) * scale < 1 in fp32.
_UNIFORM_SCALE = 4.6566127342e-10


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product of the constant ``a`` and uint32 values ``b``.

    int64 cannot hold a 32x32-bit product, so ``a`` is split into 16-bit halves."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    p_lo = b * a_lo  # < 2**48
    p_hi = b * a_hi  # < 2**48
    mid = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2**49
    hi = (p_hi >> 16) + (mid >> 32)
    return hi & _MASK32, mid & _MASK32


def philox4_uint32(seed: int, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four output words of Philox4x32-10 for counters ``(offset_lo, offset_hi, 0, 0)`` and key
    ``(seed_lo, seed_hi)``, int64 values in [0, 2**32): ``tl.randint4x(seed, offsets)``."""
    offsets = offsets.to(torch.int64)
    c0 = offsets & _MASK32
    c1 = (offsets >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def philox_uint32(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """First output word of Philox4x32-10 for counters ``(offset_lo, offset_hi, 0, 0)`` and key
    ``(seed_lo, seed_hi)``, as int64 values in [0, 2**32). Matches ``tl.randint(seed, offsets)``
    for int64 ``offsets``."""
    return philox4_uint32(seed, offsets)[0]


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1), bit-identical to ``tl.rand(seed, offsets)`` for int64 offsets."""
    x = philox_uint32(seed, offsets)
    x = torch.where(x >= 2**31, x - 2**32, x)  # reinterpret as int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


DROPOUT_BITS = 8


def dropout_offsets(
    b: torch.Tensor | int,
    h: torch.Tensor | int,
    i: torch.Tensor,
    j: torch.Tensor,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
) -> torch.Tensor:
    """Offsets of elements (b, h, i, j); arguments broadcast against each other."""
    row = 64 * ((seqlen_k + 63) // 64)
    return ((torch.as_tensor(b, dtype=torch.int64) * nheads + h) * seqlen_q + i) * row + j


def dropout_keep(seed: int, offsets: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Boolean keep-mask: an element is kept when its 8 random bits are at least
    ``params.dropout_threshold(dropout_p)``."""
    offsets = offsets.to(torch.int64)
    words = philox4_uint32(seed, 4 * (offsets // 64) + (offsets % 8) // 2)
    i = (offsets % 64) // 8
    word = torch.where(i < 4, torch.where(i < 2, words[0], words[1]), torch.where(i < 6, words[2], words[3]))
    bits = (word >> (8 * (2 * (i % 2) + offsets % 2))) & 0xFF
    return bits >= dropout_threshold(dropout_p)


def new_seed() -> int:
    """A fresh 62-bit Philox seed drawn from PyTorch's default CPU generator, so that
    ``torch.manual_seed`` makes dropout reproducible."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
