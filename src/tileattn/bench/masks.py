"""FlashMask benchmark (``--masks``): every builder of ``tileattn.masks`` against FlexAttention with the same
mask (compiled, its block mask built once outside the timing, ``mask_mod`` written from the mask's definition
over per-token ids as FlexAttention's documentation does) and SDPA with the dense boolean mask.

TFLOP/s count only the visible score pairs (4·D FLOPs a pair forward, 2.5× that backward), so the
columns compare the speed on the work the mask leaves. Every backend's output passes the tolerance rule
against an fp64 reference on the last 256 query rows of one head first (where a skipped tile would show).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

import tileattn
from tileattn import masks
from tileattn.testing import check_close

_print_now = functools.partial(print, flush=True)


def _cuts(seqlen: int, pieces: int, seed: int = 0) -> list[int]:
    """``pieces`` random lengths summing to ``seqlen`` (documents of a packed sequence)."""
    gen = torch.Generator().manual_seed(seed)
    points = torch.randperm(seqlen - 1, generator=gen)[: pieces - 1].add(1).sort().values.tolist()
    return [b - a for a, b in zip([0, *points], [*points, seqlen])]


def _ids(lengths: list[int], device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))


def mask_cases(seqlen: int, device) -> list[tuple[str, torch.Tensor, bool, object]]:
    """(name, startend_row_indices, causal, FlexAttention mask_mod) for each builder at ``seqlen`` tokens:
    documents of random lengths (one per 2k tokens on average), a question with three answers, prefixes of
    half the sequence or document, a window of 1k, 64 global tokens."""
    docs = _cuts(seqlen, max(1, seqlen // 2048))
    doc = _ids(docs, device)
    starts = torch.tensor([sum(docs[:i]) for i in range(len(docs))], device=device)
    prefix_end = (starts + torch.tensor([n // 2 for n in docs], device=device))[doc]
    quarter = seqlen // 4
    seg = torch.cat([torch.zeros(quarter, dtype=torch.int64), _ids([quarter] * 3, "cpu") + 1]).to(device)
    blocks = [seqlen // 8] * 7 + [seqlen - 7 * (seqlen // 8)]
    blk = _ids(blocks, device)
    window, glob, half = 1024, 64, seqlen // 2
    return [
        (
            "causal document",
            masks.causal_document_mask(docs, device),
            True,
            lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q),
        ),
        ("document", masks.document_mask(docs, device), False, lambda b, h, q, kv: doc[q] == doc[kv]),
        (
            "shared question",
            masks.shared_question_mask(quarter, [quarter] * 3, device),
            True,
            lambda b, h, q, kv: (kv <= q) & ((seg[kv] == 0) | (seg[q] == seg[kv])),
        ),
        (
            "prefix LM",
            masks.prefix_lm_causal_mask(seqlen, half, device),
            False,
            lambda b, h, q, kv: (kv < half) | (kv <= q),
        ),
        (
            "prefix LM document",
            masks.prefix_lm_document_mask(docs, [n // 2 for n in docs], device),
            False,
            lambda b, h, q, kv: (doc[q] == doc[kv]) & ((kv < prefix_end[kv]) | (kv <= q)),
        ),
        (
            "sliding window 1k",
            masks.sliding_window_mask(seqlen, window, device),
            True,
            lambda b, h, q, kv: (kv <= q) & (q - kv <= window),
        ),
        (
            "global 64 + window 1k",
            masks.global_sliding_window_mask(seqlen, glob, window, device),
            False,
            lambda b, h, q, kv: (q < glob) | (kv < glob) | ((q - kv).abs() <= window),
        ),
        (
            "causal blockwise",
            masks.causal_blockwise_mask(blocks, device),
            True,
            lambda b, h, q, kv: (kv <= q) & ((blk[q] == blk[kv]) | (blk[q] == len(blocks) - 1)),
        ),
    ]


def dense_visible(mask_mod, seqlen: int, device, rows: slice | None = None) -> torch.Tensor:
    """Bool ``(rows, seqlen)`` of the mask from its ``mask_mod`` (the definition), rows 1k at a time."""
    rows = rows or slice(0, seqlen)
    kv = torch.arange(seqlen, device=device)[None, :]
    out = []
    for r0 in range(rows.start, rows.stop, 1024):
        q = torch.arange(r0, min(r0 + 1024, rows.stop), device=device)[:, None]
        out.append(mask_mod(0, 0, q, kv))
    return torch.cat(out)


def _reference(q, k, v, seen, rows, precision):
    """Attention of head 0 for query ``rows`` under the bool mask ``seen (rows, seqlen_k)``."""
    qs, ks, vs = (t[0, :, 0].to(precision) for t in (q[:, rows], k, v))
    s = (qs @ ks.T) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    return p @ vs


def _backends(q, k, v, idx, causal, flex, block_mask, dense) -> dict:
    """The forward of each backend on ``(1, seqlen, nheads, headdim)`` inputs: tileattn with the mask's
    indices, Flex with its block mask, SDPA with the dense boolean mask (when ``dense`` is given:
    ``(1, 1, seqlen, seqlen)``)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    calls = {
        "tileattn": lambda: tileattn.flashmask_attention(q, k, v, idx, causal=causal),
        "flex": lambda: flex(qt, kt, vt, block_mask=block_mask).transpose(1, 2),
    }
    if dense is not None:  # (the dense mask of 32k tokens is 1 GiB, and SDPA's mask path spends minutes)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        calls["sdpa dense mask"] = lambda: sdpa(qt, kt, vt, attn_mask=dense).transpose(1, 2)
    return calls


