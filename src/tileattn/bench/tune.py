"""``python -m tileattn.bench.tune``: sweeps tile configurations of the forward and backward kernels
on the current GPU and prints the fastest per head dim, to be copied into ``kernels/configs.py``.

Each candidate is a ``params.Settings`` value: the device's settings with the candidate in the head
dim's entry of ``fwd``, ``bwd_dkdv`` or ``bwd_dq``, run under ``configs.override``. Each is checked
against the reference before it is timed, on the timed (dense) inputs and on GQA 4:1 inputs, which
compile a build of their own (one such build, head dim 256's 128 x 64 pointer-load forward, was wrong
for GQA only: docs/perf.md). Backward candidates are checked on their gradients.

``--mla``: MLA decoding's rows (``bench --mla``'s) with the portable build and with the Gluon one
(``MLASettings.gluon``, sm90; the memory-bound rows' 16-row programs padded to 64, ``gluon_narrow``),
alternating, each checked before it is timed.

``--exp2-poly``: the forward with k of every 8 exponentials by polynomial (``KernelConfig.exp2_poly`` in every
forward table, portable and Gluon) for k in 0, 2, 3, 4, causal and not, at ``--headdim`` and ``--seqlen``, in
alternating rounds, each build checked against the reference first; with ``--fp8`` the FP8 forward's grid
(``bench --fp8``'s at those head dims and lengths, each build checked with its tolerance) instead.

``--levers NAME ...``: the options the tables do not take yet (``LEVERS``: the portable forward where the tables
run the Gluon one, the Gluon forward at every length, a persistent grid for it, three consumer warpgroups, the
ping-pong, causal heads in one group, the snake order, the backward's dK after dQ), each where it applies at
``--headdim``, against the tables' builds with cuDNN beside them, causal and not, at each ``--seqlen``, in
alternating rounds, each build checked first (``time_builds``).

``--fp8-widen``: FP8 KV-cache decoding (``bench --fp8``'s decode rows, 8 x 32k and 64 x 16k, contiguous and
paged) under each ``DecodeSettings.fp8_widen`` against the bf16 cache, alternating; each checked first
against the fp64 attention with the tolerance rule's baseline of what it rounds ("fp8": q's rows in e4m3;
"none": and the probabilities).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from dataclasses import replace

import torch
import triton

import tileattn
from tileattn.bench.__main__ import flops
from tileattn.bench.backends import check_backend
from tileattn.kernels import configs
from tileattn.params import KernelConfig, Settings, padded_headdim
from tileattn.reference import attention_ref
from tileattn.testing import check_close

FWD_CANDIDATES = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 2),
    (64, 64, 4, 3),
    (128, 32, 8, 2),
    (64, 128, 4, 3),
]
DKDV_CANDIDATES = [
    (64, 128, 8, 2),
    (32, 128, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 8, 3),
    (32, 64, 4, 2),
    (128, 128, 8, 2),
    (32, 128, 8, 3),
    (32, 64, 4, 3),
]
DQ_CANDIDATES = [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2), (128, 128, 8, 2)]
# Head dim 256 needs smaller tiles or fewer stages to fit shared memory and registers.
HD256_CANDIDATES = {
    "fwd": [(128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 2)],
    "dkdv": [
        (32, 64, 4, 2),
        (64, 64, 8, 2),
        (32, 64, 8, 2),
        (64, 32, 8, 2),
        (32, 32, 4, 2),
        (64, 64, 8, 1),
        (32, 128, 8, 1),
    ],
    "dq": [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 2), (128, 64, 8, 1), (32, 64, 4, 2)],
}


def _smem_ok(cfg: tuple, block_d: int, kind: str) -> bool:
    """keep(): drop configs whose shared-memory footprint cannot fit in the H100/H200's 227 KB."""
    if block_d == 256:
        return cfg[:4] in HD256_CANDIDATES[kind]
    bm, bn, _, stages = cfg[:4]
    if kind == "fwd":
        need = 2 * (bm * block_d + stages * 2 * bn * block_d)
    else:
        rows = bm if kind == "dkdv" else bn
        need = 2 * (2 * (bn if kind == "dkdv" else bm) * block_d + stages * 2 * rows * block_d)
        if len(cfg) > 4 and cfg[4]:
            need += 2 * 2 * bm * bn  # q_major: P and dS transposed through shared memory
    return need <= 220 * 1024


