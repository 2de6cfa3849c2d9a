"""Ring attention (context parallelism) as custom ops: ``tileattn::ring_fwd`` and ``tileattn::ring_bwd``.

Each rank of a ``torch.distributed`` group holds one slice of the sequence: q, k and v of its own tokens.
The forward passes K/V around the ring (rank r sends to r + 1 and receives from r - 1, asynchronously,
while it computes on the block it holds), runs the attention kernels on every (query segment, key
segment) pair that sees anything, and merges the partial outputs in fp32 through their log-sum-exp.
The backward passes K/V around the same way, recomputes with the merged ``out`` and ``softmax_lse``, keeps
dQ in fp32 on its rank and sends the dK/dV of each block on around the ring behind the block, summed in
fp32 (each kernel call's part comes in the inputs' dtype), so that after the last step (and one more hop)
every rank holds the gradients of its own K/V. A rank adds its part to what it received from the rank
before after computing it, so the receive overlaps the step's compute.

Two layouts (``Layout``): ``ring``, rank r holding tokens ``[r·C, (r+1)·C)``, and ``zigzag``, rank r
holding half-chunks r and 2W−1−r of 2W, which gives every rank the same causal work. Masks are bands
of ``j − i`` in global positions (causal, sliding windows); ``band`` turns the band of a segment pair into
the rows and keys that see anything and a window in the kernels' bottom-right-aligned terms, so every
kernel call is an ordinary dense call on slices. Calls that see everything merge into one.

The ops take the group by name (``ProcessGroup.group_name``), which ``torch.compile`` keeps as a
constant. Before anything runs, the ranks agree (``agree``): one all-gather of each rank's shapes and
options, after which every rank raises the same error if they differ, instead of hanging in a transfer.
"""

from __future__ import annotations

import dataclasses
import enum
import struct

import torch
import torch.distributed as dist
from torch import Tensor

from tileattn import backend, rng
from tileattn.kernels import configs
from tileattn.ops.attention import _like
from tileattn.params import AttnParams


class Layout(enum.IntEnum):
    RING = 0
    ZIGZAG = 1


