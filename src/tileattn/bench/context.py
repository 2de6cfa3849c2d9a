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

On CPU the ranks are processes sharing the machine's cores (gloo), each with the threads the load
average leaves idle divided among them (at least one). There the efficiencies measure how the processes
share the cores as much as the scaling, and a busy machine's load most of all: a row is marked noisy when
its repeats spread by more than ``cpu_grid.NOISY`` or its ranks got less than ``cpu_grid.BUSY_SHARE`` of
their threads' time while other work loaded the machine, and the table says what that means.
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

from tileattn.bench.cpu_grid import BUSY_SHARE, NOISY, cores, others_load, pick_threads

NHEADS, HEADDIM = 16, 128
GPU_SEQLENS = (32768, 65536, 131072, 262144)
CPU_SEQLENS = (512, 1024)


def _time(fn, device: torch.device, group, repeats: int) -> tuple[float, float, float]:
    """``(ms, spread, share)`` of ``fn`` over ``repeats`` runs, every rank starting together (a barrier
    before each): the slowest rank's median ms, the widest spread of a rank's repeats (upper over lower
    quartile, less 1) and, on CPU, the least share of its threads' time a rank got (CPU time over wall
    time and threads; 1.0 on CUDA)."""
    fn()
    times, cpu, wall = [], 0.0, 0.0
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1, c1 = time.perf_counter(), time.process_time()
        times.append((t1 - t0) * 1e3)
        cpu, wall = cpu + c1 - c0, wall + t1 - t0
    lo, _, hi = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    share = cpu / max(wall, 1e-9) / torch.get_num_threads() if device.type == "cpu" else 1.0
    slowest = torch.tensor([statistics.median(times), hi / lo - 1, -share], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # the slowest, widest and least-served rank's
    ms, spread, share = slowest.tolist()
    return ms, spread, -share


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


def _worker(
    rank: int, world: int, store: str, results: str, seqlens: list[int], repeats: int, cuda: bool, threads: int
) -> None:
    from tileattn import distributed as cp
    from tileattn import flash_attn_func

    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(threads)
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

        anchor, anchor_spread, anchor_share = _time(single, device, group, repeats)
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
            ms, spread, share = _time(run, device, group, repeats)
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
                    ulps=ulps, device=device.type, threads=torch.get_num_threads(), spread=max(spread, anchor_spread),
                    share=min(share, anchor_share),
                )
            )  # fmt: skip
            if rank == 0:
                print(f"cp {name} {seqlen} tokens: {ms:.1f} ms, efficiency {rows[-1]['efficiency']:.2f}", flush=True)
            del x, d_local
        del q, k, v, dout, reference
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda" and peak_per_token:
        rows.append(_longest(cp, device, group, world, peak_per_token))
    if rank == 0:
        with open(results, "w") as f:
            json.dump(rows, f)
    # every rank done with the group before any tears it down: a gloo rank whose peer closes its sockets
    # mid-teardown can abort (seen once in CI, SIGABRT after the last row was printed)
    dist.barrier(group)
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
    threads = 0
    if not cuda:
        idle, why = pick_threads()
        threads = max(1, idle // world)
        print(f"--cp on CPU: {world} processes of {threads} thread(s) ({why})", flush=True)
    print(f"--cp: {len(seqlens)} lengths x 4 schemes over {world} ranks, a line as each is timed", flush=True)
    with tempfile.TemporaryDirectory() as d:
        results = os.path.join(d, "rows.json")
        args = (world, os.path.join(d, "store"), results, seqlens, repeats, cuda, threads)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        with open(results) as f:
            rows = json.load(f)
    return flag_noise(rows, others_load(world * threads) if not cuda else 0.0)


def flag_noise(rows: list[dict], load: float) -> list[dict]:
    """Marks the CPU rows ``noisy`` whose repeats spread by more than NOISY, or whose ranks got less than
    BUSY_SHARE of their threads' time while other work (``load``: cpu_grid.others_load) held half a core."""
    for r in rows:
        if r["case"] == "cp" and r["device"] == "cpu":
            r["noisy"] = r["spread"] > NOISY or (r["share"] < BUSY_SHARE and load >= 0.5)
    return rows


def format_context(rows) -> str:
    from tabulate import tabulate

    table = [
        [
            r["scheme"],
            r["world"],
            f"{r['seqlen']:,}",
            f"{r['anchor_ms']:.1f}",
            f"{r['ms']:.1f}",
            f"{r['efficiency']:.2f}{' noisy' if r.get('noisy') else ''}",
            "" if r["ulps"] is None else f"{r['ulps']:.1f}",
        ]
        for r in rows
        if r["case"] == "cp"
    ]
    headers = ["scheme", "devices", "tokens", "1 device, tokens / W (ms)", "W devices (ms)", "efficiency", "ulps"]
    text = "Context parallelism: causal fwd+bwd, 16 heads x 128\n" + tabulate(table, headers=headers, tablefmt="github")
    note = cpu_note(rows)
    if note:
        text += "\n" + note
    for r in rows:
        if r["case"] == "cp_longest" and r["seqlen"]:
            text += (
                f"\nlongest sequence on {r['world']} devices (zigzag, fwd+bwd): {r['seqlen']:,} tokens, "
                f"{r['ms'] / 1e3:.1f} s, peak {r['peak_gib']:.1f} GiB per device"
            )
    return text


def cpu_note(rows) -> str | None:
    """What the efficiencies of CPU rows measure: a sentence for the end of the table (None without CPU rows)."""
    cpu = [r for r in rows if r["case"] == "cp" and r.get("device") == "cpu"]
    if not cpu:
        return None
    world, threads = cpu[0]["world"], cpu[0]["threads"]
    load = f"load average {os.getloadavg()[0]:.1f} on {cores()} cores, " if hasattr(os, "getloadavg") else ""
    text = (
        f"On CPU the {world} ranks are processes of {threads} thread(s) sharing this machine's cores over gloo: "
        "the efficiencies say how they share the cores, not how GPUs scale."
    )
    noisy = [r for r in cpu if r.get("noisy")]
    if noisy:
        share = min(r["share"] for r in noisy)
        text += (
            f" Rows marked noisy ran on a busy machine ({load}the ranks' threads got as little as {share:.0%} of "
            "their time, or their repeats spread): those efficiencies measure the machine's load, not the schemes; "
            "rerun when the machine is idle."
        )
    return text
