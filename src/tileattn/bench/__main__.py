"""``python -m tileattn.bench``: times tileattn against the other attention backends.

The default is the FlashAttention papers' setting: batch * seqlen = 16k tokens, hidden 2048
(nheads = 2048 / headdim), bf16, forward and backward, causal and not. FLOPs: forward
4·B·H·Sq·Sk·D (halved when causal); backward 2.5 × forward, timed alone over a retained graph.
Before anything is timed, each backend's output is checked against the reference with the project's
tolerance rule. Results are appended to a JSON-lines file; ``--plot`` draws PNG charts from it.

On a machine without a GPU the default is a small grid of the CPU path against eager attention (head
dim 64, 512 and 2048 tokens, causal and not, forward and backward time and the forward's peak memory:
about a minute on two cores), and ``--quick`` its causal forward (about 20 seconds), so the command
always does something useful. On CPU the backends of a case are timed in turns with as many threads as
the machine has idle cores, and the table flags ratios that a busy machine makes noisy
(``tileattn.bench.cpu_grid``). A run shows its progress: a bar with the case and an estimate of the time
left on a terminal, a line per case elsewhere.

Other measurements, one flag each: ``--features`` (each feature against the dense speed), ``--varlen``
(packed against padded batches), ``--dropout`` (attention dropout against none and FlashAttention-2's),
``--sinks`` (attention sinks against the same calls without), ``--e2e`` (training steps of Hugging Face models
against SDPA),
``--fp8`` (the FP8 forward against bf16 and the FP8 matmul ceiling, and FP8 accuracy), ``--mla`` (MLA
decoding beside GQA decoding), ``--cp`` (context parallelism across the host's GPUs: scaling against one
GPU, exactness, the longest sequence), ``--decode`` (KV-cache decoding, GB/s), ``--decode-ab`` (the decode rows as an interleaved A/B against
cuDNN in each layout's rounds), ``--host`` (host time per call at launch-bound sizes) and ``--hf-decode``
(Hugging Face greedy decoding with the static cache and a compiled decode step, tokens/s against SDPA),
``--masks`` (FlashMask builders against FlexAttention and SDPA) and ``--new-masks`` (a new mask tensor every call
against the same one). The options live in ``tileattn.bench.cli``.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import tileattn
from tileattn.bench.backends import BACKENDS, Unavailable, check_backend, slice_refs
from tileattn.bench.cli import GPU_DEFAULT_BACKENDS, grid_defaults, parse_args  # noqa: F401  (the CLI's entry points)
from tileattn.bench.cpu_grid import noise_note, others_load, peak_mib, pick_threads, summarize, time_in_turns
from tileattn.bench.progress import Progress

CPU_BUDGET_S = 4.0  # seconds of rounds per case and mode on CPU (at least three rounds)


def banner(device: str) -> str:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        commit = "unknown"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if device == "cuda":
        where = f"GPU {torch.cuda.get_device_name()} | CUDA {torch.version.cuda}"
    else:
        where = f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"
    return f"tileattn {tileattn.__version__} ({commit}) | {where} | torch {torch.__version__} | triton {triton_version}"


def flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, mode):
    f = 4 * batch * nheads * seqlen_q * seqlen_k * headdim / (2 if causal else 1)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def time_ms(fn, device: str) -> float:
    """Median milliseconds of ``fn``: triton.testing.do_bench on CUDA, wall-clock repeats on CPU."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    deadline = time.perf_counter() + 2.0
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 20):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _case_row(case, name: str, device: str, **extra) -> dict:
    """The fields every result row of ``case`` (batch, seqlen, nheads, headdim, causal, dtype) starts with."""
    batch, seqlen, nheads, headdim, causal, dtype = case
    return dict(
        backend=name,
        batch=batch,
        seqlen=seqlen,
        nheads=nheads,
        headdim=headdim,
        causal=causal,
        dtype=str(dtype).replace("torch.", ""),
        device=device,
        **extra,
    )


