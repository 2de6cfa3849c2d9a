"""Stress test of the TMA forward (device-side descriptors in a scratch buffer reused from launch to
launch): shapes and features interleaved with backward passes, every output compared with the pointer-load
forward's output of the same inputs (they must agree to the bit)."""

import dataclasses
import sys

import torch

import tileattn
from tileattn.kernels import configs

torch.manual_seed(0)
cases = []
for b, n, h, hk, kw in [
    (4, 4096, 16, 16, {}),
    (4, 4096, 16, 16, {"causal": True}),
    (4, 4096, 16, 4, {}),
    (4, 4096, 16, 4, {"causal": True}),
    (4, 4096, 16, 16, {"window_size": (512, 512)}),
    (2, 1025, 8, 2, {"causal": True}),
]:
    q = torch.randn(b, n, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, n, hk, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cases.append((q, k, v, kw))
saved = configs._FWD[128]
configs._FWD[128] = dataclasses.replace(saved, tma=False)
expected = [tileattn.flash_attn_func(q, k, v, **kw).detach() for q, k, v, kw in cases]
configs._FWD[128] = dataclasses.replace(saved, tma=True)
bad = 0
total = 0
for it in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    for i, (q, k, v, kw) in enumerate(cases):
        out = tileattn.flash_attn_func(q, k, v, **kw)
        if it % 5 == 0:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        total += 1
        if not torch.equal(out.detach(), expected[i]):
            bad += 1
            diff = (out.detach().float() - expected[i].float()).abs()
            print(f"iter {it} case {i}: {int((diff > 0).sum())} elements differ, max {diff.max().item():.4f}")
torch.cuda.synchronize()
print(f"TMA forward vs pointer-load forward: {bad} of {total} calls differ")
