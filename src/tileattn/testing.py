"""The one tolerance rule, used by the tests and by the benchmark's correctness check.

A result is accepted when its error against a high-precision oracle is at most twice the error that
plain PyTorch makes in the same low precision, plus a rounding floor of two units in the last place at
the reference's largest magnitude. For gradients the floor is taken at the largest magnitude of the
whole backward (dq, dk and dv together): a gradient that is exactly 0 in exact arithmetic (dk when every
row sees one key) still carries the rounding of Δ = rowsum(dO ∘ O) from the stored low-precision O.
That scale is not enough at large head dims, where Δ sums many rounded products (a row with one key at
head dim 256 was 7 ulps off): a caller that computes the exact change the rounding of O makes through Δ
passes it as an ``allowance`` on top of the floor.
"""

from __future__ import annotations

import math

import torch


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Two ulps of ``dtype`` at the largest finite magnitude of ``ref``."""
    finite = ref[torch.isfinite(ref)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    return 2.0 * torch.finfo(dtype).eps * max(scale, 1e-3)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


def check_close(
    name: str,
    out: torch.Tensor,
    ref: torch.Tensor,
    ref_lowp: torch.Tensor,
    factor: float = 2.0,
    floor_scale: torch.Tensor | None = None,
    allowance: float = 0.0,
) -> float:
    """Asserts ``max|out - ref| <= factor * max|ref_lowp - ref| + floor + allowance``; returns the error ratio.

    ``ref`` is the oracle (fp32/fp64), ``ref_lowp`` the same computation in ``out``'s precision;
    ``floor_scale`` (default ``ref``) sets the magnitude of the rounding floor; ``allowance`` is an error,
    computed exactly by the caller, that the algorithm makes by design on top (a backward's rounding of Δ
    from the stored O: ``tests/helpers.py``'s ``delta_rounding``). Non-finite entries of ``ref``
    must be matched exactly (NaN by NaN, ±inf by the same infinity) and ``out`` is finite everywhere else;
    the rule holds on the finite entries. A baseline that is not finite where ``ref`` is (the PyTorch run
    overflowed) would make the bound meaningless: that is an error of the test, raised as ValueError. The
    message names the tensor, the worst element and the ratio to the PyTorch error."""
    for what, t in (("reference", ref), ("PyTorch baseline", ref_lowp)):
        if out.shape != t.shape:
            raise AssertionError(f"{name}: shape {tuple(out.shape)} != {what} shape {tuple(t.shape)}")
    ref64, out64 = ref.double(), out.double()
    finite = torch.isfinite(ref64)
    same = (torch.isnan(out64) & torch.isnan(ref64)) | (out64 == ref64)
    if not bool((same | finite).all()):
        where = _first(~(same | finite))
        raise AssertionError(f"{name}: {out64[where].item()} at {where} where the reference is {ref64[where].item()}")
    if not bool(torch.isfinite(out64)[finite].all()):
        where = _first(~torch.isfinite(out64) & finite)
        raise AssertionError(
            f"{name}: non-finite value {out64[where].item()} at {where}, reference {ref64[where].item()}"
        )
    low64 = ref_lowp.double()
    if not bool(torch.isfinite(low64)[finite].all()):
        where = _first(~torch.isfinite(low64) & finite)
        raise ValueError(
            f"{name}: the PyTorch baseline is {low64[where].item()} at {where} where the reference is "
            f"{ref64[where].item()}: the test's low-precision run is broken, its error bounds nothing"
        )
    if floor_scale is not None and not bool(torch.isfinite(torch.as_tensor(floor_scale)).all()):
        raise ValueError(f"{name}: floor_scale is not finite")
    if not (math.isfinite(allowance) and allowance >= 0):
        raise ValueError(f"{name}: allowance must be finite and >= 0, got {allowance}")
    err_t = torch.where(finite, out64 - ref64, 0.0).abs()
    err = err_t.max().item() if out.numel() else 0.0
    base = torch.where(finite, low64 - ref64, 0.0).abs().max().item() if out.numel() else 0.0
    floor = rounding_floor(ref64 if floor_scale is None else floor_scale, out.dtype)
    bound = factor * base + floor + allowance
    if err > bound:
        where = tuple(int(i) for i in torch.unravel_index(err_t.argmax(), err_t.shape))
        raise AssertionError(
            f"{name}: max error {err:.3e} at {where} (out {out64[where].item():.5g}, ref "
            f"{ref64[where].item():.5g}) exceeds {factor} x PyTorch error {base:.3e} + floor "
            f"{floor:.3e}{f' + allowance {allowance:.3e}' if allowance else ''}; ratio to PyTorch "
            f"{err / max(base, 1e-30):.2f}"
        )
    return err / max(base, floor)
