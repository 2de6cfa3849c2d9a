"""The types every layer shares: one call's validated arguments (``AttnParams``), where a KV cache's keys
live (``CacheLayout``), kernel tiles (``KernelConfig``) and the tuning settings (``DecodeSettings``,
``Settings``), with the small host helpers they need. Imports nothing else from tileattn (and not Triton),
so any layer may import it.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

import torch


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code, without Triton's constexpr-function wrapper (microseconds a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def padded_headdim(headdim: int) -> int:
    """The head dim the kernels compute with (their ``BLOCK_D``, the tables' key): the next power of
    two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(headdim))


def dropout_threshold(dropout_p: float) -> int:
    """The byte value from which a dropout draw keeps its element (8 random bits per element): flash_attn's
    rule, which keeps an element when its byte is at most ``floor(255 · (1 - p))`` with ``1 - p`` in fp32
    (here stated from the other end, byte >= 255 - that, for the same count of kept bytes). So the keep
    probability is ``(floor(255 · (1 - p)) + 1) / 256``, while the kept weights are rescaled by ``1 / (1 - p)``
    (``AttnParams.keep_scale``): flash_attn's numbers, with the bias of less than 1/256 in the expected
    output that its rule carries (any p > 0 drops at least 1/256)."""
    if dropout_p <= 0:
        return 0
    keep = struct.unpack("f", struct.pack("f", 1.0 - struct.unpack("f", struct.pack("f", dropout_p))[0]))[0]
    return 255 - math.floor(keep * 255.0)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def remember(table: dict, key, value, limit: int):
    """``table[key] = value`` in a table of at most ``limit`` entries: the oldest go first. Safe when
    threads evict at once (an entry another thread removed is skipped)."""
    while len(table) >= limit:
        try:
            table.pop(next(iter(table)), None)
        except (StopIteration, RuntimeError):  # emptied or resized by another thread meanwhile
            break
    table[key] = value
    return value


