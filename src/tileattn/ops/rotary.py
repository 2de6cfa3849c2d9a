"""Rotary embedding as ``torch.library`` custom ops, so ``torch.compile`` sees single opaque nodes:
``tileattn::rotary`` returns x rotated, ``tileattn::rotary_`` rotates x in place. Both take the positions
as a ``(batch,)`` tensor ``seqlen_offsets`` or an int ``seqlen_offset`` (the other unused), dense or packed
x (``cu_seqlens``, ``max_seqlen``), and ``conjugate`` (rotate by -angle: the backward). ``tileattn.rotary``
checks the metadata and carries the autograd; the checks of index *values* (cu_seqlens, tensor offsets:
a read on the host, once per unmodified tensor, skipped under CUDA graph capture) run here. CUDA tensors
take the Triton kernel (``tileattn.kernels.rotary``, imported on first use), CPU tensors the PyTorch path
(``tileattn.rotary_torch``) or, where ``tileattn.backend`` says so, the kernel under Triton's interpreter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tileattn import backend, checks, cpu, rotary_torch


def _check_offsets(offsets: Tensor, lengths: list[int], seqlen_ro: int) -> None:
    """Every position ``offsets[b] + t`` (t < lengths[b]) must be a row of the cos/sin tables."""
    for b, (offset, n) in enumerate(zip(offsets.tolist(), lengths)):
        if n and (offset < 0 or offset + n > seqlen_ro):
            raise checks.InvalidArgument(
                f"seqlen_offsets[{b}] = {offset} puts the {n} tokens of sequence {b} at positions {offset}..."
                f"{offset + n - 1}, outside the cos/sin tables' {seqlen_ro} positions"
            )


def _check_values(x, cos, seqlen_offsets, cu_seqlens, max_seqlen) -> list[int] | None:
    """Checks the values of cu_seqlens and tensor offsets; returns the packed sequences' lengths (None
    when dense, or under CUDA graph capture, where nothing is read)."""
    if backend.capturing(x.device):
        return None
    lengths = None
    if cu_seqlens is not None:
        lengths = checks.cu_values("cu_seqlens", cu_seqlens, x.shape[0], "max_seqlen", max_seqlen)
    if seqlen_offsets is not None:
        checks.checked_once(
            (seqlen_offsets, cu_seqlens),
            ("rotary offsets", tuple(x.shape[:2]), cos.shape[0]),
            lambda: _check_offsets(seqlen_offsets, lengths or [x.shape[1]] * x.shape[0], cos.shape[0]),
        )
    return lengths


def rotary_into(
    out: Tensor,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Tensor | None,
    seqlen_offset: int,
    cu_seqlens: Tensor | None,
    max_seqlen: int,
    interleaved: bool,
    conjugate: bool,
) -> None:
    """Writes x rotated into ``out`` (x itself, or a new tensor of x's shape). Packed rows past
    ``cu_seqlens[-1]`` (padding) are not rotated."""
    lengths = _check_values(x, cos, seqlen_offsets, cu_seqlens, max_seqlen)
    if x.numel() == 0:
        return
    cos, sin = cos.contiguous(), sin.contiguous()
    if seqlen_offsets is not None:
        seqlen_offsets = seqlen_offsets.contiguous()
    if backend.implementation(x) is cpu:
        rotary_torch.apply_rotary(out, x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, interleaved, conjugate)
        return
    from tileattn.kernels import rotary as kernel  # (Triton loads here, on first use)

    if cu_seqlens is not None and out is not x:  # the kernel writes the sequences; the padding rows past them:
        end = sum(lengths) if lengths is not None else 0  # (all of them under capture, where it is unknown)
        if end < x.shape[0]:
            out[end:] = x[end:]
    with backend.on_device(x):
        kernel.apply_rotary(
            out, x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate
        )


def rotary_impl(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Tensor | None,
    seqlen_offset: int,
    cu_seqlens: Tensor | None,
    max_seqlen: int,
    interleaved: bool,
    conjugate: bool,
) -> Tensor:
    out = torch.empty_like(x)
    rotary_into(out, x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate)
    return out


def rotary_inplace_impl(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Tensor | None,
    seqlen_offset: int,
    cu_seqlens: Tensor | None,
    max_seqlen: int,
    interleaved: bool,
    conjugate: bool,
) -> None:
    rotary_into(x, x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate)


rotary = torch.library.custom_op("tileattn::rotary", rotary_impl, mutates_args=())
rotary_ = torch.library.custom_op("tileattn::rotary_", rotary_inplace_impl, mutates_args=("x",))


@rotary.register_fake
def _(x, *args):
    return torch.empty_like(x)


@rotary_.register_fake
def _(x, *args):
    return None


def run(x: Tensor, *args, inplace: bool) -> Tensor:
    """x rotated (``args`` as the ops take them after x): a new tensor, or x itself if ``inplace``. Calls
    the ops, or in eager mode on plain tensors their implementations without the dispatch
    (``backend.direct``)."""
    direct = backend.direct(x, *(a for a in args if isinstance(a, Tensor)))
    if inplace:
        (rotary_inplace_impl if direct else torch.ops.tileattn.rotary_)(x, *args)
        return x
    return (rotary_impl if direct else torch.ops.tileattn.rotary)(x, *args)
