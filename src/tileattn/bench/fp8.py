"""FP8 benchmark (``--fp8``): the forward on e4m3 q, k, v against tileattn's own bf16 forward on the same
inputs, and the FP8 matmul ceiling of this GPU (``torch._scaled_mm``) timed in the same run; then the
accuracy of FP8 attention on realistic inputs (``accuracy_rows``).

The grid is the dense grid's (16k tokens, hidden 2048, head dims 64/128/256, causal and not). Inputs are
quantized once outside the timing with ``tileattn.fp8.quantize`` (per sequence and kv head), as a serving
stack holds them. Each row's FP8 output passes the FP8 tolerance first: against the fp64 attention of the
dequantized inputs on the last 256 query rows of one head, at most twice the error of plain FP8
attention (fp32 with e4m3 probabilities) plus bf16's rounding floor.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

import tileattn
from tileattn import fp8
from tileattn.testing import check_close

_print_now = functools.partial(print, flush=True)
E4M3 = torch.float8_e4m3fn


def matmul_ceiling(time_ms, n: int = 8192) -> float:
    """TFLOP/s of an ``n``³ e4m3 matmul with fp32 tensor-wise scales and bf16 output (``torch._scaled_mm``)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", generator=gen).to(E4M3)
    b = torch.randn(n, n, device="cuda", generator=gen).to(E4M3).T  # column-major, as cuBLASLt's FP8 wants
    one = torch.ones((), device="cuda")
    ms = time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), "cuda")
    return 2.0 * n**3 / ms / 1e9


def _reference_rows(q, k, v, rows, causal, precision, probs_dtype=None):
    """Attention of batch 0, head 0 for query ``rows`` (bottom-right causal), in ``precision``; with
    ``probs_dtype`` the probabilities are rounded to it at their row max (plain FP8 attention)."""
    qs, ks, vs = (t[0, :, 0].to(precision) for t in (q[:, rows], k, v))
    s = (qs @ ks.T) * q.shape[-1] ** -0.5
    if causal:
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None] + k.shape[1] - q.shape[1]
        s = s.masked_fill(torch.arange(k.shape[1], device=q.device)[None, :] > i, float("-inf"))
    p = torch.softmax(s, -1)
    if probs_dtype is not None:
        row_max = p.amax(-1, keepdim=True)
        p = (p / row_max).to(probs_dtype).to(precision) * row_max
    return p @ vs


def check_fp8(out, q8, k8, v8, descales, causal) -> float:
    """The FP8 tolerance on the last 256 query rows of batch 0, head 0 (raises if it fails); returns the
    error ratio to plain FP8 attention."""
    qd, kd, vd = descales
    deq = [fp8.dequantize(t[:1], d[:1], dtype=torch.float32) for t, d in ((q8, qd), (k8, kd), (v8, vd))]
    rows = slice(max(0, q8.shape[1] - 256), q8.shape[1])
    ref = _reference_rows(*deq, rows, causal, torch.float64)
    plain = _reference_rows(*deq, rows, causal, torch.float32, E4M3)
    return check_close("fp8 forward", out[0, rows, 0], ref, plain)


