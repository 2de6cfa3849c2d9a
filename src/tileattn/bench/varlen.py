"""Packed batches (``--varlen``): a batch of mixed lengths timed as tileattn varlen, as tileattn on the
zero-padded batch, and as SDPA on the padded batch with a padding mask."""

from __future__ import annotations

import torch

import tileattn


def run_varlen(
    time_ms, device: str, dtype: torch.dtype, tokens: int, headdim: int, nheads: int, causal: bool, seed: int = 0
):
    """A packed batch of mixed lengths (drawn from 64..4096 until ``tokens``) timed three ways: tileattn
    varlen, tileattn on the zero-padded batch, and SDPA on the padded batch with a padding mask."""

    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(64, 4097, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - tokens
    lengths = [n for n in lengths if n > 0]
    batch, max_len = len(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(tokens, nheads, headdim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.arange(max_len, device=device)[None] < torch.tensor(lengths, device=device)[:, None]

    def padded(t):
        out = t.new_zeros(batch, max_len, nheads, headdim)
        out[mask] = t.detach()
        return out.requires_grad_()

    qp, kp, vp = padded(q), padded(k), padded(v)
    attn_mask = mask[:, None, None, :]
    if causal:
        attn_mask = attn_mask & torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()[None, None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=attn_mask
        ).transpose(1, 2)

    variants = {
        "tileattn varlen": (
            (q, k, v),
            lambda: tileattn.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal),
        ),
        "tileattn padded": ((qp, kp, vp), lambda: tileattn.flash_attn_func(qp, kp, vp, causal=causal)),
        "sdpa padded+mask": ((qp, kp, vp), sdpa),
    }
    useful = sum(4 * nheads * n * n * headdim / (2 if causal else 1) for n in lengths)
    rows = []
    for name, (inputs, fn) in variants.items():
        out = fn()
        dout = torch.randn_like(out)
        t_fwd = time_ms(fn, device)
        t_all = time_ms(lambda fn=fn, inputs=inputs, dout=dout: torch.autograd.grad(fn(), inputs, dout), device)
        rows.append(
            dict(
                kind="varlen",
                backend=name,
                device=device,
                causal=causal,
                headdim=headdim,
                nheads=nheads,
                tokens=tokens,
                batch=batch,
                max_seqlen=max_len,
                fwd_ms=t_fwd,
                fwd_bwd_ms=t_all,
                useful_fwd_tflops=useful / t_fwd / 1e9,
            )
        )
    return rows, lengths


def format_varlen(rows) -> str:
    from tabulate import tabulate

    base = {r["causal"]: r for r in rows if r["backend"] == "tileattn varlen"}
    table = [
        [
            ("causal" if r["causal"] else "full"),
            r["backend"],
            f"{r['fwd_ms']:.3f}",
            f"{r['fwd_bwd_ms']:.3f}",
            f"{r['useful_fwd_tflops']:.1f}",
            f"{r['fwd_ms'] / base[r['causal']]['fwd_ms']:.2f}x",
            f"{r['fwd_bwd_ms'] / base[r['causal']]['fwd_bwd_ms']:.2f}x",
        ]
        for r in rows
    ]
    headers = [
        "mask",
        "variant",
        "fwd ms",
        "fwd+bwd ms",
        "useful fwd TFLOP/s",
        "varlen speed-up fwd",
        "varlen speed-up fwd+bwd",
    ]
    return tabulate(table, headers=headers, tablefmt="github")
