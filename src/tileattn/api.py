"""The public API: a drop-in superset of the ``flash_attn`` 2.x Python functions (dense and varlen).

Every argument is validated (``tileattn.checks``, one place for every error message) before anything
runs or is written; a refused argument raises ``tileattn.InvalidArgument``, a ValueError that is also
the RuntimeError flash_attn raises (``dense_call``, ``varlen_call`` and ``paged_call`` do this for the
public functions here and for flash_attn's internal ones in ``tileattn.interface``). The call is then
normalised into a ``params.AttnParams`` and handed to the ``tileattn::fwd`` custom op
(``tileattn.ops.attention``), which routes it: CUDA tensors run the Triton kernels; CPU tensors run the
blockwise PyTorch path (``tileattn.cpu``), or the Triton kernels through Triton's interpreter when
``TRITON_INTERPRET=1`` is set (fp16 only).
"""

from __future__ import annotations

import torch

from tileattn import backend, checks, fp8, kvcache
from tileattn.backend import cpu_backend
from tileattn.checks import resolve_scale
from tileattn.ops import attention
from tileattn.params import AttnParams, remember

__all__ = [
    "cpu_backend",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "resolve_scale",
]


def attn_params(
    q: torch.Tensor,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> AttnParams:
    """The validated options of one call (``checks.check_options``, ``checks.check_alibi``) as AttnParams."""
    dropout_p, softmax_scale, left, right, softcap = checks.check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, seqlen_k=seqlen_k
    )
    headdim = q.shape[-1]
    return AttnParams(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        headdim=headdim,
        softmax_scale=resolve_scale(softmax_scale, headdim),
        window_left=left,
        window_right=right,
        softcap=softcap,
        alibi_slopes=checks.check_alibi(alibi_slopes, batch, q.shape[-2], q.device),
        dropout_p=dropout_p,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        deterministic=deterministic,
    )


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------

_DENSE_DOC_ARGS = """
        dropout_p: probability of dropping an attention weight (training only; pass 0.0 at eval). As in
            flash_attn, each decision uses 8 random bits: a weight is kept when its byte is at most
            ``K = floor(255 · (1 - dropout_p))`` (in fp32), so the kept fraction is ``(K + 1) / 256`` (every
            p > 0 drops at least 1/256), and kept weights are rescaled by ``1 / (1 - dropout_p)``:
            flash_attn's numbers, with the bias its rule carries (the expected weights are ``(K + 1) / 256
            / (1 - p)`` of the exact ones: 0.9983 at p = 0.1, 0.9977 at p = 0.17). Decisions come from a
            counter-based RNG (Philox) seeded from PyTorch's default generator, so ``torch.manual_seed``
            makes them reproducible; the backward pass regenerates them.
        softmax_scale: scale of QKᵀ before the softmax; default ``1 / sqrt(headdim)``.
        causal: causal mask aligned to the bottom-right corner: with ``seqlen_q != seqlen_k``, query i
            sees keys ``j <= i + seqlen_k - seqlen_q``.
        window_size: ``(left, right)`` sliding window around that diagonal; query i sees keys in
            ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``; -1 = unbounded, and
            as in flash_attn a side at least ``seqlen_k`` wide (``max_seqlen_k`` in varlen calls, the cache
            capacity in ``flash_attn_with_kvcache``) is unbounded too. Any pair of integers: a tuple or
            list, NumPy integers, 0-d integer tensors or a 1-D integer tensor of two.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (before ALiBi and masking).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``; adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores.
        deterministic: the backward's dQ by a separate pass, bitwise reproducible run to run. Without it
            the tables may add dQ from the dK/dV pass by fp32 reduce-adds, whose order varies (causal
            calls at head dim 128, which are faster that way); dK and dV are reproducible either way.
        return_attn_probs: also return ``softmax_lse`` and ``S_dmask`` (see Returns).
        q_descale, k_descale, v_descale: keyword-only, FlashAttention-3's FP8 arguments: with q, k, v in
            ``torch.float8_e4m3fn`` (all three), fp32 ``(batch, nheads_k)`` factors (None: 1.0) by which each
            sequence's kv head (and the query heads of its group) is multiplied; ``tileattn.fp8.quantize``
            makes them. The output is bf16; FP8 calls are forward only. Both matmuls run in FP8 on GPUs
            with FP8 tensor cores (sm89+).
        learnable_sink: keyword-only, attention sinks (gpt-oss; FlashAttention-4's ``learnable_sink``): a
            float32 ``(nheads,)`` tensor (other float dtypes are converted), one logit per query head that
            joins the denominator of every row's softmax, ``softmax([s_i0, ..., s_ij, ..., sink_h])`` with
            the sink's column then dropped: it has no value vector and is not scaled, capped, biased or
            masked. It takes a gradient (in the backward, like q, k and v). ``s_aux`` is the same argument
            under vLLM's and Hugging Face's name (pass one of the two).
"""

