"""The softmax's exponentials by polynomial (kernels/exp2.py, KernelConfig.exp2_poly): the PTX the GPU runs,
evaluated here instruction by instruction in fp32; the same arithmetic in Triton ops under the interpreter
(or the PTX itself on a GPU); against 2**x in fp64: within 1.0e-4 from -126 up, exactly 0 from -127 down
(-inf: masked scores), NaN kept. The forward's use of it on every case is in test_builds.py."""

import re

import numpy as np
import pytest
import torch

import tileattn
from helpers import SLOW, TUNED_TRITON, builds, compiled_sm90, on, randn
from tileattn.kernels import exp2
from tileattn.params import KernelConfig

BOUND = 1.1e-4  # the polynomial's largest relative error is 1.02e-4 (MUFU's ex2.approx: 2**-22)
SPECIAL = [float("-inf"), float("nan"), -1e30, -200.0, -127.0, -126.75, -126.5, -126.0, -0.5, 0.0, 1e-30, 0.5, 8.0]


def _inputs() -> np.ndarray:
    grid = np.linspace(-130.0, 9.0, 40_001, dtype=np.float32)
    fine = np.linspace(-1.0, 1.0, 8_001, dtype=np.float32)  # (the reduction's edges at ±1/2)
    return np.concatenate([grid, fine, np.array(SPECIAL, dtype=np.float32)])


def _check(x: np.ndarray, y: np.ndarray) -> None:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    nan = np.isnan(x64)
    assert np.isnan(y64[nan]).all(), "a NaN score must stay NaN"
    x64, y64 = x64[~nan], y64[~nan]
    assert not np.isnan(y64).any()
    low = x64 <= -127.0
    assert (y64[low] == 0).all() and not np.signbit(y64[low]).any(), "from -127 down (masked: -inf), +0.0"
    edge = (x64 > -127.0) & (x64 < -126.0)
    assert ((y64[edge] >= 0) & (y64[edge] < 2.0**-126)).all(), "between -127 and -126 at most a subnormal"
    normal = x64 >= -126.0
    rel = np.abs(y64[normal] / np.exp2(x64[normal]) - 1.0)
    assert rel.max() <= BOUND, (rel.max(), x64[normal][rel.argmax()])


def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _run_ptx(ptx: str, values: list[np.ndarray]) -> list[np.ndarray]:
    """Evaluates the PTX block of ``exp2.poly_ptx`` on fp32 arrays, one array per input operand, with PTX's
    semantics for the instructions it uses (round-to-nearest fp32 arithmetic; max.NaN returns the canonical NaN
    if either operand is NaN; ex2.approx.ftz flushes subnormal results); returns the outputs."""
    pack = len(values)
    regs: dict[str, np.ndarray] = {f"${pack + j}": v.astype(np.float32) for j, v in enumerate(values)}

    def read(op: str) -> np.ndarray | np.float32:
        if op.startswith("0f"):
            return _f32(int(op[2:], 16))
        if re.fullmatch(r"-?\d+", op):
            return np.uint32(int(op) % 2**32)
        return regs[op]

    def bits(a) -> np.ndarray:
        return np.asarray(a, dtype=np.float32).view(np.uint32) if np.asarray(a).dtype == np.float32 else a

    def f64(a) -> np.ndarray:  # (registers are untyped: a .b32 value read by a .f32 instruction is its bits)
        a = np.asarray(a)
        return (a.view(np.float32) if a.dtype == np.uint32 else a).astype(np.float64)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        a = [read(s) for s in src]
        with np.errstate(all="ignore"):
            if op == "max.NaN.f32":  # (PTX's canonical NaN: 0x7FFFFFFF, not numpy's 0x7FC00000)
                x, y = f64(a[0]), f64(a[1])
                r = np.where(np.isnan(x) | np.isnan(y), _f32(0x7FFFFFFF), np.maximum(x, y).astype(np.float32))
            elif op == "add.rn.f32":
                r = (f64(a[0]) + f64(a[1])).astype(np.float32)
            elif op == "sub.rn.f32":
                r = (f64(a[0]) - f64(a[1])).astype(np.float32)
            elif op == "mul.rn.f32":
                r = (f64(a[0]) * f64(a[1])).astype(np.float32)
            elif op == "fma.rn.f32":  # (the product of two fp32 values is exact in fp64: one rounding per step)
                prod = f64(a[0]) * f64(a[1])
                r = (prod + f64(a[2])).astype(np.float32)
            elif op == "ex2.approx.ftz.f32":
                r = np.exp2(f64(a[0])).astype(np.float32)
                r = np.where(np.abs(r) < np.finfo(np.float32).tiny, np.float32(0), r)
            elif op == "mov.b32":
                r = a[0]
            elif op == "shl.b32":
                r = (bits(a[0]).astype(np.uint64) << np.uint64(a[1])).astype(np.uint32)
            elif op == "add.s32":
                r = (bits(a[0]).astype(np.uint64) + bits(a[1]).astype(np.uint64)).astype(np.uint32)
            else:
                raise AssertionError(f"an instruction the model does not know: {line}")
        regs[d] = np.asarray(r)
    return [bits(regs[f"${j}"]).view(np.float32) for j in range(pack)]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_ptx_block(k):
    """The inline PTX, evaluated: the first k of 8 values through the polynomial, the others through ex2."""
    x = _inputs()
    x = np.concatenate([x, np.zeros(-len(x) % 8, np.float32)])
    lanes = x.reshape(-1, 8)
    outs = _run_ptx(exp2.poly_ptx(k), [lanes[:, j] for j in range(8)])
    _check(x, np.stack(outs, 1).reshape(-1))
    for j in range(8):  # the polynomial's lanes differ from exp2 somewhere; the others are exp2's
        poly = not np.allclose(outs[j], np.exp2(lanes[:, j].astype(np.float64)), rtol=1e-6, equal_nan=True)
        assert poly == (j < k), (j, k)
    assert exp2.poly_ptx(k).count("ex2.approx") == 8 - k