@dataclass(frozen=True)
class KernelConfig:
    """Tiles, warps and stages of one kernel build, with the build variants the tables may ask for."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # dK/dV kernel only: score tiles in query x key orientation (see backward._dkdv_tiles)
    q_major: bool = False
    # row tiles read in the kernel loops through TMA tensor descriptors (sm90+, aligned rows; common.use_tma)
    tma: bool = False
    # forward only: the key loop warp-specialised by the compiler (tl.range(warp_specialize=True))
    warp_spec: bool = False
    # a register cap per thread for ptxas (None: its own choice, up to 255); two CTAs of 8 warps fit an
    # SM only at <= 128 registers
    maxnreg: int | None = None
    # dK/dV kernel only: also accumulate dQ with fp32 atomic adds (1) or TMA reduce-adds (2, sm90+) and
    # skip the dQ pass; never with deterministic=True. Where TMA cannot write the fp32 buffer, mode 2
    # takes the dQ pass on the GPU and the atomic adds under the interpreter (no TMA stores there).
    dq_atomic: int = 0
    # Gluon backward only: each tile's dQ (the split build's, head dim 256: its first dQ chunk) issued before
    # dK (and dV), so that its add runs under them; the split build's dQ columns per product and add (32:
    # room for a second (Q, dO) stage)
    dq_first: bool = False
    dq_chunk: int = 64
    # Gluon forward only (two consumer warpgroups): they take turns issuing their wgmmas through named
    # barriers, one's softmax under the other's matmuls (FlashAttention-3's ping-pong)
    pingpong: bool = False
    # Gluon forward only: the key loop as three branch-free loops (tiles that need a mask, those that need
    # none, those that do), so that ptxas can schedule the softmax under the running P·V
    mask_loops: bool = False
    # forward only (portable and Gluon): of every 8 scores a thread holds, this many take their exponential
    # from a polynomial on the FMA units instead of MUFU.EX2 (``kernels.exp2``: FlashAttention-4's split)
    exp2_poly: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.exp2_poly <= 8:
            raise ValueError(f"exp2_poly counts scores of every 8, so 0 to 8, got {self.exp2_poly}")


@dataclass(frozen=True)
class DecodeSettings:
    """How ``flash_attn_with_kvcache`` plans its launches (``kernels.decode.plan``). Hashable: plans
    are remembered per settings value. The defaults are the H200's measured choices (docs/perf.md)."""

    # pipeline stages of the split kernel's key loop (3: 136 KiB of shared memory at head dim 128)
    stages: int = 3
    # waves of programs the split heuristic aims for (one program per SM per wave)
    waves: int = 1
    # key tiles a split keeps at least
    min_split_tiles: int = 4
    max_splits: int = 128
    # splits of pages smaller than a key tile take runs of ``interleave_unit`` tiles in turn, so a
    # split's first table entries are known before the sequence's length is read
    interleave: bool = True
    interleave_unit: int = 2
    # contiguous caches at head dim 128 in grids of two waves or more whose programs have at most
    # ``full_grid_tiles`` key tiles: ``full_grid_stages`` stages (two blocks per SM; 0 = ``stages``)
    full_grid_stages: int = 2
    full_grid_tiles: int = 32
    # K/V tiles through TMA descriptors for programs of at least ``tma_tiles`` key tiles (contiguous
    # caches: ``tma``; pages holding whole key tiles in grids under two waves: ``paged_tma``)
    tma: bool = False
    paged_tma: bool = False
    paged_tma_stages: int = 5
    tma_tiles: int = 16
    # programmatic dependent launches (sm90+): the combine after the split kernel (``pdl``), the split
    # kernel after whatever runs before it in the stream (``pdl_attn``)
    pdl: bool = True
    pdl_attn: bool = True
    # paged caches: long programs (``paged_long_tiles`` key tiles or more) in grids under two waves take
    # ``paged_long_stages``; others read the table one tile ahead in grids under
    # ``paged_prefetch_waves`` waves, and prefetch their table sectors into L2 (``paged_table_l2``)
    paged_long_stages: int = 5
    paged_long_tiles: int = 16
    paged_warps: int = 4
    paged_prefetch_waves: int = 2
    paged_table_l2: bool = True
    # one-wave grids of at most ``short_tiles`` key tiles a program (``short_small_page_tiles`` for
    # pages smaller than a tile) take tiles of ``short_block_n`` keys (0: the config's)
    short_block_n: int = 64
    short_tiles: int = 8
    short_small_page_tiles: int = 4
    # 64-bit cache offsets for every call, not only where offsets could pass 2**31 (to time them)
    offs_64_always: bool = False
    # the combine: splits read per load, rows a program merges, fp32 values a load holds at most
    combine_splits_per_load: int = 16
    combine_max_rows: int = 16
    combine_max_values: int = 16384
    # SMs the planner counts on (None: the device's own)
    sm_count: int | None = None
    # whether the planner counts on programmatic dependent launches (None: whether the device takes them)
    has_pdl: bool | None = None
    # FP8 caches: the dtype their tiles are widened to for the matmuls: "f16" (q converted too; one
    # conversion per two values, 1.3-1.7x the speed of "q" for bf16 q), "q" (q's dtype), or "fp8": only V
    # is widened (to fp16), q·kᵀ runs on the FP8 tensor cores with q's rows quantized to e4m3 by their
    # own factors (q's precision then is e4m3's, as an FP8 forward's is; head dims from 32, else "f16"),
    # or "none": as "fp8", and P·V on the FP8 tensor cores too, p rounded to e4m3 at 2**8 times its value
    # (an FP8 forward's probabilities)
    fp8_widen: str = "f16"


