"""A short GPU check after a kernel refactor: forward and backward of a few feature combinations against
the fp64 reference (tolerance rule), and the hd128 causal forward at 4k for speed (TFLOP/s)."""

import sys

import torch
import triton

import tileattn

sys.path.insert(0, "tests")
from helpers import check_attention  # noqa: E402

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
for b, sq, sk, h, hk, d, kw in [
    (2, 257, 311, 4, 2, 96, dict(causal=True)),
    (1, 130, 130, 4, 1, 59, dict(window_size=(33, 7), softcap=5.0)),
    (2, 200, 180, 2, 2, 128, dict(alibi_slopes=torch.rand(2, 2, device=dev))),
]:
    q, k, v = (
        torch.randn(b, n, hh, d, device=dev, dtype=dt, requires_grad=True) for n, hh in ((sq, h), (sk, hk), (sk, hk))
    )
    dout = torch.randn_like(q)
    out = tileattn.flash_attn_func(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention(str(kw.keys()), out, grads, q, k, v, dout, kw)
    print("ok", b, sq, sk, h, hk, d, list(kw), flush=True)
q = torch.randn(4, 4096, 16, 128, device=dev, dtype=dt)
ms = triton.testing.do_bench(lambda: tileattn.flash_attn_func(q, q, q, causal=True), return_mode="median")
print(f"hd128 causal 4x4096 fwd: {4 * 4 * 16 * 4096 * 4096 * 128 / 2 / ms / 1e9:.0f} TFLOP/s")