def test_polynomial_in_the_kernels():
    """``exp2_mixed`` in a kernel: under the interpreter all values through the polynomial's Triton ops, on
    a GPU 3 and 8 of every 8 through the PTX."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, Y, N: tl.constexpr, POLY: tl.constexpr, INTERPRET: tl.constexpr):
        x = tl.load(X + tl.arange(0, N))
        tl.store(Y + tl.arange(0, N), exp2.exp2_mixed(x, POLY, INTERPRET))

    x = _inputs()
    n = 1 << (len(x) - 1).bit_length()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    xt = torch.nn.functional.pad(torch.from_numpy(x), (0, n - len(x))).to(device)
    for poly in (3, 8) if device == "cuda" else (8,):
        y = torch.empty_like(xt)
        kernel[(1,)](xt, y, n, poly, device == "cpu", num_warps=4)
        _check(x, y[: len(x)].cpu().numpy())


def test_rows_that_see_no_key_keep_lse_inf():
    """Causal with more queries than keys: the first rows see no key. Through the polynomial their scores
    (-inf) give exactly 0, so their output is 0 and their LSE +inf (a clamp at -126 would give 2**-126 each,
    an LSE near the running max's start instead)."""
    backend = "cuda" if torch.cuda.is_available() else "interpret"
    ctx, device = on(backend)
    q = randn(1, 113, 2, 64, dtype=torch.float16, device=device, requires_grad=False)
    k, v = (randn(1, 63, 2, 64, dtype=torch.float16, device=device, requires_grad=False) for _ in range(2))
    with builds(backend, fwd=dict(exp2_poly=8), gluon=dict(exp2_poly=8)), ctx:
        out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    blind = 113 - 63  # (rows 0 ... 49 see no key)
    assert (out[0, :blind] == 0).all() and torch.isinf(lse[0, :, :blind]).all() and (lse[0, :, :blind] > 0).all()
    assert out[0, blind:].isfinite().all() and lse[0, :, blind:].isfinite().all()


def test_counts_are_checked():
    with pytest.raises(ValueError, match="exp2_poly counts scores of every 8"):
        KernelConfig(128, 64, 8, 2, exp2_poly=9)
    with pytest.raises(ValueError, match="k must be in"):
        exp2.poly_ptx(-1)


BUILD_CASES = """
import dataclasses
from tileattn.kernels import configs, gluon
for poly in (0, 2, 4):
    with configs.override(configs.with_builds(configs.HOPPER, fwd=dict(exp2_poly=poly))):
        rows += [dict(r, poly=poly) for r in compile_report.compile_case(64, "causal", ["fwd"], batch=1, seqlen=1024)]
        rows += [dict(r, poly=poly) for r in compile_report.compile_case(128, "dense", ["fwd"], batch=1, seqlen=1024)]
    if gluon.available():
        rows.append(dict(compile_report.compile_gluon(128, True, exp2_poly=poly), poly=poly))
        rows.append(dict(compile_report.compile_gluon(128, False, fp8=True, block_m=128, block_n=128, stages=2,
                                                      exp2_poly=poly), poly=poly))
"""


@pytest.mark.skipif(
    torch.cuda.is_available() and not SLOW, reason="compile-only for a fixed sm_90a target (TILEATTN_SLOW=1 runs it)"
)
def test_builds_move_exponentials_off_mufu():
    """Compiled for sm_90a: with exp2_poly = 2 and 4 of every 8, the portable forward's unmasked key loop
    (head dim 64 causal, 128 dense, at the tables' tiles) issues that share fewer MUFU.EX2 (the two row
    rescales stay), at the same registers (<= 128, two blocks per SM) and no spills (Triton 3.6); the Gluon forward
    (head dim 128 causal, FP8) that share fewer exponentials between its wgmma waits, at the same stack."""
    rows = compiled_sm90(BUILD_CASES)
    portable = [r for r in rows if r["kernel"] == "_attn_fwd"]
    assert len(portable) == 6, portable
    for base, poly in ((b, r) for b in portable[:2] for r in portable[2:] if r["headdim"] == b["headdim"]):
        scores = base["loop_ex2"] - 2  # (per thread: a tile's scores, and two row rescales)
        assert poly["loop_ex2"] == 2 + scores * (8 - poly["poly"]) // 8, (base, poly)
        # (the tables' Triton, 3.6, spills nothing; 3.9 16 bytes at head dim 64 causal)
        assert poly["stack"] <= (0 if TUNED_TRITON else 16) and poly["regs"] <= 128, poly
        assert poly["blocks_per_sm"] == base["blocks_per_sm"], (base, poly)
    gluon_rows = [r for r in rows if r["kernel"] != "_attn_fwd"]
    for base, poly in ((b, r) for b in gluon_rows[:2] for r in gluon_rows[2:] if r["fp8"] == b["fp8"]):
        ex2 = [[int(n) for run in row["schedule"] for n in re.findall(r"E(\d+)", run)] for row in (base, poly)]
        assert ex2[0] and ex2[1] == [(n - 2) * (8 - poly["poly"]) // 8 + 2 for n in ex2[0]], ex2
        assert poly["stack"] <= base["stack"] and poly["setmaxnreg"] == base["setmaxnreg"], (base, poly)
