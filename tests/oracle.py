"""The tests' own oracle: dense attention and rotary embeddings written from their definitions.

Nothing here imports tileattn: the masks, windows, ALiBi and rotary that the package's paths and its
shipped reference (``tileattn.reference``, ``tileattn.rotary``) implement are written again from the
documented semantics (``tileattn.flash_attn_func``'s docstring; flash_attn 2.8.3's ``attention_ref`` and
``construct_local_mask``), in a different form (a row's visible keys as one slice, rotation as complex
multiplication), so that a mistake in the package's helpers cannot pass by agreeing with itself.
``tests/test_oracle.py`` checks this module against PyTorch's own attention (SDPA with explicit masks,
``causal_lower_right``) and against hand-written cases.

Semantics (flash_attn's):
- scores ``S = (q·scale) kᵀ`` with ``scale = 1/sqrt(headdim)`` by default; softcap ``c > 0`` maps them to
  ``c·tanh(S/c)``; then ALiBi adds ``-slope·|i + seqlen_k - seqlen_q - j|``; then masking;
- masks are aligned to the bottom-right corner: row i's diagonal is key ``i + seqlen_k - seqlen_q``;
  ``window_size = (left, right)`` lets it see keys from ``diagonal - left`` to ``diagonal + right``; -1, or a
  side at least the call's key length (``window_seqlen_k``), is unbounded; causal sets the right side to 0;
- MQA/GQA: query head h reads kv head ``h // (nheads / nheads_k)``;
- a row that sees no key outputs 0 and has LSE +inf;
- dropout multiplies the kept probabilities by ``1 / (1 - dropout_p)`` (the keep mask is given);
- attention sinks (one logit per query head) are a column appended to every row's scores after masking,
  then dropped after the softmax: the LSE includes it, and a row that sees no key has LSE = its sink.

The ``precision`` switch gives both halves of the tolerance rule from one function: the oracle
(``torch.float64``, the default) and the plain-PyTorch run in the inputs' own precision (``None``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Attention(NamedTuple):
    """What ``attention`` returns: ``out (batch, seqlen_q, nheads, headdim)``, ``lse (batch, nheads,
    seqlen_q)`` (natural log, +inf for rows that see no key; no gradient) and ``probs (batch, nheads, seqlen_q,
    seqlen_k)`` (before dropout, 0 where masked), all in the compute precision. ``attention_varlen``
    returns the packed ``out (total_q, nheads, headdim)`` and ``lse (nheads, total_q)``, probs None."""

    out: torch.Tensor
    lse: torch.Tensor
    probs: torch.Tensor | None


def window_sides(causal: bool, window_size: tuple[int, int], window_seqlen_k: int) -> tuple[int | None, int | None]:
    """``(left, right)`` of the window a call means, None for an unbounded side: -1 and sides at least
    ``window_seqlen_k`` (the call's key length: k's seqlen, max_seqlen_k, a cache's capacity) are
    unbounded; causal bounds the right side at 0."""
    left, right = window_size
    left = None if left < 0 or left >= window_seqlen_k else left
    right = None if right < 0 or right >= window_seqlen_k else right
    if causal:
        right = 0
    return left, right


def visible(seqlen_q: int, seqlen_k: int, left: int | None, right: int | None, rows: int, cols: int) -> torch.Tensor:
    """Bool ``(rows, cols)`` on the CPU: True where query row i (of ``seqlen_q`` real rows) sees key j (of
    ``seqlen_k`` real keys). Row i's keys are one run, from its diagonal ``i + seqlen_k - seqlen_q`` minus
    ``left`` to the diagonal plus ``right``, clipped to the real keys; padding rows and columns see nothing."""
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(seqlen_q):
        diagonal = i + seqlen_k - seqlen_q
        first = 0 if left is None else max(diagonal - left, 0)
        last = seqlen_k - 1 if right is None else min(diagonal + right, seqlen_k - 1)
        if first <= last:
            mask[i, first : last + 1] = True
    return mask


def _real_lengths(padding_mask: torch.Tensor | None, full: int, batch: int, name: str) -> list[int]:
    """Real tokens per sequence of a padding mask (True = real), which must put them first."""
    if padding_mask is None:
        return [full] * batch
    lengths = padding_mask.sum(-1).tolist()
    first = torch.arange(full, device=padding_mask.device)[None] < padding_mask.sum(-1, keepdim=True)
    if not torch.equal(padding_mask.bool(), first):
        raise ValueError(f"oracle: {name} must hold each sequence's real tokens first")
    return lengths


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    window_seqlen_k: int | None = None,
    visible_mask: torch.Tensor | None = None,
    precision: torch.dtype | None = torch.float64,
    probs_dtype: torch.dtype | None = None,
    sink: torch.Tensor | None = None,
    lse_grad: bool = False,
) -> Attention:
    """Dense attention with materialised scores (differentiable).

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, any float dtype.
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``, ``nheads % nheads_k == 0``.
        softmax_scale, causal, window_size, softcap: as in ``flash_attn_func``.
        alibi_slopes: float ``(nheads,)`` or ``(batch, nheads)``.
        dropout_p: the dropout probability; with ``dropout_p > 0``, ``dropout_mask`` bool
            ``(batch, nheads, seqlen_q, seqlen_k)`` says which probabilities are kept (True).
        query_padding_mask, key_padding_mask: bool ``(batch, seqlen_q)`` / ``(batch, seqlen_k)``, True for
            real tokens, which come first: the bottom-right alignment (and ALiBi's distance) then uses each
            sequence's real lengths, as a varlen call would; padded rows output 0.
        window_seqlen_k: the key length from which a window side is unbounded; default k's seqlen_k.
        visible_mask: bool ``(batch or 1, nheads or 1, seqlen_q, seqlen_k)``, False where a key is hidden
            from a row on top of the window (a FlashMask: ``flashmask_visible``).
        precision: the dtype to compute in (default float64, the oracle); None computes in q's dtype
            (plain PyTorch's error, for the tolerance rule).
        probs_dtype: round the probabilities to this dtype before ``· V``, at their row max 1 (plain FP8
            attention, ``exp(s - rowmax)`` in e4m3 over the fp32 sum), for the FP8 tolerance.
        sink: ``(nheads,)`` attention sinks (differentiable): a column of logits appended to the masked
            scores of every real row, dropped after the softmax.
        lse_grad: make ``lse`` differentiable (its gradient 0 in the rows that see no key); by default it
            is detached.

    Returns:
        ``Attention(out, lse, probs)`` in the compute precision.
    """
    compute = q.dtype if precision is None else precision
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads % nheads_k:
        raise ValueError(f"oracle: nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    k = k.repeat_interleave(nheads // nheads_k, dim=2)  # (batch, seqlen_k, nheads, headdim)
    v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scale = headdim**-0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)  # (batch, nheads, seqlen_q, seqlen_k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)

    lengths_q = _real_lengths(query_padding_mask, seqlen_q, batch, "query_padding_mask")
    lengths_k = _real_lengths(key_padding_mask, seqlen_k, batch, "key_padding_mask")
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute).reshape(-1, nheads, 1, 1)  # (1 or batch, nheads, 1, 1)
        rows = torch.arange(seqlen_q, device=q.device).view(1, -1, 1)
        cols = torch.arange(seqlen_k, device=q.device).view(1, 1, -1)
        shift = torch.tensor(lengths_k, device=q.device).view(-1, 1, 1) - torch.tensor(lengths_q, device=q.device).view(
            -1, 1, 1
        )
        distance = (rows + shift - cols).abs().to(compute)  # (batch, seqlen_q, seqlen_k)
        scores = scores - slopes * distance.unsqueeze(1)

    left, right = window_sides(causal, window_size, seqlen_k if window_seqlen_k is None else window_seqlen_k)
    if query_padding_mask is None and key_padding_mask is None:
        seen = visible(seqlen_q, seqlen_k, left, right, seqlen_q, seqlen_k)[None, None]
    else:
        seen = torch.stack([visible(sq, sk, left, right, seqlen_q, seqlen_k) for sq, sk in zip(lengths_q, lengths_k)])
        seen = seen[:, None]  # (batch, 1, seqlen_q, seqlen_k)
    seen = seen.to(q.device)
    if visible_mask is not None:
        seen = seen & visible_mask.to(q.device)
    has_key = seen.any(-1)  # (batch or 1, 1 or nheads, seqlen_q)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sink is not None:  # the sinks' column, in the real rows (padding rows are no rows: no sink)
        real = torch.arange(seqlen_q, device=q.device)[None, :] < torch.tensor(lengths_q, device=q.device)[:, None]
        column = sink.to(compute).view(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        column = column.masked_fill(~real[:, None, :, None], float("-inf"))
        scores = torch.cat([scores, column], dim=-1)
        seen = torch.cat([seen.expand(batch, nheads, seqlen_q, seqlen_k), column.isfinite()], dim=-1)
        has_key = seen.any(-1)
    if not bool(has_key.all()):  # rows that see no key: a finite row, so that no NaN enters the graph
        scores = scores.masked_fill(~has_key.unsqueeze(-1), 0.0)
    lse = torch.logsumexp(scores if lse_grad else scores.detach(), dim=-1).masked_fill(~has_key, float("inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    if sink is not None:
        probs = probs[..., :seqlen_k]
    weights = probs
    if dropout_p > 0:
        if dropout_mask is None:
            raise ValueError("oracle: dropout_p > 0 needs dropout_mask (True where kept)")
        weights = probs.masked_fill(~dropout_mask, 0.0) / (1 - dropout_p)
    if probs_dtype is not None and weights.numel():
        row_max = weights.detach().amax(-1, keepdim=True).clamp_min(torch.finfo(compute).tiny)
        weights = (weights / row_max).to(probs_dtype).to(compute) * row_max
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    return Attention(out, lse, probs)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int],
    cu_seqlens_k: torch.Tensor | list[int],
    max_seqlen_k: int | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    visible_masks: list[torch.Tensor] | None = None,
    **kwargs,
) -> Attention:
    """A packed batch, each sequence on its own through ``attention``.

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` offsets of the sequences.
        max_seqlen_k: the call's ``max_seqlen_k``, from which a window side is unbounded (default: the
            longest key sequence).
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)`` (row b for sequence b).
        dropout_mask: bool ``(batch, nheads, max_seqlen_q, max_seqlen_k)``; sequence b keeps
            ``[b, :, :seqlen_q, :seqlen_k]`` (the layout of varlen's ``S_dmask``).
        visible_masks: one ``visible_mask`` of ``attention`` per sequence.
        kwargs: the other arguments of ``attention``.

    Returns:
        ``Attention(out (total_q, nheads, headdim), lse (nheads, total_q), None)``.
    """
    cu_q = [int(x) for x in cu_seqlens_q]
    cu_k = [int(x) for x in cu_seqlens_k]
    if max_seqlen_k is None:
        max_seqlen_k = max([b - a for a, b in zip(cu_k, cu_k[1:])], default=0)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        keep = dropout_mask[b : b + 1, :, : q1 - q0, : k1 - k0] if dropout_mask is not None else None
        res = attention(
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            alibi_slopes=slopes,
            dropout_mask=keep,
            window_seqlen_k=max_seqlen_k,
            visible_mask=None if visible_masks is None else visible_masks[b],
            **kwargs,
        )
        outs.append(res.out[0])
        lses.append(res.lse[0])
    if not outs:
        precision = kwargs.get("precision", torch.float64)
        compute = q.dtype if precision is None else precision
        return Attention(q.new_zeros(q.shape, dtype=compute), q.new_zeros(q.shape[1], 0, dtype=compute), None)
    return Attention(torch.cat(outs), torch.cat(lses, dim=-1), None)


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding: ``x (batch, seqlen, nheads, headdim)`` with token s of sequence b at position
    ``positions[b, s]`` (an index into the tables ``cos``, ``sin`` of shape ``(seqlen_ro, rotary_dim / 2)``).

    Each pair of the first ``rotary_dim`` channels is a complex number ``a + ib`` multiplied by
    ``cos + i·sin`` of its frequency f: channels (2f, 2f + 1) when interleaved (GPT-J), (f, f + rotary_dim/2)
    otherwise (GPT-NeoX); the other channels pass through. As flash_attn's rotary, the product is taken
    in fp32 (complex64; complex128 for float64 x) and rounded once to x's dtype (for 16-bit x and tables,
    whose products are exact in fp32, that is one rounding of the exact sum).
    Returns a new tensor of x's dtype and shape."""
    real = torch.promote_types(x.dtype, torch.float32)
    half = cos.shape[-1]
    rot = 2 * half
    turn = torch.complex(cos[positions].to(real), sin[positions].to(real)).unsqueeze(2)  # (b, s, 1, half)
    head = x[..., :rot].to(real)
    if interleaved:
        pairs = head.unflatten(-1, (half, 2))  # (..., half, 2): channels 2f, 2f + 1
    else:
        pairs = torch.stack((head[..., :half], head[..., half:]), dim=-1)  # channels f, f + half
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn)  # (..., half, 2)
    if interleaved:
        head = turned.flatten(-2)
    else:
        head = torch.cat((turned[..., 0], turned[..., 1]), dim=-1)
    return torch.cat((head.to(x.dtype), x[..., rot:]), dim=-1)


def flashmask_visible(startend_row_indices: torch.Tensor, causal: bool, seqlen_q: int) -> torch.Tensor:
    """Bool ``(batch, heads, seqlen_q, seqlen_k)``, False where FlashMask's ``startend_row_indices``
    ``(batch, heads, seqlen_k, C)`` hides a row from a key column (the causal mask not included). From the
    semantics of ``tileattn.flashmask_attention``, column by column: C = 1 (causal) hides rows from LTS
    on; C = 2 hides rows LTS..LTE-1 with causal, and rows from LTS on plus rows before UTE without; C = 4
    hides rows LTS..LTE-1 and UTS..UTE-1."""
    batch, heads, seqlen_k, columns = startend_row_indices.shape
    seen = torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for j, bounds in enumerate(startend_row_indices[b, h].tolist()):
                if columns == 1:
                    seen[b, h, bounds[0] :, j] = False
                elif columns == 2 and causal:
                    seen[b, h, bounds[0] : bounds[1], j] = False
                elif columns == 2:
                    seen[b, h, bounds[0] :, j] = False
                    seen[b, h, : bounds[1], j] = False
                else:
                    seen[b, h, bounds[0] : bounds[1], j] = False
                    seen[b, h, bounds[2] : bounds[3], j] = False
    return seen


def flash_attn_block_n(headdim: int, dropout: bool, causal: bool, capability: tuple[int, int] = (9, 0)) -> int:
    """flash_attn 2.8.3's key-block size (its ``_get_block_size_n``; ``capability`` of the GPU, (0, 0) for CPU
    tensors): the blocks of its S_dmask's scaling."""
    sm8x = capability[0] == 8 and capability[1] > 0
    if headdim <= 32:
        return 128
    if headdim <= 64:
        return 64 if dropout else 128
    if headdim <= 96:
        return 64
    if headdim <= 128:
        if sm8x:
            return 64 if (not dropout and causal) else 32
        return 32 if dropout else 64
    return 64


def flash_attn_unnormalized(probs: torch.Tensor, block_n: int) -> torch.Tensor:
    """flash_attn's S_dmask magnitudes from the probabilities ``(..., seqlen_q, seqlen_k)``: each key block's
    weights ``exp(s - m)`` with m the row's largest score in that block and every block after it (its key
    loop runs from the last block to the first), which is the probability over the largest probability of
    those blocks (0 where that is 0)."""
    if probs.shape[-1] == 0:
        return probs
    block_max = torch.stack([blk.amax(-1) for blk in probs.split(block_n, dim=-1)], dim=-1)
    running = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1)
    running = running.repeat_interleave(block_n, dim=-1)[..., : probs.shape[-1]]
    return torch.where(running > 0, probs / running.clamp_min(torch.finfo(probs.dtype).tiny), 0.0)