def _checked_forward(name, q, k, v, causal, refs, progress):
    """``(fn, error)``: backend ``name``'s forward on q, k, v once its output has passed the check against
    ``refs`` (``slice_refs``); ``fn`` is None when the backend cannot run here (skipped, ``error`` None) or
    failed (``error``: what it raised). One backend failing, or rejecting a shape, must not end the run."""
    try:
        fn = BACKENDS[name](q, k, v, causal)
        check_backend(name, fn(), q, k, v, causal, refs)
    except Unavailable as exc:
        progress(f"skip {name}: {exc}")
        return None, None
    except Exception as exc:  # noqa: BLE001
        progress(f"{name} failed: {_first_line(exc)[:160]}")
        return None, _first_line(exc)[:300]
    return fn, None


def _backward_alone(name, q, k, v, causal, progress):
    """A callable running backend ``name``'s backward alone, over one retained graph of a forward on leaf
    copies of q, k, v (the difference of a forward + backward and a forward timing varied by up to 15 %
    at the shortest cells), or None if the backward fails."""
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    try:
        out = BACKENDS[name](*inputs, causal)()
        dout = torch.randn_like(out)

        def bwd():
            torch.autograd.grad(out, inputs, dout, retain_graph=True)

        bwd()
    except Exception as exc:  # noqa: BLE001
        progress(f"{name} backward failed: {_first_line(exc)[:160]}")
        return None
    return bwd


def run_case(case, backends, device, modes, progress):
    """Rows of one case on CUDA: each backend checked, then timed alone (``time_ms``), with its peak memory."""
    batch, seqlen, nheads, headdim, causal, dtype = case
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen) for _ in range(3))
    refs = slice_refs(q, k, v, causal)  # computed once for every backend
    rows = []
    for name in backends:
        row = _case_row(case, name, device)
        fn, error = _checked_forward(name, q, k, v, causal, refs, progress)
        if fn is None:
            if error is not None:
                rows.append(dict(row, error=error))
            continue
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_fwd = time_ms(fn, device)
        row["fwd_ms"] = t_fwd
        row["fwd_tflops"] = flops(batch, nheads, seqlen, seqlen, headdim, causal, "fwd") / t_fwd / 1e9
        row["kind"] = "attention"
        if "bwd" in modes:  # the forward is always measured too (fwd+bwd adds the two)
            bwd = _backward_alone(name, q, k, v, causal, progress)
            if bwd is not None:
                row["bwd_ms"] = time_ms(bwd, device)
                row["bwd_tflops"] = flops(batch, nheads, seqlen, seqlen, headdim, causal, "bwd") / row["bwd_ms"] / 1e9
                del bwd  # the retained graph, before the next backend's peak memory is measured
        if device == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
        rows.append(row)
        progress(f"{name} hd{headdim} {'causal' if causal else 'full'} {seqlen}: {row['fwd_tflops']:.3g} TFLOP/s fwd")
    return rows


def run_case_cpu(case, backends, modes, threads, peak, progress, budget_s=CPU_BUDGET_S):
    """Rows of one case on CPU: each backend checked, then all of them timed in turns (``cpu_grid``) with
    ``threads`` threads: per mode the median ms, the rounds' median ratio to tileattn with its range
    (``{mode}_ratio``, ``_ratio_lo``, ``_ratio_hi``) and the share of the threads' time the run got
    (``{mode}_share``). ``peak``: ``peak_mib``'s result, the forward's peak memory."""
    batch, seqlen, nheads, headdim, causal, dtype = case
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, generator=gen) for _ in range(3))
    rows, timed = {}, {"fwd": {}, "bwd": {}}
    refs = slice_refs(q, k, v, causal)  # computed once for every backend
    for name in backends:
        row = _case_row(case, name, "cpu", kind="attention", threads=threads)
        fn, error = _checked_forward(name, q, k, v, causal, refs, progress)
        if fn is None:
            if error is not None:
                rows[name] = dict(row, error=error)
            continue
        rows[name], timed["fwd"][name] = row, fn
        row["peak_mem_mib"] = peak.get((batch, seqlen, nheads, headdim, causal, name), float("nan"))
        if "bwd" in modes:  # the forward is always measured too
            bwd = _backward_alone(name, q, k, v, causal, progress)
            if bwd is not None:
                timed["bwd"][name] = bwd
    for mode, fns in timed.items():
        if not fns:
            continue
        base = "tileattn" if "tileattn" in fns else next(iter(fns))
        times = time_in_turns(fns, budget_s)
        for name, s in summarize(times, base, threads, others_load(threads)).items():
            rows[name].update(
                {
                    f"{mode}_ms": s["ms"],
                    f"{mode}_tflops": flops(batch, nheads, seqlen, seqlen, headdim, causal, mode) / s["ms"] / 1e9,
                    f"{mode}_ratio": s["ratio"],
                    f"{mode}_ratio_lo": s["ratio_lo"],
                    f"{mode}_ratio_hi": s["ratio_hi"],
                    f"{mode}_share": s["share"],
                    f"{mode}_rounds": s["rounds"],
                    f"{mode}_noisy": s["noisy"],
                    f"{mode}_starved": s["starved"],
                }
            )
    for name, row in rows.items():
        if "fwd_ms" in row:
            progress(
                f"{name} hd{headdim} {'causal' if causal else 'full'} {batch}x{seqlen}: {row['fwd_ms']:.1f} ms fwd"
            )
    return list(rows.values())


_CSV_FIELDS = [
    "kind",
    "backend",
    "device",
    "dtype",
    "batch",
    "seqlen",
    "nheads",
    "headdim",
    "causal",
    "fwd_ms",
    "fwd_tflops",
    "bwd_ms",
    "bwd_tflops",
    "peak_mem_gb",
    "peak_mem_mib",
    "tokens",
    "max_seqlen",
    "fwd_bwd_ms",
    "useful_fwd_tflops",
    "cache_len",
    "nheads_k",
    "ms",
    "gbps",
    "threads",
    "error",
    "case",
    "baseline",
    "fwd_ratio",
    "bwd_ratio",
]


def append_results(path: Path, rows: list[dict]) -> None:
    """Appends rows to ``path`` (JSON lines) and to the CSV beside it (same name, ``.csv``)."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    csv_path = path.with_suffix(".csv")
    new = not csv_path.exists()
    with csv_path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_CSV_FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def _by_case(rows) -> dict[tuple, list[dict]]:
    """The rows of each case ``(headdim, causal, seqlen, batch)``, in the order they came."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r["headdim"], r["causal"], r["seqlen"], r["batch"]), []).append(r)
    return by_case


def format_table(rows, modes, device) -> str:
    """One line per (case, backend): ms, TFLOP/s and the ratio of tileattn to it (on CPU the median of the
    rounds' ratios, their range, and ``noisy`` where ``cpu_grid.summarize`` found them so)."""
    from tabulate import tabulate

    out = []
    for (headdim, causal, seqlen, batch), group in _by_case(rows).items():
        ours = next((r for r in group if r["backend"] == "tileattn"), None)
        for r in group:
            line = [f"hd{headdim}{' causal' if causal else ''}", f"{batch}x{seqlen}", r["backend"]]
            if "error" in r:
                out.append(line + ["error: " + r["error"][:40]])
                continue
            for mode in modes:
                ms, tf = r.get(f"{mode}_ms"), r.get(f"{mode}_tflops")
                ratio = ""
                if f"{mode}_ratio" in r and r is not ours:  # CPU: the rounds' median and range
                    lo, hi = r[f"{mode}_ratio_lo"], r[f"{mode}_ratio_hi"]
                    ratio = f"{r[f'{mode}_ratio']:.2f}x ({lo:.2f}-{hi:.2f}){' noisy' if r[f'{mode}_noisy'] else ''}"
                elif ours and ms and ours.get(f"{mode}_ms"):
                    ratio = f"{ms / ours[f'{mode}_ms']:.2f}x"
                line += [f"{ms:.3f}" if ms else "-", f"{tf:.3g}" if tf else "-", ratio]
            mem = r.get("peak_mem_gb")
            line.append(f"{mem:.2f} GB" if mem is not None else f"{r.get('peak_mem_mib', float('nan')):.0f} MiB")
            out.append(line)
    headers = ["case", "BxS", "backend"]
    for mode in modes:
        headers += [f"{mode} ms", f"{mode} TFLOP/s", f"tileattn speed-up ({mode})"]
    headers.append("peak mem")
    return tabulate(out, headers=headers, tablefmt="github")


