"""Inference against a KV cache: ``flash_attn_with_kvcache`` (flash_attn 2.8's signature and semantics),
and the paged prefill behind ``flash_attn_varlen_func(..., block_table=...)``.

Order of work in one call: validate the metadata (shapes, dtypes, devices, options) and raise what
the kernels of an earlier call found wrong (``tileattn.errors``); check the values of cache_seqlens /
cache_leftpad / cache_batch_idx / block_table / rotary tables; rotate the new keys and write them and
the new values into the cache in place; attend over the updated cache with the decode kernel
(``kernels.decode``, which rotates the queries as it reads them), or the PyTorch path for CPU tensors.
The metadata checks run here; the value checks, the append and the attention are the custom ops of
``tileattn.ops.kvcache``.

The values of CUDA tensors are checked by the kernels as they read them, without a device sync: a bad
one is raised by the next call on the device, or by ``tileattn.check_errors()``, and its batch entry
appends nothing. CPU tensors' values, and CUDA tensors' with ``TILEATTN_SYNC_CHECKS=1``
(``Settings.sync_checks``), are read on the host before anything runs, so that a rejected call leaves
the caches untouched. Under CUDA graph capture they are not checked (``tileattn.ops.kvcache`` says what
holds in each case).
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch
from torch import Tensor

from tileattn import backend, checks, fp8
from tileattn.ops import kvcache as ops
from tileattn.params import remember


class _NoBackward(torch.autograd.Function):
    """Ties a forward-only call's outputs to its inputs that require grad: a backward that reaches them
    raises ``message``, instead of a silent gradient of zero (or none)."""

    @staticmethod
    def forward(ctx, message: str, num_outputs: int, *tensors: Tensor):
        ctx.message = message
        return tensors[:num_outputs]  # (returned as they are: autograd makes views, no copy)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.message)


def forward_only(message: str, names: tuple[str, ...]):
    """Decorates a function without a backward: when grad mode is on and an argument in ``names`` (or a
    tensor value of a dict argument in ``names``) requires grad, it runs as under ``torch.no_grad()`` and its
    outputs raise ``NotImplementedError(message)`` if and when a backward reaches them."""

    def decorate(fn):
        params = list(inspect.signature(fn).parameters)
        places = [(params.index(name), name) for name in names]

        def needing_grad(given) -> list[Tensor]:
            tensors = (t for value in given for t in (value.values() if isinstance(value, dict) else (value,)))
            return [t for t in tensors if isinstance(t, Tensor) and t.requires_grad]

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if torch.is_grad_enabled():  # (a plain loop: this runs on every decode step's host path)
                n = len(args)
                for i, name in places:
                    value = args[i] if i < n else kwargs.get(name)
                    if getattr(value, "requires_grad", False) or (isinstance(value, dict) and needing_grad([value])):
                        return tied(args, kwargs, n)
            return fn(*args, **kwargs)

        def tied(args, kwargs, n):
            inputs = needing_grad(args[i] if i < n else kwargs.get(name) for i, name in places)
            with torch.no_grad():
                result = fn(*args, **kwargs)
            outs = result if isinstance(result, tuple) else (result,)
            outs = _NoBackward.apply(message, len(outs), *outs, *inputs)
            return tuple(outs) if isinstance(result, tuple) else outs[0]

        return run

    return decorate


@forward_only(
    "flash_attn_with_kvcache has no backward (it is for inference, as in flash_attn): call it under "
    "torch.no_grad() or torch.inference_mode(), or train with flash_attn_func / flash_attn_varlen_func",
    ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "alibi_slopes", "learnable_sink", "s_aux"),
)
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    """Attention of new queries against a KV cache, appending new keys/values to it in place first.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_cache, capacity, nheads_k, headdim)``, or with ``block_table`` paged
            ``(num_pages, page_block_size, nheads_k, headdim)`` (any page size).
        k, v: optional ``(batch, seqlen_new, nheads_k, headdim)``, written into the caches at positions
            ``cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1`` (in place) before attending.
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)`` tables (needs k and v): k is
            rotated at its cache positions; q at positions ``cache_seqlens + i`` when causal or windowed
            (a window side narrower than the cache, as in flash_attn), else all of q at
            ``cache_seqlens``. The first rotary_dim channels rotate.
        cache_seqlens: int or int32 ``(batch,)``: tokens already in each sequence's cache (None: the
            whole capacity, only without k/v). An int is checked at once. The index tensors'
            values (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, and the rotary tables'
            length against the positions they must cover) are checked, for CUDA tensors, by the
            kernels where they read them, with no device sync: a value out of range is raised as
            ``InvalidArgument`` by the next call of this function (or of the paged
            ``flash_attn_varlen_func`` or ``flash_mla_with_kvcache``) on the device that starts after
            the GPU has run this one, and by ``tileattn.check_errors()``, which synchronises first (call
            it where you want errors surfaced: after each step). That call's outputs for the entry are
            then unspecified, its append wrote nothing for the entry (unless the only bad value was a
            block-table entry of older keys), no other sequence's cache row or page was written, and
            nothing outside the caches was read. CPU tensors, and CUDA tensors with
            ``TILEATTN_SYNC_CHECKS=1`` (``Settings.sync_checks=True``), are read on the host before
            anything runs instead (a device sync), once until a torch op changes one of them: the layers
            of a decode step share one check. Writes that bypass PyTorch's version counter (``.data``,
            ``.numpy()``, DLPack, your own kernels, the replay of a CUDA graph that updates them) are not
            seen then: pass a new tensor instead. Inference tensors (``torch.inference_mode``) have no
            version counter and are read on every call. Under CUDA graph capture the values are not
            checked at all (the kernels still clamp every index).
        cache_batch_idx: int32 ``(batch,)``: the cache row of each sequence (dense caches only).
        cache_leftpad: int32 ``(batch,)``: a sequence's keys start at this cache position.
        block_table: int32 ``(batch, max_pages)``: page of each ``page_block_size`` keys.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in ``flash_attn_func``; the keys
            of sequence b are ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)`` and masks align the
            last query with the last key.
        rotary_interleaved: GPT-J style pairs (0, 1), (2, 3)... if True, else GPT-NeoX halves.
        num_splits: split each sequence's keys over this many programs (Flash-Decoding); 0 picks a
            count that fills the GPU; 1 disables splitting.
        return_softmax_lse: also return the fp32 LSE ``(batch, nheads, seqlen_q)`` (+inf for rows that
            see no key; with sinks, the sink is in it).
        k_descale, v_descale: keyword-only, for FP8 caches (``torch.float8_e4m3fn`` k_cache and v_cache,
            with float16/bfloat16 q, k, v): fp32 ``(batch, nheads_k)`` factors (None: 1.0), sequence b's
            keys and values of kv head h being ``cache * descale[b, h]``. New k and v are divided by them,
            saturated at ±448 and rounded to e4m3 as they are written; the decode kernel widens the
            cache's tiles to fp16 (or, as ``DecodeSettings.fp8_widen`` says, quantizes q's rows and the
            probabilities for the FP8 tensor cores) and folds the factors into the scores and the output.
        learnable_sink: keyword-only, attention sinks as in ``flash_attn_func`` (fp32 ``(nheads,)``;
            ``s_aux`` is the same argument under vLLM's name); forward only here, as the whole call.

    Returns:
        ``out (batch, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse)``. There is no backward, as in
        flash_attn: inputs may require grad, and a backward that reaches the outputs raises
        NotImplementedError.

    Metadata is validated before the caches are written, and index values too for CPU tensors or with
    ``TILEATTN_SYNC_CHECKS=1``; CUDA calls check index values in their kernels (``cache_seqlens`` above;
    the module docstring for CUDA graph capture).
    """
    # the op's implementation directly in eager mode on plain tensors (backend.direct: no dispatcher overhead);
    # there, checks and launch plans are kept per call signature (none while tracing or under a mode)
    direct = backend.direct(q, k_cache, v_cache, k, v)
    key = None
    if direct:
        key = _call_key(
            (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad)
            + (block_table, alibi_slopes, k_descale, v_descale, learnable_sink, s_aux),
            (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits),
            return_softmax_lse,
        )
    try:
        call = calls.get(key) if key is not None else None
    except TypeError:  # an unhashable value (the checks will say what is wrong with it)
        key = call = None
    if call is None:
        call = _check_call(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos,
            rotary_sin,
            cache_seqlens,
            cache_batch_idx,
            cache_leftpad,
            block_table,
            softmax_scale,
            causal,
            window_size,
            softcap,
            rotary_interleaved,
            alibi_slopes,
            num_splits,
            return_softmax_lse,
            k_descale,
            v_descale,
            learnable_sink,
            s_aux,
        )
        if key is not None:
            remember(calls, key, call, _MAX_CALLS)
    elif direct:  # an eager call of a known signature: the launches of the last such call, where they apply
        replayed = ops.replay_kvcache(
            call.plans, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
            alibi_slopes, *call.descales(k_descale, v_descale), return_softmax_lse, _sink(learnable_sink, s_aux),
        )  # fmt: skip
        if replayed is not None:
            return replayed if return_softmax_lse else replayed[0]
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens_value = None
        seqlens = cache_seqlens.contiguous()
    else:  # an int, or None: the whole capacity
        seqlens_value = call.capacity if cache_seqlens is None else int(cache_seqlens)
        if not 0 <= seqlens_value <= call.capacity:  # (int32 below; the new tokens are checked with the rest)
            raise checks.InvalidArgument(
                f"cache_seqlens must be in [0, {call.capacity}] (the cache capacity), got {seqlens_value}"
            )
        seqlens = torch.full((call.batch,), seqlens_value, dtype=torch.int32, device=q.device)
    args = (
        checks.contiguous_last(q),  # (q, k and v are only read: copied if need be, as flash_attn does)
        k_cache,
        v_cache,
        checks.contiguous_last(k) if k is not None else None,
        checks.contiguous_last(v) if v is not None else None,
        rotary_cos.contiguous() if rotary_cos is not None else None,  # (the kernel reads both with one stride)
        rotary_sin.contiguous() if rotary_sin is not None else None,
        seqlens,
        cache_batch_idx.contiguous() if cache_batch_idx is not None else None,
        cache_leftpad.contiguous() if cache_leftpad is not None else None,
        block_table.contiguous() if block_table is not None else None,
        alibi_slopes.contiguous() if alibi_slopes is not None else None,
        call.scale,
        call.left,
        call.right,
        call.softcap,
        rotary_interleaved,
        call.num_splits,
        call.q_span,
        *call.descales(k_descale, v_descale),
        _sink(learnable_sink, s_aux),
    )
    if direct:
        given = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad)
        as_given = all(a is b for a, b in zip(args, given + (block_table, alibi_slopes))) and all(
            d is None or d.is_contiguous() for d in (k_descale, v_descale)
        )  # (the replayed launches take the arguments as they come: none may need a copy)
        out, lse = ops.fwd_kvcache_impl(
            *args, plans=call.plans, seqlens_value=seqlens_value, replay=key is not None and as_given
        )
        if k is not None:  # what the op's dispatcher does for its mutated arguments
            torch.autograd.graph.increment_version((k_cache, v_cache))
    else:
        out, lse = torch.ops.tileattn.fwd_kvcache(*args)
    return (out, lse) if return_softmax_lse else out


_MAX_CALLS = 1024  # call keys remembered (see flash_attn_with_kvcache); beyond that the oldest go
calls: dict[tuple, _Call] = {}


class _Unkeyed(Exception):
    pass


def _other_meta(t: object) -> type:
    if isinstance(t, torch.Tensor):  # a subclass: no key
        raise _Unkeyed
    return type(t)


def _call_key(tensors: tuple, scalars: tuple, return_lse: object) -> tuple | None:
    """The key of a flash_attn_with_kvcache call's metadata: everything its checks and launch plans read
    except index values. A plain tensor enters by shape, strides, dtype, device and address alignment
    (Triton specialises on 16-byte alignment); None as None; any other object by type (the checks
    refuse those but an int cache_seqlens, whose value is read per call). Scalars enter with their types
    (True == 1 and 1.0 == 1 as keys). None: no key (a tensor subclass, or a window_size that is not a
    tuple of two ints): the call is checked in full."""
    scale, causal, window, softcap, interleaved, num_splits = scalars
    if type(window) is not tuple or len(window) != 2 or type(window[0]) is not int or type(window[1]) is not int:
        return None
    tensor = torch.Tensor
    try:
        metas = [
            (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
            if type(t) is tensor
            else None
            if t is None
            else _other_meta(t)
            for t in tensors
        ]
    except _Unkeyed:
        return None
    values = (scale, causal, *window, softcap, interleaved, num_splits, return_lse)
    return (*metas, values, tuple(map(type, values)))


def _check_call(
    q,
    k_cache,
    v_cache,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    softmax_scale,
    causal,
    window_size,
    softcap,
    rotary_interleaved,
    alibi_slopes,
    num_splits,
    return_softmax_lse,
    k_descale=None,
    v_descale=None,
    learnable_sink=None,
    s_aux=None,
) -> _Call:
    """Every check of flash_attn_with_kvcache's arguments that their metadata decides (all but the index
    values, which the ops check: ``checks.cache_values`` on the host, or the kernels): the normalised
    call, or a clear error."""
    q = checks.check_tensor("q", q, "(batch, seqlen_q, nheads, headdim)")
    layout = "(batch_cache or num_pages, seqlen_cache or page_block_size, nheads_k, headdim)"
    k_cache = checks.check_tensor("k_cache", k_cache, layout)
    v_cache = checks.check_tensor("v_cache", v_cache, layout)
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise checks.InvalidArgument("k and v must be given together (the new keys and values to append), or neither")
    has_new = k is not None
    if has_new:
        named["k"] = checks.check_tensor("k", k, "(batch, seqlen_new, nheads_k, headdim)")
        named["v"] = checks.check_tensor("v", v, "(batch, seqlen_new, nheads_k, headdim)")
    fp8_cache = fp8.is_fp8(k_cache) or fp8.is_fp8(v_cache)
    dtype, device = checks.check_inputs(named, in_place=("k_cache", "v_cache"), fp8=fp8_cache)
    if k_cache.shape != v_cache.shape:
        raise checks.InvalidArgument(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k = k_cache.shape[2]
    checks.check_heads(nheads, nheads_k, headdim, k_cache.shape[3], v_cache.shape[3], ("q", "k_cache", "v_cache"))
    if has_new:
        seqlen_new = k.shape[1]
        expected = (batch, seqlen_new, nheads_k, headdim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise checks.InvalidArgument(
                    f"{name} must have shape (batch, seqlen_new, nheads_k, headdim) = {expected} to match q and "
                    f"the cache, got {tuple(t.shape)}"
                )

    if block_table is not None:
        block_table = checks.check_table(block_table, batch, k_cache.shape[0], device)
        max_pages = block_table.shape[1]
        if cache_batch_idx is not None:
            raise checks.InvalidArgument(
                "cache_batch_idx cannot be combined with block_table (the table already maps pages)"
            )
        page_size = k_cache.shape[1]
        if page_size < 1:
            raise checks.InvalidArgument(f"k_cache: page_block_size must be at least 1, got {page_size}")
        capacity = max_pages * page_size
    else:
        capacity, batch_cache = k_cache.shape[1], k_cache.shape[0]
        checks.check_extent(capacity, {"k_cache": k_cache, "v_cache": v_cache})
        if cache_batch_idx is None and batch_cache < batch:
            raise checks.InvalidArgument(
                f"k_cache holds {batch_cache} sequences but q has batch {batch}; pass cache_batch_idx to map them"
            )
    if cache_batch_idx is not None:
        checks.check_int32("cache_batch_idx", cache_batch_idx, (batch,), "(batch,)", device)
    if cache_seqlens is None:
        if has_new:
            raise checks.InvalidArgument("cache_seqlens is required with k and v: it says where the new tokens go")
    elif not isinstance(cache_seqlens, torch.Tensor) and checks.is_int(cache_seqlens):
        pass  # (its value is checked with the other index values)
    else:
        checks.check_int32("cache_seqlens", cache_seqlens, (batch,), "(batch,) or an int", device)
    if cache_leftpad is not None:
        checks.check_int32("cache_leftpad", cache_leftpad, (batch,), "(batch,)", device)
    checks.check_rotary(rotary_cos, rotary_sin, q, has_new)
    if not checks.is_int(num_splits) or num_splits < 0:
        raise checks.InvalidArgument(
            f"num_splits must be an int >= 0 (0 = heuristic, 1 = no split), got {num_splits!r}"
        )
    checks.check_flag("rotary_interleaved", rotary_interleaved)
    checks.check_flag("return_softmax_lse", return_softmax_lse)
    # (as flash_attn: window sides as wide as the cache are unbounded, in the mask and q's rotation)
    _, scale, left, right, softcap = checks.check_options(
        0.0, softmax_scale, causal, window_size, softcap, False, False, seqlen_k=capacity
    )
    local = left >= 0 or right >= 0
    checks.check_extent(seqlen_q, {"q": q})
    if batch > checks.MAX_DENSE_BATCH:
        raise NotImplementedError(f"batch {batch} is above {checks.MAX_DENSE_BATCH}; split it into several calls")
    checks.check_alibi(alibi_slopes, batch, nheads, device)
    checks.check_sink(learnable_sink, s_aux, nheads, device)
    ones = fp8.cache_descales(named, k_descale, v_descale, batch, nheads_k)
    return _Call(
        batch=batch,
        capacity=capacity,
        scale=checks.resolve_scale(scale, headdim),
        left=left,
        right=right,
        softcap=softcap,
        num_splits=int(num_splits),
        q_span=seqlen_q if (causal or local) else 1,
        plans={},
        ones=ones,
    )


def _sink(learnable_sink: Tensor | None, s_aux: Tensor | None) -> Tensor | None:
    """The op's ``learnable_sink`` (its two names already checked): fp32, contiguous, or None."""
    sink = learnable_sink if learnable_sink is not None else s_aux
    if sink is None or (sink.dtype == torch.float32 and sink.is_contiguous()):
        return sink
    return sink.float().contiguous()


