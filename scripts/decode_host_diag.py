"""Diagnostics of the decode call's host path at 1 x 8k: synchronising ops (torch's sync debug mode),
value-check misses, per-launch host time, for the plain and paged (pages of 16) calls."""

import time

import torch
import triton

import tileattn
from tileattn import api
from tileattn.kernels import launch

dev, dt = "cuda", torch.bfloat16
q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
kc, vc = (torch.randn(1, 8192, 8, 128, device=dev, dtype=dt) for _ in range(2))
seqlens = torch.full((1,), 8191, dtype=torch.int32, device=dev)
table = torch.randperm(512, device=dev).view(1, 512).int()
kp, vp = kc.view(512, 16, 8, 128), vc.view(512, 16, 8, 128)
cases = {
    "plain": lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens),
    "paged16": lambda: tileattn.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table),
}
misses = [0]
real_check = api._CheckedOnce.__call__


def counting(self, tensors, args, check):
    def counted():
        misses[0] += 1
        return check()

    return real_check(self, tensors, args, counted)


api._CheckedOnce.__call__ = counting
launch_times = {}
real_bound = launch.Bound.__call__


def timed(self, args):
    t0 = time.perf_counter()
    real_bound(self, args)
    launch_times.setdefault(self.launcher.fn.__name__, []).append(time.perf_counter() - t0)


for name, fn in cases.items():
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    misses[0] = 0
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(3):
        fn()
    torch.cuda.set_sync_debug_mode(0)
    print(f"{name}: check misses in 3 calls: {misses[0]}", flush=True)
    launch.Bound.__call__ = timed
    launch_times.clear()
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    launch.Bound.__call__ = real_bound
    for k, v in launch_times.items():
        v.sort()
        print(f"{name}: {k} launch host time median {v[len(v) // 2] * 1e6:.1f} us", flush=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    g.replay()
    t1.record()
    t1.synchronize()
    print(f"{name}: graph (L2 warm) {t0.elapsed_time(t1) / 20 * 1e3:.1f} us/call", flush=True)
    print(f"{name}: do_bench {triton.testing.do_bench(fn, return_mode='median') * 1e3:.1f} us", flush=True)