_RETURNS_DOC = """
    Returns:
        out ``{out_shape}``, the inputs' dtype. If ``return_attn_probs``: ``(out, softmax_lse,
        S_dmask)`` where softmax_lse is fp32 ``{lse_shape}``, the natural-log sum of exp of each row's
        scores (``+inf`` for a row that sees no key, whose output is 0); with attention sinks the sum
        includes ``exp(sink)``, as in FlashAttention-4 (a row that sees no key then has LSE = its
        sink). As in flash_attn, S_dmask is computed only with dropout: with ``dropout_p == 0`` it is an
        empty tensor (shape ``(0,)``, the inputs' dtype), so ``return_attn_probs=True`` costs nothing
        beyond returning the LSE. With dropout it is fp32 ``(batch, nheads, {sq}, {sk})`` in flash_attn's
        scaling: the weights before normalisation, ``exp(s - m)`` where m is the row's running max over
        the key blocks of ``flash_attn.flash_attn_interface._get_block_size_n(device, headdim, True,
        causal)`` columns from the last block to this one (flash_attn's key loop runs backwards), negated
        where dropout removed the weight and 0 where masked; times ``exp(m - softmax_lse)`` they are the
        probabilities (flash_attn's tests' ``normalize_flash_attn_S``). Materialised N×N: for tests only.
"""


# Calls checked before, by signature (``signature``): a model's layers share one. Beyond the limit the oldest go.
_MAX_CALLS = 1024
calls: dict[tuple, attention.Call] = {}


def signature(tensors: tuple, scalars: tuple, window_size: object) -> tuple | None:
    """The key of a call's metadata, all that its checks and launch plans read: each tensor by shape,
    strides, dtype, device and 16-byte alignment (Triton specialises on it), None as None; the options by
    value and type (True == 1 and 1.0 == 1 as keys). None: no key (a tensor subclass or a non-tensor where
    a tensor goes, a window_size that is not a tuple of two ints): such a call is checked in full."""
    if type(window_size) is not tuple or len(window_size) != 2:
        return None
    left, right = window_size
    if type(left) is not int or type(right) is not int:
        return None
    tensor = torch.Tensor
    metas = []
    for t in tensors:
        if t is None:
            metas.append(None)
        elif type(t) is tensor:
            metas.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16))
        else:
            return None
    return (*metas, scalars, tuple(map(type, scalars)), left, right)


def known(key: tuple | None) -> attention.Call | None:
    """The call remembered under ``key``, or None (also for a key holding an unhashable value)."""
    if key is None:
        return None
    try:
        return calls.get(key)
    except TypeError:
        return None


