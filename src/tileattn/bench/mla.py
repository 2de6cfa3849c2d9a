"""MLA decoding benchmark (``--mla``): ``tileattn.mla.flash_mla_with_kvcache`` on DeepSeek's geometry
(one 576-wide latent row per token, values its first 512 dims, bf16, pages of 64, causal), in FlashMLA's
two regimes, beside GQA decoding of the same batch and cache lengths through ``flash_attn_with_kvcache``.

- memory-bound: batch 128, one query token, 16 query heads, caches of 4k-32k tokens; GB/s of cache read
  (each sequence's rows read once: ``sum(cache_seqlens) * 576 * 2`` bytes);
- compute-bound: 128 query heads, two query tokens (speculative decoding); TFLOP/s, counting
  ``2 * seqlen_q * nheads * cache_len * (576 + 512)`` per sequence;
- the GQA anchor: 32 query / 8 kv heads of dim 128 (4 KiB of K and V per token), GB/s of cache read.

The schedule (``get_mla_metadata``) is made once per step outside the timing, as a model's layers share
it. Before timing, each MLA row's output for its first sequence passes the tolerance rule against the
fp64 attention over the same cache rows. Each row is timed twice: the eager call (``time_ms``:
``do_bench``, so the host's per-call work counts where it exceeds the GPU's) and a CUDA graph of it
replayed (``decode.graph_ms``: device time alone, as a serving loop that captures its step sees it; every
case's cache is far larger than the L2, so each replay reads it from HBM).
"""

from __future__ import annotations

import functools
import math

import torch

import tileattn
from tileattn import mla
from tileattn.bench.decode import graph_ms
from tileattn.testing import check_close

MEMORY_CASES = ((128, 4096), (128, 8192), (128, 16384), (128, 32768))  # (batch, cache length), 16 heads
COMPUTE_CASES = ((128, 4096), (64, 8192))  # 128 heads, two query tokens
D, D_V, PAGE = 576, 512, 64


def _paged_latents(batch: int, seqlen: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A shuffled pool of bf16 pages holding ``batch`` sequences of ``seqlen`` latent rows, and its table."""
    pages = math.ceil(seqlen / PAGE)
    table = torch.randperm(batch * pages, device="cuda", generator=gen).view(batch, pages).to(torch.int32)
    pool = torch.randn(batch * pages, PAGE, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return pool, table


def _check(out, q, pool, table, seqlen, causal) -> float:
    """The tolerance rule on the first sequence (raises if it fails); returns the ratio to bf16's error."""
    pos = torch.arange(seqlen, device="cuda")
    rows = pool[table[0].long()[pos // PAGE], pos % PAGE, 0]  # (seqlen, D)

    def attend(precision):
        qs, ks = q[0].to(precision), rows.to(precision)  # (seqlen_q, nheads, D)
        s = torch.einsum("qhd,kd->hqk", qs, ks) * D**-0.5
        if causal:
            last = seqlen - q.shape[1] + torch.arange(q.shape[1], device="cuda")
            s = s.masked_fill(pos[None, None, :] > last[None, :, None], float("-inf"))
        return torch.einsum("hqk,kd->qhd", torch.softmax(s, -1), ks[:, :D_V])

    return check_close("mla out", out[0], attend(torch.float64), attend(torch.bfloat16))


def _mla_row(time_ms, regime, batch, seqlen, seqlen_q, nheads, gen) -> dict:
    pool, table = _paged_latents(batch, seqlen, gen)
    q = torch.randn(batch, seqlen_q, nheads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    metadata, num_splits = mla.get_mla_metadata(seqlens, seqlen_q * nheads, 1)
    call = functools.partial(
        mla.flash_mla_with_kvcache, q, pool, table, seqlens, D_V, metadata, num_splits, causal=True
    )
    ratio = _check(call()[0], q, pool, table, seqlen, True)
    ms, graph = time_ms(call, "cuda"), graph_ms([call])
    flops = 2.0 * batch * seqlen_q * nheads * seqlen * (D + D_V)
    return dict(
        case="mla",
        regime=regime,
        batch=batch,
        seqlen=seqlen,
        seqlen_q=seqlen_q,
        nheads=nheads,
        ms=ms,
        gbs=batch * seqlen * D * 2 / ms / 1e6,
        tflops=flops / ms / 1e9,
        graph_ms=graph,
        graph_gbs=batch * seqlen * D * 2 / graph / 1e6,
        graph_tflops=flops / graph / 1e9,
        err_ratio=ratio,
        parts=metadata.shape[0],
    )


def _gqa_row(time_ms, batch, seqlen, gen, nheads=32, nheads_k=8, headdim=128) -> dict:
    """One decoding step of GQA over a paged bf16 cache of the same shape of batch and lengths."""
    pages = math.ceil(seqlen / PAGE)
    table = torch.randperm(batch * pages, device="cuda", generator=gen).view(batch, pages).to(torch.int32)
    k, v = (
        torch.randn(batch * pages, PAGE, nheads_k, headdim, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    call = functools.partial(tileattn.flash_attn_with_kvcache, q, k, v, cache_seqlens=seqlens, block_table=table)
    ms, graph = time_ms(call, "cuda"), graph_ms([call])
    nbytes = batch * seqlen * nheads_k * headdim * 4
    return dict(
        case="gqa", regime="memory", batch=batch, seqlen=seqlen, ms=ms, gbs=nbytes / ms / 1e6, graph_ms=graph,
        graph_gbs=nbytes / graph / 1e6,
    )  # fmt: skip


def run_mla(time_ms, memory=MEMORY_CASES, compute=COMPUTE_CASES) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, seqlen in memory:
        rows.append(_mla_row(time_ms, "memory", batch, seqlen, 1, 16, gen))
        rows.append(_gqa_row(time_ms, batch, seqlen, gen))
        torch.cuda.empty_cache()
    for batch, seqlen in compute:
        rows.append(_mla_row(time_ms, "compute", batch, seqlen, 2, 128, gen))
        torch.cuda.empty_cache()
    return rows


def format_mla(rows) -> str:
    from tabulate import tabulate

    gqa = {(r["batch"], r["seqlen"]): r for r in rows if r["case"] == "gqa"}
    table = [
        [
            r["regime"],
            f"{r['batch']} x {r['seqlen']}",
            f"{r['seqlen_q']} x {r['nheads']}",
            f"{r['ms'] * 1e3:.0f} / {r['graph_ms'] * 1e3:.0f}",
            f"{r['gbs']:.0f} / {r['graph_gbs']:.0f}",
            f"{r['tflops']:.0f} / {r['graph_tflops']:.0f}",
            "{gbs:.0f} / {graph_gbs:.0f}".format(**gqa[(r["batch"], r["seqlen"])])
            if r["regime"] == "memory" and (r["batch"], r["seqlen"]) in gqa
            else "",
        ]
        for r in rows
        if r["case"] == "mla"
    ]
    headers = ["regime", "batch x cache", "q tokens x heads", "µs", "GB/s", "TFLOP/s", "GQA 32/8 d128 GB/s"]
    headers[3:] = [f"{h} (eager / graph)" for h in headers[3:]]
    return "MLA decoding (576 / 512, pages of 64, causal, bf16)\n" + tabulate(table, headers=headers, tablefmt="github")
