"""GPU time per call, kernel by kernel (torch.profiler device times; no host time, no gaps between
launches), for the cells whose timed speed may include more than the kernels:

- decode 1 × 8k (GQA 32/8, head dim 128): tileattn (split + combine) against SDPA's cuDNN backend, each
  call on its own copy of the cache so that it is read from HBM;
- the feature bench's windows against dense (head dim 128, 4 × 4096), forward and backward kernels;
- the grid's shortest cells (head dim 128, 16 × 1024, causal and not), tileattn against cuDNN.

Prints, per case and backend, the kernels' µs per call and the TFLOP/s or GB/s they give; with ``--out``
writes the rows as JSON lines.

    python scripts/kernel_times.py [--out FILE]
"""

import argparse
import json
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import tileattn
from tileattn.bench.decode import DECODE_BACKENDS
from tileattn.bench.features import visible_pairs


def kernel_us(calls, reps=5):
    """{kernel name: µs per call} over ``reps`` rounds of ``calls`` (after one warm round)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for call in calls:
                call()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            per[e.name[:60]] += e.device_time_total / (reps * len(calls))
    return dict(per)


def show(case, backend, kernels, per_us=None, unit=""):
    """``per_us``: the amount (bytes ÷ 1e3 for GB/s, FLOP ÷ 1e6 for TFLOP/s) that, divided by µs, gives the rate."""
    total = sum(kernels.values())
    rate = f"{per_us / total:.0f} {unit}" if per_us else ""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
    print(f"{case:28s} {backend:10s} {total:9.1f} µs  {rate:14s} [{parts}]", flush=True)
    return dict(case=case, backend=backend, kernel_us=total, kernels=kernels, rate=rate)


def decode_rows():
    rows = []
    batch, cache_len, nheads, nheads_k, d = 1, 8192, 32, 8, 128
    kv_bytes = 2 * batch * cache_len * nheads_k * d * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = []
    for _ in range(16):  # 16 × 33.5 MB, more than L2
        q = torch.randn(batch, 1, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        kc, vc = (
            torch.randn(batch, cache_len, nheads_k, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2)
        )
        inputs.append((q, kc, vc))
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    for name in ("tileattn", "tileattn nosplit", "sdpa-cudnn"):
        calls = [DECODE_BACKENDS[name](q, kc, vc, seqlens)[0] for q, kc, vc in inputs]
        rows.append(show("decode 1x8k", name, kernel_us(calls), kv_bytes / 1e3, "GB/s"))
    return rows


def attention_rows(case, batch, seqlen, causal, window, backends=("tileattn",)):
    nheads, d = 16, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn_like(q)
    work = 4 * batch * nheads * visible_pairs(seqlen, causal, window) * d
    rows = []
    for backend in backends:
        if backend == "tileattn":

            def fwd(q=q, k=k, v=v):
                return tileattn.flash_attn_func(q, k, v, causal=causal, window_size=window)
        else:

            def fwd(q=q, k=k, v=v):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        fwd_k = kernel_us([lambda fwd=fwd: fwd().detach()])
        all_k = kernel_us([lambda fwd=fwd: torch.autograd.grad(fwd(), (q, k, v), dout)])
        bwd_k = {name: t - fwd_k.get(name, 0.0) for name, t in all_k.items()}
        rows.append(show(case + " fwd", backend, fwd_k, work / 1e6, "TFLOP/s"))
        rows.append(
            show(case + " bwd", backend, {n: t for n, t in bwd_k.items() if t > 0.05}, 2.5 * work / 1e6, "TFLOP/s")
        )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = decode_rows()
    full = (-1, -1)
    rows += attention_rows("hd128 4x4096 dense", 4, 4096, False, full)
    rows += attention_rows("hd128 4x4096 window(512,512)", 4, 4096, False, (512, 512))
    rows += attention_rows("hd128 4x4096 window(512,0)", 4, 4096, False, (512, 0))
    for causal in (False, True):
        name = "hd128 16x1024" + (" causal" if causal else "")
        rows += attention_rows(name, 16, 1024, causal, full, backends=("tileattn", "cudnn"))
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
