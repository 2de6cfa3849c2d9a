"""Attention sinks (``--sinks``): what a sink costs over the same call without one, forward, forward +
backward and decode, timed as an interleaved A/B (the two calls alternate over ``rounds`` rounds, the ratio
of their medians), so that the GPU's drift between runs falls on both.

Training cases: the papers' setting (``tokens`` per batch, hidden ``hidden``), head dims 64, 128 and 256 at
4k and 16k tokens per sequence, causal and not. Decode cases: one new token against a bf16 cache, GQA
32/8 at head dim 128, contiguous and paged (pages of 16), at a batch that splits the keys (1 × 32k) and one
that fills the GPU without splitting (64 × 4k). Every sink call's output passes the tolerance rule against
``tileattn.reference.attention_ref`` with the same sinks first (on one sequence and head group).
"""

from __future__ import annotations

import statistics

import torch

import tileattn
from tileattn.reference import attention_ref
from tileattn.testing import check_close

# (headdim, seqlen, causal)
TRAINING_CASES = [(d, n, c) for d in (64, 128, 256) for n in (4096, 16384) for c in (False, True)]
# (batch, cache length, paged)
DECODE_CASES = [(1, 32768, False), (1, 32768, True), (64, 4096, False), (64, 4096, True)]


def _ab(time_ms, calls: dict, device: str, rounds: int) -> dict:
    """Median ms of each call over ``rounds`` interleaved rounds."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(time_ms(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _check(name, out, q, k, v, sink, causal):
    """The first sequence's first head group of a sink call against the reference with those sinks."""
    group = q.shape[2] // k.shape[2]
    qs, ks, vs = q.detach()[:1, :, :group], k.detach()[:1, :, :1], v.detach()[:1, :, :1]
    kwargs = dict(causal=causal, learnable_sink=sink[:group])
    ref = attention_ref(qs, ks, vs, upcast=torch.float64, **kwargs)[0]
    check_close(name, out.detach()[:1, :, :group], ref, attention_ref(qs, ks, vs, upcast=False, **kwargs)[0])


def run_sinks(
    time_ms,
    tokens=16384,
    hidden=2048,
    cases=None,
    decode_cases=None,
    dtype=torch.bfloat16,
    device="cuda",
    rounds=5,
    progress=print,
):
    """Rows of ``kind='sinks'``: ``case`` ('fwd', 'fwd+bwd' or 'decode'), the shape, ``plain_ms``,
    ``sink_ms`` and ``ratio`` (sink ÷ plain)."""
    rows = []
    for headdim, seqlen, causal in TRAINING_CASES if cases is None else cases:
        batch, nheads = max(1, tokens // seqlen), max(1, hidden // headdim)
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen).requires_grad_()
            for _ in range(3)
        )
        dout = torch.randn_like(q)
        sink = (torch.randn(nheads, device=device, generator=gen) * 2).requires_grad_()
        _check(
            "sinks fwd", tileattn.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink), q, k, v, sink, causal
        )
        fwd = {
            "plain": lambda q=q, k=k, v=v, c=causal: tileattn.flash_attn_func(q, k, v, causal=c),
            "sink": lambda q=q, k=k, v=v, c=causal, s=sink: tileattn.flash_attn_func(
                q, k, v, causal=c, learnable_sink=s
            ),
        }
        both = {
            "plain": lambda f=fwd["plain"], q=q, k=k, v=v, dout=dout: torch.autograd.grad(f(), (q, k, v), dout),
            "sink": lambda f=fwd["sink"], q=q, k=k, v=v, s=sink, dout=dout: torch.autograd.grad(
                f(), (q, k, v, s), dout
            ),
        }
        shape = dict(headdim=headdim, batch=batch, seqlen=seqlen, nheads=nheads, causal=causal)
        for case, calls in (("fwd", fwd), ("fwd+bwd", both)):
            ms = _ab(time_ms, calls, device, rounds)
            rows.append(dict(kind="sinks", case=case, plain_ms=ms["plain"], sink_ms=ms["sink"], **shape))
            rows[-1]["ratio"] = ms["sink"] / ms["plain"]
            progress(f"sinks {case} hd{headdim} {batch}x{seqlen}{' causal' if causal else ''}: {rows[-1]['ratio']:.3f}")
    for batch, cache_len, paged in DECODE_CASES if decode_cases is None else decode_cases:
        nheads, nheads_k, headdim = 32, 8, 128
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch, 1, nheads, headdim, device=device, dtype=dtype, generator=gen)
        kc, vc = (
            torch.randn(batch, cache_len, nheads_k, headdim, device=device, dtype=dtype, generator=gen)
            for _ in range(2)
        )
        seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
        sink = torch.randn(nheads, device=device, generator=gen) * 2
        extra = {}
        caches = (kc, vc)
        if paged:
            page = 16
            pages = cache_len // page
            table = torch.arange(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
            caches = tuple(c.view(batch * pages, page, nheads_k, headdim) for c in (kc, vc))
            extra["block_table"] = table
        call = dict(cache_seqlens=seqlens, **extra)
        calls = {
            "plain": lambda q=q, caches=caches, call=call: tileattn.flash_attn_with_kvcache(q, *caches, **call),
            "sink": lambda q=q, caches=caches, call=call, s=sink: tileattn.flash_attn_with_kvcache(
                q, *caches, learnable_sink=s, **call
            ),
        }
        _check("sinks decode", calls["sink"](), q, kc, vc, sink, False)
        ms = _ab(time_ms, calls, device, rounds)
        shape = dict(headdim=headdim, batch=batch, seqlen=cache_len, nheads=nheads, paged=paged)
        rows.append(dict(kind="sinks", case="decode", plain_ms=ms["plain"], sink_ms=ms["sink"], **shape))
        rows[-1]["ratio"] = ms["sink"] / ms["plain"]
        progress(f"sinks decode {batch}x{cache_len}{' paged' if paged else ''}: {rows[-1]['ratio']:.3f}")
    return rows


def format_sinks(rows) -> str:
    from tabulate import tabulate

    def case(r):
        if r["case"] == "decode":
            return f"decode {r['batch']}x{r['seqlen']}{' paged16' if r['paged'] else ''}"
        return f"{r['case']} hd{r['headdim']} {r['batch']}x{r['seqlen']}{' causal' if r['causal'] else ''}"

    table = [[case(r), f"{r['plain_ms']:.3f}", f"{r['sink_ms']:.3f}", f"{r['ratio']:.3f}"] for r in rows]
    return tabulate(table, headers=["case", "plain ms", "sink ms", "sink ÷ plain"], tablefmt="github")
