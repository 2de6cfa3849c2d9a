"""Context-parallel benchmark (``--cp``): exactness and scaling of ``tileattn.distributed`` across the GPUs
of one host (NCCL, one process per GPU, spawned here), or across CPU processes (gloo) without GPUs.

For each total sequence length S (one sequence, 16 heads of dim 128, bf16, causal):

- the single-device anchor: ``flash_attn_func`` on S / W tokens on one device, forward + backward;
- zigzag ring, ring, Ulysses and gathered K/V (``gather_kv_flash_attn_varlen_func`` on the one sequence)
  on S tokens over W devices, forward + backward;
- efficiency of each: per-device throughput against the anchor's, ``W · t(S / W, 1 device) / t(S, W)``
  (causal work grows with S², so S tokens on W devices is W times the anchor's work per device; 1.0 is
  perfect scaling);
- exactness: where the whole sequence fits on one device, the gathered output and gradients against the
  single-device kernel on the whole sequence, as the largest difference in units of bf16's rounding at
  the largest magnitude (ulps).

Then the longest sequence: memory per device grows linearly in S, so the peak of the largest timed run
predicts the longest S that fits; the prediction is run (zigzag, forward + backward) to confirm it.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NHEADS, HEADDIM = 16, 128
GPU_SEQLENS = (32768, 65536, 131072, 262144)
CPU_SEQLENS = (512, 1024)


def _time(fn, device: torch.device, group, repeats: int) -> float:
    """Median ms of ``fn`` over ``repeats`` runs, every rank starting together (a barrier before each)."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's
    return t.item()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() or 1.0
    return (a.float() - b.float()).abs().max().item() / (torch.finfo(torch.bfloat16).eps * scale)


def _gather_kv(cp):
    """``gather_kv_flash_attn_varlen_func`` on one sequence, called as the others are (batch 1)."""

    def call(q, k, v, causal, group):
        seqlen = q.shape[1] * dist.get_world_size(group)
        cu = torch.tensor([0, seqlen], dtype=torch.int32, device=q.device)
        out = cp.gather_kv_flash_attn_varlen_func(q[0], k[0], v[0], cu, seqlen, causal=causal, group=group)
        return out.unsqueeze(0)

    return call


