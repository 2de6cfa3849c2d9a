"""The one tolerance rule, used by the tests and by the benchmark's correctness check.

A result is accepted when its error against a high-precision oracle is at most twice the error that
plain PyTorch makes in the same low precision, plus a rounding floor of two units in the last place at
the reference's largest magnitude. For gradients the floor is taken at the largest magnitude of the
whole backward (dq, dk and dv together): a gradient that is exactly 0 in exact arithmetic (dk when every
row sees one key) still carries the rounding of Δ = rowsum(dO ∘ O) from the stored low-precision O.
"""

from __future__ import annotations

import torch


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Two ulps of ``dtype`` at the largest magnitude of ``ref``."""
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return 2.0 * torch.finfo(dtype).eps * max(scale, 1e-3)


def check_close(
    name: str,
    out: torch.Tensor,
    ref: torch.Tensor,
    ref_lowp: torch.Tensor,
    factor: float = 2.0,
    floor_scale: torch.Tensor | None = None,
) -> float:
    """Asserts ``max|out - ref| <= factor * max|ref_lowp - ref| + floor``; returns the error ratio.

    ``ref`` is the oracle (fp32/fp64), ``ref_lowp`` the same computation in ``out``'s precision;
    ``floor_scale`` (default ``ref``) sets the magnitude of the rounding floor. The message names the
    tensor, the worst element and the ratio to the PyTorch error."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    ref64 = ref.double()
    if not torch.isfinite(out).all():
        bad = (~torch.isfinite(out)).nonzero()[0].tolist()
        raise AssertionError(f"{name}: non-finite value at index {bad}")
    err_t = (out.double() - ref64).abs()
    err = err_t.max().item() if out.numel() else 0.0
    base = (ref_lowp.double() - ref64).abs().max().item() if out.numel() else 0.0
    floor = rounding_floor(ref64 if floor_scale is None else floor_scale, out.dtype)
    bound = factor * base + floor
    if err > bound:
        where = tuple(torch.unravel_index(err_t.argmax(), err_t.shape))
        where = tuple(int(i) for i in where)
        raise AssertionError(
            f"{name}: max error {err:.3e} at {where} (out {out.flatten()[err_t.argmax()].item():.5g}, ref "
            f"{ref64.flatten()[err_t.argmax()].item():.5g}) exceeds {factor} x PyTorch error {base:.3e} + floor "
            f"{floor:.3e}; ratio to PyTorch {err / max(base, 1e-30):.2f}"
        )
    return err / max(base, floor)
