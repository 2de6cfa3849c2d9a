"""The kernels as compiled for the H200 (sm_90a), checked without a GPU: Triton compiles the launch's
specialisation for that target (scripts/compile_report.py, with the H200's settings, configs.HOPPER) and
the cubin's resources are read back. These are performance properties the tables rely on (docs/perf.md,
"Compiler resources")."""

import importlib.metadata

import pytest
import torch

from helpers import SLOW, TUNED_TRITON, compiled_sm90

# Every case compiles for a fixed target (compile_report's H200), never the machine's GPU: CPU CI, with the
# same Triton 3.6.0, builds exactly what a GPU machine would. There the 18 cases took 317 s of the GPU
# suite's worker time (44 s the longest), repeating CI's result: skipped unless TILEATTN_SLOW=1.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and not SLOW,
    reason="compile-only for a fixed sm_90a target, as CPU CI runs it: on a GPU machine TILEATTN_SLOW=1 runs it",
)


FWD_CASES = """
rows += compile_report.compile_case(64, "dense", ["fwd"], batch=1, seqlen=1024)
rows += compile_report.compile_case(256, "gqa", ["fwd"], batch=1, seqlen=1024)
rows += compile_report.compile_case(128, "dense", ["fwd"], batch=1, seqlen=1024)
rows += compile_report.compile_case(128, "causal", ["fwd"], batch=1, seqlen=1024)
rows += compile_report.compile_case(128, "causal", ["fwd"], batch=1, seqlen=8192)
rows += compile_report.compile_case(64, "window", ["fwd"], batch=1, seqlen=1024)
"""


def test_forward_builds_as_the_tables_assume():
    """Head dim 64's dense forward fits two blocks per SM (<= 128 registers, 64 KiB of shared memory)
    without spills; head dim 256's forward is the TMA build of its tiles, under the register limit; head
    dim 128's dense forward is a spill-free TMA build at <= 128 registers, two blocks per SM, its causal
    forward (Settings.fwd_causal's entry, else the same) a spill-free TMA build with two blocks per SM,
    and from Settings.long_seqlen_k keys on a one-block three-stage TMA build; head dim 64's window
    forward (Settings.fwd_window) at <= 128 registers, four blocks per SM, spill-free with Triton 3.6."""
    hd64, hd256, hd128, hd128_causal, hd128_long, hd64_window = compiled_sm90(FWD_CASES)
    assert hd64["kernel"] == "_attn_fwd" and hd64["regs"] <= 128 and hd64["stack"] == 0, hd64
    assert hd64["shared"] <= 64 * 1024 and hd64["blocks_per_sm"] >= 2, hd64
    assert hd256["tma"] and hd256["regs"] < 255 and hd256["stack"] == 0, hd256
    assert hd128["tma"] and hd128["regs"] <= 128 and hd128["stack"] == 0, hd128
    assert hd128["blocks_per_sm"] == 2, hd128
    assert hd128_causal["tma"] and hd128_causal["stack"] == 0 and hd128_causal["blocks_per_sm"] >= 2, hd128_causal
    assert hd128_long["tma"] and hd128_long["stack"] == 0 and hd128_long["blocks_per_sm"] == 1, hd128_long
    assert hd64_window["config"][:3] == [64, 64, 4] and hd64_window["regs"] <= 128, hd64_window
    assert (hd64_window["stack"] == 0 or not TUNED_TRITON) and hd64_window["blocks_per_sm"] == 4, hd64_window


BWD_CASES = """
rows += compile_report.compile_case(256, "varlen", ["bwd"], batch=1, seqlen=1024)
rows += compile_report.compile_case(256, "dense", ["bwd"], batch=1, seqlen=1024)
rows = [r for r in rows if r["kernel"] == "_attn_bwd_dkdv"]
"""


def test_varlen_backward_builds_as_the_tables_assume():
    """Head dim 256's varlen dK/dV pass (Settings.bwd_dkdv_varlen: 32-key tiles) compiles without spills;
    the plain table's 64-key build (dense calls) spills, which is why varlen has its own entry."""
    dkdv, dense = compiled_sm90(BWD_CASES)
    assert dkdv["config"][:2] == [64, 32] and dkdv["stack"] == 0 and dkdv["regs"] < 255, dkdv
    assert dense["config"][:2] == [64, 64] and dense["stack"] > 0, dense


# The H200's settings, planning with programmatic dependent launches (the stand-in target's tensors are
# CPU tensors, for which the planner would not count on them).
H200 = """
import dataclasses
from tileattn.kernels import configs
h200 = dataclasses.replace(configs.HOPPER, decode=dataclasses.replace(configs.HOPPER.decode, has_pdl=True))
"""

DECODE_CASES = (
    H200
    + """
with configs.override(h200):
    rows += compile_report.compile_decode(1, 131072, None)
    rows += compile_report.compile_decode(1, 131072, 16)
    rows += compile_report.compile_decode(1, 131072, 256)
    rows += compile_report.compile_decode(64, 4096, None)
    rows += compile_report.compile_decode(64, 4096, 16)
    rows += compile_report.compile_decode(64, 4096, 256)
    rows += compile_report.compile_decode(1, 8192, None)
    rows += compile_report.compile_decode(1, 8192, 16)
    rows += compile_report.compile_decode(1, 8192, 256)
    rows += compile_report.compile_decode(1, 16384, None)
    rows += compile_report.compile_decode(1, 16384, 16)
"""
)


