"""Host time of tileattn calls at a launch-bound size (BERT-large's attention, one layer), against SDPA;
``--decode``: a decode step's flash_attn_with_kvcache call at 1 x 8k (with ``do_bench`` of each call,
the call path without its launches, and with ``--profile`` a cProfile of the plain call).

Host time per call: 20 calls issued after a synchronize (the launch queue never fills, so the clock
stops when the host is done issuing), best of 10 rounds. GPU time: CUDA events around the same calls.
``--compare-op`` also times the calls through the ``torch.library`` custom op (what torch.compile
traces) instead of the direct eager path (``tileattn.api.direct``). ``--profile`` ends with a cProfile of
tileattn forward+backward calls, synchronising every 10 calls so that no time is spent waiting on a full
launch queue (which cProfile would charge to whatever call happened to block).
"""

import argparse
import cProfile
import pstats
import time

import torch

import tileattn
from tileattn import api


def host_and_gpu_us(fn, calls=20, rounds=10):
    for _ in range(5):
        fn()
    host = []
    gpu = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3 / calls)
    return min(host), min(gpu)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare-op", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--decode", action="store_true", help="flash_attn_with_kvcache at 1 x 8k instead")
    args = ap.parse_args()
    if args.decode:
        return decode(args.profile)
    q, k, v = (torch.randn(8, 512, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def sdpa(p):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p
        ).transpose(1, 2)

    def grad(out):
        return torch.autograd.grad(out, (q, k, v), dout)

    cases = {
        "tileattn fwd": lambda: tileattn.flash_attn_func(q, k, v),
        "tileattn fwd+bwd": lambda: grad(tileattn.flash_attn_func(q, k, v)),
        "tileattn fwd+bwd p=0.1": lambda: grad(tileattn.flash_attn_func(q, k, v, dropout_p=0.1)),
        "sdpa fwd": lambda: sdpa(0.0),
        "sdpa fwd+bwd": lambda: grad(sdpa(0.0)),
        "sdpa fwd+bwd p=0.1": lambda: grad(sdpa(0.1)),
    }
    paths = {"direct": api.direct}
    if args.compare_op:
        paths["custom op"] = lambda *t: False
    for path, rule in paths.items():
        api.direct = rule
        for name, fn in cases.items():
            if path != "direct" and not name.startswith("tileattn"):
                continue
            host, gpu = host_and_gpu_us(fn)
            print(f"{path:9} {name:24} host {host:7.1f} us/call   GPU {gpu:7.1f} us/call", flush=True)
    api.direct = paths["direct"]
    if args.profile:
        prof = cProfile.Profile()
        for _ in range(20):
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(10):
                cases["tileattn fwd+bwd"]()
            prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def decode(profile=False):
    """Host and GPU time of one decode step's attention call (1 x 8k, GQA 32/8, head dim 128): the plain
    call, paged (pages of 16), with a new token appended and rotated, against SDPA's cuDNN backend; and
    each under ``triton.testing.do_bench`` (ANCHORS' method). ``profile``: a cProfile of the plain call."""
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kc, vc = (torch.randn(1, 8192, 8, 128, device=dev, dtype=dt) for _ in range(2))
    seqlens = torch.full((1,), 8191, dtype=torch.int32, device=dev)
    new = torch.randn(1, 1, 8, 128, device=dev, dtype=dt)
    angle = torch.rand(8192, 64, device=dev)
    cos, sin = angle.cos().to(dt), angle.sin().to(dt)
    table = torch.randperm(512, device=dev).view(1, 512).int()
    kp, vp = kc.view(512, 16, 8, 128), vc.view(512, 16, 8, 128)

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True
            )

    cases = {
        "tileattn": lambda: tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens),
        "tileattn paged16": lambda: tileattn.flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=seqlens, block_table=table
        ),
        "tileattn append+rotary": lambda: tileattn.flash_attn_with_kvcache(
            q, kc, vc, new, new, cos, sin, cache_seqlens=seqlens, causal=True
        ),
        "sdpa cudnn": sdpa,
    }
    for name, fn in cases.items():
        host, gpu = host_and_gpu_us(fn)
        bench = triton.testing.do_bench(fn, return_mode="median") * 1e3
        print(
            f"decode 1x8k {name:24} host {host:7.1f} us/call   GPU {gpu:7.1f} us/call   do_bench {bench:7.1f} us",
            flush=True,
        )
    # the same calls with the launches left out (launch.Bound a no-op): the Python of the call path alone
    from tileattn.kernels import launch

    real = launch.Bound.__call__
    launch.Bound.__call__ = lambda self, args: None
    try:
        for name in ("tileattn", "tileattn paged16", "tileattn append+rotary"):
            host, _ = host_and_gpu_us(cases[name])
            print(f"decode 1x8k {name + ' no launch':24} host {host:7.1f} us/call", flush=True)
    finally:
        launch.Bound.__call__ = real
    if profile:
        prof = cProfile.Profile()
        for _ in range(20):
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(10):
                cases["tileattn"]()
            prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
