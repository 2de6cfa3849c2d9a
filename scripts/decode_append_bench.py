"""Decode step with the in-place append: flash_attn_with_kvcache with one new token (k, v, rotary)
against the attention alone, CUDA-graph timed like ``python -m tileattn.bench --decode`` (H200)."""

import torch

import tileattn
from tileattn.bench.decode import graph_ms


def measure(batch: int, cache_len: int) -> tuple[float, float]:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, 1, 32, 128, **bf16)
    kc = torch.randn(batch, cache_len, 8, 128, **bf16)
    vc = torch.randn_like(kc)
    k, v = torch.randn(batch, 1, 8, 128, **bf16), torch.randn(batch, 1, 8, 128, **bf16)
    angle = torch.rand(cache_len, 64, device="cuda")
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    seqlens = torch.full((batch,), cache_len - 1, dtype=torch.int32, device="cuda")

    def plain():
        return tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

    def with_append():
        return tileattn.flash_attn_with_kvcache(
            q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=True
        )

    return graph_ms([plain]), graph_ms([with_append])


for batch, cache_len in ((1, 8192), (8, 32768), (64, 4096)):
    plain_ms, append_ms = measure(batch, cache_len)
    print(f"{batch}x{cache_len}: attention {plain_ms * 1e3:.1f} µs, with append+rotary {append_ms * 1e3:.1f} µs")