def test_decode_builds_as_the_settings_assume():
    """The decode builds of bench --decode's rows: at 1 x 128k the split kernel (three stages, one block
    per SM) signals its dependent combine (launched with PDL); pages of 16 and 256 take the five-stage
    pointer-load build (two K/V tiles in flight), spill-free in the shared memory of one block; 64 x 4k's
    full grid of short programs the two-stage build, two blocks per SM. The paged pointer-load builds'
    key loop (unmasked tiles) issues at most 15 % more instructions than the contiguous build's in the
    same grid: its page lookup adds int32 arithmetic for each row a thread loads (one lookup per tile for
    pages of whole tiles), where 64-bit offsets doubled the loop (docs/perf.md). 1 x 8k's short programs
    take 64-key tiles; paged builds in grids under two waves prefetch their table sectors into L2. Every
    attention build is launched as a programmatic dependent and loads nothing before its
    griddepcontrol.wait."""
    rows = compiled_sm90(DECODE_CASES)
    split, combine, paged16, _, paged256, _, full, full16, full256 = rows[:9]
    short, _, short16, _, short256, _, eight, _, eight16, _ = rows[9:]
    assert split["config"][3] == 3 and split["gdc_signal"] and not split["tma"] and split["stack"] == 0, split
    # launched as a dependent, the combine must wait for the split kernel's partials in its code
    assert combine["kernel"] == "_combine" and combine["pdl_launch"] and combine["gdc_wait"], combine
    assert paged16["config"][3] == 5 and not paged16["tma"] and paged16["stack"] == 0, paged16
    assert paged16["blocks_per_sm"] == 1, paged16
    assert paged256["config"][3] == 5 and not paged256["tma"] and paged256["stack"] == 0, paged256
    assert paged256["blocks_per_sm"] == 1, paged256
    assert full["config"][3] == 2 and full["grid"][2] == 1 and full["blocks_per_sm"] == 2, full
    assert full["stack"] == 0, full
    for paged in (paged16, paged256):
        assert paged["tile_loop"] <= 1.15 * split["tile_loop"], (paged, split)
    for paged in (full16, full256):
        assert not paged["tma"] and paged["blocks_per_sm"] == 2, paged
        assert paged["tile_loop"] <= 1.15 * full["tile_loop"], (paged, full)
    # 1 x 8k: one wave of programs of four 128-key tiles, built with 64-key tiles (DecodeSettings.short_block_n)
    # at three stages; the paged builds prefetch their table sectors into L2 (a predicated prefetch)
    for build in (short, short16, short256):
        assert build["config"][1:] == [64, 4, 3] and build["grid"] == [1, 8, 16] and build["stack"] == 0, build
    assert not short["table_to_l2"] and short16["table_to_l2"] and short256["table_to_l2"], (short, short16)
    # 1 x 16k: eight tiles per program; pages smaller than a tile keep 128-key tiles there
    # (DecodeSettings.short_small_page_tiles)
    assert eight["config"][1] == 64 and eight16["config"][1] == 128 and eight16["grid"] == [1, 8, 16], (eight, eight16)
    assert paged16["table_to_l2"] and not full16["table_to_l2"], (paged16, full16)  # (grids under two waves)
    # every attention build is a programmatic dependent of the kernel ahead (DecodeSettings.pdl_attn), which
    # may still be writing its inputs: no global load or async copy before its griddepcontrol.wait
    for build in (split, paged16, paged256, full, full16, full256, short, short16, short256, eight, eight16):
        assert build["kernel"] == "_attn_fwd_kvcache" and build["pdl_launch"] and build["gdc_wait"], build
        assert build["loads_before_wait"] == 0, build
    assert combine["loads_before_wait"] == 0, combine


FP8_DECODE_CASES = """
import dataclasses
import re
import torch
from tileattn.kernels import configs, decode
from tileattn.params import AttnParams, CacheLayout
for widen, d, page in (("f16", 128, None), ("fp8", 128, None), ("none", 128, None), ("none", 256, 256)):
    h200 = dataclasses.replace(configs.HOPPER, decode=dataclasses.replace(configs.HOPPER.decode, fp8_widen=widen))
    q = torch.empty(8, 1, 32, d, dtype=torch.bfloat16)
    table = None
    if page:
        cache = torch.empty(8 * 32768 // page, page, 8, d, dtype=torch.float8_e4m3fn)
        table = torch.arange(8 * 32768 // page, dtype=torch.int32).view(8, -1)
    else:
        cache = torch.empty(8, 32768, 8, d, dtype=torch.float8_e4m3fn)
    descale = torch.ones(8, 8)
    c = CacheLayout(seqlens_k=torch.full((8,), 32768, dtype=torch.int32), block_table=table, max_seqlen_k=32768,
                    k_descale=descale, v_descale=descale)
    p = AttnParams(batch=8, seqlen_q=1, seqlen_k=32768, headdim=d, softmax_scale=0.1)
    with configs.override(h200):
        decode.attn_fwd_kvcache(q, cache, cache, p, c, configs.current(q.device))
    for name, kernel, kw in compile_report._LAUNCHES:
        if name == "_attn_fwd_kvcache":
            ptx = kernel.asm["ptx"]
            mma = sorted(set(re.findall(r"(?:mma\\.sync|wgmma\\.mma_async\\.sync)\\.aligned\\.[\\w.]+", ptx)))
            cvt = len(re.findall(r"cvt\\.rn\\.f16x2\\.e4m3x2", ptx))
            rows.append(dict(widen=widen, block_m=kw["BLOCK_M"], mma=mma, widenings=cvt, **compile_report.resources(kernel)))
    compile_report._LAUNCHES.clear()
"""


