"""Context parallelism: exact attention over a sequence split across the ranks of a ``torch.distributed``
group (NCCL on GPUs, gloo on CPUs), forward and backward.

Three schemes, each called by every rank of the group with its own slice of the sequence:

- ``ring_flash_attn_func``: rank r holds tokens ``[r·C, (r+1)·C)`` of a sequence of ``W·C`` (``ring_shard``
  cuts a full sequence so). K/V blocks travel around the ring while each rank computes on the one it
  holds; the partial outputs merge in fp32 through their log-sum-exp; dK/dV travel back around the ring
  in fp32. Causal work is uneven: rank W−1 computes W blocks, rank 0 one.
- ``zigzag_ring_flash_attn_func``: the same ring on the zigzag layout, rank r holding half-chunks r and
  2W−1−r of 2W (``zigzag_shard`` / ``zigzag_unshard``), which balances causal work across the ranks.
- ``ulysses_flash_attn_func``: all-to-all instead of a ring (DeepSpeed-Ulysses): the ranks trade
  sequence slices for head slices, run full-sequence attention on ``nheads / W`` heads each, and trade
  back. Needs ``nheads % W == 0``; every feature of ``flash_attn_func`` works, ALiBi included.
- ``gather_kv_flash_attn_varlen_func``: packed batches of sequences (documents) whose token stream is
  split across the ranks, sequences spanning ranks: K/V all-gathered, each rank's queries attend to the
  keys of their own sequences in one varlen call, dK/dV reduce-scattered back (Llama 3's context
  parallelism).

The ring functions take ``flash_attn_func``'s arguments (``window_size`` and ``causal`` in global
positions; a side at least the whole sequence long is unbounded) plus ``group`` (default: the world), as
ring-flash-attn's do, and keyword-only ``softcap``. GQA sends only the kv heads. Dropout draws a
fresh Philox seed per kernel call (each block pair of each rank), so a ring call drops a different
random set than a single-GPU call with the same seed would, at the same rate. ALiBi slopes are refused
by the ring functions (the kernels' ALiBi distance is the block's, not the sequence's): use Ulysses.
``return_attn_probs=True`` returns ``(out, softmax_lse, None)`` with the rank's fp32 LSE ``(batch,
nheads, C)``; the attention probabilities are never materialised.

Before the first transfer the ranks agree: one all-gather of each rank's shapes and options, after
which every rank raises the same ``Disagreement`` if a rank refused its arguments or the ranks differ
(slices of unequal length, other head counts, other options). Ranks that do not all make the call (a
different group on some rank) fail when the group's timeout expires: on gloo with a ``Disagreement`` that
says so, on NCCL by its watchdog ending the process. The
ring runs as the custom ops ``tileattn::ring_fwd`` / ``tileattn::ring_bwd`` (``tileattn.ops.context``),
which ``torch.compile`` keeps whole. The agreement reads its result on the host (one small all-gather
and a device sync per forward), so the functions do not run under CUDA graph capture.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor

from tileattn import api, checks, rng
from tileattn.ops import context
from tileattn.ops.context import Disagreement, Layout

__all__ = [
    "Disagreement",
    "gather_kv_flash_attn_varlen_func",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_shard",
    "ring_unshard",
    "ulysses_flash_attn_func",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_shard",
    "zigzag_unshard",
]

_ULYSSES, _GATHER = 2, 3  # the layout field of the agreement for Ulysses and gathered-K/V calls


def _group(group: object) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise checks.InvalidArgument(
            "context parallelism needs torch.distributed initialised: call torch.distributed.init_process_group first"
        )
    group = dist.group.WORLD if group is None else group
    if not isinstance(group, dist.ProcessGroup):
        raise checks.InvalidArgumentType(f"group must be None or a ProcessGroup, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise checks.InvalidArgument(
            f"this process (global rank {dist.get_rank()}) is not a member of the group passed as group"
        )
    return group


def _check_backend(group: dist.ProcessGroup, t: Tensor) -> None:
    """The group's backend moves tensors of ``t``'s device: NCCL CUDA tensors, gloo CPU tensors (gloo's
    send and receive fail on CUDA memory)."""
    backend = str(dist.get_backend(group))
    if t.is_cuda and "nccl" not in backend:
        raise checks.InvalidArgument(
            f"CUDA tensors need a process group with the NCCL backend, got a {backend!r} group "
            "(init_process_group('nccl'), or a 'cpu:gloo,cuda:nccl' group)"
        )
    if not t.is_cuda and "gloo" not in backend and backend not in ("mpi", "ucc"):
        raise checks.InvalidArgument(f"{t.device.type} tensors need a group with the gloo backend, got {backend!r}")


def _refuse_everywhere(group: dist.ProcessGroup, error: Exception, name: str, device: torch.device | None) -> None:
    """Tells the other ranks (through the agreement they are waiting in) that this rank refused its
    arguments, so they raise too; then raises ``error`` here."""
    row = [1] + [0] * (len(context.FIELDS) - 1)
    try:
        context.agree(group, row, name, device)
    except Disagreement:
        pass
    raise error


def _checked(group, name, like, check, *args):
    """``check(*args)``, or on a refusal the same refusal on this rank and a ``Disagreement`` on the others
    (``like``: the caller's first tensor argument, whose device the agreement uses)."""
    try:
        return check(*args)
    except (checks.InvalidArgument, NotImplementedError) as e:
        _refuse_everywhere(group, e, name, like.device if isinstance(like, torch.Tensor) else None)


def _options(q, seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs):
    """``(window_left, window_right, softmax_scale, softcap, dropout_p, deterministic)``, the window's sides
    unbounded from ``seqlen_k`` keys (the whole sequence's, or a packed batch's longest)."""
    dropout_p, scale, left, right, softcap = checks.check_options(
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        deterministic,
        return_attn_probs,
        seqlen_k=seqlen_k,
    )
    return left, right, checks.resolve_scale(scale, q.shape[-1]), softcap, dropout_p, deterministic


def _rank_seeded(fn, args: tuple, dropout_p: float, rank: int):
    """``fn(*args)``, with dropout drawing from a seed that mixes in the rank (``context.seed_for``): ranks
    seeded alike would otherwise drop the same elements in their heads or pieces."""
    if dropout_p == 0:
        return fn(*args)
    seed = rng.new_seed()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(context.seed_for(seed, rank))
        return fn(*args)


def _check_slices(group: dist.ProcessGroup, q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor]:
    q = checks.check_tensor("q", q, "(batch, seqlen_local, nheads, headdim)")
    k = checks.check_tensor("k", k, "(batch, seqlen_local, nheads_k, headdim)")
    v = checks.check_tensor("v", v, "(batch, seqlen_local, nheads_k, headdim)")
    q, k, v = checks.check_qkv(q, k, v)
    _check_backend(group, q)
    if k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1]:
        raise checks.InvalidArgument(
            "q, k and v hold the same tokens of the sequence on each rank: their batch and seqlen_local must match, "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if q.shape[0] < 1 or q.shape[1] < 1:
        raise checks.InvalidArgument(f"q must hold at least one sequence and one token, got shape {tuple(q.shape)}")
    return q, k, v


def _ring_call(layout: Layout, name: str, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
               deterministic, return_attn_probs, group, softcap):  # fmt: skip
    group = _group(group)
    world = dist.get_world_size(group)

    def check():
        qs, ks, vs = _check_slices(group, q, k, v)
        if alibi_slopes is not None:
            raise NotImplementedError(
                f"{name}: alibi_slopes are not supported by the ring functions (the kernels measure the ALiBi "
                "distance within a block, not across the sequence); ulysses_flash_attn_func supports them"
            )
        if layout == Layout.ZIGZAG and qs.shape[1] % 2:
            raise checks.InvalidArgument(
                f"{name}: each rank holds two half-chunks in the zigzag layout, so seqlen_local must be even, "
                f"got {qs.shape[1]} (zigzag_shard cuts a sequence of a multiple of 2 x world size tokens)"
            )
        options = _options(
            qs,
            world * qs.shape[1],
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            deterministic,
            return_attn_probs,
        )
        return qs, ks, vs, options

    q, k, v, options = _checked(group, name, q, check)
    out, lse, _ = context.run(q, k, v, layout, group.group_name, options)
    return (out, lse, None) if return_attn_probs else out


_ARGS_DOC = """
    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``, this rank's tokens ({layout}).
        k, v: ``(batch, seqlen_local, nheads_k, headdim)``, the same tokens; ``nheads % nheads_k == 0``.
        dropout_p, softmax_scale, causal, window_size, deterministic: as in ``flash_attn_func``, over the
            whole sequence of ``world_size * seqlen_local`` tokens (the window in global positions).
        alibi_slopes: must be None (see the module docstring; ``ulysses_flash_attn_func`` supports ALiBi).
        return_attn_probs: also return the LSE: ``(out, softmax_lse, None)``.
        group: the process group whose ranks hold the slices (None: the world); every rank calls.
        softcap: keyword-only, as in ``flash_attn_func``.

    Returns:
        out ``(batch, seqlen_local, nheads, headdim)`` for this rank's tokens, or ``(out, softmax_lse,
        None)`` with softmax_lse fp32 ``(batch, nheads, seqlen_local)``.
"""


def ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    softcap: float = 0.0,
):
    return _ring_call(
        Layout.RING, "ring_flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, softcap,
    )  # fmt: skip