def _inputs(seqlen: int, nheads: int, headdim: int, dtype, device) -> tuple[torch.Tensor, ...]:
    """q, k, v ``(1, seqlen, nheads, headdim)`` requiring grad and dout, drawn from one seed."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
    return q, k, v, torch.randn_like(q)


def _step(call, inputs, dout) -> None:
    """Forward and backward of ``call`` (its inputs' gradients reset first)."""
    for t in inputs:
        t.grad = None
    call().backward(dout)


def run_masks(time_ms, seqlens=(8192, 32768), headdim=128, hidden=2048, dtype=torch.bfloat16, progress=_print_now):
    """Times tileattn, FlexAttention and SDPA (dense bool mask) forward and forward+backward for each
    builder and seqlen (batch 1, ``hidden // headdim`` heads; the backward's time is their difference);
    returns result rows (``kind='masks'``)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    flex = torch.compile(flex_attention, dynamic=False)
    device = "cuda"
    nheads = hidden // headdim
    rows = []
    for seqlen in seqlens:
        q, k, v, dout = _inputs(seqlen, nheads, headdim, dtype, device)
        check_rows = slice(seqlen - 256, seqlen)
        for name, idx, causal, mask_mod in mask_cases(seqlen, device):
            progress(f"masks {name} {seqlen}: checking")
            pairs = int(dense_visible(mask_mod, seqlen, device).sum())
            seen = dense_visible(mask_mod, seqlen, device, check_rows)
            ref = _reference(q.detach(), k.detach(), v.detach(), seen, check_rows, torch.float64)
            lowp = _reference(q.detach(), k.detach(), v.detach(), seen, check_rows, dtype)
            block_mask = create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device)
            dense = dense_visible(mask_mod, seqlen, device)[None, None] if seqlen <= 16384 else None
            calls = _backends(q, k, v, idx, causal, flex, block_mask, dense)
            for backend, call in calls.items():
                row = dict(kind="masks", mask=name, seqlen=seqlen, headdim=headdim, nheads=nheads, backend=backend)
                try:
                    out = call()
                    check_close(f"{backend} {name}", out[0, check_rows, 0], ref, lowp)
                    t_fwd = time_ms(call, device)
                    t_all = time_ms(functools.partial(_step, call, (q, k, v), dout), device)
                except Exception as exc:  # noqa: BLE001 -- a row that cannot run says why
                    row["error"] = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
                    rows.append(row)
                    progress(f"masks {name} {seqlen} {backend}: {row['error']}")
                    continue
                fwd_flops = 4.0 * nheads * headdim * pairs
                t_bwd = max(t_all - t_fwd, 1e-9)
                row.update(
                    fwd_ms=t_fwd,
                    bwd_ms=t_bwd,
                    fwd_tflops=fwd_flops / t_fwd / 1e9,
                    bwd_tflops=2.5 * fwd_flops / t_bwd / 1e9,
                    density=pairs / seqlen**2,
                )
                rows.append(row)
                progress(f"masks {name} {seqlen} {backend}: fwd {t_fwd:.3f} ms, bwd {t_bwd:.3f} ms")
    return rows


def _wall_ms(fn, calls: int, device: str) -> float:
    """Milliseconds per call of ``calls`` calls queued back to back (one sync at each end): what a training
    loop sees, host reads and idle gaps included."""
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3 / calls


def run_new_masks(
    seqlens=(8192, 32768), headdim=128, hidden=2048, dtype=torch.bfloat16, rounds=7, calls=10, device="cuda"
):
    """Forward + backward with a new ``startend_row_indices`` tensor every call (its kernels' form, value
    checks and tile schedules built each time) against the same tensor (all remembered), for every builder
    at each seqlen (batch 1, ``hidden // headdim`` heads): both clone the mask each call, so the two differ
    by the building alone; rounds alternate, medians. Checks that both give the same output. Rows of
    ``kind='new masks'``."""
    nheads = hidden // headdim
    rows = []
    for seqlen in seqlens:
        q, k, v, dout = _inputs(seqlen, nheads, headdim, dtype, device)
        for name, idx, causal, _ in mask_cases(seqlen, device):

            def step(new: bool, idx=idx, causal=causal, inputs=(q, k, v), dout=dout):
                fresh = idx.clone()
                out = tileattn.flashmask_attention(*inputs, fresh if new else idx, causal=causal)
                out.backward(dout)
                return out

            same_out, new_out = step(False).detach(), step(True).detach()
            if not torch.equal(same_out, new_out):
                raise AssertionError(f"new masks {name} {seqlen}: a new mask tensor changed the output")
            times = {"same": [], "new": []}
            for _ in range(rounds):
                for which in times:
                    times[which].append(_wall_ms(functools.partial(step, which == "new"), calls, device))
            same, new = statistics.median(times["same"]), statistics.median(times["new"])
            rows.append(
                dict(kind="new masks", mask=name, seqlen=seqlen, headdim=headdim, nheads=nheads, same_ms=same,
                     new_ms=new, ratio=new / same)
            )  # fmt: skip
            _print_now(f"new masks {name} {seqlen}: same {same:.3f} ms, new {new:.3f} ms ({new / same:.2f}x)")
    return rows


def format_new_masks(rows) -> str:
    from tabulate import tabulate

    table = [[r["mask"], r["seqlen"], f"{r['same_ms']:.3f}", f"{r['new_ms']:.3f}", f"{r['ratio']:.2f}"] for r in rows]
    headers = ["mask", "seqlen", "same tensor ms", "new tensor ms", "new / same"]
    table = tabulate(table, headers, tablefmt="github", disable_numparse=True)
    return "forward + backward per call, a new mask tensor every call\n" + table


def format_masks(rows) -> str:
    from tabulate import tabulate

    by = {(r["mask"], r["seqlen"], r["backend"]): r for r in rows}
    table = []
    for (mask, seqlen, backend), r in by.items():
        if backend != "tileattn" or "error" in r:
            continue
        flex = by.get((mask, seqlen, "flex"), {})
        sdpa = by.get((mask, seqlen, "sdpa dense mask"), {})

        def ratio(other, key, r=r):
            return f"{r[key] / other[key]:.2f}x" if key in other else "-"

        def tf(other, key):
            return f"{other[key]:.0f}" if key in other else "-"

        table.append(
            [
                mask,
                seqlen,
                f"{r['density']:.3f}",
                f"{r['fwd_tflops']:.0f}",
                tf(flex, "fwd_tflops"),
                tf(sdpa, "fwd_tflops"),
                ratio(flex, "fwd_tflops"),
                f"{r['bwd_tflops']:.0f}",
                tf(flex, "bwd_tflops"),
                tf(sdpa, "bwd_tflops"),
                ratio(flex, "bwd_tflops"),
            ]
        )
    headers = [
        "mask", "seqlen", "density", "fwd tileattn", "fwd Flex", "fwd SDPA", "fwd vs Flex",
        "bwd tileattn", "bwd Flex", "bwd SDPA", "bwd vs Flex",
    ]  # fmt: skip
    return "TFLOP/s on the visible pairs\n" + tabulate(table, headers=headers, tablefmt="github")