@dataclass(frozen=True)
class MLASettings:
    """How ``tileattn.mla`` schedules and builds its decode kernel (``kernels.decode.mla``). The defaults
    are the H200's measured choices (docs/perf.md, "MLA decode")."""

    # keys a program takes per step; query rows (heads x tokens of one kv head) per program: a power of
    # two from ``min_block_m`` to ``block_m``
    block_n: int = 64
    block_m: int = 64
    min_block_m: int = 16
    # warps of programs of 64 query rows (the 512-wide accumulator over two warpgroups) and of fewer
    wide_warps: int = 8
    narrow_warps: int = 4
    stages: int = 2
    # the query tiles loaded again for every key tile instead of held in registers
    q_in_loop: bool = False
    # 64-row programs on sm90 in Gluon (``kernels.gluon.mla``: q·kᵀ split between the warpgroups, not
    # computed by both; DeepSeek's geometry only), with that many key tiles in flight (H100: 1.47-1.50x the
    # portable build's TFLOP/s compute-bound, docs/perf.md; needs Triton 3.6's Gluon, else the portable build)
    gluon: bool = True
    gluon_stages: int = 2
    # with ``gluon``, programs of fewer rows too (memory-bound decoding), padded to 64 rows (a wgmma's M;
    # H100: 0.99x the portable 16-row programs' GB/s, so off)
    gluon_narrow: bool = False
    # the work schedule (``get_mla_metadata``): keys counted in blocks of ``schedule_block``, each
    # sequence costing ``fixed_overhead`` blocks more (its output's write), over ``parts_per_sm`` parts per
    # SM for programs of ``block_m`` rows and ``narrow_parts_per_sm`` for programs of fewer
    schedule_block: int = 64
    fixed_overhead: int = 5
    parts_per_sm: int = 1
    narrow_parts_per_sm: int = 2
    # SMs the schedule counts on (None: the device's own)
    sm_count: int | None = None

    def rows_per_program(self, rows: int) -> int:
        """Query rows per program for ``rows`` rows per kv head: a power of two from ``min_block_m`` to
        ``block_m``."""
        return min(self.block_m, max(self.min_block_m, next_power_of_2(rows)))


