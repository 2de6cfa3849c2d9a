"""Every kernel on odd shapes with masked tails, for compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python scripts/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python scripts/sanitize.py

Without PyTorch's caching allocator each tensor is its own allocation, so an access one element past a
tensor is reported. Covers the forward, the backward (preprocess, dK/dV, dQ) and the varlen scheduling,
with every feature flag."""

import torch

import tileattn

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
CASES = [
    (1, 113, 203, 4, 2, 59, dict(causal=True)),
    (2, 203, 113, 3, 1, 111, dict(window_size=(17, 5), softcap=3.0)),
    (1, 63, 63, 2, 2, 256, dict(dropout_p=0.2, causal=True)),
    (2, 1, 77, 4, 4, 40, dict(alibi_slopes=torch.rand(2, 4, device=dev))),
    (1, 129, 65, 2, 1, 96, dict(causal=True)),  # first 64 rows see no key
]
for b, sq, sk, h, hk, d, kw in CASES:
    q = torch.randn(b, sq, h, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
    out = tileattn.flash_attn_func(q, k, v, **kw)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
lens_q, lens_k = [37, 0, 1, 130], [5, 9, 0, 200]
q = torch.randn(sum(lens_q), 4, 72, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(sum(lens_k), 2, 72, device=dev, dtype=dt, requires_grad=True)
cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=dev)
for kw in (dict(causal=True), dict(window_size=(3, 9), dropout_p=0.1)):
    out = tileattn.flash_attn_varlen_func(q, k, k, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    torch.autograd.grad(out, (q, k), torch.randn_like(out))
torch.cuda.synchronize()
print("sanitize workload done")
