"""Interleaved A/B timing of decode kernel settings: for each decode row and cache layout, one CUDA graph
per variant (and one per anchor: cuDNN's, or the backends --anchors names) over the same inputs, replayed
in turn for several rounds, so that drift between variants (clocks, memory placement) falls on all of
them alike; medians of the rounds.

    python scripts/decode_ab.py [--rounds 4] [--out FILE] "" "tma=1" "ptma=0"

Variants are ``name=value`` changes as in ``decode_variants.py`` (same names). Outputs are checked
against the first variant's before timing. Prints GB/s of K+V per row (median, and the spread of rounds).
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
from decode_variants_settings import apply
from tabulate import tabulate

import tileattn
from tileattn.bench.decode import DECODE_BACKENDS, DECODE_CASES, _pool, _tileattn, capture_graph, decode_inputs


def _after_kernel(make):
    """The call with a one-element torch kernel launched before it, so that the kernel ahead of the call
    in the stream is not a decode kernel (a chain of programmatic dependent launches is broken there)."""

    def made(q, k_cache, v_cache, seqlens):
        run, ref_k, ref_v = make(q, k_cache, v_cache, seqlens)
        bump = torch.zeros(1, device=q.device)

        def call():
            bump.add_(1)
            return run()

        return call, ref_k, ref_v

    return made


def _append(page=None):
    """A decode step with its append: one new token's k and v rotated and written at cache_seqlens =
    the cache's length - 1 (the same slot every call), then attention over the cache (causal, q rotated)."""

    def make(q, k_cache, v_cache, seqlens):
        kc, vc, table, ref_k, ref_v = (k_cache, v_cache, None, k_cache, v_cache)
        if page is not None:
            kc, vc, table, ref_k, ref_v = _pool(q, k_cache, v_cache, page)
        gen = torch.Generator(device=q.device).manual_seed(2)
        k = torch.randn(q.shape[0], 1, *k_cache.shape[2:], device=q.device, dtype=q.dtype, generator=gen)
        v = torch.randn_like(k)
        angle = torch.rand(k_cache.shape[1], k_cache.shape[3] // 2, device=q.device, generator=gen)
        cos, sin = angle.cos().to(q.dtype), angle.sin().to(q.dtype)
        before = seqlens - 1
        run = lambda: tileattn.flash_attn_with_kvcache(  # noqa: E731
            q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=before, block_table=table, causal=True
        )
        return run, ref_k, ref_v

    return make


# layouts for diagnosis, besides the benchmark's: pools whose pages lie elsewhere than the benchmark's shuffle
# (``_pool``'s orders: in table order, as PagedKVCache deals pages to sequences growing together, shuffled
# only within each 2 MiB of the pool), a kernel ahead of the call, the append step, one shared table
LAYOUTS = {
    **DECODE_BACKENDS,
    "tileattn after a kernel": _after_kernel(_tileattn()),
    "tileattn paged16 after a kernel": _after_kernel(_tileattn(page=16)),
    "tileattn append": _append(),
    "tileattn paged16 append": _append(page=16),
    "tileattn paged16 in order": _tileattn(page=16, order="in order"),
    "tileattn paged16 lockstep": _tileattn(page=16, order="lockstep"),
    "tileattn paged16 shuffled in 2 MiB": _tileattn(page=16, order=64),
    "tileattn paged256 in order": _tileattn(page=256, order="in order"),
    "tileattn paged256 lockstep": _tileattn(page=256, order="lockstep"),
    # one block table for every input copy (hot in L2 from the second call on), as a model's layers share one
    "tileattn paged16 shared table": _tileattn(page=16, shared_table=True),
    "tileattn paged256 shared table": _tileattn(page=256, shared_table=True),
}


def replay_ms(graph, calls: int, replays: int) -> float:
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def gbps_rounds(graphs: dict, calls: int, kv_bytes: int, rounds: int, replays: int = 5) -> dict:
    """GB/s of K+V per round for each of ``graphs`` (name -> graph of ``calls`` calls), the graphs taking
    turns within each round so that a slow spell of the machine falls on all of them."""
    gbps = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            gbps[name].append(kv_bytes / replay_ms(graph, calls, replays) / 1e6)
    return gbps


def median_range(vals) -> str:
    """``median (min-max)`` of a row's rounds, as the tables print them."""
    return f"{statistics.median(vals):.0f} ({min(vals):.0f}-{max(vals):.0f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--layouts", nargs="+", default=["tileattn", "tileattn paged16", "tileattn paged256"])
    ap.add_argument("--rows", nargs="+", help="batch x cache length rows to run, as 64x4096 (default: the benchmark's)")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--anchors",
        nargs="+",
        default=["sdpa-cudnn"],
        help="backends of bench --decode timed in each row alongside (sdpa-cudnn is named cuDNN; fa4 needs "
        "flash_attn.cute, as scripts/gpu_fa4.sh installs it)",
    )
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args()
    results = []
    rows = [tuple(int(n) for n in row.split("x")) for row in args.rows] if args.rows else DECODE_CASES
    for batch, cache_len in rows:
        inputs, seqlens, kv_bytes = decode_inputs(batch, cache_len)
        for layout in args.layouts:
            graphs = {}
            make = LAYOUTS[layout]
            calls = [make(q, kc, vc, seqlens)[0] for q, kc, vc in inputs]
            first = None
            for variant in args.variants:
                with apply(variant):
                    graph, outs = capture_graph(calls)
                out = outs[0]
                if first is None:
                    first = out.float()
                else:
                    torch.testing.assert_close(out.float(), first, atol=2e-2, rtol=0)
                graphs[variant or "table"] = graph
            ref_calls = []  # (a graph replays its calls' tables: they live as long as the graphs)
            for anchor in args.anchors:
                ref_calls.append([DECODE_BACKENDS[anchor](q, kc, vc, seqlens)[0] for q, kc, vc in inputs])
                graphs["cuDNN" if anchor == "sdpa-cudnn" else anchor], _ = capture_graph(ref_calls[-1])
            rounds = gbps_rounds(graphs, len(calls), kv_bytes, args.rounds, args.replays)
            for name, vals in rounds.items():
                row = dict(batch=batch, cache_len=cache_len, layout=layout, variant=name, gbps=vals)
                results.append(row)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
            print(
                f"{batch}x{cache_len} {layout}: "
                + ", ".join(f"{n} {statistics.median(v):.0f}" for n, v in rounds.items()),
                flush=True,
            )
            del graphs, calls, ref_calls
        del inputs
        torch.cuda.empty_cache()
    cases = list(dict.fromkeys((r["batch"], r["cache_len"]) for r in results))
    keys = list(dict.fromkeys((r["layout"], r["variant"]) for r in results))
    cell = {(r["layout"], r["variant"], r["batch"], r["cache_len"]): r["gbps"] for r in results}
    table = []
    for layout, variant in keys:
        row = [f"{layout} [{variant}]"]
        for case in cases:
            v = cell.get((layout, variant, *case))
            row.append(median_range(v) if v else "-")
        table.append(row)
    print(tabulate(table, headers=["layout [variant]"] + [f"{b}x{n // 1024}k" for b, n in cases], tablefmt="github"))


if __name__ == "__main__":
    main()
