"""Decode benchmark: one query token per sequence against a long KV cache (``--decode``).

GQA 32/8 heads, head dim 128 by default; the figure of merit is GB/s of K and V read,
``2 · batch · cache_len · nheads_k · headdim · bytes / time``. Every backend is timed the same way: a
CUDA graph of calls over several copies of the inputs, rotated so that together they exceed the L2
cache (each call reads its cache from HBM, as in serving where the cache is far larger than L2), and
the graph's replay time divided by the number of calls. The tileattn rows use contiguous caches and
paged caches of several page sizes (pages shuffled); the ``fa4`` rows (FlashAttention-4, where
``flash_attn.cute`` is installed: ``scripts/gpu_fa4.sh decode``) the same caches and pools.

The rows marked ``do_bench`` time the plain Python call as ``../shared/ANCHORS.md`` did: the median of
``triton.testing.do_bench`` (L2 flushed between calls, no graph), so the host's per-call work counts
where it exceeds the GPU's (tileattn validates cache_seqlens / block_table on the host once per
unmodified tensor). ``copy read+write`` is ANCHORS' copy ceiling, timed alike: a device-to-device copy
of the K cache, GB/s counted as bytes read plus bytes written (the issue's 4.27 TB/s).
"""

from __future__ import annotations

import statistics

import torch

import tileattn
from tileattn.bench.backends import Unavailable
from tileattn.reference import attention_ref
from tileattn.testing import check_close

DECODE_CASES = [(1, 8192), (1, 131072), (8, 32768), (64, 4096), (64, 16384)]
_L2_BYTES = 512 * 2**20  # rotate inputs until at least this much is touched per graph
DO_BENCH_BACKENDS = ("tileattn", "tileattn paged16", "tileattn paged256", "sdpa-cudnn", "fa4")


def do_bench_ms(call) -> float:
    import triton

    return triton.testing.do_bench(call, return_mode="median")


