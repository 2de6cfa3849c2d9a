"""The settings of every kernel, chosen in one place: per GPU arch (``for_device``), then per head dim and
feature (``fwd_config``, ``bwd_dkdv_config``, ``bwd_dq_config``). The tables are values
(``params.Settings``); callers that want others (the tuner, the bench, tests) pass their own through
``override``, which holds for the calls made inside it (a context variable: per thread and task).
The numbers behind each entry are in docs/perf.md ("Decisions").
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from dataclasses import replace

import torch

from tileattn.params import AttnParams, DecodeSettings, KernelConfig, MLASettings, Settings, interpreting

# TILEATTN_SYNC_CHECKS=1 (read once, when this module is imported): index values checked on the host
# before every KV-cache call, as ``Settings.sync_checks=True``; otherwise CUDA tensors' are checked by
# the kernels and reported by a later call (``tileattn.errors``).
SYNC_CHECKS = True if os.environ.get("TILEATTN_SYNC_CHECKS") == "1" else None

# Tiles by padded head dim, (BLOCK_M, BLOCK_N, warps, stages): the fastest of ``python -m
# tileattn.bench.tune`` on the H200 (bf16, 16k tokens), then the build variants measured against them.
HOPPER = Settings(
    fwd={
        16: KernelConfig(128, 64, 8, 3, maxnreg=128),
        32: KernelConfig(128, 64, 8, 3, maxnreg=128),
        64: KernelConfig(128, 64, 8, 3, maxnreg=128),
        # two blocks per SM at 128 registers, TMA row tiles
        128: KernelConfig(128, 64, 8, 2, tma=True, maxnreg=128),
        # TMA: the pointer-load build of these tiles is wrong for GQA at 255 registers (see fwd_pointer)
        256: KernelConfig(128, 64, 8, 2, tma=True),
    },
    # long key loops without a left window gain more from a deeper pipeline than from a second block
    fwd_long={128: KernelConfig(128, 64, 8, 3, tma=True)},
    # causal, no left window, under long_seqlen_k keys
    fwd_causal={128: KernelConfig(64, 64, 4, 3, tma=True)},
    # a left window and no dropout (a short key loop)
    fwd_window={64: KernelConfig(64, 64, 4, 3, maxnreg=128)},
    # FP8 inputs: one warpgroup of 64 rows over 128-key tiles (two CTAs an SM) up to head dim 128; V read
    # through its transposed copy (2-4x faster than V itself)
    fwd_fp8={
        64: KernelConfig(64, 128, 4, 3, tma=True),
        128: KernelConfig(64, 128, 4, 3, tma=True),
        256: KernelConfig(128, 64, 8, 3, tma=True),
    },
    fp8_v_transposed=True,
    # FlashAttention-3's warp-specialized forward in Gluon (kernels/gluon/forward.py): 128 query rows over
    # 128-key tiles (64 at head dim 256), one program per query tile, two stages; under gluon_short_seqlen_k
    # keys (short sequences, bounded windows) a persistent grid, with three stages at head dim 128 (at 256:
    # 1.02-1.06x one per tile dense at 1k-2k, 1.04-1.05x on windows, 0.98x causal 2k). Head dim 96 as 64 + 32
    # columns: 1.20-1.44x the portable forward (causal 1k-16k, not causal 2k and 16k). Head dim 64 from 16k keys
    # (gluon_min_seqlen_k; three consumer warpgroups of 192 rows: 1.01-1.09x, two 1.06-1.08x). The
    # branch-free mask loops (``mask_loops``) lost 0-15 % causal at 1k-4k: not taken
    fwd_gluon={
        64: KernelConfig(128, 128, 4, 2),
        96: KernelConfig(128, 128, 4, 2),
        128: KernelConfig(128, 128, 4, 2),
        256: KernelConfig(128, 64, 4, 2),
    },
    # head dim 64 on Gluon from 16k keys (H100: 1.06-1.08x the portable forward at 16k, 2026-12-08, and
    # 1.02-1.04x on 2026-12-07); under it the portable forward (Gluon 0.88-0.96x at 2k)
    gluon_min_seqlen_k={64: 16384},
    fwd_gluon_short={
        96: KernelConfig(128, 128, 4, 2),
        128: KernelConfig(128, 128, 4, 3),
        256: KernelConfig(128, 64, 4, 2),
    },
    # causal heads in groups whose K/V fits 32 MiB of L2 (FlashAttention-3's budget): 1.24-1.32x the order
    # over all heads at 1k, 1.22-1.30x at 2k (head dim 256: 0.94x), 1.08-1.13x at 4k, 1.00-1.05x at 16k
    gluon_l2_bytes=32 << 20,
    # the forward's tiles when TMA cannot read the inputs (unaligned rows, not sm90+)
    fwd_pointer={256: KernelConfig(64, 64, 4, 2)},
    # FlashAttention-3's warp-specialized backward in Gluon (kernels/gluon/backward.py), by head dim: at 128
    # it ran 1.37x (4k) and 1.50x (8k causal) the portable backward, level with cuDNN, the ring 3 deep
    # (+5 % at 4k, -3 % at 8k causal against 2); at 64 on query tiles of 128 rows, a ring of 2 (the most
    # that fits): 1.13-1.35x the portable backward, level with cuDNN (tiles of 64 ran 0.97-1.28x)
    # (docs/perf.md, "Gluon backward"). Head dim 256, the split build (64 keys a program, both warpgroups on
    # them), each tile's first dQ chunk issued before dV and dK: dQ in chunks of 32 columns through a ring of
    # 2 (1.17-1.47x the portable backward, 0.78-0.88x cuDNN; chunks of 64 leave room for one stage: 2-5 %
    # slower); with dropout a ring of 1 and chunks of 64 (the draws take the second stage's room; chunks of
    # 32 on one stage ran 10-12 % slower): 2.0-2.4x the portable backward, 0.77-1.05x cuDNN
    bwd_gluon={
        64: KernelConfig(128, 128, 4, 2),
        128: KernelConfig(64, 128, 4, 3),
        256: KernelConfig(64, 64, 4, 2, dq_first=True, dq_chunk=32),
    },
    # with dropout: query tiles of 64 rows at head dim 64 (128 spill: the draws and the 128-query Sᵀ and dPᵀ
    # do not fit 240 registers), a ring of 2 at 128 (the draws take the third stage's shared memory)
    bwd_gluon_dropout={
        64: KernelConfig(64, 128, 4, 3),
        128: KernelConfig(64, 128, 4, 2),
        256: KernelConfig(64, 64, 4, 1, dq_first=True),
    },
    bwd_dkdv={
        16: KernelConfig(64, 64, 4, 3),
        32: KernelConfig(64, 64, 4, 3),
        64: KernelConfig(64, 64, 4, 3),
        128: KernelConfig(64, 128, 8, 3),
        256: KernelConfig(64, 64, 8, 2),
    },
    # causal, no left window: dQ from the dK/dV pass by TMA reduce-adds (deterministic takes bwd_dkdv)
    bwd_dkdv_causal={128: KernelConfig(64, 128, 8, 3, dq_atomic=2)},
    # varlen without dropout: 32-key tiles compile spill-free at head dim 256
    bwd_dkdv_varlen={256: KernelConfig(64, 32, 8, 2)},
    bwd_dq={
        16: KernelConfig(128, 64, 8, 3, maxnreg=128),
        32: KernelConfig(128, 64, 8, 3, maxnreg=128),
        64: KernelConfig(128, 64, 8, 3, maxnreg=128),
        128: KernelConfig(128, 64, 8, 3),
        256: KernelConfig(128, 64, 8, 1),
    },
    long_seqlen_k=8192,
    decode=DecodeSettings(),
    sync_checks=SYNC_CHECKS,
)
# Other GPUs take the same tables (TMA builds fall back to pointer loads below sm90): only Hopper was measured.
PORTABLE = HOPPER
# Triton's interpreter (CPU tensors under TRITON_INTERPRET=1): small tiles that still cross several tiles.
_INTERPRET_TILES = {d: KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1) for d in (16, 32, 64, 128, 256)}
INTERPRETER = Settings(
    fwd=_INTERPRET_TILES,
    bwd_dkdv=_INTERPRET_TILES,
    bwd_dq=_INTERPRET_TILES,
    mla=MLASettings(block_n=16, block_m=16, stages=1, sm_count=4),
    interpret=True,
    sync_checks=SYNC_CHECKS,
)

_OVERRIDE: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("tileattn_settings", default=None)


@functools.cache
def _for_device(kind: str, index: int | None) -> Settings:
    if interpreting():  # (CUDA tensors too: the interpreter runs every kernel on the host)
        return INTERPRETER
    if kind != "cuda":
        return PORTABLE
    major, _ = torch.cuda.get_device_capability(index)
    return HOPPER if major == 9 else PORTABLE


def for_device(device: torch.device) -> Settings:
    """The settings measured for ``device``'s GPU arch (the interpreter's for CPU tensors)."""
    return _for_device(device.type, device.index)


def current(device: torch.device) -> Settings:
    """The settings calls on ``device`` use now: those of the innermost ``override``, else ``for_device``."""
    settings = _OVERRIDE.get()
    return settings if settings is not None else _for_device(device.type, device.index)


@contextlib.contextmanager
def override(settings: Settings) -> Iterator[Settings]:
    """Runs the calls made inside the block with ``settings`` (the tuner's candidates, the bench's
    variants, tests of builds the tables do not pick). It holds in this thread or task: an eager
    backward takes its forward's settings (``ops.attention``), but a compiled graph's backward, or a
    checkpoint's recomputation, runs with the defaults unless it runs inside the block too."""
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be a tileattn.params.Settings, got {type(settings).__name__}")
    token = _OVERRIDE.set(settings)
    try:
        yield settings
    finally:
        _OVERRIDE.reset(token)