@dataclass(frozen=True, eq=False)
class Settings:
    """The tile tables of the training kernels, by padded head dim, and the decode settings: chosen per
    GPU arch in ``kernels.configs.for_device`` and passed into the launchers."""

    fwd: Mapping[int, KernelConfig]
    bwd_dkdv: Mapping[int, KernelConfig]
    bwd_dq: Mapping[int, KernelConfig]
    # entries that take precedence over ``fwd`` for some calls (``kernels.configs.fwd_config``)
    fwd_long: Mapping[int, KernelConfig] = field(default_factory=dict)
    fwd_causal: Mapping[int, KernelConfig] = field(default_factory=dict)
    fwd_window: Mapping[int, KernelConfig] = field(default_factory=dict)
    fwd_pointer: Mapping[int, KernelConfig] = field(default_factory=dict)
    # the forward of FP8 inputs (``AttnParams.is_fp8``), and whether it reads V through a transposed
    # copy (key-major rows, as FP8 tensor-core B operands want) rather than V itself
    fwd_fp8: Mapping[int, KernelConfig] = field(default_factory=dict)
    fp8_v_transposed: bool = False
    # the Gluon forward on sm90 (``kernels.gluon.forward``; block_m is a work item's rows, two or three
    # consumer warpgroups of 64), by head dim: one program per query tile, or (``fwd_gluon_short``) a
    # persistent grid where a query block sees fewer than ``gluon_short_seqlen_k`` keys (short sequences,
    # windows bounded on both sides); calls it cannot compute, and head dims in neither, run the portable
    # forward
    fwd_gluon: Mapping[int, KernelConfig] = field(default_factory=dict)
    fwd_gluon_short: Mapping[int, KernelConfig] = field(default_factory=dict)
    # FP8 (e4m3) inputs in the Gluon forward, by head dim (one program per query tile; none: the portable
    # forward, which reads V through Triton's key-major copy or ``fp8_v_transposed``'s)
    fwd_gluon_fp8: Mapping[int, KernelConfig] = field(default_factory=dict)
    gluon_short_seqlen_k: int = 4096
    # head dims whose Gluon forward (not FP8) runs only where a query block sees this many keys or more; the
    # portable forward below (``configs.gluon_fwd_config``)
    gluon_min_seqlen_k: Mapping[int, int] = field(default_factory=dict)
    # the K/V bytes a causal Gluon forward's groups of heads keep in L2: its longest-first order walks the
    # query blocks of as many heads together as fit (``kernels.gluon.schedule``); 0: all heads in one group
    # (configs.HOPPER: FlashAttention-3's budget, 32 << 20)
    gluon_l2_bytes: int = 0
    # a persistent causal Gluon forward's programs take every other wave of items in reverse, in groups of
    # heads (at most ``gluon_l2_bytes``' worth) that load the busiest program least (``schedule.balanced_group``)
    gluon_snake: bool = False
    # the Gluon backward on sm90 (``kernels.gluon.backward``: one dK/dV/dQ kernel, dQ added in fp32, so never
    # with ``deterministic``), by head dim: block_m query rows per tile, block_n keys per program (128),
    # num_stages the (Q, dO) ring's depth, dq_atomic 1 for fp32 atomic adds, else TMA reduce-adds. Empty:
    # the portable backward runs
    bwd_gluon: Mapping[int, KernelConfig] = field(default_factory=dict)
    # the same with dropout (the draws take registers and shared memory)
    bwd_gluon_dropout: Mapping[int, KernelConfig] = field(default_factory=dict)
    # entries that take precedence over ``bwd_dkdv`` (``kernels.configs.bwd_dkdv_config``)
    bwd_dkdv_causal: Mapping[int, KernelConfig] = field(default_factory=dict)
    bwd_dkdv_varlen: Mapping[int, KernelConfig] = field(default_factory=dict)
    # key lengths from which ``fwd_long`` applies
    long_seqlen_k: int = 8192
    decode: DecodeSettings = DecodeSettings()
    mla: MLASettings = MLASettings()
    # the kernels run in Triton's interpreter: small tiles that still cross several tiles, one config
    interpret: bool = False
    # packed batches of up to this many sequences map tiles to sequences in registers; larger ones by a
    # binary search over tile counts summed on the device (``kernels.common.varlen_schedule``)
    varlen_scan_batch: int = 2048
    # CUDA grids hold at most 65,535 programs along y and z: dense batches (grid z) beyond this run as a
    # packed batch of equal lengths, whose tiles are flat along x
    grid_z_batch: int = 65535
    # index values of KV-cache calls (cache_seqlens, cache_leftpad, cache_batch_idx, block tables) checked
    # on the host before the kernels run, a device sync per new tensor (True), or by the kernels where
    # they read them, an error raised by a later call or ``tileattn.check_errors`` (False, ``tileattn.
    # errors``; CPU tensors too, under the interpreter). None: on the device for CUDA tensors, on the
    # host for CPU tensors. TILEATTN_SYNC_CHECKS=1 when ``kernels.configs`` is imported makes it True.
    sync_checks: bool | None = None

    def __post_init__(self) -> None:  # the tables read-only too, so that a Settings value never changes
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                object.__setattr__(self, f.name, MappingProxyType(dict(value)))


