"""Attention forward and backward as ``torch.library`` custom ops, so ``torch.compile`` sees them as
single opaque nodes (no graph break) with fake (meta) implementations for tracing and registered autograd.

``tileattn::fwd`` returns ``(out, softmax_lse, rng_state)``: rng_state is an int64 CPU tensor
``[seed, offset]`` (flash_attn's layout) holding the Philox seed the forward drew for dropout and the
offset of its counters, always 0 (each call's counters start at 0: the seed alone decides the mask), which
``tileattn::bwd`` takes to regenerate the same mask. The public functions in ``tileattn.api`` validate
metadata (works on fake tensors while tracing) and call ``run``; flash_attn's internal functions in
``tileattn.interface`` call ``forward`` and ``backward``. Checks that need tensor *values* (cu_seqlens)
run here, in the real implementation, before any kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tileattn import backend, checks, cpu, flashmask, rng
from tileattn.kernels import configs
from tileattn.params import AttnParams, FlashMask, Settings, remember

# what a backward through FP8 inputs raises (tileattn.fp8 too, where it dequantizes them)
FP8_BACKWARD = (
    "backward through float8_e4m3fn inputs is not supported: FP8 attention is forward only (train in bf16 or fp16)"
)

DROPOUT_CAPTURE = (
    "dropout_p > 0 under CUDA graph capture: the dropout seed is drawn on the host, so every replay would drop the "
    "same elements; capture with dropout_p=0 or run the dropout call outside the graph"
)

# FlashMasks in the kernels' form, remembered per startend_row_indices tensor while it is alive and unmodified
# (every layer of a model passes the same one); a few, as each holds 16 bytes per key token on the device
FLASHMASKS = checks.CheckedOnce(limit=8)


def _flashmask(startend_row_indices: Tensor, causal: bool, varlen: bool, seqlen_q: int) -> FlashMask:
    """The kernels' form of a checked ``startend_row_indices`` (values checked here): on CUDA in one launch
    and one host read (``kernels.flashmask.canonical``), on the CPU with torch ops."""
    if startend_row_indices.is_cuda:
        from tileattn.kernels import flashmask as kernel_flashmask

        return kernel_flashmask.canonical(startend_row_indices, causal, varlen, seqlen_q)
    checks.flashmask_values(startend_row_indices, causal, seqlen_q)
    return flashmask.canonical(startend_row_indices, causal, varlen)


def _attn_params(
    q: Tensor,
    alibi_slopes: Tensor | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    seed: int,
    deterministic: bool,
    startend_row_indices: Tensor | None,
    mask_causal: bool,
    learnable_sink: Tensor | None = None,
    descales: Tensor | None = None,
) -> AttnParams:
    varlen = cu_seqlens_q is not None
    fm = None
    if startend_row_indices is not None:
        fm = FLASHMASKS(
            (startend_row_indices,),
            (mask_causal, varlen, max_seqlen_q),
            lambda: _flashmask(startend_row_indices, mask_causal, varlen, max_seqlen_q),
        )
    return AttnParams(
        batch=cu_seqlens_q.numel() - 1 if varlen else q.shape[0],
        seqlen_q=max_seqlen_q,
        seqlen_k=max_seqlen_k,
        headdim=q.shape[-1],
        softmax_scale=softmax_scale,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
        philox_seed=seed,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        deterministic=deterministic,
        startend_row_indices=startend_row_indices,
        mask_causal=mask_causal,
        flashmask=fm,
        descales=descales,
        learnable_sink=learnable_sink,
    )


def _like(t: Tensor, ref: Tensor) -> Tensor:
    """``t`` with the strides ``torch.empty_like(ref)`` has (what the fake implementations promise), in
    its own dtype. ``t`` is dense, so equal strides mean ``ref`` is dense too and ``empty_like`` would
    keep them."""
    if t.stride() == ref.stride():
        return t
    out = torch.empty_like(ref, dtype=t.dtype)
    if out.stride() == t.stride():
        return t
    return out.copy_(t)


def _tokens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[int, int]:
    """The query and key rows the sequences of a packed batch use (``cu_seqlens[-1]``, which may stop
    short of the tensors' first dim: the rest is padding), after checking the cu_seqlens values
    (``checks.cu_values``, once per unmodified tensor). Dense calls: the whole first dim.

    _used_rows: the kernels get the used rows only. The Gluon kernels read whole tiles by TMA, past a
    sequence's end into the next rows (their scores masked, so they weigh 0), and padding may hold
    anything: a NaN there would turn those zero weights into NaN (0 · NaN), where TMA's zero fill past
    the tensor's end cannot."""
    if cu_seqlens_q is None:
        return q.shape[0], k.shape[0]
    return checks.cu_tokens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)


def forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Tensor | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    startend_row_indices: Tensor | None = None,
    mask_causal: bool = False,
    learnable_sink: Tensor | None = None,
    descales: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    tokens_q, tokens_k = _tokens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if dropout_p > 0 and backend.capturing(q.device):
        raise NotImplementedError(DROPOUT_CAPTURE)
    seed = rng.new_seed() if dropout_p > 0 else 0
    p = _attn_params(
        q,
        alibi_slopes,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_left,
        window_right,
        softcap,
        dropout_p,
        seed,
        deterministic,
        startend_row_indices,
        mask_causal,
        learnable_sink,
        descales,
    )
    if backend.nothing_to_attend(q, k) or tokens_k == 0:
        out, lse = torch.zeros_like(q, dtype=_out_dtype(q)), _no_keys_lse(p, q)
    else:
        if tokens_k < k.shape[0]:  # the kernels see the sequences' rows only (_used_rows)
            k, v = k[:tokens_k], v[:tokens_k]
        with backend.on_device(q):
            out, lse = backend.implementation(q).attn_fwd(q, k, v, p, configs.current(q.device))
    if tokens_q < q.shape[0]:  # padding rows after the last sequence see no key, nor the sinks
        out[tokens_q:] = 0
        lse[:, tokens_q:] = float("inf")
    rng_state = torch.tensor([seed, 0], dtype=torch.int64) if seed else torch.zeros(2, dtype=torch.int64)
    return _like(out, q), lse, rng_state


def _no_keys_lse(p: AttnParams, q: Tensor) -> Tensor:
    """The LSE of a call in which no row sees a key: +inf (the flash_attn convention), or with attention
    sinks each row's sink, the only term of its softmax's denominator."""
    lse = p.new_lse(p.as_4d(q))
    if p.learnable_sink is None:
        return lse.fill_(float("inf"))
    sink = p.learnable_sink.view(-1, 1) if p.is_varlen else p.learnable_sink.view(1, -1, 1)
    return lse.copy_(sink.expand_as(lse))


def _out_dtype(q: Tensor) -> torch.dtype:
    """The output's dtype: q's, bf16 for FP8 q."""
    return torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype


attn_fwd = torch.library.custom_op("tileattn::fwd", forward_impl, mutates_args=())


@attn_fwd.register_fake
def _(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *args):
    nheads = q.shape[-2]
    if cu_seqlens_q is not None:
        lse = q.new_empty((nheads, q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], nheads, q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q, dtype=_out_dtype(q)), lse, torch.empty(2, dtype=torch.int64)


def backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    rng_state: Tensor,
    alibi_slopes: Tensor | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    startend_row_indices: Tensor | None = None,
    mask_causal: bool = False,
    learnable_sink: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsink)``: dsink fp32 ``(nheads,)`` with attention sinks, else an empty tensor."""
    dsink = _no_dsink(learnable_sink)
    if backend.nothing_to_attend(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsink
    p = _attn_params(
        q,
        alibi_slopes,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_left,
        window_right,
        softcap,
        dropout_p,
        int(rng_state[0]),
        deterministic,
        startend_row_indices,
        mask_causal,
        learnable_sink,
    )
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    tokens_q, tokens_k = _tokens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if tokens_q == 0 or tokens_k == 0:  # (a row whose softmax holds its sink alone has Δ = 0: dsink 0)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsink
    if tokens_q == q.shape[0] and tokens_k == k.shape[0]:
        with backend.on_device(q):
            dq, dk, dv, ds = backend.implementation(q).attn_bwd(dout, q, k, v, out, lse, p, configs.current(q.device))
        return _like(dq, q), _like(dk, k), _like(dv, v), dsink if ds is None else ds
    # padding rows after the last sequence: the kernels see the sequences' rows only (_used_rows), and the
    # padding's gradients are 0
    used_q, used_k = slice(0, tokens_q), slice(0, tokens_k)
    with backend.on_device(q):
        grads = backend.implementation(q).attn_bwd(
            dout[used_q], q[used_q], k[used_k], v[used_k], out[used_q], lse[:, used_q].contiguous(), p,
            configs.current(q.device),
        )  # fmt: skip
    padded = []
    for g, t, used in zip(grads[:3], (q, k, v), (used_q, used_k, used_k)):
        full = torch.zeros_like(t)
        full[used] = g
        padded.append(full)
    return (*padded, dsink if grads[3] is None else grads[3])


def _no_dsink(learnable_sink: Tensor | None) -> Tensor:
    """dsink where nothing reaches the sinks' gradient: zeros of their shape, or an empty tensor without them
    (a custom op returns tensors only)."""
    if learnable_sink is None:
        return torch.empty(0, dtype=torch.float32)
    return torch.zeros_like(learnable_sink)


attn_bwd = torch.library.custom_op("tileattn::bwd", backward_impl, mutates_args=())


@attn_bwd.register_fake
def _(dout, q, k, v, *args):
    sink = args[16] if len(args) > 16 else None  # (learnable_sink, after the 16 arguments before it)
    dsink = torch.empty_like(sink) if sink is not None else torch.empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse, rng_state = output
    options += [None] * (15 - len(options))  # (learnable_sink and descales have defaults)
    # the tensors among the options: alibi_slopes, cu_seqlens_q, cu_seqlens_k, startend_row_indices and
    # learnable_sink
    ctx.save_for_backward(q, k, v, out, lse, rng_state, *options[:3], options[11], options[13])
    ctx.options = options[3:11] + options[12:13]
    ctx.fp8 = options[14] is not None
    # the backward runs with the forward's settings: autograd may run it on another thread, where an
    # override (a context variable) of the calling thread is not set
    ctx.settings = configs.current(q.device)


def _grads(bwd, ctx, dout):
    """(dq, dk, dv, None..., dsink, None) for the forward's 18 inputs, from what ``_setup_context`` saved."""
    if ctx.fp8:
        raise NotImplementedError(FP8_BACKWARD)
    *saved, startend_row_indices, learnable_sink = ctx.saved_tensors
    with configs.override(ctx.settings):
        dq, dk, dv, dsink = bwd(dout, *saved, *ctx.options[:8], startend_row_indices, *ctx.options[8:], learnable_sink)
    return (dq, dk, dv) + (None,) * 13 + (dsink if learnable_sink is not None else None, None)


def _backward(ctx, dout, _dlse, _drng):
    return _grads(attn_bwd, ctx, dout)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """``tileattn::fwd`` / ``tileattn::bwd`` without the custom-op dispatch, for eager calls on plain
    tensors (``backend.direct``): the same implementations and saved tensors, at a fraction of the host time
    per call (the dispatcher's argument handling costs more than the kernel launches at small sizes)."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse, rng_state = forward_impl(q, k, v, *options)
        _setup_context(ctx, (q, k, v, *options), (out, lse, rng_state))
        ctx.inputs = len(options)
        return out, lse, rng_state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse, _drng):
        return _grads(backward_impl, ctx, dout)[: 3 + ctx.inputs]


def s_dmask_block_n(device: torch.device, headdim: int, dropout: bool, causal: bool) -> int:
    """The key-block size of flash_attn 2.8's CUDA kernels for this head dim (its ``_get_block_size_n``):
    the blocks by which S_dmask is scaled as flash_attn scales it (``cpu.attn_probs``)."""
    major, minor = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    if headdim <= 32:
        return 128
    if headdim <= 64:
        return 64 if dropout else 128
    if headdim <= 96:
        return 64
    if headdim <= 128:
        if major == 8 and minor > 0:  # sm86 / sm89
            return 64 if (not dropout and causal) else 32
        return 32 if dropout else 64
    return 64


def attn_probs(q: Tensor, k: Tensor, rng_state: Tensor, p: AttnParams) -> Tensor:
    """S_dmask of ``return_attn_probs`` with dropout, in flash_attn's scaling (``cpu.attn_probs``;
    materialised N×N, for tests)."""
    p.philox_seed = int(rng_state[0])
    causal = p.window_right == 0 and p.window_left < 0
    block_n = s_dmask_block_n(q.device, q.shape[-1], p.dropout_p > 0, causal)
    return cpu.attn_probs(q.detach(), k.detach(), p, block_n)


def no_probs(q: Tensor) -> Tensor:
    """S_dmask without dropout: an empty tensor of q's dtype, as flash_attn returns (no N×N tensor)."""
    return q.new_empty((0,))


def op_options(p: AttnParams) -> tuple:
    """The inputs of ``tileattn::fwd`` after its tensors, from ``p`` (``tileattn::bwd`` takes all but the
    last, the FP8 descales)."""
    return (
        p.alibi_slopes,
        p.cu_seqlens_q,
        p.cu_seqlens_k,
        p.seqlen_q,
        p.seqlen_k,
        p.softmax_scale,
        p.window_left,
        p.window_right,
        p.softcap,
        p.dropout_p,
        p.deterministic,
        p.startend_row_indices,
        p.mask_causal,
        p.learnable_sink,
        p.descales,
    )