ring_flash_attn_func.__doc__ = (
    "Exact attention over a sequence split in contiguous slices across the ranks of ``group`` (ring).\n"
    + _ARGS_DOC.format(layout="rank r holds tokens [r·C, (r+1)·C): ``ring_shard``")
)


def zigzag_ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    softcap: float = 0.0,
):
    return _ring_call(
        Layout.ZIGZAG, "zigzag_ring_flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size,
        alibi_slopes, deterministic, return_attn_probs, group, softcap,
    )  # fmt: skip


zigzag_ring_flash_attn_func.__doc__ = (
    "Exact attention over a sequence split in the zigzag layout across the ranks of ``group``: the ring\n"
    "    with the same causal work on every rank.\n"
    + _ARGS_DOC.format(layout="rank r holds half-chunks r and 2W−1−r of 2W, in that order: ``zigzag_shard``")
)


_QKV = "(batch, seqlen_local, 3, nheads, headdim)"
_KV = "(batch, seqlen_local, 2, nheads_k, headdim)"


def _packed(name: str, t: object, count: int, layout: str) -> tuple[Tensor, ...]:
    t = checks.check_tensor(name, t, layout)
    if t.shape[2] != count:
        raise checks.InvalidArgument(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    return t.unbind(2)


def _unpack(function: str, group, like, name: str, t: object) -> tuple[Tensor, ...]:
    """``qkv`` or ``kv`` unbound along dim 2, or the refusal on every rank."""
    count, layout = (3, _QKV) if name == "qkv" else (2, _KV)
    return _checked(_group(group), function, like, _packed, name, t, count, layout)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                   *, softcap=0.0):  # fmt: skip
    """``ring_flash_attn_func`` on ``qkv (batch, seqlen_local, 3, nheads, headdim)``."""
    q, k, v = _unpack("ring_flash_attn_qkvpacked_func", group, qkv, "qkv", qkv)
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                return_attn_probs, group, softcap=softcap)  # fmt: skip


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                                  *, softcap=0.0):  # fmt: skip
    """``ring_flash_attn_func`` with ``kv (batch, seqlen_local, 2, nheads_k, headdim)``."""
    k, v = _unpack("ring_flash_attn_kvpacked_func", group, q, "kv", kv)
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                return_attn_probs, group, softcap=softcap)  # fmt: skip


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, softcap=0.0):  # fmt: skip
    """``zigzag_ring_flash_attn_func`` on ``qkv (batch, seqlen_local, 3, nheads, headdim)``."""
    q, k, v = _unpack("zigzag_ring_flash_attn_qkvpacked_func", group, qkv, "qkv", qkv)
    return zigzag_ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                       deterministic, return_attn_probs, group, softcap=softcap)  # fmt: skip


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, softcap=0.0):  # fmt: skip
    """``zigzag_ring_flash_attn_func`` with ``kv (batch, seqlen_local, 2, nheads_k, headdim)``."""
    k, v = _unpack("zigzag_ring_flash_attn_kvpacked_func", group, q, "kv", kv)
    return zigzag_ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                       deterministic, return_attn_probs, group, softcap=softcap)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Ulysses: all-to-all between sequence slices and head slices
