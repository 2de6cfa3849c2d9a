"""Inference against a KV cache: ``flash_attn_with_kvcache`` (flash_attn 2.8's signature and semantics),
and the paged prefill behind ``flash_attn_varlen_func(..., block_table=...)``.

Order of work in one call: validate everything (shapes, dtypes, devices, then the values of
cache_seqlens / cache_leftpad / cache_batch_idx / block_table / rotary tables, read on the host in one
transfer) so that a rejected call leaves the caches untouched; rotate the new keys and write them
and the new values into the cache in place; attend over the updated cache with the decode kernel
(``kernels.decode``, which rotates the queries as it reads them), or the PyTorch path for CPU tensors.

Under CUDA graph capture the value checks are skipped (they would need a device-to-host copy, which
capture forbids): the kernels still clamp every index and rotary position so that they never read
outside the caches and the rotary tables, and drop appends outside the caches, but out-of-range values
then give unspecified results instead of an error.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import Tensor

from tileattn import api
from tileattn.kernels.configs import AttnParams, remember
from tileattn.kernels.decode import CacheLayout


def _check_int32(name: str, t: object, shape: tuple[int, ...], layout: str, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape {layout}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t.contiguous()


def _check_table(block_table: object, batch: int, num_pages: int, device: torch.device) -> torch.Tensor:
    if isinstance(block_table, torch.Tensor) and block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D (batch, max_pages), got shape {tuple(block_table.shape)}")
    max_pages = block_table.shape[1] if isinstance(block_table, torch.Tensor) else 0
    table = _check_int32("block_table", block_table, (batch, max_pages), "(batch, max_pages)", device)
    if num_pages == 0 and table.numel() > 0:  # (no entry could be valid; the kernels clamp to the pool)
        raise ValueError(f"k_cache holds no pages (shape[0] == 0) for a block_table of {max_pages} columns")
    return table


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _check_rotary(cos: object, sin: object, q: torch.Tensor, has_new: bool) -> None:
    if cos is None and sin is None:
        return
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if not has_new:
        raise ValueError(
            "rotary_cos/rotary_sin rotate the new tokens at their cache positions: pass k and v with them "
            "(rotate q yourself with tileattn.rotary.apply_rotary_emb when nothing is appended)"
        )
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2)")
        if t.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must have q's dtype ({q.dtype}) or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if cos.shape[0] == 0:
        raise ValueError("rotary_cos and rotary_sin have no rows (seqlen_ro = 0): they need a row per position")
    rotary_dim = 2 * cos.shape[1]
    if not 2 <= rotary_dim <= q.shape[-1]:
        raise ValueError(
            f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be between 2 and the head dim ({q.shape[-1]})"
        )


def _first_bad(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _check_values(
    seqlens: torch.Tensor,
    seqlen_new: int,
    capacity: int,
    leftpad: torch.Tensor | None,
    batch_idx: torch.Tensor | None,
    batch_cache: int,
    block_table: torch.Tensor | None,
    num_pages: int,
    page_size: int,
    rotary_len: int | None,
    rotary_span: int,
    seqlens_name: str = "cache_seqlens",
) -> int:
    """Device-side index values against their bounds, read back in one transfer; returns the longest
    key range (seqlens + seqlen_new). Messages name the first offending batch entry."""
    ends = seqlens.long() + seqlen_new
    checks = [seqlens.min(), ends.max()]
    if leftpad is not None:
        checks.append(((leftpad < 0) | (leftpad > seqlens)).any())
    if batch_idx is not None:
        checks.append(((batch_idx < 0) | (batch_idx >= batch_cache)).any())
        if seqlen_new:  # two entries appending into one cache row would race for it
            rows = batch_idx.sort().values
            checks.append((rows[1:] == rows[:-1]).any())
    if block_table is not None:
        used = torch.arange(block_table.shape[1], device=seqlens.device) < (ends + page_size - 1).div(
            page_size, rounding_mode="floor"
        ).unsqueeze(1)
        bad_pages = used & ((block_table < 0) | (block_table >= num_pages))
        checks.append(bad_pages.any())
    values = torch.stack([c.long() for c in checks]).tolist()
    lowest, longest = values[0], values[1]
    flags = iter(values[2:])
    if lowest < 0:
        b = _first_bad(seqlens < 0)
        raise ValueError(f"{seqlens_name} must be >= 0, got {int(seqlens[b])} at batch entry {b}")
    if longest > capacity:
        b = _first_bad(ends > capacity)
        raise ValueError(
            f"{seqlens_name}[{b}] + seqlen_new = {int(seqlens[b])} + {seqlen_new} exceeds the cache capacity "
            f"{capacity} (seqlen of k_cache, or block_table.shape[1] * page_block_size)"
        )
    if leftpad is not None and next(flags):
        b = _first_bad((leftpad < 0) | (leftpad > seqlens))
        raise ValueError(
            f"cache_leftpad must be in [0, cache_seqlens], got {int(leftpad[b])} with cache_seqlens "
            f"{int(seqlens[b])} at batch entry {b}"
        )
    if batch_idx is not None and next(flags):
        b = _first_bad((batch_idx < 0) | (batch_idx >= batch_cache))
        raise ValueError(f"cache_batch_idx must be in [0, {batch_cache}), got {int(batch_idx[b])} at batch entry {b}")
    if batch_idx is not None and seqlen_new and next(flags):
        rows = batch_idx.tolist()
        b = next(i for i, row in enumerate(rows) if row in rows[:i])
        raise ValueError(
            f"cache_batch_idx[{b}] = {rows[b]} repeats an earlier entry: with new k and v each batch entry "
            "must append into a cache row of its own"
        )
    if block_table is not None and next(flags):
        b, j = (int(x) for x in bad_pages.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache: entries covering "
            f"a sequence's keys must be in [0, {num_pages})"
        )
    if rotary_len is not None and lowest >= 0 and longest - seqlen_new + rotary_span > rotary_len:
        raise ValueError(
            f"rotary_cos/rotary_sin have {rotary_len} positions but position "
            f"{longest - seqlen_new + rotary_span - 1} is needed (cache_seqlens + the new tokens, or + the "
            "query tokens when q rotates per token and is longer)"
        )
    return longest


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
            whole capacity, only without k/v). The index tensors (cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table) are read on the host to validate them, once until a torch op
            changes one of them: the layers of a decode step share one check. Writes that bypass
            PyTorch's version counter (``.data``, ``.numpy()``, DLPack, your own kernels, the replay
            of a CUDA graph that updates them) are not seen: pass a new tensor instead. Inference
            tensors (``torch.inference_mode``) have no version counter and are read on every call.
            Under CUDA graph capture they are not read at all.
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
            see no key).

    Returns:
        ``out (batch, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse)``.

    Validation (including index values, read on the host) happens before the caches are written; see
    the module docstring for CUDA graph capture.
    """
    # the op's implementation directly in eager mode on plain tensors (api.direct: no dispatcher overhead);
    # there, checks and launch plans are kept per call signature (none while tracing or under a mode)
    direct = api.direct(q, k_cache, v_cache, k, v)
    key = None
    if direct:
        key = _call_key(
            (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad)
            + (block_table, alibi_slopes),
            (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits),
            return_softmax_lse,
        )
    try:
        call = _CALLS.get(key) if key is not None else None
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
        )
        if key is not None:
            remember(_CALLS, key, call, _MAX_CALLS)
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens_value = None
        seqlens = cache_seqlens.contiguous()
    else:  # an int, or None: the whole capacity
        seqlens_value = call.capacity if cache_seqlens is None else int(cache_seqlens)
        if not 0 <= seqlens_value <= call.capacity:  # (int32 below; the new tokens are checked with the rest)
            raise ValueError(f"cache_seqlens must be in [0, {call.capacity}] (the cache capacity), got {seqlens_value}")
        seqlens = torch.full((call.batch,), seqlens_value, dtype=torch.int32, device=q.device)
    args = (
        q,
        k_cache,
        v_cache,
        k,
        v,
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
    )
    if direct:
        out, lse = _fwd_kvcache(*args, plans=call.plans, seqlens_value=seqlens_value)
        if k is not None:  # what the op's dispatcher does for its mutated arguments
            torch.autograd.graph.increment_version((k_cache, v_cache))
    else:
        out, lse = torch.ops.tileattn.fwd_kvcache(*args)
    return (out, lse) if return_softmax_lse else out


