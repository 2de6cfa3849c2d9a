"""Feature benchmark (``--features``): does each feature keep the dense kernel's speed on the work it does?

For one head dim at a time (batch × seqlen = 16k tokens, hidden 2048 by default), tileattn runs dense,
causal, GQA (4 query heads per kv head), sliding windows, a packed varlen batch of the same sequences,
and the non-power-of-two head dims that pad to it (96 → 128, 192 → 256, with the same heads). TFLOP/s
count only the score pairs a row sees (4·D FLOPs per pair forward, 2.5× that backward) and the real head
dim, so a row's ratio to the dense row is the speed it keeps; the issue's bar is ≥ 0.9, and ≥ D / padded
D for the padded head dims. Each row's output passes the tolerance rule on one (batch, head) slice first.
"""

from __future__ import annotations

import functools

import torch

import tileattn
from tileattn.reference import attention_ref
from tileattn.testing import check_close

_print_now = functools.partial(print, flush=True)

# padded head dim -> the non-power-of-two head dims that pad to it
PADDED_DIMS = {128: [96], 256: [192]}


def visible_pairs(seqlen: int, causal: bool, window: tuple[int, int]) -> int:
    """Score pairs one (batch, head) of a square seqlen × seqlen problem computes (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(seqlen, dtype=torch.int64)
    hi = torch.clamp(i + right, max=seqlen - 1) if right >= 0 else torch.full_like(i, seqlen - 1)
    lo = torch.clamp(i - left, min=0) if left >= 0 else torch.zeros_like(i)
    return int((hi - lo + 1).clamp(min=0).sum())


def _cases(headdim: int, seqlen: int, window: int):
    """(name, headdim, kv-head divisor, causal, window, varlen)"""
    cases = [
        ("dense", headdim, 1, False, (-1, -1), False),
        ("causal", headdim, 1, True, (-1, -1), False),
        ("GQA 4:1", headdim, 4, False, (-1, -1), False),
        ("GQA 4:1 causal", headdim, 4, True, (-1, -1), False),
        (f"window ({window}, {window})", headdim, 1, False, (window, window), False),
        (f"window ({window}, 0)", headdim, 1, False, (window, 0), False),
        ("varlen (same lengths)", headdim, 1, False, (-1, -1), True),
        ("varlen causal", headdim, 1, True, (-1, -1), True),
    ]
    for d in PADDED_DIMS.get(headdim, []):
        cases.append((f"head dim {d}", d, 1, False, (-1, -1), False))
        cases.append((f"head dim {d} causal", d, 1, True, (-1, -1), False))
    return cases


def run_features(
    time_ms,
    headdim=128,
    seqlen=4096,
    tokens=16384,
    hidden=2048,
    window=512,
    dtype=torch.bfloat16,
    progress=_print_now,
    device="cuda",
):
    """Times every feature case; returns result rows (``kind='features'``) with the ratio to a baseline:
    dense, or for causal rows other than ``causal`` itself the causal row (so the causal mask's own cost
    shows once, in the causal row). ``progress`` gets a line as each case starts and ends, so a run that
    dies (a CUDA fault ends the process) names the case it was in."""
    batch, nheads = max(1, tokens // seqlen), max(1, hidden // headdim)
    rows = []
    for name, d, kv_div, causal, win, varlen in _cases(headdim, seqlen, window):
        progress(f"features hd{d} {name}: checking")
        gen = torch.Generator(device=device).manual_seed(0)
        nheads_k = nheads // kv_div
        q = torch.randn(batch, seqlen, nheads, d, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(batch, seqlen, nheads_k, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        kwargs = dict(causal=causal, window_size=win)
        if varlen:
            cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
            flat = [t.reshape(batch * seqlen, *t.shape[2:]) for t in (q, k, v)]
            qf, kf, vf = (t.detach().requires_grad_() for t in flat)

            def call(qf=qf, kf=kf, vf=vf, cu=cu, kwargs=kwargs):
                return tileattn.flash_attn_varlen_func(qf, kf, vf, cu, cu, seqlen, seqlen, **kwargs)

            inputs = (qf, kf, vf)
            out = call().view(batch, seqlen, nheads, d)
        else:
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

            def call(qg=qg, kg=kg, vg=vg, kwargs=kwargs):
                return tileattn.flash_attn_func(qg, kg, vg, **kwargs)

            inputs = (qg, kg, vg)
            out = call()
        sl = (slice(0, 1), slice(None), slice(0, 1))
        ref = attention_ref(q[sl], k[sl], v[sl], upcast=torch.float64, **kwargs)[0]
        lowp = attention_ref(q[sl], k[sl], v[sl], upcast=False, **kwargs)[0]
        row = dict(kind="features", backend="tileattn", device=device, case=name, headdim=d, causal=causal)
        try:
            check_close(f"features {name}", out[sl], ref, lowp)
        except AssertionError as exc:  # shown as a failed row; the other cases still run
            rows.append(dict(row, error=str(exc)))
            progress(str(exc))
            continue
        dout = torch.randn_like(out)
        t_fwd = time_ms(call, device)
        t_bwd = time_ms(
            lambda out=out, inputs=inputs, dout=dout: torch.autograd.grad(out, inputs, dout, retain_graph=True), device
        )
        work = 4 * batch * nheads * visible_pairs(seqlen, causal, win) * d
        row.update(
            nheads=nheads,
            nheads_k=nheads_k,
            batch=batch,
            seqlen=seqlen,
            fwd_ms=t_fwd,
            bwd_ms=t_bwd,
            fwd_tflops=work / t_fwd / 1e9,
            bwd_tflops=2.5 * work / t_bwd / 1e9,
        )
        progress(f"features hd{d} {name}: {row['fwd_tflops']:.0f} fwd, {row['bwd_tflops']:.0f} bwd TFLOP/s")
        rows.append(row)
    by_case = {r["case"]: r for r in rows if "error" not in r}
    for r in rows:  # the causal row against dense; the other causal rows against causal
        r["baseline"] = "causal" if r.get("causal") and r["case"] != "causal" else "dense"
        b = by_case.get(r["baseline"])
        if "error" in r or b is None:
            continue
        r["fwd_ratio"] = r["fwd_tflops"] / b["fwd_tflops"]
        r["bwd_ratio"] = r["bwd_tflops"] / b["bwd_tflops"]
    return rows


def format_features(rows) -> str:
    from tabulate import tabulate

    def cell(r, key, fmt):
        if "error" in r:
            return "check failed" if key == "fwd_tflops" else ""
        return format(r[key], fmt) if key in r else "—"

    table = [
        [
            f"hd{r['headdim']}",
            r["case"],
            r["baseline"],
            cell(r, "fwd_tflops", ".0f"),
            cell(r, "fwd_ratio", ".2f"),
            cell(r, "bwd_tflops", ".0f"),
            cell(r, "bwd_ratio", ".2f"),
        ]
        for r in rows
    ]
    headers = ["head dim", "case", "baseline", "fwd TFLOP/s", "÷ baseline", "bwd TFLOP/s", "÷ baseline"]
    return tabulate(table, headers=headers, tablefmt="github")