def _usable(cfg: tuple, block_d: int, kind: str, dropout_p: float) -> bool:
    return _smem_ok(cfg, block_d, kind) and (dropout_p == 0 or cfg[1] % 64 == 0)


# The tables whose entries take precedence over ``fwd``'s and ``bwd_dkdv``'s for some calls.
SHAPE_TABLES = ("fwd_long", "fwd_causal", "fwd_window", "bwd_dkdv_causal", "bwd_dkdv_varlen")


def _plain(s: Settings, block_d: int) -> Settings:
    """``s`` without the shape tables' entries for ``block_d``, so that the candidates placed in ``fwd``
    and ``bwd_dkdv`` are the ones the timed calls take."""
    return replace(s, **{name: {d: c for d, c in getattr(s, name).items() if d != block_d} for name in SHAPE_TABLES})


def _with(s: Settings, table: str, block_d: int, cand: tuple) -> Settings:
    """``s`` with the candidate ``cand`` (KernelConfig's fields in order) as ``block_d``'s entry of ``table``."""
    return replace(s, **{table: {**getattr(s, table), block_d: KernelConfig(*cand)}})


def _check_grads(name, grads, q, k, v, dout, causal):
    """dq of batch 0's query heads that share kv head 0, and that head's dk and dv, against the
    reference (the tolerance rule, the floor at the largest gradient)."""
    group = q.shape[2] // k.shape[2]
    sl_q = (slice(0, 1), slice(None), slice(0, group))
    sl_k = (slice(0, 1), slice(None), slice(0, 1))
    qs, ks, vs = (t[s].detach().requires_grad_() for t, s in ((q, sl_q), (k, sl_k), (v, sl_k)))
    ref = attention_ref(qs, ks, vs, causal=causal, upcast=torch.float64)[0]
    lowp = attention_ref(qs, ks, vs, causal=causal, upcast=False)[0]
    g_ref = torch.autograd.grad(ref, (qs, ks, vs), dout[sl_q])
    g_lowp = torch.autograd.grad(lowp, (qs, ks, vs), dout[sl_q])
    scale = torch.stack([g.abs().max() for g in g_ref])
    for gname, g, sl, gr, gl in zip(("dq", "dk", "dv"), grads, (sl_q, sl_k, sl_k), g_ref, g_lowp):
        check_close(f"{name} {gname}", g[sl], gr, gl, floor_scale=scale)


