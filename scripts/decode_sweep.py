"""Decode sweep for tileattn (H200): GB/s of K+V for every (block_n, stages, num_splits), contiguous
caches, and for paged caches (pages of 16 and 256, shuffled) at block_n 128. One line per measurement."""

import torch

import tileattn
from tileattn.bench.decode import DECODE_CASES, graph_ms
from tileattn.kernels import decode
from tileattn.kernels.configs import KernelConfig


def gbps(inputs, seqlens, kv_bytes, num_splits, page=None):
    calls = []
    for q, k, v in inputs:
        table = None
        if page:
            batch, cache_len = k.shape[:2]
            k = k.view(-1, page, *k.shape[2:])
            v = v.view(-1, page, *v.shape[2:])
            table = torch.randperm(k.shape[0], device="cuda").view(batch, -1).int()
        calls.append(
            lambda q=q, k=k, v=v, t=table: tileattn.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=seqlens, block_table=t, num_splits=num_splits
            )
        )
    return kv_bytes / graph_ms(calls) / 1e6


def fixed(cfg):
    return lambda *args: cfg  # stands in for decode._config_for(rows, block_d, interpret, stages, tma)


def main():
    for batch, cache_len in DECODE_CASES:
        kv_bytes = 2 * batch * cache_len * 8 * 128 * 2
        copies = max(1, -(-(512 * 2**20) // kv_bytes))
        inputs = [
            tuple(
                torch.randn(batch, n, h, 128, device="cuda", dtype=torch.bfloat16)
                for n, h in ((1, 32), (cache_len, 8), (cache_len, 8))
            )
            for _ in range(copies)
        ]
        seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
        name = f"{batch}x{cache_len}"
        default = decode._config_for
        for block_n, warps, stages in ((64, 4, 3), (128, 4, 3), (128, 4, 4)):
            decode._config_for = fixed(KernelConfig(16, block_n, warps, stages))
            res = [gbps(inputs, seqlens, kv_bytes, n) for n in (1, 2, 4, 8, 16, 32)]
            line = " ".join(f"{r:.0f}" for r in res)
            print(f"{name} n{block_n} w{warps} s{stages} splits 1/2/4/8/16/32: {line}", flush=True)
        decode._config_for = default
        for page in (None, 16, 256):
            res = [gbps(inputs, seqlens, kv_bytes, n, page) for n in (0, 1, 4, 16)]
            line = " ".join(f"{r:.0f}" for r in res)
            print(
                f"{name} default {'paged' + str(page) if page else 'contiguous'} splits auto/1/4/16: {line}", flush=True
            )
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