NAMES = {Layout.RING: "ring_flash_attn_func", Layout.ZIGZAG: "zigzag_ring_flash_attn_func"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call of a step: local query rows ``[q0, q1)`` against the held block's local keys
    ``[k0, k1)``, with the window ``(left, right)`` in the kernels' terms (-1 unbounded)."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int

    @property
    def full(self) -> bool:
        return self.left < 0 and self.right < 0


def band(rows: int, keys: int, lo: int | None, hi: int | None) -> tuple[int, int, int, int, int, int] | None:
    """The part of a ``rows × keys`` tile where key j is visible to row i when ``lo <= j - i <= hi`` (None:
    unbounded), as ``(q0, q1, k0, k1, left, right)``: the rows that see a key, the keys some row sees, and
    the window of the kernels (key j' of the slice visible to row i' when ``j' - i' - (sk - sq)`` lies in
    ``[-left, right]``, -1 unbounded) that is the same band on the slices. None when nothing is visible."""
    q0 = 0 if hi is None else max(0, -hi)
    q1 = rows if lo is None else min(rows, keys - lo)
    if q0 >= q1:
        return None
    k0 = 0 if lo is None else max(0, q0 + lo)
    k1 = keys if hi is None else min(keys, q1 + hi)
    if k0 >= k1:
        return None
    sq, sk = q1 - q0, k1 - k0
    shift = k1 - q1  # j - i on the slices' bottom-right diagonal
    left = -1 if lo is None else shift - lo
    right = -1 if hi is None else hi - shift
    # a side that no pair of the slices reaches bounds nothing
    if left >= sk - 1:
        left = -1
    if right >= sq - 1:
        right = -1
    return q0, q1, k0, k1, left, right


def segments(layout: Layout, rank: int, world: int, chunk: int) -> list[tuple[int, int]]:
    """``(global start, length)`` of the token runs rank ``rank`` holds, in its local order."""
    if layout == Layout.RING:
        return [(rank * chunk, chunk)]
    half = chunk // 2
    return [(rank * half, half), ((2 * world - 1 - rank) * half, half)]


def _merge_full(calls: list[Call]) -> list[Call]:
    """Joins calls that see everything: the same keys over adjacent rows, then the same rows over
    adjacent keys."""
    for same, start, end in ((("k0", "k1"), "q0", "q1"), (("q0", "q1"), "k0", "k1")):
        merged: list[Call] = []
        for c in calls:
            prev = merged[-1] if merged else None
            if (
                prev is not None
                and prev.full
                and c.full
                and all(getattr(prev, f) == getattr(c, f) for f in same)
                and getattr(prev, end) == getattr(c, start)
            ):
                merged[-1] = dataclasses.replace(prev, **{end: getattr(c, end)})
            else:
                merged.append(c)
        calls = sorted(merged, key=lambda c: (c.q0, c.k0))  # rows first, for the second pass
    return calls


def plan(layout: Layout, rank: int, source: int, world: int, chunk: int, left: int, right: int) -> list[Call]:
    """The kernel calls of rank ``rank`` against the K/V block of rank ``source``, for the global window
    ``(left, right)`` (-1 unbounded; causal is ``right == 0``) on a sequence of ``world * chunk`` tokens."""
    if layout == Layout.ZIGZAG and source == rank and right == 0 and left < 0:
        # the two half-chunks in order, against themselves: causal on the concatenation is exact
        return [Call(0, chunk, 0, chunk, -1, 0)]
    calls = []
    q_segments, k_segments = segments(layout, rank, world, chunk), segments(layout, source, world, chunk)
    for qi, (q_start, q_len) in enumerate(q_segments):
        for ki, (k_start, k_len) in enumerate(k_segments):
            offset = k_start - q_start  # j - i in global positions = local j - i + offset
            lo = None if left < 0 else -left - offset
            hi = None if right < 0 else right - offset
            part = band(q_len, k_len, lo, hi)
            if part is not None:
                q0, q1, k0, k1, wl, wr = part
                calls.append(Call(qi * q_len + q0, qi * q_len + q1, ki * k_len + k0, ki * k_len + k1, wl, wr))
    return _merge_full(sorted(calls, key=lambda c: (c.k0, c.q0)))


@dataclasses.dataclass(frozen=True)
class Ring:
    """Where this rank is: the group, its size and this rank's index in it."""

    group: dist.ProcessGroup
    world: int
    rank: int

    @classmethod
    def of(cls, group_name: str) -> Ring:
        group = dist.distributed_c10d._resolve_process_group(group_name)
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def exchange(self, t: Tensor) -> _Transfer | None:
        """Sends ``t`` to the next rank and receives the previous rank's into a new tensor, asynchronously
        (None with one rank)."""
        if self.world == 1:
            return None
        received = torch.empty_like(t)
        peer_next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        peer_prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)
        ops = [
            dist.P2POp(dist.isend, t, peer_next, self.group),
            dist.P2POp(dist.irecv, received, peer_prev, self.group),
        ]
        return _Transfer(t, received, dist.batch_isend_irecv(ops))


@dataclasses.dataclass
class _Transfer:
    sent: Tensor  # kept alive until the send completes
    received: Tensor
    works: list

    def wait(self) -> Tensor:
        for w in self.works:
            w.wait()
        return self.received


# --------------------------------------------------------------------------------------------------
# Agreement: every rank checks the others' shapes and options before the first transfer
# --------------------------------------------------------------------------------------------------

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FIELDS = (
    "refused",
    "batch",
    "local seqlen",
    "local seqlen of k",
    "nheads",
    "nheads_k",
    "headdim",
    "dtype",
    "layout",
    "window_left",
    "window_right",
    "softmax_scale",
    "softcap",
    "dropout_p",
    "deterministic",
    "group size",
    "return_attn_probs",
    "cu_seqlens of the packed stream",
)


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def description(q: Tensor, k: Tensor, layout: int, options: tuple, world: int, lse: bool = False) -> list[int]:
    """This rank's row of the agreement (``FIELDS``): shapes, dtype and options as integers (``lse``:
    whether the caller asked for the LSE, which costs Ulysses one more all-to-all)."""
    left, right, scale, softcap, dropout_p, deterministic = options
    dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else len(_DTYPES)
    batch, seqlen, nheads, headdim = q.shape
    return [
        0,
        batch,
        seqlen,
        k.shape[1],
        nheads,
        k.shape[2],
        headdim,
        dtype,
        layout,
        left,
        right,
        _bits(scale),
        _bits(softcap),
        _bits(dropout_p),
        int(deterministic),
        world,
        int(lse),
        0,  # (a checksum of the packed stream's lengths: gather_kv_flash_attn_varlen_func)
    ]


