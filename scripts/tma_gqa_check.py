"""Diagnoses the TMA forward against an fp32 reference on GQA shapes: max error per variant, and which
heads / rows are off."""

import dataclasses
import sys

import torch

import tileattn
from tileattn.kernels import configs

torch.manual_seed(0)
for b, n, h, hk, causal in [
    (4, 4096, 16, 4, False),
    (1, 1025, 16, 4, False),
    (4, 4096, 16, 16, False),
    (1, 4096, 16, 4, False),
    (4, 1024, 16, 4, False),
    (4, 4096, 16, 4, True),
]:
    q = torch.randn(b, n, h, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, n, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2),
        k.float().transpose(1, 2),
        v.float().transpose(1, 2),
        is_causal=causal,
        enable_gqa=True,
    ).transpose(1, 2)
    saved = configs._FWD[128]
    for tma in (False, True):
        configs._FWD[128] = dataclasses.replace(saved, tma=tma)
        out = tileattn.flash_attn_func(q, k, v, causal=causal).float()
        err = (out - ref).abs()
        bad = (err > 0.01).nonzero()
        print(
            f"B{b} N{n} H{h}/{hk} causal={causal} tma={tma}: max err {err.max().item():.4f}, "
            f"bad elems {bad.shape[0]}, batches {bad[:, 0].unique().tolist()[:8]}, heads {bad[:, 2].unique().tolist()[:16]}, "
            f"rows {bad[:, 1].min().item() if len(bad) else '-'}..{bad[:, 1].max().item() if len(bad) else '-'}",
            flush=True,
        )
    configs._FWD[128] = saved
sys.exit(0)