def sweep(headdim: int, seqlen: int, causal: bool, tokens: int = 16384, hidden: int = 2048, dropout_p: float = 0.0):
    """Times every candidate; with ``dropout_p`` the timed calls use dropout (each candidate's forward is
    still checked against the reference without dropout first) and candidates whose key tiles are not a
    multiple of 64 columns, which dropout's draws need, are left out."""
    import tileattn

    batch, nheads = max(1, tokens // seqlen), max(1, hidden // headdim)
    block_d = padded_headdim(headdim)
    q, k, v = (
        torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    # GQA 4:1 inputs for the checks (a separate build: the group size is a runtime argument)
    kg, vg = (
        torch.randn(
            batch, seqlen, max(1, nheads // 4), headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )
        for _ in range(2)
    )
    dout = torch.randn_like(q)
    f_fwd = flops(batch, nheads, seqlen, seqlen, headdim, causal, "fwd")
    f_bwd = flops(batch, nheads, seqlen, seqlen, headdim, causal, "bwd")
    results = []
    plain = _plain(configs.current(q.device), block_d)
    for cand in HD256_CANDIDATES["fwd"] if block_d == 256 else FWD_CANDIDATES:
        if not _usable(cand, block_d, "fwd", dropout_p):
            continue
        try:
            with configs.override(_with(plain, "fwd", block_d, cand)):
                out = tileattn.flash_attn_func(q, k, v, causal=causal)
                check_backend("tileattn", out, q, k, v, causal)
                check_backend("tileattn GQA", tileattn.flash_attn_func(q, kg, vg, causal=causal), q, kg, vg, causal)
                ms = triton.testing.do_bench(
                    lambda: tileattn.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal),
                    return_mode="median",
                )
            results.append(dict(kind="fwd", cfg=cand, ms=ms, tflops=f_fwd / ms / 1e9))
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is just skipped
            results.append(dict(kind="fwd", cfg=cand, error=str(exc).splitlines()[0][:120]))
    for kind, table, cands in (("dkdv", "bwd_dkdv", DKDV_CANDIDATES), ("dq", "bwd_dq", DQ_CANDIDATES)):
        if block_d == 256:
            cands = HD256_CANDIDATES[kind]
        if kind == "dkdv" and dropout_p > 0:  # both tile orientations (KernelConfig.q_major)
            cands = [(*c, q_major) for c in cands for q_major in (False, True)]
        for cand in dict.fromkeys(cands):
            if not _usable(cand, block_d, kind, dropout_p):
                continue
            try:
                # the forward too under the candidate's settings: its backward may take the forward's
                with configs.override(_with(plain, table, block_d, cand)):
                    out = tileattn.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)
                    out_gqa = tileattn.flash_attn_func(q, kg, vg, causal=causal)

                    def bwd(out=out):
                        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                    grads_gqa = torch.autograd.grad(out_gqa, (q, kg, vg), dout)
                    _check_grads("tileattn GQA", grads_gqa, q, kg, vg, dout, causal)
                    bwd()
                    ms = triton.testing.do_bench(bwd, return_mode="median")
                results.append(dict(kind=kind, cfg=cand, ms=ms, tflops=f_bwd / ms / 1e9))
            except Exception as exc:  # noqa: BLE001
                results.append(dict(kind=kind, cfg=cand, error=str(exc).splitlines()[0][:120]))
    return results


def mla_builds(rounds: int = 3) -> list[dict]:
    """``bench --mla``'s rows with the portable build (``MLASettings.gluon`` off) and the Gluon one (on, with
    ``gluon_narrow``), in ``rounds`` alternating rounds (each row checked against the fp64 attention before
    it is timed)."""
    from tileattn.bench.__main__ import time_ms
    from tileattn.bench.mla import COMPUTE_CASES, MEMORY_CASES, _mla_row
    from tileattn.kernels import gluon

    s = configs.current(torch.device("cuda"))
    builds = {"portable": replace(s, mla=replace(s.mla, gluon=False))}
    if torch.cuda.get_device_capability()[0] == 9 and gluon.available():
        builds["Gluon"] = replace(s, mla=replace(s.mla, gluon=True, gluon_narrow=True))
    cases = [("memory", *c, 1, 16) for c in MEMORY_CASES] + [("compute", *c, 2, 128) for c in COMPUTE_CASES]
    rows = []
    for r in range(rounds):
        for regime, batch, seqlen, seqlen_q, nheads in cases:
            for name, settings in builds.items():
                gen = torch.Generator(device="cuda").manual_seed(batch + seqlen)  # (the same inputs each build)
                with configs.override(settings):
                    row = _mla_row(time_ms, regime, batch, seqlen, seqlen_q, nheads, gen)
                rows.append(dict(row, build=name, round=r))
                print(
                    f"round {r} {name:8s} {regime:7s} {batch} x {seqlen}: {row['gbs']:.0f} GB/s "
                    f"{row['tflops']:.0f} TFLOP/s (a replayed graph: {row['graph_gbs']:.0f} GB/s "
                    f"{row['graph_tflops']:.0f} TFLOP/s)",
                    flush=True,
                )
                torch.cuda.empty_cache()
    return rows


def _pass_call(mode: str, name: str, q, k, v, causal: bool):
    """The pass to time for one build, under the settings in force: the forward, or (``"bwd"``) the backward
    alone over one retained graph; checked first against the reference (the output, or dq, dk and dv)."""
    import tileattn

    if mode == "fwd":
        check_backend(name, tileattn.flash_attn_func(q, k, v, causal=causal), q, k, v, causal)
        return functools.partial(tileattn.flash_attn_func, q, k, v, causal=causal)
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    out = tileattn.flash_attn_func(*inputs, causal=causal)
    dout = torch.randn_like(out)
    _check_grads(name, torch.autograd.grad(out, inputs, dout, retain_graph=True), q, k, v, dout, causal)
    return functools.partial(torch.autograd.grad, out, inputs, dout, retain_graph=True)


def time_builds(
    builds_of,
    mode: str = "fwd",
    headdims=(64, 128, 256),
    seqlens=(2048, 16384),
    rounds: int = 3,
    tokens: int = 16384,
    hidden: int = 2048,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    anchor: str | None = "sdpa-cudnn",
) -> list[dict]:
    """TFLOP/s of the forward (``mode="fwd"``) or the backward alone (``"bwd"``) under each build of
    ``builds_of(headdim)`` (a dict name: ``Settings``, the first the baseline), causal and not, ``tokens`` a
    batch, ``hidden`` = heads x head dim; each build checked against the reference first, a build that fails
    reported and left out; then ``rounds`` rounds of alternating order with backend ``anchor`` beside them
    (where it runs: ``bench.backends``); each row's ratio to the baseline of the same round (``vs_first``)."""
    from tileattn.bench.__main__ import _backward_alone, time_ms
    from tileattn.bench.backends import BACKENDS, Unavailable

    rows = []
    for headdim in headdims:
        builds = builds_of(headdim)
        first = next(iter(builds))
        for seqlen in seqlens:
            batch, nheads = max(1, tokens // seqlen), max(1, hidden // headdim)
            gen = torch.Generator(device=device).manual_seed(headdim + seqlen)
            q, k, v = (
                torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen) for _ in range(3)
            )
            for causal in (False, True):
                f = flops(batch, nheads, seqlen, seqlen, headdim, causal, mode)
                case = dict(mode=mode, headdim=headdim, seqlen=seqlen, causal=causal)
                calls = {}
                for name, settings in builds.items():
                    try:
                        with configs.override(settings):
                            calls[name] = (settings, _pass_call(mode, name, q, k, v, causal))
                    except Exception as exc:  # noqa: BLE001 -- a build that cannot run says why
                        rows.append(dict(case, name=name, error=str(exc)[:300]))
                        print(f"{case} {name}: {str(exc)[:200]}", flush=True)
                if anchor is not None:
                    try:
                        run = BACKENDS[anchor](q, k, v, causal)
                        calls[anchor] = (
                            None,
                            run if mode == "fwd" else _backward_alone(anchor, q, k, v, causal, print),
                        )
                    except Unavailable:
                        pass
                timed = []
                for r in range(rounds):
                    times = {}
                    for name in list(calls)[:: 1 if r % 2 == 0 else -1]:
                        settings, fn = calls[name]
                        if fn is None:
                            continue
                        with configs.override(settings) if settings is not None else contextlib.nullcontext():
                            times[name] = time_ms(fn, device)
                    base = times.get(first)
                    for name, ms in times.items():
                        timed.append(dict(case, name=name, round=r, ms=ms, tflops=f / ms / 1e9))
                        timed[-1]["vs_first"] = base / ms if base else None
                rows += timed
                summary = " ".join(
                    f"{name} {statistics.median(r['tflops'] for r in mine):.0f}"
                    f" ({statistics.median(r['vs_first'] or 0 for r in mine):.3f})"
                    for name in calls
                    if (mine := [r for r in timed if r["name"] == name])
                )
                print(f"{mode} hd{headdim} {seqlen} causal={int(causal)}: {summary}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


EXP2_POLYS = (0, 2, 3, 4)


def _exp2_settings(s: Settings, k: int) -> Settings:
    """``s`` with ``exp2_poly = k`` in every forward table (the portable forward's and the Gluon one's)."""
    return configs.with_builds(s, fwd=dict(exp2_poly=k), gluon=dict(exp2_poly=k))


def exp2_splits(
    headdims=(64, 128, 256),
    seqlens=(2048, 16384),
    polys=EXP2_POLYS,
    rounds: int = 3,
    tokens: int = 16384,
    hidden: int = 2048,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """Forward TFLOP/s (``time_builds``) with ``exp2_poly = k`` for each k of ``polys`` (builds named
    ``exp2_poly=k``, rows with ``poly``), the first k the baseline. (On the CPU: the kernels under the
    interpreter.)"""
    s = configs.current(torch.device(device))
    poly_of = {f"exp2_poly={poly}": poly for poly in polys}
    builds = {name: _exp2_settings(s, poly) for name, poly in poly_of.items()}
    rows = time_builds(lambda headdim: builds, "fwd", headdims, seqlens, rounds, tokens, hidden, device, dtype, None)
    return [dict(row, poly=poly_of[row["name"]]) for row in rows]


def _gluon_everywhere(s: Settings, headdim: int, **entry) -> Settings | None:
    """``s`` with the Gluon forward at every length at ``headdim`` (``gluon_min_seqlen_k`` cleared), its
    entries changed by ``entry``; None where the settings have no Gluon forward there."""
    if headdim not in s.fwd_gluon:
        return None
    short = {headdim: replace(s.fwd_gluon_short[headdim], **entry)} if headdim in s.fwd_gluon_short else {}
    return replace(
        s,
        fwd_gluon={**s.fwd_gluon, headdim: replace(s.fwd_gluon[headdim], **entry)},
        fwd_gluon_short={**s.fwd_gluon_short, **short},
        gluon_min_seqlen_k={},
    )


def _portable(s: Settings, headdim: int) -> Settings | None:
    if headdim not in s.fwd_gluon:
        return None
    drop = lambda table: {d: c for d, c in table.items() if d != headdim}  # noqa: E731
    return replace(s, fwd_gluon=drop(s.fwd_gluon), fwd_gluon_short=drop(s.fwd_gluon_short))


def _gluon_short(s: Settings, headdim: int) -> Settings | None:
    if headdim not in s.fwd_gluon or headdim in s.fwd_gluon_short:
        return None
    both = _gluon_everywhere(s, headdim)
    return replace(
        both, fwd_gluon_short={**both.fwd_gluon_short, headdim: replace(both.fwd_gluon[headdim], num_stages=3)}
    )


def _three_warpgroups(s: Settings, headdim: int) -> Settings | None:
    stages = {64: 4, 96: 3}.get(headdim)
    return None if stages is None else _gluon_everywhere(s, headdim, block_m=192, block_n=64, num_stages=stages)


def _dq_first(s: Settings, headdim: int) -> Settings | None:
    cfg = s.bwd_gluon.get(headdim)
    if cfg is None or cfg.dq_first:
        return None
    return replace(s, bwd_gluon={**s.bwd_gluon, headdim: replace(cfg, dq_first=True)})


# ``--levers``: the options the tables do not take yet, each (the pass it changes, a function of the
# device's settings and a head dim giving the changed settings, or None where it does not apply there)
LEVERS = {
    "portable": ("fwd", _portable),  # the portable forward where the tables run the Gluon one
    "gluon": ("fwd", _gluon_everywhere),  # the Gluon forward at every length (gluon_min_seqlen_k cleared)
    "gluon-short": ("fwd", _gluon_short),  # and a persistent grid under gluon_short_seqlen_k where none is
    "three-warpgroups": ("fwd", _three_warpgroups),  # 192-row Gluon tiles at head dims 64 and 96
    "pingpong": ("fwd", lambda s, d: _gluon_everywhere(s, d, pingpong=True)),  # the named-barrier ping-pong
    # causal Gluon forwards: all heads in one group (no L2 budget); the persistent grid's snake order
    "all-heads": ("fwd", lambda s, d: replace(s, gluon_l2_bytes=0) if d in s.fwd_gluon and s.gluon_l2_bytes else None),
    "snake": (
        "fwd",
        lambda s, d: replace(s, gluon_snake=True) if d in s.fwd_gluon_short and not s.gluon_snake else None,
    ),
    "dq-first": ("bwd", _dq_first),  # the Gluon backward's dK after dQ
}


def levers(names, headdims=(64, 128), seqlens=(2048, 16384), **kwargs) -> list[dict]:
    """``time_builds`` of the tables' builds (``table``) and each lever of ``names`` (``LEVERS``) that
    applies at a head dim, the forward levers and the backward ones each against the tables' same pass."""
    s = configs.current(torch.device(kwargs.get("device", "cuda")))
    rows = []
    for mode in ("fwd", "bwd"):
        chosen = [name for name in names if LEVERS[name][0] == mode]
        if not chosen:
            continue

        def builds_of(headdim, chosen=chosen):
            changed = {name: LEVERS[name][1](s, headdim) for name in chosen}
            return {"table": s, **{name: c for name, c in changed.items() if c is not None}}

        rows += time_builds(builds_of, mode, headdims, seqlens, **kwargs)
    return rows


def exp2_splits_fp8(headdims=(64, 128, 256), seqlens=(4096, 16384), polys=EXP2_POLYS) -> list[dict]:
    """``bench --fp8``'s grid (bf16 and the FP8 forward, each FP8 build checked with its tolerance first) with
    the FP8 forward also under ``exp2_poly = k`` for each k of ``polys`` past 0."""
    from tileattn.bench.__main__ import time_ms
    from tileattn.bench.fp8 import format_fp8, run_fp8

    s = configs.current(torch.device("cuda"))
    variants = {f"exp2_poly={k}": functools.partial(configs.override, _exp2_settings(s, k)) for k in polys if k}
    rows = run_fp8(time_ms, seqlens=seqlens, headdims=headdims, variants=variants)
    print(format_fp8(rows), flush=True)
    return rows


def _e4m3_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row (last dim) through e4m3 at its own factor, amax / 448, back in t's dtype (how the decode
    kernel's "fp8" and "none" round q)."""
    amax = t.float().abs().amax(-1, keepdim=True)
    factor = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return ((t.float() / factor).clamp(-448, 448).to(torch.float8_e4m3fn).float() * factor).to(t.dtype)


def fp8_widenings(rounds: int = 3, cases=((8, 32768), (64, 16384)), nheads=32, nheads_k=8, headdim=128) -> list[dict]:
    """Tokens/s of FP8-cache decoding under each ``DecodeSettings.fp8_widen`` and of the bf16 cache, in
    ``rounds`` alternating rounds, contiguous and paged (pages of 64); ratios to bf16 per round."""
    from tileattn import fp8
    from tileattn.bench.__main__ import time_ms
    from tileattn.bench.fp8 import _paged, decode_inputs, decode_step

    s = configs.current(torch.device("cuda"))
    widenings = ("f16", "fp8", "none")
    rows = []
    for batch, seqlen in cases:
        gen, q, kc, vc, kc8, kd, vc8, vd, seqlens = decode_inputs(batch, seqlen, nheads, nheads_k, headdim)
        k0, v0 = (fp8.dequantize(t[:1], d[:1], dtype=torch.float64)[0] for t, d in ((kc8, kd), (vc8, vd)))
        ref = decode_step(q[0, 0], k0, v0, torch.float64)
        lowp = {
            "f16": decode_step(q[0, 0], k0, v0, torch.bfloat16),
            "fp8": decode_step(_e4m3_rows(q[0, 0]), k0, v0, torch.bfloat16),
            "none": decode_step(_e4m3_rows(q[0, 0]), k0, v0, torch.bfloat16, e4m3_probs=True),
        }
        for paged in (False, True):
            if paged:
                (k16, v16, k8, v8), table = _paged((kc, vc, kc8, vc8), 64, gen)
                layout = dict(block_table=table)
            else:
                k16, v16, k8, v8, layout = kc, vc, kc8, vc8, {}
            calls = {"bf16": (s, (q, k16, v16), {})}
            for w in widenings:
                settings = replace(s, decode=replace(s.decode, fp8_widen=w))
                calls[w] = (settings, (q, k8, v8), dict(k_descale=kd, v_descale=vd))
            usable = {}
            for name, (settings, args, extra) in calls.items():
                with configs.override(settings):
                    out = tileattn.flash_attn_with_kvcache(*args, cache_seqlens=seqlens, **layout, **extra)
                    try:
                        if name != "bf16":
                            check_close(f"fp8_widen={name}", out[0, 0].double(), ref, lowp[name])
                        usable[name] = (settings, args, extra)
                    except AssertionError as e:
                        rows.append(dict(batch=batch, seqlen=seqlen, paged=paged, build=name, error=str(e)[:300]))
                        print(f"{batch} x {seqlen} paged={paged} {name}: {str(e)[:200]}", flush=True)
            for r in range(rounds):
                times = {}
                for name, (settings, args, extra) in usable.items():
                    with configs.override(settings):
                        call = functools.partial(
                            tileattn.flash_attn_with_kvcache, *args, cache_seqlens=seqlens, **layout, **extra
                        )
                        times[name] = time_ms(call, "cuda")
                for name, ms in times.items():
                    row = dict(batch=batch, seqlen=seqlen, paged=paged, build=name, round=r, ms=ms)
                    row.update(tok_s=batch / ms * 1e3, vs_bf16=times["bf16"] / ms)
                    rows.append(row)
                    print(
                        f"round {r} {batch} x {seqlen} {'paged' if paged else 'contiguous':10s} {name:5s} "
                        f"{row['tok_s']:.0f} tokens/s {row['vs_bf16']:.2f}x bf16",
                        flush=True,
                    )
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tileattn.bench.tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256], help="head dims (default 64 128 256)")
    ap.add_argument(
        "--seqlen", type=int, nargs="+", default=[4096], help="tokens per sequence, 16k tokens a batch (default 4096)"
    )
    ap.add_argument("--causal", action="store_true", help="time causal attention (default: not)")
    ap.add_argument("--dropout", type=float, default=0.0, help="time the candidates with this dropout_p (default 0)")
    ap.add_argument(
        "--mla", action="store_true", help="MLA decoding's builds instead, bench --mla's rows (default: off)"
    )
    ap.add_argument(
        "--fp8-widen", action="store_true", help="FP8 KV-cache decoding under each fp8_widen instead (default: off)"
    )
    ap.add_argument(
        "--exp2-poly",
        action="store_true",
        help="the forward with k of every 8 exponentials by polynomial, k in 0 2 3 4, instead (default: off)",
    )
    ap.add_argument("--fp8", action="store_true", help="with --exp2-poly: the FP8 forward's grid (default: bf16)")
    ap.add_argument(
        "--levers",
        nargs="+",
        choices=list(LEVERS),
        help="these options the tables do not take, each against the tables' builds and cuDNN, causal and not, "
        "at --headdim and --seqlen, instead (default: none)",
    )
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file (default: none)")
    args = ap.parse_args(argv)
    if args.fp8 and not args.exp2_poly:
        ap.error("--fp8 goes with --exp2-poly")
    if (args.exp2_poly or args.levers) and (args.causal or args.dropout):
        ap.error("--exp2-poly and --levers time causal and non-causal calls without dropout: drop --causal / --dropout")
    if args.exp2_poly and args.levers:
        ap.error("--exp2-poly and --levers are two runs: name one")
    if args.mla or args.fp8_widen or args.exp2_poly or args.levers:
        sizes = dict(headdims=tuple(args.headdim), seqlens=tuple(args.seqlen))
        if args.levers:
            rows = levers(args.levers, **sizes)
        elif args.exp2_poly:
            rows = exp2_splits_fp8(**sizes) if args.fp8 else exp2_splits(**sizes)
        elif args.mla:
            rows = mla_builds()
        else:
            rows = fp8_widenings()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    everything = {}
    for d, seqlen in ((d, n) for d in args.headdim for n in args.seqlen):
        res = sweep(d, seqlen, args.causal, dropout_p=args.dropout)
        everything[f"{d}" if len(args.seqlen) == 1 else f"{d}-{seqlen}"] = res
        for kind in ("fwd", "dkdv", "dq"):
            ok = sorted((r for r in res if r["kind"] == kind and "ms" in r), key=lambda r: r["ms"])
            for r in ok:
                print(f"hd{d} {seqlen} {kind:5s} {r['cfg']} {r['ms']:.3f} ms {r['tflops']:.1f} TFLOP/s", flush=True)
            for r in res:
                if r["kind"] == kind and "error" in r:
                    print(f"hd{d} {seqlen} {kind:5s} {r['cfg']} error {r['error']}")
            if ok:
                print(
                    f"BEST hd{d} {seqlen} {kind}: {ok[0]['cfg']} ({ok[0]['tflops']:.1f} TFLOP/s{' incl. other pass' if kind != 'fwd' else ''})"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