class Disagreement(ValueError, RuntimeError):
    """The ranks of a group called with different shapes or options, or one of them refused its
    arguments (raised on every rank)."""


def agree(group: dist.ProcessGroup, row: list[int], name: str, device: torch.device | None = None) -> None:
    """Gathers every rank's ``description`` row and raises ``Disagreement`` on every rank if any rank refused
    its arguments (a row whose first field is 1) or the rows differ. ``device``: the inputs' device; the
    rows travel on it when it is a GPU and the backend NCCL. On gloo, ranks that do not all call (another
    group, another function) fail when the group's timeout expires, with a message that says so, rather
    than hang; NCCL's watchdog ends such a process instead."""
    world = dist.get_world_size(group)
    if dist.get_backend(group) != "nccl":
        device = torch.device("cpu")  # gloo and the rest take CPU tensors
    elif device is None or device.type != "cuda":  # NCCL moves CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(rows, mine, group=group)
    except RuntimeError as e:
        raise Disagreement(
            f"{name}: the ranks of the group did not all reach its agreement step (a group of {world} ranks here): "
            f"every rank of the group must call the same function with the same group ({e})"
        ) from e
    table = torch.stack(rows).tolist()
    refused = [r for r, t in enumerate(table) if t[0]]
    if refused:
        raise Disagreement(
            f"{name}: rank(s) {refused} of the group refused their arguments (their own errors say why); every "
            "rank raises"
        )
    for f, field in enumerate(FIELDS):
        values = [t[f] for t in table]
        if len(set(values)) > 1:
            if field in ("softmax_scale", "softcap", "dropout_p"):
                values = [struct.unpack("<d", struct.pack("<q", v))[0] for v in values]
            if field == "dtype":
                values = [str(_DTYPES[v]) if v < len(_DTYPES) else "other" for v in values]
            hint = " (every rank holds a slice of equal length)" if field == "local seqlen" else ""
            raise Disagreement(f"{name}: the ranks disagree on {field}{hint}: {values} by rank")


# --------------------------------------------------------------------------------------------------
# Forward and backward
# --------------------------------------------------------------------------------------------------


def seed_for(base: int, rank: int, index: int = 0) -> int:
    """The Philox seed of kernel call ``index`` of rank ``rank`` in a call whose base seed is ``base``:
    distinct per rank and call, so no two blocks share dropout draws (ranks seeded alike included)."""
    return (base * 1_000_003 + rank * 65_537 + index) % 2**62


def _steps(ring: Ring, kv: Tensor, q: Tensor, layout: int, options: tuple, base: int):
    """The ring's steps for this rank: per step, the K/V block it holds and the kernel calls on it as
    ``(Call, AttnParams)`` (seeds numbered over the whole call, so forward and backward draw alike). The
    block goes on to the next rank, and the previous rank's comes in, while the caller computes."""
    left, right, scale, softcap, dropout_p, deterministic = options
    chunk = q.shape[1]
    index = 0
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        transfer = ring.exchange(kv) if step + 1 < ring.world else None
        calls = []
        for c in plan(Layout(layout), ring.rank, source, ring.world, chunk, left, right):
            p = AttnParams(
                batch=q.shape[0],
                seqlen_q=c.q1 - c.q0,
                seqlen_k=c.k1 - c.k0,
                headdim=q.shape[-1],
                softmax_scale=scale,
                window_left=c.left,
                window_right=c.right,
                softcap=softcap,
                dropout_p=dropout_p,
                philox_seed=seed_for(base, ring.rank, index),
                deterministic=deterministic,
            )
            calls.append((c, p))
            index += 1
        yield kv, calls
        if transfer is not None:
            kv = transfer.wait()


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """``out``/``lse`` (fp32 views, lse -inf where nothing was seen yet) absorb a block's output and LSE
    (+inf for rows of the block that saw nothing)."""
    block_lse = block_lse.masked_fill(block_lse == float("inf"), float("-inf"))
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    w_old = (lse - safe).exp().transpose(1, 2).unsqueeze(-1)
    w_new = (block_lse - safe).exp().transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.float() * w_new)
    lse.copy_(new)


def forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    layout: int,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor]:
    ring = Ring.of(group_name)
    options = (window_left, window_right, softmax_scale, softcap, dropout_p, deterministic)
    agree(ring.group, description(q, k, layout, options, ring.world), NAMES[layout], q.device)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    base = rng.new_seed() if dropout_p > 0 else 0
    settings = configs.current(q.device)
    with backend.on_device(q):
        impl = backend.implementation(q)
        for kv, calls in _steps(ring, torch.stack((k, v)), q, layout, options, base):
            for c, p in calls:
                block_out, block_lse = impl.attn_fwd(
                    q[:, c.q0 : c.q1], kv[0, :, c.k0 : c.k1], kv[1, :, c.k0 : c.k1], p, settings
                )
                _merge(out[:, c.q0 : c.q1], lse[:, :, c.q0 : c.q1], block_out, block_lse)
    lse.masked_fill_(lse == float("-inf"), float("inf"))  # rows that saw no key: out 0, LSE +inf
    return _like(out.to(q.dtype), q), lse, torch.tensor([base, 0], dtype=torch.int64)


ring_fwd = torch.library.custom_op("tileattn::ring_fwd", forward_impl, mutates_args=())


@ring_fwd.register_fake
def _(q, k, v, *args):
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q), lse, torch.empty(2, dtype=torch.int64)


def backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    rng_state: Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    layout: int,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor]:
    ring = Ring.of(group_name)
    options = (window_left, window_right, softmax_scale, softcap, dropout_p, deterministic)
    dout = dout.contiguous() if dout.stride(-1) != 1 else dout
    kv = torch.stack((k, v))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    settings = configs.current(q.device)
    dkv_transfer = None
    with backend.on_device(q):
        impl = backend.implementation(q)
        for block, calls in _steps(ring, kv, q, layout, options, int(rng_state[0])):
            part = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # this rank's dK/dV of the block
            for c, p in calls:
                rows = slice(c.q0, c.q1)
                dq_c, dk_c, dv_c, _ = impl.attn_bwd(
                    dout[:, rows],
                    q[:, rows],
                    block[0, :, c.k0 : c.k1],
                    block[1, :, c.k0 : c.k1],
                    out[:, rows],
                    lse[:, :, rows].contiguous(),
                    p,
                    settings,
                )
                dq[:, rows] += dq_c
                part[0, :, c.k0 : c.k1] += dk_c
                part[1, :, c.k0 : c.k1] += dv_c
            # plus what the ranks before this one added (received while this step computed), on to the next
            dkv = part if dkv_transfer is None else dkv_transfer.wait().add_(part)
            dkv_transfer = ring.exchange(dkv)
    # after the last step the gradients of the block one rank back come in: this rank's own
    dkv = dkv if dkv_transfer is None else dkv_transfer.wait()
    # (copies: an op's outputs must not alias each other)
    dk, dv = dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)
    return _like(dq.to(q.dtype), q), _like(dk, k), _like(dv, v)


ring_bwd = torch.library.custom_op("tileattn::ring_bwd", backward_impl, mutates_args=())


@ring_bwd.register_fake
def _(dout, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state)
    ctx.options = options
    ctx.settings = configs.current(q.device)


def _backward(ctx, dout, _dlse, _drng):
    with configs.override(ctx.settings):
        dq, dk, dv = torch.ops.tileattn.ring_bwd(dout, *ctx.saved_tensors, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


ring_fwd.register_autograd(_backward, setup_context=_setup_context)


def run(q: Tensor, k: Tensor, v: Tensor, layout: Layout, group_name: str, options: tuple):
    """``(out, softmax_lse, rng_state)`` of ring attention through ``tileattn::ring_fwd``; ``options`` as
    ``description`` takes them: ``(window_left, window_right, softmax_scale, softcap, dropout_p,
    deterministic)``."""
    left, right, scale, softcap, dropout_p, deterministic = options
    return torch.ops.tileattn.ring_fwd(
        q, k, v, scale, left, right, softcap, dropout_p, deterministic, int(layout), group_name
    )