@dataclass
class AttnParams:
    """Validated, normalised arguments of one attention call (see ``tileattn.api``).

    ``seqlen_q``/``seqlen_k`` are the padded lengths: the dense lengths, or max_seqlen in varlen mode.
    ``window_left``/``window_right`` already include causal (right = 0); -1 means unbounded."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    philox_seed: int = 0
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    deterministic: bool = False
    # FlashMask (``tileattn.masks``): the caller's ``startend_row_indices`` and whether the call is causal
    # (which decides what two columns mean); the ops layer turns them into ``flashmask``
    startend_row_indices: torch.Tensor | None = None
    mask_causal: bool = False
    flashmask: FlashMask | None = None
    # FP8 (e4m3) q, k, v: their descales, fp32 ``(3, batch, nheads_k)`` contiguous (q's, k's, v's; 1.0
    # where the caller gave none), by which the kernels scale the scores and the output (``tileattn.fp8``)
    descales: torch.Tensor | None = None
    # attention sinks: fp32 ``(nheads,)`` contiguous, one logit per query head that joins every row's
    # softmax denominator (no value vector; not scaled, capped or masked); the LSE includes it
    learnable_sink: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.descales is not None

    @property
    def drop_threshold(self) -> int:
        """``dropout_threshold(dropout_p)``: a draw's byte at or above it keeps its element."""
        return dropout_threshold(self.dropout_p)

    @property
    def keep_scale(self) -> float:
        """The factor of the kept weights, ``1 / (1 - dropout_p)`` (flash_attn's)."""
        return 1.0 / (1.0 - self.dropout_p)

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def block_d(self) -> int:
        """``padded_headdim`` of this call's head dim (at least 32 with FP8 inputs: the K of FP8
        tensor-core matmuls)."""
        padded = padded_headdim(self.headdim)
        return max(32, padded) if self.descales is not None else padded

    def as_4d(self, t: torch.Tensor) -> torch.Tensor:
        """Varlen ``(total, nheads, d)`` tensors are seen as one batch of ``total`` rows."""
        return t.unsqueeze(0) if self.is_varlen else t

    def strides(self, t4: torch.Tensor) -> tuple[int, int, int]:
        """(batch, row, head) strides of a 4-D view; varlen rows are addressed through cu_seqlens, so the
        batch stride is 0."""
        s = t4.stride()  # one call: each Tensor.stride(i) is a separate host round trip
        return (0 if self.is_varlen else s[0]), s[1], s[2]

    def lse_shape(self, q4: torch.Tensor) -> tuple[int, ...]:
        """The LSE's shape: ``(batch, nheads, seqlen_q)`` dense, ``(nheads, total_q)`` varlen."""
        nheads = q4.shape[2]
        return (nheads, q4.shape[1]) if self.is_varlen else (self.batch, nheads, self.seqlen_q)

    def new_lse(self, q4: torch.Tensor) -> torch.Tensor:
        """fp32 LSE buffer of ``lse_shape``."""
        return torch.empty(self.lse_shape(q4), device=q4.device, dtype=torch.float32)

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        """(batch, head) strides of an LSE-shaped buffer; varlen rows are offset by cu_seqlens_q."""
        s = lse.stride()
        if self.is_varlen:
            return 0, s[0]
        return s[0], s[1]

    @property
    def defer_scale(self) -> bool:
        """Whether the kernels may leave the softmax scale to the exponent's FMA (common.online_softmax):
        no softcap or ALiBi between the product and the exponent, and a positive scale (the row max of
        the raw products is then the max of the scaled scores; 0 or a negative scale would turn masked
        -inf scores into NaN or +inf)."""
        return self.softcap == 0 and self.alibi_slopes is None and self.softmax_scale > 0

    def alibi_batch_stride(self) -> int:
        slopes = self.alibi_slopes
        return slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0


@dataclass(frozen=True)
class FlashMask:
    """A FlashMask in the form the kernels and the CPU path read (``tileattn.flashmask.canonical``).

    ``bounds``: int32 ``(nheads_mask, 4, tokens_k)``, for each key token (``b * seqlen_k + j`` in dense
    calls, the packed row in varlen calls) the query rows ``[lower_start, lower_end)`` and
    ``[upper_start, upper_end)`` that it hides (rows counted from its sequence's start; an empty
    interval is ``(EMPTY, EMPTY)`` below and ``(0, 0)`` above). ``has_upper``: whether any call's mode
    uses the upper interval (else it is all empty and the kernels skip it). ``nheads_mask`` is 1 (one mask
    for every head) or the number of query heads."""

    bounds: torch.Tensor
    has_upper: bool

    @property
    def heads(self) -> int:
        return self.bounds.shape[0]


