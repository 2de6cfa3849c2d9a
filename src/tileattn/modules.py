"""Attention layers: ``flash_attn.modules.mha`` (flash_attn 2.8.3's names, constructor and forward
arguments, attribute and weight names, so that code and state dicts carry over), on tileattn.

- ``FlashSelfAttention`` / ``FlashCrossAttention``: the attention step on packed ``qkv`` / ``q`` + ``kv``,
  dense or varlen, through tileattn's kernels; ``SelfAttention`` / ``CrossAttention``: flash_attn's
  plain-PyTorch attention (scores materialised), which ``MHA`` uses when ``use_flash_attn=False``
  (flash_attn's default). Defined in ``tileattn.inner_attention``, served from here.
- ``MHA``: projections (fused QKV, or Wq + Wkv for cross attention), MQA/GQA, rotary (RoPE, xPos),
  ALiBi, sliding windows, generation against a KV cache (``InferenceParams``), ``return_residual``,
  activation checkpointing.
- ``InferenceParams``: ``flash_attn.utils.generation.InferenceParams``; ``get_alibi_slopes``.

Beyond flash_attn (where it asserts or crashes), and never changing a result flash_attn computes: bad
arguments raise ``tileattn.checks.InvalidArgument`` (a ValueError) naming them; the flash modules accept
CPU tensors and float32 on CPU; with ``use_flash_attn=True``, ``MHA`` takes a ``key_padding_mask`` (the
batch runs packed, varlen: padded tokens cost no attention and their outputs are 0) and applies rotary
to packed (``cu_seqlens``) inputs; MQA/GQA self-attention takes ``cu_seqlens``; ``dwconv`` works with
MQA/GQA and cross attention; generation with xPos, sliding windows or ``batch_size_offset`` uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from tileattn.api import resolve_scale
from tileattn.bert_padding import index_first_axis, pad_input
from tileattn.checks import InvalidArgument
from tileattn.inner_attention import CrossAttention, FlashCrossAttention, FlashSelfAttention, SelfAttention
from tileattn.kvcache import flash_attn_with_kvcache
from tileattn.rotary import RotaryEmbedding, apply_rotary_emb

__all__ = [
    "CrossAttention",
    "FlashCrossAttention",
    "FlashSelfAttention",
    "InferenceParams",
    "MHA",
    "SelfAttention",
    "get_alibi_slopes",
]


def get_alibi_slopes(nheads: int) -> list[float]:
    """ALiBi's head slopes (Press et al., https://arxiv.org/abs/2108.12409), as flash_attn computes them:
    for a power of two n, ``2 ** (-8 (h + 1) / n)`` for head h; otherwise those of the power of two below,
    then every other slope of the power of two above."""

    def power_of_2(n: int) -> list[float]:
        ratio = 2 ** (-(2 ** -(math.log2(n) - 3)))  # 2 ** (-8 / n)
        return [ratio ** (h + 1) for h in range(n)]

    if math.log2(nheads).is_integer():
        return power_of_2(nheads)
    below = 2 ** math.floor(math.log2(nheads))
    return power_of_2(below) + get_alibi_slopes(2 * below)[0::2][: nheads - below]


@dataclass
class InferenceParams:
    """Generation state passed to every layer (``flash_attn.utils.generation.InferenceParams``).

    Fields:
        max_seqlen: capacity of the KV caches (and of the rotary tables).
        max_batch_size: rows of the KV caches.
        seqlen_offset: tokens already in the caches (0 for the prompt).
        batch_size_offset: first cache row of this batch.
        key_value_memory_dict: ``layer_idx -> (max_batch_size, max_seqlen, 2, nheads_kv, headdim)`` cache,
            allocated by the layers on first use (or by ``MHA.allocate_inference_cache``).
        lengths_per_sample: optional int32 ``(batch,)``, tokens in each sequence's cache (then rotary
            positions and, with ``use_flash_attn``, the cache lengths come from it).
    """

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Tensor | None = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


def _causal_dwconv(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """flash_attn's depthwise convolution over time: ``x (batch, seqlen, channels)``, each output step
    from the kernel's 3 steps up to it."""
    return conv(x.transpose(1, 2))[..., :-2].transpose(1, 2).contiguous()


