"""The in-place append of ``flash_attn_with_kvcache``: ``_rotate_rows`` writes the new keys, rotated at
their cache positions, and the new values into a contiguous or paged cache, both in one launch
(``kvcache_append``). Writes outside the cache are dropped, so a captured CUDA graph with bad indices
never touches memory outside it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tileattn.kernels import common
from tileattn.kernels.decode.plan import Launch, remember_plan
from tileattn.kernels.decode.rotary import rotated
from tileattn.kernels.launch import Launcher
from tileattn.params import padded_headdim


@triton.jit
def _rotate_rows(
    Src, Dst, Src2, Dst2,
    Seqlens, BatchIdx, Table, Cos, Sin, Descale, Descale2,
    stride_sb, stride_st, stride_sh,
    stride_db, stride_dt, stride_dh,
    stride_s2b, stride_s2t, stride_s2h,
    stride_d2b, stride_d2t, stride_d2h,
    stride_tb, stride_c,
    seqlen, nheads, rot_half, rot_len, capacity, num_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    QUANTIZE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Writes row (b, t, h) of ``Src`` into the cache ``Dst`` at position ``pos = Seqlens[b] + t``,
    rotated (if ROTARY) at that position: ``Dst[row, pos, h]`` of a contiguous cache (row = BatchIdx[b]
    or b), or of the page ``Table[b, pos // PAGE_SIZE]`` at slot ``pos % PAGE_SIZE`` (PAGED). Programs of
    grid axis 2 index 1 copy ``Src2`` to ``Dst2`` the same way, unrotated (the new values beside the new
    keys, in one launch). The rotation is computed in fp32 as ``x·cos ∓ partner·sin`` and rounded once,
    like ``tileattn.rotary`` (launched without FMA contraction, so the bits match it). Writes whose
    position (``< capacity``), cache row or page (``< num_rows``) is out of range are dropped, and the
    rotary position is clamped to the tables' ``rot_len`` rows: the API refuses such values, and under
    CUDA graph capture, where it cannot read them, nothing outside the cache or the tables is touched.

    QUANTIZE: the caches are e4m3; a row is divided by its descale (``Descale`` / ``Descale2``, fp32
    ``(batch, nheads)`` contiguous), saturated at ±448 and rounded to nearest."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.program_id(2) == 0
    b = pid // seqlen
    t = pid % seqlen
    pos = tl.load(Seqlens + b) + t
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)
    # (selected, not branched: a stride of 2**31 or more is an int64 argument, the other's may be int32)
    src = tl.where(
        first,
        Src + b64 * stride_sb + t64 * stride_st + h64 * stride_sh,
        Src2 + b64 * stride_s2b + t64 * stride_s2t + h64 * stride_s2h,
    )
    dst_base = tl.where(first, Dst, Dst2)
    sdb = tl.where(first, stride_db, stride_d2b)
    sdt = tl.where(first, stride_dt, stride_d2t)
    sdh = tl.where(first, stride_dh, stride_d2h)
    x = tl.load(src + offs_d, mask=mask_d, other=0.0)  # [BLOCK_D]
    if ROTARY:  # (the keys only: the values of grid axis 2 index 1 are copied as they are)
        x = rotated(x, src, Cos, Sin, pos, rot_len, stride_c, offs_d, rot_half, first, INTERLEAVED)
    in_range = (pos >= 0) & (pos < capacity)
    safe_pos = tl.where(in_range, pos, 0)
    if PAGED:
        page = tl.load(Table + b64 * stride_tb + safe_pos // PAGE_SIZE)
        in_range = in_range & (page >= 0) & (page < num_rows)
        dst = dst_base + page.to(tl.int64) * sdb + (safe_pos % PAGE_SIZE).to(tl.int64) * sdt + h64 * sdh
    else:
        row = b
        if HAS_BATCH_IDX:
            row = tl.load(BatchIdx + b)
        in_range = in_range & (row >= 0) & (row < num_rows)
        dst = dst_base + row.to(tl.int64) * sdb + safe_pos.to(tl.int64) * sdt + h64 * sdh
    if QUANTIZE:
        descale = tl.where(first, tl.load(Descale + b * nheads + h), tl.load(Descale2 + b * nheads + h))
        x = common.to_e4m3(x.to(tl.float32) / descale, INTERPRET)
    # (!= 0: a boolean mask under the interpreter too, where the scalar in_range broadcasts as int32)
    tl.store(dst + offs_d, x.to(Dst.dtype.element_ty), mask=(mask_d & in_range) != 0)


LAUNCHER = Launcher(_rotate_rows)


def _append_launch(src, dst, block_table, rotary, has_batch_idx, pair, quantize, interpret) -> Launch:
    """The launch of ``_rotate_rows`` for new rows ``src`` into ``dst`` and ``pair = (src2, dst2)``
    (the values) beside them."""
    batch, seqlen, nheads, headdim = src.shape
    paged = block_table is not None
    cos = rotary[0] if rotary is not None else None
    src2, dst2 = pair
    return Launch(
        LAUNCHER,
        (batch * seqlen, nheads, 2),
        (
            *src.stride()[:3],
            *dst.stride()[:3],
            *src2.stride()[:3],
            *dst2.stride()[:3],
            block_table.stride(0) if paged else 0,
            cos.stride(0) if cos is not None else 0,
            seqlen,
            nheads,
            cos.shape[1] if cos is not None else 0,
            cos.shape[0] if cos is not None else 0,
            block_table.shape[1] * dst.shape[1] if paged else dst.shape[1],
            dst.shape[0],
        ),
        {
            "HEAD_DIM": headdim,
            "BLOCK_D": padded_headdim(headdim),
            "ROTARY": rotary is not None,
            "INTERLEAVED": bool(rotary[2]) if rotary is not None else False,
            "PAGED": paged,
            "PAGE_SIZE": dst.shape[1] if paged else 1,
            "HAS_BATCH_IDX": has_batch_idx,
            "QUANTIZE": quantize,
            "INTERPRET": interpret,
        },
        num_warps=1,
        enable_fp_fusion=False,
    )


def kvcache_append(
    k_cache, v_cache, k, v, rotary, seqlens, batch_idx, block_table, plans=None, descales=(None, None), interpret=False
):
    """The in-place append of ``flash_attn_with_kvcache``: k rotated (``rotary``: ``(cos, sin,
    interleaved)`` or None) and v written at ``seqlens[b] + t``, in one launch of ``_rotate_rows``
    (q is rotated by the split kernel as it reads it, ``CacheLayout.q_rotary``); same interface and
    results as ``tileattn.cpu.kvcache_append``. ``plans`` as ``CacheLayout.plans``: the launch is
    planned once per table. ``descales``: ``(k_descale, v_descale)`` of FP8 caches (else Nones);
    ``interpret``: the kernel runs in Triton's interpreter (``common.to_e4m3``)."""
    if k is None or k.numel() == 0:
        return
    launch = plans.get("append") if plans is not None else None
    if launch is None:
        quantize = descales[0] is not None
        launch = _append_launch(
            k, k_cache, block_table, rotary, batch_idx is not None, (v, v_cache), quantize, interpret
        )
        if plans is not None:
            remember_plan(plans, "append", launch)
    cos, sin = (rotary[0], rotary[1]) if rotary is not None else (seqlens, seqlens)
    launch(
        (
            k,
            k_cache,
            v,
            v_cache,
            seqlens,
            batch_idx if batch_idx is not None else seqlens,
            block_table if block_table is not None else seqlens,
            cos,
            sin,
            *(descales if descales[0] is not None else (seqlens, seqlens)),
        )
    )
