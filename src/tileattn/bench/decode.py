"""Decode benchmark: one query token per sequence against a long KV cache (``--decode``).

GQA 32/8 heads, head dim 128 by default; the figure of merit is GB/s of K and V read,
``2 · batch · cache_len · nheads_k · headdim · bytes / time``. Every backend is timed the same way: a
CUDA graph of calls over several copies of the inputs, rotated so that together they exceed the L2
cache (each call reads its cache from HBM, as in serving where the cache is far larger than L2), and
the graph's replay time divided by the number of calls. The tileattn rows use contiguous caches and
paged caches of several page sizes (pages shuffled); the ``fa4`` rows (FlashAttention-4, where
``flash_attn.cute`` is installed) the same caches and pools.

The rows marked ``do_bench`` time the plain Python call as the anchor measurements did: the median of
``triton.testing.do_bench`` (L2 flushed between calls, no graph), so the host's per-call work counts
where it exceeds the GPU's (tileattn validates cache_seqlens / block_table on the host once per
unmodified tensor). ``copy read+write`` is the copy ceiling, timed alike: a device-to-device copy of the
K cache, GB/s counted as bytes read plus bytes written (4.27 TB/s on the H200).

``--decode-ab`` (``run_decode_ab``) times the same rows as an interleaved A/B: per row and layout, one
graph per layout and anchor, replayed in turn for several rounds, so that a slow spell of the machine
falls on all of them; medians and ranges of the rounds. Its layouts add diagnostic ones to the
benchmark's (``AB_LAYOUTS``: pages in other orders, a kernel ahead of the call, the append step).
"""

from __future__ import annotations

import statistics
import time

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


