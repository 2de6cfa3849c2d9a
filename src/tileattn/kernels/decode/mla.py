"""Multi-head latent attention (MLA) decoding against a paged latent cache, FlashMLA's schedule.

Every query head of a kv head reads the same cache rows of ``D_V + D_ROPE`` values (DeepSeek: a
512-wide latent and 64 rotary dims); the values are the rows' first ``D_V`` dims, so one load of a key
tile serves both matmuls. ``_mla_fwd`` computes one block of packed query rows (row r: token
``r // group`` of query head ``hk * group + r % group``) over the work of one *part* of the schedule
(``tileattn.mla.get_mla_metadata``): a run of 64-key blocks that starts in one sequence and may end in a later one.
A sequence done by one part is written whole; the others leave fp32 partials in their split's slot
(``SplitOffsets[b] + split``), which ``combine._combine`` merges (``VAR_SPLITS``). The latent is
split into chunks of at most 256 dims (two accumulators of ``[BLOCK_M, 256]`` for DeepSeek's 512), so
that every tile shape is a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileattn import params
from tileattn.kernels import common
from tileattn.kernels.decode import combine, paging, plan, record
from tileattn.kernels.launch import Launcher
from tileattn.params import Settings, cdiv, next_power_of_2


@triton.jit
def _mla_tiles(
    acc_a, acc_b, l_i, m_i, q_a, q_b, q_e, Q_b, mask_q,
    KV_base, Table_row, offs_n_base, offs_c, offs_e,
    lo, hi, k_end, causal_end, i,
    table_pages, num_pages, stride_kn, stride_kp, qk_scale,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, CHUNK_V: tl.constexpr, TWO_CHUNKS: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    OFFS_64: tl.constexpr, Q_IN_LOOP: tl.constexpr,
):  # fmt: skip
    """Online softmax over the key tiles at lo, lo + BLOCK_N, ... below hi. MASKED tiles hide the keys
    at ``k_end`` and past (the part's end), and with CAUSAL those past row token i's last key,
    ``causal_end + i``; their rows past ``k_end`` are not read. With Q_IN_LOOP the query tiles are
    loaded again for every key tile (from ``Q_b + ...`` under ``mask_q``), not kept in registers."""
    for start_n in range(lo, hi, BLOCK_N):
        if Q_IN_LOOP:
            q_a, q_b, q_e = _q_tiles(Q_b, mask_q, offs_c, offs_e, D_V, D_ROPE, CHUNK_V, TWO_CHUNKS)
        K_tile, rows, _, _ = paging.cache_rows(
            KV_base, KV_base, Table_row,
            offs_n_base, 0, start_n,
            table_pages, num_pages,
            stride_kn, stride_kn, stride_kp, stride_kp,
            PAGE_SIZE, BLOCK_N, True, False, MASKED, OFFS_64,
        )  # fmt: skip
        offs_n = start_n + offs_n_base
        ptrs = K_tile + rows[:, None]
        if MASKED:
            row_ok = (offs_n < k_end)[:, None]
            k_a = tl.load(ptrs + offs_c[None, :], mask=row_ok, other=0.0)  # [BLOCK_N, CHUNK_V]
            if TWO_CHUNKS:
                k_b = tl.load(ptrs + CHUNK_V + offs_c[None, :], mask=row_ok, other=0.0)
            if D_ROPE > 0:
                k_e = tl.load(ptrs + D_V + offs_e[None, :], mask=row_ok & (offs_e[None, :] < D_ROPE), other=0.0)
        else:
            k_a = tl.load(ptrs + offs_c[None, :])
            if TWO_CHUNKS:
                k_b = tl.load(ptrs + CHUNK_V + offs_c[None, :])
            if D_ROPE > 0:
                k_e = tl.load(ptrs + D_V + offs_e[None, :], mask=offs_e[None, :] < D_ROPE, other=0.0)
        qk = tl.dot(q_a, tl.trans(k_a))  # [BLOCK_M, BLOCK_N]
        if TWO_CHUNKS:
            qk = tl.dot(q_b, tl.trans(k_b), qk)
        if D_ROPE > 0:
            qk = tl.dot(q_e, tl.trans(k_e), qk)
        s = qk * qk_scale  # (log2 domain)
        if MASKED:
            seen = offs_n[None, :] < k_end
            if CAUSAL:
                seen = seen & (offs_n[None, :] < causal_end + i[:, None])
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p = p.to(k_a.dtype)
        acc_a = tl.dot(p, k_a, acc_a * alpha[:, None])  # the values: the latent's first D_V dims
        if TWO_CHUNKS:
            acc_b = tl.dot(p, k_b, acc_b * alpha[:, None])
    return acc_a, acc_b, l_i, m_i


@triton.jit
def _q_tiles(
    Q_b,
    mask_q,
    offs_c,
    offs_e,
    D_V: tl.constexpr,
    D_ROPE: tl.constexpr,
    CHUNK_V: tl.constexpr,
    TWO_CHUNKS: tl.constexpr,
):
    """The query rows at ``Q_b`` (row pointers ``[BLOCK_M, 1]``): the values' dims in one or two chunks,
    then the rest (zero-padded)."""
    q_a = tl.load(Q_b + offs_c[None, :], mask=mask_q, other=0.0)  # [BLOCK_M, CHUNK_V]
    q_b = q_a
    if TWO_CHUNKS:
        q_b = tl.load(Q_b + CHUNK_V + offs_c[None, :], mask=mask_q, other=0.0)
    q_e = tl.load(Q_b + D_V + offs_e[None, :], mask=mask_q & (offs_e[None, :] < D_ROPE), other=0.0)
    return q_a, q_b, q_e


@triton.jit
def _part_keys(Seqlens, b, begin_idx, end_idx, begin_seq, end_seq, capacity, BLOCK_N: tl.constexpr):
    """``(seqlen_k, lo, k_end)``: sequence b's length (clamped to the capacity) and the keys ``[lo,
    k_end)`` of it that the part ``begin_idx, begin_seq ... end_idx, end_seq`` takes, in whole tiles."""
    seqlen_k = tl.minimum(tl.maximum(tl.load(Seqlens + b), 0), capacity)
    k_end = seqlen_k
    if b == end_idx:
        k_end = tl.minimum(tl.maximum(end_seq, 0), seqlen_k)
        # a split point (not the sequence's end) rounds down to a whole tile, as the next part's start
        # does below: the parts of a sequence then share no key whatever the schedule's block
        k_end = tl.where(k_end < seqlen_k, k_end // BLOCK_N * BLOCK_N, k_end)
    lo = 0
    if b == begin_idx:  # (whole tiles from the part's first block)
        lo = tl.minimum(tl.maximum(begin_seq, 0), k_end) // BLOCK_N * BLOCK_N
    return seqlen_k, lo, k_end


@triton.jit(noinline=True)
def _check_part(
    Record, Seqlens, Table, stride_tb,
    begin_idx, end_idx, begin_seq, end_seq, capacity, num_pages,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """The deferred checks (``tileattn.errors``) of the sequences a part takes: each length below 0 or
    past the capacity, and the block-table entries covering the part's keys of it (the parts of a
    schedule made for the lengths cover every key), the first bad value into the error record."""
    for b in range(begin_idx, end_idx + 1):
        _, lo, k_end = _part_keys(Seqlens, b, begin_idx, end_idx, begin_seq, end_seq, capacity, BLOCK_N)
        code, j, value, bound, extra = record.entry_error(
            Seqlens, Seqlens, Seqlens, b, 0, capacity, num_pages, 0, 0, False, False, False
        )
        col_hi = tl.cdiv(k_end, PAGE_SIZE)
        col, page = record.first_bad_page(
            Table + tl.cast(b, tl.int64) * stride_tb, lo // PAGE_SIZE, col_hi, num_pages, 64
        )
        code, j, value, bound, extra = record.first_error(
            code, j, value, bound, extra, col < col_hi, record.BLOCK_TABLE, col, page, num_pages, 0
        )
        record.record(Record, code, b, j, value, bound, extra, CHECK)


@triton.jit
def _mla_fwd(
    Q, KV, Out, Lse, OutP, LseP, Table, Seqlens, Meta, SplitOffsets, Record,
    stride_qb, stride_qm, stride_qh,
    stride_kp, stride_kn, stride_kh,
    stride_tb, stride_meta,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_ps, stride_pls,
    batch, group, seqlen_q, num_pages, table_pages, num_slots,
    qk_scale,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, CHUNK_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, OFFS_64: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, Q_IN_LOOP: tl.constexpr,
    CHECK: tl.constexpr,
):  # fmt: skip
    """Program (row block, kv head, part). The part's row of ``Meta`` (int32, FlashMLA's layout) says
    its work: sequences ``begin_idx ... end_idx``, keys from ``begin_seqlen`` in the first and up to
    ``end_seqlen`` in the last, and ``begin_split``, which split of the first sequence it is. Sequence
    b's keys are ``[0, Seqlens[b])`` through its row of the block table; with CAUSAL token i of
    ``seqlen_q`` sees the keys below ``Seqlens[b] - seqlen_q + 1 + i``.

    Out ``(batch, seqlen_q, nheads, D_V)``, Lse ``(batch, nheads, seqlen_q)`` (natural log; +inf for a
    row that sees no key). Partials: slot j of OutP at ``j * stride_ps`` as ``(seqlen_q, nheads, D_V)``
    contiguous, of LseP at ``j * stride_pls`` as ``(nheads, seqlen_q)`` (-inf where no key was seen).

    Every index read from the metadata, the lengths and the table is clamped (sequences to the batch,
    lengths to the table's capacity, pages to the pool, slots to ``num_slots``): bad values give wrong
    results, never a read or write outside the tensors. LAUNCH_DEPENDENTS lets the combine, launched as
    a programmatic dependent, start early (it waits for our writes).

    CHECK (``params.CALL_MLA``; 0: none): the call defers its index checks to the kernel. The programs of
    the first row block and kv head write the first bad value they read into the error record
    ``Record`` (``_check_part``, after their work and not inlined: this kernel spills at 255 registers,
    and the checks' code inlined made the key loop's spills worse)."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    hk = tl.program_id(1)
    part = tl.program_id(2)
    nheads_k = tl.num_programs(1)
    nheads = nheads_k * group
    n_rows = seqlen_q * group
    meta = Meta + part * stride_meta
    begin_idx = tl.maximum(tl.load(meta), 0)
    begin_seq = tl.load(meta + 1)
    end_idx = tl.minimum(tl.load(meta + 2), batch - 1)
    end_seq = tl.load(meta + 3)
    begin_split = tl.load(meta + 4)
    capacity = table_pages * PAGE_SIZE

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_r = offs_r < n_rows
    i = offs_r // group  # token
    h = hk * group + offs_r % group  # query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CHUNK_V)
    offs_e = tl.arange(0, ROPE_PAD)
    TWO_CHUNKS: tl.constexpr = D_V > CHUNK_V
    KV_base = KV + hk.to(tl.int64) * stride_kh
    m_first = pid_m * BLOCK_M // group
    m_last = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // group
    row_q = i.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    row_o = i.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
    row_p = (i * nheads + h).to(tl.int64) * D_V  # a partial slot's rows: (token, head) contiguous
    for b in range(begin_idx, end_idx + 1):
        b64 = tl.cast(b, tl.int64)
        seqlen_k, lo, k_end = _part_keys(Seqlens, b, begin_idx, end_idx, begin_seq, end_seq, capacity, BLOCK_N)
        causal_end = seqlen_k - seqlen_q + 1  # token i sees keys below causal_end + i
        hi = k_end
        full_hi = k_end
        if CAUSAL:
            hi = tl.minimum(hi, tl.maximum(causal_end + m_last, 0))
            full_hi = tl.minimum(full_hi, tl.maximum(causal_end + m_first, 0))
        full_hi = tl.maximum(lo + (full_hi - lo) // BLOCK_N * BLOCK_N, lo)  # whole unmasked tiles
        hi = tl.maximum(hi, full_hi)

        Table_row = Table + b64 * stride_tb
        Q_b = Q + b64 * stride_qb + row_q[:, None]
        q_a, q_b, q_e = _q_tiles(Q_b, mask_r[:, None], offs_c, offs_e, D_V, D_ROPE, CHUNK_V, TWO_CHUNKS)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_a = tl.zeros([BLOCK_M, CHUNK_V], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, CHUNK_V], dtype=tl.float32)
        for seg in tl.static_range(2):  # whole unmasked tiles, then the masked edge
            a, z = common.segment(seg + 1, lo, lo, full_hi, hi)
            acc_a, acc_b, l_i, m_i = _mla_tiles(
                acc_a, acc_b, l_i, m_i, q_a, q_b, q_e, Q_b, mask_r[:, None],
                KV_base, Table_row, offs_n, offs_c, offs_e,
                a, z, k_end, causal_end, i,
                table_pages, num_pages, stride_kn, stride_kp, qk_scale,
                D_V, D_ROPE, CHUNK_V, TWO_CHUNKS, BLOCK_N, PAGE_SIZE, seg == 1, CAUSAL, OFFS_64, Q_IN_LOOP,
            )  # fmt: skip

        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        acc_a = acc_a / l_safe[:, None]
        acc_b = acc_b / l_safe[:, None]
        lse = (m_i + tl.log2(l_safe)) * common.LN2  # (natural log)
        first = tl.load(SplitOffsets + b)
        if tl.load(SplitOffsets + b + 1) - first <= 1:  # the sequence is this part's alone: the output
            O_b = Out + b64 * stride_ob + row_o[:, None]
            tl.store(O_b + offs_c[None, :], acc_a.to(Out.dtype.element_ty), mask=mask_r[:, None])
            if TWO_CHUNKS:
                tl.store(O_b + CHUNK_V + offs_c[None, :], acc_b.to(Out.dtype.element_ty), mask=mask_r[:, None])
            lse = tl.where(seen, lse, float("inf"))
            tl.store(Lse + b64 * stride_lb + h * stride_lh + i, lse, mask=mask_r)
        else:  # a split: fp32 partials in its slot, for the combine
            slot = first
            if b == begin_idx:
                slot += begin_split
            slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1).to(tl.int64)
            P_b = OutP + slot * stride_ps + row_p[:, None]
            tl.store(P_b + offs_c[None, :], acc_a, mask=mask_r[:, None])
            if TWO_CHUNKS:
                tl.store(P_b + CHUNK_V + offs_c[None, :], acc_b, mask=mask_r[:, None])
            lse = tl.where(seen, lse, float("-inf"))
            tl.store(LseP + slot * stride_pls + h * seqlen_q + i, lse, mask=mask_r)
    if CHECK != 0:  # (after the work, a call of its own: the key loop's registers stay as they are)
        if (pid_m == 0) & (hk == 0):
            _check_part(
                Record, Seqlens, Table, stride_tb,
                begin_idx, end_idx, begin_seq, end_seq, capacity, num_pages,
                BLOCK_N, PAGE_SIZE, CHECK,
            )  # fmt: skip


