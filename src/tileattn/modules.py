"""Attention layers on tileattn, in the spirit of ``flash_attn.modules.mha``.

- ``SelfAttention`` / ``CrossAttention``: the attention step alone, on packed ``qkv`` / ``q`` + ``kv``
  tensors, dense or varlen (with ``cu_seqlens``).
- ``MHA``: a full multi-head attention layer: fused QKV projection (one matmul, GQA/MQA when
  ``num_heads_kv < num_heads``), optional rotary embedding, causal or sliding-window attention, and a
  ``key_padding_mask`` that is turned into a packed (varlen) batch so padding costs nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from tileattn.api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    resolve_scale,
)
from tileattn.bert_padding import pad_input, unpad_input
from tileattn.rotary import rotary_at


class _InnerAttention(nn.Module):
    """Options shared by SelfAttention and CrossAttention (flash_attn's constructor arguments)."""

    def __init__(
        self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1), deterministic=False
    ):
        super().__init__()
        self.causal, self.softmax_scale, self.drop_p = causal, softmax_scale, attention_dropout
        self.window_size, self.deterministic = window_size, deterministic

    def _kwargs(self, causal, alibi_slopes) -> dict:
        return dict(
            dropout_p=self.drop_p if self.training else 0.0,
            softmax_scale=self.softmax_scale,
            causal=self.causal if causal is None else causal,
            window_size=self.window_size,
            alibi_slopes=alibi_slopes,
            deterministic=self.deterministic,
        )


class SelfAttention(_InnerAttention):
    """softmax(QKᵀ·scale)·V on packed ``qkv``: ``(batch, seqlen, 3, nheads, headdim)``, or
    ``(total, 3, nheads, headdim)`` with ``cu_seqlens`` and ``max_seqlen``."""

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None, alibi_slopes=None):
        kwargs = self._kwargs(causal, alibi_slopes)
        if cu_seqlens is not None:
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **kwargs)
        return flash_attn_qkvpacked_func(qkv, **kwargs)