# --------------------------------------------------------------------------------------------------


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``all_to_all_single`` over dim 0 (one piece per rank)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``(batch, C, nheads, d)`` slices of the sequence → ``(batch, W·C, nheads / W, d)``: the whole sequence,
    this rank's heads."""
    world = dist.get_world_size(group)
    b, c, h, d = x.shape
    pieces = x.reshape(b, c, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    return _all_to_all(pieces, group).permute(1, 0, 2, 3, 4).reshape(b, world * c, h // world, d)


def heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The inverse of ``seq_to_heads``."""
    world = dist.get_world_size(group)
    b, s, h, d = x.shape
    pieces = x.reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).contiguous()
    return _all_to_all(pieces, group).permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), ctx.group), None


def ulysses_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    softcap: float = 0.0,
):
    """Exact attention over a sequence split in contiguous slices across the ranks of ``group``, by
    all-to-all (DeepSpeed-Ulysses): each rank attends over the whole sequence with ``nheads / W`` heads.

    Args:
        q: ``(batch, seqlen_local, nheads, headdim)``, rank r holding tokens ``[r·C, (r+1)·C)``
            (``ring_shard``); ``nheads % world_size == 0``.
        k, v: ``(batch, seqlen_local, nheads_k, headdim)``; ``nheads_k`` a multiple of the world size (its
            heads are split) or a divisor of it (each rank receives the one kv head its query heads use).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``, the whole model's heads.
        Other arguments: as ``ring_flash_attn_func``'s. With dropout, each rank's seed mixes in its rank, so
        ranks seeded alike still drop independently in their heads.

    Under ``torch.compile`` (``fullgraph=True`` works: the all-to-alls trace as functional collectives)
    the ranks' agreement is left out of the graph, so a mismatch between ranks fails in the all-to-all,
    at the group's timeout, rather than with a ``Disagreement``; the ring functions keep it (it runs
    inside their custom op).

    Returns:
        out ``(batch, seqlen_local, nheads, headdim)``, or ``(out, softmax_lse, None)`` with softmax_lse
        fp32 ``(batch, nheads, seqlen_local)``.
    """
    group = _group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    name = "ulysses_flash_attn_func"

    def check():
        qs, ks, vs = _check_slices(group, q, k, v)
        nheads, nheads_k = qs.shape[2], ks.shape[2]
        if nheads % world:
            raise checks.InvalidArgument(
                f"{name}: nheads ({nheads}) must be a multiple of the group's size ({world}): each rank attends with "
                "nheads / world_size heads (ring_flash_attn_func has no such limit)"
            )
        if nheads_k % world and world % nheads_k:
            raise checks.InvalidArgument(
                f"{name}: nheads_k ({nheads_k}) must be a multiple or a divisor of the group's size ({world})"
            )
        options = _options(
            qs,
            world * qs.shape[1],
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            deterministic,
            return_attn_probs,
        )
        slopes = checks.check_alibi(alibi_slopes, qs.shape[0], nheads, qs.device)
        return qs, ks, vs, options, slopes

    q, k, v, options, slopes = _checked(group, name, q, check)
    if not torch.compiler.is_compiling():  # (traced, it would branch on gathered values: see the docstring)
        row = context.description(q, k, _ULYSSES, options, world, lse=return_attn_probs)
        context.agree(group, row, name, q.device)
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads_k < world:  # each rank gets the kv head of its query heads
        k, v = (t.repeat_interleave(world // nheads_k, dim=2) for t in (k, v))
    if slopes is not None:
        per_rank = nheads // world
        slopes = slopes[..., rank * per_rank : (rank + 1) * per_rank].contiguous()
    q, k, v = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    left, right, scale, softcap, dropout_p, deterministic = options
    call = (q, k, v, dropout_p, scale, False, (left, right), softcap, slopes, deterministic, True)
    out, lse, _ = _rank_seeded(api.flash_attn_func, call, dropout_p, rank)
    out = _HeadsToSeq.apply(out, group)
    if not return_attn_probs:
        return out
    lse = heads_to_seq(lse.transpose(1, 2).unsqueeze(-1).contiguous(), group)  # (batch, C, nheads, 1)
    return out, lse.squeeze(-1).transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------------------------------
# Packed sequences: gather K/V (Llama 3's context parallelism)
# --------------------------------------------------------------------------------------------------


class _GatherTokens(torch.autograd.Function):
    """Every rank's ``(tokens, ...)`` slice concatenated in rank order; the backward sums the gradients of
    the whole over the ranks and keeps this rank's slice (a reduce-scatter on NCCL; gloo has none, so an
    all-reduce there)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = list(grad.contiguous().chunk(world))
        if dist.get_backend(group) == "nccl":
            mine = torch.empty_like(pieces[rank])
            dist.reduce_scatter(mine, pieces, group=group)
            return mine, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad.chunk(world)[rank].clone(), None


