"""Where does dropout's time go? Times attention with dropout 0.1 with alternative keep-mask builders
swapped in for ``common.dropout_keep`` (one variant per process: ``python dropout_variants.py NAME``;
without a name, runs every variant in subprocesses and prints a table; ``--only NAME...`` a subset).

Variants (timing only; the production mask is ``current``):
  current        ``common.dropout_keep``: 8-bit draws, 16 columns per Philox call spread so that one
                 thread of the MMA accumulator layout holds all 16: column 64j + 8i + 2c + h takes byte
                 2(i%2) + h of word i // 2 of counter (j, c)
  qmajor         current, with the dK/dV kernel's tiles in query x key orientation (``q_major``)
  consecutive16  the previous mask: 16-bit draws, 8 consecutive columns per call, [M, N/8, 8] -> [M, N]
  mma32          16-bit draws, 8 columns per call, thread-local like ``current``: column 32j + 8w + 2c + h
                 takes half h of word w of counter (j, c)
  cheap          consecutive16's reshape with a 2-multiply hash instead of Philox
  flat           a 2-multiply hash per element in the accumulator's layout (no reshape, no Philox: a floor)
The kernels' launchers compute ``row_groups`` for the current mapping; the other variants only need a
distinct counter per draw for timing, not the exact stream.
"""

