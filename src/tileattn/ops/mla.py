"""MLA decoding as the ``torch.library`` custom op ``tileattn::mla_fwd``: the value checks of the
lengths and the block table, then the kernel, or the PyTorch path for CPU tensors. ``tileattn.mla``
validates the metadata and calls it. The values are checked as ``ops.kvcache`` says: by the kernel
for CUDA tensors (an error raised by a later call, ``tileattn.errors``), on the host once per unmodified
tensors for CPU tensors or with ``Settings.sync_checks``, not at all under CUDA graph capture; the
kernel's clamping keeps every read inside the cache whatever the values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tileattn import backend, checks, errors
from tileattn.kernels import configs


def mla_fwd_impl(
    q: Tensor,
    kv: Tensor,
    block_table: Tensor,
    seqlens: Tensor,
    metadata: Tensor,
    num_splits: Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: out ``(batch, seqlen_q, nheads, head_dim_v)`` in q's dtype, lse fp32
    ``(batch, nheads, seqlen_q)`` (+inf for rows that see no key)."""
    batch, seqlen_q, nheads, _ = q.shape
    device = q.device
    num_pages, page_size = kv.shape[:2]
    capacity = block_table.shape[1] * page_size
    impl = backend.implementation(q)
    settings = configs.current(device)
    record = None
    if not backend.capturing(device):
        errors.raise_pending(device)  # (an error an earlier call's kernels found)
        if batch and errors.deferred(q, settings, impl):
            record = errors.record(device)
        elif batch:
            checks.checked_once(
                (seqlens, block_table),
                ("mla", capacity, num_pages, page_size),
                lambda: checks.cache_values(
                    seqlens, 0, capacity, None, None, batch, block_table, num_pages, page_size, None, 0
                ),
            )
    if q.numel() == 0:
        out = q.new_zeros((batch, seqlen_q, nheads, head_dim_v))
        return out, torch.full((batch, nheads, seqlen_q), float("inf"), device=device)
    with backend.on_device(q):
        out, lse = impl.mla_fwd(
            q, kv, block_table, seqlens, metadata, num_splits, head_dim_v, softmax_scale, causal, settings, record
        )
        if record is not None:
            errors.mirror(device)
    return out, lse


_mla_fwd_op = torch.library.custom_op("tileattn::mla_fwd", mla_fwd_impl, mutates_args=())


@_mla_fwd_op.register_fake
def _(q, kv, block_table, seqlens, metadata, num_splits, head_dim_v, softmax_scale, causal):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((batch, seqlen_q, nheads, head_dim_v)), q.new_empty(
        (batch, nheads, seqlen_q), dtype=torch.float32
    )


def mla_fwd(*args) -> tuple[Tensor, Tensor]:
    """The op, or its implementation directly for plain tensors in eager mode (``backend.direct``)."""
    if backend.direct(*args[:6]):
        return mla_fwd_impl(*args)
    return _mla_fwd_op(*args)
