"""Hugging Face transformers on tileattn: ``attn_implementation="tileattn"``.

Importing this module registers an attention function and its mask format with transformers::

    import tileattn.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tileattn")

Models receive the 2-D padding mask (the format transformers builds for FlashAttention, or None when
nothing is padded). Padded batches run packed through ``flash_attn_varlen_func``; packed sequences
(``position_ids`` restarting at 0 inside one row, or ``cu_seq_lens_q``/``cu_seq_lens_k`` from a
flattening data collator) run varlen too. Causal masks align to the bottom-right corner, so decoding with
a cache (fewer queries than keys) is correct.

A FlashMask reaches the attention as a keyword of the model's forward, which transformers hands down to
every attention layer: ``model(input_ids, startend_row_indices=idx)`` with ``idx`` int32 ``(batch, 1 or
heads, seq_len, C)`` from ``tileattn.masks`` runs ``flashmask_attention`` (the model's causal flag on top)
in every layer, in place of a 4-D mask; the padding mask must then be None (hide padded keys in the
FlashMask itself). The name has no "flash" in it: transformers 5 sends such
names to its hub-kernel loader.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from tileattn.api import flash_attn_func, flash_attn_varlen_func
from tileattn.bert_padding import pad_input, unpad_input
from tileattn.masks import flashmask_attention

NAME = "tileattn"


def _target_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype | None:
    """CUDA kernels take fp16/bf16: fp32 activations (e.g. LayerNorms kept in fp32) are cast to the
    autocast dtype or the weights' dtype, and the output cast back. CPU runs fp32 as is."""
    if query.dtype != torch.float32 or not query.is_cuda:
        return None
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    weights = next((p for p in module.parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)
    return weights.dtype if weights is not None else torch.bfloat16


def _cu_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sequence starts where position_ids restart (a batch of one packed row)."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().view(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def tileattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query (batch, heads, q_len, d)``, key/value
    ``(batch, kv_heads, kv_len, d)``; returns ``((batch, q_len, heads, d), None)``."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"tileattn takes a 2-D padding mask (the FlashAttention format); got a {attention_mask.dim()}-D mask. "
            "Custom 4-D masks need attn_implementation='eager' or 'sdpa'."
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    dtype = q.dtype
    target = _target_dtype(q, module)
    if target is not None:
        q, k, v = q.to(target), k.to(target), v.to(target)
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: pad V to the query head dim, crop the output
        v = torch.nn.functional.pad(v, [0, head_dim - v_head_dim])
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal)
    options = dict(
        dropout_p=dropout if module.training else 0.0,
        softmax_scale=scaling,
        causal=causal,
        softcap=softcap or 0.0,
    )
    if sliding_window is not None and k.shape[1] > sliding_window:
        options["window_size"] = (sliding_window - 1, sliding_window - 1)
    batch, q_len = q.shape[:2]
    position_ids = kwargs.get("position_ids")
    startend_row_indices = kwargs.get("startend_row_indices")
    if startend_row_indices is not None:
        if attention_mask is not None or options["softcap"]:
            raise NotImplementedError(
                "startend_row_indices (a FlashMask) with a padding mask or a softcap: hide padded keys in the "
                "FlashMask and pass attention_mask=None; softcap is not supported with a FlashMask"
            )
        options.pop("softcap")
        out = flashmask_attention(q, k, v, startend_row_indices, **options)
    elif attention_mask is not None:
        q_mask = attention_mask[:, -q_len:]
        q_flat, q_idx, cu_q, max_q, _ = unpad_input(q, q_mask)
        k_flat, k_idx, cu_k, max_k, _ = unpad_input(k, attention_mask)
        v_flat = v.reshape(-1, *v.shape[2:])[k_idx]
        out = flash_attn_varlen_func(q_flat, k_flat, v_flat, cu_q, cu_k, max_q, max_k, **options)
        out = pad_input(out, q_idx, batch, q_len)
    elif kwargs.get("cu_seq_lens_q") is not None:
        out = flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]),
            k.reshape(-1, *k.shape[2:]),
            v.reshape(-1, *v.shape[2:]),
            kwargs["cu_seq_lens_q"].to(torch.int32),
            kwargs["cu_seq_lens_k"].to(torch.int32),
            int(kwargs["max_length_q"]),
            int(kwargs["max_length_k"]),
            **options,
        ).view(batch, q_len, *q.shape[2:])
    elif (
        position_ids is not None
        and batch == 1
        and q_len > 1
        and q_len == k.shape[1]
        and bool((position_ids.reshape(-1)[1:] == 0).any())
    ):
        cu, max_len = _cu_from_position_ids(position_ids)
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max_len, max_len, **options).unsqueeze(0)
    else:
        out = flash_attn_func(q, k, v, **options)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out.to(dtype), None


def register(name: str = NAME) -> None:
    """Registers the attention function and its mask format under ``name`` (done on import)."""
    AttentionInterface.register(name, tileattn_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)


register()