def first_run(key: tuple | None, direct: bool, checked: tuple, given: tuple, return_attn_probs: bool):
    """The run of a call just checked (``checked``: ``dense_call``'s or ``varlen_call``'s q, k, v and
    AttnParams): through the custom ops where the call is traced (not ``direct``), else as an eager
    ``attention.Call``, remembered under ``key`` for later calls of its signature where the checks used
    the tensors as given (``given``: q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k; no copy made
    contiguous, no FP8 input dequantized), so that those calls may take their own tensors unchecked."""
    q, k, v, p = checked
    if not direct:
        return attention.run(q, k, v, p, return_attn_probs)
    call = attention.Call(p, p.flashmask is None and not backend.nothing_to_attend(q, k))
    used = (q, k, v, p.alibi_slopes, p.cu_seqlens_q, p.cu_seqlens_k)
    if key is not None and all(a is b for a, b in zip(given, used)):
        try:
            remember(calls, key, call, _MAX_CALLS)
        except TypeError:  # (an unhashable value: not kept)
            pass
    p = call.params(p.alibi_slopes, p.cu_seqlens_q, p.cu_seqlens_k, p.learnable_sink, p.descales, 0)
    return call.run(q, k, v, p, return_attn_probs)


def dense_call(
    q: object,
    k: object,
    v: object,
    dropout_p: object,
    softmax_scale: object,
    causal: object,
    window_size: object,
    softcap: object,
    alibi_slopes: object,
    deterministic: object,
    return_attn_probs: object,
    descales: tuple = (None, None, None),
    sinks: tuple = (None, None),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnParams]:
    """Validates a dense call (q ``(batch, seqlen_q, nheads, headdim)``, k and v ``(batch, seqlen_k,
    nheads_k, headdim)``): q, k, v contiguous in their last dimension (dequantized to bf16 if they are FP8,
    with ``descales = (q_descale, k_descale, v_descale)``: ``tileattn.fp8``), and the call's AttnParams
    (with the attention sinks of ``sinks = (learnable_sink, s_aux)``)."""
    q = checks.check_tensor("q", q, "(batch, seqlen_q, nheads, headdim)")
    k = checks.check_tensor("k", k, "(batch, seqlen_k, nheads_k, headdim)")
    v = checks.check_tensor("v", v, "(batch, seqlen_k, nheads_k, headdim)")
    q, k, v, fp8_descales = fp8.inputs(q, k, v, *descales, batch=q.shape[0])
    q, k, v = checks.check_qkv(q, k, v, fp8=fp8_descales is not None)
    batch, seqlen_q, nheads, headdim = q.shape
    if k.shape[0] != batch:
        raise checks.InvalidArgument(f"q and k must have the same batch size, got {batch} and {k.shape[0]}")
    checks.check_extent(seqlen_q, {"q": q})
    checks.check_extent(k.shape[1], {"k": k, "v": v})
    p = attn_params(
        q,
        batch,
        seqlen_q,
        k.shape[1],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
    p.descales = fp8.checked_options(fp8_descales, p)
    p.learnable_sink = checks.check_sink(*sinks, nheads, q.device)
    return q, k, v, p


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    sink = learnable_sink if learnable_sink is not None else s_aux
    direct = backend.direct(q, k, v, alibi_slopes, sink)
    key = None
    if direct and q_descale is None and k_descale is None and v_descale is None:
        key = signature(
            (q, k, v, alibi_slopes, learnable_sink, s_aux),
            (dropout_p, softmax_scale, causal, softcap, deterministic, return_attn_probs),
            window_size,
        )
    call = known(key)
    if call is not None:
        return call.run(q, k, v, call.params(alibi_slopes, None, None, sink, None, 0), return_attn_probs)
    checked = dense_call(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        (q_descale, k_descale, v_descale),
        (learnable_sink, s_aux),
    )
    return first_run(key, direct, checked, (q, k, v, alibi_slopes, None, None), return_attn_probs)


flash_attn_func.__doc__ = (
    """Exact attention softmax(QKᵀ·scale)·V, fused and O(N) in memory, forward and backward.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16 or bfloat16 (float32 too on CPU).
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (MQA/GQA: query head
            i uses kv head ``i // (nheads // nheads_k)``). headdim may be anything from 1 to 256. Strides
            are free; a last dimension that is not contiguous is copied first (as flash_attn does)."""
    + _DENSE_DOC_ARGS
    + _RETURNS_DOC.format(
        out_shape="(batch, seqlen_q, nheads, headdim)",
        lse_shape="(batch, nheads, seqlen_q)",
        sq="seqlen_q",
        sk="seqlen_k",
    )
)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    """``flash_attn_func`` on ``qkv`` of shape ``(batch, seqlen, 3, nheads, headdim)`` (self-attention);
    the gradient flows back into ``qkv``. Other arguments and returns as in ``flash_attn_func``."""
    qkv = checks.check_tensor("qkv", qkv, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise checks.InvalidArgument(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        learnable_sink=learnable_sink, s_aux=s_aux,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    """``flash_attn_func`` with ``kv`` of shape ``(batch, seqlen_k, 2, nheads_k, headdim)``; the gradient
    flows back into ``kv``. Other arguments and returns as in ``flash_attn_func``."""
    kv = checks.check_tensor("kv", kv, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise checks.InvalidArgument(
            f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}"
        )
    k, v = kv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        learnable_sink=learnable_sink, s_aux=s_aux,
    )  # fmt: skip


def paged_call(
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    block_table: object,
    options: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged prefill (``block_table``): validates q ``(total_q, nheads, headdim)`` and the page pools k, v
    ``(num_pages, page_block_size, nheads_k, headdim)``, then runs ``kvcache.paged_varlen_fwd``;
    returns ``(out, softmax_lse)``."""
    q = checks.check_tensor("q", q, "(total_q, nheads, headdim)")
    k = checks.check_tensor("k", k, "paged (num_pages, page_block_size, nheads_k, headdim)")
    v = checks.check_tensor("v", v, "paged (num_pages, page_block_size, nheads_k, headdim)")
    q, k, v = checks.check_qkv(q, k, v)
    return kvcache.paged_varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, options
    )


def varlen_call(
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    dropout_p: object,
    softmax_scale: object,
    causal: object,
    window_size: object,
    softcap: object,
    alibi_slopes: object,
    deterministic: object,
    return_attn_probs: object,
    descales: tuple = (None, None, None),
    sinks: tuple = (None, None),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnParams]:
    """Validates a packed call (q ``(total_q, nheads, headdim)``, k and v ``(total_k, nheads_k,
    headdim)``, int32 cu_seqlens): q, k, v contiguous in their last dimension (dequantized if FP8, as in
    ``dense_call``), and the call's AttnParams (sinks as ``dense_call``'s). The cu_seqlens values are
    checked where the kernels run (``ops.attention``)."""
    q = checks.check_tensor("q", q, "(total_q, nheads, headdim)")
    k = checks.check_tensor("k", k, "(total_k, nheads_k, headdim)")
    v = checks.check_tensor("v", v, "(total_k, nheads_k, headdim)")
    checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, q.device)
    checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, q.device)
    q, k, v, fp8_descales = fp8.inputs(q, k, v, *descales, cu_seqlens_q.numel() - 1, cu_seqlens_q, cu_seqlens_k)
    q, k, v = checks.check_qkv(q, k, v, fp8=fp8_descales is not None)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise checks.InvalidArgument(
            f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got {cu_seqlens_q.numel() - 1} and "
            f"{cu_seqlens_k.numel() - 1} sequences"
        )
    batch = cu_seqlens_q.numel() - 1
    checks.check_extent(int(max_seqlen_q), {"q": q})
    checks.check_extent(int(max_seqlen_k), {"k": k, "v": v})
    p = attn_params(
        q,
        batch,
        int(max_seqlen_q),
        int(max_seqlen_k),
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        cu_seqlens_q=cu_seqlens_q.contiguous(),
        cu_seqlens_k=cu_seqlens_k.contiguous(),
    )
    p.descales = fp8.checked_options(fp8_descales, p)
    p.learnable_sink = checks.check_sink(*sinks, q.shape[1], q.device)
    return q, k, v, p


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    if block_table is not None:
        if any(d is not None for d in (q_descale, k_descale, v_descale)):
            raise checks.InvalidArgument("FP8 descales with a block_table (paged prefill) are not supported")
        options = dict(
            dropout_p=dropout_p,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            deterministic=deterministic,
            return_attn_probs=return_attn_probs,
            learnable_sink=learnable_sink,
            s_aux=s_aux,
        )
        out, lse = paged_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, options)
        return (out, lse, attention.no_probs(q)) if return_attn_probs else out
    sink = learnable_sink if learnable_sink is not None else s_aux
    direct = backend.direct(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sink)
    key = None
    if direct and q_descale is None and k_descale is None and v_descale is None:
        key = signature(
            (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink, s_aux),
            (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, softcap, deterministic, return_attn_probs),
            window_size,
        )
    call = known(key)
    if call is not None:
        p = call.params(alibi_slopes, cu_seqlens_q, cu_seqlens_k, sink, None, 0)
        return call.run(q, k, v, p, return_attn_probs)
    checked = varlen_call(
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
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        (q_descale, k_descale, v_descale),
        (learnable_sink, s_aux),
    )
    return first_run(key, direct, checked, (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k), return_attn_probs)


flash_attn_varlen_func.__doc__ = (
    """Attention over a packed batch of sequences of different lengths (no padding computed).

    Args:
        q: ``(total_q, nheads, headdim)``, the batch's query tokens concatenated.
        k, v: ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, cumulative sequence lengths starting at 0:
            sequence b holds query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``. Empty sequences are
            allowed, and so is padding after the last sequence (``cu_seqlens_q[-1] < total_q``): those rows'
            outputs and gradients are 0. Any number of sequences. Their values are read on the host to validate them before the kernels run, once
            per tensor: later calls with the same tensor (every layer of a model) reuse the check until
            a torch op changes it. Writes that bypass PyTorch's version counter (``.data``,
            ``.numpy()``, DLPack, your own kernels, a CUDA graph's replay) are not seen: pass a new
            tensor instead. Inference tensors have no version counter and are read on every call.
        max_seqlen_q, max_seqlen_k: ints at least the longest query / key sequence.
        Masks are aligned to the bottom-right corner of each sequence."""
    + _DENSE_DOC_ARGS
    + """        block_table: int32 ``(batch, max_pages)``: paged prefill. k and v are then page pools
            ``(num_pages, page_block_size, nheads_k, headdim)`` and sequence b's keys are the first
            ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` positions of its pages. Forward only, as in
            flash_attn 2.8.3 (whose varlen backward takes no block_table): inputs may require grad, and a
            backward that reaches the call raises NotImplementedError; no dropout. The entries
            covering a sequence's keys must be pages of the pool: for CUDA tensors the kernel checks
            them, and the next call on the device raises a bad one (``flash_attn_with_kvcache`` says
            how; ``tileattn.check_errors()``), for CPU tensors they are read on the host first.
"""
    + _RETURNS_DOC.format(
        out_shape="(total_q, nheads, headdim)", lse_shape="(nheads, total_q)", sq="max_seqlen_q", sk="max_seqlen_k"
    )
)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    """``flash_attn_varlen_func`` on ``qkv`` of shape ``(total, 3, nheads, headdim)`` with one
    ``cu_seqlens``/``max_seqlen`` for queries and keys."""
    qkv = checks.check_tensor("qkv", qkv, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise checks.InvalidArgument(f"qkv must have shape (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    """``flash_attn_varlen_func`` with ``kv`` of shape ``(total_k, 2, nheads_k, headdim)``."""
    kv = checks.check_tensor("kv", kv, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise checks.InvalidArgument(f"kv must have shape (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
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
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )
