"""What the Gluon forward and backward share: which calls they compute (``plain_attention``), q, k, v
and dO as the 2-D matrices their TMA copies read (``tma_rows``, ``TmaRows``), the shared-memory layout
of a tile, where a batch entry's sequence and a head's rows lie in those matrices (``sequence``,
``start``), named barriers by inline PTX (``named_barrier``; FlashAttention-3's warpgroup turns,
``turn_wait`` / ``turn_pass``) and the exponentials split between MUFU and the FMA units (``exp2_mixed``)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tileattn.kernels.exp2 import EXP2_CONSTRAINTS, EXP2_POLY_PTX, PACK_C
from tileattn.params import AttnParams

LOG2E = 1.4426950408889634


@gluon.jit
def sequence(CuQ, CuK, b, seqlen_q, seqlen_k, VARLEN: gl.constexpr):
    """Where batch entry b lies in the 2-D row matrices: ``(first query row, seqlen_q, first key row,
    seqlen_k)``, from cu_seqlens (VARLEN), else entries of the padded lengths one after another."""
    if VARLEN:
        q0 = gl.load(CuQ + b)
        k0 = gl.load(CuK + b)
        return q0, gl.load(CuQ + b + 1) - q0, k0, gl.load(CuK + b + 1) - k0
    else:
        return b * seqlen_q, seqlen_q, b * seqlen_k, seqlen_k


@gluon.jit
def start(b, seq_start, head, layout, VARLEN: gl.constexpr):
    """Where head ``head`` of batch entry b starts in a tensor's 2-D TMA matrix (``TmaRows``): ``(row,
    column)``. ``layout``: the tensor's ``(batch_rows, head_rows, head_cols)``; a packed batch's
    sequence starts at row ``seq_start`` (cu_seqlens[b])."""
    batch_rows, head_rows, head_cols = layout
    if VARLEN:
        row = seq_start
    else:
        row = b * batch_rows
    return row + head * head_rows, head * head_cols


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}


@gluon.jit
def named_barrier(ASM: gl.constexpr):
    """A named-barrier instruction (``bar.sync`` / ``bar.arrive``) by inline PTX: Gluon has no API for them
    (Triton 3.6's inline assembly needs one result: a dummy)."""
    gl.inline_asm_elementwise(ASM + " mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def exp2_mixed(x, POLY: gl.constexpr):
    """2**x for fp32 ``x``: ``POLY`` of every 8 values of a thread by a polynomial on the FMA units, the
    rest by ``gl.exp2`` (MUFU.EX2); 0: all by ``gl.exp2``. ``kernels.exp2`` says how, and how close."""
    if POLY == 0:
        return gl.exp2(x)
    else:
        return gl.inline_asm_elementwise(
            EXP2_POLY_PTX[POLY], EXP2_CONSTRAINTS, [x], dtype=gl.float32, is_pure=True, pack=PACK_C
        )


@gluon.jit
def turn_wait(WG: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: waits for this consumer warpgroup's turn to issue its wgmmas. FlashAttention-3's warp
    scheduler barriers: named barrier 8 + WG counts 256 threads, this warpgroup's 128 at its ``bar.sync``
    and the other's 128 at its ``bar.arrive`` (``turn_pass``). Triton's warp specialization uses barriers 0,
    1 and 2 + worker; 8 and 9 are free."""
    if PINGPONG:
        if WG == 0:
            named_barrier("bar.sync 8, 256;")
        else:
            named_barrier("bar.sync 9, 256;")


@gluon.jit
def turn_pass(WG: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: gives the turn to the other consumer warpgroup, once this one's wgmmas are issued: its
    matmuls then run on the tensor cores while this one runs the softmax."""
    if PINGPONG:
        if WG == 0:
            named_barrier("bar.arrive 9, 256;")
        else:
            named_barrier("bar.arrive 8, 256;")


@functools.cache
def tile_layout(rows: int, headdim: int, dtype: torch.dtype):
    """The shared-memory layout of a ``rows × headdim`` tile (made once: ~6 µs of host time each)."""
    return gl.NVMMASharedLayout.get_default_for([rows, headdim], _GL_DTYPES[dtype])


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


class TmaRows(NamedTuple):
    """A (batch, seqlen, nheads, headdim) tensor as the 2-D matrix TMA reads (a view, no copy) and where
    its heads lie in it: head h of batch entry b starts at row ``b * batch_rows + h * head_rows`` (a packed
    batch's sequence: at its cu_seqlens row instead of ``b * batch_rows``), column ``h * head_cols``."""

    matrix: torch.Tensor
    batch_rows: int
    head_rows: int
    head_cols: int


def tma_rows(t4: torch.Tensor) -> TmaRows | None:
    """``(batch, seqlen, nheads, headdim)`` as a 2-D matrix TMA reads: rows of positions with the heads side
    by side, ``(batch * seqlen, nheads * headdim)`` (flash_attn's layout, a packed qkv's q, k or v), or rows
    of one head's positions one head after another, ``(batch * nheads * seqlen, headdim)`` (the layout of
    a ``(batch, nheads, seqlen, headdim)`` tensor transposed, as Hugging Face models hand queries and keys
    after their rotary embedding); None where the strides allow neither, or TMA's 16-byte alignment does
    not hold."""
    b, s, h, d = t4.shape
    st = t4.stride()
    if st[3] != 1 or (st[1] * t4.element_size()) % 16 or t4.data_ptr() % 16:
        return None
    if st[2] == d and (b == 1 or st[0] == s * st[1]):
        return TmaRows(t4.as_strided((b * s, h * d), (st[1], 1)), s, 0, d)
    if st[1] >= d and st[2] == s * st[1] and (b == 1 or st[0] == h * st[2]):
        return TmaRows(t4.as_strided((b * h * s, d), (st[1], 1)), h * s, s, 0)
    return None


def plain_attention(
    q4: torch.Tensor, p: AttnParams, head_dims: tuple, dropout: bool = False, fp8_head_dims: tuple = ()
) -> bool:
    """What the Gluon kernels (``gluon.forward``, ``gluon.backward``) compute: on sm90, plain attention (no
    softcap, ALiBi or FlashMask; dropout only where ``dropout``), causal or not, sliding windows, dense or
    packed (varlen), bf16/fp16 at one of ``head_dims`` or FP8 (e4m3 with descales) at one of
    ``fp8_head_dims``, a positive softmax scale (they scale the raw products in the exponent: with a scale
    of 0 or below a masked -inf would turn into NaN or +inf, and the row max of the products would not be
    the scores')."""
    if not (q4.is_cuda and _sm90(q4.device.index)) or not p.softmax_scale > 0:
        return False
    if p.softcap > 0 or p.alibi_slopes is not None or p.flashmask is not None:
        return False
    if p.dropout_p > 0 and not dropout:
        return False
    if p.is_fp8:
        return q4.dtype == torch.float8_e4m3fn and q4.shape[-1] in fp8_head_dims
    return q4.dtype in (torch.bfloat16, torch.float16) and q4.shape[-1] in head_dims


def rebased(template: TensorDescriptor, t: torch.Tensor) -> TensorDescriptor:
    """``template`` over the data of ``t``, a tensor of the call signature the template was made for (the
    kernels' plans): its shape, strides, block and layout are the same, only the address differs, and
    Triton's launcher reads the address alone from ``base``. Made without ``TensorDescriptor``'s checks,
    which held for the template."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(template.__dict__)
    desc.base = t
    return desc