def format_grid(rows, modes, anchors=("fa4", "sdpa-cudnn")) -> str | None:
    """The grid in the terms of the Hopper bar (docs/perf.md, "Dense grid"): per head dim, mask and pass, tileattn's
    TFLOP/s ÷ the best of ``anchors`` timed in the same case, one column per seqlen, then the cells' minimum, median
    and those under 0.95. None where no case has tileattn and an anchor."""
    from tabulate import tabulate

    cells: dict = {}  # (headdim, causal, mode) -> {seqlen: ratio}
    seqlens = set()
    for key, group in _by_case(rows).items():
        for mode in modes:
            ours = [r[f"{mode}_tflops"] for r in group if r["backend"] == "tileattn" and r.get(f"{mode}_tflops")]
            best = [r[f"{mode}_tflops"] for r in group if r["backend"] in anchors and r.get(f"{mode}_tflops")]
            if ours and best:
                cells.setdefault((key[0], key[1], mode), {})[key[2]] = ours[0] / max(best)
                seqlens.add(key[2])
    if not cells:
        return None
    cols = sorted(seqlens)
    lines = [
        [f"hd{hd}{' causal' if causal else ''}", mode, *(f"{by[n]:.2f}" if n in by else "-" for n in cols)]
        for (hd, causal, mode), by in sorted(cells.items())
    ]
    flat = sorted((r, hd, causal, mode, n) for (hd, causal, mode), by in cells.items() for n, r in by.items())
    under = [f"hd{hd}{' causal' if c else ''} {mode} {n}: {r:.2f}" for r, hd, c, mode, n in flat if r < 0.95]
    table = tabulate(lines, headers=["case", "pass", *map(str, cols)], tablefmt="github", disable_numparse=True)
    summary = (
        f"tileattn ÷ best of {', '.join(anchors)}: {len(flat)} cells, min {flat[0][0]:.2f}, median "
        f"{statistics.median(r for r, *_ in flat):.2f}; under 0.95: {'; '.join(under) if under else 'none'}"
    )
    return table + "\n" + summary