def forward(q: Tensor, k: Tensor, v: Tensor, p: AttnParams) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, softmax_lse, rng_state)`` from ``tileattn::fwd``, which carries the autograd, or in eager
    mode on plain tensors the same implementation without the op's dispatch (``backend.direct``): through
    ``EagerAttention`` where a gradient may be asked for, else directly."""
    sink = p.learnable_sink
    if not backend.direct(q, k, v, sink):
        return torch.ops.tileattn.fwd(q, k, v, *op_options(p))
    wants_grad = q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
    if wants_grad and torch.is_grad_enabled():
        return EagerAttention.apply(q, k, v, *op_options(p))
    return forward_impl(q, k, v, *op_options(p))  # (nothing to differentiate: no autograd node to make)


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor, p: AttnParams
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` from ``tileattn::bwd`` (or its implementation directly, as ``forward``) for a
    forward that returned ``out``, ``lse`` and ``rng_state`` with the same ``p``."""
    op = backward_impl if backend.direct(dout, q, k, v, out, lse) else torch.ops.tileattn.bwd
    return op(dout, q, k, v, out, lse, rng_state, *op_options(p)[:-1])[:3]


def run(q: Tensor, k: Tensor, v: Tensor, p: AttnParams, return_attn_probs: bool):
    """The public functions' attention: ``out``, or ``(out, softmax_lse, S_dmask)`` with S_dmask only
    computed with dropout (else ``no_probs``), as in flash_attn."""
    out, lse, rng_state = forward(q, k, v, p)
    if not return_attn_probs:
        return out
    return out, lse, attn_probs(q, k, rng_state, p) if p.dropout_p > 0 else no_probs(q)


# --------------------------------------------------------------------------------------------------
# The eager path: one call signature checked once, its launches planned once
# --------------------------------------------------------------------------------------------------