def packed_pieces(
    lengths: list[int], start: int, stop: int, causal: bool
) -> tuple[list[int], list[int], list[int], int, int]:
    """For the tokens ``[start, stop)`` of a packed stream of sequences of ``lengths``: the sequences with
    tokens there (and empty ones between), the query lengths of their pieces, the key lengths each piece
    attends to (its sequence from its first token to the piece's end when causal, else the whole
    sequence) and the key range ``[first, last)`` of the stream those keys lie in."""
    seqs, q_lens, k_lens = [], [], []
    first = last = start
    begin = 0
    for i, n in enumerate(lengths):
        end = begin + n
        if (end > start and begin < stop) or (n == 0 and start <= begin < stop):
            k_end = min(stop, end) if causal else end
            if not seqs:
                first = begin
            seqs.append(i)
            q_lens.append(min(stop, end) - max(start, begin))
            k_lens.append(k_end - begin)
            last = k_end
        begin = end
    return seqs, q_lens, k_lens, first, last


def gather_kv_flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    softcap: float = 0.0,
):
    """Exact attention over a packed batch of sequences (documents) whose token stream is split in contiguous
    slices across the ranks of ``group``, by gathering K/V (the context parallelism of Llama 3's training):
    every rank all-gathers the K/V slices, then attends with its own queries to the keys their sequences
    see, in one ``flash_attn_varlen_func`` call; the backward sums dK/dV over the ranks back to their
    owners (a reduce-scatter). K/V travel whole (with GQA only the kv heads), so this suits GQA models,
    whose K/V are a fraction of the activations; each rank holds the whole K/V for the call.

    Args:
        q: ``(tokens_local, nheads, headdim)``, rank r holding tokens ``[r·T, (r+1)·T)`` of the packed stream
            (``ring_shard(x, 0)``); a sequence may span ranks.
        k, v: ``(tokens_local, nheads_k, headdim)``, the same tokens.
        cu_seqlens: int32 ``(batch + 1,)``, the whole stream's (``cu_seqlens[-1] == world_size · T``), the
            same on every rank; ``max_seqlen`` its longest sequence.
        causal, window_size, alibi_slopes, softcap, dropout_p, softmax_scale, deterministic: as in
            ``flash_attn_varlen_func``, per sequence in its own positions. A sliding window or ALiBi needs
            ``causal=True`` here (a piece of a sequence that goes on past the slice would be aligned to
            the wrong end).
        return_attn_probs: also return the LSE: ``(out, softmax_lse, None)``, softmax_lse fp32
            ``(nheads, tokens_local)``.

    Returns:
        out ``(tokens_local, nheads, headdim)`` for this rank's tokens.
    """
    group = _group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    name = "gather_kv_flash_attn_varlen_func"

    def check():
        qs = checks.check_tensor("q", q, "(tokens_local, nheads, headdim)")
        ks = checks.check_tensor("k", k, "(tokens_local, nheads_k, headdim)")
        vs = checks.check_tensor("v", v, "(tokens_local, nheads_k, headdim)")
        qs, ks, vs = checks.check_qkv(qs, ks, vs)
        _check_backend(group, qs)
        if ks.shape[0] != qs.shape[0]:
            raise checks.InvalidArgument(
                f"{name}: q, k and v hold the same tokens, got {qs.shape[0]} and {ks.shape[0]} tokens"
            )
        checks.check_cu_seqlens("cu_seqlens", cu_seqlens, "max_seqlen", max_seqlen, qs.device)
        lengths = checks.cu_values("cu_seqlens", cu_seqlens, None, "max_seqlen", max_seqlen)
        if sum(lengths) != world * qs.shape[0]:
            raise checks.InvalidArgument(
                f"{name}: cu_seqlens[-1] must be the whole stream, world_size x tokens_local = {world} x "
                f"{qs.shape[0]}, got {sum(lengths)}"
            )
        options = _options(
            qs, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs
        )
        if not causal and (options[0] >= 0 or options[1] >= 0 or alibi_slopes is not None):
            raise NotImplementedError(
                f"{name}: a sliding window or ALiBi needs causal=True here (ulysses_flash_attn_func takes them "
                "without causal)"
            )
        slopes = checks.check_alibi(alibi_slopes, len(lengths), qs.shape[1], qs.device)
        return qs, ks, vs, lengths, options, slopes

    q, k, v, lengths, options, slopes = _checked(group, name, q, check)
    checksum = sum((i + 1) * n for i, n in enumerate(lengths)) % 2**61
    row = context.description(q.unsqueeze(0), k.unsqueeze(0), _GATHER, options, world, lse=return_attn_probs)
    row[context.FIELDS.index("cu_seqlens of the packed stream")] = checksum  # every rank, the same stream
    if not torch.compiler.is_compiling():
        context.agree(group, row, name, q.device)
    tokens = q.shape[0]
    seqs, q_lens, k_lens, first, last = packed_pieces(lengths, rank * tokens, (rank + 1) * tokens, causal)
    k_all, v_all = (_GatherTokens.apply(t, group)[first:last] for t in (k, v))
    device = q.device
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32, device=device)
    left, right, scale, softcap, dropout_p, deterministic = options
    if not causal:
        left = right = -1
    if slopes is not None and slopes.dim() == 2:  # per sequence: those of this rank's pieces
        slopes = slopes[seqs[0] : seqs[-1] + 1].contiguous()
    call = (q, k_all, v_all, cu_q, cu_k, max(q_lens), max(k_lens), dropout_p, scale, causal, (left, right), softcap,
            slopes, deterministic, True)  # fmt: skip
    out, lse, _ = _rank_seeded(api.flash_attn_varlen_func, call, dropout_p, rank)
    return (out, lse, None) if return_attn_probs else out