def plot(results: Path, out_dir: Path) -> list[Path]:
    """PNG charts of TFLOP/s against seqlen per backend, one per (headdim, causal, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    keys = sorted({(r["headdim"], r["causal"], r["device"]) for r in rows})
    for headdim, causal, device in keys:
        for mode in ("fwd", "bwd"):
            sel = [
                r
                for r in rows
                if (r["headdim"], r["causal"], r["device"]) == (headdim, causal, device) and f"{mode}_tflops" in r
            ]
            if not sel:
                continue
            fig, ax = plt.subplots(figsize=(6, 4))
            for backend in sorted({r["backend"] for r in sel}):
                pts = sorted((r["seqlen"], r[f"{mode}_tflops"]) for r in sel if r["backend"] == backend)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{mode} headdim {headdim}{' causal' if causal else ''} ({device})")
            ax.legend()
            path = out_dir / f"{mode}_hd{headdim}{'_causal' if causal else ''}_{device}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def _label(case) -> str:
    batch, seqlen, _, headdim, causal = case[:5]
    return f"hd{headdim}{' causal' if causal else ''} {batch}x{seqlen}"


def _peaks(cases, backends, dtype, threads) -> dict[tuple, float]:
    """``peak_mib`` of the cases, with a progress bar (one step a case and backend)."""
    order = [f"{_label(c)} {name}" for c in cases for name in backends]
    print("peak memory of each forward, in a child process", flush=True)
    with Progress(len(order), "peak memory") as bar:
        bar.step(order[0])
        coming = iter(order[1:])

        def measured(key):
            step = next(coming, None)
            if step is not None:
                bar.step(step)

        return peak_mib([c[:5] for c in cases], backends, dtype, threads, measured)


def _on_gpu(device: str, flag: str) -> bool:
    if device != "cuda":
        print(f"{flag} times CUDA kernels; no GPU here")
    return device == "cuda"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    backends = args.backends or (GPU_DEFAULT_BACKENDS if device == "cuda" else ["tileattn", "eager"])
    modes = {"fwd": ["fwd"], "bwd": ["bwd"], "fwd+bwd": ["fwd", "bwd"]}[args.mode]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cases = [
        (max(1, args.tokens // s), s, max(1, args.hidden // d), d, c, dtype)
        for d in args.headdim
        for c in causals
        for s in args.seqlen
    ]
    print(banner(device), flush=True)
    if args.decode:
        if not _on_gpu(device, "--decode"):
            return 1
        from tileattn.bench.decode import format_decode, run_decode

        rows = run_decode(dtype=torch.float16 if args.dtype == "fp16" else torch.bfloat16)
        append_results(args.out, rows)
        print(format_decode(rows))
        return 0
    if args.decode_ab:
        if not _on_gpu(device, "--decode-ab"):
            return 1
        from tileattn.bench.decode import format_decode_ab, run_decode_ab

        rows = [tuple(int(n) for n in row.lower().split("x")) for row in args.rows] if args.rows else None
        rows = run_decode_ab(
            rows,
            args.layouts,
            args.anchors,
            args.rounds,
            args.replays,
            dtype=torch.float16 if args.dtype == "fp16" else torch.bfloat16,
        )
        append_results(args.out, rows)
        print(format_decode_ab(rows))
        return 0
    if args.host:
        if not _on_gpu(device, "--host"):
            return 1
        from tileattn.bench.host import format_host, run_host

        rows = run_host(device, dtype=torch.float16 if args.dtype == "fp16" else torch.bfloat16)
        append_results(args.out, rows)
        print(format_host(rows))
        return 0
    if args.hf_decode:
        from tileattn.bench.hf_decode import format_hf_decode, run_hf_decode

        rows = []
        for batch in args.hf_batches:  # (each batch's rows kept as it ends: a GPU batch compiles for minutes)
            new = run_hf_decode(device, batches=(batch,), dtype=torch.float16 if args.dtype == "fp16" else None)
            append_results(args.out, new)
            rows += new
        print(format_hf_decode(rows))
        return 0
    if args.masks:
        if not _on_gpu(device, "--masks"):
            return 1
        from tileattn.bench.masks import format_masks, run_masks

        seqlens = args.seqlen if "seqlen" in args.given else [8192, 32768]
        headdim = args.headdim[0] if "headdim" in args.given else 128
        rows = run_masks(time_ms, seqlens, headdim, args.hidden, dtype=dtype)
        append_results(args.out, rows)
        print(format_masks(rows))
        return 0
    if args.new_masks:
        if not _on_gpu(device, "--new-masks"):
            return 1
        from tileattn.bench.masks import format_new_masks, run_new_masks

        seqlens = args.seqlen if "seqlen" in args.given else [8192, 32768]
        headdim = args.headdim[0] if "headdim" in args.given else 128
        rows = run_new_masks(seqlens, headdim, args.hidden, dtype=dtype)
        append_results(args.out, rows)
        print(format_new_masks(rows))
        return 0
    if args.fp8:
        if not _on_gpu(device, "--fp8"):
            return 1
        from tileattn.bench.fp8 import accuracy_rows, decode_rows, format_accuracy, format_decode, format_fp8, run_fp8

        seqlens = args.seqlen if "seqlen" in args.given else [1024, 2048, 4096, 8192, 16384]
        rows = run_fp8(time_ms, seqlens, args.headdim, hidden=args.hidden)
        rows += accuracy_rows() + decode_rows(time_ms)
        append_results(args.out, rows)
        print(format_fp8(rows))
        print(format_accuracy(rows))
        print(format_decode(rows))
        return 0
    if args.mla:
        if not _on_gpu(device, "--mla"):
            return 1
        from tileattn.bench.mla import format_mla, run_mla

        rows = run_mla(time_ms)
        append_results(args.out, rows)
        print(format_mla(rows))
        return 0
    if args.cp:
        from tileattn.bench.context import format_context, run_context

        seqlens = args.seqlen if "seqlen" in args.given else None
        rows = run_context(args.world, seqlens, device=args.device)
        append_results(args.out, rows)
        print(format_context(rows))
        return 0
    if args.dropout:
        from tileattn.bench.dropout import DROPOUT_CASES, format_dropout, run_dropout

        cases = DROPOUT_CASES
        if "headdim" in args.given or "seqlen" in args.given or args.quick:
            cases = [(d, s, c) for d in args.headdim for s in args.seqlen for c in causals]
        rows = run_dropout(time_ms, args.dropout_p, cases, args.tokens, args.hidden, dtype=dtype, device=device)
        append_results(args.out, rows)
        print(format_dropout(rows))
        return 0
    if args.e2e:
        from tileattn.bench.e2e import format_e2e, run_e2e

        rows = run_e2e(device, small=device != "cuda")
        append_results(args.out, rows)
        print(format_e2e(rows))
        return 0
    if args.sinks:
        from tileattn.bench.sinks import format_sinks, run_sinks

        cases = None
        if "headdim" in args.given or "seqlen" in args.given or args.quick:
            cases = [(d, s, c) for d in args.headdim for s in args.seqlen for c in causals]
        rows = run_sinks(time_ms, args.tokens, args.hidden, cases, dtype=dtype, device=device)
        append_results(args.out, rows)
        print(format_sinks(rows))
        return 0
    if args.features:
        if not _on_gpu(device, "--features"):
            return 1
        from tileattn.bench.features import format_features, run_features

        headdims = args.headdim if "headdim" in args.given else [128, 64]
        rows = []
        for d in headdims:  # appended head dim by head dim, so an interrupted run keeps its results
            new = run_features(time_ms, d, 4096, args.tokens, args.hidden, dtype=dtype)
            append_results(args.out, new)
            rows += new
        print(format_features(rows))
        return 0
    if args.varlen:
        from tileattn.bench.varlen import format_varlen, run_varlen

        rows = []
        headdim = args.headdim[0] if "headdim" in args.given else 128
        for causal in causals:
            r, lengths = run_varlen(
                time_ms, device, dtype, args.tokens, headdim, max(1, args.hidden // headdim), causal
            )
            rows += r
        print(f"lengths: {lengths}")
        append_results(args.out, rows)
        print(format_varlen(rows))
        return 0
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(case_rows):
        rows.extend(case_rows)
        append_results(args.out, case_rows)  # case by case, so an interrupted run keeps its results

    run = functools.partial(run_case, backends=backends, device=device, modes=modes)
    threads = torch.get_num_threads()
    print(f"{len(cases)} cases x {len(backends)} backends ({', '.join(backends)}), {args.mode}", flush=True)
    if device == "cpu":
        default_threads, (threads, why) = threads, pick_threads(args.threads)
        torch.set_num_threads(threads)
        print(f"CPU: {threads} thread(s), {why}; backends timed in turns, medians of the rounds", flush=True)
        peak = _peaks(cases, backends, dtype, threads)
        run = functools.partial(run_case_cpu, backends=backends, modes=modes, threads=threads, peak=peak)
    try:
        with Progress(len(cases), "timing") as bar:
            for case in cases:
                bar.step(_label(case))
                record(run(case, progress=bar.log))
    finally:
        if device == "cpu":
            torch.set_num_threads(default_threads)
    print(format_table(rows, modes, device))
    grid = format_grid(rows, modes) if device == "cuda" else None
    if grid:
        print(grid)
    note = noise_note(rows, modes, threads) if device == "cpu" else None
    if note:
        print(note)
    print(f"results appended to {args.out} and {args.out.with_suffix('.csv')}")
    if args.plot:
        for path in plot(args.out, args.out.parent):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