LAUNCHER = Launcher(_mla_fwd)


@triton.jit
def _check_parts(
    Record, Seqlens, Table, Meta, stride_tb, stride_meta, batch, num_pages, capacity,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """Program ``part``: ``_check_part`` of one part of the schedule, for the kernels that leave the checks
    out (the Gluon build, ``kernels.gluon.mla``), its indices clamped as ``_mla_fwd``'s."""
    meta = Meta + tl.program_id(0) * stride_meta
    _check_part(
        Record, Seqlens, Table, stride_tb,
        tl.maximum(tl.load(meta), 0), tl.minimum(tl.load(meta + 2), batch - 1), tl.load(meta + 1),
        tl.load(meta + 3), capacity, num_pages, BLOCK_N, PAGE_SIZE, CHECK,
    )  # fmt: skip


CHECKS = Launcher(_check_parts)


def _gluon_call(q: torch.Tensor, kv: torch.Tensor, head_dim_v: int, block_m: int, m: params.MLASettings) -> bool:
    """Whether this call's programs run the Gluon build (``MLASettings.gluon``: those of 64 rows;
    ``gluon_narrow``: those of fewer too, padded), on sm90 with the Gluon this Triton has, for the geometry
    ``kernels.gluon.mla.eligible`` takes."""
    if not (m.gluon and m.block_n == 64 and (block_m == 64 or m.gluon_narrow)):  # (its key tiles: pages of 64)
        return False
    from tileattn.kernels import gluon

    if not (q.is_cuda and gluon.available()):
        return False
    from tileattn.kernels.gluon import common
    from tileattn.kernels.gluon import mla as gluon_mla

    return common._sm90(q.device.index) and gluon_mla.eligible(q, kv, head_dim_v)


def _launch_portable(
    q, kv, out, lse, out_p, lse_p, block_table, seqlens, metadata, num_splits, head_dim_v, softmax_scale, causal,
    s, record, bm, pdl,
):  # fmt: skip
    """``_mla_fwd`` over the call's programs (``mla_fwd``'s arguments, its outputs and partials)."""
    m = s.mla
    batch, seqlen_q, nheads, d = q.shape
    num_pages, page_size, nheads_k, _ = kv.shape
    num_parts = metadata.shape[0]
    per_slot = seqlen_q * nheads
    LAUNCHER(
        (cdiv(seqlen_q * nheads // nheads_k, bm), nheads_k, num_parts),
        (
            q,
            kv,
            out,
            lse,
            out_p,
            lse_p,
            block_table,
            seqlens,
            metadata,
            num_splits,
            record if record is not None else seqlens,
            *q.stride()[:3],
            kv.stride(0),
            kv.stride(1),
            kv.stride(2),
            block_table.stride(0),
            metadata.stride(0),
            *out.stride()[:3],
            *lse.stride()[:2],
            per_slot * head_dim_v,
            per_slot,
            batch,
            nheads // nheads_k,
            seqlen_q,
            num_pages,
            block_table.shape[1],
            batch + num_parts,
            softmax_scale * common.LOG2E,
        ),  # fmt: skip
        {
            "D_V": head_dim_v,
            "D_ROPE": d - head_dim_v,
            "ROPE_PAD": max(16, next_power_of_2(d - head_dim_v)),
            "CHUNK_V": min(head_dim_v, 256),
            "BLOCK_M": bm,
            "BLOCK_N": m.block_n,
            "PAGE_SIZE": page_size,
            "CAUSAL": causal,
            "OFFS_64": paging.offsets_past_int32(kv, True),
            "LAUNCH_DEPENDENTS": pdl,
            "Q_IN_LOOP": m.q_in_loop,
            "CHECK": params.CALL_MLA if record is not None else 0,
        },
        num_warps=m.wide_warps if bm >= 64 else m.narrow_warps,
        num_stages=m.stages,
    )


def mla_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    metadata: torch.Tensor,
    num_splits: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    s: Settings,
    record: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decoding (arguments validated by ``tileattn.mla``): q ``(batch, seqlen_q, nheads, d)``, kv the
    paged cache ``(num_pages, page_size, nheads_k, d)`` whose first ``head_dim_v`` dims are the values,
    ``metadata`` and ``num_splits`` the schedule (``tileattn.mla.get_mla_metadata``). Returns out ``(batch, seqlen_q, nheads, head_dim_v)`` in q's dtype and
    the LSE fp32 ``(batch, nheads, seqlen_q)``. ``record``: the error record into which the kernel
    writes a bad length or block-table entry (``CacheLayout.record``), or None: no checks."""
    m = s.mla
    batch, seqlen_q, nheads, d = q.shape
    num_pages, page_size, nheads_k, _ = kv.shape
    bm = m.rows_per_program(seqlen_q * nheads // nheads_k)
    block_n = m.block_n
    num_parts = metadata.shape[0]
    num_slots = batch + num_parts
    out = torch.empty((batch, seqlen_q, nheads, head_dim_v), device=q.device, dtype=q.dtype)
    lse = torch.empty((batch, nheads, seqlen_q), device=q.device, dtype=torch.float32)
    per_slot = seqlen_q * nheads
    # the partial LSEs, then (16-byte aligned) the partial outputs: one allocation
    at = cdiv(num_slots * per_slot, 4) * 4
    partials = torch.empty(at + num_slots * per_slot * head_dim_v, device=q.device, dtype=torch.float32)
    lse_p, out_p = partials[:at], partials[at:]
    pdl = s.decode.pdl and plan.device_has_pdl(q.device)
    if _gluon_call(q, kv, head_dim_v, bm, m):
        from tileattn.kernels.gluon import mla as gluon_mla

        if record is not None:  # (the deferred index checks, which the Gluon kernel leaves out)
            CHECKS(
                (num_parts, 1, 1),
                (record, seqlens, block_table, metadata, block_table.stride(0), metadata.stride(0))
                + (batch, num_pages, block_table.shape[1] * page_size),
                {"BLOCK_N": block_n, "PAGE_SIZE": page_size, "CHECK": params.CALL_MLA},
            )
        gluon_mla.mla_fwd_gluon(
            q, kv, out, lse, out_p, lse_p, block_table, seqlens, metadata, num_splits,
            softmax_scale * common.LOG2E, causal, m.gluon_stages,
        )  # fmt: skip
        pdl = False  # (the Gluon kernel does not launch its dependents early)
    else:
        _launch_portable(q, kv, out, lse, out_p, lse_p, block_table, seqlens, metadata, num_splits, head_dim_v,
                         softmax_scale, causal, s, record, bm, pdl)  # fmt: skip
    n_rows = out.numel() // head_dim_v
    block_r, chunk_s = combine.combine_tiles(num_parts + 1, head_dim_v, s.decode)
    combine.LAUNCHER(
        (cdiv(n_rows, block_r), 1, 1),
        (out_p, lse_p, out, lse, num_splits, lse, lse, lse)
        + (per_slot * head_dim_v, per_slot, n_rows, nheads, seqlen_q, num_parts + 1),
        {
            "HEAD_DIM": head_dim_v,
            "BLOCK_D": head_dim_v,
            "BLOCK_R": block_r,
            "SPLITS_PAD": max(2, next_power_of_2(num_parts + 1)),
            "CHUNK": chunk_s,
            "USE_PDL": pdl,
            "VAR_SPLITS": True,
            "MIRROR": False,  # (ops.mla copies the record after the call)
            "HAS_SINK": False,
        },
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out, lse