import json
import os
import subprocess
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _mma32(seed, rng_base, offs_m, start_n, row_groups, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    J: tl.constexpr = BLOCK_N // 32
    g = (start_n // 32 + tl.arange(0, J))[:, None] * 4 + tl.arange(0, 4)[None, :]  # [J, C]
    counters = rng_base + offs_m.to(tl.int64)[:, None, None] * row_groups + g[None, :, :]  # [M, J, C]
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    w = tl.arange(0, 4)[None, None, :, None]
    word = tl.where(
        w < 2,
        tl.where(w < 1, w0[:, :, None, :], w1[:, :, None, :]),
        tl.where(w < 3, w2[:, :, None, :], w3[:, :, None, :]),
    )  # [M, J, W, C]
    h = tl.arange(0, 2)[None, None, None, None, :]
    bits = ((word[:, :, :, :, None] >> (h * 16).to(tl.uint32)) & 0xFFFF).to(tl.float32)  # [M, J, W, C, H]
    return tl.reshape(bits, [BLOCK_M, BLOCK_N]) >= dropout_p * 65536.0


@triton.jit
def _consecutive16(
    seed, rng_base, offs_m, start_n, row_groups, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    GROUPS: tl.constexpr = BLOCK_N // 8
    g = start_n // 8 + tl.arange(0, GROUPS)
    counters = rng_base + offs_m.to(tl.int64)[:, None] * row_groups + g[None, :]  # [BLOCK_M, GROUPS]
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    s = tl.arange(0, 8)[None, None, :]
    word = tl.where(
        s < 4,
        tl.where(s < 2, w0[:, :, None], w1[:, :, None]),
        tl.where(s < 6, w2[:, :, None], w3[:, :, None]),
    )  # [BLOCK_M, GROUPS, 8]
    bits = ((word >> ((s % 2) * 16).to(tl.uint32)) & 0xFFFF).to(tl.float32)
    return tl.reshape(bits, [BLOCK_M, BLOCK_N]) >= dropout_p * 65536.0


@triton.jit
def _cheap(seed, rng_base, offs_m, start_n, row_groups, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_N // 8
    g = start_n // 8 + tl.arange(0, GROUPS)
    counters = (rng_base + offs_m.to(tl.int64)[:, None] * row_groups + g[None, :]).to(tl.uint32) ^ seed.to(tl.uint32)
    w0 = counters * 0x9E3779B1
    w1 = w0 * 0x85EBCA77
    w2 = w0 ^ w1
    w3 = w1 * 3
    s = tl.arange(0, 8)[None, None, :]
    word = tl.where(
        s < 4,
        tl.where(s < 2, w0[:, :, None], w1[:, :, None]),
        tl.where(s < 6, w2[:, :, None], w3[:, :, None]),
    )
    bits = ((word >> ((s % 2) * 16).to(tl.uint32)) & 0xFFFF).to(tl.float32)
    return tl.reshape(bits, [BLOCK_M, BLOCK_N]) >= dropout_p * 65536.0


@triton.jit
def _flat(seed, rng_base, offs_m, start_n, row_groups, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n = start_n + tl.arange(0, BLOCK_N)
    x = (rng_base + offs_m.to(tl.int64)[:, None] * row_groups * 8 + n[None, :]).to(tl.uint32) ^ seed.to(tl.uint32)
    x = (x * 0x9E3779B1) * 0x85EBCA77
    return ((x >> 16).to(tl.float32)) >= dropout_p * 65536.0


VARIANTS = {
    "current": None,
    "qmajor": None,  # the current mask with the dK/dV kernel in query x key orientation (KernelConfig.q_major)
    "consecutive16": _consecutive16,
    "mma32": _mma32,
    "cheap": _cheap,
    "flat": _flat,
}
# (head dim, seqlen, causal); DROPOUT_SHAPES="64,512,0;..." overrides (16k tokens, hidden 2048 in each)
SHAPES = [(64, 2048, 1), (128, 2048, 1), (64, 8192, 1)]
if os.environ.get("DROPOUT_SHAPES"):
    SHAPES = [tuple(int(x) for x in item.split(",")) for item in os.environ["DROPOUT_SHAPES"].split(";")]


def _time(fn, inputs, grad_out):
    """Median ms of the forward alone and of forward + backward."""
    fwd = triton.testing.do_bench(fn, return_mode="median")
    both = triton.testing.do_bench(lambda: torch.autograd.grad(fn(), inputs, grad_out), return_mode="median")
    return fwd, both


def _problem(headdim, seqlen):
    """q, k, v and dout of the papers' setting: 16k tokens, hidden 2048, bf16."""
    batch, nheads = 16384 // seqlen, 2048 // headdim
    q, k, v = (
        torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    return q, k, v, torch.randn_like(q)


def run_one(name):
    from tileattn.kernels import common

    if VARIANTS[name] is not None:
        common.dropout_keep = VARIANTS[name]
    if name == "qmajor":
        import dataclasses

        from tileattn.kernels import backward

        original = backward.bwd_dkdv_config
        backward.bwd_dkdv_config = lambda p: dataclasses.replace(original(p), q_major=True)
    import tileattn

    rows = []
    for headdim, seqlen, causal in SHAPES:
        causal = bool(causal)
        q, k, v, dout = _problem(headdim, seqlen)
        out = tileattn.flash_attn_func(q, k, v, dropout_p=0.1, causal=causal)
        fwd, both = _time(
            lambda q=q, k=k, v=v, c=causal: tileattn.flash_attn_func(q, k, v, dropout_p=0.1, causal=c), (q, k, v), dout
        )
        rows.append(
            dict(
                variant=name,
                headdim=headdim,
                seqlen=seqlen,
                fwd_ms=fwd,
                fwdbwd_ms=both,
                finite=bool(out.isfinite().all()),
            )
        )
    return rows


def anchors():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tileattn

    rows = []
    for headdim, seqlen, causal in SHAPES:
        causal = bool(causal)
        q, k, v, dout = _problem(headdim, seqlen)

        def fa2(p, q=q, k=k, v=v, causal=causal):
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)

        ours = lambda q=q, k=k, v=v, c=causal: tileattn.flash_attn_func(q, k, v, causal=c)  # noqa: E731
        for name, fn, grad_out in (("p=0", ours, dout), ("fa2 p=0.1", lambda: fa2(0.1), dout.transpose(1, 2))):
            fwd, both = _time(fn, (q, k, v), grad_out)
            rows.append(dict(variant=name, headdim=headdim, seqlen=seqlen, causal=causal, fwd_ms=fwd, fwdbwd_ms=both))
    return rows


if __name__ == "__main__":
    out_dir = os.environ.get("OUT", "/tmp/out")
    names = ["anchors", *VARIANTS]
    if len(sys.argv) > 2 and sys.argv[1] == "--only":
        names = sys.argv[2:]
    elif len(sys.argv) > 1:
        rows = anchors() if sys.argv[1] == "anchors" else run_one(sys.argv[1])
        print("JSON" + json.dumps(rows), flush=True)
        sys.exit(0)
    table = []
    for name in names:
        env = dict(os.environ, TRITON_CACHE_DIR=f"{out_dir}/cache_{name}")
        r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, env=env, timeout=240)
        line = [x for x in r.stdout.splitlines() if x.startswith("JSON")]
        if r.returncode or not line:
            print(f"{name}: FAILED\n{r.stderr[-3000:]}", flush=True)
            continue
        rows = json.loads(line[0][4:])
        table += rows
        for r in rows:
            print(f"{name}: {r}", flush=True)
    with open(f"{out_dir}/dropout_variants.json", "w") as f:
        json.dump(table, f, indent=1)
    for r in table:
        print(
            f"{r['variant']:>10} hd{r['headdim']} {r['seqlen']:>5}: fwd {r['fwd_ms']:.3f} ms  fwd+bwd {r['fwdbwd_ms']:.3f} ms"
            f"  finite {r.get('finite')}"
        )