class Call:
    """One signature of the training attention (``flash_attn_func``, ``flash_attn_varlen_func`` and their
    packed forms, ``flashmask_attention``): its validated ``AttnParams`` (the template: a call replaces its
    tensors, ``params``), checked once by the API for every later call with the same metadata, and the
    kernels' plans (``kernels.forward.plan_fwd``, ``kernels.backward.plan_bwd``) per settings, row counts
    and, for the backward, dO's layout. ``run`` is an eager call on plain tensors: one autograd node
    (``PlannedAttention``) where a gradient may be asked for, none otherwise, around the plans' launches;
    the CPU path runs its blockwise implementation instead. Calls with a FlashMask, dense batches past the
    grid's limit and calls without rows or keys keep their checks but run unplanned."""

    __slots__ = ("p", "fwd_plans", "bwd_plans", "planned", "dropout")

    def __init__(self, p: AttnParams, planned: bool):
        self.p, self.planned, self.dropout = p, planned, p.dropout_p > 0
        self.fwd_plans: dict = {}
        self.bwd_plans: dict = {}

    def params(self, alibi_slopes, cu_seqlens_q, cu_seqlens_k, learnable_sink, descales, seed: int) -> AttnParams:
        """This call's AttnParams: the template's options with the call's tensors and dropout seed."""
        p = object.__new__(AttnParams)
        p.__dict__.update(self.p.__dict__)
        p.alibi_slopes, p.cu_seqlens_q, p.cu_seqlens_k = alibi_slopes, cu_seqlens_q, cu_seqlens_k
        p.learnable_sink, p.descales, p.philox_seed = learnable_sink, descales, seed
        return p

    def run(self, q, k, v, p: AttnParams, return_attn_probs: bool):
        """The public functions' eager call: ``out``, or ``(out, softmax_lse, S_dmask)`` (``run``'s)."""
        sink = p.learnable_sink
        if sink is not None and (sink.dtype != torch.float32 or not sink.is_contiguous()):
            sink = p.learnable_sink = sink.float().contiguous()  # (checks.check_sink's; a gradient flows back)
        wants_grad = q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
        if self.dropout:
            if backend.capturing(q.device):
                raise NotImplementedError(DROPOUT_CAPTURE)
            p.philox_seed = rng.new_seed()
        if wants_grad and torch.is_grad_enabled():
            out, lse = PlannedAttention.apply(q, k, v, sink, self, p)
        else:
            out, lse = self.forward(q, k, v, p)
        if not return_attn_probs:
            return out
        rng_state = torch.tensor([p.philox_seed, 0], dtype=torch.int64)
        return out, lse, attn_probs(q, k, rng_state, p) if p.dropout_p > 0 else no_probs(q)

    def forward(self, q, k, v, p: AttnParams, settings: Settings | None = None) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` under ``settings`` (None: the current ones)."""
        if not self.planned:
            out, lse, rng_state = forward_impl(q, k, v, *op_options(p))
            p.philox_seed = int(rng_state[0])  # (the seed it drew, which the backward regenerates the mask from)
            return out, lse
        tokens_q, tokens_k = _tokens(q, k, p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k)
        if tokens_k == 0:
            return torch.zeros_like(q, dtype=_out_dtype(q)), _no_keys_lse(p, q)
        if tokens_k < k.shape[0]:  # the kernels see the sequences' rows only (_used_rows)
            k, v = k[:tokens_k], v[:tokens_k]
        if settings is None:
            settings = configs.current(q.device)
        impl = backend.implementation(q)
        with backend.on_device(q):
            if impl is cpu or (not p.is_varlen and p.batch > settings.grid_z_batch):
                out, lse = impl.attn_fwd(q, k, v, p, settings)
            else:
                key = (settings, tokens_k)
                plan = self.fwd_plans.get(key)
                if plan is None:
                    from tileattn.kernels import forward as kernels  # (Triton loads on first use)

                    plan = remember(self.fwd_plans, key, kernels.plan_fwd(q, k, v, p, settings), 8)
                out, lse = plan.run(q, k, v, p)
        if tokens_q < q.shape[0]:  # padding rows after the last sequence see no key, nor the sinks
            out[tokens_q:] = 0
            lse[:, tokens_q:] = float("inf")
        return _like(out, q), lse

    def backward(self, dout, q, k, v, out, lse, p: AttnParams, settings: Settings):
        """``(dq, dk, dv, dsink)`` of a forward this call ran with ``p`` under ``settings`` (dsink None without
        sinks)."""
        if not self.planned:
            with configs.override(settings):
                return backward_impl(dout, q, k, v, out, lse, torch.tensor([p.philox_seed, 0]), *op_options(p)[:-1])
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        tokens_q, tokens_k = _tokens(q, k, p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k)
        if tokens_q == 0 or tokens_k == 0:
            dsink = _no_dsink(p.learnable_sink) if p.learnable_sink is not None else None
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsink
        whole = tokens_q == q.shape[0] and tokens_k == k.shape[0]
        if not whole:  # padding rows after the last sequence: the kernels see the sequences' rows only
            rows_q, rows_k = slice(0, tokens_q), slice(0, tokens_k)
            args = (dout[rows_q], q[rows_q], k[rows_k], v[rows_k], out[rows_q], lse[:, rows_q].contiguous())
        else:
            args = (dout, q, k, v, out, lse)
        impl = backend.implementation(q)
        with backend.on_device(q):
            if impl is cpu or (not p.is_varlen and p.batch > settings.grid_z_batch):
                grads = impl.attn_bwd(*args, p, settings)
            else:
                key = (settings, tokens_q, tokens_k, dout.stride(), dout.data_ptr() % 16, out.stride())
                plan = self.bwd_plans.get(key)
                if plan is None:
                    from tileattn.kernels import backward as kernels

                    plan = remember(self.bwd_plans, key, kernels.plan_bwd(*args, p, settings), 8)
                grads = plan.run(*args, p)
        dq, dk, dv, dsink = grads
        if dsink is None and p.learnable_sink is not None:
            dsink = _no_dsink(p.learnable_sink)
        if whole:
            return _like(dq, q), _like(dk, k), _like(dv, v), dsink
        padded = []
        for g, t, used in zip((dq, dk, dv), (q, k, v), (rows_q, rows_k, rows_k)):
            full = torch.zeros_like(t)
            full[used] = g
            padded.append(full)
        return (*padded, dsink)


class PlannedAttention(torch.autograd.Function):
    """The eager call's autograd node: ``Call.forward`` and ``Call.backward`` (the settings of the forward,
    as autograd may run the backward on another thread, where an override of the calling thread is not
    set). Inputs q, k, v and the sinks (or None); the LSE is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, sink, call: Call, p: AttnParams):
        settings = configs.current(q.device)
        out, lse = call.forward(q, k, v, p, settings)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call, ctx.p, ctx.settings = call, p, settings
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        if ctx.p.is_fp8:
            raise NotImplementedError(FP8_BACKWARD)
        dq, dk, dv, dsink = ctx.call.backward(dout, *ctx.saved_tensors, ctx.p, ctx.settings)
        return dq, dk, dv, dsink if ctx.p.learnable_sink is not None else None, None, None
