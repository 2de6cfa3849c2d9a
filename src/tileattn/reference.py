"""The oracle: attention with materialised scores, for tests and for users checking tileattn.

``attention_ref`` follows the conventions of the public API (layout ``(batch, seqlen, nheads, headdim)``,
masks aligned to the bottom-right corner, softcap before ALiBi before masking) and computes either in a
wider dtype (``upcast``) or in the input precision, so one function gives both the oracle and the error
that plain PyTorch makes in low precision. ``local_mask`` and ``alibi_bias`` define the masking and bias
semantics once; the CPU path applies them block by block.
"""

from __future__ import annotations

import math

import torch


def local_mask(
    i: torch.Tensor,
    j: torch.Tensor,
    seqlen_q: torch.Tensor | int,
    seqlen_k: torch.Tensor | int,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """True where query row ``i`` may see key column ``j`` (arguments broadcast).

    The diagonal is aligned to the bottom-right corner: row ``i`` is centred on column
    ``i + seqlen_k - seqlen_q``; it sees columns within ``window_size = (left, right)`` of it
    (-1 = unbounded on that side). Columns ``j >= seqlen_k`` and rows ``i >= seqlen_q`` see nothing.
    Causal attention is ``window_size=(-1, 0)``."""
    left, right = window_size
    centre = i + seqlen_k - seqlen_q
    visible = (j < seqlen_k) & (i < seqlen_q)
    if right >= 0:
        visible = visible & (j <= centre + right)
    if left >= 0:
        visible = visible & (j >= centre - left)
    return visible


def alibi_bias(
    slopes: torch.Tensor, i: torch.Tensor, j: torch.Tensor, seqlen_q: torch.Tensor | int, seqlen_k: torch.Tensor | int
) -> torch.Tensor:
    """ALiBi bias ``-slope * |i + seqlen_k - seqlen_q - j|``; ``slopes`` broadcasts against i, j."""
    return -slopes * (i + seqlen_k - seqlen_q - j).abs().to(slopes.dtype)


def causal_window(causal: bool, window_size: tuple[int, int], seqlen_k: int | None = None) -> tuple[int, int]:
    """The window that a (causal, window_size) pair means. As in flash_attn, a side at least ``seqlen_k``
    wide (the call's key length: k's, flash_attn_varlen_func's max_seqlen_k, flash_attn_with_kvcache's
    cache capacity) is unbounded (-1); then causal bounds the right side at 0."""
    left, right = window_size
    if seqlen_k is not None:
        left, right = (-1 if side >= seqlen_k else side for side in (left, right))
    return (left, 0) if causal else (left, right)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_padding_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    upcast: bool | torch.dtype = True,
    reorder_ops: bool = False,
    window_seqlen_k: int | None = None,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive attention that materialises the ``(batch, nheads, seqlen_q, seqlen_k)`` scores.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (MQA/GQA).
        query_padding_mask: bool ``(batch, seqlen_q)``, True for real tokens (a padded batch). Padded
            rows output 0.
        key_padding_mask: bool ``(batch, seqlen_k)``, True for real keys. With padding masks the
            bottom-right alignment uses each sequence's real lengths (the count of True entries), so a
            padded batch matches the varlen API when the real tokens come first.
        causal, window_size, softcap, alibi_slopes, softmax_scale: as in ``tileattn.flash_attn_func``.
        dropout_p: probability of dropping an attention weight.
        dropout_mask: bool ``(batch, nheads, seqlen_q, seqlen_k)``, True where kept; required when
            ``dropout_p > 0``.
        upcast: True computes in float32, a dtype (e.g. ``torch.float64``) computes in that dtype,
            False computes in the input dtype (the "plain PyTorch" error).
        reorder_ops: scale k instead of q before the product (a second low-precision variant).
        window_seqlen_k: the key length from which a window side counts as unbounded
            (``causal_window``): k's ``seqlen_k`` when None; a cache's capacity for a slice of it.
        learnable_sink: ``(nheads,)`` attention sinks, as in ``tileattn.flash_attn_func``: one more logit
            in every real row's softmax, with no value (padded rows have none).

    Returns:
        ``(output, attention)``: output in q's dtype ``(batch, seqlen_q, nheads, headdim)``, attention
        probabilities before dropout ``(batch, nheads, seqlen_q, seqlen_k)``. Rows that see no key have
        zero output and zero attention.
    """
    dtype_og = q.dtype
    if upcast is True:
        compute = torch.float32
    elif upcast is False:
        compute = dtype_og
    else:
        compute = upcast
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap

    i = torch.arange(seqlen_q, device=q.device).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=q.device).view(1, 1, 1, -1)
    len_q = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).view(-1, 1, 1, 1)
    len_k = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute).view(-1, nheads, 1, 1)
        scores = scores + alibi_bias(slopes, i, j, len_q, len_k)
    window = causal_window(causal, window_size, seqlen_k if window_seqlen_k is None else window_seqlen_k)
    visible = local_mask(i, j, len_q, len_k, window)
    visible = visible.expand(batch, nheads, seqlen_q, seqlen_k)
    scores = scores.masked_fill(~visible, float("-inf"))
    if learnable_sink is not None:
        real = (i < len_q).expand(batch, nheads, seqlen_q, 1)
        sink = learnable_sink.to(compute).view(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        attention = torch.softmax(torch.cat([scores, sink.masked_fill(~real, float("-inf"))], dim=-1), dim=-1)
        attention = attention[..., :seqlen_k].nan_to_num(0.0)  # (rows with neither keys nor a sink: 0)
    else:
        attention = torch.softmax(scores, dim=-1)
    # A row that sees no key softmaxes -inf everywhere into NaN; its output is defined as 0.
    attention = attention.masked_fill(~visible, 0.0)
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("attention_ref: dropout_p > 0 needs dropout_mask")
        attention_drop = attention.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    else:
        attention_drop = attention
    out = torch.einsum("bhts,bshd->bthd", attention_drop, v)
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask.view(batch, seqlen_q, 1, 1), 0.0)
    return out.to(dtype_og), attention.to(dtype_og)
