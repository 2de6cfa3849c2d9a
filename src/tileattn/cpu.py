"""The PyTorch path for CPU tensors: the same features as the kernels, blockwise.

Queries are processed in blocks of rows and keys in blocks of columns with an online softmax, so no
N×N matrix exists (peak extra memory is one ``(batch, nheads, BLOCK_M, BLOCK_N)`` score block). Key
blocks that a row block cannot see are skipped. The backward pass recomputes the probabilities from the
saved LSE. Computation is in fp32 (fp16/bf16 inputs are upcast block by block). The mask and bias
definitions are those of ``tileattn.reference``; dropout uses ``tileattn.rng``, so the mask is the
one the GPU kernels draw for the same seed.

Same launcher interface as the Triton kernels: ``attn_fwd(q, k, v, p, s)``,
``attn_bwd(dout, q, k, v, out, lse, p, s)`` (returning dq, dk, dv and the sinks' gradient or None), ``attn_fwd_kvcache(q, k_cache, v_cache, p, c, s)`` and
``kvcache_append``, with ``p`` a ``params.AttnParams``, ``c`` a ``params.CacheLayout`` and ``s`` the
kernels' ``params.Settings`` (which this path has no use for).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from tileattn import flashmask, reference, rng
from tileattn.params import AttnParams, CacheLayout, Settings
from tileattn.rotary_torch import rotary_at

BLOCK_M = 128
BLOCK_N = 256
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _sequences(p: AttnParams, total_q: int, total_k: int):
    """Yields (b, q rows slice, k rows slice) of each sequence: one per batch entry in dense mode (rows
    index the seqlen dim), the cu_seqlens spans in varlen mode (rows index the token dim)."""
    if not p.is_varlen:
        for b in range(p.batch):
            yield b, slice(0, total_q), slice(0, total_k)
        return
    cu_q = p.cu_seqlens_q.tolist()
    cu_k = p.cu_seqlens_k.tolist()
    for b in range(p.batch):
        yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def _seq(t: torch.Tensor, p: AttnParams, b: int, rows: slice) -> torch.Tensor:
    """One sequence as ``(nheads, seqlen, d)``."""
    t = t[rows] if p.is_varlen else t[b, rows]
    return t.transpose(0, 1)


def _lse_seq(lse: torch.Tensor, p: AttnParams, b: int, rows: slice) -> torch.Tensor:
    """One sequence's LSE as ``(nheads, seqlen)``: a row of the dense ``(batch, nheads, seqlen)`` buffer or
    a column span of the varlen ``(nheads, total)`` one."""
    return lse[:, rows] if p.is_varlen else lse[b]


def _key_token(p: AttnParams, b: int, rows_k: slice) -> int:
    """The first key token of sequence ``b`` in the FlashMask bounds' token axis (``params.FlashMask``)."""
    return rows_k.start if p.is_varlen else b * p.seqlen_k


def _key_span(m0: int, m1: int, seqlen_q: int, seqlen_k: int, p: AttnParams) -> tuple[int, int]:
    """Columns [lo, hi) that rows [m0, m1) can see at all; blocks outside are skipped."""
    diag = seqlen_k - seqlen_q
    lo = max(0, m0 + diag - p.window_left) if p.window_left >= 0 else 0
    hi = min(seqlen_k, m1 - 1 + diag + p.window_right + 1) if p.window_right >= 0 else seqlen_k
    return lo, max(lo, hi)