# --------------------------------------------------------------------------------------------------
# Sharding a whole sequence
# --------------------------------------------------------------------------------------------------


def _pieces(x: object, dim: int, world: int, parts: int, name: str) -> tuple[Tensor, ...]:
    if not isinstance(x, torch.Tensor):
        raise checks.InvalidArgumentType(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise checks.InvalidArgument(f"{name}: dim {dim} is out of range for a tensor of {x.dim()} dims")
    if x.shape[dim] % parts or x.shape[dim] == 0:
        raise checks.InvalidArgument(
            f"{name}: the sequence ({x.shape[dim]} tokens along dim {dim}) must split into {parts} equal non-empty "
            f"chunks for a group of {world} ranks; pad it to a multiple of {parts}"
        )
    return x.chunk(parts, dim)


def ring_shard(x: Tensor, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's contiguous slice of a whole sequence ``x`` (tokens along ``dim``), for the ring
    functions and Ulysses: rank r gets tokens ``[r·S/W, (r+1)·S/W)``."""
    group = _group(group)
    world = dist.get_world_size(group)
    return _pieces(x, dim, world, world, "ring_shard")[dist.get_rank(group)]


def zigzag_shard(x: Tensor, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's slice of a whole sequence ``x`` in the zigzag layout: ``x`` cut in 2W chunks along
    ``dim``, rank r gets chunks r and 2W−1−r, concatenated in that order."""
    group = _group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = _pieces(x, dim, world, 2 * world, "zigzag_shard")
    return torch.cat((chunks[rank], chunks[2 * world - 1 - rank]), dim=dim)


def _gather(x: Tensor, group: dist.ProcessGroup, name: str) -> list[Tensor]:
    if not isinstance(x, torch.Tensor):
        raise checks.InvalidArgumentType(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def ring_unshard(x: Tensor, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """The whole sequence from every rank's ``ring_shard`` slice (an all-gather; every rank calls and
    receives the whole; not differentiable)."""
    group = _group(group)
    return torch.cat(_gather(x, group, "ring_unshard"), dim=dim)


def zigzag_unshard(x: Tensor, dim: int = 1, group: dist.ProcessGroup | None = None) -> Tensor:
    """The whole sequence from every rank's ``zigzag_shard`` slice (an all-gather; every rank calls and
    receives the whole; not differentiable)."""
    group = _group(group)
    if isinstance(x, torch.Tensor) and x.shape[dim] % 2:
        raise checks.InvalidArgument(
            f"zigzag_unshard: a zigzag slice holds two half-chunks, so its length along dim {dim} must be even, "
            f"got {x.shape[dim]}"
        )
    parts = _gather(x, group, "zigzag_unshard")
    world = len(parts)
    halves = [p.chunk(2, dim) for p in parts]
    order = [halves[r][0] for r in range(world)] + [halves[world - 1 - r][1] for r in range(world)]
    return torch.cat(order, dim=dim)
