"""How close a decode grid's shape lets a kernel come to DRAM's rate, and where its programs finish.

A probe kernel streams a contiguous cache the way the split kernel does (grid (1, batch * kv heads,
splits), 128-key tiles through Triton's pipeliner, q·Kᵀ and P·V on the tensor cores, no softmax, no
masks) and stamps each program's start and end with ``%globaltimer``, and its SM. For each row and
split count it prints the probe's GB/s of K+V in a CUDA graph next to tileattn's and cuDNN's over the
same caches, and the programs' spread: when the first and the last program end, as a share of the
kernel's time (a grid whose programs end together has nothing to gain from balancing them).

    python scripts/decode_tail.py [--rows 1x131072 8x32768] [--splits 0 15] [--block-n 128 64] [--out FILE]

``--splits 0`` is the split count tileattn picks for the row. ``--kinds`` picks the probe's builds, a
ladder to the split kernel: tiles in runs (as tileattn reads contiguous caches) or dealt in turn as it
deals them for pages smaller than a key tile (``interleave``), with the online softmax
(``softmax``), or with the splits of a kv head launched as one thread-block cluster that sums their
partials after a cluster barrier (``cluster``: a merge in the launch, without the second kernel). ``--profile`` adds each graph's kernels' device times (torch.profiler). Under
``TRITON_INTERPRET=1`` (no GPU: ``--check``) it runs a tiny row without stamps and checks the probe's
output against torch (the cluster builds only run on the GPU, where each is checked as it is built).
"""

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from decode_ab import gbps_rounds, median_range, replay_ms
from tabulate import tabulate

from tileattn.bench.decode import DECODE_BACKENDS, capture_graph, decode_inputs
from tileattn.kernels import decode


