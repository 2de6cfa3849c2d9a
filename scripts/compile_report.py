"""Registers, spills and shared memory of the attention kernels as compiled for the H200 (sm_90a), on a
machine without a GPU: Triton compiles each launch's specialisation for a fixed target (a stand-in
driver; nothing is launched) and cuobjdump reads the cubin's resource usage.

    python scripts/compile_report.py [--headdim 64 128 256] [--cases dense gqa ...] [--kernels fwd bwd]

Each case calls the launchers (forward.attn_fwd, backward.attn_bwd) with CPU tensors shaped like the
feature bench's (4 × 4096 tokens; strides and lengths are multiples of 16, as there), so the builds are
the ones the GPU runs. "stack" is the spill space per thread (bytes; 0 = no spills). Builds at the
register limit (255 per thread, or what 65,536 registers leave for the block) are marked: most backward
builds sit there, as did head dim 256's pointer-load forward that was miscompiled for GQA (docs/perf.md),
so the mark is a fact to read, not a diagnosis. Register counts decide how many blocks share an SM
(8 warps: two at <= 128 registers). ``--maxnreg kernel=N`` tries a register cap (ptxas maxnreg).
``--decode`` reports the decode builds of ``python -m tileattn.bench --decode``'s rows instead.
Compiling takes a few seconds per build on two cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

CASES = {
    # name: (kv-head divisor, causal, window, varlen, dropout, softcap + alibi)
    "dense": (1, False, (-1, -1), False, 0.0, False),
    "gqa": (4, False, (-1, -1), False, 0.0, False),
    "gqa-causal": (4, True, (-1, -1), False, 0.0, False),
    "causal": (1, True, (-1, -1), False, 0.0, False),
    "window": (1, False, (512, 0), False, 0.0, False),
    "varlen": (1, False, (-1, -1), True, 0.0, False),
    "dropout": (1, False, (-1, -1), False, 0.1, False),
    "softcap-alibi": (1, False, (-1, -1), False, 0.0, True),
    # FlashMask: a causal document mask (the lower interval), and global tokens + window (both intervals)
    "flashmask": (1, True, (-1, -1), False, 0.0, False),
    "flashmask-upper": (1, False, (-1, -1), False, 0.0, False),
}


class _H200Target:
    """The parts of Triton's driver that compiling (not launching) needs, for sm_90a."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(kernel) -> dict:
    """Registers, stack frame (spill space, bytes per thread; cuobjdump's LOCAL stays 0 when ptxas
    spills) and shared memory of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", text))
    if "REG" not in usage or "STACK" not in usage:
        raise RuntimeError(f"cuobjdump -res-usage gave no REG / STACK: {text[:300]!r}")
    regs, shared, warps = int(usage["REG"]), kernel.metadata.shared, kernel.metadata.num_warps
    return dict(
        blocks_per_sm=blocks_per_sm(regs, shared, warps),
        regs=regs,
        stack=int(usage["STACK"]),
        shared=kernel.metadata.shared,
        warps=kernel.metadata.num_warps,
    )


def tile_loop(kernel) -> int:
    """Instructions in the body of the kernel's shortest loop that holds a tensor-core instruction: in the
    decode kernel, the key loop over unmasked tiles (the masked edges' copies are longer). A static count
    (cuobjdump -sass): what one warp issues per key tile there."""
    return len(loop_body(kernel))


def loop_body(kernel) -> list[str]:
    """The SASS instructions of the kernel's shortest loop that holds a tensor-core instruction
    (``tile_loop``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    bodies = []
    for at, ins in code:
        jump = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if jump and int(jump.group(1), 16) < at:
            body = [i for a, i in code if int(jump.group(1), 16) <= a <= at]
            if any("HMMA" in i or "HGMMA" in i for i in body):
                bodies.append(body)
    if not bodies:
        raise RuntimeError("no loop with a tensor-core instruction in the SASS")
    return min(bodies, key=len)


def compile_mla(seqlen_q: int, nheads: int, causal: bool, gluon: bool) -> dict:
    """The MLA decode build of DeepSeek's geometry (576-wide rows, 512 values, pages of 64) for ``seqlen_q``
    tokens of ``nheads`` heads: the portable kernel (``kernels.decode.mla``) or, with ``gluon``, the Gluon
    one (``kernels.gluon.mla``; 64-row programs). Its resources, and in its key loop (``loop_body``) the
    tensor-core instructions and spill traffic."""
    from tileattn.kernels.decode import mla

    batch, pages = 8, 512
    q = torch.empty(batch, seqlen_q, nheads, 576, dtype=torch.bfloat16)
    kv = torch.empty(pages, 64, 1, 576, dtype=torch.bfloat16)
    table = torch.arange(pages, dtype=torch.int32).view(batch, -1)
    seqlens = torch.full((batch,), 4096, dtype=torch.int32)
    meta, splits = torch.zeros(132, 8, dtype=torch.int32), torch.zeros(batch + 1, dtype=torch.int32)
    if gluon:
        from tileattn.kernels.gluon import mla as gluon_mla

        out = torch.empty(batch, seqlen_q, nheads, 512, dtype=torch.bfloat16)
        lse, partials = torch.empty(batch, nheads, seqlen_q), torch.empty(16)
        gluon_mla.mla_fwd_gluon(q, kv, out, lse, partials, partials, table, seqlens, meta, splits, 0.1, causal)
    else:
        from tileattn.kernels import configs

        mla.mla_fwd(q, kv, table, seqlens, meta, splits, 512, 0.1, causal, configs.current(q.device))
    name, kernel, kw = next(launch for launch in _LAUNCHES if launch[0] in ("_mla_fwd", "_mla_kernel"))
    _LAUNCHES.clear()
    body = loop_body(kernel)
    return dict(
        kernel=name,
        seqlen_q=seqlen_q,
        nheads=nheads,
        causal=causal,
        **resources(kernel),
        wgmma_shapes=sorted(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", kernel.asm["ptx"])),
        loop_hgmma=sum("HGMMA" in i for i in body),
        loop_spills=sum("LDL" in i or "STL" in i for i in body),
        tensordesc_boxes=[m["block_size"] for m in kernel.metadata.tensordesc_meta or ()],
    )


DECODE_CASES = [
    (1, 8192, None),
    (1, 8192, 16),
    (1, 8192, 256),
    (1, 131072, 16),
    (8, 32768, None),
    (8, 32768, 16),
    (64, 4096, None),
    (64, 4096, 16),
    (64, 4096, 256),
    (64, 16384, 256),
]


def compile_decode(
    batch: int,
    cache_len: int,
    page: int | None,
    nheads: int = 32,
    nheads_k: int = 8,
    d: int = 128,
    seqlen_q: int = 1,
    rotary: str | None = None,
):
    """The builds of one decode step (one query token, GQA 32/8, head dim 128) over a contiguous or
    paged cache, as in ``bench --decode``, with the launch grids (the split count is the grid's z).
    ``seqlen_q`` query tokens (not causal); ``rotary`` ("interleaved" or "neox", a full rotary dim): q
    rotated in the kernel (CacheLayout.q_rotary, all tokens at cache_seqlens)."""
    from tileattn.kernels import configs, decode
    from tileattn.params import AttnParams, CacheLayout

    q = torch.empty(batch, seqlen_q, nheads, d, dtype=torch.bfloat16)  # nothing runs: contents do not matter
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32)
    table = None
    if page:
        pages = cache_len // page
        cache = torch.empty(batch * pages, page, nheads_k, d, dtype=torch.bfloat16)
        table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    else:
        cache = torch.empty(batch, cache_len, nheads_k, d, dtype=torch.bfloat16)
    p = AttnParams(batch=batch, seqlen_q=seqlen_q, seqlen_k=cache_len, headdim=d, softmax_scale=d**-0.5)
    q_rotary = None
    if rotary:
        cos = torch.empty(cache_len, d // 2, dtype=torch.bfloat16)
        q_rotary = (cos, cos, rotary == "interleaved", False)
    c = CacheLayout(seqlens_k=seqlens, block_table=table, max_seqlen_k=cache_len, q_rotary=q_rotary)
    decode.attn_fwd_kvcache(q, cache, cache, p, c, configs.current(q.device))
    rows = []
    for name, kernel, kw in _LAUNCHES:
        if name == "_combine":
            cfg = (f"rows {kw['BLOCK_R']}", f"splits/load {kw['CHUNK']}", kw.get("num_warps"))
        else:
            cfg = (kw.get("BLOCK_M"), kw.get("BLOCK_N"), kw.get("num_warps"), kw.get("num_stages"))
        case = f"{batch}x{cache_len}" + (f" page{page}" if page else "") + (f" q{seqlen_q}" if seqlen_q > 1 else "")
        case += f" {rotary}" if rotary else ""
        ptx = kernel.asm["ptx"]
        flags = dict(
            tma=bool(kw.get("USE_TMA")),
            pdl=bool(kw.get("launch_pdl") or kw.get("LAUNCH_DEPENDENTS")),
            pdl_launch=bool(kw.get("launch_pdl")),  # launched as a programmatic dependent
            gdc_wait="griddepcontrol.wait" in ptx,
            gdc_signal="griddepcontrol.launch_dependents" in ptx,
            # global loads and async copies the PTX issues before its griddepcontrol.wait (None: no wait)
            loads_before_wait=loads_before_wait(ptx),
            table_to_l2="@p prefetch.global.L2" in ptx,
        )
        loop = dict(tile_loop=tile_loop(kernel)) if name != "_combine" else {}
        rows.append(
            dict(kernel=name, headdim=d, case=case, config=cfg, grid=kw["grid"], **flags, **resources(kernel), **loop)
        )
    _LAUNCHES.clear()
    return rows


def loads_before_wait(ptx: str) -> int | None:
    """Instructions that may read global memory (loads of any ordering, ``ldu``, atomics and reductions,
    async and TMA copies; not loads of parameters, shared, local or constant memory) ahead of the first
    ``griddepcontrol.wait`` in the PTX's order, or None without one: a programmatic dependent must read
    nothing before it (the wait sits in the entry block, before any branch)."""
    at = ptx.find("griddepcontrol.wait")
    if at < 0:
        return None
    ops = re.findall(r"^\s*(?:@!?%\w+\s+)?((?:ldu?|atom|red|cp\.async|cp\.reduce)\b(?:\.[\w:]+)*)", ptx[:at], re.M)
    # (an async copy reads global memory whatever its destination; the others name the space they read)
    return sum(op.startswith("cp.") or not re.search(r"\.(?:param|shared|local|const)\b", op) for op in ops)


def blocks_per_sm(regs: int, shared: int, warps: int) -> int:
    """Blocks of this build an H100/H200 SM holds at once: 65,536 registers in four sub-partitions
    (allocated per warp, per thread in steps of 8), 228 KiB of shared memory (1 KiB reserved per block,
    128-byte steps), 64 warps, 32 blocks."""
    warps_by_regs = (16384 // (-(-max(regs, 1) // 8) * 8 * 32)) * 4
    by_smem = 233472 // (-(-(shared + 1024) // 128) * 128)
    return min(warps_by_regs // warps, by_smem, 64 // warps, 32)


def compile_case(headdim: int, case: str, kernels: list[str], batch: int = 4, seqlen: int = 4096) -> list[dict]:
    """The builds one call of ``case`` compiles, with their resources."""
    from tileattn.kernels import backward, configs, forward
    from tileattn.params import AttnParams

    kv_div, causal, window, varlen, dropout, softcap_alibi = CASES[case]
    nheads = max(4, 2048 // headdim)
    block_d = max(16, 1 << (headdim - 1).bit_length())  # the padded head dim, the kernels' BLOCK_D
    q = torch.zeros(batch, seqlen, nheads, headdim, dtype=torch.bfloat16)
    k = torch.zeros(batch, seqlen, nheads // kv_div, headdim, dtype=torch.bfloat16)
    left, right = window
    if causal:
        right = 0
    extra = {}
    if varlen:
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32)
        extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
        q, k = q.flatten(0, 1), k.flatten(0, 1)
    p = AttnParams(
        batch=batch,
        seqlen_q=seqlen,
        seqlen_k=seqlen,
        headdim=headdim,
        softmax_scale=headdim**-0.5,
        window_left=left,
        window_right=right,
        softcap=30.0 if softcap_alibi else 0.0,
        alibi_slopes=torch.ones(nheads) if softcap_alibi else None,
        dropout_p=dropout,
        philox_seed=1,
        **extra,
    )
    if case.startswith("flashmask"):
        from tileattn import flashmask, masks

        docs = [seqlen // 3, seqlen - seqlen // 3]  # (one boundary inside a tile)
        idx = masks.causal_document_mask(docs) if causal else masks.global_sliding_window_mask(seqlen, 64, 512)
        p.flashmask = flashmask.canonical(torch.cat([idx] * batch), causal, varlen=False)
    if "fwd" in kernels:
        forward.attn_fwd(q, k, k, p, configs.current(q.device))
    if "bwd" in kernels:
        lse = p.new_lse(p.as_4d(q))
        backward.attn_bwd(q, q, k, k, q, lse, p, configs.current(q.device))
    rows = []
    for name, kernel, kw in _LAUNCHES:
        cfg = (kw.get("BLOCK_M"), kw.get("BLOCK_N"), kw.get("num_warps"), kw.get("num_stages"), kw.get("maxnreg"))
        rows.append(
            dict(
                kernel=name,
                headdim=headdim,
                block_d=block_d,
                case=case,
                config=cfg,
                tma=bool(kw.get("USE_TMA")),
                **resources(kernel),
                # the forward's exponentials on MUFU in its unmasked key loop (kernels.exp2: the rest by polynomial)
                **(dict(loop_ex2=sum("MUFU.EX2" in i for i in loop_body(kernel))) if name == "_attn_fwd" else {}),
            )
        )
    _LAUNCHES.clear()
    return rows


def _warp_specialization(ptx: str) -> dict:
    """From a Gluon kernel's PTX: the register budgets of its partitions (setmaxnreg), its wgmma waits, the
    shapes of its wgmmas (``m64n128k16``, ...), the byte counts its TMA barriers expect and its named-barrier
    instructions written as inline PTX (``{"bar.sync 8, 256": count, ...}``; Triton's own are ``barrier.sync``)."""
    return dict(
        setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        wgmma_waits=sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}),
        wgmma_shapes=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
        expect_bytes=sorted(
            {int(n) for n in re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+_,\s*\[[^]]+\],\s*(\d+)", ptx)}
        ),
        named_barriers=dict(sorted(Counter(re.findall(r"\bbar\.(?:sync|arrive) \d+, \d+", ptx)).items())),
    )


def wgmma_schedule(kernel) -> list[str]:
    """A Gluon kernel's SASS (nvdisasm, bundled with Triton), read for where the softmax falls against the
    wgmma waits: one line per run of HGMMA instructions, then in order what follows up to the next run,
    ``E<n>`` for n MUFU.EX2 (the exponentials), ``W1`` / ``W0`` for a wait for all but one / all wgmma
    groups (e.g. ``H16 W1 E66 W0``: Q·Kᵀ and P·V issued, the exponentials between the two waits, under
    the running P·V; QGMMA, the FP8 wgmma, counts as H too; ``R<n>`` for n TMA reduce-adds, the backward's
    dQ adds). Empty where nvdisasm is not there."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        return []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    runs: list[list] = []
    for m in re.finditer(r"[HQ]GMMA\.\S+|WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)|MUFU\.EX2|UTMAREDG", sass):
        op = m.group(0)
        kind = "H" if "GMMA" in op else "E" if op.startswith("MUFU") else "R" if op == "UTMAREDG" else "W" + m.group(1)
        if kind == "H" and (not runs or runs[-1][-1][0] != "H"):
            runs.append([["H", 0]])
        if not runs:
            continue
        last = runs[-1][-1]
        if last[0] == kind and kind in "HER":
            last[1] += 1
        else:
            runs[-1].append([kind, 1])
    return [" ".join(f"{k}{n}" if k in "HER" else k for k, n in run) for run in runs]


def compile_gluon(
    headdim: int, causal: bool, varlen: bool = False, window: tuple = (-1, -1), sink: bool = False,
    fp8: bool = False, **options,
) -> dict:  # fmt: skip
    """The Gluon forward's build (``kernels.gluon.forward``) for one head dim, dense or ``varlen``, causal or
    with a sliding ``window`` (flash_attn's window_size), with attention sinks (``sink``), with ``options``
    (block_m, block_n, stages, pingpong, mask_loops, exp2_poly; the settings table's entry by default): its
    resources, from the PTX the register budgets of its partitions (setmaxnreg), its wgmma waits and shapes,
    TMA byte counts and named barriers, and from the SASS where the exponentials fall against the waits
    (``schedule``: ``wgmma_schedule``). ``fp8``: e4m3 inputs with descales (``settings.fwd_gluon_fp8``)."""
    from tileattn.kernels import configs
    from tileattn.kernels.gluon import forward as hopper
    from tileattn.params import AttnParams

    batch, seqlen, nheads = 2, 1024, 2048 // headdim
    q = torch.zeros(batch, seqlen, nheads, headdim, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    cu = None
    if varlen:  # the same rows as one packed batch of two sequences
        q = q.view(1, batch * seqlen, nheads, headdim)
        cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)
    cfg = (configs.HOPPER.fwd_gluon_fp8 if fp8 else configs.HOPPER.fwd_gluon).get(headdim)
    if cfg is not None:
        table = dict(block_m=cfg.block_m, block_n=cfg.block_n, stages=cfg.num_stages, pingpong=cfg.pingpong)
        options = table | dict(mask_loops=cfg.mask_loops, exp2_poly=cfg.exp2_poly) | options
    p = AttnParams(
        batch, seqlen, seqlen, headdim, headdim**-0.5, window_left=window[0],
        window_right=0 if causal else window[1], cu_seqlens_q=cu, cu_seqlens_k=cu,
        learnable_sink=torch.zeros(nheads) if sink else None,
        descales=torch.ones(3, batch, nheads) if fp8 else None,
    )  # fmt: skip
    hopper.attn_fwd(q, q, q, p, programs=132, **options)  # (the H200's SMs: the grid, not the build)
    name, kernel, kw = _LAUNCHES.pop()
    _LAUNCHES.clear()
    ptx = kernel.asm["ptx"]
    return dict(
        kernel=name,
        headdim=headdim,
        causal=causal,
        varlen=varlen,
        window=window,
        sink=sink,
        fp8=fp8,
        options=options,
        **_warp_specialization(ptx),
        **resources(kernel),
        schedule=wgmma_schedule(kernel),
    )


def compile_gluon_bwd(
    headdim: int, causal: bool, varlen: bool = False, window: tuple = (-1, -1), dropout: bool = False, **options
) -> dict:
    """The Gluon backward's build (``kernels.gluon.backward``) for one head dim, dense or ``varlen``, causal
    or with a sliding ``window`` (flash_attn's window_size), with ``dropout`` or not, with ``options``
    (block_m, stages, dq_tma; the launcher's defaults, else the settings table's entry): its resources, and from the PTX the register
    budgets of its partitions (setmaxnreg), its wgmma waits and its dQ reduce-adds."""
    from tileattn.kernels import configs
    from tileattn.kernels.gluon import backward as hopper
    from tileattn.params import AttnParams

    batch, seqlen, nheads = 2, 1024, 2048 // headdim
    q = torch.zeros(batch, seqlen, nheads, headdim, dtype=torch.bfloat16)
    lse = torch.zeros(batch, nheads, seqlen, dtype=torch.float32)
    cu = None
    if varlen:  # the same rows as one packed batch of two sequences
        q, lse = q.view(1, batch * seqlen, nheads, headdim), lse.transpose(0, 1).reshape(nheads, batch * seqlen)
        cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)
    cfg = (configs.HOPPER.bwd_gluon_dropout if dropout else configs.HOPPER.bwd_gluon).get(headdim)
    if cfg is not None:
        options = dict(hopper.config_options(cfg), **options)
    p = AttnParams(
        batch, seqlen, seqlen, headdim, headdim**-0.5, window_left=window[0],
        window_right=0 if causal else window[1], cu_seqlens_q=cu, cu_seqlens_k=cu,
        dropout_p=0.125 if dropout else 0.0, philox_seed=0x1234,
    )  # fmt: skip
    hopper.attn_bwd(q, q, q, q, lse, lse, p, **options)
    name, kernel, kw = next(launch for launch in _LAUNCHES if launch[0] in ("_bwd_kernel", "_bwd_split_kernel"))
    _LAUNCHES.clear()
    ptx = kernel.asm["ptx"]
    return dict(
        kernel=name,
        headdim=headdim,
        causal=causal,
        varlen=varlen,
        window=window,
        options=options,
        **_warp_specialization(ptx),
        tma_reduces=len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx)),
        atomics=len(re.findall(r"^\s*(?:@!?%\w+\s+)?(?:red|atom)\.global", ptx, re.M)),
        **resources(kernel),
        schedule=wgmma_schedule(kernel),
    )


_LAUNCHES: list = []


def _install(maxnreg: dict[str, int] | None = None) -> None:
    """Compile instead of launch: every JIT call records its compiled kernel. ``maxnreg`` (kernel name
    -> registers) overrides the tables' register caps (KernelConfig.maxnreg, passed to ptxas)."""
    driver.set_active(_H200Target())
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if maxnreg and self.__name__ in maxnreg:
            kwargs["maxnreg"] = maxnreg[self.__name__]
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        _LAUNCHES.append((self.__name__, kernel, dict(kwargs, grid=grid)))
        return kernel

    JITFunction.run = run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--kernels", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--decode", action="store_true", help="the decode kernels of bench --decode's rows instead")
    ap.add_argument(
        "--maxnreg",
        nargs="+",
        default=[],
        help="register caps overriding the tables', e.g. _attn_fwd=128 _attn_bwd_dq=128",
    )
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")
    _install({k: int(v) for k, v in (a.split("=") for a in args.maxnreg)})
    import dataclasses

    from tileattn.kernels import configs

    # the H200's settings, with the programmatic dependent launches it has (CPU tensors stand in for its own)
    h200 = dataclasses.replace(configs.HOPPER, decode=dataclasses.replace(configs.HOPPER.decode, has_pdl=True))
    with configs.override(h200):
        _report(args)


def _report(args) -> None:
    if args.decode:
        print(f"{'kernel':>18} {'case':>16} {'tiles':>22} {'grid':>16} regs stack shared blocks/SM tile loop")
        for batch, cache_len, page in DECODE_CASES:
            for r in compile_decode(batch, cache_len, page):
                print(
                    f"{r['kernel']:>18} {r['case']:>16} {str(r['config']):>22} {str(r['grid']):>16} "
                    f"{r['regs']:>4} {r['stack']:>5} {r['shared'] // 1024:>5}K {r['blocks_per_sm']:>9} "
                    f"{r.get('tile_loop', ''):>9}",
                    flush=True,
                )
        return
    print(f"{'kernel':>18} {'hd':>4} {'case':>14} {'tiles (M, N, warps, stages, cap)':>34} regs stack shared blocks/SM")
    for headdim in args.headdim:
        for case in args.cases:
            for r in compile_case(headdim, case, args.kernels):
                limit = min(255, 65536 // (32 * r["warps"]))
                flag = "  <- at the register limit" if r["regs"] >= limit else ""
                print(
                    f"{r['kernel']:>18} {r['headdim']:>4} {r['case']:>14} {str(r['config']):>34} "
                    f"{r['regs']:>4} {r['stack']:>5} {r['shared'] // 1024:>5}K {r['blocks_per_sm']:>3}{flag}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