def test_fp8_cache_decode_builds():
    """FP8 caches at 8 x 32k (GQA 32/8, head dim 128): DecodeSettings.fp8_widen "f16" widens K and V for
    16-row fp16 MMAs; "fp8" runs q·kᵀ as e4m3 warpgroup MMAs (64-row blocks: the only MMA that takes e4m3
    on Hopper) and widens V alone, half the conversions, spill-free; "none" runs P·V so too (V's tiles
    read key-major by byte permutes) and widens nothing; at head dim 256 (paged, pages of 256) over 8
    warps, spill-free."""
    f16, fp8, none, none256 = compiled_sm90(FP8_DECODE_CASES)
    assert f16["block_m"] == 16 and f16["mma"] == ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"], f16
    assert fp8["block_m"] == 64 and "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in fp8["mma"], fp8
    assert fp8["widenings"] <= 0.55 * f16["widenings"] and fp8["stack"] == 0 and f16["stack"] == 0, (f16, fp8)
    e4m3 = ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"]
    assert none["block_m"] == 64 and none["mma"] == e4m3 and none["widenings"] == 0 and none["stack"] == 0, none
    assert none256["warps"] == 8 and none256["widenings"] == 0 and none256["stack"] == 0, none256
    assert all(m.endswith("e4m3.e4m3") for m in none256["mma"]), none256


CHECK_CASES = (
    H200
    + """
import re
import torch
from tileattn.kernels import decode
from tileattn.params import CALL_KVCACHE, AttnParams, CacheLayout
record = torch.zeros(8, dtype=torch.int64)
q = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16)
pool = torch.empty(8192, 16, 8, 128, dtype=torch.bfloat16)
table = torch.arange(8192, dtype=torch.int32).view(1, -1)
seqlens = torch.full((1,), 131072, dtype=torch.int32)
p = AttnParams(batch=1, seqlen_q=1, seqlen_k=131072, headdim=128, softmax_scale=0.1)
with configs.override(h200):
    for checked in (False, True):  # 1 x 128k over pages of 16: planned without the longest sequence when checked
        c = CacheLayout(seqlens_k=seqlens, block_table=table, max_seqlen_k=None if checked else 131072,
                        record=record if checked else None, call=CALL_KVCACHE)
        decode.attn_fwd_kvcache(q, pool, pool, p, c, configs.current(q.device))
    new = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16)
    decode.kvcache_append(pool, pool, new, new, None, seqlens - 1, None, table, leftpad=seqlens, span=1,
                          record=record, call=CALL_KVCACHE)
    # MLA at DeepSeek's head dims (its key loop spills at 255 registers): plain, then checking
    from tileattn.kernels.decode import mla
    latent = torch.empty(4096, 64, 1, 576, dtype=torch.bfloat16)
    meta, splits = torch.zeros(132, 8, dtype=torch.int32), torch.zeros(65, dtype=torch.int32)
    for checked in (None, record):
        mla.mla_fwd(torch.empty(64, 1, 128, 576, dtype=torch.bfloat16), latent, table.view(64, 128)[:, :64],
                    seqlens.expand(64).contiguous(), meta, splits, 512, 0.1, True, configs.current(q.device), checked)
for name, kernel, kw in compile_report._LAUNCHES:
    ptx = kernel.asm["ptx"]
    row = dict(kernel=name, grid=kw["grid"], check=kw.get("CHECK"), **compile_report.resources(kernel))
    row["claims"] = len(re.findall(r"atom\\.global\\.acq_rel\\.sys\\.cas\\.b64", ptx))
    row["releases"] = len(re.findall(r"atom\\.global\\.sys\\.release\\.exch\\.b64", ptx))
    if name in ("_attn_fwd_kvcache", "_mla_fwd"):
        row.update(tile_loop=compile_report.tile_loop(kernel), loads_before_wait=compile_report.loads_before_wait(ptx))
    if name != "_combine":
        rows.append(row)
compile_report._LAUNCHES.clear()
"""
)


def test_decode_builds_that_check_index_values():
    """The builds of calls whose kernels check their index values (``tileattn.errors``, CHECK): 1 x 128k
    over pages of 16 is the plain build's grid and key loop (to within 1 %), spill-free, one block per SM,
    loading nothing before its griddepcontrol.wait; MLA's key loop (which spills) is the plain build's,
    its spills no larger; each claims the error record with a system-scope compare-and-swap (the host
    reads it) and releases its code with a system-scope exchange, and so does the append."""
    plain, checked, append, mla_plain, mla_checked = compiled_sm90(CHECK_CASES)
    assert plain["check"] == 0 and checked["check"] == 1 and checked["grid"] == plain["grid"], (plain, checked)
    assert checked["stack"] == 0 and checked["blocks_per_sm"] == plain["blocks_per_sm"], (plain, checked)
    assert checked["tile_loop"] <= 1.01 * plain["tile_loop"] and checked["loads_before_wait"] == 0, (plain, checked)
    assert plain["claims"] == 0 and checked["claims"] == checked["releases"] == 1, (plain, checked)
    assert append["kernel"] == "_rotate_rows" and append["claims"] == append["releases"] == 1, append
    assert mla_checked["check"] == 3 and mla_checked["claims"] == mla_checked["releases"] == 1, mla_checked
    assert mla_checked["stack"] <= mla_plain["stack"], (mla_plain, mla_checked)
    assert mla_checked["tile_loop"] <= 1.01 * mla_plain["tile_loop"], (mla_plain, mla_checked)