def _worker(rank: int, world: int, store: str, results: str, seqlens: list[int], repeats: int, cuda: bool) -> None:
    from tileattn import distributed as cp
    from tileattn import flash_attn_func

    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dtype = torch.bfloat16 if cuda else torch.float32
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5)
    )
    group = dist.group.WORLD
    schemes = {
        "zigzag": (cp.zigzag_ring_flash_attn_func, cp.zigzag_shard, cp.zigzag_unshard),
        "ring": (cp.ring_flash_attn_func, cp.ring_shard, cp.ring_unshard),
        "ulysses": (cp.ulysses_flash_attn_func, cp.ring_shard, cp.ring_unshard),
        "gather-kv": (_gather_kv(cp), cp.ring_shard, cp.ring_unshard),
    }
    rows = []
    peak_per_token = 0.0
    for seqlen in seqlens:
        gen = torch.Generator(device=device).manual_seed(seqlen)
        q, k, v, dout = (
            torch.randn(1, seqlen, NHEADS, HEADDIM, device=device, dtype=dtype, generator=gen) for _ in range(4)
        )
        local = seqlen // world

        def single(q=q, k=k, v=v, dout=dout, local=local):
            x = [t[:, :local].detach().requires_grad_() for t in (q, k, v)]
            flash_attn_func(*x, causal=True).backward(dout[:, :local])

        anchor = _time(single, device, group, repeats)
        reference = None
        try:  # the whole sequence on one device, for exactness
            x = [t.detach().requires_grad_() for t in (q, k, v)]
            out = flash_attn_func(*x, causal=True)
            out.backward(dout)
            reference = [out.detach()] + [t.grad for t in x]
            del x, out
        except torch.cuda.OutOfMemoryError:
            pass
        for name, (fn, shard, unshard) in schemes.items():
            x = [shard(t, 1, group).detach().requires_grad_() for t in (q, k, v)]
            d_local = shard(dout, 1, group)

            def run(fn=fn, x=x, d_local=d_local):
                for t in x:
                    t.grad = None
                fn(*x, causal=True, group=group).backward(d_local)

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ms = _time(run, device, group, repeats)
            if device.type == "cuda" and name == "zigzag":
                peak_per_token = max(peak_per_token, torch.cuda.max_memory_allocated() / local)
            ulps = None
            if reference is not None:
                got = [unshard(fn(*x, causal=True, group=group).detach(), 1, group)]
                got += [unshard(t.grad, 1, group) for t in x]
                ulps = max(_ulps(a, b) for a, b in zip(got, reference))
            rows.append(
                dict(
                    case="cp", scheme=name, world=world, seqlen=seqlen, nheads=NHEADS, headdim=HEADDIM,
                    dtype=str(dtype).replace("torch.", ""), ms=ms, anchor_ms=anchor, efficiency=world * anchor / ms,
                    ulps=ulps, device=device.type,
                )
            )  # fmt: skip
            del x, d_local
        del q, k, v, dout, reference
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda" and peak_per_token:
        rows.append(_longest(cp, device, group, world, peak_per_token))
    if rank == 0:
        with open(results, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _longest(cp, device, group, world: int, peak_per_token: float) -> dict:
    """The longest causal sequence whose zigzag forward + backward runs: predicted from the memory per
    token (linear in S) and confirmed by running it (halving the step on running out)."""
    free = torch.tensor([torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()], device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN, group=group)
    unit = 2 * world * 1024
    seqlen = int(free.item() * 0.92 / peak_per_token * world) // unit * unit
    while seqlen >= unit:
        ok = torch.ones(1, device=device)
        try:
            x = [
                torch.randn(1, seqlen // world, NHEADS, HEADDIM, device=device, dtype=torch.bfloat16) for _ in range(3)
            ]
            for t in x:
                t.requires_grad_()
            t0 = time.perf_counter()
            cp.zigzag_ring_flash_attn_func(*x, causal=True, group=group).sum().backward()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
        except torch.cuda.OutOfMemoryError:
            ok.zero_()
        x = None
        torch.cuda.empty_cache()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if ok.item():
            peak = torch.cuda.max_memory_allocated() / 2**30
            return dict(case="cp_longest", scheme="zigzag", world=world, seqlen=seqlen, ms=ms, peak_gib=peak)
        seqlen = seqlen * 3 // 4 // unit * unit
    return dict(case="cp_longest", scheme="zigzag", world=world, seqlen=0, ms=None, peak_gib=None)


def run_context(world: int | None = None, seqlens=None, repeats: int = 5, device: str | None = None) -> list[dict]:
    """Spawns ``world`` ranks (default: every GPU, or 2 CPU processes) and returns the rows of rank 0.
    ``device``: "cuda" or "cpu" (gloo processes on a host with GPUs too); default: cuda if there is a GPU."""
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    world = world or (torch.cuda.device_count() if cuda else 2)
    if cuda and world > torch.cuda.device_count():
        raise SystemExit(f"--cp: {world} ranks need {world} GPUs, this host has {torch.cuda.device_count()}")
    seqlens = list(seqlens or (GPU_SEQLENS if cuda else CPU_SEQLENS))
    if any(s % (2 * world) for s in seqlens):
        raise SystemExit(f"--cp: every sequence length must be a multiple of 2 x {world} ranks, got {seqlens}")
    with tempfile.TemporaryDirectory() as d:
        results = os.path.join(d, "rows.json")
        args = (world, os.path.join(d, "store"), results, seqlens, repeats, cuda)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        with open(results) as f:
            return json.load(f)


def format_context(rows) -> str:
    from tabulate import tabulate

    table = [
        [
            r["scheme"],
            r["world"],
            f"{r['seqlen']:,}",
            f"{r['anchor_ms']:.1f}",
            f"{r['ms']:.1f}",
            f"{r['efficiency']:.2f}",
            "" if r["ulps"] is None else f"{r['ulps']:.1f}",
        ]
        for r in rows
        if r["case"] == "cp"
    ]
    headers = ["scheme", "devices", "tokens", "1 device, tokens / W (ms)", "W devices (ms)", "efficiency", "ulps"]
    text = "Context parallelism: causal fwd+bwd, 16 heads x 128\n" + tabulate(table, headers=headers, tablefmt="github")
    for r in rows:
        if r["case"] == "cp_longest" and r["seqlen"]:
            text += (
                f"\nlongest sequence on {r['world']} devices (zigzag, fwd+bwd): {r['seqlen']:,} tokens, "
                f"{r['ms'] / 1e3:.1f} s, peak {r['peak_gib']:.1f} GiB per device"
            )
    return text