def with_builds(
    s: Settings, fwd: dict | None = None, dkdv: dict | None = None, dq: dict | None = None, gluon: dict | None = None
) -> Settings:
    """``s`` with these ``KernelConfig`` fields changed in every entry of the portable forward's tables
    (``fwd``), the dK/dV pass's (``dkdv``), the dQ pass's (``dq``) and the Gluon forward's (``gluon``):
    builds the tables do not pick (TMA, warp specialisation, query-major tiles, dQ accumulation, the
    exponentials' split), for tests and the bench."""

    def changed(table, changes):
        return {d: replace(cfg, **changes) for d, cfg in table.items()} if changes else table

    return replace(
        s,
        fwd=changed(s.fwd, fwd),
        fwd_long=changed(s.fwd_long, fwd),
        fwd_causal=changed(s.fwd_causal, fwd),
        fwd_window=changed(s.fwd_window, fwd),
        fwd_pointer=changed(s.fwd_pointer, fwd),
        fwd_fp8=changed(s.fwd_fp8, fwd),
        bwd_dkdv=changed(s.bwd_dkdv, dkdv),
        bwd_dkdv_causal=changed(s.bwd_dkdv_causal, dkdv),
        bwd_dkdv_varlen=changed(s.bwd_dkdv_varlen, dkdv),
        bwd_dq=changed(s.bwd_dq, dq),
        fwd_gluon=changed(s.fwd_gluon, gluon),
        fwd_gluon_short=changed(s.fwd_gluon_short, gluon),
        fwd_gluon_fp8=changed(s.fwd_gluon_fp8, gluon),
    )


