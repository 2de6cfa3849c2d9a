"""Launch parameters shared by the kernels, and tile/warp/stage choices per head dim.

``AttnParams`` is what the API layer hands to every launcher once it has validated the arguments:
normalised window, scale, dropout seed and the varlen description. The tile tables below were
measured on the H200 (docs/perf.md); under the Triton interpreter small tiles keep CPU runs short
while still crossing several tiles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton 3.6 made it a constexpr function, whose call wrapper costs
    microseconds per host call (several per launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (the same values; see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def padded_headdim(headdim: int) -> int:
    """The head dim the kernels compute with (their ``BLOCK_D``, the tables' key): the next power of
    two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(headdim))


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


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class KernelConfig:
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
    # a register cap per thread for ptxas (None: its own choice, up to 255). Two CTAs of 8 warps fit an
    # SM only at <= 128 registers; the masked builds (varlen, windows, dropout) take more than the dense
    # one of the same tiles unless capped (scripts/compile_report.py).
    maxnreg: int | None = None
    # dK/dV kernel only: also accumulate dQ with fp32 atomic adds (1) or TMA reduce-adds (2, sm90+) and
    # skip the dQ pass (two fewer matmuls per tile pair); never with deterministic=True. Where TMA cannot
    # write the fp32 buffer, mode 2 takes the dQ pass on the GPU (the atomic adds were slower than it in
    # every measured cell) and the atomic adds under the interpreter, which does not emulate TMA stores.
    dq_atomic: int = 0


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

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def block_d(self) -> int:
        """``padded_headdim`` of this call's head dim."""
        return padded_headdim(self.headdim)

    @property
    def batch_pad(self) -> int:
        return next_power_of_2(self.batch) if self.is_varlen else 1

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


_INTERPRET_CONFIG = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
# Dropout draws cover 64 key columns each (tileattn.rng), so key tiles are multiples of 64 with dropout.
_INTERPRET_DROPOUT_CONFIG = KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=1)


def _interpret_config(p: AttnParams) -> KernelConfig:
    return _INTERPRET_DROPOUT_CONFIG if p.dropout_p > 0 else _INTERPRET_CONFIG