EDGE_CASES = (
    H200
    + """
import torch
from tileattn.kernels import decode
from tileattn.params import AttnParams, CacheLayout
with configs.override(h200):
    rows += compile_report.compile_decode(1, 256, 256)
    rows += compile_report.compile_decode(1, 16, 16)
# 64-bit cache offsets for every call (DecodeSettings.offs_64_always)
wide = dataclasses.replace(h200, decode=dataclasses.replace(h200.decode, offs_64_always=True))
with configs.override(wide):
    rows += compile_report.compile_decode(1, 8192, 256, nheads=4, nheads_k=1, d=1)
    rows += compile_report.compile_decode(1, 8192, 16, nheads=4, nheads_k=1, d=1)
# a block table of 2**31 keys: capacity becomes an int64 argument (pages of stride 0: nothing allocated)
pool = torch.empty(256 * 128, dtype=torch.bfloat16).as_strided((2**23, 256, 1, 128), (0, 128, 128, 1))
for leftpad in (None, torch.zeros(1, dtype=torch.int32)):
    c = CacheLayout(seqlens_k=torch.full((1,), 4096, dtype=torch.int32), leftpad=leftpad,
                    block_table=torch.zeros(1, 2**23, dtype=torch.int32), max_seqlen_k=4096)
    p = AttnParams(batch=1, seqlen_q=1, seqlen_k=2**31, headdim=128, softmax_scale=0.1)
    decode.attn_fwd_kvcache(torch.empty(1, 1, 4, 128, dtype=torch.bfloat16), pool, pool, p, c, wide)
    rows += [dict(kernel=n, offs_64=kw["OFFS_64"], loads_before_wait=compile_report.loads_before_wait(k.asm["ptx"]))
             for n, k, kw in compile_report._LAUNCHES if "OFFS_64" in kw]
    compile_report._LAUNCHES.clear()
"""
)


def test_decode_compiles_at_the_edges():
    """Triton passes an int argument equal to 1 as a constant, and one of 2**31 or more as int64. The
    decode kernel must compile for a pool of one page (of 256 or of 16 keys: the clamp of table
    entries, decode.paging.pool_page), for unit strides in its 64-bit offsets (head dim 1, one kv head:
    decode.paging.wide_product), and for a block table of 2**31 keys with 64-bit offsets (with and
    without cache_leftpad), loading nothing before its griddepcontrol.wait in either."""
    rows = compiled_sm90(EDGE_CASES)
    kernels = [r["kernel"] for r in rows]
    assert kernels.count("_attn_fwd_kvcache") >= 6 and set(kernels) <= {"_attn_fwd_kvcache", "_combine"}, rows
    assert [r["offs_64"] for r in rows if "offs_64" in r] == [True, True], rows
    # (as programmatic dependents, the builds with and without leftpad load nothing before the wait)
    assert [r["loads_before_wait"] for r in rows if "offs_64" in r] == [0, 0], rows


ROTARY_Q_CASES = (
    H200
    + """
with configs.override(h200):
    for page in (None, 16):
        for seqlen_q in (1, 4):
            for rotary in (None, "interleaved", "neox"):
                rows += [r for r in compile_report.compile_decode(1, 8192, page, seqlen_q=seqlen_q, rotary=rotary)
                         if r["kernel"] == "_attn_fwd_kvcache"]
"""
)


def test_decode_builds_that_rotate_q():
    """The attention kernel rotating q as it reads it (CacheLayout.q_rotary; interleaved and NeoX, one
    and four query tokens, contiguous and paged caches) compiles without spills, and its key loop is the
    plain build's to within 2 %: the rotation is work before the loop. (ptxas gives the contiguous
    interleaved build with four query tokens all 255 registers, spill-free; docs/perf.md.)"""
    rows = compiled_sm90(ROTARY_Q_CASES)
    assert len(rows) == 12, rows
    assert all(row["loads_before_wait"] == 0 for row in rows), rows  # (q and its tables read after the wait)
    for plain, *rotating in (rows[i : i + 3] for i in range(0, 12, 3)):
        for row in rotating:
            assert row["stack"] == 0 and row["tile_loop"] <= 1.02 * plain["tile_loop"], (plain, row)


ROTATE_CASE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tileattn.kernels.decode import append
fn = append._rotate_rows
consts = dict(HEAD_DIM=64, BLOCK_D=64, ROTARY=True, INTERLEAVED=False, PAGED=False)
consts.update(PAGE_SIZE=1, HAS_BATCH_IDX=True, HAS_LEFTPAD=True, QUANTIZE=False, INTERPRET=False, CHECK=1)
sig, constexprs = {}, {}
for i, name in enumerate(fn.arg_names):
    if name in consts:
        sig[name], constexprs[(i,)] = "constexpr", consts[name]
    elif name in ("Seqlens", "BatchIdx", "Table", "LeftPad"):
        sig[name] = "*i32"
    elif name == "Record":
        sig[name] = "*i64"
    elif name[0].isupper():
        sig[name] = "*fp16"
    else:  # the v cache's row stride past 2**31: a 64-bit argument beside the k cache's 32-bit one
        sig[name] = "i64" if name == "stride_d2b" else "i32"
triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32))
rows.append({"compiled": True})
"""


def test_paired_append_compiles_with_strides_of_two_widths():
    """_rotate_rows appends k and v in one launch; when only one cache's stride is 2**31 or more, Triton
    passes it as int64 and the other as int32, which the kernel selects between without a branch."""
    assert compiled_sm90(ROTATE_CASE) == [{"compiled": True}]


FLASHMASK_BUILD_CASES = """
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tileattn.kernels import flashmask

def build(fn, consts):
    sig, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            sig[name] = "*i32" if name[0].isupper() else "i32"
    triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32))
    return {"kernel": fn.__name__, **consts}

for c, causal in ((1, True), (2, True), (2, False), (4, False)):
    rows.append(build(flashmask._canonical_kernel, dict(C=c, CAUSAL=causal, BLOCK=1024)))
for upper, varlen in itertools.product((False, True), repeat=2):
    rows.append(build(flashmask._key_tile_stats_kernel, dict(BLOCK_N=128, HAS_UPPER=upper, IS_VARLEN=varlen)))
    for by_keys in (False, True):
        consts = dict(BLOCK_M=128, BLOCK_N=64, BY_KEYS=by_keys, HAS_UPPER=upper, IS_VARLEN=varlen)
        rows.append(build(flashmask._schedule_kernel, dict(consts, CHUNK=1024, SEQ_CHUNK=16)))
"""


def test_flashmask_build_kernels_compile():
    """The kernels that build a FlashMask's form and schedules compile for sm_90a in every variant (mode,
    upper interval, packed, both sides): the GPU path of every FlashMask call goes through them."""
    rows = compiled_sm90(FLASHMASK_BUILD_CASES)
    assert len(rows) == 4 + 4 + 8 and {r["kernel"] for r in rows} == {
        "_canonical_kernel",
        "_key_tile_stats_kernel",
        "_schedule_kernel",
    }, rows


GLUON_CASES = """
from tileattn.kernels import gluon
if gluon.available():
    rows += [
        compile_report.compile_gluon(d, causal, varlen)
        for d in (128, 256)
        for causal in (False, True)
        for varlen in (False, True)
    ]
    rows.append(compile_report.compile_gluon(128, False, window=(256, 0)))
    # three consumer warpgroups of 64 rows (192-row items) at head dim 64
    three = dict(block_m=192, block_n=64, stages=4)
    rows += [compile_report.compile_gluon(64, causal, **three) for causal in (False, True)]
    rows += [compile_report.compile_gluon(64, True, True, **three), compile_report.compile_gluon(64, False, window=(256, 0), **three)]