# The error record of index values checked on the device (``tileattn.errors``): int64 words ``[code,
# call, batch entry, j, value, bound, extra, 0]``, written by the first kernel that finds a bad value
# (the code last, after the others; -1 while they are written). ``call`` says which function's call.
RECORD_WORDS = 8
ERR_SEQLENS_NEGATIVE = 1  # value: cache_seqlens[b]
ERR_SEQLENS_CAPACITY = 2  # value: cache_seqlens[b], extra: the new tokens, bound: the capacity
ERR_LEFTPAD = 3  # value: cache_leftpad[b], extra: cache_seqlens[b]
ERR_BATCH_IDX = 4  # value: cache_batch_idx[b], bound: the cache's rows
ERR_BATCH_IDX_REPEATED = 5  # value: cache_batch_idx[b], j: the earlier entry with the same row
ERR_BLOCK_TABLE = 6  # j: the column, value: block_table[b, j], bound: the pool's pages
ERR_ROTARY = 7  # value: the position needed, bound: the rotary tables' rows
CALL_KVCACHE = 1  # flash_attn_with_kvcache
CALL_PAGED_VARLEN = 2  # flash_attn_varlen_func with block_table
CALL_MLA = 3  # flash_mla_with_kvcache


# The key under which a call signature's plan table (``CacheLayout.plans``) holds ``(settings, step)``: the
# step (``kernels.decode.plan.Step``) of a call the eager API may replay (``CacheLayout.replay``)
REPLAY = "replay"


@dataclass
class CacheLayout:
    """Where each sequence's keys live in a KV cache, validated by the API.

    seqlens_k: int32 ``(batch,)`` and new_tokens: each sequence's keys end at ``seqlens_k[b] +
    new_tokens`` in its cache row (cache_seqlens, and the tokens just appended); leftpad: int32
    ``(batch,)`` start, or None for 0; batch_idx: int32 ``(batch,)`` cache row of each sequence, or None
    for row b; block_table: int32 ``(batch, max_pages)`` or None; num_splits: 0 = heuristic;
    max_seqlen_k: the longest key range if known on the host (else the capacity is assumed); plans: a
    dict in which the launches of calls with the same metadata as this one are planned once (the API
    layer keeps one per call signature, ``kvcache.calls``), or None to plan them for this call only; q_rotary: ``(cos,
    sin, interleaved, per_token)`` to rotate q at ``seqlens_k[b]`` (plus its token index if per_token)
    as it is read (dense q only), or None; k_descale, v_descale: of FP8 caches; record: the error record
    (int64 ``(RECORD_WORDS,)``) into which the kernels write the first index value out of range they
    find, for a ``call`` (``CALL_*``), or None: values checked beforehand, or not at all (graph capture)."""

    seqlens_k: torch.Tensor
    new_tokens: int = 0
    leftpad: torch.Tensor | None = None
    batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    num_splits: int = 0
    max_seqlen_k: int | None = None
    plans: dict | None = None
    q_rotary: tuple | None = None
    # FP8 (e4m3) caches: fp32 ``(batch, nheads_k)`` contiguous descales of the keys and values (the cache
    # holds ``x_fp8 * descale``; the append divides by them), else None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    record: torch.Tensor | None = None
    call: int = 0
    # the record's pinned host copy (``errors.mirror_target``), into which the attention step copies the
    # record behind its kernels (``kernels.decode.plan.Step``), or None: the kernels write host memory, or
    # the caller copies it
    mirror: torch.Tensor | None = None
    # the eager API may replay this call's planned step for later calls with the same metadata, without
    # its checks (``REPLAY``, ``ops.kvcache.replay_kvcache``): no append, no rotary, a tensor
    # cache_seqlens, the arguments used as given, the values checked in the kernels (``record``)
    replay: bool = False
