"""KV-cache attention as ``torch.library`` custom ops: ``tileattn::fwd_kvcache`` (the value checks, the
in-place append with rotary, then attention over the updated cache) and ``tileattn::fwd_paged_varlen``
(packed queries against a paged cache). The API layer (``tileattn.kvcache``) validates metadata and
calls them, or their implementations directly in eager mode on plain tensors.

Index values (cache_seqlens, cache_leftpad, cache_batch_idx, block_table, the rotary tables' length
against the positions they must cover) are checked in one of three ways:

- **On the device** (eager calls on CUDA tensors, the default): the kernels check the values where they
  read them and write the first bad one into the device's error record (``tileattn.errors``), which the
  next call on the device raises, or ``tileattn.check_errors``. No device sync. Values known on the host
  (an int cache_seqlens, the lengths of the paged varlen call's cu_seqlens) are still checked before
  anything runs. The split plan counts on the capacity, not the longest sequence, as under capture.
- **On the host** (CPU tensors, or ``Settings.sync_checks`` / ``TILEATTN_SYNC_CHECKS=1``): read back in
  one transfer before any kernel (``checks.cache_values``), once per unmodified tensors
  (``checks.checked_once``); a refused call leaves the caches untouched.
- **Not at all** under CUDA graph capture (a read would need a device-to-host copy, which capture
  forbids).

Whatever the values, the kernels clamp every index and rotary position, so they never read outside the
caches and the rotary tables, and an append writes nothing for a batch entry whose cache_seqlens,
cache_leftpad, cache_batch_idx (or one shared with another entry), rotary span or block-table entries
of the pages it writes are out of range: never outside the caches, nor into another sequence's row or
page. Out-of-range values give that entry unspecified outputs, and an error where the checks run.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from tileattn import backend, checks, errors
from tileattn.kernels import configs
from tileattn.params import CALL_KVCACHE, CALL_PAGED_VARLEN, REPLAY, AttnParams, CacheLayout


def fwd_kvcache_impl(
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
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    learnable_sink: Tensor | None = None,
    plans: dict | None = None,
    seqlens_value: int | None = None,
    replay: bool = False,
) -> tuple[Tensor, Tensor]:
    """The ``tileattn::fwd_kvcache`` op: value checks, rotary, the in-place append and the attention
    (metadata already validated). Three arguments only the eager API passes (the op's schema leaves them
    out): ``plans``, the table in which the kernels plan the launches of calls with this call's metadata
    once (``CacheLayout.plans``); ``seqlens_value``, the value of every entry of ``seqlens`` when the
    caller gave cache_seqlens as an int (checked here without reading ``seqlens``: with the other index
    tensors' values on the host, or alone before the kernels check those); and ``replay``, that the
    caller passed its arguments as given (no copies) and may replay this call's launches for later calls
    of its signature (``replay_kvcache``). FP8 caches come with ``k_descale`` and ``v_descale``, fp32
    ``(batch, nheads_k)`` contiguous; attention sinks with ``learnable_sink``, fp32 ``(nheads,)``
    contiguous. The module docstring says how index values are checked."""
    batch, seqlen_q = q.shape[:2]
    device = q.device
    seqlen_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    span = max(seqlen_new, q_span)  # positions past cache_seqlens the rotary tables cover
    impl = backend.implementation(q)
    settings = configs.current(device)
    max_seqlen_k = None
    record = None
    if not backend.capturing(device):
        errors.raise_pending(device)  # (an error an earlier call's kernels found)
        rotary_len = rotary_cos.shape[0] if rotary_cos is not None else None
        if batch and errors.deferred(q, settings, impl):
            record = errors.record(device)
            if seqlens_value is not None:  # known here; the kernels check the index tensors' values
                max_seqlen_k = checks.known_cache_values(
                    [seqlens_value], seqlen_new, capacity, rotary_len, span, "cache_seqlens"
                )
        elif batch:
            cache_rows, page_size = k_cache.shape[:2]  # batch_cache, or num_pages and page_size when paged

            def check() -> int:
                return checks.cache_values(
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

            # once per step, not per layer: the layers share cache_seqlens and block_table (checks.checked_once)
            max_seqlen_k = checks.checked_once(
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
        learnable_sink=learnable_sink,
    )
    rotary = (rotary_cos, rotary_sin, rotary_interleaved) if rotary_cos is not None else None
    with backend.on_device(q):
        impl.kvcache_append(
            k_cache, v_cache, k, v, rotary, seqlens, cache_batch_idx, block_table, plans,
            (k_descale, v_descale), settings.interpret, cache_leftpad, span, record, CALL_KVCACHE,
        )  # fmt: skip
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
            k_descale=k_descale,
            v_descale=v_descale,
            record=record,
            call=CALL_KVCACHE,
            mirror=errors.mirror_target(device) if record is not None else None,
            # (a later call of this signature runs this one's launches: nothing it depends on but the
            # settings, which replay_kvcache compares, may differ)
            replay=replay and record is not None and k is None and rotary is None and seqlens_value is None,
        )
        if q.numel() == 0:
            out, lse = torch.zeros(q.shape, dtype=q.dtype, device=device), p.new_lse(q).fill_(float("inf"))
            if record is not None:  # (the append's record: no attention step brings it to the host)
                errors.mirror(device)
        else:  # (its step brings the record to the host, c.mirror)
            out, lse = impl.attn_fwd_kvcache(q, k_cache, v_cache, p, c, settings)
    return out.contiguous(), lse


def replay_kvcache(
    plans: dict,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens: Tensor,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    block_table: Tensor | None,
    alibi_slopes: Tensor | None,
    k_descale: Tensor | None,
    v_descale: Tensor | None,
    want_lse: bool,
    learnable_sink: Tensor | None = None,
) -> tuple[Tensor, Tensor | None] | None:
    """``fwd_kvcache_impl`` for a call whose signature's table ``plans`` holds a replayable step
    (``CacheLayout.replay``: an eager call of this metadata ran with its values checked in the kernels,
    no append, no rotary, a tensor cache_seqlens, its arguments as given): the earlier call's launches
    with this call's tensors, after the pending-error check, or None when the step does not apply (no
    step, other settings now, a step planned for the other way of bringing the error record to the host,
    ``errors.mirror_target``, or a CUDA graph capture). The API's call key (``kvcache._call_key``)
    guarantees the rest: the same shapes, strides, dtypes, devices, alignments and options. Returns
    ``(out, lse)``, lse None unless ``want_lse`` (``Step.replay``)."""
    entry = plans.get(REPLAY)
    if entry is None:
        return None
    settings, step = entry
    device = q.device
    mirror = errors.mirror_target(device)
    if configs.current(device) is not settings or step.to_host != (mirror is not None) or backend.capturing(device):
        return None
    errors.raise_pending(device)
    with backend.on_device(q):
        return step.replay(
            q, k_cache, v_cache, seqlens, cache_leftpad, cache_batch_idx, block_table, k_descale, v_descale,
            alibi_slopes, errors.record(device), mirror, want_lse, learnable_sink,
        )  # fmt: skip


def _op_prototype():
    """Carries the op's signature: ``fwd_kvcache_impl``'s without its eager-only arguments."""


_signature = inspect.signature(fwd_kvcache_impl)
_op_prototype.__signature__ = _signature.replace(
    parameters=[p for name, p in _signature.parameters.items() if name not in ("plans", "seqlens_value", "replay")]
)
_MUTATED = ("k_cache", "v_cache")
_fwd_kvcache_op = torch.library.custom_op(
    "tileattn::fwd_kvcache",
    fwd_kvcache_impl,
    mutates_args=_MUTATED,
    schema=torch.library.infer_schema(_op_prototype, mutates_args=_MUTATED),
)


@_fwd_kvcache_op.register_fake
def _(q, *args):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def fwd_paged_varlen_impl(
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
    learnable_sink: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``tileattn::fwd_paged_varlen`` op: ``(out, softmax_lse)``, the LSE fp32 ``(nheads, total_q)``
    as the varlen training forward's (+inf for rows that see no key, the sink's logit with sinks)."""
    batch = cu_seqlens_q.numel() - 1
    device = q.device
    capacity = block_table.shape[1] * k.shape[1]
    seqlens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    settings = configs.current(device)
    impl = backend.implementation(q)
    longest = None
    record = None
    if not backend.capturing(device):
        errors.raise_pending(device)  # (an error an earlier call's kernels found)
        checks.cu_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q)
        lengths = checks.cu_values("cu_seqlens_k", cu_seqlens_k, None, "max_seqlen_k", max_seqlen_k)
        longest = max(lengths, default=0)
        if batch and errors.deferred(q, settings, impl):  # the lengths here, the table by the kernel
            record = errors.record(device)
            checks.known_cache_values(lengths, 0, capacity, None, 0, "key lengths (cu_seqlens_k)")
        elif batch:
            checks.checked_once(
                (cu_seqlens_k, block_table),
                ("paged", capacity, k.shape[0], k.shape[1]),
                lambda: checks.cache_values(
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
        learnable_sink=learnable_sink,
    )
    if q.numel() == 0 or batch == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=device), p.new_lse(p.as_4d(q)).fill_(float("inf"))
    c = CacheLayout(
        seqlens_k=seqlens,
        block_table=block_table,
        max_seqlen_k=longest,
        record=record,
        call=CALL_PAGED_VARLEN,
        mirror=errors.mirror_target(device) if record is not None else None,
    )
    with backend.on_device(q):  # (the step brings the record to the host, c.mirror)
        out, lse = impl.attn_fwd_kvcache(q, k, v, p, c, settings)
    return out.contiguous(), lse


_fwd_paged_varlen = torch.library.custom_op("tileattn::fwd_paged_varlen", fwd_paged_varlen_impl, mutates_args=())


@_fwd_paged_varlen.register_fake
def _(q, *args):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