"""


def _needs_gluon() -> None:
    """Skips (not passes) where this Triton has no Gluon the kernels are written for: nothing builds."""
    from tileattn.kernels import gluon

    if not gluon.available():
        pytest.skip(f"Triton {importlib.metadata.version('triton')} has no Gluon the kernels are written for")


def _assert_warp_specialized(row: dict, max_stack: int = 128, dq_first: bool = False, consumers: int = 2) -> None:
    """A Gluon build as the kernels are designed: one block per SM of twelve warps (sixteen with three
    consumer warpgroups), a few scalars spilled at most, two consumer warpgroups at 240 registers (three at
    160) and a loader at 24, waits for one wgmma group of two (``dq_first``: the split backward's, also for
    dQ's first chunk of three)."""
    warps, regs = (12, 240) if consumers == 2 else (16, 160)
    assert row["stack"] <= max_stack and row["blocks_per_sm"] == 1 and row["warps"] == warps, row
    waits = [0, 1, 2] if dq_first else [0, 1]
    assert {24, regs} <= set(row["setmaxnreg"]) and row["wgmma_waits"] == waits, row


def test_gluon_forward_builds_as_designed():
    """The Gluon forward (kernels/gluon/forward.py; Triton 3.6's Gluon, else the portable kernels run and
    there is nothing to build), dense and packed, causal or with a window, is warp-specialized as designed at the tables' tiles: two consumer
    warpgroups at 240 registers and a loader at 24 (setmaxnreg), one block of twelve warps per SM within
    shared memory, a few scalars spilled at most; its key loop waits for one wgmma group of two (Q·Kᵀ of
    the next tile done, P·V still running)."""
    _needs_gluon()
    rows = compiled_sm90(GLUON_CASES)
    assert len(rows) == 13, f"{len(rows)} builds compiled of the 13 cases"
    for row in rows:
        _assert_warp_specialized(row, consumers=row["options"].get("block_m", 128) // 64)
    three = [row for row in rows if row["options"].get("block_m") == 192]
    assert len(three) == 4 and all(row["stack"] == 0 for row in three), three


MLA_CASES = (
    H200
    + """
from tileattn.kernels import gluon
with configs.override(h200):
    rows.append(compile_report.compile_mla(2, 128, True, gluon=False))
    if gluon.available():
        rows += [compile_report.compile_mla(2, 128, causal, gluon=True) for causal in (False, True)]
        rows.append(compile_report.compile_mla(1, 64, False, gluon=True))
"""
)


def test_gluon_mla_builds_split_the_scores():
    """MLA decode's 64-row programs (DeepSeek's geometry): the portable build computes each key tile's
    scores in both warpgroups (per warpgroup 72 wgmmas of 64 x 32 x 16 a tile: all 64 keys; a chained dot's
    warps along its rows) and spills; the Gluon build (kernels/gluon/mla.py) gives each warpgroup 32 keys of
    the scores and 256 of the values (36 + 4 wgmmas a tile), spill-free within shared memory (two stages
    of 64 cache rows, q and P: under the 227 KB a block may take), its TMA boxes of 64 x 64."""
    _needs_gluon()
    portable, *builds = compiled_sm90(MLA_CASES)
    assert portable["loop_hgmma"] == 80 and portable["wgmma_shapes"].count("m64n32k16") == 144, portable
    assert len(builds) == 3, builds
    for row in builds:
        assert row["kernel"] == "_mla_kernel" and row["warps"] == 8 and row["stack"] == 0, row
        assert row["shared"] <= 227 * 1024 and row["blocks_per_sm"] == 1, row
        assert row["loop_hgmma"] == 40 and row["loop_spills"] == 0, row
        assert sorted(set(row["wgmma_shapes"])) == ["m64n256k16", "m64n32k16"], row
        assert row["wgmma_shapes"].count("m64n32k16") == 36 and row["wgmma_shapes"].count("m64n256k16") == 4, row
        assert row["tensordesc_boxes"] == [[64, 64], [64, 64]], row


GLUON_96_CASES = """
from tileattn.kernels import gluon
if gluon.available():
    rows += [compile_report.compile_gluon(96, causal, block_m=128, block_n=128, stages=2) for causal in (False, True)]
    rows.append(compile_report.compile_gluon(96, False, True, block_m=192, block_n=64, stages=3))
    rows.append(compile_report.compile_gluon(96, False, window=(256, 0), block_m=128, block_n=128, stages=3))
"""


def test_gluon_forward_at_head_dim_96_builds_as_two_column_parts():
    """Head dim 96 in the Gluon forward, as 64 + 32 columns (Gluon's shapes are powers of two): the same
    warp-specialized design, P·V as wgmmas of 64 and of 32 columns (no column computed for nothing), its key
    loop waiting for the two P·V wgmmas of the last tile (wait 2), each TMA barrier expecting both parts'
    bytes (a K or V stage of block_n × 96 columns, Q of every consumer's 64 × 96), few scalars spilled."""
    _needs_gluon()
    rows = compiled_sm90(GLUON_96_CASES)
    assert len(rows) == 4, rows
    for row in rows:
        block_m, block_n = row["options"]["block_m"], row["options"]["block_n"]
        warps, regs = (12, 240) if block_m == 128 else (16, 160)
        assert row["stack"] <= 16 and row["blocks_per_sm"] == 1 and row["warps"] == warps, row
        assert {24, regs} <= set(row["setmaxnreg"]) and row["wgmma_waits"] == [0, 2], row
        assert {"m64n64k16", "m64n32k16", f"m64n{block_n}k16"} == set(row["wgmma_shapes"]), row
        assert set(row["expect_bytes"]) == {block_n * 96 * 2, block_m * 96 * 2}, row


GLUON_PINGPONG_CASES = """
from tileattn.kernels import gluon
if gluon.available():
    rows += [compile_report.compile_gluon(d, causal, pingpong=True) for d in (128, 256) for causal in (False, True)]
    rows.append(compile_report.compile_gluon(96, False, True, block_m=128, block_n=128, stages=2, pingpong=True))
    rows.append(compile_report.compile_gluon(128, True))
"""


def test_gluon_forward_pingpong_builds_take_turns():
    """The ping-pong (``pingpong``: FlashAttention-3's warp scheduler barriers, by inline PTX): each consumer
    warpgroup waits for its turn (``bar.sync``, its own barrier, 8 or 9) before each of its three wgmma
    issue sites (the first Q·Kᵀ, the loop's Q·Kᵀ + P·V, the last P·V) and passes it on after (``bar.arrive``
    on the other's), the second warpgroup once more at its start (the first turn is the first's): so every
    wait has its arrival and none is left over but that one. Builds without it use no such barrier. The
    design otherwise as without (registers, waits, one block per SM)."""
    _needs_gluon()
    rows = compiled_sm90(GLUON_PINGPONG_CASES)
    assert len(rows) == 6, rows
    turns = {"bar.sync 8, 256": 3, "bar.arrive 9, 256": 3, "bar.sync 9, 256": 3, "bar.arrive 8, 256": 4}
    for row in rows[:-1]:
        assert row["named_barriers"] == turns, row
        assert row["stack"] <= 128 and row["blocks_per_sm"] == 1 and row["warps"] == 12, row
        assert {24, 240} <= set(row["setmaxnreg"]) and row["wgmma_waits"] == (
            [0, 2] if row["headdim"] == 96 else [0, 1]
        )
    assert rows[-1]["named_barriers"] == {}, rows[-1]


GLUON_MASK_LOOP_CASES = """
from tileattn.kernels import gluon
if gluon.available():
    for options in ({}, {"mask_loops": True}):
        rows += [compile_report.compile_gluon(128, causal, **options) for causal in (False, True)]
        rows.append(compile_report.compile_gluon(128, False, window=(256, 0), **options))
"""


def _exponentials_under_pv(schedule: list[str]) -> tuple[int, int]:
    """Of the exponentials in a build's key loops (``compile_report.wgmma_schedule`` lines that issue Q·Kᵀ
    and P·V and wait for Q·Kᵀ alone first: ``H16 W1 E61 W0 E5``), how many run between that wait and the
    wait for P·V, i.e. under the running P·V; and how many there are."""
    under = total = 0
    for loop in schedule:
        if " W1 " not in f" {loop} ":
            continue
        ops = loop.split()
        before_w0 = ops[: ops.index("W0")] if "W0" in ops else ops
        under += sum(int(op[1:]) for op in before_w0 if op.startswith("E"))
        total += sum(int(op[1:]) for op in ops if op.startswith("E"))
    return under, total


def test_gluon_forward_mask_loops_put_the_softmax_under_the_pv():
    """With the key loop in one loop whose mask sits behind a branch, ptxas waits for the P·V before the
    softmax (the branch splits the loop body, and the wait moves to the top of the block after it): no
    exponential runs under the P·V, no intra-warpgroup overlap. With ``mask_loops`` (three branch-free
    loops: tiles that need a mask, those that need none, those that do) most of them do (dense: the loop
    over unmasked tiles all of them, causal all of both loops', windows about 60 %). Dense, causal and
    windowed. (What it is worth is for the GPU to say: docs/perf.md.)"""
    _needs_gluon()
    rows = compiled_sm90(GLUON_MASK_LOOP_CASES)
    assert len(rows) == 6, rows
    for one, three in zip(rows[:3], rows[3:]):
        under, total = _exponentials_under_pv(one["schedule"])
        assert total and under == 0, one
        under, total = _exponentials_under_pv(three["schedule"])
        assert total and under >= total / 2, three
        assert three["stack"] <= 256 and three["wgmma_waits"] == [0, 1], three


GLUON_FP8_CASES = """
from tileattn.kernels import gluon
if gluon.available():
    rows += [compile_report.compile_gluon(d, True, fp8=True, block_m=128, block_n=64 if d == 256 else 128, stages=2)
             for d in (64, 128, 256)]
    rows.append(compile_report.compile_gluon(128, False, True, fp8=True, block_m=128, block_n=128, stages=2,
                                             pingpong=True, mask_loops=True))
"""


def test_gluon_forward_fp8_builds_on_fp8_wgmma():
    """The Gluon forward on FP8 inputs (``fp8``): both matmuls on e4m3 wgmma (K = 32 a step), the design
    otherwise as in 16 bits (two consumer warpgroups at 240 registers, a loader at 24, one block per SM, the
    key loop's waits), each stage's K tile and V tile (of V transposed, head dim x keys) block_n x head dim
    bytes, no spills; with the ping-pong and packed too."""
    _needs_gluon()
    rows = compiled_sm90(GLUON_FP8_CASES)
    assert len(rows) == 4, rows
    for row in rows:
        d, block_n = row["headdim"], row["options"]["block_n"]
        assert row["fp8"] and {f"m64n{block_n}k32", f"m64n{d}k32"} == set(row["wgmma_shapes"]), row
        assert set(row["expect_bytes"]) == {block_n * d, 2 * 64 * d}, row
        assert row["stack"] == 0 and row["blocks_per_sm"] == 1 and row["warps"] == 12, row
        assert {24, 240} <= set(row["setmaxnreg"]) and row["wgmma_waits"] == [0, 1], row


GLUON_SINK_CASES = """
from tileattn.kernels import gluon
if gluon.available():
    rows += [compile_report.compile_gluon(d, causal, sink=sink) for d in (128, 256) for causal in (False, True)
             for sink in (False, True)]
"""


@pytest.mark.skipif(not TUNED_TRITON, reason="the Gluon kernels are built with Triton 3.6")
def test_gluon_forward_with_sinks_builds_as_without():
    """The Gluon forward with attention sinks (their logit joins each row's sum after the key loop) keeps the
    build's design and spills no more than the same build without them (but for ptxas's own noise)."""
    rows = compiled_sm90(GLUON_SINK_CASES)
    assert len(rows) == 8, rows
    for plain, sink in zip(rows[::2], rows[1::2]):
        assert not plain["sink"] and sink["sink"], (plain, sink)
        _assert_warp_specialized(sink)
        # (16 bytes of slack: ptxas spills the same PTX by 8 bytes more or less as the kernel's parameter
        # list changes: one parameter added for FP8 moved head dim 128 causal from 56 / 56 to 48 / 64)
        assert sink["stack"] <= plain["stack"] + 16, (plain, sink)


GLUON_BWD_CASES = """
from tileattn.kernels import gluon
if gluon.available():
    rows += [
        compile_report.compile_gluon_bwd(d, causal, varlen)
        for d in (64, 128)
        for causal in (False, True)
        for varlen in (False, True)
    ]
    rows += [compile_report.compile_gluon_bwd(d, False, window=(256, 0)) for d in (64, 128)]
    rows += [compile_report.compile_gluon_bwd(d, causal, dropout=True) for d in (64, 128) for causal in (False, True)]
    rows += [compile_report.compile_gluon_bwd(256, causal, varlen) for causal in (False, True) for varlen in (False, True)]
    rows += [compile_report.compile_gluon_bwd(256, False, dq_tma=False, stages=2)]
    rows += [compile_report.compile_gluon_bwd(256, True, dq_first=False), compile_report.compile_gluon_bwd(256, True, stages=1, dq_chunk=64)]
    rows += [compile_report.compile_gluon_bwd(256, causal, dropout=True) for causal in (False, True)]
"""


def test_gluon_backward_builds_as_designed():
    """The Gluon backward (kernels/gluon/backward.py; Triton 3.6's Gluon, else nothing to build) is
    warp-specialized as designed at the settings' tiles (the launcher's defaults where the table has
    none): two consumer warpgroups at 240 registers and a loader at 24 (setmaxnreg), one block of twelve
    warps per SM within shared memory, a few scalars spilled at most; a query tile waits for one wgmma group of two (Sᵀ done, dPᵀ running;
    dV and dK done, dQ running) and adds its dQ by TMA reduce-adds, no atomics."""
    _needs_gluon()
    rows = compiled_sm90(GLUON_BWD_CASES)
    assert len(rows) == 23, f"{len(rows)} builds compiled of the 23 cases"
    for row in rows:
        split = row["kernel"] == "_bwd_split_kernel"
        # (the split build keeps its ~ten shared-memory operand descriptors in local memory, 64-bit values
        # reloaded once per query tile; with dropout some of the draws' integers as well)
        _assert_warp_specialized(row, max_stack=320 if split else 128, dq_first=row["options"].get("dq_first", False))
        if row["options"].get("dq_tma", True):
            assert row["tma_reduces"] >= 1 and row["atomics"] == 0, row
        else:
            assert row["tma_reduces"] == 0 and row["atomics"] >= 1, row


GLUON_BWD_DQ_FIRST_CASES = """
from tileattn.kernels import gluon
if gluon.available():
    rows += [compile_report.compile_gluon_bwd(d, causal, dq_first=first) for d in (64, 128) for causal in (False, True)
             for first in (False, True)]
"""


def test_gluon_backward_dq_first_adds_dq_under_dk():
    """``dq_first`` at head dims 64 and 128 (KernelConfig.dq_first, untimed): a tile's dK is issued after its dQ,
    and dQ's reduce-add (TMA) falls between the wait for dV and dQ and the wait for dK, under the running dK;
    without it the add follows the last wait. The same registers, a few scalars spilled at most, the same
    partitions."""
    _needs_gluon()
    rows = compiled_sm90(GLUON_BWD_DQ_FIRST_CASES)
    assert len(rows) == 8, rows
    for plain, first in zip(rows[::2], rows[1::2]):
        _assert_warp_specialized(first)
        assert first["regs"] == plain["regs"] and first["stack"] <= plain["stack"] + 16, (plain, first)
        adds = [
            [run.split()[run.split().index("R1") - 1] for run in row["schedule"] if "R1" in run.split()]
            for row in (plain, first)
        ]  # (what comes just before each reduce-add: W0 or W1)
        assert adds[0] and set(adds[0]) == {"W0"} and adds[1] and set(adds[1]) == {"W1"}, (plain, first)


def test_tma_rows_of_both_layouts():
    """The Gluon kernels read (batch, seqlen, nheads, headdim) tensors as one 2-D TMA matrix, no copy:
    flash_attn's layout (a packed qkv's slices too) as rows of positions with the heads side by side,
    a (batch, nheads, seqlen, headdim) tensor transposed as rows of one head's positions; other strides,
    and rows whose start is not 16-byte aligned, have none (the portable kernels run)."""
    from tileattn.kernels import gluon

    if not gluon.available():
        pytest.skip("the Gluon kernels are written for Triton 3.6's Gluon")
    from tileattn.kernels.gluon.common import tma_rows

    b, s, h, d = 2, 5, 3, 64
    x = torch.randn(b, s, h, d, dtype=torch.bfloat16)
    rows = tma_rows(x)
    assert (rows.batch_rows, rows.head_rows, rows.head_cols) == (s, 0, d)
    assert torch.equal(rows.matrix[1 * s + 4, 2 * d : 3 * d], x[1, 4, 2])
    qkv = torch.randn(b, s, 3, h, d, dtype=torch.bfloat16)
    rows = tma_rows(qkv[:, :, 1])
    assert torch.equal(rows.matrix[1 * s + 4, 2 * d : 3 * d], qkv[1, 4, 1, 2])
    heads = torch.randn(b, h, s, d, dtype=torch.bfloat16).transpose(1, 2)
    rows = tma_rows(heads)
    assert (rows.batch_rows, rows.head_rows, rows.head_cols) == (h * s, s, 0)
    assert torch.equal(rows.matrix[1 * h * s + 2 * s + 4], heads[1, 4, 2])
    assert tma_rows(x.transpose(0, 1)) is None  # batch entries interleaved
    assert tma_rows(torch.randn(b, s, h, d + 4, dtype=torch.bfloat16)[..., :d]) is None  # heads apart
    assert tma_rows(torch.randn(b, s, 1, 4, dtype=torch.bfloat16)) is None  # rows of 8 bytes
    one = tma_rows(torch.randn(1, s, h, d, dtype=torch.bfloat16))  # (one batch entry: its stride is free)
    assert (one.batch_rows, one.head_rows, one.head_cols) == (s, 0, d)
