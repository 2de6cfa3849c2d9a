"""One decode layout's calls for Nsight Compute: warms up (compiles), then makes a few more calls of the
same row, so that ``ncu --launch-skip`` can pick a warm split kernel.

    ncu --clock-control none --kernel-name regex:_attn_fwd_kvcache --launch-skip 3 --launch-count 1 \\
        --set full -o OUT python scripts/ncu_decode.py "tileattn paged16" 1 131072

Settings as in decode_ab.py can follow (``--variant "plong=7"``).
"""

import argparse

import torch
from decode_variants_settings import apply

from tileattn.bench.decode import DECODE_BACKENDS, decode_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("layout")
    ap.add_argument("batch", type=int)
    ap.add_argument("cache_len", type=int)
    ap.add_argument("--variant", default="")
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    inputs, seqlens, _ = decode_inputs(args.batch, args.cache_len)
    make = DECODE_BACKENDS[args.layout]
    calls = [make(q, kc, vc, seqlens)[0] for q, kc, vc in inputs]
    with apply(args.variant):
        for i in range(args.calls):
            calls[i % len(calls)]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
