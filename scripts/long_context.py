"""One long causal sequence through forward and backward on one GPU: time, peak memory, and a check of
the last 128 query rows of head 0 against the reference (bottom-right alignment makes those rows the
same causal problem).

Usage: python scripts/long_context.py [--seqlen 131072] [--nheads 16] [--headdim 128]
"""

import argparse

import torch
import triton

import tileattn
from tileattn.reference import attention_ref
from tileattn.testing import check_close

ap = argparse.ArgumentParser()
ap.add_argument("--seqlen", type=int, default=131072)
ap.add_argument("--nheads", type=int, default=16)
ap.add_argument("--headdim", type=int, default=128)
args = ap.parse_args()
n, h, d = args.seqlen, args.nheads, args.headdim
q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)
torch.cuda.reset_peak_memory_stats()
out = tileattn.flash_attn_func(q, k, v, causal=True)
grads = torch.autograd.grad(out, (q, k, v), dout)
torch.cuda.synchronize()
peak = torch.cuda.max_memory_allocated() / 2**30
inputs = 8 * n * h * d * 2 / 2**30  # q, k, v, out, dout, dq, dk, dv
tail = (slice(None), slice(n - 128, n), slice(0, 1))
ref = attention_ref(q[tail], k[:, :, :1], v[:, :, :1], causal=True, upcast=torch.float64)[0]
lowp = attention_ref(q[tail], k[:, :, :1], v[:, :, :1], causal=True, upcast=False)[0]
check_close("last rows", out[tail], ref, lowp)
t_fwd = triton.testing.do_bench(lambda: tileattn.flash_attn_func(q, k, v, causal=True), rep=500)
t_all = triton.testing.do_bench(
    lambda: torch.autograd.grad(tileattn.flash_attn_func(q, k, v, causal=True), (q, k, v), dout), rep=1000
)
flops = 4 * h * n * n * d / 2
print(
    f"seqlen {n}, {h} heads, headdim {d}, causal, bf16: fwd {t_fwd:.1f} ms ({flops / t_fwd / 1e9:.0f} TFLOP/s), "
    f"fwd+bwd {t_all:.1f} ms ({3.5 * flops / t_all / 1e9:.0f} TFLOP/s); peak memory {peak:.2f} GiB "
    f"(the 8 input/output/gradient tensors alone: {inputs:.2f} GiB); last-rows check passed"
)
