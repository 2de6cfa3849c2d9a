"""Stress of the forward on the feature bench's shapes (4 × 4096, GQA and dense, head dims 64 to 256):
fresh inputs each round, every output compared with SDPA's (k/v repeated per group) and with a second
call on the same inputs, backward passes in between. Prints which (batch, head, 128-row block) programs
went wrong and the compiled forward's registers / spills / shared memory.

    python scripts/gqa_stress.py [ROUNDS] [HEADDIM,NHEADS,NHEADS_K ...]
    FWD=bm,bn,warps,stages[,tma]   every forward table entry replaced by these tiles
    SET="fwd@128:tma=1 fwd@128:maxnreg=128"   table changes in scripts/features_variant.py's syntax
    STEP=1                         synchronise after each forward (find the faulting call)
"""

import os
import sys

import torch
import torch.nn.functional as F

import tileattn
from tileattn.kernels import configs, forward

if os.environ.get("FWD"):
    f = [int(x) for x in os.environ["FWD"].split(",")]
    for d in configs._FWD:
        configs._FWD[d] = configs.KernelConfig(*f[:4], tma=len(f) > 4 and bool(f[4]))

if os.environ.get("SET"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from features_variant import apply

    for change in os.environ["SET"].split():
        apply(change)

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
cases = [(256, 8, 2), (128, 16, 4), (256, 8, 8), (128, 16, 16), (64, 32, 8)]
if len(sys.argv) > 2:
    cases = [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]]
bad = dict.fromkeys(cases, 0)
nondet = dict.fromkeys(cases, 0)


def step(what):
    if os.environ.get("STEP"):
        torch.cuda.synchronize()
        print(what, "done", flush=True)


for r in range(rounds):
    for hd, h, hk in cases:
        g = torch.Generator(device="cuda").manual_seed(r)
        q = torch.randn(4, 4096, h, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(4, 4096, hk, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = tileattn.flash_attn_func(qg, kg, vg)
        if r == 0:
            for kern in forward._attn_fwd.device_caches[0][0].values():
                print("compiled fwd: regs", kern.n_regs, "spills", kern.n_spills, "shared", kern.metadata.shared)
        step("fwd 1")
        out2 = tileattn.flash_attn_func(q, k, v)
        step("fwd 2")
        kr, vr = (t.repeat_interleave(h // hk, dim=2) for t in (k, v))
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, kr, vr))).transpose(1, 2)
        err = (out.detach().float() - ref.float()).abs()
        wrong = err > 0.01
        if not torch.equal(out.detach(), out2):
            nondet[(hd, h, hk)] += 1
        if wrong.any():
            bad[(hd, h, hk)] += 1
            blocks = sorted({(b, hh, m // 128) for b, m, hh, _ in wrong.nonzero().tolist()})
            print(
                f"round {r} hd{hd} {h}/{hk}: {int(wrong.sum())} wrong, max {err.max().item():.3f}, programs {blocks[:12]}"
            )
        for _ in range(3):
            torch.autograd.grad(tileattn.flash_attn_func(qg, kg, vg), (qg, kg, vg), torch.ones_like(out))
torch.cuda.synchronize()
for c in cases:
    print(f"hd{c[0]} {c[1]}/{c[2]}: {bad[c]} of {rounds} rounds wrong, {nondet[c]} differ between two calls")