def decode_inputs(
    batch, cache_len, nheads=32, nheads_k=8, headdim=128, dtype=torch.bfloat16, device="cuda", touch_bytes=_L2_BYTES
):
    """``(inputs, seqlens, kv_bytes)`` of one decode row: ``(q, k_cache, v_cache)`` copies enough to
    touch at least ``touch_bytes`` together (seeded), full caches, and the K+V bytes one call reads."""
    kv_bytes = 2 * batch * cache_len * nheads_k * headdim * torch.finfo(dtype).bits // 8
    copies = max(1, -(-touch_bytes // kv_bytes))
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


# --decode-ab: layouts timed against anchors in turn. A layout's maker returns (call, expected):
# ``expected()``, run after the call, gives (q, k, v) of the first sequence for the reference.


def _as_checked(make):
    """A ``DECODE_BACKENDS`` maker in the A/B's form: the reference reads its (q, ref_k, ref_v)."""

    def made(q, k_cache, v_cache, seqlens):
        run, ref_k, ref_v = make(q, k_cache, v_cache, seqlens)
        return run, lambda: (q[:1], ref_k[:1], ref_v[:1])

    return made


def _after_kernel(make):
    """The call with a one-element torch kernel launched before it, so that the kernel ahead of it in
    the stream is not a decode kernel."""

    def made(q, k_cache, v_cache, seqlens):
        run, expected = make(q, k_cache, v_cache, seqlens)
        bump = torch.zeros(1, device=q.device)

        def call():
            bump.add_(1)
            return run()

        return call, expected

    return made


def _append(page=None):
    """A decode step with its append: one new token's k and v, rotated (interleaved rotary over the whole
    head dim), written at the cache's last slot (the same slot every call), then causal attention over
    the cache with q rotated at that position."""

    def make(q, k_cache, v_cache, seqlens):
        from tileattn.rotary import apply_rotary_emb

        kc, vc, table = k_cache, v_cache, None
        if page is not None:
            kc, vc, table, _, _ = _pool(q, k_cache, v_cache, page)
        gen = torch.Generator(device=q.device).manual_seed(2)
        k = torch.randn(q.shape[0], 1, *k_cache.shape[2:], device=q.device, dtype=q.dtype, generator=gen)
        v = torch.randn_like(k)
        angle = torch.rand(k_cache.shape[1], k_cache.shape[3] // 2, device=q.device, generator=gen)
        cos, sin = angle.cos().to(q.dtype), angle.sin().to(q.dtype)
        before = seqlens - 1

        def run():
            return tileattn.flash_attn_with_kvcache(
                q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=before, block_table=table, causal=True
            )

        def expected():
            n = int(seqlens[0])
            if table is None:
                k0, v0 = kc[:1, :n], vc[:1, :n]
            else:
                pages = table[0].long()
                k0 = kc[pages].reshape(1, -1, *kc.shape[2:])[:, :n]
                v0 = vc[pages].reshape(1, -1, *vc.shape[2:])[:, :n]
            k_rot = apply_rotary_emb(k[:1], cos, sin, interleaved=True, seqlen_offsets=n - 1)
            torch.testing.assert_close(k0[:, n - 1 :].float(), k_rot.float(), atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(v0[:, n - 1 :], v[:1])
            return apply_rotary_emb(q[:1], cos, sin, interleaved=True, seqlen_offsets=n - 1), k0, v0

        return run, expected

    return make


# The benchmark's layouts, and diagnostic ones: pools whose pages lie elsewhere than the benchmark's
# shuffle (``_pool``'s orders), a torch kernel ahead of the call, the append step, one block table
# shared by every input copy (hot in L2 after the first call, as a model's layers share one).
AB_LAYOUTS = {
    "tileattn": _as_checked(_tileattn()),
    "tileattn paged16": _as_checked(_tileattn(page=16)),
    "tileattn paged256": _as_checked(_tileattn(page=256)),
    "tileattn after a kernel": _after_kernel(_as_checked(_tileattn())),
    "tileattn paged16 after a kernel": _after_kernel(_as_checked(_tileattn(page=16))),
    "tileattn append": _append(),
    "tileattn paged16 append": _append(page=16),
    "tileattn paged16 in order": _as_checked(_tileattn(page=16, order="in order")),
    "tileattn paged16 lockstep": _as_checked(_tileattn(page=16, order="lockstep")),
    "tileattn paged16 shuffled in 2 MiB": _as_checked(_tileattn(page=16, order=64)),
    "tileattn paged256 in order": _as_checked(_tileattn(page=256, order="in order")),
    "tileattn paged256 lockstep": _as_checked(_tileattn(page=256, order="lockstep")),
    "tileattn paged16 shared table": _as_checked(_tileattn(page=16, shared_table=True)),
    "tileattn paged256 shared table": _as_checked(_tileattn(page=256, shared_table=True)),
}
AB_DEFAULT_LAYOUTS = ("tileattn", "tileattn paged16", "tileattn paged256")


def _replayer(calls: list, device: torch.device):
    """``(replay, first output)``: ``replay()`` runs every call once, as one CUDA graph on the GPU, as the
    calls themselves elsewhere (the CPU path, to test the harness)."""
    if device.type == "cuda":
        graph, outs = capture_graph(calls)
        return graph.replay, outs[0]
    outs = [call() for call in calls]
    return (lambda: [call() for call in calls]), outs[0]


def replay_ms(replay, calls: int, replays: int, device: torch.device) -> float:
    """Median milliseconds per call over ``replays`` replays of ``calls`` calls."""
    times = []
    for _ in range(replays):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            replay()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def _check_expected(name, out, expected):
    q, ref_k, ref_v = expected()
    ref = attention_ref(q, ref_k, ref_v, upcast=torch.float64)[0]
    lowp = attention_ref(q, ref_k, ref_v, upcast=False)[0]
    check_close(name, out[:1], ref, lowp)


def run_decode_ab(
    rows=None,
    layouts=AB_DEFAULT_LAYOUTS,
    anchors=("sdpa-cudnn",),
    rounds=5,
    replays=5,
    dtype=torch.bfloat16,
    nheads=32,
    nheads_k=8,
    headdim=128,
    device="cuda",
    progress=print,
    time_replay=replay_ms,
    touch_bytes=_L2_BYTES,
):
    """Per row and layout: the layout's calls and each anchor's over the same inputs, checked against the
    reference, then timed in turn for ``rounds`` rounds (``time_replay(replay, calls, replays, device)``:
    ms per call). Returns rows of ``kind='decode-ab'``: ``case`` the layout, ``backend`` the layout or the
    anchor timed in its rounds, ``gbps`` the median of the rounds, ``gbps_rounds`` all of them. The
    inputs are copies that touch ``touch_bytes`` per replay together (each call reads from HBM)."""
    device = torch.device(device)
    out_rows = []
    for batch, cache_len in rows or DECODE_CASES:
        inputs, seqlens, kv_bytes = decode_inputs(
            batch, cache_len, nheads, nheads_k, headdim, dtype, device, touch_bytes
        )
        base = dict(
            kind="decode-ab", batch=batch, cache_len=cache_len, nheads=nheads, nheads_k=nheads_k, headdim=headdim
        )
        for layout in layouts:
            timed, alive = {}, []  # alive: the calls (and their tables) a captured graph replays
            for name in (layout, *(a for a in anchors if a != layout)):
                try:
                    if name == layout:
                        made = [AB_LAYOUTS[name](q, kc, vc, seqlens) for q, kc, vc in inputs]
                    else:
                        made = [_as_checked(DECODE_BACKENDS[name])(q, kc, vc, seqlens) for q, kc, vc in inputs]
                    calls = [m[0] for m in made]
                    replay, out = _replayer(calls, device)
                    _check_expected(name, out, made[0][1])
                except Unavailable as exc:
                    progress(f"{name} {batch}x{cache_len}: {exc}")
                    continue
                except Exception as exc:  # noqa: BLE001 - reported as an error row, the other layouts still run
                    progress(f"{name} {batch}x{cache_len}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    out_rows.append(dict(base, case=layout, backend=name, error=str(exc).splitlines()[0][:200]))
                    if name == layout:
                        break
                    continue
                timed[name] = replay
                alive.append(calls)
            if layout not in timed:
                continue
            gbps = {name: [] for name in timed}
            for _ in range(rounds):
                for name, replay in timed.items():
                    gbps[name].append(kv_bytes / time_replay(replay, len(inputs), replays, device) / 1e6)
            for name, vals in gbps.items():
                mid = statistics.median(vals)
                row = dict(base, case=layout, backend=name, gbps=mid, ms=kv_bytes / mid / 1e6)
                out_rows.append(dict(row, gbps_min=min(vals), gbps_max=max(vals), gbps_rounds=vals))
            progress(
                f"{batch}x{cache_len} {layout}: "
                + ", ".join(f"{n} {statistics.median(v):.0f}" for n, v in gbps.items())
            )
            del timed, alive
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out_rows


def format_decode_ab(rows) -> str:
    """One line per row and layout: the layout's GB/s (median and range of the rounds), each anchor's in
    the same rounds, and the layout's ratio to the first anchor it was timed with."""
    from tabulate import tabulate

    anchors = list(dict.fromkeys(r["backend"] for r in rows if r["backend"] != r["case"] and "error" not in r))
    table = []
    for key in dict.fromkeys((r["batch"], r["cache_len"], r["case"]) for r in rows):
        group = {r["backend"]: r for r in rows if (r["batch"], r["cache_len"], r["case"]) == key}
        ours = group.get(key[2])
        line = [f"{key[0]}x{key[1]}", key[2]]
        if ours is None or "error" in ours:
            table.append(line + ["error: " + (ours or {}).get("error", "")[:50]])
            continue
        line.append(f"{ours['gbps']:.0f} ({ours['gbps_min']:.0f}-{ours['gbps_max']:.0f})")
        for anchor in anchors:
            a = group.get(anchor)
            line.append(f"{a['gbps']:.0f}" if a and "gbps" in a else "-")
        first = next((group[a] for a in anchors if "gbps" in group.get(a, {})), None)
        line.append(f"{ours['gbps'] / first['gbps']:.3f}" if first else "")
        table.append(line)
    ratio = f"÷ {anchors[0]}" if len(anchors) == 1 else "÷ first anchor"
    headers = ["batch x cache", "layout", "GB/s K+V (range)", *anchors, ratio]

    return tabulate(table, headers=headers, tablefmt="github", disable_numparse=True)
