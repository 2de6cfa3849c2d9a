"""Registers, spills and shared memory of every compiled attention kernel after a causal forward and
backward with and without dropout (hd64 and hd128, bf16), so register pressure can be read, not guessed."""

import torch

import tileattn
from tileattn.kernels import backward, forward

for headdim in (64, 128):
    q, k, v = (
        torch.randn(2, 1024, 8, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    for p in (0.0, 0.1):
        out = tileattn.flash_attn_func(q, k, v, dropout_p=p, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
torch.cuda.synchronize()
for fn in (forward._attn_fwd, backward._attn_bwd_dkdv, backward._attn_bwd_dq):
    for cache in fn.device_caches.values():
        for kernel in cache[0].values():
            kernel._init_handles()
            consts = getattr(kernel.src, "constants", {}) or {}
            tags = {}
            for name in ("HAS_DROPOUT", "BLOCK_D", "MASK_RIGHT"):
                if name in fn.arg_names:
                    i = fn.arg_names.index(name)
                    tags[name] = next((consts[key] for key in ((i,), i, name) if key in consts), "?")
            print(
                f"{fn.__name__:>16} regs {kernel.n_regs:>3} spills {kernel.n_spills:>4} smem {kernel.metadata.shared:>6} {tags}"
            )
