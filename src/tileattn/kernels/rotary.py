"""Rotary embedding of whole tensors (``tileattn.rotary.apply_rotary_emb`` and the layers on it): one
program rotates a tile of ``BLOCK_M`` tokens × ``BLOCK_H`` heads, out of place or in place, dense or
packed (varlen).

The rotation is that of ``tileattn.rotary_torch`` (its docstring has the conventions): fp32 products and
sums as written, launched without FMA contraction, rounded once, so both paths give the same bits. The
two channels of a pair are loaded as two contiguous halves (GPT-NeoX) or as one contiguous row split in
even and odd channels (GPT-J), so the loads vectorise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tileattn.kernels.launch import Launcher
from tileattn.params import cdiv, interpreting, next_power_of_2


@triton.jit
def _rotary_kernel(
    Out, X, Cos, Sin, CuSeqlens, SeqlenOffsets,
    stride_ob, stride_om, stride_oh, stride_od,  #
    stride_xb, stride_xm, stride_xh, stride_xd,  #
    seqlen, nheads, seqlen_offset, seqlen_ro, m_blocks,
    ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, COPY_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_OFFSETS_TENSOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_REST: tl.constexpr,
):  # fmt: skip
    """Rotates the first ROTARY_DIM channels of tokens ``[pid_m * BLOCK_M, +BLOCK_M)`` of sequence b,
    heads ``[pid_h * BLOCK_H, +BLOCK_H)``, at positions ``offset(b) + t`` of the ``(seqlen_ro, ROTARY_DIM
    / 2)`` tables (contiguous); channels up to HEAD_DIM are copied if COPY_REST (out of place). Tokens
    whose position falls outside the tables are not rotated. With IS_VARLEN sequence b is the tokens
    ``[CuSeqlens[b], CuSeqlens[b + 1])`` of packed X (stride_xb unused)."""
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = pid // m_blocks
    pid_m = pid % m_blocks
    if IS_VARLEN:
        start = tl.load(CuSeqlens + b).to(tl.int64)
        seqlen = (tl.load(CuSeqlens + b + 1) - start).to(tl.int32)
        X += start * stride_xm
        Out += start * stride_om
    else:
        X += b.to(tl.int64) * stride_xb
        Out += b.to(tl.int64) * stride_ob
    if pid_m * BLOCK_M >= seqlen:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    if HAS_OFFSETS_TENSOR:
        pos = offs_m + tl.load(SeqlenOffsets + b).to(tl.int32)
    else:
        pos = offs_m + seqlen_offset
    mask_rows = (offs_m < seqlen)[:, None, None] & (offs_h < nheads)[None, :, None]  # [BLOCK_M, BLOCK_H, 1]
    x_rows = X + offs_m.to(tl.int64)[:, None, None] * stride_xm + offs_h[None, :, None] * stride_xh
    o_rows = Out + offs_m.to(tl.int64)[:, None, None] * stride_om + offs_h[None, :, None] * stride_oh

    # cos/sin of each token's position; rows outside the tables read (1, 0), the identity
    offs_f = tl.arange(0, BLOCK_K // 2)
    in_table = (pos >= 0) & (pos < seqlen_ro)
    mask_cs = in_table[:, None] & (offs_f < ROTARY_DIM // 2)[None, :]
    cs_offs = tl.where(in_table, pos, 0).to(tl.int64)[:, None] * (ROTARY_DIM // 2) + offs_f[None, :]
    cos = tl.load(Cos + cs_offs, mask=mask_cs, other=1.0).to(tl.float32)[:, None, :]  # [BLOCK_M, 1, BLOCK_K / 2]
    sin = tl.load(Sin + cs_offs, mask=mask_cs, other=0.0).to(tl.float32)[:, None, :]
    if CONJUGATE:
        sin = -sin

    if INTERLEAVED:
        offs_k = tl.arange(0, BLOCK_K)
        mask = mask_rows & (offs_k < ROTARY_DIM)[None, None, :]
        x = tl.load(x_rows + offs_k[None, None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        # [BLOCK_M, BLOCK_H, BLOCK_K / 2] each: the even and the odd channels
        x0, x1 = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_H, BLOCK_K // 2, 2]))
        o0 = x0 * cos - x1 * sin
        o1 = x0 * sin + x1 * cos
        o = tl.reshape(tl.join(o0, o1), [BLOCK_M, BLOCK_H, BLOCK_K])
        tl.store(o_rows + offs_k[None, None, :] * stride_od, o.to(Out.dtype.element_ty), mask=mask)
    else:
        mask = mask_rows & (offs_f < ROTARY_DIM // 2)[None, None, :]
        x0_ptrs = x_rows + offs_f[None, None, :] * stride_xd
        x0 = tl.load(x0_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_H, BLOCK_K / 2]
        x1 = tl.load(x0_ptrs + (ROTARY_DIM // 2) * stride_xd, mask=mask, other=0.0).to(tl.float32)
        o0 = x0 * cos - x1 * sin
        o1 = x0 * sin + x1 * cos
        o0_ptrs = o_rows + offs_f[None, None, :] * stride_od
        tl.store(o0_ptrs, o0.to(Out.dtype.element_ty), mask=mask)
        tl.store(o0_ptrs + (ROTARY_DIM // 2) * stride_od, o1.to(Out.dtype.element_ty), mask=mask)

    if COPY_REST:  # the channels past ROTARY_DIM, unchanged
        offs_r = ROTARY_DIM + tl.arange(0, BLOCK_REST)
        mask_r = mask_rows & (offs_r < HEAD_DIM)[None, None, :]
        rest = tl.load(x_rows + offs_r[None, None, :] * stride_xd, mask=mask_r, other=0.0)
        tl.store(o_rows + offs_r[None, None, :] * stride_od, rest.to(Out.dtype.element_ty), mask=mask_r)


LAUNCHER = Launcher(_rotary_kernel)


def _tiles(rotary_dim: int, nheads: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_H): about 2048 rotated elements a program (flash_attn's tile), 8192 under the
    interpreter, where each program costs host time."""
    elements = 8192 if interpreting() else 2048
    block_h = min(next_power_of_2(nheads), 2 if not interpreting() else 16)
    block_m = max(1, elements // (block_h * next_power_of_2(rotary_dim)))
    return min(block_m, 64), block_h


def apply_rotary(out, x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate):
    """Writes x rotated into ``out`` (x's shape, any strides; ``out`` may be x, in place): the interface
    of ``tileattn.rotary_torch.apply_rotary`` plus ``max_seqlen``, the longest sequence of a packed x.
    ``cos``/``sin`` contiguous ``(seqlen_ro, rotary_dim / 2)``, ``seqlen_offsets`` a contiguous integer
    ``(batch,)`` tensor or None (then ``seqlen_offset`` for every sequence), ``cu_seqlens`` int32 or None."""
    varlen = cu_seqlens is not None
    if varlen:
        batch, seqlen = cu_seqlens.shape[0] - 1, max_seqlen
        x_strides = (0, *x.stride())
        o_strides = (0, *out.stride())
    else:
        batch, seqlen = x.shape[:2]
        x_strides, o_strides = x.stride(), out.stride()
    nheads, headdim = x.shape[-2:]
    rotary_dim = 2 * cos.shape[1]
    copy_rest = out is not x and rotary_dim < headdim
    block_m, block_h = _tiles(rotary_dim, nheads)
    m_blocks = cdiv(seqlen, block_m)
    if batch == 0 or m_blocks == 0:
        return
    LAUNCHER(
        (batch * m_blocks, cdiv(nheads, block_h)),
        (
            out,
            x,
            cos,
            sin,
            cu_seqlens if varlen else cos,  # (unused pointers get a valid tensor)
            seqlen_offsets if seqlen_offsets is not None else cos,
            *o_strides,
            *x_strides,
            seqlen,
            nheads,
            seqlen_offset,
            cos.shape[0],
            m_blocks,
        ),
        {
            "ROTARY_DIM": rotary_dim,
            "HEAD_DIM": headdim,
            "COPY_REST": copy_rest,
            "INTERLEAVED": bool(interleaved),
            "CONJUGATE": bool(conjugate),
            "IS_VARLEN": varlen,
            "HAS_OFFSETS_TENSOR": seqlen_offsets is not None,
            "BLOCK_M": block_m,
            "BLOCK_H": block_h,
            "BLOCK_K": max(2, next_power_of_2(rotary_dim)),
            "BLOCK_REST": next_power_of_2(headdim - rotary_dim) if copy_rest else 1,
        },
        num_warps=4,
        enable_fp_fusion=False,
    )
