"""The combine of split-KV decoding: ``_combine`` merges the split kernel's partial outputs and LSEs into
the output and its LSE, weighting each split by ``exp(lse_split - lse)``, and may bring the error record
to the host behind the call's kernels (``MIRROR``). On sm90+ it runs as a programmatic dependent launch
of the split kernel (``DecodeSettings.pdl``): its programs start while the split kernel runs and wait for
its writes. ``combine_tiles`` sizes its loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tileattn import params
from tileattn.kernels.launch import Launcher
from tileattn.params import DecodeSettings, next_power_of_2

RECORD_WORDS = tl.constexpr(params.RECORD_WORDS)


@triton.jit
def _combine(
    OutP, LseP, Out, Lse, SplitOffsets, Record, Mirror, Sink,
    stride_ps, stride_ls,
    n_rows, nheads, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr, VAR_SPLITS: tl.constexpr, MIRROR: tl.constexpr, HAS_SINK: tl.constexpr = False,
):  # fmt: skip
    """Merges split partials of rows [pid·BLOCK_R, ...) of the contiguous output, viewed as rows of
    HEAD_DIM in (batch, token, head) order; LSE is (batch, head, token) (varlen: batch 1, tokens = total).
    The partial outputs are read CHUNK splits at a time, as one [BLOCK_R, CHUNK, BLOCK_D] load. With
    USE_PDL (a programmatic dependent launch) it first waits for the split kernel's writes.

    Every sequence has ``num_splits`` splits, split s of sequence b at ``s * stride_ps`` (output) and
    ``s * stride_ls`` (LSE) from b's rows, unless VAR_SPLITS: then sequence b has the partial slots
    ``SplitOffsets[b] ... SplitOffsets[b + 1] - 1`` (int32 prefix sums; ``num_splits`` bounds their
    count), slot j's partials at ``j * stride_ps`` / ``j * stride_ls`` laid out like one sequence of
    the output / LSE, and sequences of one split, which the split kernel wrote whole, are skipped.

    MIRROR: program 0 also copies the device's error record ``Record`` (``RECORD_WORDS`` int64 words, final
    once the kernels before this one have run) into ``Mirror``, its pinned host copy (plain stores into
    host memory the device addresses, no atomics), in place of an asynchronous copy after the call.

    HAS_SINK: the attention sinks ``Sink`` (fp32, one logit per query head) join every row's softmax
    denominator as one more term (no value), also for rows whose splits saw no key."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if MIRROR:
        if tl.program_id(0) == 0:
            words = tl.arange(0, RECORD_WORDS)
            tl.store(Mirror + words, tl.load(Record + words))
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < n_rows
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    h = offs_r % nheads
    t = (offs_r // nheads) % seqlen_q
    b = offs_r // (nheads * seqlen_q)
    lse_idx = (b * nheads + h).to(tl.int64) * seqlen_q + t
    if VAR_SPLITS:
        first = tl.load(SplitOffsets + b, mask=mask_r, other=0)
        count = tl.load(SplitOffsets + b + 1, mask=mask_r, other=0) - first
        mask_r = mask_r & (count > 1)
        lse_row = first.to(tl.int64) * stride_ls + h * seqlen_q + t
        out_row = first.to(tl.int64) * stride_ps + (offs_r - b * (nheads * seqlen_q)) * HEAD_DIM
    else:
        count = tl.zeros([BLOCK_R], dtype=tl.int32) + num_splits
        lse_row = lse_idx
        out_row = offs_r.to(tl.int64) * HEAD_DIM
    lse = tl.load(
        LseP + offs_s[None, :].to(tl.int64) * stride_ls + lse_row[:, None],
        mask=mask_r[:, None] & (offs_s[None, :] < count[:, None]),
        other=float("-inf"),
    )  # [BLOCK_R, SPLITS_PAD]
    m = tl.max(lse, 1)
    if HAS_SINK:
        sink = tl.load(Sink + h, mask=mask_r, other=float("-inf"))
        m = tl.maximum(m, sink)
    seen = m > float("-inf")
    m_safe = tl.where(seen, m, 0.0)
    total = tl.sum(tl.exp(lse - m_safe[:, None]), 1)
    if HAS_SINK:
        total += tl.exp(sink - m_safe)
    total_safe = tl.where(seen, total, 1.0)
    mask_d = offs_d < HEAD_DIM
    rows = offs_r.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_R, BLOCK_D]
    rows_p = out_row[:, None] + offs_d[None, :]  # the partials' rows
    offs_c = tl.arange(0, CHUNK)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    last = num_splits
    if VAR_SPLITS:  # (the most splits of this block's rows; num_splits only bounds them)
        last = tl.max(tl.where(mask_r, count, 0), 0)
    for s0 in range(0, last, CHUNK):
        mask_c = mask_r[:, None] & (s0 + offs_c[None, :] < count[:, None])  # [BLOCK_R, CHUNK]
        lse_c = tl.load(
            LseP + (s0 + offs_c[None, :]).to(tl.int64) * stride_ls + lse_row[:, None], mask=mask_c, other=float("-inf")
        )
        w = tl.exp(lse_c - m_safe[:, None]) / total_safe[:, None]  # [BLOCK_R, CHUNK]
        o = tl.load(
            OutP + (s0 + offs_c[None, :, None]).to(tl.int64) * stride_ps + rows_p[:, None, :],
            mask=mask_c[:, :, None] & mask_d[None, None, :],
            other=0.0,
        )  # [BLOCK_R, CHUNK, BLOCK_D]
        acc += tl.sum(w[:, :, None] * o, 1)
    tl.store(Out + rows, acc.to(Out.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])
    tl.store(Lse + lse_idx, tl.where(seen, m_safe + tl.log(total_safe), float("inf")), mask=mask_r)


LAUNCHER = Launcher(_combine)


def combine_tiles(num_splits: int, block_d: int, d: DecodeSettings) -> tuple[int, int]:
    """(rows per program, splits per load) of ``_combine``, both powers of two: ``d.combine_splits_per_load``
    splits per load at most, at most ``d.combine_max_values`` fp32 partial values per load and
    ``d.combine_max_rows`` rows."""
    chunk = min(
        next_power_of_2(max(1, d.combine_splits_per_load)),
        next_power_of_2(max(1, num_splits)),
        max(1, d.combine_max_values // block_d),
    )
    if chunk == 1:
        return min(d.combine_max_rows, 16 if block_d <= 128 else 8), 1
    return max(1, min(d.combine_max_rows, d.combine_max_values // (chunk * block_d))), chunk
