"""Kernel variants on the GPU: row tiles through TMA tensor descriptors (KernelConfig.tma) in the forward,
dK/dV and dQ kernels, and the forward's key loop warp-specialised by the compiler (KernelConfig.warp_spec),
against the current tables and SDPA's cuDNN backend, in one run. Each variant's forward passes the
tolerance rule before it is timed (the backward variants are tested in tests/test_attention.py); a variant
that fails to compile is listed with its error.

    python scripts/tma_probe.py [--headdim 128 64 256] [--seqlen 4096] [--out DIR]
"""

import argparse
import dataclasses
import json
import os

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import tileattn
from tileattn.bench.__main__ import check_backend, flops
from tileattn.kernels import configs

# name -> {table: changes to its entry}; the forward tile changes keep the table's other fields
VARIANTS = {
    "tma-fwd": {"fwd": dict(tma=True)},
    "tma-fwd-ws": {"fwd": dict(tma=True, warp_spec=True)},
    "tma-dkdv": {"dkdv": dict(tma=True)},
    "tma-dq": {"dq": dict(tma=True)},
    "tma-all": {"fwd": dict(tma=True), "dkdv": dict(tma=True), "dq": dict(tma=True)},
    "no-tma": {"fwd": dict(tma=False), "dkdv": dict(tma=False), "dq": dict(tma=False)},
    "tma-fwd-4s": {"fwd": dict(tma=True, num_stages=4)},
    "tma-fwd-2s": {"fwd": dict(tma=True, num_stages=2)},
}
TABLES = {"fwd": configs._FWD, "dkdv": configs._BWD_DKDV, "dq": configs._BWD_DQ}


def _time(fn, total_flops):
    return total_flops / triton.testing.do_bench(fn, return_mode="median") / 1e9


def _measure(q, k, v, dout, causal, f_fwd, f_bwd):
    out = tileattn.flash_attn_func(q, k, v, causal=causal)
    check_backend("tileattn", out, q, k, v, causal)
    fwd_ms = triton.testing.do_bench(lambda: tileattn.flash_attn_func(q, k, v, causal=causal), return_mode="median")

    def step():
        o = tileattn.flash_attn_func(q, k, v, causal=causal)
        torch.autograd.grad(o, (q, k, v), dout)

    both_ms = triton.testing.do_bench(step, return_mode="median")
    return f_fwd / fwd_ms / 1e9, f_bwd / (both_ms - fwd_ms) / 1e9


def _cudnn(q, k, v, dout, causal, f_fwd, f_bwd):
    qt, kt, vt, dt = (t.transpose(1, 2) for t in (q, k, v, dout))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):

        def fwd():
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        def step():
            torch.autograd.grad(fwd(), (q, k, v), dt)

        fwd_ms = triton.testing.do_bench(fwd, return_mode="median")
        both_ms = triton.testing.do_bench(step, return_mode="median")
    return f_fwd / fwd_ms / 1e9, f_bwd / (both_ms - fwd_ms) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--headdim", type=int, nargs="+", default=[128, 64, 256])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args()
    rows = []
    for d in args.headdim:
        for n in args.seqlen:
            b, h = max(1, 16384 // n), 2048 // d
            q, k, v = (
                torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
            )
            dout = torch.randn_like(q)
            for causal in (False, True):
                f_fwd = flops(b, h, n, n, d, causal, "fwd")
                f_bwd = flops(b, h, n, n, d, causal, "bwd")
                row = dict(d=d, n=n, causal=causal, results={})
                row["results"]["cudnn"] = _cudnn(q, k, v, dout, causal, f_fwd, f_bwd)
                row["results"]["table"] = _measure(q, k, v, dout, causal, f_fwd, f_bwd)
                for name in args.variants:
                    saved = {t: TABLES[t][d] for t in TABLES}
                    try:
                        for t, changes in VARIANTS[name].items():
                            TABLES[t][d] = dataclasses.replace(TABLES[t][d], **changes)
                        row["results"][name] = _measure(q, k, v, dout, causal, f_fwd, f_bwd)
                    except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                        row["results"][name] = str(exc).strip().splitlines()[-1][:160]
                    finally:
                        for t, cfg in saved.items():
                            TABLES[t][d] = cfg
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tma_probe.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print("\nTFLOP/s fwd / bwd (bf16, 16k tokens, hidden 2048; bwd = (fwd+bwd) - fwd)")
    for r in rows:
        print(f"hd{r['d']} n{r['n']} causal={r['causal']}")
        for name, x in r["results"].items():
            print(f"    {name:12} {x if isinstance(x, str) else f'{x[0]:5.0f} {x[1]:5.0f}'}")


if __name__ == "__main__":
    main()