def _interpreted(cfg: KernelConfig, p: AttnParams) -> KernelConfig:
    """Dropout draws cover 64 key columns each (tileattn.rng): key tiles are multiples of 64 with dropout."""
    return replace(cfg, block_n=max(cfg.block_n, 64)) if p.dropout_p > 0 else cfg


def fwd_config(p: AttnParams, s: Settings, tma_ok: bool = True) -> KernelConfig:
    """The forward's tiles; ``tma_ok=False`` when the inputs cannot be read through TMA descriptors."""
    cfg = s.fwd[p.block_d]
    if s.interpret:
        cfg = _interpreted(cfg, p)
    elif p.is_fp8:
        cfg = s.fwd_fp8.get(p.block_d, cfg)
    elif p.window_left < 0:  # no left window (which keeps the key loop short): the shape tables
        if p.seqlen_k >= s.long_seqlen_k:
            cfg = s.fwd_long.get(p.block_d, cfg)
        elif p.window_right == 0:
            cfg = s.fwd_causal.get(p.block_d, cfg)
    elif p.dropout_p == 0:  # windows were timed without dropout (whose build spills more with these tiles)
        cfg = s.fwd_window.get(p.block_d, cfg)
    if cfg.tma and not tma_ok:
        return s.fwd_pointer.get(p.block_d, replace(cfg, tma=False))
    return cfg


def gluon_fwd_config(p: AttnParams, s: Settings, headdim: int) -> tuple[KernelConfig, bool] | None:
    """The Gluon forward's entry for a call (and whether it is the persistent grid's, ``fwd_gluon_short``),
    or None where the settings give the call's head dim to the portable forward: not in the table, or
    fewer keys than ``gluon_min_seqlen_k`` asks. The keys are those a query block sees at most: the
    sequence's, or under a window bounded on both sides the window's and the block's rows."""
    table, short_table = (s.fwd_gluon_fp8, {}) if p.is_fp8 else (s.fwd_gluon, s.fwd_gluon_short)
    if headdim not in table:
        return None
    keys = p.seqlen_k
    if p.window_left >= 0 and p.window_right >= 0:
        keys = min(keys, p.window_left + p.window_right + table[headdim].block_m)
    if not p.is_fp8 and keys < s.gluon_min_seqlen_k.get(headdim, 0):
        return None
    short = keys < s.gluon_short_seqlen_k and headdim in short_table
    return (short_table if short else table)[headdim], short


def bwd_dkdv_config(p: AttnParams, s: Settings) -> KernelConfig:
    """The dK/dV pass's tiles (and whether it also accumulates dQ)."""
    cfg = s.bwd_dkdv[p.block_d]
    if s.interpret:
        return _interpreted(cfg, p)
    if p.is_varlen and p.dropout_p == 0:
        cfg = s.bwd_dkdv_varlen.get(p.block_d, cfg)
    # a causal entry takes precedence over a varlen one (no head dim has both today)
    if p.window_left < 0 and p.window_right == 0 and not p.deterministic:  # causal without a left window
        cfg = s.bwd_dkdv_causal.get(p.block_d, cfg)
    return cfg


def bwd_dq_config(p: AttnParams, s: Settings) -> KernelConfig:
    """The dQ pass's tiles."""
    cfg = s.bwd_dq[p.block_d]
    return _interpreted(cfg, p) if s.interpret else cfg