def capture_graph(calls: list) -> tuple[torch.cuda.CUDAGraph, list]:
    """A CUDA graph of ``calls`` (run once on a side stream first, as capture wants), replayed once;
    with the outputs of the warm-up run."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outs = [call() for call in calls]
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs


def graph_ms(calls: list) -> float:
    """Median time of one call: a CUDA graph of ``calls`` replayed, divided by their number."""
    graph, _ = capture_graph(calls)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def _sdpa(backend_name):
    def make(q, k_cache, v_cache, seqlens):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        backend = getattr(SDPBackend, backend_name)

        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

        return run, k_cache, v_cache

    return make


def _flex(q, k_cache, v_cache, seqlens):
    from tileattn.bench.backends import _flex as flex_make

    return flex_make(q, k_cache, v_cache, False), k_cache, v_cache


def _pool(q, k_cache, v_cache, page, order="shuffled"):
    """The caches as a pool of pages of ``page`` keys under a block table that places them in ``order``:
    ``(k_pages, v_pages, table, ref_k, ref_v)``, the last two the first sequence's keys and values in the
    order the table gives them. Orders: ``"shuffled"`` (the benchmark's: a seeded random permutation of
    the pool), ``"in order"`` (sequence b's pages in one run, the contiguous cache's memory), ``"lockstep"``
    (page j of sequence b is pool page j * batch + b, as ``PagedKVCache`` hands out pages to sequences
    that grow together), or an int n (a seeded permutation within each run of n consecutive pool pages:
    pages as scattered as ``"shuffled"``'s at a finer scale, 64 pages of 32 KiB within each 2 MiB)."""
    batch, cache_len = k_cache.shape[:2]
    pages, per_seq = batch * cache_len // page, cache_len // page
    kp = k_cache.reshape(pages, page, *k_cache.shape[2:])
    vp = v_cache.reshape(pages, page, *v_cache.shape[2:])
    gen = torch.Generator(device=q.device).manual_seed(1)
    if order == "shuffled":
        perm = torch.randperm(pages, device=q.device, generator=gen)
    elif order == "in order":
        perm = torch.arange(pages, device=q.device)
    elif order == "lockstep":
        perm = torch.arange(pages, device=q.device).view(per_seq, batch).t().flatten()
    elif isinstance(order, int) and order > 0 and pages % order == 0:
        keys = torch.rand(pages, device=q.device, generator=gen) + torch.arange(pages, device=q.device) // order
        perm = keys.argsort()
    else:
        raise ValueError(f"order: 'shuffled', 'in order', 'lockstep' or a divisor of the {pages} pages, not {order!r}")
    table = perm.view(batch, per_seq).to(torch.int32)
    first = perm[:per_seq].long()
    ref_k = kp[first].reshape(1, cache_len, *k_cache.shape[2:])
    ref_v = vp[first].reshape(1, cache_len, *k_cache.shape[2:])
    return kp, vp, table, ref_k, ref_v


def _tileattn(num_splits=0, page=None, order="shuffled", shared_table=False):
    """tileattn's call; with ``page``, over a pool of pages of that size (``_pool``). Each input copy has
    its own table, so that, like the caches, it is not in L2 when read; ``order``: where the pool's pages
    lie (``_pool``); ``shared_table``: one table for all copies (as the layers of a model share one)."""
    tables = {}

    def make(q, k_cache, v_cache, seqlens):
        if page is None:
            run = lambda: tileattn.flash_attn_with_kvcache(  # noqa: E731
                q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits
            )
            return run, k_cache, v_cache
        kp, vp, table, ref_k, ref_v = _pool(q, k_cache, v_cache, page, order)
        if shared_table:
            table = tables.setdefault(tuple(k_cache.shape[:2]), table)
        run = lambda: tileattn.flash_attn_with_kvcache(  # noqa: E731
            q, kp, vp, cache_seqlens=seqlens, block_table=table, num_splits=num_splits
        )
        return run, ref_k, ref_v

    return make


def _fa4(page=None):
    """FlashAttention-4 (``flash_attn.cute``, where installed) without splits (ANCHORS.md's "no split":
    4.0.0b36 has no split-KV on sm90): ``flash_attn_func`` over the whole cache, or with ``page`` its
    paged path (``flash_attn_varlen_func`` with ``page_table`` and ``seqused_k``) over ``_pool``'s pages."""

    def make(q, k_cache, v_cache, seqlens):
        try:
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
        except ImportError as exc:
            raise Unavailable("flash_attn.cute (FA4) is not installed") from exc

        def first(out):
            return out[0] if isinstance(out, tuple) else out

        if page is None:
            return lambda: first(flash_attn_func(q, k_cache, v_cache)), k_cache, v_cache
        kp, vp, table, ref_k, ref_v = _pool(q, k_cache, v_cache, page)
        run = lambda: first(  # noqa: E731
            flash_attn_varlen_func(q, kp, vp, seqused_k=seqlens, page_table=table)
        )
        return run, ref_k, ref_v

    return make


DECODE_BACKENDS = {
    "tileattn": _tileattn(),
    "tileattn nosplit": _tileattn(num_splits=1),
    "tileattn paged16": _tileattn(page=16),
    "tileattn paged256": _tileattn(page=256),
    "fa4": _fa4(),
    "fa4 paged16": _fa4(page=16),
    "fa4 paged256": _fa4(page=256),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flex": _flex,
}


def decode_inputs(batch, cache_len, nheads=32, nheads_k=8, headdim=128, dtype=torch.bfloat16, device="cuda"):
    """``(inputs, seqlens, kv_bytes)`` of one decode row: ``(q, k_cache, v_cache)`` copies enough to
    touch at least _L2_BYTES together (seeded), full caches, and the K+V bytes one call reads."""
    kv_bytes = 2 * batch * cache_len * nheads_k * headdim * torch.finfo(dtype).bits // 8
    copies = max(1, -(-_L2_BYTES // kv_bytes))
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = []
    for _ in range(copies):
        q = torch.randn(batch, 1, nheads, headdim, device=device, dtype=dtype, generator=gen)
        kc = torch.randn(batch, cache_len, nheads_k, headdim, device=device, dtype=dtype, generator=gen)
        vc = torch.randn(batch, cache_len, nheads_k, headdim, device=device, dtype=dtype, generator=gen)
        inputs.append((q, kc, vc))
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
    return inputs, seqlens, kv_bytes


def run_decode(dtype=torch.bfloat16, nheads=32, nheads_k=8, headdim=128, cases=None, backends=None, progress=print):
    rows = []
    for batch, cache_len in cases or DECODE_CASES:
        inputs, seqlens, kv_bytes = decode_inputs(batch, cache_len, nheads, nheads_k, headdim, dtype)
        base = dict(kind="decode", batch=batch, cache_len=cache_len, nheads=nheads, nheads_k=nheads_k, headdim=headdim)
        src = inputs[0][1]
        dst = torch.empty_like(src)
        t = do_bench_ms(lambda d=dst, s=src: d.copy_(s))
        moved = 2 * src.numel() * src.element_size()  # read + written
        rows.append(dict(base, backend="copy read+write", ms=t, gbps=moved / t / 1e6))
        del dst
        for name in backends or DECODE_BACKENDS:
            make = DECODE_BACKENDS[name]
            try:
                made = [make(q, kc, vc, seqlens) for q, kc, vc in inputs]
                calls = [m[0] for m in made]
                out = calls[0]()
                sl = slice(0, 1)
                q, ref_k, ref_v = inputs[0][0][sl], made[0][1][sl], made[0][2][sl]
                del made
                ref = attention_ref(q, ref_k, ref_v, upcast=torch.float64)[0]
                lowp = attention_ref(q, ref_k, ref_v, upcast=False)[0]
                check_close(name, out[sl], ref, lowp)
                del ref_k, ref_v
                t = graph_ms(calls)
            except Unavailable as exc:  # not installed here: no row
                progress(f"{name} {batch}x{cache_len}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run this case is reported, not fatal
                progress(f"{name} {batch}x{cache_len}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                rows.append(dict(base, backend=name, error=str(exc).splitlines()[0][:200]))
                continue
            row = dict(base, backend=name, ms=t, gbps=kv_bytes / t / 1e6)
            rows.append(row)
            progress(f"{name} {batch}x{cache_len}: {row['gbps']:.0f} GB/s")
            if name in DO_BENCH_BACKENDS:
                t = do_bench_ms(calls[0])
                rows.append(dict(base, backend=f"{name} do_bench", ms=t, gbps=kv_bytes / t / 1e6))
            del calls
        del inputs
        torch.cuda.empty_cache()
    return rows


def format_decode(rows) -> str:
    from tabulate import tabulate

    table = []
    for batch, cache_len in dict.fromkeys((r["batch"], r["cache_len"]) for r in rows):
        group = [r for r in rows if (r["batch"], r["cache_len"]) == (batch, cache_len)]
        ours = next((r for r in group if r["backend"] == "tileattn" and "ms" in r), None)
        for r in group:
            if "error" in r:
                table.append([f"{batch}x{cache_len}", r["backend"], "-", "-", "error: " + r["error"][:50]])
                continue
            ratio = f"{r['ms'] / ours['ms']:.2f}x" if ours else ""
            table.append([f"{batch}x{cache_len}", r["backend"], f"{r['ms'] * 1e3:.1f}", f"{r['gbps']:.0f}", ratio])
    headers = ["batch x cache", "backend", "µs", "GB/s K+V", "tileattn speed-up"]
    return tabulate(table, headers=headers, tablefmt="github")
