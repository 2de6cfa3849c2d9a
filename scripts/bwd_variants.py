"""Backward tile variants against the tables, in one process: per case and length, each variant's
gradients are compared with the tables' (max |difference| ÷ max |gradient|) and then timed (median of
triton.testing.do_bench over a retained graph; kernel µs from torch.profiler), the builds alternated twice
so that order does not decide. 16k tokens, hidden 2048 (2048 ÷ head dim heads), bf16.

    python scripts/bwd_variants.py --headdim 256 --seqlen 2048 8192 --cases causal dense varlen \\
        --variant "m32n32=dkdvcausal@256:dq_atomic=2,dkdvcausal@256:block_m=32,dkdvcausal@256:block_n=32"

A variant is NAME=CHANGE[,CHANGE...] with the changes of scripts/features_variant.py; "table" (the
tables as they are) is always first. Cases: dense, causal, varlen (lengths from seqlen/2 to seqlen, packed),
varlen-causal.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

import tileattn
from tileattn.bench.__main__ import flops

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from features_variant import tables_as_given  # noqa: E402
from kernel_times import kernel_us  # noqa: E402


def inputs(case, seqlen, d, gen):
    nheads = 2048 // d
    if case.startswith("varlen"):
        lens, total = [], 0
        while total < 16384:
            n = int(torch.randint(seqlen // 2, seqlen + 1, (1,), generator=gen, device="cuda"))
            lens.append(min(n, 16384 - total))
            total += lens[-1]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        shape, extra = (total, nheads, d), dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens))
        extra["max_seqlen_k"] = max(lens)
        pairs = sum(n * n for n in lens)
    else:
        shape, extra, pairs = (16384 // seqlen, seqlen, nheads, d), {}, 16384 * seqlen
    q, k, v = (
        torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3)
    )
    causal = case.endswith("causal")

    def forward():
        if extra:
            return tileattn.flash_attn_varlen_func(q, k, v, causal=causal, **extra)
        return tileattn.flash_attn_func(q, k, v, causal=causal)

    return (q, k, v), forward, pairs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdim", type=int, default=256)
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--cases", nargs="+", default=["causal", "dense"])
    ap.add_argument("--variant", action="append", default=[])
    args = ap.parse_args()
    tables = tables_as_given()
    variants = [("table", [])] + [(v.split("=", 1)[0], v.split("=", 1)[1].split(",")) for v in args.variant]

    header = f"{'case':14s} {'seqlen':>6s} {'variant':12s} {'rel err':>8s} {'ms':>7s} {'TFLOP/s':>8s}"
    print(f"{header} {'kernel µs':>9s}  kernels")
    for case in args.cases:
        for seqlen in args.seqlen:
            gen = torch.Generator(device="cuda").manual_seed(seqlen)
            leaves, forward, pairs = inputs(case, seqlen, args.headdim, gen)
            dout = None
            ref = None
            for name, changes in variants + variants:
                tables.reset(changes)
                out = forward()
                dout = torch.randn_like(out) if dout is None else dout

                def bwd(out=out, leaves=leaves, dout=dout):
                    return torch.autograd.grad(out, leaves, dout, retain_graph=True)

                grads = bwd()
                if ref is None:
                    ref = grads
                err = max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, ref))
                ms = triton.testing.do_bench(bwd, return_mode="median")
                kernels = kernel_us([bwd])
                flop = flops(1, 2048 // args.headdim, pairs, 1, args.headdim, case.endswith("causal"), "bwd")
                parts = ", ".join(f"{n[:20]} {t:.0f}" for n, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:3])
                print(
                    f"{case:14s} {seqlen:6d} {name:12s} {err:8.1e} {ms:7.3f} {flop / ms / 1e9:8.0f} "
                    f"{sum(kernels.values()):9.0f}  {parts}",
                    flush=True,
                )
                del out
            tables.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
