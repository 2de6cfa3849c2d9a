"""Hugging Face transformers on tileattn: ``attn_implementation="tileattn"``.

Importing this module registers an attention function and a mask function with transformers::

    import tileattn.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tileattn")

Every model family gives what ``attn_implementation="eager"`` gives, or is refused with ``Unsupported``
(a ``NotImplementedError``) naming what tileattn cannot do, when the model is created or first called;
docs/huggingface.md lists the families.

The mask. transformers builds one mask per forward and layer type from a *mask function* (causal,
bidirectional, sliding window, chunked, prefix LM, packed documents...), the 2-D padding mask and the
cache's offsets. Here it becomes a ``TileattnMask`` (``hf_mask``), which the attention reads: causal,
bidirectional and sliding-window masks run ``flash_attn_func`` (nothing padded), ``flash_attn_varlen_func``
(padded batches; packed documents, the ``position_ids`` restarting inside rows, over the flattened rows) or
``flash_attn_with_kvcache`` (a static cache, or under ``torch.compile``: no host sync); any other mask
function (Llama 4's chunks, PaliGemma's prefix, overlays for image tokens...) is evaluated block by block
into a FlashMask, per key column the runs of query rows it hides, O(seq_len) memory, and runs
``flashmask_attention``. A mask that needs more than two runs of hidden rows in a column is refused. A
4-D mask a model builds itself (0 / -inf, or boolean) is converted the same way; an additive bias is
refused.

Refused, with an error naming it: a model that runs its own attention code under the name (checked when
it is created: transformers' own test, the modeling file calling ``ALL_ATTENTION_FUNCTIONS``; and a
``TileattnMask`` used outside this module's attention raises), and every keyword a model passes to the
attention that changes the result and that tileattn does not apply (``position_bias``, per-token
``sinks``, sparse ``indices``...). Attention sinks (``s_aux``, one logit per head) go to tileattn's
``learnable_sink``.

A FlashMask of your own reaches the attention as a keyword of the model's forward, which transformers
hands down to every attention layer: ``model(input_ids, startend_row_indices=idx)`` with ``idx`` int32
``(batch, 1 or heads, seq_len, C)`` from ``tileattn.masks`` runs ``flashmask_attention`` (the model's
causal mask on top) in every layer; nothing may be padded then (hide padded keys in the FlashMask).
The name has no "flash" in it: transformers 5 sends such names to its hub-kernel loader.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from tileattn.api import flash_attn_func, flash_attn_varlen_func
from tileattn.bert_padding import pad_input
from tileattn.integrations.hf_mask import (
    _USE_INSTEAD,
    TileattnMask,
    Unsupported,
    _compiling,
    _mask_4d_flashmask,
    _mask_function_flashmask,
    _require,
    tileattn_mask,
)
from tileattn.kvcache import flash_attn_with_kvcache
from tileattn.masks import flashmask_attention

NAME = "tileattn"
_NAMES: set[str] = set()


# Keywords that reach the attention and do not change its result (or are applied here).
_HARMLESS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "past_key_values",
        "past_key_value",
        "cache",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",
        "seq_idx",
        "layer_idx",
        "token_type_ids",
        "position_embeddings",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "startend_row_indices",
        "deterministic",
    }
)
# Keywords whose meaning is known and that tileattn does not apply: refused by name when set.
_MEANINGS = {
    "position_bias": "an additive attention bias (relative positions, T5-style)",
    "sinks": "attention sinks per query token",
    "indices": "sparse attention indices (top-k keys per query)",
    "block_indices": "sparse attention block indices",
    "head_mask": "a mask over attention heads",
    "layer_head_mask": "a mask over attention heads",
    "alibi": "an ALiBi bias",
    "attention_chunk_size": "chunked attention",
}


# --------------------------------------------------------------------------------------------------
# The attention
# --------------------------------------------------------------------------------------------------


def _target_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype | None:
    """CUDA kernels take fp16/bf16: fp32 activations (e.g. LayerNorms kept in fp32) are cast to the
    autocast dtype or the weights' dtype, and the output cast back. CPU runs fp32 as is."""
    if query.dtype != torch.float32 or not query.is_cuda:
        return None
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    weights = next((p for p in module.parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)
    return weights.dtype if weights is not None else torch.bfloat16


def _check_keywords(module: torch.nn.Module, kwargs: dict) -> None:
    """Refuses every keyword that would change the attention and that tileattn does not apply."""
    for name, value in kwargs.items():
        if name in _HARMLESS or value is None or value is False:
            continue
        if name == "output_attentions":
            raise Unsupported(
                "tileattn: output_attentions=True needs the attention probabilities, which tileattn never forms; "
                "use attn_implementation='eager' to get them"
            )
        meaning = _MEANINGS.get(name, "a keyword tileattn does not know")
        raise Unsupported(
            f"tileattn: {type(module).__name__} passes {name}= to its attention ({meaning}), which tileattn does "
            f"not apply; {_USE_INSTEAD}"
        )


def _cu_seqlens(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens and the longest length of the sequences that start where ``mask`` (flattened) is True."""
    starts = mask.reshape(-1).nonzero().view(-1)
    cu = torch.cat([starts, starts.new_tensor([mask.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, options):
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    return flash_attn_varlen_func(*flat, cu_q, cu_k, max_q, max_k, **options).view(q.shape)


def _padded(q, k, v, padding, last_slots, options, derived: dict | None = None):
    """Padded rows as varlen: the keys of each row are its unpadded slots; the queries are the row's last
    ``q_len`` slots, unpadded alike (``last_slots``: self-attention where the mask depends on positions,
    causal or windowed), or every query row (bidirectional without a window, cross-attention: the
    queries are not the keys). ``derived``: where the unpadding of this mask is kept for the other layers
    (the mask's own ``derived``), so that a forward reads the padding's positions on the host once."""
    batch, q_len = q.shape[:2]
    slots = _unpadding(padding, q_len, last_slots, q.device, derived)
    (k_idx, cu_k, max_k), queries = slots
    k_flat = k.reshape(-1, *k.shape[2:])[k_idx]
    v_flat = v.reshape(-1, *v.shape[2:])[k_idx]
    if queries is not None:
        q_idx, cu_q, max_q = queries
        q_flat = q.reshape(-1, *q.shape[2:])[q_idx]
    else:
        q_flat, q_idx = q.reshape(-1, *q.shape[2:]), None
        cu_q, max_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device), q_len
    out = flash_attn_varlen_func(q_flat, k_flat, v_flat, cu_q, cu_k, max_q, max_k, **options)
    return out.view(batch, q_len, *out.shape[1:]) if q_idx is None else pad_input(out, q_idx, batch, q_len)


def _unpadding(padding, q_len: int, last_slots: bool, device, derived: dict | None):
    """``((k_indices, cu_seqlens_k, max_seqlen_k), (q_indices, cu_seqlens_q, max_seqlen_q) or None)`` of a
    padding mask (``bert_padding.unpad_input``'s), made once per mask where ``derived`` keeps it."""
    key = ("unpadding", q_len, last_slots)
    if derived is not None and key in derived:
        return derived[key]
    lengths = padding.sum(-1, dtype=torch.int32)
    k_idx = torch.nonzero(padding.flatten(), as_tuple=False).flatten()
    cu_k = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    keys = (k_idx, cu_k, int(lengths.max()) if lengths.numel() else 0)
    queries = None
    if last_slots:
        q_pad = padding[:, -q_len:]
        q_lengths = q_pad.sum(-1, dtype=torch.int32)
        q_idx = torch.nonzero(q_pad.flatten(), as_tuple=False).flatten()
        cu_q = torch.nn.functional.pad(torch.cumsum(q_lengths, 0, dtype=torch.int32), (1, 0))
        queries = (q_idx, cu_q, int(q_lengths.max()) if q_lengths.numel() else 0)
    slots = (keys, queries)
    if derived is not None:
        derived[key] = slots
    return slots


def _key_runs(m: TileattnMask, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(first, end, one_run)`` of each row's key slots (``m.padding`` set): the first and one past the
    last slot holding a token, and whether the tokens are one run of slots (no padding between them)."""
    if "key_runs" not in m.derived:
        p, kv = m.padding, m.kv_length
        first = (p.cumsum(-1) == 0).sum(-1).to(torch.int32)
        end = kv - (p.flip(-1).cumsum(-1) == 0).sum(-1).to(torch.int32)
        slot = torch.arange(kv, device=device)
        one_run = (p == ((slot >= first[:, None]) & (slot < end[:, None]))).all()
        m.derived["key_runs"] = (first, end, one_run)
    return m.derived["key_runs"]


def _key_range(m: TileattnMask, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(cache_seqlens, cache_leftpad)`` of the mask for ``flash_attn_with_kvcache``: each row's keys must
    be one run of slots ``[leftpad, seqlens)`` (left padding, a static cache's unwritten slots after),
    and, causal, the last query sits at slot ``seqlens - 1``. Checked once per forward."""
    if "key_range" not in m.derived:
        batch, kv = m.batch_size, m.kv_length
        leftpad = None
        if m.causal:
            end = m.q_offset + m.q_length - m.kv_offset
            if isinstance(end, torch.Tensor):
                end = end.to(device=device, dtype=torch.int32)
            else:
                end = torch.tensor(end, dtype=torch.int32, device=device)
            seqlens = end.reshape(1).expand(batch)
        else:
            seqlens = torch.full((batch,), kv, dtype=torch.int32, device=device)
        if m.padding is not None:
            leftpad, high, one_run = _key_runs(m, device)
            # (causal: slots after the row's last token hold padding, seen only by padded queries)
            _require(
                one_run,
                "a padding mask with holes (padding between tokens) under torch.compile or CUDA graph capture "
                "(which needs the keys of each row in one run): pad on the left",
            )
            if not m.causal:
                seqlens = high
        m.derived["key_range"] = (seqlens.contiguous(), leftpad)
    return m.derived["key_range"]


def _attend_mask(m: TileattnMask, q, k, v, options, kwargs):
    """Attention under a ``TileattnMask`` (the routes are in the module's docstring)."""
    batch, q_len = q.shape[:2]
    if m.q_length != q_len or m.kv_length != k.shape[1] or m.batch_size != batch:
        raise Unsupported(
            f"tileattn: the mask was built for {m.batch_size} rows of {m.q_length} queries and {m.kv_length} keys, "
            f"but the attention gets {batch} x {q_len} queries and {k.shape[1]} keys; {_USE_INSTEAD}"
        )
    device = q.device
    compiling = _compiling(device)
    cu_given = kwargs.get("cu_seq_lens_q") is not None
    if cu_given or m.documents is not None:
        if m.general or m.padding is not None or not m.aligned:
            raise Unsupported("tileattn: packed sequences (cu_seq_lens or position_ids) with padding or a cache")
        options = {**options, "causal": m.causal, "window_size": m.window_size()}
        if cu_given:
            cu_q, cu_k = (kwargs[n].to(torch.int32) for n in ("cu_seq_lens_q", "cu_seq_lens_k"))
            max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
        else:
            if "documents" not in m.derived:
                ids = m.documents
                start = torch.ones_like(ids, dtype=torch.bool)
                start[:, 1:] = ids[:, 1:] != ids[:, :-1]
                m.derived["documents"] = _cu_seqlens(start)
            cu_q, max_q = m.derived["documents"]
            cu_k, max_k = cu_q, max_q
        return _varlen(q, k, v, cu_q, cu_k, max_q, max_k, options)
    if kwargs.get("startend_row_indices") is not None:
        if m.general or m.padding is not None or not (m.aligned or not m.causal):
            raise Unsupported(
                "tileattn: startend_row_indices (a FlashMask) with a padding mask, a cache or another mask: hide "
                "padded keys in the FlashMask and pass attention_mask=None"
            )
        if options["softcap"]:
            raise Unsupported("tileattn: softcap is not supported with a FlashMask (startend_row_indices)")
        options = {key: value for key, value in options.items() if key != "softcap"}
        return flashmask_attention(
            q, k, v, kwargs["startend_row_indices"], causal=m.causal, window_size=m.window_size(), **options
        )
    sink = options.get("learnable_sink")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink))
    if not m.general:
        options = {**options, "causal": m.causal, "window_size": m.window_size()}
        windowed = m.window is not None
        # the mask depends on where queries and keys sit (causal, windows): the last query must be the last key
        placed = m.aligned or not (m.causal or windowed)
        if m.padding is None and placed:
            return flash_attn_func(q, k, v, **options)
        # (unpadding closes holes between tokens, which would move keys into a window)
        if not compiling and placed and (not windowed or bool(_key_runs(m, device)[2])):
            return _padded(q, k, v, m.padding, m.causal or windowed, options, m.derived)
        # (a hole between tokens: a FlashMask below where the host may read, refused where it may not)
        one_run = compiling or m.padding is None or bool(_key_runs(m, device)[2])
        if not needs_grad and options["dropout_p"] == 0.0 and (m.causal or not windowed) and one_run:
            seqlens, leftpad = _key_range(m, device)
            kept = ("softmax_scale", "causal", "window_size", "softcap", "learnable_sink")
            kv_options = {n: options[n] for n in kept if n in options}
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad, **kv_options)
    # any other mask, and training where the fast paths do not apply: the mask as a FlashMask
    if options.pop("softcap"):
        raise Unsupported(f"tileattn: softcap with this attention mask ({m!r}), which runs as a FlashMask")
    options = {key: value for key, value in options.items() if key not in ("causal", "window_size")}
    return flashmask_attention(q, k, v, _mask_function_flashmask(m, device), causal=False, **options)


def tileattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: TileattnMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query (batch, heads, q_len, d)``, key/value
    ``(batch, kv_heads, kv_len, d)``; returns ``((batch, q_len, heads, d), None)``.

    ``attention_mask``: a ``TileattnMask`` (this module's mask function; the mask decides causality and
    windows, as in eager attention), None (``is_causal`` or ``module.is_causal``, ``sliding_window``,
    and ``cu_seq_lens_*`` from a flattening collator, as transformers' FlashAttention path reads them), a
    2-D padding mask, or a 4-D mask a model built itself (boolean or 0 / -inf). ``s_aux``: attention sinks,
    one logit per query head (fp32 ``learnable_sink``)."""
    _check_keywords(module, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    dtype = q.dtype
    target = _target_dtype(q, module)
    if target is not None:
        q, k, v = q.to(target), k.to(target), v.to(target)
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: pad V to the query head dim, crop the output
        v = torch.nn.functional.pad(v, [0, head_dim - v_head_dim])
    options = dict(
        dropout_p=dropout if module.training else 0.0,
        softmax_scale=scaling,
        softcap=softcap or 0.0,
    )
    if s_aux is not None:  # attention sinks, one logit per query head: fp32, with its gradient
        options["learnable_sink"] = s_aux.float()
    if kwargs.get("deterministic"):
        options["deterministic"] = True
    if isinstance(attention_mask, TileattnMask):
        out = _attend_mask(attention_mask, q, k, v, options, kwargs)
    else:
        out = _attend_other(module, q, k, v, attention_mask, options, sliding_window, is_causal, kwargs)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out.to(dtype), None


def _attend_other(module, q, k, v, attention_mask, options, sliding_window, is_causal, kwargs):
    """Attention without a ``TileattnMask``: None, a 2-D padding mask or a 4-D mask."""
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal)
    if attention_mask is not None and attention_mask.dim() == 4:
        if options.pop("softcap") or kwargs.get("startend_row_indices") is not None:
            raise Unsupported("tileattn: a 4-D attention mask with softcap or startend_row_indices")
        return flashmask_attention(q, k, v, _mask_4d_flashmask(attention_mask, q, k), causal=False, **options)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise Unsupported(f"tileattn: an attention mask of {attention_mask.dim()} dimensions; {_USE_INSTEAD}")
    options = {**options, "causal": causal}
    if sliding_window is not None and k.shape[1] > sliding_window:
        options["window_size"] = (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)
    if kwargs.get("startend_row_indices") is not None:
        if attention_mask is not None or options.pop("softcap"):
            raise Unsupported(
                "tileattn: startend_row_indices (a FlashMask) with a padding mask or a softcap: hide padded keys in "
                "the FlashMask and pass attention_mask=None"
            )
        return flashmask_attention(q, k, v, kwargs["startend_row_indices"], **options)
    if attention_mask is not None:
        padding = attention_mask.to(torch.bool)
        windowed = "window_size" in options
        runs = padding[:, 0].int() + (padding[:, 1:] & ~padding[:, :-1]).sum(-1)  # runs of tokens per row
        if windowed and bool((runs > 1).any()):
            raise Unsupported("tileattn: a 2-D padding mask with holes (padding between tokens) and a sliding window")
        return _padded(q, k, v, padding, causal or windowed, options)
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q, cu_k = (kwargs[n].to(torch.int32) for n in ("cu_seq_lens_q", "cu_seq_lens_k"))
        return _varlen(q, k, v, cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), options)
    return flash_attn_func(q, k, v, **options)


# --------------------------------------------------------------------------------------------------
# Registration, and the check of a model when it is created
# --------------------------------------------------------------------------------------------------


def check_model(cls: type) -> None:
    """Refuses a model class that runs its own attention code rather than transformers' attention
    interface (transformers' own test: its modeling file defines attention modules and never calls
    ``ALL_ATTENTION_FUNCTIONS.get_interface``), so that ``attn_implementation="tileattn"`` would not
    reach tileattn, and the masks built for it would reach code that does not expect them."""
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise Unsupported(
            f"tileattn: {cls.__name__} computes attention with its own code, not through transformers' attention "
            f"interface, so attn_implementation='tileattn' cannot run it; {_USE_INSTEAD}"
        )


_original_check = PreTrainedModel._check_and_adjust_attn_implementation


def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
    result = _original_check(self, attn_implementation, *args, **kwargs)
    if result in _NAMES:
        check_model(type(self))
    return result


def register(name: str = NAME) -> None:
    """Registers the attention function and the mask function under ``name`` (done on import), and the
    check that refuses, when it is created with that name, a model that does not use the attention
    interface."""
    AttentionInterface.register(name, tileattn_attention_forward)
    AttentionMaskInterface.register(name, tileattn_mask)
    _NAMES.add(name)
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


register()