@triton.jit
def _timer(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _sm(x):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cluster_sync():
    """A barrier of the cluster's threads, releasing their writes to the others (acquire)."""
    tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned; // $0",
        "=r",
        [],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _stream(
    Q,
    K,
    V,
    Out,
    Merged,
    Stamps,
    tiles,
    stride_qb,
    stride_kb,
    stride_kn,
    nheads_k,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STAGES: tl.constexpr,
    STAMPS: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    SOFTMAX: tl.constexpr,
    CLUSTER: tl.constexpr,
):
    bh = tl.program_id(1)
    if CLUSTER:  # launched as clusters of CLUSTER programs along x: the splits of one (batch, kv head)
        split = tl.program_id(0)
        num_splits = CLUSTER
    else:
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
    if STAMPS:
        start = _timer(bh)
    b = bh // nheads_k
    h = bh % nheads_k
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + (h * GROUP + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptrs, mask=offs_m[:, None] < GROUP, other=0.0)
    kv = b.to(tl.int64) * stride_kb + h * HEAD_DIM
    if INTERLEAVE:  # tiles split, split + num_splits, ... (as tileattn deals them for small pages)
        lo = split
        hi = tiles
        step = num_splits
    else:  # a run of consecutive tiles
        per_split = tl.cdiv(tiles, num_splits)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, tiles)
        step = 1
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in tl.range(lo, hi, step, num_stages=STAGES):
        rows = (t * BLOCK_N + offs_n).to(tl.int64)
        k = tl.load(K + kv + rows[:, None] * stride_kn + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        v = tl.load(V + kv + rows[:, None] * stride_kn + offs_d[None, :])
        if SOFTMAX:  # online softmax in base 2 (scale 1/sqrt(d)), as the split kernel keeps it
            s = s * (1.4426950408889634 / tl.sqrt(HEAD_DIM * 1.0))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        else:
            acc = tl.dot(s.to(v.dtype), v, acc)
    if SOFTMAX:
        acc = acc / l_i[:, None]
    o_ptrs = Out + ((bh * num_splits + split) * BLOCK_M + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, acc)
    if CLUSTER:  # every split's partial written: each program sums a slice of the head dim over them
        _cluster_sync()
        W: tl.constexpr = HEAD_DIM // CLUSTER
        cols = split * W + tl.arange(0, W)
        offs_s = tl.arange(0, CLUSTER)
        part_ptrs = (
            Out
            + ((bh * CLUSTER + offs_s[:, None, None]) * BLOCK_M + offs_m[None, :, None]) * HEAD_DIM
            + cols[None, None, :]
        )
        merged = tl.sum(tl.load(part_ptrs, cache_modifier=".cg"), 0)  # (from L2: other SMs wrote them)
        tl.store(Merged + (bh * BLOCK_M + offs_m[:, None]) * HEAD_DIM + cols[None, :], merged)
    if STAMPS:
        end = _timer(bh)
        slot = Stamps + (bh * num_splits + split) * 3
        tl.store(slot, start)
        tl.store(slot + 1, end)
        tl.store(slot + 2, _sm(bh).to(tl.int64))


class Probe:
    """One row's probe launch, its outputs and stamps (stamps on the GPU only)."""

    def __init__(
        self,
        q,
        k_cache,
        v_cache,
        num_splits,
        block_n=128,
        stages=3,
        stamps=True,
        interleave=False,
        softmax=False,
        cluster=False,
    ):
        batch, cache_len, nheads_k, d = k_cache.shape
        if cluster and (softmax or num_splits > 16 or d % num_splits):
            raise ValueError("cluster merges: sums (no softmax) of up to 16 splits that divide the head dim")
        self.group = q.shape[2] // nheads_k
        self.args = (q, k_cache, v_cache)
        self.grid = (1, batch * nheads_k, num_splits)
        self.cluster = num_splits if cluster else 0
        self.kernel = None
        self.out = torch.empty(batch * nheads_k * num_splits, 16, d, device=q.device, dtype=torch.float32)
        self.merged = torch.empty(batch * nheads_k if cluster else 1, 16, d, device=q.device, dtype=torch.float32)
        self.stamps = torch.zeros(batch * nheads_k * num_splits, 3, device=q.device, dtype=torch.int64)
        self.meta = dict(
            tiles=cache_len // block_n,
            stride_qb=q.stride(0),
            stride_kb=k_cache.stride(0),
            stride_kn=k_cache.stride(1),
            nheads_k=nheads_k,
            GROUP=self.group,
            BLOCK_M=16,
            BLOCK_N=block_n,
            HEAD_DIM=d,
            STAGES=stages,
            STAMPS=stamps,
            INTERLEAVE=interleave,
            SOFTMAX=softmax,
            CLUSTER=self.cluster,
            num_warps=4,
            num_stages=stages,
        )

    def __call__(self):
        q, k, v = self.args
        if not self.cluster:
            _stream[self.grid](q, k, v, self.out, self.merged, self.stamps, **self.meta)
            return self.out
        # clusters of the splits along x: the build's own launcher, given a cluster size (Triton launches
        # gridX · num_ctas programs in clusters of num_ctas; the build itself is compiled for one)
        params = dict(Q=q, K=k, V=v, Out=self.out, Merged=self.merged, Stamps=self.stamps, **self.meta)
        if self.kernel is None:
            self.kernel = _stream.warmup(**params, grid=(1,))
        kernel = self.kernel
        meta = (kernel.metadata.num_warps, self.cluster, kernel.metadata.shared)
        stream = torch.cuda.current_stream().cuda_stream
        args = [params[name] for name in _stream.arg_names]
        kernel.run(1, self.grid[1], 1, stream, kernel.function, meta, None, None, None, *args)
        return self.out

    def max_active_clusters(self) -> int:
        """Clusters of this launch's size the GPU holds at once (after a launch: a cluster of 16 needs
        the attribute the launcher sets)."""
        from triton.runtime import driver

        kernel = self.kernel
        return driver.active.utils.cuOccupancyMaxActiveClusters(kernel.function, kernel.metadata.shared, self.cluster)

    def reference(self):
        """The probe's outputs by torch (fp32) for its query heads (rows past the group are padding): per
        (batch, kv head, split), over its tiles, the sum of (q·Kᵀ in bf16) · V, or with SOFTMAX
        softmax(q·Kᵀ/√d) · V."""
        q, k, v = self.args
        batch, cache_len, nheads_k, d = k.shape
        num_splits = self.grid[2]
        tiles, block_n = self.meta["tiles"], self.meta["BLOCK_N"]
        per = -(-tiles // num_splits)
        out = torch.zeros_like(self.out).view(batch, nheads_k, num_splits, 16, d)
        qg = q[:, 0].view(batch, nheads_k, self.group, d).float()
        for s in range(num_splits):
            own = range(s, tiles, num_splits) if self.meta["INTERLEAVE"] else range(s * per, min((s + 1) * per, tiles))
            keys = torch.tensor(list(own), device=k.device)[:, None] * block_n + torch.arange(block_n, device=k.device)
            ks, vs = k[:, keys.flatten()].float(), v[:, keys.flatten()].float()
            scores = torch.einsum("bhgd,bnhd->bhgn", qg, ks)
            if self.meta["SOFTMAX"]:
                scores = torch.softmax(scores / d**0.5, dim=-1)
            else:
                scores = scores.to(k.dtype).float()
            out[:, :, s, : self.group] = torch.einsum("bhgn,bnhd->bhgd", scores, vs)
        return out.view_as(self.out)

    def heads(self, out):
        """``out``'s rows of query heads (the probe's output or its reference), without the padding."""
        return out.view(-1, 16, out.shape[-1])[:, : self.group]

    def spread(self) -> dict:
        """Programs' ends (first, median) and starts (last) from the kernel's first start, in µs, and the
        SMs the grid ran on."""
        st = self.stamps.cpu()
        t0 = st[:, 0].min().item()
        start, end = (st[:, 0] - t0) / 1e3, (st[:, 1] - t0) / 1e3
        return dict(
            total_us=end.max().item(),
            last_start_us=start.max().item(),
            first_end_us=end.min().item(),
            median_end_us=end.median().item(),
            sms=len(set(st[:, 2].tolist())),
        )


def _check():
    """Interpreter check of the probe kernel against torch on a tiny row (no stamps; fp16: the
    interpreter multiplies bf16 operands as raw bits, docs/design.md)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen).half() for shape in ((2, 1, 8, 16), (2, 80, 2, 16), (2, 80, 2, 16)))
    for splits in (1, 2, 3):
        for interleave in (False, True):
            for softmax in (False, True):
                probe = Probe(q, k, v, splits, 16, 1, False, interleave, softmax)
                out, ref = probe.heads(probe()), probe.heads(probe.reference())
                torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    print("probe matches torch")


def kernel_times(graph, calls: int, replays: int = 10) -> dict:
    """Device time per call of each kernel in ``graph`` (of ``calls`` calls), by torch.profiler over
    ``replays`` replays, and the wall time per call between the replays' events ("call")."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            times[event.key] = event.device_time_total / (replays * calls)
    times["call"] = replay_ms(graph, calls, replays) * 1e3
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["1x131072", "8x32768"])
    ap.add_argument("--splits", nargs="+", type=int, default=[0])
    ap.add_argument("--block-n", nargs="+", type=int, default=[128])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=["plain"],
        choices=["plain", "interleave", "softmax", "softmax+interleave", "cluster", "cluster+interleave"],
        help="probe builds: tiles in runs (plain) or dealt in turn as tileattn deals them for small pages, "
        "with or without the online softmax; cluster: the splits of a kv head launched as one cluster, which sums their "
        "partials after a cluster barrier (the merge in the launch)",
    )
    ap.add_argument("--profile", action="store_true", help="also each graph's kernels' device times (torch.profiler)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--check", action="store_true", help="check the probe under the interpreter and stop")
    args = ap.parse_args()
    if args.check:
        return _check()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    kernels = []
    for row in args.rows:
        batch, cache_len = (int(n) for n in row.split("x"))
        inputs, seqlens, kv_bytes = decode_inputs(batch, cache_len)
        graphs = {}
        for name in ("tileattn", "sdpa-cudnn"):
            calls = [DECODE_BACKENDS[name](q, kc, vc, seqlens)[0] for q, kc, vc in inputs]
            graphs[name], _ = capture_graph(calls)
        probes = {}
        for block_n in args.block_n:
            for splits in args.splits:
                for kind in args.kinds:
                    n = splits or decode.choose_splits(batch * inputs[0][1].shape[2], cache_len, 128, sms)
                    opts = dict(interleave="interleave" in kind, softmax="softmax" in kind, cluster="cluster" in kind)
                    made = [Probe(q, kc, vc, n, block_n, args.stages, **opts) for q, kc, vc in inputs]
                    first = made[0]
                    first()
                    # (the reference in fp32 on the GPU: one copy; a score on a bf16 rounding boundary may
                    # round either way in the two, so the tolerance follows the outputs' scale)
                    ref = first.reference()
                    tol = dict(atol=1e-2 * ref.abs().amax().item(), rtol=2e-2)
                    torch.testing.assert_close(first.heads(first.out), first.heads(ref), **tol)
                    name = f"probe {kind} {n} splits, {block_n}-key tiles"
                    if first.cluster:
                        summed = ref.view(-1, n, *ref.shape[1:]).sum(1)
                        tol = dict(atol=1e-2 * summed.abs().amax().item(), rtol=2e-2)
                        torch.testing.assert_close(first.heads(first.merged), first.heads(summed), **tol)
                        name += f", {first.max_active_clusters()} clusters at once"
                    graphs[name], _ = capture_graph(made)
                    probes[name] = made
        rounds = gbps_rounds(graphs, len(inputs), kv_bytes, args.rounds)
        for name, vals in rounds.items():
            spread = {}
            if name in probes:
                probes[name][0]()  # a single call, after the graphs: its stamps
                torch.cuda.synchronize()
                spread = probes[name][0].spread()
            rec = dict(row=row, variant=name, gbps=vals, **spread)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
            share = (
                f"{spread['first_end_us'] / spread['total_us']:.3f} / {spread['median_end_us'] / spread['total_us']:.3f}"
                if spread
                else "-"
            )
            table.append(
                [
                    row,
                    name,
                    median_range(vals),
                    share,
                    f"{spread['total_us']:.1f}" if spread else "-",
                    spread.get("sms", "-"),
                ]
            )
        if args.profile:
            for name in ("tileattn", "sdpa-cudnn"):
                for kernel, us in kernel_times(graphs[name], len(inputs)).items():
                    kernels.append([row, name, kernel[:60], f"{us:.2f}"])
        del graphs, probes, inputs
        torch.cuda.empty_cache()
    if kernels:
        print(tabulate(kernels, headers=["row", "graph", "kernel", "µs per call"], tablefmt="github"))
    print(
        tabulate(
            table, headers=["row", "kernel", "GB/s", "first / median end", "µs (one call)", "SMs"], tablefmt="github"
        )
    )


if __name__ == "__main__":
    main()
