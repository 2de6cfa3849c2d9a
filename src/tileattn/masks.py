"""FlashMask: attention under rich masks stored per key column as intervals of hidden query rows, O(N) memory.

``flashmask_attention`` (dense) and ``flashmask_varlen_attention`` (packed batches) take
``startend_row_indices``, int32 bounds per key column whose meaning ``tileattn.flashmask`` tabulates
(C = 1, 2 or 4 bounds, with or without causal). The kernels skip every tile the mask hides entirely, in
the forward and the backward, and run the tiles it leaves whole without an element mask.

The builders below return the indices of the common masks for one sequence, int32 ``(1, 1, seqlen, C)``
(``torch.cat`` them along dim 0 for a batch), with the ``causal`` flag to pass. In the pictures row i is a
query, column j a key, ``■`` visible and ``·`` hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tileattn import api, checks
from tileattn.ops import attention

__all__ = [
    "causal_blockwise_mask",
    "causal_document_mask",
    "document_mask",
    "flashmask_attention",
    "flashmask_varlen_attention",
    "global_sliding_window_mask",
    "prefix_lm_causal_mask",
    "prefix_lm_document_mask",
    "shared_question_mask",
    "sliding_window_mask",
]

_ARGS_DOC = """
        startend_row_indices: int32 ``{mask_shape}``: per key column, the query rows it hides (C = 1, 2
            or 4 bounds; ``tileattn.flashmask`` gives their meaning, and the builders of ``tileattn.masks``
            make the common ones). One mask for every head (``1``) or one per query head. Every bound lies
            in ``[0, {sq}]``; each interval's start is at most its end. Read on the host once per
            unmodified tensor to check that.
        causal: the causal mask (bottom-right aligned, as in ``flash_attn_func``) on top of the FlashMask;
            C = 1 needs it and C = 4 refuses it, and C = 2 means ``[LTS, LTE)`` with it and ``i >= LTS``
            or ``i < UTE`` without.
        softmax_scale: default ``1 / sqrt(headdim)``.
        dropout_p: as in ``flash_attn_func``.
        window_size: ``(left, right)`` sliding window, as in ``flash_attn_func``, on top of the mask.
        return_softmax_lse: also return the fp32 LSE ``{lse_shape}`` (``+inf`` for a row that sees no key;
            with sinks it includes them).
        deterministic: as in ``flash_attn_func``.
        learnable_sink, s_aux: attention sinks, fp32 ``(nheads,)``, as in ``flash_attn_func``.

    Returns:
        out ``{out_shape}`` in q's dtype (0 in rows that see no key, never NaN), or ``(out, softmax_lse)``.
    Backward through q, k, v like ``flash_attn_func``. ``torch.compile`` traces it as one custom op."""


def _run(q, k, v, p, startend_row_indices, causal, lead, seqlen_k, layout, return_softmax_lse):
    """The attention of a validated call ``p`` under its checked ``startend_row_indices`` (shape
    ``(*lead, 1 or nheads, seqlen_k, C)``, ``layout`` in messages)."""
    nheads = q.shape[-2]
    p.startend_row_indices = checks.check_startend_row_indices(
        startend_row_indices, causal, lead, seqlen_k, nheads, layout, q.device
    )
    p.mask_causal = causal
    out, lse, _ = attention.forward(q, k, v, p)
    return (out, lse) if return_softmax_lse else out


def flashmask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    return_softmax_lse: bool = False,
    deterministic: bool = False,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    q, k, v, p = api.dense_call(
        q, k, v, dropout_p, softmax_scale, causal, window_size, 0.0, None, deterministic, return_softmax_lse,
        sinks=(learnable_sink, s_aux),
    )  # fmt: skip
    lead = (q.shape[0],)
    layout = "(batch, 1 or nheads, seqlen_k, C)"
    return _run(q, k, v, p, startend_row_indices, causal, lead, k.shape[1], layout, return_softmax_lse)


flashmask_attention.__doc__ = """Exact attention under a FlashMask, forward and backward, fully hidden tiles skipped.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16 or bfloat16 (float32 too on CPU).
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``, ``nheads % nheads_k == 0`` (GQA).""" + _ARGS_DOC.format(
    mask_shape="(batch, 1 or nheads, seqlen_k, C)",
    sq="seqlen_q",
    lse_shape="(batch, nheads, seqlen_q)",
    out_shape="(batch, seqlen_q, nheads, headdim)",
)


def flashmask_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    startend_row_indices: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    return_softmax_lse: bool = False,
    deterministic: bool = False,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    q, k, v, p = api.varlen_call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        0.0,
        None,
        deterministic,
        return_softmax_lse,
        sinks=(learnable_sink, s_aux),
    )
    layout = "(1 or nheads, total_k, C)"
    return _run(q, k, v, p, startend_row_indices, causal, (), k.shape[0], layout, return_softmax_lse)


flashmask_varlen_attention.__doc__ = """``flashmask_attention`` over a packed batch (``flash_attn_varlen_func``'s layout and cu_seqlens).

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as in ``flash_attn_varlen_func``.
        The bounds of key token ``t`` (a row of the packed k) count query rows from the start of its own
        sequence: the masks of one sequence's builder, concatenated along the token dim.""" + _ARGS_DOC.format(
    mask_shape="(1 or nheads, total_k, C)",
    sq="max_seqlen_q",
    lse_shape="(nheads, total_q)",
    out_shape="(total_q, nheads, headdim)",
)


