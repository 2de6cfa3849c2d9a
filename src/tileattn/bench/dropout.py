"""Attention dropout (``--dropout``): forward and forward + backward ms of tileattn with dropout, without
it, and SDPA's FLASH_ATTENTION backend (FlashAttention-2) with the same dropout, on the same inputs.

The default cases are the papers' setting (16k tokens, hidden 2048): causal at head dims 64 and 128 and
2k / 8k tokens per sequence, non-causal head dim 64 at 512 (BERT's shape) and 2k, and head dim 256 at 2k
causal and 4k. Ratios are each
time over tileattn's with dropout. Dropout outputs cannot meet the reference, so the call without
dropout passes the tolerance rule and the dropout call must differ from it and stay finite.
"""

from __future__ import annotations

import torch

import tileattn
from tileattn.bench.backends import Unavailable
from tileattn.reference import attention_ref
from tileattn.testing import check_close

# (headdim, seqlen, causal)
DROPOUT_CASES = [
    (64, 2048, True),
    (64, 8192, True),
    (128, 2048, True),
    (128, 8192, True),
    (64, 512, False),
    (64, 2048, False),
    (256, 2048, True),
    (256, 4096, False),
]


def _sdpa_flash(q, k, v, causal, p):
    if not q.is_cuda:
        raise Unavailable("SDPA's FLASH_ATTENTION backend is timed on CUDA only")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)
        return out.transpose(1, 2)

    return run


def run_dropout(
    time_ms,
    p=0.1,
    cases=None,
    tokens=16384,
    hidden=2048,
    dtype=torch.bfloat16,
    device="cuda",
    progress=print,
):
    """Rows of ``kind='dropout'``: per case, ``backend`` one of ``tileattn p=P``, ``tileattn p=0`` and
    ``sdpa-flash p=P`` (CUDA only), with ``fwd_ms``, ``fwd_bwd_ms`` and their ratios to ``tileattn p=P``
    (``fwd_ratio``, ``fwd_bwd_ratio``). ``time_ms(fn, device)``: median ms of ``fn``."""
    rows = []
    for headdim, seqlen, causal in cases or DROPOUT_CASES:
        batch, nheads = max(1, tokens // seqlen), max(1, hidden // headdim)
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen).requires_grad_()
            for _ in range(3)
        )
        dout = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen)
        variants = {
            f"tileattn p={p:g}": lambda q=q, k=k, v=v, c=causal: tileattn.flash_attn_func(
                q, k, v, dropout_p=p, causal=c
            ),
            "tileattn p=0": lambda q=q, k=k, v=v, c=causal: tileattn.flash_attn_func(q, k, v, causal=c),
        }
        try:
            variants[f"sdpa-flash p={p:g}"] = _sdpa_flash(q, k, v, causal, p)
        except Unavailable as exc:
            progress(f"skip sdpa-flash: {exc}")
        base = dict(kind="dropout", device=str(device), headdim=headdim, batch=batch, seqlen=seqlen)
        base.update(nheads=nheads, causal=causal, dropout_p=p)
        plain = variants["tileattn p=0"]().detach()
        sl = (slice(0, 1), slice(None), slice(0, 1))
        qs, ks, vs = (t.detach()[sl] for t in (q, k, v))
        ref = attention_ref(qs, ks, vs, causal=causal, upcast=torch.float64)[0]
        check_close("tileattn p=0", plain[sl], ref, attention_ref(qs, ks, vs, causal=causal, upcast=False)[0])
        dropped = variants[f"tileattn p={p:g}"]().detach()
        if p > 0 and (not dropped.isfinite().all() or torch.equal(dropped, plain)):
            raise AssertionError(f"tileattn with dropout {p} returned non-finite values or no dropout")
        case_rows = []
        for name, fwd in variants.items():
            t_fwd = time_ms(fwd, device)
            t_all = time_ms(
                lambda fwd=fwd, inputs=(q, k, v), dout=dout: torch.autograd.grad(fwd(), inputs, dout), device
            )
            case_rows.append(dict(base, backend=name, fwd_ms=t_fwd, fwd_bwd_ms=t_all))
        ours = case_rows[0]
        for r in case_rows:
            r["fwd_ratio"] = r["fwd_ms"] / ours["fwd_ms"]
            r["fwd_bwd_ratio"] = r["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
            progress(
                f"hd{headdim} {batch}x{seqlen}{' causal' if causal else ''} {r['backend']}: {r['fwd_bwd_ms']:.3f} ms"
            )
        rows += case_rows
    return rows


def format_dropout(rows) -> str:
    from tabulate import tabulate

    table = [
        [
            f"hd{r['headdim']} {r['batch']}x{r['seqlen']}{' causal' if r['causal'] else ''}",
            r["backend"],
            f"{r['fwd_ms']:.3f}",
            f"{r['fwd_ratio']:.2f}",
            f"{r['fwd_bwd_ms']:.3f}",
            f"{r['fwd_bwd_ratio']:.2f}",
        ]
        for r in rows
    ]
    headers = ["case", "backend", "fwd ms", "÷ with dropout", "fwd+bwd ms", "÷ with dropout"]
    return tabulate(table, headers=headers, tablefmt="github")