def run_fp8(
    time_ms,
    seqlens=(1024, 2048, 4096, 8192, 16384),
    headdims=(64, 128, 256),
    tokens: int = 16384,
    hidden: int = 2048,
    variants: dict | None = None,
    progress=_print_now,
):
    """Times the bf16 and FP8 forwards over the grid (``variants``: name -> a function returning a context
    in which the FP8 call runs another build, e.g. ``configs.override`` of a tuner's candidate); returns
    result rows (``kind='fp8'``), the first one the matmul ceiling."""
    rows = [dict(kind="fp8", case="ceiling", tflops=matmul_ceiling(time_ms))]
    progress(f"fp8: torch._scaled_mm ceiling {rows[0]['tflops']:.0f} TFLOP/s")
    for headdim in headdims:
        nheads = hidden // headdim
        for seqlen in seqlens:
            batch = max(1, tokens // seqlen)
            gen = torch.Generator(device="cuda").manual_seed(seqlen + headdim)
            q, k, v = (
                torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(3)
            )
            (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t) for t in (q, k, v))
            for causal in (False, True):
                flop = 4.0 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
                row = dict(kind="fp8", case="grid", headdim=headdim, seqlen=seqlen, batch=batch, causal=causal)
                attn = functools.partial(tileattn.flash_attn_func, causal=causal)
                bf16_ms = time_ms(functools.partial(attn, q, k, v), "cuda")
                row.update(bf16_ms=bf16_ms, bf16_tflops=flop / bf16_ms / 1e9)
                call = functools.partial(attn, q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
                builds = {"fp8": contextlib.nullcontext, **(variants or {})}
                for name, context in builds.items():
                    try:
                        with context():
                            ratio = check_fp8(call(), q8, k8, v8, (qd, kd, vd), causal)
                            ms = time_ms(call, "cuda")
                    except Exception as exc:  # noqa: BLE001 -- a build that cannot run says why
                        row[f"{name}_error"] = str(exc).strip().splitlines()[0][:120] or type(exc).__name__
                        progress(f"fp8 d{headdim} {seqlen} causal={causal} {name}: {row[f'{name}_error']}")
                        continue
                    row.update({f"{name}_ms": ms, f"{name}_tflops": flop / ms / 1e9, f"{name}_err_ratio": ratio})
                rows.append(row)
                progress(
                    f"fp8 d{headdim} {seqlen} causal={causal}: bf16 {bf16_ms:.3f} ms, "
                    + ", ".join(f"{n} {row[f'{n}_ms']:.3f} ms" for n in builds if f"{n}_ms" in row)
                )
    return rows


def format_fp8(rows) -> str:
    from tabulate import tabulate

    ceiling = next(r["tflops"] for r in rows if r["case"] == "ceiling")
    grid = [r for r in rows if r["case"] == "grid"]
    names = sorted({key[: -len("_tflops")] for r in grid for key in r if key.endswith("_tflops")} - {"bf16"})
    names = ["fp8"] + [n for n in names if n != "fp8"]
    table = []
    for r in grid:
        line = [r["headdim"], r["seqlen"], "yes" if r["causal"] else "no", f"{r['bf16_tflops']:.0f}"]
        for n in names:
            tf = r.get(f"{n}_tflops")
            line.append(f"{tf:.0f} ({tf / r['bf16_tflops']:.2f}x, {tf / ceiling:.0%})" if tf else "-")
        table.append(line)
    headers = ["headdim", "seqlen", "causal", "bf16 TFLOP/s", *(f"{n} TFLOP/s (vs bf16, of ceiling)" for n in names)]
    return f"FP8 forward; torch._scaled_mm ceiling {ceiling:.0f} TFLOP/s\n" + tabulate(
        table, headers=headers, tablefmt="github"
    )


def _realistic(batch, seqlen, nheads, headdim, outliers: int, gen, device):
    """q, k, v bf16 with ``outliers`` channels of q and k 20× larger (shared by every token, as the
    outlier features of trained models are), and values of unit scale."""
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device=device, generator=gen) for _ in range(3))
    if outliers:
        channels = torch.randperm(headdim, generator=gen, device=device)[:outliers]
        q[..., channels] *= 20.0
        k[..., channels] *= 20.0
    scale = 1.0 / math.sqrt(1.0 + outliers * 400.0 / headdim)  # scores of a comparable spread
    return (q * scale).bfloat16(), (k * scale).bfloat16(), v.bfloat16()


