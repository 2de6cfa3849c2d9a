"""The in-place append of ``flash_attn_with_kvcache``: ``_rotate_rows`` writes the new keys, rotated at
their cache positions, and the new values into a contiguous or paged cache, both in one launch
(``kvcache_append``). A batch entry whose index values are out of range appends nothing, so bad
indices (under CUDA graph capture, or in calls whose checks the kernels make) never write outside the
caches, nor into another sequence's cache row or page.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tileattn.kernels import common
from tileattn.kernels.decode import record
from tileattn.kernels.decode.plan import remember_plan
from tileattn.kernels.decode.rotary import rotated
from tileattn.kernels.launch import Launch, Launcher
from tileattn.params import padded_headdim


@triton.jit
def _entry_ok(
    Seqlens, LeftPad, BatchIdx, Table, b,
    stride_tb, seqlen, batch, capacity, num_rows, rot_len, rot_span,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    ROTARY: tl.constexpr,
):  # fmt: skip
    """``(ok, (code, j, value, bound, extra))``: whether batch entry b may append its ``seqlen`` new
    tokens, and its first bad value (``record``'s error; code 0 for none). Not ok: cache_seqlens,
    cache_leftpad or cache_batch_idx out of range, the rotary tables short of ``cache_seqlens +
    rot_span``, a block-table entry of a page it writes outside the pool, or another entry appending into
    the same cache row (the later one reports it, as ``checks.cache_values`` does)."""
    code, j, value, bound, extra = record.entry_error(
        Seqlens, LeftPad, BatchIdx, b,
        seqlen, capacity, num_rows, rot_len, rot_span,
        HAS_LEFTPAD, HAS_BATCH_IDX and not PAGED, ROTARY,
    )  # fmt: skip
    ok = code == 0
    if PAGED:  # the table entries of the pages the new tokens go to
        cached = tl.load(Seqlens + b)
        lo = tl.where(ok, cached // PAGE_SIZE, 0)
        hi = tl.where(ok, (cached + seqlen - 1) // PAGE_SIZE + 1, 0)
        col, page = record.first_bad_page(Table + b.to(tl.int64) * stride_tb, lo, hi, num_rows, 16)
        code, j, value, bound, extra = record.first_error(
            code, j, value, bound, extra, col < hi, record.BLOCK_TABLE, col, page, num_rows, 0
        )
    elif HAS_BATCH_IDX:  # entries appending into the same cache row (O(batch) per program)
        row = tl.load(BatchIdx + b)
        shared = b * 0
        earlier = b * 0 + batch
        for start in range(0, batch, 128):
            offs = start + tl.arange(0, 128)
            same = (offs < batch) & (offs != b) & (tl.load(BatchIdx + offs, mask=offs < batch, other=0) == row)
            shared = tl.maximum(shared, tl.max(same.to(tl.int32), 0))
            earlier = tl.minimum(earlier, tl.min(tl.where(same, offs, batch), 0))
        ok = ok & (shared == 0)
        code, j, value, bound, extra = record.first_error(
            code, j, value, bound, extra, earlier < b, record.BATCH_IDX_REPEATED, earlier, row, 0, 0
        )
    return ok & (code == 0), (code, j, value, bound, extra)


@triton.jit
def _rotate_rows(
    Src, Dst, Src2, Dst2,
    Seqlens, BatchIdx, Table, Cos, Sin, Descale, Descale2, LeftPad, Record,
    stride_sb, stride_st, stride_sh,
    stride_db, stride_dt, stride_dh,
    stride_s2b, stride_s2t, stride_s2h,
    stride_d2b, stride_d2t, stride_d2h,
    stride_tb, stride_c,
    seqlen, nheads, rot_half, rot_len, capacity, num_rows, batch, rot_span,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    QUANTIZE: tl.constexpr, INTERPRET: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """Writes row (b, t, h) of ``Src`` into the cache ``Dst`` at position ``pos = Seqlens[b] + t``,
    rotated (if ROTARY) at that position: ``Dst[row, pos, h]`` of a contiguous cache (row = BatchIdx[b]
    or b), or of the page ``Table[b, pos // PAGE_SIZE]`` at slot ``pos % PAGE_SIZE`` (PAGED). Programs of
    grid axis 2 index 1 copy ``Src2`` to ``Dst2`` the same way, unrotated (the new values beside the new
    keys, in one launch). The rotation is computed in fp32 as ``x·cos ∓ partner·sin`` and rounded once,
    like ``tileattn.rotary`` (launched without FMA contraction, so the bits match it).

    A batch entry with an index value out of range (``_entry_ok``: its position past ``capacity``, its
    cache row or a page it writes outside ``num_rows``, cache_leftpad, the rotary tables shorter than
    ``cache_seqlens + rot_span`` rows, a cache row another entry appends into) writes nothing, and the
    rotary position is clamped to the tables' ``rot_len`` rows: the API refuses such values, and under
    CUDA graph capture, where it cannot read them, nothing outside the cache or the tables is touched
    and no entry writes into another's row or page. CHECK (a ``params.CALL_*``; 0: none): the first
    program of each entry writes its first bad value into the error record ``Record``.

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
    ok, error = _entry_ok(
        Seqlens, LeftPad, BatchIdx, Table, b,
        stride_tb, seqlen, batch, capacity, num_rows, rot_len, rot_span,
        PAGED, PAGE_SIZE, HAS_BATCH_IDX, HAS_LEFTPAD, ROTARY,
    )  # fmt: skip
    if CHECK != 0:
        if (t == 0) & (h == 0) & first:
            code, j, value, bound, extra = error
            record.record(Record, code, b, j, value, bound, extra, CHECK)
    in_range = ok & (pos >= 0) & (pos < capacity)
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


def _append_launch(
    src, dst, block_table, rotary, has_batch_idx, pair, quantize, interpret, has_leftpad, span, check
) -> Launch:
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
            batch,
            max(span, seqlen),
        ),
        {
            "HEAD_DIM": headdim,
            "BLOCK_D": padded_headdim(headdim),
            "ROTARY": rotary is not None,
            "INTERLEAVED": bool(rotary[2]) if rotary is not None else False,
            "PAGED": paged,
            "PAGE_SIZE": dst.shape[1] if paged else 1,
            "HAS_BATCH_IDX": has_batch_idx,
            "HAS_LEFTPAD": has_leftpad,
            "QUANTIZE": quantize,
            "INTERPRET": interpret,
            "CHECK": check,
        },
        num_warps=1,
        enable_fp_fusion=False,
    )