_MAX_CALLS = 1024  # call keys remembered (see flash_attn_with_kvcache); beyond that the oldest go
_CALLS: dict[tuple, _Call] = {}


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
    tuple): the call is checked in full."""
    scale, causal, window, softcap, interleaved, num_splits = scalars
    if type(window) is not tuple:
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
) -> _Call:
    """Every check of flash_attn_with_kvcache's arguments that their metadata decides (all but the index
    values, which ``_check_values`` reads on the device): the normalised call, or a clear error."""
    q = api._check_tensor("q", q, "(batch, seqlen_q, nheads, headdim)")
    layout = "(batch_cache or num_pages, seqlen_cache or page_block_size, nheads_k, headdim)"
    k_cache = api._check_tensor("k_cache", k_cache, layout)
    v_cache = api._check_tensor("v_cache", v_cache, layout)
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append), or neither")
    has_new = k is not None
    if has_new:
        named["k"] = api._check_tensor("k", k, "(batch, seqlen_new, nheads_k, headdim)")
        named["v"] = api._check_tensor("v", v, "(batch, seqlen_new, nheads_k, headdim)")
    dtype, device = api._check_inputs(named)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k = k_cache.shape[2]
    api._check_heads(nheads, nheads_k, headdim, k_cache.shape[3], v_cache.shape[3])
    if has_new:
        seqlen_new = k.shape[1]
        expected = (batch, seqlen_new, nheads_k, headdim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"{name} must have shape (batch, seqlen_new, nheads_k, headdim) = {expected} to match q and "
                    f"the cache, got {tuple(t.shape)}"
                )

    if block_table is not None:
        block_table = _check_table(block_table, batch, k_cache.shape[0], device)
        max_pages = block_table.shape[1]
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (the table already maps pages)")
        page_size = k_cache.shape[1]
        if page_size < 1:
            raise ValueError(f"k_cache: page_block_size must be at least 1, got {page_size}")
        capacity = max_pages * page_size
    else:
        capacity, batch_cache = k_cache.shape[1], k_cache.shape[0]
        api._check_extent(capacity, {"k_cache": k_cache, "v_cache": v_cache})
        if cache_batch_idx is None and batch_cache < batch:
            raise ValueError(
                f"k_cache holds {batch_cache} sequences but q has batch {batch}; pass cache_batch_idx to map them"
            )
    if cache_batch_idx is not None:
        _check_int32("cache_batch_idx", cache_batch_idx, (batch,), "(batch,)", device)
    if cache_seqlens is None:
        if has_new:
            raise ValueError("cache_seqlens is required with k and v: it says where the new tokens go")
    elif not isinstance(cache_seqlens, torch.Tensor) and api._is_int(cache_seqlens):
        pass  # (its value is checked with the other index values)
    else:
        _check_int32("cache_seqlens", cache_seqlens, (batch,), "(batch,) or an int", device)
    if cache_leftpad is not None:
        _check_int32("cache_leftpad", cache_leftpad, (batch,), "(batch,)", device)
    _check_rotary(rotary_cos, rotary_sin, q, has_new)
    if not api._is_int(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = heuristic, 1 = no split), got {num_splits!r}")
    _check_flag("rotary_interleaved", rotary_interleaved)
    _check_flag("return_softmax_lse", return_softmax_lse)
    # (as flash_attn: window sides as wide as the cache are unbounded, in the mask and q's rotation)
    _, scale, left, right, softcap = api._check_options(
        0.0, softmax_scale, causal, window_size, softcap, False, False, seqlen_k=capacity
    )
    local = left >= 0 or right >= 0
    api._check_extent(seqlen_q, {"q": q})
    if batch > api.MAX_DENSE_BATCH:
        raise NotImplementedError(f"batch {batch} is above {api.MAX_DENSE_BATCH}; split it into several calls")
    api._check_alibi(alibi_slopes, batch, nheads, device)
    return _Call(
        batch=batch,
        capacity=capacity,
        scale=api.resolve_scale(scale, headdim),
        left=left,
        right=right,
        softcap=softcap,
        num_splits=int(num_splits),
        q_span=seqlen_q if (causal or local) else 1,
        plans={},
    )


class _Call(NamedTuple):
    """A validated flash_attn_with_kvcache call, normalised (capacity: of each sequence's cache row or
    pages). ``plans``: where the kernels keep the launch plans of calls with this metadata
    (``CacheLayout.plans``)."""

    batch: int
    capacity: int
    scale: float
    left: int
    right: int
    softcap: float
    num_splits: int
    q_span: int
    plans: dict


def _fwd_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    rotary_cos: Tensor | None,
    rotary_sin: Tensor | None,
    seqlens: Tensor,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    block_table: Tensor | None,
    alibi_slopes: Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    num_splits: int,
    q_span: int,
    plans: dict | None = None,
    seqlens_value: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``tileattn::fwd_kvcache`` op: value checks, rotary, the in-place append and the attention
    (metadata already validated). Two arguments only the eager API passes (the op's schema leaves them
    out): ``plans``, the table in which the kernels plan the launches of calls with this call's metadata
    once (``CacheLayout.plans``), and ``seqlens_value``, the value of every entry of ``seqlens`` when the
    caller gave cache_seqlens as an int (its checks are then remembered with the other index tensors'
    instead of reading a new tensor every call)."""
    batch, seqlen_q = q.shape[:2]
    device = q.device
    seqlen_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    max_seqlen_k = None
    if batch and not _capturing(device):
        rotary_len = rotary_cos.shape[0] if rotary_cos is not None else None
        span = max(seqlen_new, q_span)
        cache_rows, page_size = k_cache.shape[:2]  # batch_cache, or num_pages and page_size when paged

        def check() -> int:
            return _check_values(
                seqlens,
                seqlen_new,
                capacity,
                cache_leftpad,
                cache_batch_idx,
                cache_rows,
                block_table,
                cache_rows,
                page_size,
                rotary_len,
                span,
            )

        # once per step, not per layer: the layers share cache_seqlens and block_table (api.checked_once)
        max_seqlen_k = api.checked_once(
            (seqlens if seqlens_value is None else None, cache_leftpad, cache_batch_idx, block_table),
            ("kvcache", seqlen_new, capacity, cache_rows, page_size, rotary_len, span, seqlens_value, batch),
            check,
        )
    p = AttnParams(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=capacity,
        headdim=q.shape[-1],
        softmax_scale=softmax_scale,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    impl = api._implementation(q)
    rotary = (rotary_cos, rotary_sin, rotary_interleaved) if rotary_cos is not None else None
    with api._on_device(q):
        impl.kvcache_append(k_cache, v_cache, k, v, rotary, seqlens, cache_batch_idx, block_table, plans)
        c = CacheLayout(
            seqlens_k=seqlens,
            new_tokens=seqlen_new,
            leftpad=cache_leftpad,
            batch_idx=cache_batch_idx,
            block_table=block_table,
            num_splits=num_splits,
            max_seqlen_k=max_seqlen_k,
            plans=plans,
            q_rotary=(*rotary, q_span > 1) if rotary is not None else None,
        )
        if q.numel() == 0:
            return torch.zeros(q.shape, dtype=q.dtype, device=device), p.new_lse(q).fill_(float("inf"))
        out, lse = impl.attn_fwd_kvcache(q, k_cache, v_cache, p, c)
    return out.contiguous(), lse


def _op_prototype():
    """Carries the op's signature: ``_fwd_kvcache``'s without its eager-only arguments."""


_signature = inspect.signature(_fwd_kvcache)
_op_prototype.__signature__ = _signature.replace(
    parameters=[p for name, p in _signature.parameters.items() if name not in ("plans", "seqlens_value")]
)
_MUTATED = ("k_cache", "v_cache")
_fwd_kvcache_op = torch.library.custom_op(
    "tileattn::fwd_kvcache",
    _fwd_kvcache,
    mutates_args=_MUTATED,
    schema=torch.library.infer_schema(_op_prototype, mutates_args=_MUTATED),
)


@_fwd_kvcache_op.register_fake
def _(q, *args):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


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
) -> Tensor:
    """``flash_attn_varlen_func`` with ``block_table``: queries packed by cu_seqlens_q, the keys of
    sequence b are the first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` positions of its pages in
    ``k``/``v (num_pages, page_block_size, nheads_k, headdim)``. Forward only."""
    device = q.device
    api._check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, device)
    api._check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, device)
    batch = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != batch + 1:
        raise ValueError(f"cu_seqlens_k must have batch + 1 = {batch + 1} entries, got {cu_seqlens_k.numel()}")
    if batch > api.MAX_DENSE_BATCH:
        raise NotImplementedError(f"cu_seqlens_q describes {batch} sequences; at most {api.MAX_DENSE_BATCH}")
    block_table = _check_table(block_table, batch, k.shape[0], device)
    if p_options["dropout_p"] != 0.0:
        raise NotImplementedError(
            "flash_attn_varlen_func: dropout with a paged KV cache (block_table) is not supported"
        )
    if p_options["return_attn_probs"]:
        raise NotImplementedError("flash_attn_varlen_func: return_attn_probs with block_table is not supported")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("flash_attn_varlen_func with block_table is forward only (no backward through pages)")
    _, scale, left, right, softcap = api._check_options(
        0.0,
        p_options["softmax_scale"],
        p_options["causal"],
        p_options["window_size"],
        p_options["softcap"],
        p_options["deterministic"],
        False,
        seqlen_k=int(max_seqlen_k),
    )
    op = _fwd_paged_varlen_impl if api.direct(q, k, v) else torch.ops.tileattn.fwd_paged_varlen
    return op(
        q,
        k,
        v,
        cu_seqlens_q.contiguous(),
        cu_seqlens_k.contiguous(),
        block_table,
        api._check_alibi(p_options["alibi_slopes"], batch, q.shape[1], device),
        int(max_seqlen_q),
        int(max_seqlen_k),
        api.resolve_scale(scale, q.shape[-1]),
        left,
        right,
        softcap,
    )


