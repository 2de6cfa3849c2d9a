"""The dropout keep mask from its documented definition (``tileattn.rng``'s module docstring), written apart
from ``tileattn.rng`` so that a mistake there or in the kernels' offsets cannot pass by agreeing with itself:
Philox4x32-10 on numpy uint64 (whole 64-bit products, no 16-bit halves), element ``(b, h, i, j)`` at offset
``((b * nheads + h) * seqlen_q + i) * row + j`` with ``row = 64 * ceil(seqlen_k / 64)``, one evaluation per 16
elements (counter ``4 * (offset // 64) + (offset % 8) // 2``; word ``(offset % 64) // 16``, byte
``2 * ((offset % 64) // 8 % 2) + offset % 2``), kept when the byte is at least ``255 - floor(255 · (1 - p))``
with ``1 - p`` in fp32 (flash_attn's count of kept bytes, ``tileattn.params.dropout_threshold``'s statement)."""

from __future__ import annotations

import math

import numpy as np
import torch

_M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(seed: int, counters: np.ndarray) -> list[np.ndarray]:
    """The four uint64 words (each < 2**32) of Philox4x32-10 at counters ``(c & 0xffffffff, c >> 32, 0, 0)``
    with key ``(seed & 0xffffffff, seed >> 32)`` (Triton's ``tl.randint4x``)."""
    c = counters.astype(np.uint64)
    x = [c & _M32, (c >> np.uint64(32)) & _M32, np.zeros_like(c), np.zeros_like(c)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    for _ in range(10):
        prod_a = np.uint64(0xD2511F53) * x[0]  # (< 2**64: exact in uint64)
        prod_b = np.uint64(0xCD9E8D57) * x[2]
        x = [(prod_b >> np.uint64(32)) ^ x[1] ^ k0, prod_b & _M32, (prod_a >> np.uint64(32)) ^ x[3] ^ k1, prod_a & _M32]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _M32, (k1 + np.uint64(0xBB67AE85)) & _M32
    return x


def kept_bytes(dropout_p: float) -> int:
    """How many of the 256 byte values keep their element: ``floor(255 · (1 - p)) + 1``, ``1 - p`` in fp32."""
    return math.floor(float(np.float32(1.0) - np.float32(dropout_p)) * 255.0) + 1 if dropout_p > 0 else 256


def keep_mask(seed: int, dropout_p: float, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Bool ``(batch, nheads, seqlen_q, seqlen_k)`` on the CPU, True where an element is kept."""
    b, h, i, j = np.ix_(*(np.arange(n, dtype=np.uint64) for n in (batch, nheads, seqlen_q, seqlen_k)))
    row = np.uint64(64 * -(-seqlen_k // 64))
    offset = ((b * np.uint64(nheads) + h) * np.uint64(seqlen_q) + i) * row + j
    words = philox4x32_10(seed, np.uint64(4) * (offset // np.uint64(64)) + (offset % np.uint64(8)) // np.uint64(2))
    within = (offset % np.uint64(64)).astype(np.int64)  # the element's place among its evaluation's 64 columns
    word = np.choose(within // 16, words)
    shift = (8 * (2 * (within // 8 % 2) + within % 2)).astype(np.uint64)
    byte = (word >> shift) & np.uint64(0xFF)
    return torch.from_numpy(byte >= np.uint64(256 - kept_bytes(dropout_p)))
