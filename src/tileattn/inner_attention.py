"""The inner attention modules of ``flash_attn.modules.mha`` (served from ``tileattn.modules``, beside ``MHA``,
which uses them): ``FlashSelfAttention`` / ``FlashCrossAttention``, the attention step on packed ``qkv`` /
``q`` + ``kv``, dense or varlen (or under a FlashMask), through tileattn's kernels; ``SelfAttention`` /
``CrossAttention``, flash_attn's plain-PyTorch attention with the scores materialised. flash_attn 2.8.3's
constructor and forward arguments; bad arguments raise ``tileattn.checks.InvalidArgument``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tileattn.api import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from tileattn.checks import InvalidArgument
from tileattn.masks import flashmask_attention, flashmask_varlen_attention

__all__ = ["CrossAttention", "FlashCrossAttention", "FlashSelfAttention", "SelfAttention"]


class FlashSelfAttention(nn.Module):
    """softmax(QKᵀ·scale)·V on packed ``qkv``, through tileattn's kernels.

    Args:
        causal: causal mask (aligned bottom-right); ``forward(causal=...)`` overrides it.
        softmax_scale: scale of QKᵀ; default ``1 / sqrt(headdim)``.
        attention_dropout: dropout probability on the attention weights (training only); ``self.drop.p``.
        window_size: ``(left, right)`` sliding window, -1 for unbounded.
        alibi_slopes: optional fp32 ``(nheads,)`` or ``(batch, nheads)``, a non-persistent buffer.
        deterministic: deterministic backward.
    """

    def __init__(
        self,
        causal=False,
        softmax_scale=None,
        attention_dropout=0.0,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
    ):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.window_size = window_size
        self.deterministic = deterministic

    def _options(self, causal) -> dict:
        if self.alibi_slopes is not None and self.alibi_slopes.dtype != torch.float32:
            self.alibi_slopes = self.alibi_slopes.to(torch.float32)  # (module.to(dtype) converted the buffer)
        return dict(
            dropout_p=self.drop.p if self.training else 0.0,
            softmax_scale=self.softmax_scale,
            causal=self.causal if causal is None else causal,
            window_size=self.window_size,
            alibi_slopes=self.alibi_slopes,
            deterministic=self.deterministic,
        )

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None, *, startend_row_indices=None):
        """Args:
            qkv: ``(batch, seqlen, 3, nheads, headdim)``, or ``(total, 3, nheads, headdim)`` with
                cu_seqlens; float16 or bfloat16 (float32 on CPU too).
            causal: overrides ``self.causal`` if not None.
            cu_seqlens: int32 ``(batch + 1,)``: the sequences of a packed qkv.
            max_seqlen: the longest sequence (an int; needed with cu_seqlens).
            startend_row_indices: a FlashMask (``tileattn.masks``; tileattn's own): int32 ``(batch, 1 or
                nheads, seqlen, C)``, or ``(1 or nheads, total, C)`` with cu_seqlens; the call then runs
                ``flashmask_attention`` (or its varlen form), without ALiBi.

        Returns:
            ``(batch, seqlen, nheads, headdim)``, or ``(total, nheads, headdim)`` with cu_seqlens.
        """
        options = self._options(causal)
        if cu_seqlens is not None and max_seqlen is None:
            raise InvalidArgument("FlashSelfAttention: max_seqlen is needed with cu_seqlens")
        if startend_row_indices is not None:
            q, k, v = qkv.unbind(-3)
            return _flashmask(q, k, v, startend_row_indices, options, cu_seqlens, max_seqlen, cu_seqlens, max_seqlen)
        if cu_seqlens is not None:
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **options)
        return flash_attn_qkvpacked_func(qkv, **options)


class FlashCrossAttention(FlashSelfAttention):
    """softmax(QKᵀ·scale)·V of ``q`` over packed ``kv``, through tileattn's kernels. Arguments as
    ``FlashSelfAttention``'s (flash_attn's order: alibi_slopes before window_size)."""

    def __init__(
        self,
        causal=False,
        softmax_scale=None,
        attention_dropout=0.0,
        alibi_slopes=None,
        window_size=(-1, -1),
        deterministic=False,
    ):
        super().__init__(causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(
        self,
        q,
        kv,
        causal=None,
        cu_seqlens=None,
        max_seqlen=None,
        cu_seqlens_k=None,
        max_seqlen_k=None,
        *,
        startend_row_indices=None,
    ):
        """Args:
            q: ``(batch, seqlen_q, nheads, headdim)``, or ``(total_q, nheads, headdim)`` with cu_seqlens.
            kv: ``(batch, seqlen_k, 2, nheads_k, headdim)``, or ``(total_k, 2, nheads_k, headdim)`` with
                cu_seqlens_k (``nheads % nheads_k == 0``).
            causal: overrides ``self.causal`` if not None.
            cu_seqlens, max_seqlen: int32 ``(batch + 1,)`` and the longest sequence of a packed q.
            cu_seqlens_k, max_seqlen_k: the same for a packed kv (needed with cu_seqlens).
            startend_row_indices: a FlashMask, as in ``FlashSelfAttention`` (over kv's keys).

        Returns:
            ``(batch, seqlen_q, nheads, headdim)``, or ``(total_q, nheads, headdim)`` with cu_seqlens.
        """
        options = self._options(causal)
        if cu_seqlens is not None:
            if max_seqlen is None or cu_seqlens_k is None or max_seqlen_k is None:
                raise InvalidArgument(
                    "FlashCrossAttention: a packed call needs cu_seqlens, max_seqlen, cu_seqlens_k and max_seqlen_k"
                )
        if startend_row_indices is not None:
            k, v = kv.unbind(-3)
            return _flashmask(
                q, k, v, startend_row_indices, options, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k
            )
        if cu_seqlens is not None:
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **options)
        return flash_attn_kvpacked_func(q, kv, **options)


def _flashmask(q, k, v, startend_row_indices, options, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k):
    """The inner attentions' FlashMask call (dense, or packed with cu_seqlens)."""
    if options.pop("alibi_slopes") is not None:
        raise InvalidArgument("a FlashMask (startend_row_indices) does not combine with ALiBi")
    if cu_seqlens is not None:
        return flashmask_varlen_attention(
            q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, startend_row_indices, **options
        )
    return flashmask_attention(q, k, v, startend_row_indices, **options)


def _eager_attention(q, k, v, softmax_scale, causal_mask, key_padding_mask, drop) -> Tensor:
    """flash_attn's plain-PyTorch attention: q ``(batch, seqlen_q, nheads, headdim)``, k, v ``(batch,
    seqlen_k, nheads, headdim)``; masked scores get -10000 (as flash_attn), the softmax runs in v's dtype."""
    scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])  # (flash_attn's `or`: a scale of 0 means the default)
    scores = torch.einsum("bthd,bshd->bhts", q, k * scale)  # (batch, nheads, seqlen_q, seqlen_k)
    if key_padding_mask is not None:
        padding = torch.full(key_padding_mask.shape, -10000.0, dtype=scores.dtype, device=scores.device)
        scores = scores + padding.masked_fill(key_padding_mask, 0.0)[:, None, None, :]
    if causal_mask is not None:
        scores = scores.masked_fill(causal_mask, -10000.0)
    attention = drop(torch.softmax(scores, dim=-1, dtype=v.dtype))
    return torch.einsum("bhts,bshd->bthd", attention, v)