# Tiles by padded head dim: (BLOCK_M, BLOCK_N, warps, stages), the fastest of
# ``python -m tileattn.bench.tune`` on the H200 (bf16, 16k tokens, seqlen 4096; docs/perf.md), then the
# variants of scripts/features_variant.py measured against them in the same runs.
# Head dim 256 has its own candidate list (smaller tiles, fewer stages) in the sweep.
# KernelConfig.tma (row tiles through TMA descriptors): head dim 256's pointer-load build of its tiles
# (128 x 64, 8 warps, 2 stages) compiles to 255 registers and gives wrong outputs or illegal-address
# faults for GQA inputs (a runtime group size) at 4 x 4096 tokens; the TMA build of the same tiles (239
# registers) is correct and as fast (docs/perf.md, "head dim 256 forward"). Inputs TMA cannot read fall
# back to _FWD_POINTER, or to the same tiles without TMA.
# KernelConfig.maxnreg=128 (two blocks of 8 warps per SM, so that one block's softmax overlaps the other's
# tensor-core work): head dim 128's forward with two stages (96 KiB of shared memory) and TMA is
# spill-free at 128 registers for the dense, GQA, causal, window and softcap builds (dropout spills 120
# bytes), +2-9 % over one block per SM at 1k-4k tokens and +14-18 % on windows; head dims <= 64
# (forward and dQ), whose masked builds took 158-220 registers, gain 26-39 % on varlen and windows
# forward, the dense rows unchanged (docs/perf.md, "two blocks per SM").
_FWD = {
    16: KernelConfig(128, 64, 8, 3, maxnreg=128),
    32: KernelConfig(128, 64, 8, 3, maxnreg=128),
    64: KernelConfig(128, 64, 8, 3, maxnreg=128),
    128: KernelConfig(128, 64, 8, 2, tma=True, maxnreg=128),
    256: KernelConfig(128, 64, 8, 2, tma=True),
}
# Key lengths from LONG_SEQLEN_K up, without a left window (varlen: max_seqlen_k): one block per SM with
# three TMA stages is faster at head dim 128 (+5-7 % causal at 8k-16k tokens): a long key loop gains more
# from the deeper pipeline than from the second block, which at shorter lengths mostly hides each
# program's prologue and epilogue.
LONG_SEQLEN_K = 8192
_FWD_LONG = {
    128: KernelConfig(128, 64, 8, 3, tma=True),
}
# Causal calls (no left window) under LONG_SEQLEN_K keys, where an entry is given. Head dim 128: 64 x 64
# tiles, 4 warps, 3 TMA stages (149 registers, 113 KiB: two blocks per SM): +3-10 % causal at 1k-4k
# tokens and +14 % varlen causal at 4 x 4096, -4 to -14 % without the mask (docs/perf.md, "Smaller query
# blocks" and "The causal tables at head dim 128"); its at-scale tests and the GPU suite passed with it.
_FWD_CAUSAL: dict[int, KernelConfig] = {
    128: KernelConfig(64, 64, 4, 3, tma=True),
}
# Calls with a left window and no dropout (a key loop of window / BLOCK_N tiles). Head dim 64: 64-row
# blocks of 4 warps, +2-6 % on a (512, 512) window and +7-13 % on (512, 0) at 4 x 4096 tokens in two
# runs, where dense and causal calls are level or slower with them (docs/perf.md, "Smaller query blocks
# for windows" and "Head dim 64's window forward"). Dropout keeps the plain tiles: untimed, and its
# build spills more with these (40 bytes against 16).
_FWD_WINDOW: dict[int, KernelConfig] = {
    64: KernelConfig(64, 64, 4, 3, maxnreg=128),
}
# The forward's tiles when a TMA config cannot read the inputs (common.use_tma is false: unaligned rows,
# strides, not an NVIDIA sm90+ GPU): correct at 4 x 4096 GQA, 382-396 TFLOP/s at head dim 256. It too
# compiles to 255 registers (14 spills); since the fault above is not isolated, test_tables_gqa_at_scale
# runs it at scale (128 x 32, 8 warps: 243 registers, 318-354 TFLOP/s, is the next choice).
_FWD_POINTER = {
    256: KernelConfig(64, 64, 4, 2),
}
# Backward: the dK/dV pass walks query tiles for a block of keys, the dQ pass key tiles for a block
# of queries.
_BWD_DKDV = {
    16: KernelConfig(64, 64, 4, 3),
    32: KernelConfig(64, 64, 4, 3),
    64: KernelConfig(64, 64, 4, 3),
    128: KernelConfig(64, 128, 8, 3),
    256: KernelConfig(64, 64, 8, 2),
}
# Causal calls (no left window): dQ from the dK/dV pass by TMA reduce-adds at head dim 128, +8-10 % on
# the causal backward at 2k and 8k tokens (one run); the same at head dim 64 was level (-0 to +2 %),
# both slower without the mask (-5 to -11 % at 2k: the dK/dV program's extra dQ tile traffic is not
# repaid when no tiles are skipped), and head dim 256's tiles run out of shared memory with the fp32
# dQ tile (docs/perf.md, "dQ from the dK/dV pass"). deterministic=True takes _BWD_DKDV's dQ pass.
_BWD_DKDV_CAUSAL = {
    128: KernelConfig(64, 128, 8, 3, dq_atomic=2),
}
# Varlen calls without dropout (dropout draws cover 64 key columns, so its key tiles stay at 64): at head
# dim 256, 32-key dK/dV tiles compile spill-free (174-192 registers, 100 KiB) where the table's 64-key build
# spills 776 bytes for varlen, +8 % varlen and +10-14 % varlen causal at 2k-8k tokens, while dense and
# causal calls are 9-36 % slower with them (docs/perf.md, "Head dim 256's backward tiles").
_BWD_DKDV_VARLEN = {
    256: KernelConfig(64, 32, 8, 2),
}
_BWD_DQ = {
    16: KernelConfig(128, 64, 8, 3, maxnreg=128),
    32: KernelConfig(128, 64, 8, 3, maxnreg=128),
    64: KernelConfig(128, 64, 8, 3, maxnreg=128),
    128: KernelConfig(128, 64, 8, 3),
    256: KernelConfig(128, 64, 8, 1),
}
# The tables that take precedence over _FWD's and _BWD_DKDV's entries for some calls (the tuner sets
# them aside while it times candidates for those entries).
SHAPE_TABLES = (_FWD_LONG, _FWD_CAUSAL, _FWD_WINDOW, _BWD_DKDV_CAUSAL, _BWD_DKDV_VARLEN)


def fwd_config(p: AttnParams, tma_ok: bool = True) -> KernelConfig:
    """The forward's tiles; ``tma_ok=False`` when the inputs cannot be read through TMA descriptors."""
    if interpreting():
        return _interpret_config(p)
    cfg = _FWD[p.block_d]
    if p.window_left < 0:  # no left window (which keeps the key loop short): the shape tables
        if p.seqlen_k >= LONG_SEQLEN_K:
            cfg = _FWD_LONG.get(p.block_d, cfg)
        elif p.window_right == 0:
            cfg = _FWD_CAUSAL.get(p.block_d, cfg)
    elif p.dropout_p == 0:  # windows were timed without dropout (whose build spills more with these tiles)
        cfg = _FWD_WINDOW.get(p.block_d, cfg)
    if cfg.tma and not tma_ok:
        return _FWD_POINTER.get(p.block_d, replace(cfg, tma=False))
    return cfg


def bwd_dkdv_config(p: AttnParams) -> KernelConfig:
    if interpreting():
        return _interpret_config(p)
    cfg = _BWD_DKDV[p.block_d]
    if p.is_varlen and p.dropout_p == 0:
        cfg = _BWD_DKDV_VARLEN.get(p.block_d, cfg)
    # a causal entry takes precedence over a varlen one (no head dim has both today)
    if p.window_left < 0 and p.window_right == 0 and not p.deterministic:  # causal without a left window
        cfg = _BWD_DKDV_CAUSAL.get(p.block_d, cfg)
    return cfg


def bwd_dq_config(p: AttnParams) -> KernelConfig:
    return _interpret_config(p) if interpreting() else _BWD_DQ[p.block_d]