class CrossAttention(_InnerAttention):
    """Attention of ``q`` over packed ``kv``: dense ``q (batch, seqlen_q, nheads, d)``,
    ``kv (batch, seqlen_k, 2, nheads_k, d)``, or varlen with cu_seqlens / cu_seqlens_k."""

    def forward(
        self,
        q,
        kv,
        causal=None,
        cu_seqlens=None,
        max_seqlen=None,
        cu_seqlens_k=None,
        max_seqlen_k=None,
        alibi_slopes=None,
    ):
        kwargs = self._kwargs(causal, alibi_slopes)
        if cu_seqlens is not None:
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **kwargs)
        return flash_attn_kvpacked_func(q, kv, **kwargs)


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``(max_position, rotary_dim / 2)`` of RoPE with base ``base``, grown on demand."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, device=None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary_emb_dim must be even, got {dim}")
        self.dim, self.interleaved = dim, interleaved
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tables(self, length: int, device, dtype):
        t = torch.arange(length, device=device, dtype=torch.float32)
        angles = torch.outer(t, self.inv_freq.to(device))
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotates ``x (batch, seqlen, nheads, headdim)`` at integer ``positions (batch, seqlen)``."""
        cos, sin = self.tables(int(positions.max()) + 1 if positions.numel() else 1, x.device, x.dtype)
        return rotary_at(x, cos, sin, positions, self.interleaved)


def _positions_in_sequence(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each packed token within its own sequence, ``(1, total)``."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)
    return (tokens - cu_seqlens.long()[seq]).unsqueeze(0)


class MHA(nn.Module):
    """Multi-head self-attention with a fused QKV projection.

    Args:
        embed_dim, num_heads: model width and query heads (head dim = embed_dim / num_heads).
        num_heads_kv: key/value heads (GQA/MQA); default num_heads.
        qkv_proj_bias, out_proj_bias: biases of the two projections.
        dropout: attention dropout (training only).
        softmax_scale, causal, window_size: as in ``flash_attn_func``.
        rotary_emb_dim: rotate the first rotary_emb_dim channels of q and k (0 = off) with base
            ``rotary_emb_base``; GPT-NeoX style unless ``rotary_emb_interleaved``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_heads_kv: int | None = None,
        qkv_proj_bias: bool = True,
        out_proj_bias: bool = True,
        dropout: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        rotary_emb_dim: int = 0,
        rotary_emb_base: float = 10000.0,
        rotary_emb_interleaved: bool = False,
        deterministic: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if num_heads % self.num_heads_kv:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_heads_kv ({self.num_heads_kv})")
        self.head_dim = embed_dim // num_heads
        qkv_dim = self.head_dim * (num_heads + 2 * self.num_heads_kv)
        self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)
        self.rotary_emb = (
            RotaryEmbedding(rotary_emb_dim, rotary_emb_base, rotary_emb_interleaved, device=device)
            if rotary_emb_dim > 0
            else None
        )
        self.dropout, self.softmax_scale, self.causal = dropout, softmax_scale, causal
        self.window_size, self.deterministic = window_size, deterministic

    def _attend(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        kwargs = dict(
            dropout_p=self.dropout if self.training else 0.0,
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            window_size=self.window_size,
            deterministic=self.deterministic,
        )
        if cu_seqlens is not None:
            return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
        return flash_attn_func(q, k, v, **kwargs)

    def _split(self, qkv):
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
        return q.unflatten(-1, (h, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """``x``: ``(batch, seqlen, embed_dim)``, or packed ``(total, embed_dim)`` with cu_seqlens and
        max_seqlen. ``key_padding_mask``: bool ``(batch, seqlen)``, True for real tokens; padded
        positions are dropped before the projections (the batch runs packed, varlen) and their outputs
        are 0. Rotary positions count from 0 in each sequence."""
        self._check_input(x, key_padding_mask, cu_seqlens, max_seqlen)
        if key_padding_mask is not None:
            batch, seqlen = x.shape[:2]
            x_packed, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, key_padding_mask)
            out = self.forward(x_packed, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
            return pad_input(out, indices, batch, seqlen)
        q, k, v = self._split(self.Wqkv(x))
        if self.rotary_emb is not None:
            if cu_seqlens is not None:
                pos = _positions_in_sequence(cu_seqlens, x.shape[0])
                q = self.rotary_emb(q.unsqueeze(0), pos).squeeze(0)
                k = self.rotary_emb(k.unsqueeze(0), pos).squeeze(0)
            else:
                pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
                q, k = self.rotary_emb(q, pos), self.rotary_emb(k, pos)
        out = self._attend(q, k, v, cu_seqlens, max_seqlen)
        return self.out_proj(out.flatten(-2))

    def _check_input(self, x, key_padding_mask, cu_seqlens, max_seqlen) -> None:
        embed_dim = self.out_proj.in_features
        packed = cu_seqlens is not None
        want = "(total, embed_dim) with cu_seqlens" if packed else "(batch, seqlen, embed_dim)"
        if not isinstance(x, torch.Tensor) or x.dim() != (2 if packed else 3) or x.shape[-1] != embed_dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be {want} with embed_dim={embed_dim}, got {got}")
        if packed and key_padding_mask is not None:
            raise ValueError("pass key_padding_mask or cu_seqlens, not both")
        if packed and max_seqlen is None:
            raise ValueError("max_seqlen is required with cu_seqlens")
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != tuple(x.shape[:2]):
                raise ValueError(
                    f"key_padding_mask must be bool (batch, seqlen) = {tuple(x.shape[:2])}, got "
                    f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
                )

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_heads_kv={self.num_heads_kv}, head_dim={self.head_dim}, "
            f"causal={self.causal}, rotary_emb_dim={self.rotary_emb.dim if self.rotary_emb else 0}, "
            f"softmax_scale={resolve_scale(self.softmax_scale, self.head_dim):.4g}"
        )
