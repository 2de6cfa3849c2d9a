"""Attention with dropout 0.1 (training), fwd+bwd ms: tileattn against SDPA's FLASH_ATTENTION backend
(FA2) and tileattn without dropout, bf16, 16k tokens, hidden 2048 (H200)."""

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import tileattn

for headdim in (64, 128):
    for seqlen in (2048, 8192):
        batch, nheads = 16384 // seqlen, 2048 // headdim
        q, k, v = (
            torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        dout = torch.randn_like(q)

        def ours(p, q=q, k=k, v=v, dout=dout):
            return lambda: torch.autograd.grad(
                tileattn.flash_attn_func(q, k, v, dropout_p=p, causal=True), (q, k, v), dout
            )

        def fa2(q=q, k=k, v=v, dout=dout):
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, dropout_p=0.1, is_causal=True)
            return torch.autograd.grad(out.transpose(1, 2), (q, k, v), dout)

        t = {
            name: triton.testing.do_bench(fn, return_mode="median")
            for name, fn in (("tileattn p=0.1", ours(0.1)), ("tileattn p=0", ours(0.0)), ("sdpa-flash p=0.1", fa2))
        }
        base = t["tileattn p=0.1"]
        print(
            f"hd{headdim} causal {batch}x{seqlen}: "
            + ", ".join(f"{n} {ms:.2f} ms ({ms / base:.2f}x)" for n, ms in t.items()),
            flush=True,
        )
