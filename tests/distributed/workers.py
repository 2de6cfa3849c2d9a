"""What each spawned rank runs for tests/distributed/test_context.py: a gloo group (or NCCL, one GPU per
rank), every case of the list in turn, and a JSON file per rank of ``{case: "ok" | failure}``.

Every rank builds the same whole q, k, v and output gradient from the case's seed, takes its slice
(``ring_shard`` / ``zigzag_shard``), runs the function forward and backward, and gathers the output and
the gradients back into whole tensors (``*_unshard``); rank 0 checks them against the fp64 oracle of the
whole sequence with the tolerance rule (``helpers.check_attention``)."""

from __future__ import annotations

import datetime
import itertools
import json
import os
import traceback
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

import helpers
import oracle
from tileattn import distributed as cp


@dataclass(frozen=True)
class Case:
    """One exactness case: ``scheme`` ring / zigzag / ulysses on a whole sequence of ``seqlen`` tokens."""

    scheme: str
    causal: bool = False
    dtype: str = "float32"
    nheads: int = 4
    nheads_k: int = 2
    headdim: int = 40
    seqlen: int = 0  # 0: the world's default (4·W·3 + ... see ``seqlen_for``)
    batch: int = 2
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    compiled: bool = False
    interpret: bool = False  # the Triton kernels under the interpreter (a run with TRITON_INTERPRET=1)

    @property
    def name(self) -> str:
        parts = [self.scheme, "causal" if self.causal else "full", self.dtype, f"h{self.nheads}-{self.nheads_k}"]
        parts += [f"d{self.headdim}"]
        if self.window != (-1, -1):
            parts.append(f"window{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append("softcap")
        if self.alibi:
            parts.append("alibi")
        if self.compiled:
            parts.append("compiled")
        if self.interpret:
            parts.append("interpret")
        return "-".join(parts)


FUNCTIONS = {
    "ring": (cp.ring_flash_attn_func, cp.ring_shard, cp.ring_unshard),
    "zigzag": (cp.zigzag_ring_flash_attn_func, cp.zigzag_shard, cp.zigzag_unshard),
    "ulysses": (cp.ulysses_flash_attn_func, cp.ring_shard, cp.ring_unshard),
}


def seqlen_for(case: Case, world: int) -> int:
    return case.seqlen or 2 * world * 5  # half-chunks of 5 tokens


def cases(world: int) -> list[Case]:
    """The exactness cases for a group of ``world`` ranks (Ulysses splits heads: multiples of it)."""
    h, hk = (6, 3) if world == 3 else (4, 2)
    out = []
    for scheme in ("ring", "zigzag", "ulysses"):
        for causal in (False, True):
            out.append(Case(scheme, causal, nheads=h, nheads_k=hk))
        out.append(Case(scheme, True, "bfloat16", nheads=h, nheads_k=1, headdim=59))  # MQA, bf16
    seqlen = 2 * world * 5
    for scheme in ("ring", "zigzag"):
        # windows shorter than a slice, across slice edges, and one side only
        out.append(Case(scheme, True, nheads=h, nheads_k=hk, window=(3, -1)))
        out.append(Case(scheme, False, nheads=h, nheads_k=hk, window=(7, 2)))
        out.append(Case(scheme, False, nheads=h, nheads_k=h, window=(-1, seqlen // 2), softcap=2.0))
    out.append(Case("ulysses", True, nheads=h, nheads_k=hk, window=(4, -1), alibi=True, softcap=3.0))
    out.append(Case("ring", True, nheads=h, nheads_k=hk, seqlen=world * 3))  # slices of 3 tokens
    out.append(Case("zigzag", True, nheads=h, nheads_k=hk, compiled=True))
    out.append(Case("ulysses", True, nheads=h, nheads_k=hk, compiled=True))
    return out


def interpreter_cases(world: int) -> list[Case]:
    """fp16 cases for the Triton kernels under the interpreter: slices, windows in the kernels' terms."""
    h, hk = (6, 3) if world == 3 else (4, 2)
    return [
        Case("ring", True, "float16", nheads=h, nheads_k=hk, headdim=40, batch=1, interpret=True),
        Case("zigzag", True, "float16", nheads=h, nheads_k=1, headdim=40, batch=1, window=(3, -1), interpret=True),
        Case("zigzag", False, "float16", nheads=h, nheads_k=hk, headdim=40, batch=1, window=(7, 2), interpret=True),
        Case("ulysses", True, "float16", nheads=h, nheads_k=hk, headdim=40, batch=1, interpret=True),
    ]


def run_case(case: Case, group) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    fn, shard, unshard = FUNCTIONS[case.scheme]
    on_gpu = os.environ.get("TILEATTN_CP_DEVICE") == "cuda"  # (the GPU run: float32 cases in bfloat16)
    dtype = torch.bfloat16 if on_gpu and case.dtype == "float32" else getattr(torch, case.dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    torch.manual_seed(zlib.crc32(case.name.encode()))  # the same on every rank (str hashes are not)
    seqlen = seqlen_for(case, world)
    b, h, hk, d = case.batch, case.nheads, case.nheads_k, case.headdim
    q = torch.randn(b, seqlen, h, d, dtype=dtype, device=device)
    k = torch.randn(b, seqlen, hk, d, dtype=dtype, device=device)
    v = torch.randn(b, seqlen, hk, d, dtype=dtype, device=device)
    dout = torch.randn(b, seqlen, h, d, dtype=dtype, device=device)
    slopes = torch.rand(h, device=device) * 0.5 if case.alibi else None
    local = [shard(t, 1, group).detach().requires_grad_() for t in (q, k, v)]
    call = torch.compile(fn, backend="aot_eager", fullgraph=True) if case.compiled else fn
    out, lse, _ = call(*local, 0.0, None, case.causal, case.window, slopes, False, True, group, softcap=case.softcap)
    out.backward(shard(dout, 1, group))
    out = unshard(out.detach(), 1, group)
    lse = unshard(lse, 2, group)
    grads = [unshard(t.grad, 1, group) for t in local]
    if rank == 0:
        kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=slopes)
        helpers.check_attention(case.name, out, grads, q, k, v, dout, kwargs)
        ref = oracle.attention(q, k, v, **kwargs).lse
        ref_lowp = oracle.attention(q, k, v, **kwargs, precision=torch.float32).lse
        helpers.check_lse(f"{case.name} lse", lse, ref, ref_lowp)


@dataclass(frozen=True)
class VarlenCase:
    """A packed stream split across the ranks (``gather_kv_flash_attn_varlen_func``): sequences that span
    ranks, an empty one, one of a single token."""

    causal: bool = True
    dtype: str = "float32"
    nheads: int = 4
    nheads_k: int = 2
    window: tuple[int, int] = (-1, -1)
    alibi: bool = False

    @property
    def name(self) -> str:
        parts = ["varlen", "causal" if self.causal else "full", self.dtype, f"h{self.nheads}-{self.nheads_k}"]
        if self.window != (-1, -1):
            parts.append(f"window{self.window[0]}_{self.window[1]}")
        if self.alibi:
            parts.append("alibi")
        return "-".join(parts)


def varlen_cases(world: int) -> list[VarlenCase]:
    h, hk = (6, 3) if world == 3 else (4, 2)
    return [
        VarlenCase(False, nheads=h, nheads_k=hk),
        VarlenCase(True, nheads=h, nheads_k=hk),
        VarlenCase(True, "bfloat16", nheads=h, nheads_k=1),
        VarlenCase(True, nheads=h, nheads_k=hk, window=(4, -1), alibi=True),
    ]


def run_varlen(case: VarlenCase, group) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dtype = getattr(torch, case.dtype)
    torch.manual_seed(zlib.crc32(case.name.encode()))
    tokens = 13  # per rank
    total = world * tokens
    lengths = [9, 0, 1, tokens + 3, total - 13 - tokens]  # the 4th and 5th span rank boundaries
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    h, hk, d = case.nheads, case.nheads_k, 40
    q = torch.randn(total, h, d, dtype=dtype)
    k = torch.randn(total, hk, d, dtype=dtype)
    v = torch.randn(total, hk, d, dtype=dtype)
    dout = torch.randn(total, h, d, dtype=dtype)
    slopes = torch.rand(len(lengths), h) * 0.5 if case.alibi else None
    local = [cp.ring_shard(t, 0, group).detach().requires_grad_() for t in (q, k, v)]
    out, lse, _ = cp.gather_kv_flash_attn_varlen_func(
        *local, cu, max(lengths), 0.0, None, case.causal, case.window, slopes, False, True, group
    )
    out.backward(cp.ring_shard(dout, 0, group))
    out = cp.ring_unshard(out.detach(), 0, group)
    lse = cp.ring_unshard(lse, 1, group)
    grads = [cp.ring_unshard(t.grad, 0, group) for t in local]
    if rank == 0:
        kwargs = dict(causal=case.causal, window_size=case.window, alibi_slopes=slopes)
        helpers.check_attention(case.name, out, grads, q, k, v, dout, kwargs, varlen=(cu, cu, max(lengths)))
        ref = oracle.attention_varlen(q, k, v, cu, cu, max(lengths), **kwargs).lse
        ref_lowp = oracle.attention_varlen(q, k, v, cu, cu, max(lengths), **kwargs, precision=torch.float32).lse
        helpers.check_lse(f"{case.name} lse", lse, ref, ref_lowp)


def run_dropout(group) -> None:
    """Dropout: the same seed gives the same output, another seed another; the backward differentiates
    the forward that ran (its mask): the gradient's directional derivative matches finite differences."""
    world = dist.get_world_size(group)
    seqlen = 2 * world * 5
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, seqlen, 2, 16, dtype=torch.float64) for _ in range(3))
    u = [torch.randn_like(t) for t in (q, k, v)]
    w = torch.randn_like(q)
    for fn, shard in ((cp.ring_flash_attn_func, cp.ring_shard), (cp.zigzag_ring_flash_attn_func, cp.zigzag_shard)):
        local = [shard(t, 1, group).float() for t in (q, k, v)]
        du = [shard(t, 1, group).float() for t in u]
        w_local = shard(w, 1, group).float()

        def value(t, local=local, du=du, fn=fn, w_local=w_local):
            torch.manual_seed(11)  # the dropout seeds
            x = [(a + t * b).requires_grad_() for a, b in zip(local, du)]
            out = fn(*x, 0.25, None, True, group=group)
            return (out * w_local).sum(), x

        total, x = value(0.0)
        mine = total.detach().clone()  # this rank's part, before any sum across ranks
        total.backward()
        directional = sum((a.grad * b).sum() for a, b in zip(x, du))
        eps = 1e-2
        numeric = (value(eps)[0] - value(-eps)[0]) / (2 * eps)
        summed = torch.stack([directional.detach(), numeric.detach(), total.detach()])
        dist.all_reduce(summed, group=group)
        directional, numeric, total = summed.tolist()
        assert abs(directional - numeric) <= 2e-2 * max(1.0, abs(numeric)), (fn.__name__, directional, numeric)
        # (each rank's own part: a sum across ranks may add in another order from one reduction to the next)
        assert torch.equal(value(0.0)[0].detach(), mine), f"{fn.__name__}: the same seed gave another output"
        plain = fn(*local, 0.0, None, True, group=group)
        no_drop = (plain * w_local).sum()
        dist.all_reduce(no_drop, group=group)
        assert abs(no_drop.item() - total) > 1e-3, f"{fn.__name__}: dropout_p=0.25 changed nothing"
    # every head the same inputs, every rank seeded alike: Ulysses's ranks (each its own heads) must still
    # drop different elements
    one = torch.randn(1, seqlen, 1, 16)
    x = cp.ring_shard(one.expand(1, seqlen, 2 * world, 16), 1, group)
    torch.manual_seed(5)
    out = cp.ring_unshard(cp.ulysses_flash_attn_func(x, x, x, 0.5, group=group), 1, group)
    heads = out.unbind(2)
    assert not torch.equal(heads[0], heads[2]), "Ulysses: two ranks' heads dropped the same elements"


def run_opcheck(group) -> None:
    """``torch.library.opcheck`` of ``tileattn::ring_fwd`` (schema, fake implementation, autograd
    registration, AOT dispatch), every rank making the same calls."""
    from tileattn.ops import context

    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 6, h, 16, requires_grad=True) for h in (4, 2, 2))
    # dense but permuted, as (batch, nheads, seqlen, headdim) tensors transposed are: outputs keep q's strides
    qt, kt, vt = (torch.randn(2, h, 6, 16).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    for layout in (context.Layout.RING, context.Layout.ZIGZAG):
        for inputs in ((q, k, v), (qt, kt, vt)):
            args = (*inputs, 0.25, -1, 0, 0.0, 0.0, False, int(layout), group.group_name)
            torch.library.opcheck(torch.ops.tileattn.ring_fwd.default, args)


def expect(call, exc, words) -> None:
    try:
        call()
    except exc as e:
        message = str(e)
        missing = [w for w in words if w not in message]
        assert not missing, f"message {message!r} lacks {missing}"
        return
    raise AssertionError(f"no {exc.__name__} raised")


def run_refusals(group) -> None:
    """Bad input raises on every rank, with the same message on the ranks that did nothing wrong."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = torch.randn(1, 8, 2, 16)
    # slices of unequal length
    mine = torch.randn(1, 8 if rank == 0 else 6, 2, 16)
    expect(lambda: cp.ring_flash_attn_func(mine, mine, mine, group=group), cp.Disagreement, ["local seqlen", "8"])
    # one rank's wrong dtype: its own error there, a Disagreement elsewhere
    k = x.double() if rank == 1 else x
    if rank == 1:
        expect(lambda: cp.zigzag_ring_flash_attn_func(x, k, x, group=group), TypeError, ["float64"])
    else:
        expect(lambda: cp.zigzag_ring_flash_attn_func(x, k, x, group=group), cp.Disagreement, ["rank(s) [1]"])
    # options that differ between ranks
    expect(lambda: cp.ring_flash_attn_func(x, x, x, causal=rank == 0, group=group), cp.Disagreement, ["window_right"])
    # one rank's packed qkv of the wrong shape
    qkv = torch.randn(1, 8, 4 if rank == 1 else 3, 2, 16)
    if rank != 1:
        expect(lambda: cp.ring_flash_attn_qkvpacked_func(qkv, group=group), cp.Disagreement, ["rank(s) [1]"])
    else:
        expect(lambda: cp.ring_flash_attn_qkvpacked_func(qkv, group=group), ValueError, ["qkv must have shape"])
    # Ulysses asked for the LSE on one rank only (it would cost that rank one more all-to-all)
    heads = torch.randn(1, 4, 2 * world, 8)
    expect(
        lambda: cp.ulysses_flash_attn_func(heads, heads, heads, return_attn_probs=rank == 0, group=group),
        cp.Disagreement,
        ["return_attn_probs"],
    )
    # packed streams: cu_seqlens that are not the whole stream, or another stream on one rank; a window
    # without causal
    flat = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8 * world], dtype=torch.int32)
    expect(lambda: cp.gather_kv_flash_attn_varlen_func(flat, flat, flat, cu[:2], 3, group=group), ValueError, ["whole"])
    other = torch.tensor([0, 3 + rank, 8 * world], dtype=torch.int32)
    expect(
        lambda: cp.gather_kv_flash_attn_varlen_func(flat, flat, flat, other, 8 * world, group=group),
        cp.Disagreement,
        ["cu_seqlens of the packed stream"],
    )
    expect(
        lambda: cp.gather_kv_flash_attn_varlen_func(flat, flat, flat, cu, 8 * world, window_size=(2, 2), group=group),
        NotImplementedError,
        ["causal=True"],
    )
    # a sequence that does not split into the layout's chunks (local: no rank waits)
    expect(lambda: cp.zigzag_shard(torch.randn(1, 2 * world * 3 + 1, 2, 8), 1, group), ValueError, ["pad it"])
    # ALiBi on the ring, odd zigzag slices, Ulysses heads
    slopes = torch.ones(2)
    expect(lambda: cp.ring_flash_attn_func(x, x, x, alibi_slopes=slopes, group=group), NotImplementedError, ["ulysses"])
    odd = torch.randn(1, 5, 2, 16)
    expect(lambda: cp.zigzag_ring_flash_attn_func(odd, odd, odd, group=group), ValueError, ["even"])
    heads = torch.randn(1, 4, world + 1, 8)
    expect(lambda: cp.ulysses_flash_attn_func(heads, heads, heads, group=group), ValueError, ["multiple of"])
    # the group and the rest still work after the refusals
    out = cp.ring_flash_attn_func(x, x, x, causal=True, group=group)
    assert torch.isfinite(out).all()


def run_mismatched_groups(world: int) -> None:
    """Two ranks calling with different groups (of the same ranks) fail after the groups' timeout with a
    message naming the cause, instead of hanging."""
    timeout = datetime.timedelta(seconds=3)
    a = dist.new_group(list(range(world)), timeout=timeout)
    b = dist.new_group(list(range(world)), timeout=timeout)
    x = torch.randn(1, 4, 2, 8)
    group = a if dist.get_rank() == 0 else b
    expect(lambda: cp.ring_flash_attn_func(x, x, x, group=group), cp.Disagreement, ["same group"])


def main(rank: int, world: int, store: str, results: str, which: list[str], backend: str = "gloo") -> None:
    if os.environ.get("TILEATTN_CP_DEVICE") == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    group = dist.group.WORLD
    report = {}
    jobs = {c.name: (run_case, c, group) for c in cases(world) + interpreter_cases(world)}
    jobs.update({c.name: (run_varlen, c, group) for c in varlen_cases(world)})
    jobs["dropout"] = (run_dropout, group)
    jobs["opcheck"] = (run_opcheck, group)
    jobs["refusals"] = (run_refusals, group)
    jobs["mismatched_groups"] = (run_mismatched_groups, world)  # last: it leaves its groups broken
    for name, (fn, *args) in jobs.items():
        if name not in which:
            continue
        try:
            fn(*args)
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc()
    with open(f"{results}.{rank}", "w") as f:
        json.dump(report, f)
    # a gloo group broken by a timeout aborts in its destructor: leave without running them
    os._exit(0)
