"""flash_attn 2.8.3's ``flash_attn_interface`` module on tileattn: its seven public functions (those of
``tileattn.api`` and ``tileattn.kvcache``) and the internal forward and backward functions that code
built on flash_attn calls directly, with flash_attn's signatures, defaults and returns.

Ring and zigzag attention (zhuzilin/ring-flash-attention, feifeibear/long-context-attention) run
``_flash_attn_forward`` on each chunk of K/V, merge the partial outputs by their LSE, then run
``_flash_attn_backward`` per chunk with the merged ``out`` and ``softmax_lse``, writing the gradients into
buffers they allocate. The functions here validate their arguments as the public functions do and run
tileattn's forward and backward (``tileattn::fwd`` / ``tileattn::bwd``): the Triton kernels on CUDA, the
PyTorch path on CPU. Called on plain tensors in eager mode they skip the op dispatch; under
``torch.compile`` they trace to the custom ops (no graph break), except for ``leftpad_k`` / ``seqused_k``,
whose values are read on the host.

``rng_state``: an int64 CPU tensor ``[seed, offset]``, flash_attn's layout. tileattn's dropout draws
Philox numbers keyed by ``seed`` at counters that start at 0 for every call (``offset`` is always 0), so
the seed alone decides the mask: passing the forward's ``rng_state`` to the backward regenerates it.
"""

from __future__ import annotations

import itertools

import torch

from tileattn import api, checks
from tileattn.api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from tileattn.kvcache import flash_attn_with_kvcache
from tileattn.ops import attention
from tileattn.params import AttnParams

__all__ = [
    "USE_TRITON_ROCM",
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "_get_block_size_n",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "maybe_contiguous",
    "round_multiple",
]

# flash_attn's switch to its ROCm Triton backend (FLASH_ATTENTION_TRITON_AMD_ENABLE), which newer flash_attn tests
# import to skip CUDA-extension cases; tileattn has no such backend
USE_TRITON_ROCM = False