def kvcache_append(
    k_cache,
    v_cache,
    k,
    v,
    rotary,
    seqlens,
    batch_idx,
    block_table,
    plans=None,
    descales=(None, None),
    interpret=False,
    leftpad=None,
    span=0,
    record=None,
    call=0,
):
    """The in-place append of ``flash_attn_with_kvcache``: k rotated (``rotary``: ``(cos, sin,
    interleaved)`` or None) and v written at ``seqlens[b] + t``, in one launch of ``_rotate_rows``
    (q is rotated by the split kernel as it reads it, ``CacheLayout.q_rotary``); same interface and
    results as ``tileattn.cpu.kvcache_append``. ``plans`` as ``CacheLayout.plans``: the launch is
    planned once per table. ``descales``: ``(k_descale, v_descale)`` of FP8 caches (else Nones);
    ``interpret``: the kernel runs in Triton's interpreter (``common.to_e4m3``). ``leftpad``: the call's
    cache_leftpad, and ``span``: the positions past cache_seqlens the rotary tables must cover (at least
    the new tokens), checked with the other index values: an entry with a bad one appends nothing.
    ``record``, ``call``: the error record and the caller (``CacheLayout.record``) when the kernel
    reports bad values, else None."""
    if k is None or k.numel() == 0:
        return
    check = call if record is not None else 0
    key = ("append", check)
    launch = plans.get(key) if plans is not None else None
    if launch is None:
        quantize = descales[0] is not None
        launch = _append_launch(
            k, k_cache, block_table, rotary, batch_idx is not None, (v, v_cache), quantize, interpret,
            leftpad is not None, span, check,
        )  # fmt: skip
        if plans is not None:
            remember_plan(plans, key, launch)
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
            leftpad if leftpad is not None else seqlens,
            record if record is not None else seqlens,
        )
    )
