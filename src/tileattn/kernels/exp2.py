"""The softmax's exponentials split between the SM's two pipes: ``exp2`` on the special-function unit
(MUFU.EX2, 16 results per clock per SM on Hopper) and a polynomial on the FMA units (128 lanes per clock),
as FlashAttention-4 computes part of its exponentials.

Where the matmuls are fast against the exponentials (head dim 64 in bf16, FP8 from head dim 128) one
exponential per score takes as long as the two matmuls of its tile: a head-dim-64 tile of 128 × 128 scores
is 4.2 MFLOP, 1,024 clocks of the SM's bf16 tensor cores, and 16,384 exponentials, 1,024 clocks of MUFU.
Taking ``k`` of every 8 scores through the FMA units moves that work to a pipe with room (each costs 3
FADD, 3 FFMA, an FMUL and an IMAD there, and a FMNMX), so neither pipe sets the tile's time. (Measured on an
H100 it did not pay: docs/perf.md, "Decisions".)

The polynomial: ``2**x = 2**n · p(f)`` with ``n = round(x)`` (adding 1.5 · 2**23 rounds x to an integer
in the low bits of the sum's mantissa), ``f = x - n`` in [-1/2, 1/2] and ``p(f) = 1 + f·(c1 + f·(c2 +
f·c3))``, fitted for the least largest relative error with p(0) = 1 exactly: 1.0e-4, below the rounding
of P to bf16 (2**-9) or fp16 (2**-11). 2**n is built from n's bits, ``(n + 127) << 23`` (a shift and an
add, one IMAD), and multiplies p (exactly). x is clamped at -127 first, where those bits are +0.0's:
masked scores (-inf) become exactly 0, as from ``exp2``. The clamp propagates NaN (``max.NaN``), and a NaN
p makes the product NaN, so a NaN score stays NaN. (An integer add of ``n << 23`` to p's bits would save
the multiply but not the NaN: PTX's canonical NaN, 0x7FFFFFFF, shifted and added gives 0x7F7FFFFF, the
largest finite float, as an H100 returned.) Between -127 and -126 the result is 0 or a subnormal below
2**-126, not close to 2**x (``ex2.approx.ftz`` gives 0 there); from -126 up every result is a normal
number within 1.0e-4 of 2**x.

On the GPU the split is one inline-PTX block over 8 consecutive values of a thread (``pack=8``): the
first ``k`` through the polynomial, the rest through ``ex2.approx.ftz.f32`` (what ``tl.exp2`` emits).
Which scores those are depends on the layout, not the result: every score gets one of two
approximations of 2**x. Triton's interpreter runs no PTX: there every score takes the polynomial (its
arithmetic in the same fp32 steps), so the CPU tests check its accuracy on all of them.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

# p's coefficients c1, c2, c3 (fp32), fitted on [-1/2, 1/2] for the least largest relative error with p(0) = 1
COEFFS = (0.6932827830314636, 0.24220848083496094, 0.05500781163573265)
ROUND = 12582912.0  # 1.5 * 2**23: x + ROUND, in fp32, is ROUND + round(x) for |x| < 2**22
CLAMP = -127.0  # below it every result is 0 (2**n's bits, (n + 127) << 23, are those of +0.0 there)
ONE_BITS = 0x3F800000  # 1.0's bits, 127 << 23
PACK = 8  # values a thread hands one PTX block; EXP2_POLY_PTX[k] takes the first k through the polynomial


def _f32(x: float) -> str:
    """An fp32 constant as PTX writes it exactly (``0f3F800000`` for 1.0)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return f"0f{bits:08X}"


def poly_ptx(k: int, pack: int = PACK) -> str:
    """The PTX block of ``tl.inline_asm_elementwise(..., pack=pack)``: outputs $0 ... $(pack - 1), inputs
    $pack ...; the first ``k`` values through the polynomial, the others through ``ex2.approx``."""
    if not 0 <= k <= pack:
        raise ValueError(f"k must be in [0, {pack}], got {k}")
    c1, c2, c3 = (_f32(c) for c in COEFFS)
    lines = ["{", f".reg .f32 x<{pack}>, r<{pack}>, f<{pack}>;", f".reg .b32 b<{pack}>;"]
    for j in range(pack):
        out, x = f"${j}", f"${pack + j}"
        if j >= k:
            lines.append(f"ex2.approx.ftz.f32 {out}, {x};")
            continue
        lines += [
            f"max.NaN.f32 x{j}, {x}, {_f32(CLAMP)};",
            f"add.rn.f32 r{j}, x{j}, {_f32(ROUND)};",  # ROUND + n
            f"sub.rn.f32 f{j}, r{j}, {_f32(ROUND)};",  # n, exactly
            f"sub.rn.f32 f{j}, x{j}, f{j};",  # f = x - n
            f"fma.rn.f32 x{j}, f{j}, {c3}, {c2};",
            f"fma.rn.f32 x{j}, x{j}, f{j}, {c1};",
            f"fma.rn.f32 x{j}, x{j}, f{j}, {_f32(1.0)};",  # p(f)
            f"mov.b32 b{j}, r{j};",
            f"shl.b32 b{j}, b{j}, 23;",  # n << 23 (ROUND's own bits shift out)
            f"add.s32 b{j}, b{j}, {ONE_BITS};",  # 2**n: (n + 127) << 23
            f"mov.b32 f{j}, b{j};",
            f"mul.rn.f32 {out}, x{j}, f{j};",  # p · 2**n (exact; NaN if p is)
        ]
    return "\n".join([*lines, "}"])


# EXP2_POLY_PTX[k]: the block for k of every PACK values through the polynomial (index 0 unused)
EXP2_POLY_PTX = tl.constexpr(tuple(poly_ptx(k) for k in range(PACK + 1)))
EXP2_CONSTRAINTS = tl.constexpr("=r," * PACK + ",".join(["r"] * PACK))
C1 = tl.constexpr(COEFFS[0])
C2 = tl.constexpr(COEFFS[1])
C3 = tl.constexpr(COEFFS[2])
ROUND_C = tl.constexpr(ROUND)
CLAMP_C = tl.constexpr(CLAMP)
ONE_BITS_C = tl.constexpr(ONE_BITS)
PACK_C = tl.constexpr(PACK)


@triton.jit
def exp2_poly(x):
    """2**x for fp32 ``x`` by the polynomial, in tl ops (the interpreter's path; the PTX's arithmetic)."""
    x = tl.maximum(x, CLAMP_C, propagate_nan=tl.PropagateNan.ALL)
    r = x + ROUND_C
    f = x - (r - ROUND_C)
    p = tl.fma(tl.fma(tl.fma(f, C3, C2), f, C1), f, 1.0)
    scale = ((r.to(tl.int32, bitcast=True) << 23) + ONE_BITS_C).to(tl.float32, bitcast=True)
    return p * scale


@triton.jit
def exp2_mixed(x, POLY: tl.constexpr, INTERPRET: tl.constexpr):
    """2**x for fp32 ``x``: ``POLY`` of every 8 values of a thread by the polynomial, the rest by
    ``tl.exp2`` (0: all by ``tl.exp2``); under the interpreter (INTERPRET) all by the polynomial. A thread
    must hold a multiple of 8 values of x (a compile error otherwise)."""
    if POLY == 0:
        return tl.exp2(x)
    elif INTERPRET:
        return exp2_poly(x)
    else:
        return tl.inline_asm_elementwise(
            EXP2_POLY_PTX[POLY], EXP2_CONSTRAINTS, [x], dtype=tl.float32, is_pure=True, pack=PACK_C
        )
