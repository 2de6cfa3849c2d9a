"""Multi-head latent attention (MLA) decoding with FlashMLA's interface: ``get_mla_metadata`` plans a
decode step's work over the GPU's SMs, ``flash_mla_with_kvcache`` attends over a paged latent cache.

DeepSeek-V2/V3 cache one latent row per token, shared by every query head: 576 values, the first 512
the compressed keys and values (``kv_lora_rank``), the last 64 the rotary part of the keys. With the
projections absorbed into q and the output (``examples/mla_decode.py``), attention is MQA with head
dim 576 over keys that *are* the cache rows and values that are their first 512 dims, read once::

    metadata, num_splits = get_mla_metadata(cache_seqlens, seqlen_q * nheads_q // nheads_k, nheads_k)
    for layer in range(num_layers):
        out, lse = flash_mla_with_kvcache(q, kv_cache[layer], block_table, cache_seqlens, 512,
                                          metadata, num_splits, causal=True)

The metadata depends only on ``cache_seqlens`` and the shapes, so one call serves every layer of a
step. Like FlashMLA's, it is not checked against the lengths (that would read them back every step):
metadata made for other lengths gives wrong outputs, though never a read outside the cache.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from tileattn import checks
from tileattn.kernels import configs
from tileattn.kvcache import forward_only
from tileattn.ops import mla as ops
from tileattn.params import MLASettings, cdiv

InvalidArgument = checks.InvalidArgument
InvalidArgumentType = checks.InvalidArgumentType

MAX_ROPE = 64  # dims of a cache row past the values (DeepSeek's rotary part) the kernel takes at most
HEAD_DIMS_V = (64, 128, 256, 512)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # (an H200's: CPU tensors do not use the schedule)
    return torch.cuda.get_device_properties(device).multi_processor_count


def _int_tensor(name: str, t: object, dims: int, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise InvalidArgumentType(f"{name} must be an int32 tensor of shape {layout}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InvalidArgumentType(f"{name} must be int32, got {t.dtype}")
    if t.dim() != dims:
        raise InvalidArgument(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    return t


def _positive_int(name: str, value: object) -> int:
    if not checks.is_int(value) or int(value) < 1:
        raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
    return int(value)


def get_mla_metadata(cache_seqlens: Tensor, num_q_tokens_per_head_k: int, num_heads_k: int) -> tuple[Tensor, Tensor]:
    """The work schedule of a decode step, as FlashMLA's ``get_mla_metadata``.

    Args:
        cache_seqlens: int32 ``(batch,)``, the step's key lengths (as passed to ``flash_mla_with_kvcache``).
        num_q_tokens_per_head_k: query rows per kv head, ``seqlen_q * nheads_q // nheads_k``.
        num_heads_k: kv heads of the cache (1 for MLA).

    Returns:
        ``(tile_scheduler_metadata, num_splits)``: int32 ``(num_sm_parts, 8)``, row p the work of part p,
        ``[begin_idx, begin_seqlen, end_idx, end_seqlen, begin_split, 0, 0, 0]`` (sequences begin_idx to
        end_idx, keys from begin_seqlen of the first and below end_seqlen of the last), and int32
        ``(batch + 1,)``, the prefix sums of the parts each sequence is split over. Computed on
        cache_seqlens' device without reading it back (CUDA graphs can capture it). The parts share
        the keys in 64-key blocks, each sequence counting 5 blocks more for its output
        (``params.MLASettings``), so that sequences of any lengths keep every SM busy.
    """
    seqlens = _int_tensor("cache_seqlens", cache_seqlens, 1, "(batch,)")
    rows = _positive_int("num_q_tokens_per_head_k", num_q_tokens_per_head_k)
    heads_k = _positive_int("num_heads_k", num_heads_k)
    m = configs.current(seqlens.device).mla
    sms = m.sm_count if m.sm_count is not None else _sm_count(seqlens.device)
    # (MLASettings.gluon_narrow: fewer rows run as the Gluon build's 64, one block an SM)
    block_m = m.block_m if m.gluon and m.gluon_narrow else m.rows_per_program(rows)
    per_sm = m.parts_per_sm if block_m >= m.block_m else m.narrow_parts_per_sm
    num_parts = max(1, sms * per_sm // heads_k // cdiv(rows, block_m))
    return schedule(seqlens, num_parts, m)


def schedule(seqlens: Tensor, num_parts: int, m: MLASettings) -> tuple[Tensor, Tensor]:
    """``get_mla_metadata``'s schedule of ``num_parts`` parts, without reading ``seqlens`` back.

    Sequence b costs ``cdiv(seqlens[b], block) + overhead`` units (``m.schedule_block``, at least one
    ``m.fixed_overhead``): the units of all sequences in order are cut into ``num_parts`` runs of equal
    cost, and part p takes the key blocks whose units fall in its run. Every sequence is taken by at
    least one part (an empty part has begin_idx = batch); a part that reaches a sequence only through
    its overhead units leaves it to the next part, which takes its keys."""
    device = seqlens.device
    batch = seqlens.shape[0]
    block, overhead = m.schedule_block, max(1, m.fixed_overhead)
    parts = torch.arange(num_parts, device=device)
    if batch == 0:
        metadata = torch.zeros((num_parts, 8), dtype=torch.int32, device=device)
        metadata[:, 2] = -1
        return metadata, torch.zeros(1, dtype=torch.int32, device=device)
    n = seqlens.long().clamp_min(0)
    blocks = (n + block - 1) // block
    ends = torch.cumsum(blocks + overhead, 0)  # the units of sequences 0 ... b
    starts = ends - (blocks + overhead)
    total = ends[-1]
    per_part = (total + num_parts - 1) // num_parts
    x_begin = parts * per_part
    x_end = torch.minimum(x_begin + per_part, total)  # (exclusive)
    begin_idx = torch.searchsorted(ends, x_begin, right=True)  # the sequence holding unit x_begin
    bi = begin_idx.clamp_max(batch - 1)
    begin_block = torch.minimum((x_begin - starts[bi] - overhead).clamp_min(0), blocks[bi])
    last = (x_end - 1).clamp_min(0)
    ei = torch.searchsorted(ends, last, right=True).clamp_max(batch - 1)
    end_block = torch.minimum((last - starts[ei] - overhead + 1).clamp_min(0), blocks[ei])
    drop = (end_block == 0) & (ei > begin_idx) & (x_end < ends[ei])  # reached through its overhead only
    end_idx = torch.where(drop, ei - 1, ei)
    end_seq = torch.where(drop, n[(ei - 1).clamp_min(0)], torch.minimum(end_block * block, n[ei]))
    empty = x_begin >= total
    begin_idx = torch.where(empty, batch, begin_idx)
    end_idx = torch.where(empty, batch - 1, end_idx)
    begin_seq = torch.minimum(begin_block * block, n[bi])
    # the parts holding each sequence, counted through a difference array over the batch
    used = (begin_idx <= end_idx).long()
    diff = torch.zeros(batch + 1, dtype=torch.long, device=device)
    diff.scatter_add_(0, begin_idx.clamp_max(batch), used)
    diff.scatter_add_(0, (end_idx + 1).clamp(0, batch), -used)
    counts = torch.cumsum(diff, 0)[:batch]
    num_splits = torch.cat([torch.zeros(1, dtype=torch.long, device=device), torch.cumsum(counts, 0)])
    # begin_split: the earlier parts that hold this part's first sequence too
    earlier = parts[None, :] < parts[:, None]
    holds = (begin_idx[None, :] <= begin_idx[:, None]) & (begin_idx[:, None] <= end_idx[None, :])
    begin_split = (earlier & holds & (used[None, :] > 0)).sum(1)
    zeros = torch.zeros_like(parts)
    metadata = torch.stack([begin_idx, begin_seq, end_idx, end_seq, begin_split, zeros, zeros, zeros], 1)
    return metadata.to(torch.int32), num_splits.to(torch.int32)


@forward_only(
    "flash_mla_with_kvcache has no backward (it is for decoding, as FlashMLA's): call it under torch.no_grad() "
    "or torch.inference_mode()",
    ("q", "k_cache"),
)
def flash_mla_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: Tensor | None = None,
    num_splits: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_lse: bool = True,
):
    """MLA decoding against a paged latent cache, as FlashMLA's ``flash_mla_with_kvcache``.

    Args:
        q: ``(batch, seqlen_q, nheads_q, d)``, float16 or bfloat16 (float32 too on CPU); DeepSeek's
            d = 576 (the absorbed latent query, then its rotary part).
        k_cache: ``(num_blocks, block_size, nheads_k, d)`` pages of cache rows, q's dtype, contiguous in
            its last dim; the values are the first ``head_dim_v`` dims of the same rows. block_size a
            multiple of 16 from 16 to 256 (FlashMLA's is 64).
        block_table: int32 ``(batch, max_blocks)``: page of each ``block_size`` keys of a sequence.
        cache_seqlens: int32 ``(batch,)``: sequence b's keys are its first ``cache_seqlens[b]`` rows,
            the step's new tokens (already written) among them, last.
        head_dim_v: 64, 128, 256 or 512 (DeepSeek), with ``d - head_dim_v`` at most 64.
        tile_scheduler_metadata, num_splits: ``get_mla_metadata(cache_seqlens, seqlen_q * nheads_q //
            nheads_k, nheads_k)``, made once per step for every layer (None: made here).
        softmax_scale: default ``1 / sqrt(d)``.
        causal: query token i of ``seqlen_q`` (speculative decoding) sees the keys below
            ``cache_seqlens[b] - seqlen_q + 1 + i``.
        return_lse: also return the LSE.

    Returns:
        ``out (batch, seqlen_q, nheads_q, head_dim_v)`` in q's dtype, and with return_lse the fp32
        ``lse (batch, nheads_q, seqlen_q)`` (natural log; +inf for rows that see no key, whose output
        is 0). There is no backward, as in FlashMLA: inputs may require grad, and a backward that reaches
        the outputs raises NotImplementedError.

    cache_seqlens and block_table are checked as ``flash_attn_with_kvcache``'s index tensors are: by the
    kernel for CUDA tensors (a length below 0 or past the capacity, or a block-table entry outside the
    pool among those covering a sequence's keys, is raised by the next call on the device or by
    ``tileattn.check_errors()``), on the host for CPU tensors or with ``TILEATTN_SYNC_CHECKS=1`` (once
    until a torch op changes them), and not under CUDA graph capture. Out-of-range values give
    unspecified results but never a read outside the cache.
    """
    checks.check_tensor("q", q, "(batch, seqlen_q, nheads_q, d)")
    checks.check_tensor("k_cache", k_cache, "(num_blocks, block_size, nheads_k, d)")
    checks.check_inputs({"q": q, "k_cache": k_cache})
    batch, seqlen_q, nheads, d = q.shape
    num_blocks, block_size, nheads_k, d_k = k_cache.shape
    if d_k != d:
        raise InvalidArgument(f"k_cache's last dim must be q's head dim {d}, got {d_k}")
    if nheads_k < 1 or nheads % nheads_k:
        raise InvalidArgument(f"nheads_q ({nheads}) must be a multiple of k_cache's nheads_k ({nheads_k})")
    if not checks.is_int(head_dim_v) or int(head_dim_v) not in HEAD_DIMS_V or not 0 <= d - head_dim_v <= MAX_ROPE:
        raise InvalidArgument(
            f"head_dim_v must be one of {HEAD_DIMS_V} with q's head dim - head_dim_v in [0, {MAX_ROPE}] "
            f"(DeepSeek: 512 of 576), got head_dim_v={head_dim_v!r} with head dim {d}"
        )
    if block_size % 16 or not 16 <= block_size <= 256:
        raise InvalidArgument(f"k_cache's block_size (dim 1) must be a multiple of 16 from 16 to 256, got {block_size}")
    if k_cache.stride(-1) != 1:
        raise InvalidArgument(f"k_cache must be contiguous in its last dim, got strides {tuple(k_cache.stride())}")
    table = _int_tensor("block_table", block_table, 2, "(batch, max_blocks)")
    seqlens = _int_tensor("cache_seqlens", cache_seqlens, 1, "(batch,)")
    if table.shape[0] != batch or seqlens.shape[0] != batch:
        raise InvalidArgument(
            f"block_table (batch, max_blocks) and cache_seqlens (batch,) must have q's batch {batch}, got "
            f"{tuple(table.shape)} and {tuple(seqlens.shape)}"
        )
    if (tile_scheduler_metadata is None) != (num_splits is None):
        raise InvalidArgument("tile_scheduler_metadata and num_splits go together (get_mla_metadata returns both)")
    if tile_scheduler_metadata is not None:
        _int_tensor("tile_scheduler_metadata", tile_scheduler_metadata, 2, "(num_sm_parts, 8)")
        _int_tensor("num_splits", num_splits, 1, "(batch + 1,)")
        if tile_scheduler_metadata.shape[1] != 8 or tile_scheduler_metadata.shape[0] < 1:
            raise InvalidArgument(
                f"tile_scheduler_metadata must have shape (num_sm_parts, 8), got {tuple(tile_scheduler_metadata.shape)}"
            )
        if num_splits.shape[0] != batch + 1:
            raise InvalidArgument(
                f"num_splits must have shape (batch + 1,) = ({batch + 1},), got {tuple(num_splits.shape)}"
            )
    for name, t in (
        ("block_table", table),
        ("cache_seqlens", seqlens),
        ("tile_scheduler_metadata", tile_scheduler_metadata),
        ("num_splits", num_splits),
    ):
        if t is not None and t.device != q.device:
            raise InvalidArgument(f"{name} is on {t.device} but q is on {q.device}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    elif not checks.is_real(softmax_scale) or not math.isfinite(float(softmax_scale)):
        raise InvalidArgumentType(f"softmax_scale must be None or a finite real number, got {softmax_scale!r}")
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise InvalidArgumentType(f"{name} must be a bool, got {flag!r}")
    if tile_scheduler_metadata is None:
        tile_scheduler_metadata, num_splits = get_mla_metadata(seqlens, max(1, seqlen_q * nheads // nheads_k), nheads_k)
    out, lse = ops.mla_fwd(
        checks.contiguous_last(q),
        k_cache,
        table.contiguous(),
        seqlens.contiguous(),
        tile_scheduler_metadata.contiguous(),
        num_splits.contiguous(),
        int(head_dim_v),
        float(softmax_scale),
        causal,
    )
    return (out, lse) if return_lse else out
