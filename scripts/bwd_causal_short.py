"""Causal backward at head dim 128 with dQ from the dK/dV pass (configs._BWD_DKDV_CAUSAL, TMA
reduce-adds) against the two passes, at short and mid lengths (16k tokens, 16 heads): kernel times per
call (torch.profiler) and the timed call (median of triton.testing.do_bench), the two builds alternated
twice so that order does not decide.

    python scripts/bwd_causal_short.py [SEQLEN ...]
"""

import sys

import torch
import triton

import tileattn
from tileattn.kernels import configs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_times import kernel_us  # noqa: E402

seqlens = [int(s) for s in sys.argv[1:]] or [1024, 2048]
table = dict(configs._BWD_DKDV_CAUSAL)
print(f"{'cell':16s} {'build':10s} {'timed ms':>9s} {'kernels µs':>11s}  kernels")
for seqlen in seqlens:
    batch, nheads, d = 16384 // seqlen, 16, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn_like(q)
    out = tileattn.flash_attn_func(q, k, v, causal=True)

    def bwd(out=out, inputs=(q, k, v), dout=dout):
        return torch.autograd.grad(out, inputs, dout, retain_graph=True)

    for build in ("reduce", "two-pass", "reduce", "two-pass"):
        configs._BWD_DKDV_CAUSAL.clear()
        if build == "reduce":
            configs._BWD_DKDV_CAUSAL.update(table)
        bwd()
        ms = triton.testing.do_bench(bwd, return_mode="median")
        kernels = kernel_us([bwd])
        parts = ", ".join(f"{n[:28]} {t:.1f}" for n, t in sorted(kernels.items(), key=lambda kv: -kv[1]))
        print(f"{batch}x{seqlen:<13d} {build:10s} {ms:9.3f} {sum(kernels.values()):11.1f}  {parts}", flush=True)