class _Call(NamedTuple):
    """A validated flash_attn_with_kvcache call, normalised (capacity: of each sequence's cache row or
    pages). ``plans``: where the kernels keep the launch plans of calls with this metadata
    (``CacheLayout.plans``). Its tensors are the call's device's (a call key includes the device)."""

    batch: int
    capacity: int
    scale: float
    left: int
    right: int
    softcap: float
    num_splits: int
    q_span: int
    plans: dict
    ones: Tensor | None  # FP8 caches: the descale a None stands for, fp32 (batch, nheads_k) ones

    def descales(self, k_descale: Tensor | None, v_descale: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """The op's ``(k_descale, v_descale)``: contiguous, ones for None, with FP8 caches; else Nones."""
        if self.ones is None:
            return None, None
        return tuple(self.ones if d is None else d.contiguous() for d in (k_descale, v_descale))


@forward_only(
    "flash_attn_varlen_func with block_table (paged prefill) has no backward through the pages, as in "
    "flash_attn 2.8.3, whose varlen backward takes no block_table: differentiate a call with k and v packed "
    "by cu_seqlens_k instead, or run the paged call under torch.no_grad()",
    ("q", "k", "v", "p_options"),
)
def paged_varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: Tensor,
    p_options: dict,
) -> tuple[Tensor, Tensor]:
    """``flash_attn_varlen_func`` with ``block_table``: queries packed by cu_seqlens_q, the keys of
    sequence b are the first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` positions of its pages in
    ``k``/``v (num_pages, page_block_size, nheads_k, headdim)``. Forward only, as in flash_attn 2.8.3.
    Returns ``(out, softmax_lse)``, the LSE fp32 ``(nheads, total_q)``."""
    device = q.device
    checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, device)
    checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, device)
    batch = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != batch + 1:
        raise checks.InvalidArgument(
            f"cu_seqlens_k must have batch + 1 = {batch + 1} entries, got {cu_seqlens_k.numel()}"
        )
    if batch > checks.MAX_DENSE_BATCH:
        raise NotImplementedError(f"cu_seqlens_q describes {batch} sequences; at most {checks.MAX_DENSE_BATCH}")
    block_table = checks.check_table(block_table, batch, k.shape[0], device)
    if p_options["dropout_p"] != 0.0:
        raise NotImplementedError(
            "flash_attn_varlen_func: dropout with a paged KV cache (block_table) is not supported"
        )
    _, scale, left, right, softcap = checks.check_options(
        0.0,
        p_options["softmax_scale"],
        p_options["causal"],
        p_options["window_size"],
        p_options["softcap"],
        p_options["deterministic"],
        p_options["return_attn_probs"],
        seqlen_k=int(max_seqlen_k),
    )
    sink = checks.check_sink(p_options["learnable_sink"], p_options["s_aux"], q.shape[1], device)
    op = ops.fwd_paged_varlen_impl if backend.direct(q, k, v) else torch.ops.tileattn.fwd_paged_varlen
    return op(
        q,
        k,
        v,
        cu_seqlens_q.contiguous(),
        cu_seqlens_k.contiguous(),
        block_table,
        checks.check_alibi(p_options["alibi_slopes"], batch, q.shape[1], device),
        int(max_seqlen_q),
        int(max_seqlen_k),
        checks.resolve_scale(scale, q.shape[-1]),
        left,
        right,
        softcap,
        sink,
    )