class MHA(nn.Module):
    """Multi-head self-attention and cross-attention (``flash_attn.modules.mha.MHA``).

    Args:
        embed_dim, num_heads: model width and query heads (head dim = embed_dim / num_heads).
        num_heads_kv: key/value heads (MQA/GQA); default num_heads.
        cross_attn: queries from x (``Wq``), keys and values from ``x_kv`` (``Wkv``).
        qkv_proj_bias, out_proj_bias: biases of the projections.
        dropout: attention dropout (training only).
        softmax_scale: scale of QKᵀ; default ``1 / sqrt(head dim)``.
        causal: causal attention (aligned bottom-right).
        layer_idx: this layer's key in ``InferenceParams.key_value_memory_dict`` (needed for generation).
        dwconv: a depthwise causal convolution (kernel 3) over time after the projections
            (``dwconv_qkv``, or ``dwconv_q`` and ``dwconv_kv``); not with generation or packed inputs.
        rotary_emb_dim: rotate the first rotary_emb_dim channels of q and k (0 = off; even, at most the
            head dim; self-attention only), with ``rotary_emb_base``, xPos scaling when
            ``rotary_emb_scale_base`` is set, GPT-J pairs when ``rotary_emb_interleaved``.
        use_alibi: ALiBi with ``get_alibi_slopes(num_heads)`` (needs use_flash_attn).
        window_size: ``(left, right)`` sliding window, -1 for unbounded (needs use_flash_attn).
        fused_bias_fc: accepted and ignored, as flash_attn 2.8.3 ignores it (the projections are
            ``nn.Linear``, which is what its fused kernel computed).
        use_flash_attn: run the attention through tileattn's kernels (``FlashSelfAttention`` /
            ``FlashCrossAttention``); False (flash_attn's default) runs flash_attn's plain-PyTorch
            ``SelfAttention`` / ``CrossAttention``, which materialise the scores.
        return_residual: ``forward`` returns ``(out, x)``.
        checkpointing: recompute the attention in the backward (``torch.utils.checkpoint``).
        device, dtype: of the parameters.
        deterministic: (keyword only, tileattn) deterministic backward of the flash attention.

    Submodules, as flash_attn names them: ``Wqkv`` (or ``Wq``, ``Wkv``), ``dwconv_*``, ``rotary_emb``,
    ``inner_attn``, ``inner_cross_attn``, ``out_proj``.
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        num_heads_kv=None,
        cross_attn=False,
        qkv_proj_bias=True,
        out_proj_bias=True,
        dropout=0.0,
        softmax_scale=None,
        causal=False,
        layer_idx=None,
        dwconv=False,
        rotary_emb_dim=0,
        rotary_emb_base=10000.0,
        rotary_emb_scale_base=None,
        rotary_emb_interleaved=False,
        use_alibi=False,
        window_size=(-1, -1),
        fused_bias_fc=False,
        use_flash_attn=False,
        return_residual=False,
        checkpointing=False,
        device=None,
        dtype=None,
        *,
        deterministic=False,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.dwconv = dwconv
        self.rotary_emb_dim = rotary_emb_dim
        self.use_flash_attn = use_flash_attn
        self.return_residual = return_residual
        self.checkpointing = checkpointing
        self.deterministic = deterministic
        if embed_dim % num_heads:
            raise InvalidArgument(f"MHA: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if self.num_heads_kv < 1 or num_heads % self.num_heads_kv:
            raise InvalidArgument(
                f"MHA: num_heads ({num_heads}) must be divisible by num_heads_kv ({self.num_heads_kv})"
            )
        self.head_dim = embed_dim // num_heads
        if use_alibi and not use_flash_attn:
            raise InvalidArgument("MHA: use_alibi needs use_flash_attn=True (as in flash_attn)")
        if tuple(window_size) != (-1, -1) and not use_flash_attn:
            raise InvalidArgument("MHA: a window_size other than (-1, -1) needs use_flash_attn=True (as in flash_attn)")
        if rotary_emb_dim:
            if rotary_emb_dim < 0 or rotary_emb_dim % 2 or rotary_emb_dim > self.head_dim:
                raise InvalidArgument(
                    f"MHA: rotary_emb_dim must be even and at most the head dim ({self.head_dim}), got {rotary_emb_dim}"
                )
            if cross_attn:
                raise InvalidArgument("MHA: rotary_emb_dim > 0 is not supported with cross_attn (as in flash_attn)")
            self.rotary_emb = RotaryEmbedding(
                rotary_emb_dim,
                base=rotary_emb_base,
                scale_base=rotary_emb_scale_base,
                interleaved=rotary_emb_interleaved,
                device=device,
            )
        alibi_slopes = torch.tensor(get_alibi_slopes(num_heads), device=device) if use_alibi else None
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        kv_dim = 2 * self.head_dim * self.num_heads_kv

        if use_flash_attn:
            inner_attn_cls = partial(
                FlashSelfAttention, alibi_slopes=alibi_slopes, window_size=window_size, deterministic=deterministic
            )
            inner_cross_attn_cls = partial(
                FlashCrossAttention, alibi_slopes=alibi_slopes, window_size=window_size, deterministic=deterministic
            )
        else:
            inner_attn_cls, inner_cross_attn_cls = SelfAttention, CrossAttention
        if not self.cross_attn:
            self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory_kwargs)
        else:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory_kwargs)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory_kwargs)
        if self.dwconv:  # (flash_attn makes dwconv_qkv for cross_attn too, which its forward then lacks)
            if self.num_heads_kv == self.num_heads and not self.cross_attn:
                self.dwconv_qkv = nn.Conv1d(
                    qkv_dim, qkv_dim, kernel_size=3, padding=2, groups=qkv_dim, **factory_kwargs
                )
            else:
                self.dwconv_q = nn.Conv1d(
                    embed_dim, embed_dim, kernel_size=3, padding=2, groups=embed_dim, **factory_kwargs
                )
                self.dwconv_kv = nn.Conv1d(kv_dim, kv_dim, kernel_size=3, padding=2, groups=kv_dim, **factory_kwargs)
        self.inner_attn = inner_attn_cls(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.inner_cross_attn = inner_cross_attn_cls(
            causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout
        )
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory_kwargs)

    # ---------------------------------------------------------------------------------------------
    # generation
    # ---------------------------------------------------------------------------------------------

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None) -> Tensor:
        """An empty KV cache ``(batch_size, max_seqlen, 2, num_heads_kv, head_dim)`` on the layer's device,
        of the layer's dtype unless ``dtype`` is given."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        device = self.out_proj.weight.device
        return torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, dtype=dtype, device=device)

    def _cache(self, kv: Tensor, inference_params: InferenceParams) -> Tensor:
        """This layer's cache rows of the batch (allocated on first use)."""
        memory = inference_params.key_value_memory_dict
        if self.layer_idx not in memory:
            memory[self.layer_idx] = torch.empty(
                inference_params.max_batch_size,
                inference_params.max_seqlen,
                2,
                self.num_heads_kv,
                self.head_dim,
                dtype=kv.dtype,
                device=kv.device,
            )
        cache = memory[self.layer_idx]
        start = inference_params.batch_size_offset
        if start + kv.shape[0] > cache.shape[0]:
            raise InvalidArgument(
                f"MHA: batch rows {start}..{start + kv.shape[0] - 1} do not fit the KV cache of layer {self.layer_idx} "
                f"({cache.shape[0]} rows, InferenceParams.max_batch_size)"
            )
        return cache[start : start + kv.shape[0]]

    def _update_kv_cache(self, kv: Tensor, inference_params: InferenceParams) -> Tensor:
        """Writes ``kv (batch, seqlen, 2, nheads_kv, head_dim)`` at ``seqlen_offset`` of the cache; returns
        the cache up to its end, ``(batch, seqlen_offset + seqlen, 2, nheads_kv, head_dim)``."""
        cache = self._cache(kv, inference_params)
        start = inference_params.seqlen_offset
        end = start + kv.shape[1]
        if end > cache.shape[1]:
            raise InvalidArgument(
                f"MHA: positions {start}..{end - 1} do not fit the KV cache of layer {self.layer_idx} "
                f"({cache.shape[1]} positions, InferenceParams.max_seqlen)"
            )
        cache[:, start:end] = kv
        return cache[:, :end]

    def _cache_seqlens(self, batch: int, inference_params: InferenceParams) -> int | Tensor:
        lengths = inference_params.lengths_per_sample
        if lengths is None:
            return inference_params.seqlen_offset
        start = inference_params.batch_size_offset
        return lengths[start : start + batch]

    def _alibi_slopes(self) -> Tensor | None:
        slopes = getattr(self.inner_cross_attn, "alibi_slopes", None)
        return slopes.to(torch.float32) if slopes is not None else None

    def _kvcache_attention(self, q, kv, inference_params, rotary: bool):
        """The cache append and the attention in one ``flash_attn_with_kvcache`` call, with the rotary of q
        and the new keys if ``rotary``: q ``(batch, seqlen_q, nheads, head_dim)``, kv ``(batch, seqlen_k, 2,
        nheads_kv, head_dim)``."""
        rotary_cos = rotary_sin = None
        if rotary:
            self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen, device=q.device, dtype=q.dtype)
            rotary_cos, rotary_sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        cache = self._cache(kv, inference_params)
        return flash_attn_with_kvcache(
            q,
            cache[:, :, 0],
            cache[:, :, 1],
            kv[:, :, 0],
            kv[:, :, 1],
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            cache_seqlens=self._cache_seqlens(q.shape[0], inference_params),
            softmax_scale=self.inner_cross_attn.softmax_scale,
            causal=self.inner_cross_attn.causal,
            window_size=self.inner_cross_attn.window_size,
            rotary_interleaved=self.rotary_emb.interleaved if rotary else False,
            alibi_slopes=self._alibi_slopes(),
        )

    def _update_kvcache_attention(self, q, kv, inference_params):
        """Writes kv (rotated already) to the cache, then attends over it."""
        if inference_params.seqlen_offset == 0 or not self.use_flash_attn:
            # (as flash_attn: this path places the new tokens at seqlen_offset, not lengths_per_sample)
            kv = self._update_kv_cache(kv, inference_params)
            return self.inner_cross_attn(q, kv)
        return self._kvcache_attention(q, kv, inference_params, rotary=False)

    # ---------------------------------------------------------------------------------------------
    # forward
    # ---------------------------------------------------------------------------------------------

    def _check_forward(self, x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, mixer_subset, inference_params):
        packed = cu_seqlens is not None
        want = "(total, embed_dim) with cu_seqlens" if packed else "(batch, seqlen, embed_dim)"
        if not isinstance(x, Tensor) or x.dim() != (2 if packed else 3) or x.shape[-1] != self.embed_dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InvalidArgument(f"MHA: x must be {want} with embed_dim={self.embed_dim}, got {got}")
        if not self.cross_attn and (x_kv is not None or mixer_subset is not None):
            raise InvalidArgument("MHA: x_kv and mixer_subset are for cross attention (cross_attn=True)")
        if x_kv is not None and (not isinstance(x_kv, Tensor) or x_kv.shape[-1] != self.embed_dim):
            got = tuple(x_kv.shape) if isinstance(x_kv, Tensor) else type(x_kv).__name__
            raise InvalidArgument(f"MHA: x_kv must be (batch, seqlen_kv, embed_dim={self.embed_dim}), got {got}")
        if packed:
            if max_seqlen is None:
                raise InvalidArgument("MHA: max_seqlen is required with cu_seqlens")
            if key_padding_mask is not None:
                raise InvalidArgument("MHA: pass key_padding_mask or cu_seqlens, not both")
            if not self.use_flash_attn:
                raise InvalidArgument("MHA: cu_seqlens needs use_flash_attn=True (as in flash_attn)")
            if self.dwconv:
                raise InvalidArgument("MHA: dwconv does not take packed inputs (cu_seqlens)")
        if key_padding_mask is not None:
            keys = x_kv if x_kv is not None else x
            if max_seqlen is not None:
                raise InvalidArgument("MHA: max_seqlen goes with cu_seqlens, not with key_padding_mask")
            if (
                not isinstance(key_padding_mask, Tensor)
                or key_padding_mask.dtype != torch.bool
                or tuple(key_padding_mask.shape) != tuple(keys.shape[:2])
            ):
                got = (
                    f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
                    if isinstance(key_padding_mask, Tensor)
                    else type(key_padding_mask).__name__
                )
                raise InvalidArgument(
                    f"MHA: key_padding_mask must be bool (batch, seqlen) = {tuple(keys.shape[:2])}, got {got}"
                )
            if self.use_flash_attn and self.cross_attn:
                raise InvalidArgument(
                    "MHA: key_padding_mask with use_flash_attn=True is for self-attention; with cross_attn pass "
                    "packed inputs (cu_seqlens, cu_seqlens_k) or use_flash_attn=False"
                )
        if inference_params is not None:
            if key_padding_mask is not None or packed:
                raise InvalidArgument(
                    "MHA: generation (inference_params) takes neither key_padding_mask nor cu_seqlens"
                )
            if self.dwconv:
                raise InvalidArgument("MHA: generation (inference_params) does not support dwconv (as in flash_attn)")
            if self.layer_idx is None:
                raise InvalidArgument("MHA: generation (inference_params) requires layer_idx in the constructor")

    def _project(self, x, x_kv, mixer_subset):
        """The projections: ``(qkv, None, None)`` with qkv ``(..., 3, nheads, head_dim)`` for self-attention
        with as many kv heads as query heads, else ``(None, q, kv)`` with q ``(..., nheads, head_dim)`` and
        kv ``(..., 2, nheads_kv, head_dim)``."""
        d = self.head_dim
        if not self.cross_attn and self.num_heads_kv == self.num_heads:
            qkv = self.Wqkv(x)
            if self.dwconv:
                qkv = _causal_dwconv(self.dwconv_qkv, qkv)
            return qkv.unflatten(-1, (3, self.num_heads, d)), None, None
        if self.cross_attn:
            q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
            kv = self.Wkv(x_kv if x_kv is not None else x)
        else:
            qkv = self.Wqkv(x)
            q, kv = qkv[..., : self.num_heads * d], qkv[..., self.num_heads * d :]
        if self.dwconv:  # (before the heads are split; flash_attn's order would fail on 4-D tensors)
            q, kv = _causal_dwconv(self.dwconv_q, q), _causal_dwconv(self.dwconv_kv, kv)
        return None, q.unflatten(-1, (self.num_heads, d)), kv.unflatten(-1, (2, self.num_heads_kv, d))

    def _rotate_packed(self, q: Tensor, k: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> None:
        """Rotary of packed q ``(total, nheads, head_dim)`` and k (views), in place; positions count from 0
        in each sequence."""
        rotary = self.rotary_emb
        rotary._update_cos_sin_cache(max_seqlen, device=q.device, dtype=q.dtype)
        xpos = rotary.scale is not None
        cos_k = rotary._cos_k_cached if xpos else rotary._cos_cached
        sin_k = rotary._sin_k_cached if xpos else rotary._sin_cached
        apply_rotary_emb(q, rotary._cos_cached, rotary._sin_cached, rotary.interleaved, True, 0, cu_seqlens, max_seqlen)
        apply_rotary_emb(k, cos_k, sin_k, rotary.interleaved, True, 0, cu_seqlens, max_seqlen)

    def _attend(self, attn, *args, **kwargs):
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(attn, *args, use_reentrant=False, **kwargs)
        return attn(*args, **kwargs)

    def forward(
        self,
        x,
        x_kv=None,
        key_padding_mask=None,
        cu_seqlens=None,
        max_seqlen=None,
        mixer_subset=None,
        inference_params=None,
        **kwargs,
    ):
        """Args:
            x: ``(batch, seqlen, embed_dim)``, or packed ``(total, embed_dim)`` with cu_seqlens.
            x_kv: ``(batch, seqlen_kv, embed_dim)``, the keys' and values' input of cross attention
                (default x).
            key_padding_mask: bool ``(batch, seqlen)`` (of the keys' input), True for real tokens. Without
                use_flash_attn (flash_attn's way) the padded keys are masked in the scores; with
                use_flash_attn (self-attention; tileattn) the batch runs packed, varlen, and padded
                positions output 0.
            cu_seqlens: int32 ``(batch + 1,)``, the sequences of a packed x (needs use_flash_attn; with
                cross attention pass ``cu_seqlens_k`` and ``max_seqlen_k`` for x_kv in kwargs).
            max_seqlen: the longest sequence of a packed x.
            mixer_subset: cross attention only: an index applied to x's sequence axis before the query
                projection (e.g. the CLS token of a ViT's last layer).
            inference_params: ``InferenceParams`` for generation: k and v go into the cache of
                ``layer_idx`` at ``seqlen_offset`` (``lengths_per_sample`` with use_flash_attn once past
                the prompt) and the queries attend over it; rotary positions start at the offset.
            kwargs: passed on to the inner attention (e.g. ``causal``, or ``startend_row_indices``: a FlashMask
                from ``tileattn.masks`` over x's tokens, with use_flash_attn, dense or packed).

        Returns:
            ``out`` of x's shape, or ``(out, x)`` with return_residual. Rotary positions count from 0 in
            each sequence (from the cache offset in generation).
        """
        self._check_forward(x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, mixer_subset, inference_params)
        if kwargs.get("startend_row_indices") is not None and (not self.use_flash_attn or key_padding_mask is not None):
            raise InvalidArgument(
                "MHA: startend_row_indices (a FlashMask) needs use_flash_attn=True and no key_padding_mask (hide "
                "padded keys in the FlashMask itself)"
            )
        if key_padding_mask is not None and self.use_flash_attn:
            out = self._forward_padded(x, key_padding_mask, kwargs)
            return out if not self.return_residual else (out, x)
        if self.use_flash_attn:
            kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **kwargs}
        else:
            kwargs = {"key_padding_mask": key_padding_mask, **kwargs}
        seqlen_offset = 0
        rotary_max_seqlen = None
        if inference_params is not None:
            lengths = inference_params.lengths_per_sample
            seqlen_offset = lengths if lengths is not None else inference_params.seqlen_offset
            rotary_max_seqlen = inference_params.max_seqlen
        qkv, q, kv = self._project(x, x_kv, mixer_subset)
        if qkv is not None:
            q, kv = qkv[..., 0, :, :], qkv[..., 1:, :, :]
        fused = (
            inference_params is not None
            and inference_params.seqlen_offset > 0
            and self.use_flash_attn
            and self.rotary_emb_dim > 0
            and self.rotary_emb_dim % 16 == 0
            and self.rotary_emb.scale is None  # (xPos scales q and k apart: the unfused path)
        )
        if fused:
            context = self._kvcache_attention(q, kv, inference_params, rotary=True)
        else:
            if self.rotary_emb_dim > 0:
                if cu_seqlens is not None:
                    self._rotate_packed(q, kv[:, 0], cu_seqlens, max_seqlen)
                elif qkv is not None:
                    qkv = self.rotary_emb(qkv, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
                    q, kv = qkv[..., 0, :, :], qkv[..., 1:, :, :]
                else:
                    q, kv = self.rotary_emb(q, kv, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
            if inference_params is not None:
                context = self._update_kvcache_attention(q, kv, inference_params)
            elif qkv is not None:
                context = self._attend(self.inner_attn, qkv, **kwargs)
            else:
                if cu_seqlens is not None and not self.cross_attn:  # MQA/GQA self-attention, packed
                    kwargs = {"cu_seqlens_k": cu_seqlens, "max_seqlen_k": max_seqlen, **kwargs}
                context = self._attend(self.inner_cross_attn, q, kv, **kwargs)
        out = self.out_proj(context.flatten(-2))
        return out if not self.return_residual else (out, x)

    def _forward_padded(self, x: Tensor, key_padding_mask: Tensor, kwargs: dict) -> Tensor:
        """Self-attention of a padded batch with the flash kernels: projections and rotary on the padded
        batch (rotary positions are indices in it, as without use_flash_attn), then the real tokens run
        packed (varlen); padded positions output 0."""
        batch, seqlen = x.shape[:2]
        qkv, q, kv = self._project(x, None, None)
        if self.rotary_emb_dim > 0:
            if qkv is not None:
                qkv = self.rotary_emb(qkv)
            else:
                q, kv = self.rotary_emb(q, kv)
        lengths = key_padding_mask.sum(dim=-1, dtype=torch.int32)
        cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
        max_seqlen = int(lengths.max()) if batch else 0
        indices = key_padding_mask.flatten().nonzero().flatten()
        if qkv is not None:
            packed = index_first_axis(qkv.flatten(0, 1), indices)  # (total, 3, nheads, head_dim)
            context = self._attend(self.inner_attn, packed, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kwargs)
        else:
            context = self._attend(
                self.inner_cross_attn,
                index_first_axis(q.flatten(0, 1), indices),
                index_first_axis(kv.flatten(0, 1), indices),
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                cu_seqlens_k=cu_seqlens,
                max_seqlen_k=max_seqlen,
                **kwargs,
            )
        return pad_input(self.out_proj(context.flatten(-2)), indices, batch, seqlen)

    def extra_repr(self) -> str:
        scale = resolve_scale(self.inner_attn.softmax_scale, self.head_dim)
        return (
            f"num_heads={self.num_heads}, num_heads_kv={self.num_heads_kv}, head_dim={self.head_dim}, "
            f"causal={self.causal}, cross_attn={self.cross_attn}, rotary_emb_dim={self.rotary_emb_dim}, "
            f"use_flash_attn={self.use_flash_attn}, softmax_scale={scale:.4g}"
        )
