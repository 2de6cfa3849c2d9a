"""The reference for attention against a KV cache: the cache after the append, built with plain
indexing, and per-sequence dense attention over its live keys."""

from __future__ import annotations

import torch

from tileattn.reference import attention_ref, causal_window
from tileattn.rotary import apply_rotary_emb


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
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    rotary_interleaved=True,
    upcast=torch.float64,
):
    """Returns (out, k_cache_after, v_cache_after) with the caches as dense (batch, capacity, ...)
    views in q's batch order."""
    batch, seqlen_q = q.shape[:2]
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    kc = dense_view(k_cache, block_table, capacity).clone()
    vc = dense_view(v_cache, block_table, capacity).clone()
    if cache_batch_idx is not None:
        kc, vc = kc[cache_batch_idx.long()], vc[cache_batch_idx.long()]
    seqlens = cache_seqlens.tolist() if cache_seqlens is not None else [capacity] * batch
    seqlen_new = 0 if k is None else k.shape[1]
    q_ro = q
    if rotary is not None:
        cos, sin = rotary
        offsets = torch.tensor(seqlens, device=q.device)
        k = apply_rotary_emb(k, cos, sin, rotary_interleaved, offsets)
        if causal_window(causal, window_size, capacity) != (-1, -1):  # (sides as wide as the cache: unbounded)
            q_ro = apply_rotary_emb(q, cos, sin, rotary_interleaved, offsets)
        else:  # every query token at position cache_seqlens
            flat = q.reshape(batch, 1, -1, q.shape[-1])
            q_ro = apply_rotary_emb(flat, cos, sin, rotary_interleaved, offsets).view(q.shape)
    for b in range(batch):
        if seqlen_new:
            kc[b, seqlens[b] : seqlens[b] + seqlen_new] = k[b]
            vc[b, seqlens[b] : seqlens[b] + seqlen_new] = v[b]
    outs = []
    for b in range(batch):
        start = int(cache_leftpad[b]) if cache_leftpad is not None else 0
        end = seqlens[b] + seqlen_new
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        out, _ = attention_ref(
            q_ro[b : b + 1],
            kc[b : b + 1, start:end],
            vc[b : b + 1, start:end],
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            upcast=upcast,
            window_seqlen_k=capacity,
        )
        outs.append(out)
    return torch.cat(outs), kc, vc