def _rotation(headdim: int, gen, device) -> torch.Tensor:
    """A random orthogonal ``(headdim, headdim)`` matrix (QR of a Gaussian, signs fixed)."""
    a = torch.randn(headdim, headdim, generator=gen, device=device, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    return (qm * torch.sign(torch.diagonal(r))).float()


def accuracy_rows(device="cuda", seqlen=4096, nheads=16, headdim=128, causal=True):
    """FP8 attention's error against bf16 attention on the original inputs, for Gaussian inputs and inputs
    with 2 or 8 outlier channels in q and k, plain and with q and k rotated by one random orthogonal
    matrix first (which leaves q·kᵀ unchanged and spreads the outliers over every channel). Errors are
    relative to the bf16 output's RMS: RMS and max."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for outliers in (0, 2, 8):
        q, k, v = _realistic(1, seqlen, nheads, headdim, outliers, gen, device)
        base = tileattn.flash_attn_func(q, k, v, causal=causal).float()
        rms = base.pow(2).mean().sqrt()
        rotation = _rotation(headdim, gen, device)
        for rotated in (False, True):
            qr, kr = (q, k) if not rotated else ((q.float() @ rotation).bfloat16(), (k.float() @ rotation).bfloat16())
            (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t) for t in (qr, kr, v))
            out = tileattn.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
            err = (out.float() - base).abs()
            rows.append(
                dict(
                    kind="fp8",
                    case="accuracy",
                    outliers=outliers,
                    rotated=rotated,
                    rel_rms=float(err.pow(2).mean().sqrt() / rms),
                    rel_max=float(err.max() / rms),
                )
            )
    return rows


def format_accuracy(rows) -> str:
    from tabulate import tabulate

    table = [
        [r["outliers"], "yes" if r["rotated"] else "no", f"{r['rel_rms']:.2e}", f"{r['rel_max']:.2e}"]
        for r in rows
        if r["case"] == "accuracy"
    ]
    headers = ["outlier channels", "rotated", "RMS error / RMS", "max error / RMS"]
    return "FP8 against bf16 attention on the original inputs\n" + tabulate(table, headers=headers, tablefmt="github")


def _paged(caches: tuple, page_size: int, gen) -> tuple[list, torch.Tensor]:
    """Contiguous ``(batch, seqlen, nheads_k, d)`` caches as pools of pages, all in one shuffled order, and
    their block table."""
    batch, seqlen = caches[0].shape[:2]
    pages = seqlen // page_size
    order = torch.randperm(batch * pages, generator=gen, device=caches[0].device)
    pools = []
    for cache in caches:
        pool = torch.empty((batch * pages, page_size, *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
        pool[order] = cache.reshape(batch * pages, page_size, *cache.shape[2:])
        pools.append(pool)
    return pools, order.view(batch, pages).int()


def decode_inputs(batch: int, seqlen: int, nheads: int, nheads_k: int, headdim: int) -> tuple:
    """A decoding step's inputs (seeded by the shape): ``(gen, q, kc, vc, kc8, kd, vc8, vd, seqlens)``, q one
    bf16 token, the bf16 caches full, the same caches in FP8 with ``fp8.quantize``'s descales."""
    gen = torch.Generator(device="cuda").manual_seed(batch + seqlen)
    q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc, vc = (
        torch.randn(batch, seqlen, nheads_k, headdim, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    (kc8, kd), (vc8, vd) = fp8.quantize(kc), fp8.quantize(vc)
    return gen, q, kc, vc, kc8, kd, vc8, vd, torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")


def decode_step(q0, k0, v0, precision, e4m3_probs=False) -> torch.Tensor:
    """Batch entry 0's decoding step, ``q0 (nheads, d)`` over the dequantized ``k0, v0 (seqlen, nheads_k,
    d)``, in ``precision``; with ``e4m3_probs`` the probabilities ``· V`` in e4m3 at their row max 1 over
    the unrounded sum (plain FP8 attention's)."""
    k0, v0 = (t.repeat_interleave(q0.shape[0] // k0.shape[1], 1).to(precision) for t in (k0, v0))
    scores = torch.einsum("hd,khd->hk", q0.to(precision), k0) * q0.shape[-1] ** -0.5
    if not e4m3_probs:
        return torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v0)
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    return torch.einsum("hk,khd->hd", p.to(torch.float8_e4m3fn).to(precision) / p.sum(-1, keepdim=True), v0)


def decode_rows(time_ms, cases=((8, 32768), (64, 16384)), nheads=32, nheads_k=8, headdim=128, page_size=64):
    """One decoding step (one query token, no append) against a bf16 cache and the same cache in FP8
    (``fp8.quantize``'s descales), contiguous and paged; tokens/s and GB/s of cache read. The FP8 output
    passes the tolerance rule against the fp64 attention of batch 0 over the dequantized cache first."""
    rows = []
    for batch, seqlen in cases:
        gen, q, kc, vc, kc8, kd, vc8, vd, seqlens = decode_inputs(batch, seqlen, nheads, nheads_k, headdim)
        k0, v0 = (fp8.dequantize(t[:1], d[:1], dtype=torch.float64)[0] for t, d in ((kc8, kd), (vc8, vd)))
        ref, lowp = (decode_step(q[0, 0], k0, v0, precision) for precision in (torch.float64, torch.bfloat16))
        for paged in (False, True):
            if paged:
                (k16, v16, k8p, v8p), table = _paged((kc, vc, kc8, vc8), page_size, gen)
                layout = dict(block_table=table)
            else:
                k16, v16, k8p, v8p, layout = kc, vc, kc8, vc8, {}
            bf16 = functools.partial(tileattn.flash_attn_with_kvcache, q, k16, v16, cache_seqlens=seqlens, **layout)
            fp8_call = functools.partial(
                tileattn.flash_attn_with_kvcache,
                q, k8p, v8p, cache_seqlens=seqlens, k_descale=kd, v_descale=vd, **layout,
            )  # fmt: skip
            check_close("fp8 cache decode", fp8_call()[0, 0].double(), ref, lowp)
            row = dict(kind="fp8", case="decode", batch=batch, seqlen=seqlen, paged=paged)
            for name, call, size in (("bf16", bf16, 2), ("fp8", fp8_call, 1)):
                ms = time_ms(call, "cuda")
                read = 2 * batch * seqlen * nheads_k * headdim * size
                row.update({f"{name}_ms": ms, f"{name}_tok_s": batch / ms * 1e3, f"{name}_gbs": read / ms / 1e6})
            rows.append(row)
    return rows


def format_decode(rows) -> str:
    from tabulate import tabulate

    table = [
        [
            f"{r['batch']} x {r['seqlen']}",
            "paged" if r["paged"] else "contiguous",
            f"{r['bf16_tok_s']:.0f}",
            f"{r['fp8_tok_s']:.0f}",
            f"{r['fp8_tok_s'] / r['bf16_tok_s']:.2f}x",
            f"{r['bf16_gbs']:.0f}",
            f"{r['fp8_gbs']:.0f}",
        ]
        for r in rows
        if r["case"] == "decode"
    ]
    headers = ["batch x cache", "layout", "bf16 tokens/s", "fp8 tokens/s", "fp8 vs bf16", "bf16 GB/s", "fp8 GB/s"]
    return "Decoding, GQA 32/8, head dim 128\n" + tabulate(table, headers=headers, tablefmt="github")