def _fwd_paged_varlen_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    block_table: Tensor,
    alibi_slopes: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
) -> Tensor:
    batch = cu_seqlens_q.numel() - 1
    device = q.device
    capacity = block_table.shape[1] * k.shape[1]
    seqlens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    longest = None
    if not _capturing(device):
        api._check_cu_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q)
        lengths = api._check_cu_values("cu_seqlens_k", cu_seqlens_k, None, "max_seqlen_k", max_seqlen_k)
        longest = max(lengths, default=0)
        if batch:
            api.checked_once(
                (cu_seqlens_k, block_table),
                ("paged", capacity, k.shape[0], k.shape[1]),
                lambda: _check_values(
                    seqlens,
                    0,
                    capacity,
                    None,
                    None,
                    batch,
                    block_table,
                    k.shape[0],
                    k.shape[1],
                    None,
                    0,
                    "key lengths (cu_seqlens_k)",
                ),
            )
    p = AttnParams(
        batch=batch,
        seqlen_q=max_seqlen_q,
        seqlen_k=capacity,
        headdim=q.shape[-1],
        softmax_scale=softmax_scale,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        cu_seqlens_q=cu_seqlens_q,
    )
    if q.numel() == 0 or batch == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=device)
    c = CacheLayout(seqlens_k=seqlens, block_table=block_table, max_seqlen_k=longest)
    with api._on_device(q):
        out, _ = api._implementation(q).attn_fwd_kvcache(q, k, v, p, c)
    return out.contiguous()


_fwd_paged_varlen = torch.library.custom_op("tileattn::fwd_paged_varlen", _fwd_paged_varlen_impl, mutates_args=())


@_fwd_paged_varlen.register_fake
def _(q, *args):
    return q.new_empty(q.shape)
