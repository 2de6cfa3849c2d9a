"""The split kernel of attention against a KV cache (decoding, chunked and paged prefill; forward only).

``_attn_fwd_kvcache`` computes one block of *packed* query rows: row r of a block is token ``r // group``
of query head ``hk * group + r % group``, so the GQA group's query heads share every K/V tile they read
(one read of the cache per kv head, the bandwidth decoding is bound by). Split-KV (Flash-Decoding): the
grid's third axis cuts each sequence's keys into ``num_splits`` shares that write partial outputs and
LSEs for ``combine._combine``. Masks, softcap and ALiBi go through the training kernels' helpers
(``kernels.common``); the cache addressing is ``paging``'s, the launch options ``plan``'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tileattn.kernels import common
from tileattn.kernels.decode import paging, record, rotary
from tileattn.kernels.launch import Launcher


@triton.jit
def _kv_tiles(
    acc, l_i, m_i, q, q_descale,
    K_base, V_base, k_desc, v_desc, Table_row,
    stride_kn, stride_vn, stride_kp, stride_vp,
    k_start, num_pages, i, offs_n_base, offs_d,
    lo, hi, step,
    unit_lo, unit_r0, unit_gap,
    table_pages, seqlen_q, seqlen_k,
    qk_scale, softcap_scale, softcap_log2, slope_log2,
    window_left, window_right,
    HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, OFFS_64: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    DEFER_SCALE: tl.constexpr, UNIT: tl.constexpr, KV_FP8: tl.constexpr = False, WIDEN: tl.constexpr = 0,
    INTERPRET: tl.constexpr = False,
):  # fmt: skip
    """Online softmax over the key tiles at lo, lo + step, ... below hi (columns counted from k_start;
    step is BLOCK_N, or a multiple with interleaved splits). With UNIT > 1 (splits interleaved in runs
    of UNIT tiles) the loop counts tiles instead, j in range(lo, hi, step) = range(0, count, 1), and
    tile j starts at column ``paging.unit_tile(unit_lo, j, unit_r0, unit_gap)``. With PREFETCH_TABLE the
    block table is read one tile ahead, so that a tile's K/V loads do not wait on its page lookup:
    faster when few programs run (latency-bound), slower at full occupancy. With USE_TMA the tiles come
    through the descriptors ``k_desc`` / ``v_desc``: for contiguous caches over the sequence's keys
    (rows past seqlen_k read as zeros), for paged ones over the pool's rows of this kv head (unmasked
    tiles only; the page lookup gives the tile's first row). The pointer addresses computed for the
    other tiles are dropped as dead code where unused. With KV_FP8 the e4m3 tiles are widened for the
    matmuls (``_widened``; WIDEN 3: none, p in e4m3 at 2**P8 times its value, as is the running sum);
    the caller has folded the descales into the scale and the output."""
    first = lo
    if UNIT > 1:
        first = unit_lo
    K_tile, rows_k, V_tile, rows_v = paging.cache_rows(
        K_base, V_base, Table_row,
        offs_n_base, k_start, first,
        table_pages, num_pages,
        stride_kn, stride_vn, stride_kp, stride_vp,
        PAGE_SIZE, BLOCK_N, PAGED, HAS_LEFTPAD,
        True,  # (used only with PREFETCH_TABLE; an empty segment's first tile may lie past the table row)
        OFFS_64,
    )  # fmt: skip
    for j in range(lo, hi, step):
        start_n = j
        next_n = j + step
        if UNIT > 1:
            start_n = paging.unit_tile(unit_lo, j, unit_r0, unit_gap, UNIT, BLOCK_N)
            next_n = paging.unit_tile(unit_lo, j + 1, unit_r0, unit_gap, UNIT, BLOCK_N)
        offs_n = start_n + offs_n_base
        if not PREFETCH_TABLE:
            K_tile, rows_k, V_tile, rows_v = paging.cache_rows(
                K_base, V_base, Table_row,
                offs_n_base, k_start, start_n,
                table_pages, num_pages,
                stride_kn, stride_vn, stride_kp, stride_vp,
                PAGE_SIZE, BLOCK_N, PAGED, HAS_LEFTPAD,
                MASKED or PREFETCH_TABLE, OFFS_64,
            )  # fmt: skip
        if USE_TMA and PAGED and not MASKED:
            # a whole tile of keys lies in one page (PAGE_SIZE a multiple of BLOCK_N, no leftpad); the
            # masked edge tiles take the pointer loads, which zero the rows past the sequence
            pos = k_start + start_n
            page = tl.load(Table_row + pos // PAGE_SIZE)
            row = paging.pool_page(page, num_pages) * PAGE_SIZE + pos % PAGE_SIZE
            k = k_desc.load([row, 0])  # [BLOCK_N, BLOCK_D]
            v = v_desc.load([row, 0])
        elif USE_TMA and not PAGED:
            k = k_desc.load([start_n, 0])  # [BLOCK_N, BLOCK_D]
            v = v_desc.load([start_n, 0])
        else:
            k = common.load_tile(
                K_tile + rows_k[:, None] + offs_d[None, :], offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D
            )  # [BLOCK_N, BLOCK_D]
            v = common.load_tile(
                V_tile + rows_v[:, None] + offs_d[None, :], offs_n, seqlen_k, offs_d, HEAD_DIM, MASKED, PAD_D
            )
        if KV_FP8:
            if WIDEN < 2:  # (WIDEN 2 and 3: q is e4m3 too, and q·kᵀ runs on the FP8 tensor cores)
                k = _widened(k, q.dtype, WIDEN)
            if WIDEN < 3:  # (WIDEN 3: so does P·V)
                v = _widened(v, q.dtype, WIDEN)
        if PREFETCH_TABLE:
            K_tile, rows_k, V_tile, rows_v = paging.cache_rows(
                K_base, V_base, Table_row,
                offs_n_base, k_start, next_n,
                table_pages, num_pages,
                stride_kn, stride_vn, stride_kp, stride_vp,
                PAGE_SIZE, BLOCK_N, PAGED, HAS_LEFTPAD,
                MASKED or PREFETCH_TABLE, OFFS_64,
            )  # fmt: skip
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] = q @ kᵀ
        if KV_FP8 and WIDEN >= 2:
            qk = qk * q_descale  # (q's rows were quantized by these factors)
        s, _ = common.scores(
            qk, i[:, None], offs_n[None, :],
            seqlen_q, seqlen_k,
            1.0 if DEFER_SCALE else qk_scale, softcap_scale, softcap_log2, slope_log2,
            window_left, window_right,
            MASKED, HAS_SOFTCAP, HAS_ALIBI, MASK_LEFT, MASK_RIGHT,
        )  # fmt: skip
        p, m_i, l_i, acc = common.online_softmax(
            s, m_i, l_i, acc, qk_scale if DEFER_SCALE else 1.0, P8 if KV_FP8 and WIDEN == 3 else 0
        )
        if KV_FP8 and WIDEN == 3:
            p = common.to_e4m3(p, INTERPRET)
        acc = tl.dot(p.to(v.dtype), v, acc)  # [BLOCK_M, BLOCK_D] += p @ v
    return acc, l_i, m_i


# WIDEN 3: p (and the running sum) at 2**P8 times its value, so that small probabilities stay normal in e4m3
P8 = tl.constexpr(8)


@triton.jit
def _widened(x, dtype, WIDEN: tl.constexpr):
    """An e4m3 tile in a 16-bit dtype, exactly: ``dtype`` (WIDEN 0) or fp16 (1 and 2, one conversion
    instruction per two values; bf16 takes three more, through fp32)."""
    if WIDEN == 0:
        y = x.to(dtype)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit(noinline=True)
def _check_entry(
    Record, SeqlensK, LeftPad, BatchIdx, Table_row,
    b, hk, split, num_splits, nheads_k, seqlen_q,
    new_tokens, capacity, num_rows_cache, rot_len,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    ROTARY_Q: tl.constexpr, ROT_PER_TOKEN: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """The deferred checks of batch entry b's index values (``tileattn.errors``), made by its programs of
    the first row block: each checks the values it reads (``record.entry_error``; the rotary tables must
    cover q's positions and the new keys'), and the block-table entries covering the entry's keys are
    shared out among them, ``cdiv(entries, nheads_k * num_splits)`` each. The first bad value goes into
    the error record. Not inlined: a call after the entry's work leaves the key loop's register
    allocation as the plain build's."""
    span = tl.maximum(new_tokens, 1)
    if ROT_PER_TOKEN:
        span = tl.maximum(new_tokens, seqlen_q)
    code, j, value, bound, extra = record.entry_error(
        SeqlensK, LeftPad, BatchIdx, b,
        new_tokens, capacity, num_rows_cache, rot_len, span,
        HAS_LEFTPAD, HAS_BATCH_IDX and not PAGED, ROTARY_Q,
    )  # fmt: skip
    if PAGED:
        end = tl.minimum(tl.maximum(tl.load(SeqlensK + b).to(tl.int64) + new_tokens, 0), capacity)
        used = tl.cdiv(end, PAGE_SIZE).to(tl.int32)  # (table columns)
        share = tl.cdiv(used, nheads_k * num_splits)
        lo = (hk * num_splits + split) * share
        hi = tl.minimum(lo + share, used)
        col, page = record.first_bad_page(Table_row, lo, hi, num_rows_cache, 64)
        code, j, value, bound, extra = record.first_error(
            code, j, value, bound, extra, col < hi, record.BLOCK_TABLE, col, page, num_rows_cache, 0
        )
    record.record(Record, code, b, j, value, bound, extra, CHECK)


@triton.jit(do_not_specialize=["new_tokens"])
def _attn_fwd_kvcache(
    Q, K, V, Out, Lse,
    Alibi, SeqlensK, LeftPad, BatchIdx, Table, CuSeqlensQ, Cos, Sin, KDescale, VDescale, Record, Sink,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh,
    stride_ab, stride_tb, stride_rot,
    nheads_k, group_size, seqlen_q,
    capacity, num_rows_cache, new_tokens,
    rot_half, rot_len,
    sm_scale, softcap, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, OFFS_64: tl.constexpr, SAME_KV_STRIDES: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr, SPLIT: tl.constexpr, INTERLEAVE: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr, DEFER_SCALE: tl.constexpr,
    ROTARY_Q: tl.constexpr, ROT_INTERLEAVED: tl.constexpr, ROT_PER_TOKEN: tl.constexpr,
    TABLE_TO_L2: tl.constexpr, UNIT: tl.constexpr, WAIT_PRIOR: tl.constexpr, KV_FP8: tl.constexpr,
    WIDEN: tl.constexpr, CHECK: tl.constexpr, HAS_SINK: tl.constexpr = False, INTERPRET: tl.constexpr = False,
):  # fmt: skip
    """Program (row block, batch·kv head, split). Without SPLIT it writes the normalised output and
    LSE; with SPLIT, fp32 partials (LSE -inf for a split that saw no key) for ``_combine``, over a run
    of consecutive key tiles, or with INTERLEAVE over the tiles ``split``, ``split + num_splits``, ...
    (so that without leftpad or a left window its first tile does not depend on the sequence's length,
    and the table read ahead of the loop goes out with the length's read); UNIT > 1 (INTERLEAVE builds
    only) deals runs of UNIT consecutive tiles in turn instead of single tiles.

    ``stride_kb``/``stride_vb`` are the page strides when PAGED, the cache-row strides otherwise. A
    sequence's keys are ``[leftpad, SeqlensK[b] + new_tokens)`` of its cache row (the tokens just
    appended; not specialised on, so calls with and without an append share a build), masks aligned to
    the bottom-right corner. ``capacity`` bounds that end and ``num_rows_cache`` the pages / cache rows:
    out-of-range values are clamped so that the kernel never reads outside the cache (the API rejects
    them beforehand).

    ROTARY_Q: q is rotated as it is loaded, at position ``SeqlensK[b]`` (plus its token index with
    ROT_PER_TOKEN) of the ``(rot_len, rot_half)`` tables ``Cos`` / ``Sin`` (row stride ``stride_rot``),
    as the append rotates the new keys (in fp32, rounded once to q's dtype; here the compiler may fuse a
    multiply and an add, which it does not there); positions are clamped to the tables.

    WAIT_PRIOR: launched as a programmatic dependent of the kernel ahead (``DecodeSettings.pdl_attn``),
    which may still be writing any of the inputs: before ``griddepcontrol.wait`` only prefetches of the
    table's sectors go out (without leftpad, whose start is a load), no load. LAUNCH_DEPENDENTS lets
    the combine, launched as our dependent, start early (it waits for our writes).

    KV_FP8: the caches hold e4m3 values standing for ``x_fp8 * descale``, with fp32 ``(batch, nheads_k)``
    descales ``KDescale`` / ``VDescale`` (contiguous): k's multiplies the softmax scale, v's the output.
    Tiles are widened as WIDEN says (``_widened``; with 1, q is converted to fp16 too, saturated at
    fp16's ±65504, and p is fp16). With 2, only V is widened to fp16: each row of q is quantized to e4m3
    by its own factor (its largest magnitude / 448) and q·kᵀ runs on the FP8 tensor cores, the factor
    multiplying the row's scores. With 3, nothing is: as 2, and p is rounded to e4m3 at 2**P8 times its
    value for P·V (the sum carries the same factor, which the normalisation cancels).

    CHECK (a ``params.CALL_*``; 0: none): the call defers its index checks to the kernels, which write
    the first bad value into the error record ``Record`` (``_check_entry``, after the entry's work; the
    reads stay clamped as above).

    HAS_SINK: the attention sinks ``Sink`` (fp32, one logit per query head) join the denominator of each
    row's softmax (without SPLIT; with it ``_combine`` adds them)."""
    if LAUNCH_DEPENDENTS:  # the combine, launched as a dependent, may start (it waits for our writes)
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = bh // nheads_k
    hk = bh % nheads_k
    b64 = b.to(tl.int64)
    Table_row = Table + b64 * stride_tb
    table_pages = capacity // PAGE_SIZE  # (paged: the block table's width)
    EARLY_TABLE_TO_L2: tl.constexpr = WAIT_PRIOR and TABLE_TO_L2 and not HAS_LEFTPAD
    if WAIT_PRIOR:  # launched as a programmatic dependent: nothing is read before the kernel ahead ends
        if EARLY_TABLE_TO_L2:  # (a prefetch reads nothing: the table may still be written ahead of us)
            paging.table_to_l2(Table_row, table_pages, 0, split, num_splits, BLOCK_N, PAGE_SIZE, INTERLEAVE, UNIT)
        tl.extra.cuda.gdc_wait()
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + b)
        seqlen_q = tl.load(CuSeqlensQ + b + 1) - q_start
    else:
        q_start = 0
    n_rows = seqlen_q * group_size
    r_start = pid_m * BLOCK_M
    if r_start >= n_rows:
        if CHECK != 0 and pid_m == 0:  # (a packed sequence without query tokens)
            _check_entry(
                Record, SeqlensK, LeftPad, BatchIdx, Table_row,
                b, hk, split, num_splits, nheads_k, seqlen_q,
                new_tokens, capacity, num_rows_cache, rot_len,
                PAGE_SIZE, PAGED, HAS_LEFTPAD, HAS_BATCH_IDX, ROTARY_Q, ROT_PER_TOKEN, CHECK,
            )  # fmt: skip
        return

    cached = tl.load(SeqlensK + b)
    k_end = tl.minimum(tl.maximum(cached + new_tokens, 0), capacity)
    k_start = 0
    if HAS_LEFTPAD:
        k_start = tl.minimum(tl.maximum(tl.load(LeftPad + b), 0), k_end)
    seqlen_k = k_end - k_start
    if SAME_KV_STRIDES:  # (one set of row offsets serves both caches)
        stride_vb = stride_kb
        stride_vn = stride_kn
        stride_vh = stride_kh
    if PAGED:
        K_base = K + hk.to(tl.int64) * stride_kh
        V_base = V + hk.to(tl.int64) * stride_vh
    else:
        row = b64
        if HAS_BATCH_IDX:
            row = tl.minimum(tl.maximum(tl.load(BatchIdx + b), 0), num_rows_cache - 1).to(tl.int64)
        K_base = K + row * stride_kb + hk.to(tl.int64) * stride_kh
        V_base = V + row * stride_vb + hk.to(tl.int64) * stride_vh
    k_desc = K_base
    v_desc = V_base
    if USE_TMA and PAGED:  # every page's rows of this kv head, as one [num_pages · PAGE_SIZE, d] array
        k_desc = tl.make_tensor_descriptor(
            K_base, [num_rows_cache * PAGE_SIZE, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D]
        )
        v_desc = tl.make_tensor_descriptor(
            V_base, [num_rows_cache * PAGE_SIZE, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D]
        )
    elif USE_TMA:  # the keys of this sequence and kv head: rows [k_start, k_end) of its cache row
        k_desc = common.rows_desc(K_base + k_start * stride_kn, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, True)
        v_desc = common.rows_desc(V_base + k_start * stride_vn, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, True)
    if TABLE_TO_L2 and not EARLY_TABLE_TO_L2:  # the table entries this program will read, into L2 first
        paging.table_to_l2(Table_row, table_pages, k_start, split, num_splits, BLOCK_N, PAGE_SIZE, INTERLEAVE, UNIT)

    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_r = r_start + tl.arange(0, BLOCK_M)
    mask_r = offs_r < n_rows
    i = offs_r // group_size  # token
    h = hk * group_size + offs_r % group_size  # query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_q = b64 * stride_qb + (q_start + i).to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    mask_q = mask_r[:, None]
    if PAD_D:
        mask_q = mask_q & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + row_q[:, None] + offs_d[None, :], mask=mask_q, other=0.0)  # [BLOCK_M, BLOCK_D]
    if ROTARY_Q:
        pos = cached  # (a scalar: the same position for every row)
        if ROT_PER_TOKEN:
            pos = (cached + i)[:, None]  # [BLOCK_M, 1]
        q = rotary.rotated(
            q, Q + row_q[:, None], Cos, Sin,
            pos, rot_len, stride_rot,
            offs_d, rot_half, mask_r[:, None],
            ROT_INTERLEAVED,
        ).to(q.dtype)  # fmt: skip

    v_descale = 1.0
    q_descale = 1.0
    if KV_FP8:
        sm_scale = sm_scale * tl.load(KDescale + bh)  # (bh = b * nheads_k + hk)
        v_descale = tl.load(VDescale + bh)
        if WIDEN == 1:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        if WIDEN >= 2:  # each row to e4m3 by its own factor, amax / 448 (1 for a row of zeros)
            q32 = q.to(tl.float32)
            amax = tl.max(tl.abs(q32), axis=1)
            q_descale = tl.where(amax > 0.0, amax / 448.0, 1.0)[:, None]  # [BLOCK_M, 1]
            q = common.to_e4m3(q32 / q_descale, INTERPRET)
    qk_scale = sm_scale * common.LOG2E  # scores in the log2 domain: exp2 in the softmax
    softcap_scale = 0.0
    softcap_log2 = 0.0
    if HAS_SOFTCAP:
        softcap_scale = sm_scale / softcap
        softcap_log2 = softcap * common.LOG2E
    slope_log2 = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if HAS_ALIBI:
        slope_log2 = (tl.load(Alibi + b * stride_ab + h, mask=mask_r, other=0.0) * common.LOG2E)[:, None]

    # Key tiles of this block's tokens, then this split's share of them (whole tiles): with INTERLEAVE
    # the tiles t with t mod num_splits = split, else a run of consecutive tiles.
    m_first = r_start // group_size
    m_last = (tl.minimum(r_start + BLOCK_M, n_rows) - 1) // group_size
    lo, full_lo, full_hi, hi = common.key_bounds(
        m_first, m_last, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N, MASK_LEFT, MASK_RIGHT
    )
    if INTERLEAVE:
        step = num_splits * BLOCK_N
        if UNIT > 1:
            step = 1  # (the loop counts tiles: _kv_tiles)
        s_lo = lo
        s_hi = hi
    else:
        step = BLOCK_N
        per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
        s_lo = tl.minimum(lo + split * per_split, hi)
        s_hi = tl.minimum(s_lo + per_split, hi)
        full_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), s_hi)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for seg in tl.static_range(3):  # masked left edge, unmasked middle, masked right edge
        a, z = common.segment(seg, s_lo, full_lo, full_hi, s_hi)
        unit_lo = a
        unit_r0 = 0
        unit_gap = 0
        if UNIT > 1:  # runs of UNIT tiles in turn: loop over this split's count of tiles
            ta = tl.cdiv(a, BLOCK_N)  # (a segment's start is a tile's unless it is empty, clamped to hi)
            t0 = ta // (UNIT * num_splits) * (UNIT * num_splits) + split * UNIT  # its run in ta's cycle
            t0 = tl.where(ta >= t0 + UNIT, t0 + UNIT * num_splits, tl.maximum(t0, ta))
            unit_lo = t0 * BLOCK_N
            unit_r0 = t0 % UNIT
            unit_gap = (num_splits - 1) * UNIT
            z = paging.unit_share(tl.cdiv(z, BLOCK_N), split, num_splits, UNIT)
            z -= paging.unit_share(ta, split, num_splits, UNIT)
            a = 0
        elif INTERLEAVE:  # tile t of any segment is split (t mod num_splits)'s (t counted from column 0)
            a += (split + num_splits - a // BLOCK_N % num_splits) % num_splits * BLOCK_N
        acc, l_i, m_i = _kv_tiles(
            acc, l_i, m_i, q, q_descale,
            K_base, V_base, k_desc, v_desc, Table_row,
            stride_kn, stride_vn, stride_kb, stride_vb,
            k_start, num_rows_cache, i, offs_n, offs_d,
            a, z, step,
            unit_lo, unit_r0, unit_gap,
            table_pages, seqlen_q, seqlen_k,
            qk_scale, softcap_scale, softcap_log2, slope_log2,
            window_left, window_right,
            HEAD_DIM, PAD_D, BLOCK_N, PAGE_SIZE,
            PAGED, OFFS_64, HAS_LEFTPAD,
            PREFETCH_TABLE, USE_TMA, seg != 1,
            HAS_SOFTCAP, HAS_ALIBI, MASK_LEFT, MASK_RIGHT,
            DEFER_SCALE, UNIT, KV_FP8, WIDEN, INTERPRET,
        )  # fmt: skip

    alpha = 1.0  # (the accumulator's rescale for a sink, folded into the normalisation below)
    P_LOG2: tl.constexpr = P8 if KV_FP8 and WIDEN == 3 else 0  # (the sum's factor, 2**P_LOG2)
    if HAS_SINK and not SPLIT:  # (with splits the combine adds the sinks, once)
        m_i, l_i, alpha = common.add_sink(m_i, l_i, Sink + h, P_LOG2)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    if KV_FP8:
        acc = acc * (alpha * v_descale / l_safe)[:, None]
    elif HAS_SINK and not SPLIT:
        acc = acc * (alpha / l_safe)[:, None]
    else:
        acc = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe) - P_LOG2) * common.LN2  # (natural log)
    if SPLIT:
        lse = tl.where(seen, lse, float("-inf"))
    else:
        lse = tl.where(seen, lse, float("inf"))
    split64 = split.to(tl.int64)
    lse_ptrs = Lse + split64 * stride_ls + b64 * stride_lb + h * stride_lh + q_start + i
    tl.store(lse_ptrs, lse, mask=mask_r)
    row_o = split64 * stride_os + b64 * stride_ob + (q_start + i).to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
    tl.store(Out + row_o[:, None] + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=mask_q)
    if CHECK != 0 and pid_m == 0:
        _check_entry(
            Record, SeqlensK, LeftPad, BatchIdx, Table_row,
            b, hk, split, num_splits, nheads_k, seqlen_q,
            new_tokens, capacity, num_rows_cache, rot_len,
            PAGE_SIZE, PAGED, HAS_LEFTPAD, HAS_BATCH_IDX, ROTARY_Q, ROT_PER_TOKEN, CHECK,
        )  # fmt: skip


LAUNCHER = Launcher(_attn_fwd_kvcache)
