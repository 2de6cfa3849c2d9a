"""Index values checked where the decode kernels read them (``tileattn.errors``): ``entry_error`` checks
one batch entry's cache_seqlens, cache_leftpad, cache_batch_idx and rotary span, ``first_bad_page`` a
range of its block-table row, ``first_error`` keeps the first failed check, and ``record`` writes it into
the device's error record (int64 words, ``params.RECORD_WORDS``, in host memory the kernels address
directly). An error is ``(code, j, value, bound, extra)`` with code 0 for none, the codes and words as
``params.ERR_*`` says; the kernels build these only when the call defers its checks (``CHECK``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tileattn import params

SEQLENS_NEGATIVE = tl.constexpr(params.ERR_SEQLENS_NEGATIVE)
SEQLENS_CAPACITY = tl.constexpr(params.ERR_SEQLENS_CAPACITY)
LEFTPAD = tl.constexpr(params.ERR_LEFTPAD)
BATCH_IDX = tl.constexpr(params.ERR_BATCH_IDX)
BATCH_IDX_REPEATED = tl.constexpr(params.ERR_BATCH_IDX_REPEATED)
BLOCK_TABLE = tl.constexpr(params.ERR_BLOCK_TABLE)
ROTARY = tl.constexpr(params.ERR_ROTARY)


@triton.jit
def first_error(code, j, value, bound, extra, bad, new_code: tl.constexpr, new_j, new_value, new_bound, new_extra):
    """The error so far, or the new one where there was none and ``bad`` holds (scalars, int64)."""
    take = (code == 0) & bad
    return (
        tl.where(take, new_code, code),
        tl.where(take, new_j, j),
        tl.where(take, new_value, value),
        tl.where(take, new_bound, bound),
        tl.where(take, new_extra, extra),
    )


@triton.jit
def entry_error(
    Seqlens, LeftPad, BatchIdx, b,
    new_tokens, capacity, num_rows, rot_len, rot_span,
    HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, ROTARY_SPAN: tl.constexpr,
):  # fmt: skip
    """``(code, j, value, bound, extra)`` of batch entry b's first bad value, in the host check's order
    (``checks.cache_values``): cache_seqlens below 0, past the capacity with the ``new_tokens``,
    cache_leftpad outside [0, cache_seqlens], cache_batch_idx outside [0, num_rows), and with
    ROTARY_SPAN the rotary tables' ``rot_len`` rows short of ``cache_seqlens + rot_span``."""
    cached = tl.load(Seqlens + b).to(tl.int64)
    zero = cached * 0
    code, j, value, bound, extra = zero, zero, zero, zero, zero
    code, j, value, bound, extra = first_error(
        code, j, value, bound, extra, cached < 0, SEQLENS_NEGATIVE, zero, cached, zero, zero
    )
    code, j, value, bound, extra = first_error(
        code, j, value, bound, extra, cached + new_tokens > capacity,
        SEQLENS_CAPACITY, zero, cached, zero + capacity, zero + new_tokens,
    )  # fmt: skip
    if HAS_LEFTPAD:
        pad = tl.load(LeftPad + b).to(tl.int64)
        code, j, value, bound, extra = first_error(
            code, j, value, bound, extra, (pad < 0) | (pad > cached), LEFTPAD, zero, pad, zero, cached
        )
    if HAS_BATCH_IDX:
        row = tl.load(BatchIdx + b).to(tl.int64)
        code, j, value, bound, extra = first_error(
            code, j, value, bound, extra, (row < 0) | (row >= num_rows), BATCH_IDX, zero, row, zero + num_rows, zero
        )
    if ROTARY_SPAN:
        end = cached + rot_span
        code, j, value, bound, extra = first_error(
            code, j, value, bound, extra, (cached >= 0) & (end > rot_len), ROTARY, zero, end - 1, zero + rot_len, zero
        )
    return code, j, value, bound, extra


@triton.jit
def first_bad_page(Table_row, lo, hi, num_pages, BLOCK: tl.constexpr):
    """``(j, page)``: the first column j in [lo, hi) of a block-table row whose page lies outside [0,
    num_pages), and that page; j = hi when every page is in the pool."""
    first = hi
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_row = offs < hi
        page = tl.load(Table_row + offs, mask=in_row, other=0)  # [BLOCK]
        bad = in_row & ((page < 0) | (page >= num_pages))
        first = tl.minimum(first, tl.min(tl.where(bad, offs, hi), 0))
    page = tl.load(Table_row + first, mask=first < hi, other=0)
    return first, page


@triton.jit
def record(Record, code, b, j, value, bound, extra, CALL: tl.constexpr):
    """Writes error ``code`` (0: none) of batch entry b into the error record at ``Record`` unless it
    holds one: claims the code word (0 to -1, a compare-and-swap at system scope: the host reads this
    memory), writes the other words, then releases the code, so that a host that reads a code reads
    the words written with it. Scalar atomics run once per program."""
    if code != 0:
        zero = code * 0
        seen = tl.atomic_cas(Record, zero, zero - 1, sem="acq_rel", scope="sys")
        if seen == 0:
            tl.atomic_xchg(Record + 1, zero + CALL, sem="relaxed", scope="sys")
            tl.atomic_xchg(Record + 2, zero + b, sem="relaxed", scope="sys")
            tl.atomic_xchg(Record + 3, zero + j, sem="relaxed", scope="sys")
            tl.atomic_xchg(Record + 4, zero + value, sem="relaxed", scope="sys")
            tl.atomic_xchg(Record + 5, zero + bound, sem="relaxed", scope="sys")
            tl.atomic_xchg(Record + 6, zero + extra, sem="relaxed", scope="sys")
            tl.atomic_xchg(Record, code, sem="release", scope="sys")
