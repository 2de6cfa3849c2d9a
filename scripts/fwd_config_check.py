"""Forward tile configs for one head dim: compiled registers / spills / shared memory, correctness against
SDPA on dense, GQA and causal GQA inputs (4 × 4096, fresh inputs each round), and forward TFLOP/s. A
config that faults ends the run (the CUDA context is lost), so put suspects last.

    python scripts/fwd_config_check.py HEADDIM bm,bn,warps,stages[,tma] ...
"""

import sys

import torch
import torch.nn.functional as F
import triton

import tileattn
from tileattn.kernels import configs, forward

hd = int(sys.argv[1])
h = 2048 // hd
block_d = configs.padded_headdim(hd)  # the table key


def tflops(causal, ms):
    return 4 * 4 * h * 4096 * 4096 * hd / (2 if causal else 1) / ms / 1e9


for spec in sys.argv[2:]:
    f = [int(x) for x in spec.split(",")]
    configs._FWD[block_d] = configs.KernelConfig(*f[:4], tma=len(f) > 4 and bool(f[4]))
    forward._attn_fwd.device_caches.clear()
    status, speed = "ok", {}
    try:
        for hk, causal in ((h, False), (h // 4, False), (h // 4, True)):
            for r in range(3):
                g = torch.Generator(device="cuda").manual_seed(r)
                q = torch.randn(4, 4096, h, hd, device="cuda", dtype=torch.bfloat16, generator=g)
                k, v = (
                    torch.randn(4, 4096, hk, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)
                )
                out = tileattn.flash_attn_func(q, k, v, causal=causal)
                kr, vr = (t.repeat_interleave(h // hk, dim=2) for t in (k, v))
                ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, kr, vr)), is_causal=causal)
                err = (out.float() - ref.transpose(1, 2).float()).abs().max().item()
                if err > 0.01:
                    status = f"WRONG {hk} {causal} {err:.3f}"
            ms = triton.testing.do_bench(
                lambda q=q, k=k, v=v, c=causal: tileattn.flash_attn_func(q, k, v, causal=c),
                warmup=25,
                rep=100,
                return_mode="median",
            )
            speed[(hk, causal)] = tflops(causal, ms)
        torch.cuda.synchronize()
    except Exception as e:  # a fault poisons the context: report and stop
        print(spec, "FAILED", type(e).__name__, str(e)[:80], flush=True)
        break
    kern = max(forward._attn_fwd.device_caches[0][0].values(), key=lambda c: (c.n_regs, c.n_spills))
    print(
        f"hd{hd} {spec:14s} regs {kern.n_regs} spills {kern.n_spills} shared {kern.metadata.shared // 1024}K "
        f"{status} TFLOP/s dense {speed[(h, False)]:.0f} gqa {speed[(h // 4, False)]:.0f} "
        f"gqa-causal {speed[(h // 4, True)]:.0f}",
        flush=True,
    )
