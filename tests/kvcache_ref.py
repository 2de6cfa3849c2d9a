"""The reference for attention against a KV cache: the cache after the append, built with plain
indexing, and per-sequence dense attention over its live keys through the tests' oracle
(tests/oracle.py: its own mask, window and rotary, nothing from tileattn)."""

from __future__ import annotations

from typing import NamedTuple

import torch

import oracle


class CacheRef(NamedTuple):
    """``out (batch, seqlen_q, nheads, headdim)`` and ``lse (batch, nheads, seqlen_q)`` in the compute
    precision; ``k_cache``, ``v_cache``: the caches after the append as dense ``(batch, capacity,
    nheads_k, headdim)`` copies in q's batch order, in the caches' dtype."""

    out: torch.Tensor
    lse: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def dense_view(cache, block_table, capacity):
    """A paged pool seen as (batch, capacity, nheads_k, d) through the block table (a copy)."""
    if block_table is None:
        return cache
    pages = cache[block_table.long()]  # (batch, max_pages, page, hk, d)
    return pages.flatten(1, 2)[:, :capacity]


def kvcache_ref(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    rotary_interleaved=True,
    precision=torch.float64,
    learnable_sink=None,
    probs_dtype=None,
) -> CacheRef:
    """What ``flash_attn_with_kvcache`` computes, from its definition: k and v written at
    ``cache_seqlens[b] + t`` (k rotated at those positions), q rotated at ``cache_seqlens[b] + i`` when
    the call has a window (causal, or a side narrower than the capacity) else all of it at
    ``cache_seqlens[b]``, and attention of each sequence over its keys ``[cache_leftpad[b],
    cache_seqlens[b] + seqlen_new)``, masks aligned to the last key, window sides resolved at the capacity.

    Args: as ``flash_attn_with_kvcache`` (``rotary = (cos, sin)`` or None); ``precision`` as
    ``oracle.attention`` (float64, or None for the inputs' precision); ``learnable_sink`` as the oracle's
    ``sink``, ``probs_dtype`` as its own (plain FP8 attention's probabilities). The caches are not modified."""
    batch, seqlen_q = q.shape[:2]
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    kc = dense_view(k_cache, block_table, capacity).clone()
    vc = dense_view(v_cache, block_table, capacity).clone()
    if cache_batch_idx is not None:
        kc, vc = kc[cache_batch_idx.long()], vc[cache_batch_idx.long()]
    seqlens = cache_seqlens.tolist() if cache_seqlens is not None else [capacity] * batch
    seqlen_new = 0 if k is None else k.shape[1]
    starts = torch.tensor(seqlens, device=q.device).unsqueeze(1)  # (batch, 1)
    if rotary is not None:
        cos, sin = rotary
        k = oracle.rotary(k, cos, sin, starts + torch.arange(seqlen_new, device=q.device), rotary_interleaved)
        if oracle.window_sides(causal, window_size, capacity) != (None, None):
            q = oracle.rotary(q, cos, sin, starts + torch.arange(seqlen_q, device=q.device), rotary_interleaved)
        else:
            q = oracle.rotary(q, cos, sin, starts.expand(batch, seqlen_q), rotary_interleaved)
    for b in range(batch if seqlen_new else 0):
        kc[b, seqlens[b] : seqlens[b] + seqlen_new] = k[b]
        vc[b, seqlens[b] : seqlens[b] + seqlen_new] = v[b]
    outs, lses = [], []
    for b in range(batch):
        first = int(cache_leftpad[b]) if cache_leftpad is not None else 0
        end = seqlens[b] + seqlen_new
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        res = oracle.attention(
            q[b : b + 1],
            kc[b : b + 1, first:end],
            vc[b : b + 1, first:end],
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            window_seqlen_k=capacity,
            precision=precision,
            sink=learnable_sink,
            probs_dtype=probs_dtype,
        )
        outs.append(res.out)
        lses.append(res.lse)
    return CacheRef(torch.cat(outs), torch.cat(lses), kc, vc)