def maybe_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` contiguous if its last dimension is not (None stays None), as flash_attn's helper."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block size of flash_attn 2.8's CUDA kernels for this head dim (flash_attn's helper): the
    blocks by which S_dmask is scaled, in tileattn as in flash_attn, so that its tests'
    ``normalize_flash_attn_S`` turns it into probabilities."""
    if not 1 <= head_dim <= 256:
        raise checks.InvalidArgument(f"head_dim must be between 1 and 256, got {head_dim}")
    return attention.s_dmask_block_n(torch.device(device), head_dim, bool(is_dropout), bool(is_causal))


def round_multiple(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return (x + m - 1) // m * m


def _no_rng_state() -> torch.Tensor:
    """The rng_state of a call without dropout (seed 0, offset 0)."""
    return torch.zeros(2, dtype=torch.int64)


def _rowsum_dot(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 ``rowsum(dout ∘ out)`` over the head dim, ``dout.shape[:-1]``, a few million elements at a time
    along the rows (dim -3) so that the fp32 copies stay small next to the inputs."""
    rows = dout.shape[-3]
    per_row = max(1, dout.numel() // max(rows, 1))
    step = max(1, (1 << 22) // per_row)
    d = torch.empty(dout.shape[:-1], dtype=torch.float32, device=dout.device)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        d[..., r0:r1, :] = (dout[..., r0:r1, :, :].float() * out[..., r0:r1, :, :].float()).sum(-1)
    return d


def _softmax_d(dout: torch.Tensor, out: torch.Tensor, p: AttnParams) -> torch.Tensor:
    """flash_attn's ``softmax_d``: ``rowsum(dout ∘ out) * (1 - dropout_p)`` in fp32, in its layout: dense
    ``(batch, nheads, round_multiple(seqlen_q, 128))``; varlen ``(nheads, total_q + 128 * batch)`` with
    the rows of sequence b from ``cu_seqlens_q[b] + 128 * b``. Padding entries are 0."""
    d = _rowsum_dot(dout, out) * (1.0 - p.dropout_p)  # [batch, seqlen_q, nheads] or [total_q, nheads]
    if not p.is_varlen:
        batch, seqlen_q, nheads = d.shape
        softmax_d = d.new_zeros(batch, nheads, round_multiple(seqlen_q, 128))
        softmax_d[:, :, :seqlen_q] = d.transpose(1, 2)
        return softmax_d
    total_q, nheads = d.shape
    softmax_d = d.new_zeros(nheads, total_q + 128 * p.batch)
    rows = torch.arange(total_q, dtype=p.cu_seqlens_q.dtype, device=d.device)
    seq = torch.searchsorted(p.cu_seqlens_q, rows, right=True) - 1  # each row's sequence
    softmax_d[:, rows.long() + 128 * seq.clamp(min=0).long()] = d.t()
    return softmax_d


def _check_return_softmax(return_softmax: object, dropout_p: float) -> None:
    checks.check_flag("return_softmax", return_softmax)
    if return_softmax and dropout_p == 0:
        raise checks.InvalidArgument(
            "return_softmax is only supported with dropout_p > 0, as in flash_attn (the attention probabilities "
            "are returned only to show the dropout mask); the softmax_lse is returned either way"
        )


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams, return_softmax: bool):
    """``(out, softmax_lse, S_dmask, rng_state)`` of tileattn's forward, S_dmask empty unless asked."""
    out, lse, rng_state = attention.forward(q, k, v, p)
    s_dmask = attention.attn_probs(q, k, rng_state, p) if return_softmax else attention.no_probs(q)
    return out, lse, s_dmask, rng_state


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p: AttnParams, rng_state) -> torch.Tensor:
    """Runs tileattn's backward, writes the gradients into the given buffers; returns softmax_d."""
    dout, out, lse = checks.check_grad_inputs(dout, out, softmax_lse, q, p.lse_shape(p.as_4d(q)))
    for name, buf, like_name, like in (("dq", dq, "q", q), ("dk", dk, "k", k), ("dv", dv, "v", v)):
        checks.check_grad_buffer(name, buf, like_name, like)
    rng_state = checks.check_rng_state(rng_state, p.dropout_p)
    if rng_state is None:
        rng_state = _no_rng_state()
    with torch.no_grad():
        grads = attention.backward(dout, q, k, v, out, lse, rng_state, p)
        for buf, grad in zip((dq, dk, dv), grads):
            if buf is not None:
                buf.copy_(grad)
        return _softmax_d(dout, out, p)


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn's dense forward (its ``flash_attn_func`` without the autograd).

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16 or bfloat16 (float32 too on CPU).
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``, ``nheads % nheads_k == 0``.
        dropout_p, softcap, alibi_slopes: as in ``flash_attn_func``.
        softmax_scale: scale of QKᵀ (None: ``1 / sqrt(headdim)``).
        causal, window_size_left, window_size_right: ``flash_attn_func``'s ``causal`` and
            ``window_size = (left, right)``.
        return_softmax: also return the attention probabilities; only with ``dropout_p > 0``, as in
            flash_attn (a call with dropout_p == 0 is refused).

    Returns:
        ``(out, softmax_lse, S_dmask, rng_state)``: out ``(batch, seqlen_q, nheads, headdim)`` in the
        inputs' dtype; softmax_lse fp32 ``(batch, nheads, seqlen_q)``, natural log, ``+inf`` for rows that
        see no key (whose output is 0); S_dmask fp32 ``(batch, nheads, seqlen_q, seqlen_k)`` in flash_attn's
        scaling with return_softmax (as ``flash_attn_func``'s with dropout), else an empty tensor of the
        inputs' dtype;
        rng_state int64 ``(2,)`` on the CPU, for ``_flash_attn_backward`` (see the module docstring).
    """
    window = (window_size_left, window_size_right)
    q, k, v, p = api.dense_call(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, False, False)
    _check_return_softmax(return_softmax, p.dropout_p)
    return _forward(q, k, v, p, return_softmax)


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn's packed (varlen) forward, ``flash_attn_varlen_func`` without the autograd.

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim)``, or page pools
            ``(num_pages, page_block_size, nheads_k, headdim)`` with ``block_table``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table: as in
            ``flash_attn_varlen_func``.
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
            return_softmax: as in ``_flash_attn_forward``.
        leftpad_k: int32 ``(batch,)``: sequence b's keys start ``leftpad_k[b]`` rows into its
            ``cu_seqlens_k`` range (not with block_table, as in flash_attn).
        seqused_k: int32 ``(batch,)``: sequence b uses its keys up to position ``seqused_k[b]`` (at most
            its cu_seqlens_k length; with block_table, the first seqused_k[b] positions of its pages).
            Without block_table, leftpad_k and seqused_k gather the used keys into a packed copy (their
            values are read on the host).
        zero_tensors: flash_attn zeroes its outputs first; tileattn writes every row (0 where a row
            sees no key), so it changes nothing.

    Returns:
        ``(out, softmax_lse, S_dmask, rng_state)`` as ``_flash_attn_forward``'s, out
        ``(total_q, nheads, headdim)``, softmax_lse fp32 ``(nheads, total_q)`` and S_dmask (with
        return_softmax) fp32 ``(batch, nheads, max_seqlen_q, max_seqlen_k)``.
    """
    checks.check_flag("zero_tensors", zero_tensors)
    window = (window_size_left, window_size_right)
    if block_table is not None:
        # (with dropout_p > 0 the paged call refuses the dropout; without, return_softmax is refused here)
        _check_return_softmax(return_softmax, float(dropout_p) if checks.is_real(dropout_p) else 0.0)
        if leftpad_k is not None:
            raise checks.InvalidArgument(
                "leftpad_k cannot be combined with block_table (flash_attn does not support paged keys with "
                "leftpad_k either)"
            )
        if seqused_k is not None:  # the keys of sequence b: the first seqused_k[b] positions of its pages
            checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, q.device)
            batch = cu_seqlens_k.numel() - 1
            used = checks.check_int32("seqused_k", seqused_k, (batch,), "(batch,)", q.device)
            cu_seqlens_k = torch.nn.functional.pad(used.cumsum(0, dtype=torch.int32), (1, 0))
        options = dict(
            dropout_p=dropout_p,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            deterministic=False,
            return_attn_probs=False,
            learnable_sink=None,  # (flash_attn's internal forward takes no sinks)
            s_aux=None,
        )
        out, lse = api.paged_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, options)
        return out, lse, attention.no_probs(out), _no_rng_state()
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
        window,
        softcap,
        alibi_slopes,
        False,
        False,
    )
    _check_return_softmax(return_softmax, p.dropout_p)
    if leftpad_k is not None or seqused_k is not None:
        k, v, p.cu_seqlens_k = _used_keys(k, v, p, leftpad_k, seqused_k)
    return _forward(q, k, v, p, return_softmax)


def _used_keys(
    k: torch.Tensor, v: torch.Tensor, p: AttnParams, leftpad_k: object, seqused_k: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values each sequence uses under leftpad_k / seqused_k, packed, and their cu_seqlens."""
    lengths = checks.cu_values("cu_seqlens_k", p.cu_seqlens_k, k.shape[0], "max_seqlen_k", p.seqlen_k)
    spans = checks.key_spans(lengths, leftpad_k, seqused_k, p.batch, k.device)
    starts = itertools.accumulate(lengths[:-1], initial=0)  # (cu_seqlens_k starts at 0)
    rows = [torch.arange(s0 + pad, s0 + pad + n, device=k.device) for s0, (pad, n) in zip(starts, spans)]
    index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=k.device)
    used = torch.tensor([0] + [n for _, n in spans], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return k[index], v[index], used.to(k.device)


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attn's dense backward: writes the gradients into ``dq``, ``dk``, ``dv``.

    Args:
        dout: ``(batch, seqlen_q, nheads, headdim)``, the gradient of ``out``.
        q, k, v: as given to the forward.
        out, softmax_lse: what the backward differentiates: the forward's, or (ring attention) the
            output and fp32 LSE ``(batch, nheads, seqlen_q)`` merged over several forwards, against which
            this call's keys are weighed.
        dq, dk, dv: buffers shaped and typed as q, k, v (GQA: dk and dv as k and v), any strides,
            overwritten with the gradients; None skips that gradient's write.
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes:
            the forward's.
        deterministic: as in ``flash_attn_func``.
        rng_state: the forward's (required with dropout_p > 0: it regenerates the dropout mask).

    Returns:
        softmax_d, fp32 ``(batch, nheads, round_multiple(seqlen_q, 128))``: ``rowsum(dout ∘ out) *
        (1 - dropout_p)`` per query row, 0 past seqlen_q (flash_attn's layout).
    """
    q, k, v, p = api.dense_call(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
        deterministic,
        False,
    )
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p, rng_state)


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    """flash_attn's packed (varlen) backward: ``_flash_attn_backward`` for ``(total, nheads, headdim)``
    tensors, ``softmax_lse`` fp32 ``(nheads, total_q)`` and the forward's cu_seqlens and max_seqlen (no
    block_table: flash_attn has no backward through pages either). ``zero_tensors`` changes nothing
    (every row of the buffers is written).

    Returns:
        softmax_d, fp32 ``(nheads, total_q + 128 * batch)``: ``rowsum(dout ∘ out) * (1 - dropout_p)``,
        sequence b's rows from ``cu_seqlens_q[b] + 128 * b``, 0 elsewhere (flash_attn's layout).
    """
    checks.check_flag("zero_tensors", zero_tensors)
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
        (window_size_left, window_size_right),
        softcap,
        alibi_slopes,
        deterministic,
        False,
    )
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p, rng_state)


# flash_attn binds these names to its torch.library ops (torch >= 2.4); here they are the same functions
_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward
