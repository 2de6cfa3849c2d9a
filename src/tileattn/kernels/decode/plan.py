"""The host path of attention against a KV cache: how a call is split and built (``new_base``,
``Base.splits``, ``plan_launches``: tiles, split count, stages, warps, constexprs, from the call's
metadata and ``params.DecodeSettings``), and ``attn_fwd_kvcache``, which allocates the outputs and
launches a call's plan. Plans are remembered in the table a call brings (``CacheLayout.plans``, one per
call signature) by settings, split count and key tiles per program, so that a decode loop's later calls
only allocate and launch (``Launch``: a compiled build launched directly, ``kernels.launch.Bound``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton.language as tl
from triton.runtime import driver

from tileattn.kernels import common
from tileattn.kernels.decode import combine, paging, split
from tileattn.kernels.launch import Launch
from tileattn.params import (
    REPLAY,
    AttnParams,
    CacheLayout,
    DecodeSettings,
    KernelConfig,
    Settings,
    cdiv,
    interpreting,
    next_power_of_2,
    remember,
)

_MAX_PLANS = 64  # plans kept per call signature and settings; beyond that the oldest go


def remember_plan(table: dict, key, value):
    """``table[key] = value`` in a plan table of at most ``_MAX_PLANS`` entries."""
    return remember(table, key, value, _MAX_PLANS)


@functools.cache
def _tile_config(rows: int, block_d: int, interpret: bool, stages: int, tma: bool, fp8_qk: bool) -> KernelConfig:
    """The split kernel's tiles: query-row blocks of the packed rows (at most 64), 128-key tiles up to head
    dim 128; the interpreter's small tiles. ``fp8_qk`` (q·kᵀ on FP8 tensor cores): blocks of 64 rows
    whatever the rows, since only the warpgroup MMA (64 rows) takes e4m3 on Hopper; smaller blocks would
    widen both operands to fp16 again; at head dim 256 over 8 warps (two warpgroups share the columns:
    with 4 the accumulator spills)."""
    if interpret:
        return KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, tma=tma)
    block_m = 64 if fp8_qk else min(64, max(16, next_power_of_2(rows)))
    block_n = 128 if block_d <= 128 else 64
    warps = 8 if fp8_qk and block_d >= 256 else 4
    return KernelConfig(block_m, block_n, num_warps=warps, num_stages=stages, tma=tma)


def _widen(d: DecodeSettings, p: AttnParams) -> int:
    """The split kernel's WIDEN for FP8 caches under ``d.fp8_widen`` ("fp8" and "none" need head dims from
    32, else they are "f16")."""
    fp8 = p.block_d >= 32
    return {"q": 0, "f16": 1, "fp8": 2 if fp8 else 1, "none": 3 if fp8 else 1}[d.fp8_widen]


@functools.cache
def device_has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: NVIDIA sm90+ GPUs with a Triton that has the grid dependency
    controls (not the interpreter)."""
    return (
        device.type == "cuda"
        and not interpreting()
        and not torch.version.hip
        and hasattr(tl.extra.cuda, "gdc_wait")
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@functools.cache
def device_sm_count(device: torch.device) -> int:
    """The device's SMs (an H200's 132 for other devices)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(programs: int, max_seqlen_k: int, block_n: int, sm_count: int, d: DecodeSettings) -> int:
    """As many splits as keep the programs within ``d.waves`` waves (one program per SM per wave), with at
    least ``d.min_split_tiles`` key tiles per split and at most ``d.max_splits`` splits: a grid that
    already fills the GPU is not split."""
    if programs >= d.waves * sm_count:
        return 1
    tiles = cdiv(max(max_seqlen_k, 1), block_n)
    return max(1, min(d.waves * sm_count // programs, tiles // d.min_split_tiles, d.max_splits))


@dataclass
class Base:
    """What a decode call's metadata and settings fix before its split count: the settings, tiles,
    programs per split, the LSE's shape, the SMs counted on, and the plans built so far by (num_splits,
    key tiles per program)."""

    settings: DecodeSettings
    interpret: bool
    cfg: KernelConfig
    programs: int
    lse_shape: tuple
    sm_count: int
    plans: dict = dataclasses.field(default_factory=dict)
    split_counts: dict = dataclasses.field(default_factory=dict)

    def splits(self, p: AttnParams, c: CacheLayout) -> tuple[int, int]:
        """(num_splits, key tiles per program at most) of a call."""
        key = (c.num_splits, c.max_seqlen_k)
        counts = self.split_counts.get(key)
        if counts is None:
            counts = remember_plan(self.split_counts, key, self._splits(p, c))
        return counts

    def _splits(self, p: AttnParams, c: CacheLayout) -> tuple[int, int]:
        block_n = self.cfg.block_n
        num_splits = c.num_splits
        if num_splits == 0:
            max_k = c.max_seqlen_k if c.max_seqlen_k is not None else p.seqlen_k
            num_splits = choose_splits(self.programs, max_k, block_n, self.sm_count, self.settings)
        num_splits = max(1, min(num_splits, self.settings.max_splits, cdiv(max(p.seqlen_k, 1), block_n)))
        return num_splits, cdiv(max(c.max_seqlen_k or p.seqlen_k, 1), block_n * num_splits)


def new_base(q4: torch.Tensor, k_cache: torch.Tensor, p: AttnParams, s: Settings) -> Base:
    """The ``Base`` of calls with this metadata under settings ``s`` (``s.decode``, ``s.interpret``)."""
    d = s.decode
    rows = q4.shape[2] // k_cache.shape[2] * p.seqlen_q
    fp8_qk = k_cache.dtype == torch.float8_e4m3fn and _widen(d, p) >= 2
    cfg = _tile_config(rows, p.block_d, s.interpret, d.stages, d.tma or d.paged_tma, fp8_qk)
    programs = cdiv(rows, cfg.block_m) * p.batch * k_cache.shape[2]
    sms = d.sm_count if d.sm_count is not None else device_sm_count(q4.device)
    return Base(d, s.interpret, cfg, programs, p.lse_shape(q4), sms)


def plan_launches(
    base: Base,
    q4: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o4: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    c: CacheLayout,
    num_splits: int,
    tiles: int,
) -> tuple[Launch, Launch | None]:
    """The split kernel's launch and the combine's (None without splits) for this call's metadata, under
    the base's settings. The partial outputs and LSEs (flat buffers) are addressed by the strides given
    here: each split's slice is laid out like o4 / lse."""
    d = base.settings
    nheads, headdim = q4.shape[2], q4.shape[3]
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    interpret = base.interpret
    cfg = base.cfg
    paged = c.block_table is not None
    rot_cos, _, rot_interleaved, rot_per_token = c.q_rotary or (None, None, False, False)
    split_kv = num_splits > 1
    pdl_ok = d.has_pdl if d.has_pdl is not None else device_has_pdl(q4.device)
    pdl = split_kv and d.pdl and pdl_ok
    pdl_attn = d.pdl_attn and pdl_ok
    if split_kv:
        o_strides = (o4.numel(), *p.strides(o4))
        l_strides = (lse.numel(), *p.lse_strides(lse))
    else:
        o_strides = (0, *p.strides(o4))
        l_strides = (0, *p.lse_strides(lse))
    if paged:
        page_size, num_rows = k_cache.shape[1], k_cache.shape[0]
        capacity = c.block_table.shape[1] * page_size
        table_stride = c.block_table.stride(0)
    else:
        page_size, num_rows, capacity = 1, k_cache.shape[0], k_cache.shape[1]
        table_stride = c.seqlens_k.stride(0)
    small_grid = base.programs * num_splits < 2 * base.sm_count
    # one wave of short programs: smaller key tiles (the first lands and the last one's work ends sooner)
    short = d.short_small_page_tiles if paged and page_size < cfg.block_n else d.short_tiles
    if d.short_block_n and base.programs * num_splits <= base.sm_count and tiles <= short and not interpret:
        cfg = dataclasses.replace(cfg, block_n=min(d.short_block_n, cfg.block_n))
    prefetch_grid = base.programs * num_splits < d.paged_prefetch_waves * base.sm_count
    long_paged = paged and small_grid and d.paged_long_stages > 0 and tiles >= d.paged_long_tiles
    if paged:
        use_tma = (
            tiles >= d.tma_tiles
            and small_grid
            and d.paged_tma
            and page_size % cfg.block_n == 0
            and c.leftpad is None
            and k_cache.stride(0) == page_size * k_cache.stride(1)
            and v_cache.stride(0) == page_size * v_cache.stride(1)
            and common.use_tma(cfg, k_cache, v_cache)
        )
        stages = d.paged_tma_stages if use_tma else d.paged_long_stages if long_paged else cfg.num_stages
    else:
        use_tma = d.tma and tiles >= d.tma_tiles and common.use_tma(cfg, k_cache, v_cache)
        full_short = d.full_grid_stages > 0 and p.block_d == 128 and not small_grid and tiles <= d.full_grid_tiles
        stages = d.full_grid_stages if full_short else cfg.num_stages
    interleave = split_kv and d.interleave and paged and page_size < cfg.block_n
    offs_64 = d.offs_64_always or paging.offsets_past_int32(k_cache, paged) or paging.offsets_past_int32(v_cache, paged)
    m_blocks = base.programs // (p.batch * nheads_k)
    attn = Launch(
        split.LAUNCHER,
        (m_blocks, p.batch * nheads_k, num_splits),
        (
            *p.strides(q4),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            *o_strides,
            *l_strides,
            p.alibi_batch_stride(),
            table_stride,
            rot_cos.stride(0) if rot_cos is not None else 0,
            nheads_k,
            group,
            p.seqlen_q,
            capacity,
            num_rows,
            c.new_tokens,
            rot_cos.shape[1] if rot_cos is not None else 0,
            rot_cos.shape[0] if rot_cos is not None else 0,
            p.softmax_scale,
            p.softcap,
            p.window_left,
            p.window_right,
        ),
        {
            "HEAD_DIM": headdim,
            "BLOCK_D": p.block_d,
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "PAGE_SIZE": page_size,
            "PAGED": paged,
            "OFFS_64": offs_64,
            "SAME_KV_STRIDES": k_cache.stride() == v_cache.stride(),
            "PREFETCH_TABLE": paged and prefetch_grid and not long_paged and not use_tma,
            "USE_TMA": use_tma,
            "HAS_LEFTPAD": c.leftpad is not None,
            "HAS_BATCH_IDX": c.batch_idx is not None,
            "MASK_LEFT": p.window_left >= 0,
            "MASK_RIGHT": p.window_right >= 0,
            "HAS_SOFTCAP": p.softcap > 0,
            "HAS_ALIBI": p.alibi_slopes is not None,
            "IS_VARLEN": p.is_varlen,
            "SPLIT": split_kv,
            "INTERLEAVE": interleave,
            "LAUNCH_DEPENDENTS": pdl,
            "DEFER_SCALE": p.defer_scale,
            "ROTARY_Q": rot_cos is not None,
            "ROT_INTERLEAVED": bool(rot_interleaved),
            "ROT_PER_TOKEN": bool(rot_per_token),
            "UNIT": d.interleave_unit if interleave else 1,
            "WAIT_PRIOR": pdl_attn,
            "TABLE_TO_L2": paged and prefetch_grid and d.paged_table_l2 and not interpret and not torch.version.hip,
            "KV_FP8": c.k_descale is not None,
            "WIDEN": _widen(d, p),
            "CHECK": c.call if c.record is not None else 0,
            "HAS_SINK": p.learnable_sink is not None,
            "INTERPRET": interpret,
        },
        num_warps=max(d.paged_warps, cfg.num_warps) if paged and not use_tma and not interpret else cfg.num_warps,
        num_stages=cfg.num_stages if interpret else stages,
        **({"launch_pdl": True} if pdl_attn else {}),
    )
    if not split_kv:
        return attn, None
    n_rows = o4.numel() // headdim
    block_r, chunk = combine.combine_tiles(num_splits, p.block_d, d)
    merge = Launch(
        combine.LAUNCHER,
        (cdiv(n_rows, block_r), 1, 1),
        (o4.numel(), lse.numel(), n_rows, nheads, q4.shape[1], num_splits),
        {
            "HEAD_DIM": headdim,
            "BLOCK_D": p.block_d,
            "BLOCK_R": block_r,
            "SPLITS_PAD": max(2, next_power_of_2(num_splits)),
            "CHUNK": chunk,
            "USE_PDL": pdl,
            "VAR_SPLITS": False,
            "MIRROR": c.record is not None and c.mirror is not None,
            "HAS_SINK": p.learnable_sink is not None,
        },
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return attn, merge


def plan_call(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: AttnParams, c: CacheLayout, s: Settings
) -> tuple[Launch, Launch | None]:
    """The launches ``attn_fwd_kvcache`` makes for this call under settings ``s``, planned afresh and not
    launched (the tensors may be on any device, meta included): what the tests, the bench and compile
    reports inspect."""
    q4 = p.as_4d(q)
    base = new_base(q4, k_cache, p, s)
    num_splits, tiles = base.splits(p, c)
    o4 = p.as_4d(torch.empty(q.shape, device=q.device, dtype=q.dtype))
    lse = torch.empty(base.lse_shape, device=q.device, dtype=torch.float32)
    return plan_launches(base, q4, k_cache, v_cache, o4, lse, p, c, num_splits, tiles)


def plans_in(table: dict, s: Settings | None = None) -> list[tuple[Launch, Launch | None]]:
    """The plans ``attn_fwd_kvcache`` keeps in a ``CacheLayout.plans`` table for calls under settings
    ``s`` (None: any), oldest first."""
    bases = [base for base in list(table.values()) if isinstance(base, Base)]
    if s is not None:
        bases = [base for base in bases if (base.settings, base.interpret) == (s.decode, s.interpret)]
    return [step.launches for base in bases for step in list(base.plans.values())]


def attn_fwd_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: AttnParams, c: CacheLayout, s: Settings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against a KV cache under settings ``s``.

    q ``(batch, seqlen_q, nheads, d)`` (or ``(total_q, nheads, d)`` with p.cu_seqlens_q); caches
    contiguous ``(batch_cache, capacity, nheads_k, d)`` or paged ``(num_pages, page_size, nheads_k, d)``
    through ``c.block_table``; ``c`` says where each sequence's keys are (``params.CacheLayout``).
    Returns ``(out, lse)`` laid out like the training forward's.

    With ``c.plans`` (the API's table for calls whose arguments have the same shapes, strides, dtypes,
    devices, alignments and options as this one) the launches are planned once per decode settings,
    split count, key tiles per program, and whether the kernels check index values (``c.record``) and
    copy the error record to the host (``c.mirror``): later calls only allocate the outputs and launch."""
    q4 = p.as_4d(q)
    table = c.plans
    base = None
    if table is not None:
        key = (s.decode, s.interpret)
        base = table.get(key)
    if base is None:
        base = new_base(q4, k_cache, p, s)
        if table is not None:
            remember_plan(table, key, base)
    num_splits, tiles = base.splits(p, c)
    checked = (c.call, c.mirror is not None) if c.record is not None else 0
    step = base.plans.get((num_splits, tiles, checked))
    if step is None:
        step = Step(base, q, k_cache, v_cache, p, c, num_splits, tiles)
        if table is not None:
            remember_plan(base.plans, (num_splits, tiles, checked), step)
    if c.replay and table is not None:
        table[REPLAY] = (s, step)
    return step(
        q,
        k_cache,
        v_cache,
        c.seqlens_k,
        c.leftpad,
        c.batch_idx,
        c.block_table,
        p.cu_seqlens_q,
        c.q_rotary,
        c.k_descale,
        c.v_descale,
        p.alibi_slopes,
        c.record,
        c.mirror,
        p.learnable_sink,
    )


_FLAT = torch.contiguous_format  # (empty_like with it: a third of the host time of empty(shape, ...))


class Step:
    """What a call with planned launches does: allocate the outputs, launch the split kernel and the
    combine. Built once per call signature, settings, split count and key tiles per program
    (``attn_fwd_kvcache``); ``step(q, k_cache, v_cache, seqlens_k, ...)`` with the tensors of a call of
    that signature (``CacheLayout``'s, None where the call has none) returns ``(out, lse)``. A step planned
    for a ``CacheLayout.mirror`` (``to_host``) takes the error record and its host copy ``mirror`` and
    copies the record into it behind its kernels: the combine's first program does, else an asynchronous
    copy. ``replay`` is the eager API's call of a step (``ops.kvcache.replay_kvcache``)."""

    __slots__ = (
        "launches", "attn", "merge", "to_host", "varlen", "lse_shape", "lse_size", "split_at", "split_size",
        "lse_at", "scratch",
    )  # fmt: skip

    def __init__(self, base: Base, q, k_cache, v_cache, p: AttnParams, c: CacheLayout, num_splits: int, tiles: int):
        q4 = p.as_4d(q)
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(base.lse_shape, device=q.device, dtype=torch.float32)
        self.launches = plan_launches(base, q4, k_cache, v_cache, p.as_4d(out), lse, p, c, num_splits, tiles)
        self.attn, self.merge = self.launches
        self.to_host = c.record is not None and c.mirror is not None  # (the call gives both: plan's key)
        self.varlen, self.lse_shape, self.lse_size = p.is_varlen, base.lse_shape, lse.numel()
        # with splits, the partial LSEs then (16-byte aligned) the partial outputs: one allocation
        self.split_at = cdiv(num_splits * lse.numel(), 4) * 4 if num_splits > 1 else 0
        self.split_size = self.split_at + num_splits * out.numel()
        self.lse_at = cdiv(self.split_size, 4) * 4  # (16-byte aligned, as the plan's own LSE was)
        self.scratch: dict[int, torch.Tensor] = {}  # replay's partials (and unwanted LSE), by CUDA stream

    def __call__(
        self, q, k_cache, v_cache, seqlens, leftpad, batch_idx, block_table, cu_seqlens_q, q_rotary, k_descale,
        v_descale, alibi_slopes, record, mirror=None, sink=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        device = q.device
        out = torch.empty_like(q, memory_format=_FLAT)  # contiguous: _combine addresses it flat
        lse = torch.empty(self.lse_shape, device=device, dtype=torch.float32)
        partials = torch.empty(self.split_size, device=device, dtype=torch.float32) if self.split_at else None
        self._launch(
            q, k_cache, v_cache, out, lse, partials, seqlens, leftpad, batch_idx, block_table, cu_seqlens_q,
            q_rotary, k_descale, v_descale, alibi_slopes, record, mirror, sink,
        )  # fmt: skip
        return out, lse

    def replay(
        self, q, k_cache, v_cache, seqlens, leftpad, batch_idx, block_table, k_descale, v_descale, alibi_slopes,
        record, mirror, want_lse: bool, sink=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """An eager call (not under graph capture) on the current CUDA stream (or the interpreter) with one
        allocation, the output. With splits, the partials, and the LSE unless ``want_lse``, go to this
        step's scratch buffer for the stream, which its calls on the stream reuse: each call's kernels run
        after the last call's combine has read it (stream order; a split kernel launched as a programmatic
        dependent touches no memory before the kernel ahead has ended). Returns ``(out, lse or None)``."""
        device = q.device
        out = torch.empty_like(q, memory_format=_FLAT)
        partials = None
        if self.split_at:
            stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else 0
            partials = self.scratch.get(stream)
            if partials is None:
                size = self.lse_at + self.lse_size
                partials = self.scratch[stream] = torch.empty(size, device=device, dtype=torch.float32)
        if want_lse or partials is None:
            lse = torch.empty(self.lse_shape, device=device, dtype=torch.float32)
        else:
            lse = partials[self.lse_at :].view(self.lse_shape)
        self._launch(
            q, k_cache, v_cache, out, lse, partials, seqlens, leftpad, batch_idx, block_table, None, None,
            k_descale, v_descale, alibi_slopes, record, mirror, sink,
        )  # fmt: skip
        return out, lse if want_lse else None

    def _launch(
        self, q, k_cache, v_cache, out, lse, partials, seqlens, leftpad, batch_idx, block_table, cu_seqlens_q,
        q_rotary, k_descale, v_descale, alibi_slopes, record, mirror, sink,
    ) -> None:  # fmt: skip
        """The launches into ``out`` and ``lse`` (``partials``: the split kernel's fp32 buffer of at least
        ``split_size``, or None without splits; ``sink``: the attention sinks, or None)."""
        q4, o4 = (q.unsqueeze(0), out.unsqueeze(0)) if self.varlen else (q, out)
        if partials is not None:
            o_target, l_target = partials[self.split_at : self.split_size], partials
        else:
            o_target, l_target = o4, lse
        self.attn(
            (
                q4,
                k_cache,
                v_cache,
                o_target,
                l_target,
                alibi_slopes if alibi_slopes is not None else lse,
                seqlens,
                leftpad if leftpad is not None else seqlens,
                batch_idx if batch_idx is not None else seqlens,
                block_table if block_table is not None else seqlens,
                cu_seqlens_q if cu_seqlens_q is not None else seqlens,
                *(q_rotary[:2] if q_rotary is not None else (seqlens, seqlens)),
                *((k_descale, v_descale) if k_descale is not None else (lse, lse)),
                record if record is not None else seqlens,
                sink if sink is not None else lse,
            )
        )
        if self.merge is not None:
            self.merge(
                (
                    o_target, l_target, o4, lse, lse, *((record, mirror) if self.to_host else (lse, lse)),
                    sink if sink is not None else lse,
                )
            )  # fmt: skip
        elif self.to_host:
            mirror.copy_(record, non_blocking=True)
