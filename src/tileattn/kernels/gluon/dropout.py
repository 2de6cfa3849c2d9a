"""Dropout in the Gluon backward: the keep mask ``tileattn.rng`` describes, as the portable kernels draw
it (``kernels.common.dropout_keep``), in the transposed score tiles of wgmma.

A warpgroup's Sᵀ tile (64 keys x BLOCK_M queries) draws from counters (query, c), c < 4, whose four
words hold the bytes of keys 16k + 8a + 2c + h (word k, byte 2a + h). ``_COUNTERS``: each counter in one
thread (``[4 c, BLOCK_M queries]``); ``_WORDS``: the Sᵀ accumulator's layout (wgmma's, ``s_layout`` in
the backward's consumers) seen as ``[4 k, 2 a, 4 c, 2 h, BLOCK_M]``: the same registers, lanes and warps,
so that the draws, reshaped to ``[64, BLOCK_M]``, are in ``s_layout`` without moving. ``WORD_SMEM``: the
layout of the words' shared-memory buffer (``[2 * 16, BLOCK_M]`` uint32, one half per warpgroup).
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_COUNTERS = gl.BlockedLayout([1, 2], [4, 8], [1, 4], [1, 0])
_WORDS = gl.BlockedLayout([1, 2, 1, 1, 2], [1, 1, 4, 2, 4], [4, 1, 1, 1, 1], [4, 3, 2, 1, 0])
WORD_SMEM = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])


@gluon.jit
def dropout_words(seed, rng_row, m_start, key_start, row_groups, rng_smem, WG: gl.constexpr):
    """Writes the Philox words of warpgroup WG's tile (keys ``key_start`` + 64, queries ``m_start`` +
    BLOCK_M) to its rows of ``rng_smem`` (``[2 * 16, BLOCK_M]`` uint32: row ``16 WG + 4k + c`` holds word k
    of counter (query, c)). In the transposed tile a counter's 16 bytes lie in all four warps (its keys
    ``64j + 8i + 2c + h``): evaluating each counter where its bytes are needed would repeat it eight
    times, integer work comparable to the tile's matmuls; here each thread evaluates its share once
    (FlashAttention-2's economy, as the forward), and ``dropout_kept`` reads the words back."""
    BLOCK_M: gl.constexpr = rng_smem.type.shape[1]
    c = gl.arange(0, 4, layout=gl.SliceLayout(1, _COUNTERS))[:, None]
    q = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, _COUNTERS))[None, :]
    counters = rng_row + q.to(gl.int64) * row_groups + (key_start // 64 * 4 + c)  # [4, BLOCK_M]
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    words = gl.join(gl.join(w0, w1), gl.join(w2, w3))  # [4 c, BLOCK_M, 2, 2]: word k at [..., k % 2, k // 2]
    words = gl.permute(words, (3, 2, 0, 1))  # [k // 2, k % 2, c, query] (the registers as they are)
    gl.thread_barrier()  # every warp of the warpgroup has read the last tile's words
    rng_smem.reshape([4, 2, 4, BLOCK_M]).slice(2 * WG, 2).store(words)  # (rows 16 WG + 4k + c)
    gl.thread_barrier()


@gluon.jit
def dropout_kept(rng_smem, drop_threshold, s_layout: gl.constexpr, WG: gl.constexpr):
    """Which elements of warpgroup WG's Sᵀ tile dropout keeps (``[64, BLOCK_M]`` in ``s_layout``), from the
    words ``dropout_words`` wrote: a byte >= ``drop_threshold`` (dropout_p * 256) is kept."""
    BLOCK_M: gl.constexpr = rng_smem.type.shape[1]
    # [4 k, 4 c, BLOCK_M]: each thread loads the words of its keys' (k, c), which broadcast over a and h
    words = rng_smem.reshape([8, 4, BLOCK_M]).slice(4 * WG, 4).load(gl.SliceLayout(1, gl.SliceLayout(3, _WORDS)))
    a = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, _WORDS)))))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, _WORDS)))))
    shift = ((2 * a[None, :, None, None, None] + h[None, None, None, :, None]) * 8).to(gl.uint32)
    draws = (words[:, None, :, None, :] >> shift) & 0xFF  # [4, 2, 4, 2, BLOCK_M]: key 16k + 8a + 2c + h
    kept = gl.reshape(draws.to(gl.int32) >= drop_threshold, [64, BLOCK_M])
    return gl.convert_layout(kept, s_layout, assert_trivial=True)


@gluon.jit
def kept(signed_p):
    """Whether dropout keeps the weights ``signed_p`` (P, negated where dropped): the sign bit, so that a
    dropped weight of 0 (-0.0) counts as dropped and a NaN stays NaN in dV and dS."""
    return signed_p.to(gl.int32, bitcast=True) >= 0