class SelfAttention(nn.Module):
    """flash_attn's plain-PyTorch self-attention (the scores materialised; ``MHA``'s inner attention when
    ``use_flash_attn=False``). ``causal``, ``softmax_scale`` (default ``1 / sqrt(headdim)``) and
    ``attention_dropout`` (on the attention weights, ``self.drop``) as in ``FlashSelfAttention``."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None):
        """Args:
            qkv: ``(batch, seqlen, 3, nheads, headdim)``, any float dtype and device.
            causal: overrides ``self.causal`` if not None.
            key_padding_mask: bool ``(batch, seqlen)``, True for the keys to keep.

        Returns:
            ``(batch, seqlen, nheads, headdim)``.
        """
        seqlen = qkv.shape[1]
        causal = self.causal if causal is None else causal
        q, k, v = qkv.unbind(dim=2)
        mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=qkv.device).triu(1) if causal else None
        return _eager_attention(q, k, v, self.softmax_scale, mask, key_padding_mask, self.drop)


class CrossAttention(nn.Module):
    """flash_attn's plain-PyTorch attention of ``q`` over packed ``kv`` (MQA/GQA by repeating kv heads);
    arguments as ``SelfAttention``'s."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        """Args:
            q: ``(batch, seqlen_q, nheads, headdim)``.
            kv: ``(batch, seqlen_k, 2, nheads_k, headdim)``, ``nheads % nheads_k == 0``.
            causal: overrides ``self.causal`` if not None; the mask is aligned bottom-right (query i sees
                keys ``j <= i + seqlen_k - seqlen_q``, seqlen_k counting the kept keys of
                key_padding_mask).
            key_padding_mask: bool ``(batch, seqlen_k)``, True for the keys to keep.

        Returns:
            ``(batch, seqlen_q, nheads, headdim)``.
        """
        batch, seqlen_q = q.shape[:2]
        seqlen_k = kv.shape[1]
        if kv.dim() != 5 or kv.shape[0] != batch or kv.shape[4] != q.shape[3]:
            raise InvalidArgument(
                f"CrossAttention: kv must be (batch, seqlen_k, 2, nheads_k, headdim) = ({batch}, seqlen_k, 2, "
                f"nheads_k, {q.shape[3]}), got {tuple(kv.shape)}"
            )
        causal = self.causal if causal is None else causal
        if kv.shape[3] != q.shape[2]:  # MQA/GQA
            kv = kv.repeat_interleave(q.shape[2] // kv.shape[3], dim=3)
        k, v = kv.unbind(dim=2)
        mask = None
        if causal:
            rows = torch.arange(seqlen_q, device=q.device).view(-1, 1)
            cols = torch.arange(seqlen_k, device=q.device)
            kept = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
            mask = cols > rows + kept - seqlen_q
        return _eager_attention(q, k, v, self.softmax_scale, mask, key_padding_mask, self.drop)