class _Scores:
    """Score blocks of one sequence: scale, softcap, ALiBi, mask and dropout, for rows [m0, m1) of all
    query heads against columns [n0, n1). Query heads are grouped as (nheads_k, group) for GQA."""

    def __init__(
        self, p: AttnParams, b: int, nheads: int, seqlen_q: int, seqlen_k: int, device: torch.device, k_token: int = 0
    ):
        self.p, self.b, self.nheads = p, b, nheads
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.window = (p.window_left, p.window_right)
        self.slopes = None
        if p.alibi_slopes is not None:
            slopes = p.alibi_slopes if p.alibi_slopes.dim() == 1 else p.alibi_slopes[b]
            self.slopes = slopes.to(device=device, dtype=torch.float32).view(nheads, 1, 1)
        self.heads = torch.arange(nheads, device=device).view(nheads, 1, 1)
        self.bounds = None  # the sequence's FlashMask bounds (nheads_mask, 4, seqlen_k), from its first key token
        if p.flashmask is not None:
            self.bounds = p.flashmask.bounds[:, :, k_token : k_token + seqlen_k].to(device)

    def hidden(self, m0: int, m1: int, n0: int, n1: int) -> torch.Tensor:
        """True where rows [m0, m1) must not see columns [n0, n1): ``(1 or nheads, m1 - m0, n1 - n0)``."""
        i = torch.arange(m0, m1, device=self.heads.device).view(1, -1, 1)
        j = torch.arange(n0, n1, device=self.heads.device).view(1, 1, -1)
        masked = ~reference.local_mask(i, j, self.seqlen_q, self.seqlen_k, self.window)
        if self.bounds is not None:
            masked = masked | flashmask.hidden(self.bounds[:, :, n0:n1], i.view(-1, 1))
        return masked

    def skipped(self, m0: int, m1: int, n0: int, n1: int) -> bool:
        """Whether no row of [m0, m1) sees any column of [n0, n1) under a FlashMask (the block is skipped)."""
        return self.bounds is not None and bool(self.hidden(m0, m1, n0, n1).all())

    def __call__(self, qk: torch.Tensor, m0: int, n0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """qk: raw products ``(nheads, bm, bn)``. Returns (scores with -inf where hidden, tanh of the
        softcap or None, keep-mask of dropout or None)."""
        p = self.p
        bm, bn = qk.shape[-2:]
        i = torch.arange(m0, m0 + bm, device=qk.device).view(1, bm, 1)
        j = torch.arange(n0, n0 + bn, device=qk.device).view(1, 1, bn)
        t = None
        if p.softcap > 0:
            t = torch.tanh(qk * (p.softmax_scale / p.softcap))
            s = t * p.softcap
        else:
            s = qk * p.softmax_scale
        if self.slopes is not None:
            s = s + reference.alibi_bias(self.slopes, i, j, self.seqlen_q, self.seqlen_k)
        s = s.masked_fill(self.hidden(m0, m0 + bm, n0, n0 + bn), float("-inf"))
        keep = None
        if p.dropout_p > 0:
            offsets = rng.dropout_offsets(self.b, self.heads, i, j, self.nheads, p.seqlen_q, p.seqlen_k)
            keep = rng.dropout_keep(p.philox_seed, offsets, p.dropout_p)
        return s, t, keep


def _descaled(t: torch.Tensor, descale: torch.Tensor, group: int) -> torch.Tensor:
    """A sequence's ``(nheads, seqlen, d)`` FP8 values in fp32, times their kv heads' descales."""
    return t.float() * _expand_kv(descale.view(-1, 1, 1), group)


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """(nheads_k, s, d) -> (nheads, s, d) view for GQA/MQA."""
    return t.repeat_interleave(group, dim=0) if group > 1 else t


def attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams, s: Settings | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(q.shape, device=q.device, dtype=torch.bfloat16 if p.is_fp8 else q.dtype)
    nheads = q.shape[-2]
    group = nheads // k.shape[-2]
    lse = q.new_empty(p.new_lse(p.as_4d(q)).shape, dtype=torch.float32)
    sink = None if p.learnable_sink is None else p.learnable_sink.to(q.device).view(nheads, 1, 1)
    for b, rows_q, rows_k in _sequences(p, q.shape[-3], k.shape[-3]):
        qs, ks, vs = _seq(q, p, b, rows_q), _seq(k, p, b, rows_k), _seq(v, p, b, rows_k)
        if p.is_fp8:  # FP8 inputs: their values, x_fp8 * descale (exact in fp32)
            qs, ks, vs = (_descaled(t, d, g) for t, d, g in zip((qs, ks, vs), p.descales[:, b], (group, 1, 1)))
        seqlen_q, seqlen_k = qs.shape[1], ks.shape[1]
        score = _Scores(p, b, nheads, seqlen_q, seqlen_k, q.device, _key_token(p, b, rows_k))
        o_seq = _seq(out, p, b, rows_q)
        lse_seq = _lse_seq(lse, p, b, rows_q)
        for m0 in range(0, seqlen_q, BLOCK_M):
            m1 = min(m0 + BLOCK_M, seqlen_q)
            qb = qs[:, m0:m1].float()
            m_i = torch.full((nheads, m1 - m0, 1), float("-inf"), device=q.device)
            l_i = torch.zeros_like(m_i)
            acc = torch.zeros(nheads, m1 - m0, qs.shape[-1], device=q.device)
            lo, hi = _key_span(m0, m1, seqlen_q, seqlen_k, p)
            for n0 in range(lo, hi, BLOCK_N):
                n1 = min(n0 + BLOCK_N, hi)
                if score.skipped(m0, m1, n0, n1):
                    continue
                kb = _expand_kv(ks[:, n0:n1].float(), group)
                vb = _expand_kv(vs[:, n0:n1].float(), group)
                s, _, keep = score(qb @ kb.transpose(1, 2), m0, n0)
                m_i, l_i, acc = _online_step(s, m_i, l_i, acc, vb, keep)
            o_blk, lse_blk = _finished(m_i, l_i, acc, 1.0 - p.dropout_p, sink)
            o_seq[:, m0:m1] = o_blk.to(out.dtype)
            lse_seq[:, m0:m1] = lse_blk
    return out, lse


def _online_step(s, m_i, l_i, acc, vb, keep=None):
    """One key block of the online softmax: scores ``s`` (-inf where hidden), values ``vb`` and dropout's
    keep-mask; returns the running max, sum and accumulator."""
    m_new = torch.maximum(m_i, s.amax(-1, keepdim=True))
    # Rows with nothing visible yet keep m = -inf; subtract 0 there instead of -inf.
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    pb = torch.exp(s - m_safe)
    alpha = torch.exp(m_i - m_safe)
    l_i = l_i * alpha + pb.sum(-1, keepdim=True)
    if keep is not None:
        pb = pb * keep
    return m_new, l_i, acc * alpha + pb @ vb


def _finished(m_i, l_i, acc, keep_scale=1.0, sink=None):
    """The output (fp32) and LSE of the rows: 0 and +inf for rows that saw no key. ``sink``: the attention
    sinks' logits ``(nheads, 1, 1)``, one more term of each row's denominator (the LSE includes it)."""
    if sink is not None:
        m_fin = torch.maximum(m_i, sink)
        m_safe = torch.where(torch.isinf(m_fin), torch.zeros_like(m_fin), m_fin)
        alpha = torch.exp(m_i - m_safe)
        l_i = l_i * alpha + torch.exp(sink - m_safe)
        acc = acc * alpha
        m_i = m_fin
    seen = l_i > 0
    l_safe = torch.where(seen, l_i, torch.ones_like(l_i))
    lse = torch.where(seen, m_i + torch.log(l_safe), torch.full_like(l_i, float("inf")))
    return acc / (l_safe * keep_scale), lse.squeeze(-1)


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    s: Settings | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    group = nheads // nheads_k
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    inv_keep = 1.0 / (1.0 - p.dropout_p)
    # the sinks' gradient: -Σ_rows exp(sink - lse) Δ (their softmax weight in each row times the row's Δ)
    sink = None if p.learnable_sink is None else p.learnable_sink.to(q.device).view(nheads, 1, 1)
    dsink = None if sink is None else torch.zeros(nheads, 1, 1, dtype=torch.float32, device=q.device)
    for b, rows_q, rows_k in _sequences(p, q.shape[-3], k.shape[-3]):
        qs, ks, vs = _seq(q, p, b, rows_q), _seq(k, p, b, rows_k), _seq(v, p, b, rows_k)
        dos, os_ = _seq(dout, p, b, rows_q), _seq(out, p, b, rows_q)
        dqs, dks, dvs = _seq(dq, p, b, rows_q), _seq(dk, p, b, rows_k), _seq(dv, p, b, rows_k)
        seqlen_q, seqlen_k = qs.shape[1], ks.shape[1]
        score = _Scores(p, b, nheads, seqlen_q, seqlen_k, q.device, _key_token(p, b, rows_k))
        lse_seq = _lse_seq(lse, p, b, rows_q)
        for m0 in range(0, seqlen_q, BLOCK_M):
            m1 = min(m0 + BLOCK_M, seqlen_q)
            qb, dob = qs[:, m0:m1].float(), dos[:, m0:m1].float()
            delta = (dob * os_[:, m0:m1].float()).sum(-1, keepdim=True)  # Δ = rowsum(dO ∘ O)
            lse_b = lse_seq[:, m0:m1].unsqueeze(-1)
            if sink is not None:
                dsink -= (torch.exp(sink - lse_b) * delta).sum(1, keepdim=True)
            lo, hi = _key_span(m0, m1, seqlen_q, seqlen_k, p)
            for n0 in range(lo, hi, BLOCK_N):
                n1 = min(n0 + BLOCK_N, hi)
                if score.skipped(m0, m1, n0, n1):
                    continue
                kb = _expand_kv(ks[:, n0:n1].float(), group)
                vb = _expand_kv(vs[:, n0:n1].float(), group)
                s, t, keep = score(qb @ kb.transpose(1, 2), m0, n0)
                pb = torch.exp(s - lse_b)  # rows with lse = +inf get 0
                dp = dob @ vb.transpose(1, 2)
                if keep is not None:
                    pd = pb * keep * inv_keep
                    dp = dp * keep * inv_keep
                else:
                    pd = pb
                ds = pb * (dp - delta)
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = ds * p.softmax_scale
                dqs[:, m0:m1] += ds @ kb
                # Sum the GQA group's query heads into their kv head.
                dks[:, n0:n1] += (ds.transpose(1, 2) @ qb).view(nheads_k, group, n1 - n0, -1).sum(1)
                dvs[:, n0:n1] += (pd.transpose(1, 2) @ dob).view(nheads_k, group, n1 - n0, -1).sum(1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if dsink is None else dsink.view(nheads)


def attn_probs(q: torch.Tensor, k: torch.Tensor, p: AttnParams, block_n: int) -> torch.Tensor:
    """S_dmask in flash_attn's scaling, ``(batch, nheads, seqlen_q, seqlen_k)`` (max lengths in varlen mode,
    zero-padded), fp32: the weights before normalisation of flash_attn's key loop, which runs over key
    blocks of ``block_n`` columns from the last to the first, ``exp(s - m)`` with m the row's running max
    over the scores of the column's block and every block after it (s: the scores as the softmax sees
    them, scaled, capped, biased). Entries that dropout removed are negated; hidden entries are 0.
    Multiplying a block's entries by ``exp(m - lse)`` gives the probabilities (flash_attn's tests'
    ``normalize_flash_attn_S``). Materialises N×N: for tests and inspection only."""
    nheads = q.shape[-2]
    group = nheads // k.shape[-2]
    probs = torch.zeros(p.batch, nheads, p.seqlen_q, p.seqlen_k, device=q.device, dtype=torch.float32)
    for b, rows_q, rows_k in _sequences(p, q.shape[-3], k.shape[-3]):
        qs, ks = _seq(q, p, b, rows_q).float(), _expand_kv(_seq(k, p, b, rows_k).float(), group)
        seqlen_q, seqlen_k = qs.shape[1], ks.shape[1]
        score = _Scores(p, b, nheads, seqlen_q, seqlen_k, q.device, _key_token(p, b, rows_k))
        s, _, keep = score(qs @ ks.transpose(1, 2), 0, 0)
        if seqlen_k == 0:
            continue
        block_max = torch.stack([blk.amax(-1) for blk in s.split(block_n, dim=-1)], dim=-1)
        running = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1)  # (nheads, seqlen_q, blocks)
        m = running.repeat_interleave(block_n, dim=-1)[..., :seqlen_k]
        pb = torch.where(s > float("-inf"), torch.exp(s - m), torch.zeros_like(s))
        if keep is not None:
            pb = torch.where(keep, pb, -pb)
        probs[b, :, :seqlen_q, :seqlen_k] = pb
    return probs


def _write_rows(
    cache: torch.Tensor,
    new: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor | None,
    batch_idx: torch.Tensor | None,
) -> None:
    """Writes ``new (batch, seqlen_new, nheads_k, d)`` into ``cache`` at ``positions (batch, seqlen_new)``."""
    if cache.dtype == torch.float8_e4m3fn:  # (as bytes: index_put has no float8 kernels)
        cache, new = cache.view(torch.uint8), new.view(torch.uint8)
    if block_table is not None:
        page_size = cache.shape[1]
        pages = block_table.long().gather(1, positions.div(page_size, rounding_mode="floor"))
        cache[pages, positions % page_size] = new
    else:
        rows = batch_idx.long() if batch_idx is not None else torch.arange(new.shape[0], device=new.device)
        cache[rows.unsqueeze(1), positions] = new


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
    """Rotates the new keys at their cache positions ``seqlens[b] + t`` and writes k, v into the caches
    in place (into FP8 caches divided by ``descales = (k_descale, v_descale)``, saturated and rounded to
    nearest). ``rotary`` is ``(cos, sin, interleaved)`` or None. Same interface as
    ``kernels.decode.kvcache_append`` (``plans``, ``interpret`` and the index checks' arguments are not
    used here: this path's calls have their index values checked on the host)."""
    if k is None:
        return
    positions = seqlens.long().unsqueeze(1) + torch.arange(k.shape[1], device=k.device)
    if rotary is not None:
        k = rotary_at(k, *rotary[:2], positions, rotary[2])
    if descales[0] is not None:
        k, v = (
            (t.float() / d[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            for t, d in zip((k, v), descales)
        )
    # as the kernels (and flash_attn) write: also into caches that require grad or are inference tensors,
    # which torch's in-place writes refuse outside no_grad / inference mode (after the first cache's write)
    inference = k_cache.is_inference() or v_cache.is_inference()
    with torch.inference_mode() if inference else torch.no_grad():
        _write_rows(k_cache, k, positions, block_table, batch_idx)
        _write_rows(v_cache, v, positions, block_table, batch_idx)


def attn_fwd_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: AttnParams,
    c: CacheLayout,
    s: Settings | None = None,
):
    """Attention against a KV cache (``CacheLayout`` ``c``): each sequence's keys are
    gathered from its cache row or pages into a packed batch, which the blockwise forward runs in
    varlen mode. Same returns as ``kernels.decode.attn_fwd_kvcache``, q rotated first as
    ``c.q_rotary`` says."""
    if c.q_rotary is not None:
        cos, sin, interleaved, per_token = c.q_rotary
        positions = c.seqlens_k.long().unsqueeze(1) + torch.arange(q.shape[1] if per_token else 1, device=q.device)
        q = rotary_at(q, cos, sin, positions, interleaved)
    ends = [n + c.new_tokens for n in c.seqlens_k.tolist()]
    starts = c.leftpad.tolist() if c.leftpad is not None else [0] * p.batch
    ks, vs = [], []
    for b in range(p.batch):
        pos = torch.arange(starts[b], ends[b], device=k_cache.device)
        if c.block_table is not None:
            page_size = k_cache.shape[1]
            pages = c.block_table[b].long()[pos // page_size]
            ks.append(k_cache[pages, pos % page_size])
            vs.append(v_cache[pages, pos % page_size])
        else:
            row = int(c.batch_idx[b]) if c.batch_idx is not None else b
            ks.append(k_cache[row, pos])
            vs.append(v_cache[row, pos])
        if c.k_descale is not None:  # FP8 caches: their values, x_fp8 * descale (in fp32)
            ks[-1] = ks[-1].float() * c.k_descale[b][:, None]
            vs[-1] = vs[-1].float() * c.v_descale[b][:, None]
    lengths_k = [len(t) for t in ks]
    cu_k = torch.tensor([0, *itertools.accumulate(lengths_k)], dtype=torch.int32)
    if p.is_varlen:
        qv, cu_q = q, p.cu_seqlens_q
    else:
        qv = q.reshape(p.batch * p.seqlen_q, *q.shape[2:])
        cu_q = torch.arange(0, p.batch + 1, dtype=torch.int32) * p.seqlen_q
    pv = dataclasses.replace(p, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqlen_k=max(lengths_k, default=0))
    out, lse = attn_fwd(qv, torch.cat(ks), torch.cat(vs), pv)
    if p.is_varlen:
        return out, lse
    nheads = q.shape[2]
    return out.view(q.shape), lse.view(nheads, p.batch, p.seqlen_q).transpose(0, 1).contiguous()


def mla_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    metadata: torch.Tensor | None,
    num_splits: torch.Tensor | None,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    s: Settings | None = None,
    record: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decoding (``kernels.decode.mla.mla_fwd``'s interface; the schedule and the error record are
    not needed here, the lengths and table having been checked on the host): each
    sequence's keys are read from its pages BLOCK_N at a time, the values being their first
    ``head_dim_v`` dims, with an online softmax in fp32."""
    batch, seqlen_q, nheads, _ = q.shape
    page_size, nheads_k = kv.shape[1], kv.shape[2]
    group = nheads // nheads_k
    out = torch.zeros((batch, seqlen_q, nheads, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.full((batch, nheads, seqlen_q), float("inf"), device=q.device)
    for b, seqlen_k in enumerate(seqlens.tolist()):
        qb = q[b].float().transpose(0, 1)  # (nheads, seqlen_q, d)
        m_i = torch.full((nheads, seqlen_q, 1), float("-inf"), device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(nheads, seqlen_q, head_dim_v, device=q.device)
        last = seqlen_k - seqlen_q + torch.arange(seqlen_q, device=q.device).view(1, -1, 1)  # causal: keys <= last
        for n0 in range(0, seqlen_k, BLOCK_N):
            pos = torch.arange(n0, min(n0 + BLOCK_N, seqlen_k), device=q.device)
            pages = block_table[b].long()[pos // page_size]
            kb = _expand_kv(kv[pages, pos % page_size].float().transpose(0, 1), group)  # (nheads, n, d)
            sc = (qb @ kb.transpose(1, 2)) * softmax_scale
            if causal:
                sc = sc.masked_fill(pos.view(1, 1, -1) > last, float("-inf"))
            m_i, l_i, acc = _online_step(sc, m_i, l_i, acc, kb[..., :head_dim_v])
        o_b, lse[b] = _finished(m_i, l_i, acc)
        out[b] = o_b.transpose(0, 1).to(q.dtype)
    return out, lse