# --------------------------------------------------------------------------------------------------
# Builders: one sequence, int32 (1, 1, seqlen, C)
# --------------------------------------------------------------------------------------------------


def _lengths(name: str, lengths: Sequence[int], allow_zero: bool = False) -> list[int]:
    values = [int(n) for n in lengths]
    if not values or any(n < (0 if allow_zero else 1) for n in values):
        least = "non-negative" if allow_zero else "positive"
        raise checks.InvalidArgument(f"{name} must be a non-empty sequence of {least} ints, got {list(lengths)!r}")
    return values


def _doc_spans(seqlens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per token, its document's start and end (int64 ``(seqlen,)``), and the total length."""
    lengths = torch.tensor(_lengths("seqlens", seqlens))
    ends = torch.cumsum(lengths, 0)
    return (ends - lengths).repeat_interleave(lengths), ends.repeat_interleave(lengths), int(ends[-1])


def _pack(*columns: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return torch.stack(columns, -1).to(device=device, dtype=torch.int32).view(1, 1, -1, len(columns))


def causal_document_mask(seqlens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Causal attention within each document of a packed sequence (``causal=True``, C = 1).

    ``seqlens``: the documents' lengths, in order. Key j of the document ``[s, e)`` hides rows ``i >= e``.
    ``seqlens=[3, 2]``::

        ■ · · · ·
        ■ ■ · · ·
        ■ ■ ■ · ·
        · · · ■ ·
        · · · ■ ■
    """
    _, ends, _ = _doc_spans(seqlens)
    return _pack(ends, device=device)


def document_mask(seqlens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Bidirectional attention within each document of a packed sequence (``causal=False``, C = 2: LTS,
    UTE). Key j of the document ``[s, e)`` hides rows ``i >= e`` and ``i < s``. ``seqlens=[3, 2]``::

        ■ ■ ■ · ·
        ■ ■ ■ · ·
        ■ ■ ■ · ·
        · · · ■ ■
        · · · ■ ■
    """
    starts, ends, _ = _doc_spans(seqlens)
    return _pack(ends, starts, device=device)


def shared_question_mask(
    question_len: int, answer_lens: Sequence[int], device: torch.device | str | None = None
) -> torch.Tensor:
    """One question and several answers (reward models, DPO): causal, each answer sees the question and
    itself but not the other answers (``causal=True``, C = 1). For several groups in one packed
    sequence, ``torch.cat`` each group's mask along dim 2 with the earlier groups' length added to it.

    Key j of the question hides nothing below the group; key j of the answer ``[s, e)`` hides rows
    ``i >= e``. ``question_len=2, answer_lens=[2, 1]``::

        ■ · · · ·
        ■ ■ · · ·
        ■ ■ ■ · ·
        ■ ■ ■ ■ ·
        ■ ■ · · ■
    """
    question = _lengths("question_len", [question_len])[0]
    _, answer_ends, total = _doc_spans(answer_lens)
    ends = torch.cat([torch.full((question,), question + total), answer_ends + question])
    return _pack(ends, device=device)


def prefix_lm_causal_mask(seqlen: int, prefix_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Prefix LM: the first ``prefix_len`` tokens see each other in both directions, the rest is causal
    (``causal=False``, C = 2: LTS, UTE). Prefix key j hides nothing; a later key j hides rows ``i < j``.
    ``seqlen=5, prefix_len=2``::

        ■ ■ · · ·
        ■ ■ · · ·
        ■ ■ ■ · ·
        ■ ■ ■ ■ ·
        ■ ■ ■ ■ ■
    """
    return prefix_lm_document_mask([seqlen], [prefix_len], device)


def prefix_lm_document_mask(
    seqlens: Sequence[int], prefix_lens: Sequence[int], device: torch.device | str | None = None
) -> torch.Tensor:
    """Prefix LM within each document of a packed sequence (``causal=False``, C = 2: LTS, UTE): document
    ``[s, e)`` with prefix length ``p`` has bidirectional keys ``[s, s + p)`` (hiding rows outside the
    document) and causal keys after (key j hides rows ``i < j`` and ``i >= e``).
    ``seqlens=[3, 2], prefix_lens=[2, 1]``::

        ■ ■ · · ·
        ■ ■ · · ·
        ■ ■ ■ · ·
        · · · ■ ·
        · · · ■ ■
    """
    starts, ends, total = _doc_spans(seqlens)
    prefixes = _lengths("prefix_lens", prefix_lens, allow_zero=True)
    lengths = _lengths("seqlens", seqlens)
    if len(prefixes) != len(lengths) or any(p > n for p, n in zip(prefixes, lengths)):
        raise checks.InvalidArgument(
            f"prefix_lens must give each document a prefix of at most its length, got {prefixes} for {lengths}"
        )
    prefix_end = starts + torch.tensor(prefixes).repeat_interleave(torch.tensor(lengths))
    j = torch.arange(total)
    return _pack(ends, torch.where(j < prefix_end, starts, j), device=device)


def sliding_window_mask(seqlen: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Causal sliding window: row i sees keys ``[i - window, i]``, as ``window_size=(window, 0)`` does
    (``causal=True``, C = 1). Key j hides rows ``i > j + window``. ``seqlen=5, window=1``::

        ■ · · · ·
        ■ ■ · · ·
        · ■ ■ · ·
        · · ■ ■ ·
        · · · ■ ■
    """
    seqlen = _lengths("seqlen", [seqlen])[0]
    window = _lengths("window", [window], allow_zero=True)[0]
    return _pack((torch.arange(seqlen) + window + 1).clamp(max=seqlen), device=device)


def global_sliding_window_mask(
    seqlen: int, global_tokens: int, window: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global tokens plus a symmetric sliding window (Longformer, BigBird): the first ``global_tokens``
    see and are seen by every token; the others see keys within ``window`` on either side
    (``causal=False``, C = 4). A key ``j >= global_tokens`` hides rows ``[global_tokens, j - window)`` and
    ``[j + window + 1, seqlen)``. ``seqlen=6, global_tokens=1, window=1``::

        ■ ■ ■ ■ ■ ■
        ■ ■ ■ · · ·
        ■ ■ ■ ■ · ·
        ■ · ■ ■ ■ ·
        ■ · · ■ ■ ■
        ■ · · · ■ ■
    """
    seqlen = _lengths("seqlen", [seqlen])[0]
    glob = _lengths("global_tokens", [global_tokens], allow_zero=True)[0]
    window = _lengths("window", [window], allow_zero=True)[0]
    j = torch.arange(seqlen)
    local = j >= glob
    lower_start = torch.where(local, (j + window + 1).clamp(max=seqlen), seqlen)
    upper_end = torch.where(local, (j - window).clamp(min=glob), 0)
    upper_start = torch.where(local, torch.full_like(j, glob), 0)
    return _pack(lower_start, torch.full_like(j, seqlen), upper_start, upper_end, device=device)


def causal_blockwise_mask(block_lens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Causal blockwise (in-context learning): causal within each block; the last block also sees every
    earlier block, while earlier blocks see only themselves (``causal=True``, C = 2: LTS, LTE). Key j of
    an earlier block ``[s, e)`` hides rows ``[e, start of the last block)``. ``block_lens=[2, 1, 2]``::

        ■ · · · ·
        ■ ■ · · ·
        · · ■ · ·
        ■ ■ ■ ■ ·
        ■ ■ ■ ■ ■
    """
    _, ends, total = _doc_spans(block_lens)
    last_start = total - _lengths("block_lens", block_lens)[-1]
    is_last = torch.arange(total) >= last_start
    lower_start = torch.where(is_last, total, ends)
    lower_end = torch.where(is_last, total, last_start)
    return _pack(lower_start, lower_end, device=device)
