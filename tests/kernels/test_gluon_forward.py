"""The Gluon forward (kernels/gluon/forward.py) on an sm90 GPU against the tests' oracle: odd lengths,
GQA/MQA, causal with seqlen_q != seqlen_k (rows that see no key), sliding windows, packed batches, fp16
and bf16, each build the settings or the bench may pick (stages, key tiles, persistent grids of a few
programs), and the public functions' dispatch to it with the portable backward behind it. Gluon kernels
do not run in Triton's interpreter: off sm90, or with a Triton whose Gluon the kernels were not written
for, these tests skip (the builds themselves are checked without a GPU in test_sm90_builds.py)."""

import pytest
import torch

import oracle
import tileattn
from helpers import (
    GLUON_VARLEN_CASES,
    GLUON_WINDOW_CASES,
    SLOW,
    check_lse,
    gluon_case_inputs,
    needs_gluon,
    record_calls,
)
from tileattn.kernels import configs
from tileattn.params import AttnParams
from tileattn.testing import check_close

pytestmark = needs_gluon("the Gluon forward")

CASES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, dtype
    (2, 1, 1, 4, 4, 64, False, torch.bfloat16),
    (2, 63, 63, 4, 4, 128, True, torch.bfloat16),
    (1, 113, 1025, 8, 2, 128, True, torch.bfloat16),
    (1, 1025, 113, 8, 2, 64, True, torch.bfloat16),  # rows before key 0's diagonal see no key
    (3, 1025, 1025, 4, 1, 128, False, torch.float16),
    (1, 2048, 3000, 2, 2, 64, False, torch.bfloat16),
    (2, 1000, 1000, 6, 3, 64, True, torch.float16),
    (2, 777, 777, 2, 1, 256, True, torch.bfloat16),
    (1, 63, 1025, 4, 4, 256, False, torch.float16),
    # one key more than queries (bottom-right causal): each row tile's last row sees the first key of the
    # next key tile, which a key loop that stops one key short drops
    (1, 512, 513, 2, 1, 128, True, torch.bfloat16),
    # head dim 96 as two column parts (64 + 32)
    (2, 300, 257, 4, 2, 96, True, torch.bfloat16),
    (1, 1025, 1025, 3, 3, 96, False, torch.float16),
]
BUILDS = {  # the tables' builds, and builds whose few programs each loop over many work items; block_m=192:
    # three consumer warpgroups (FlashAttention-3's head-dim-64 forward). l2_bytes=100_000: causal calls walk
    # their heads in groups of a few (the last one smaller where they do not divide: 3, 3, 2 of 8 at 63 keys)
    64: [
        dict(block_n=128, stages=2),
        dict(block_n=128, stages=3, programs=7, l2_bytes=100_000),
        dict(block_m=192, block_n=64, stages=4),
        dict(block_m=192, block_n=128, stages=3, programs=7),
    ],
    96: [dict(block_n=128, stages=2), dict(block_n=128, stages=2, programs=5, l2_bytes=100_000)],
    128: [
        dict(block_n=128, stages=2),
        dict(block_n=128, stages=3, programs=5, l2_bytes=100_000),
        dict(block_m=192, block_n=64, stages=3),
    ],
    256: [dict(block_n=64, stages=2), dict(block_n=64, stages=2, programs=3, l2_bytes=100_000)],
}
# Builds the settings do not pick (docs/perf.md, "Decisions"), run with TILEATTN_SLOW=1 (the
# suite's default run stays within one device call): mask_loops (the key loop as three branch-free loops; its
# bounds decide which tiles skip the mask: one such build a head dim), and three consumer warpgroups at 96.
# The ping-pong has its own test below.
OPTION_BUILDS = {
    64: [dict(block_m=192, block_n=64, stages=4, programs=7, mask_loops=True)],
    96: [
        dict(block_n=128, stages=2, programs=5, mask_loops=True),
        dict(block_m=192, block_n=64, stages=3, programs=7),
    ],
    128: [
        dict(block_n=128, stages=2, programs=5, mask_loops=True),
        dict(block_n=128, stages=3, programs=5, l2_bytes=100_000, snake=True),
    ],
    256: [dict(block_n=64, stages=2, mask_loops=True)],
}


def _builds(headdim: int) -> list[dict]:
    """The builds a test runs at this head dim: the tables', and with TILEATTN_SLOW=1 those they do not pick."""
    return BUILDS.get(headdim, []) + (OPTION_BUILDS[headdim] if SLOW else [])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_builds_match_the_oracle(case):
    from tileattn.kernels.gluon import forward as hopper

    batch, seqlen_q, seqlen_k, _, _, headdim, causal, _ = case
    q, k, v = gluon_case_inputs(case, 3)
    ref = oracle.attention(q, k, v, causal=causal)
    low = oracle.attention(q, k, v, causal=causal, precision=None)
    p = AttnParams(batch, seqlen_q, seqlen_k, headdim, headdim**-0.5, window_right=0 if causal else -1)
    assert hopper.eligible(q, k, v, p)
    for build in _builds(headdim):
        out, lse = hopper.attn_fwd(q, k, v, p, **build)
        check_close(f"out {build}", out, ref.out, low.out)
        check_lse(f"lse {build}", lse, ref.lse, low.lse.float())


# The ping-pong builds run in a process of their own with a time limit: turns that do not balance hang (a
# warpgroup waiting at a barrier nobody arrives at), which then fails this test instead of hanging the suite.
PINGPONG_CHECK = """
import torch, oracle
from helpers import check_lse, gluon_case_inputs
from tileattn.kernels.gluon import forward as hopper
from tileattn.params import AttnParams
from tileattn.testing import check_close

for case in CASES:
    batch, seqlen_q, seqlen_k, _, _, headdim, causal, _ = case
    q, k, v = gluon_case_inputs(case, 3)
    ref = oracle.attention(q, k, v, causal=causal)
    low = oracle.attention(q, k, v, causal=causal, precision=None)
    p = AttnParams(batch, seqlen_q, seqlen_k, headdim, headdim**-0.5, window_right=0 if causal else -1)
    for build in BUILDS[headdim]:
        out, lse = hopper.attn_fwd(q, k, v, p, pingpong=True, **build)
        check_close(f"out {case} {build}", out, ref.out, low.out)
        check_lse(f"lse {case} {build}", lse, ref.lse, low.lse.float())
    print("ok", case, flush=True)
"""
PINGPONG_CASES = [  # each head dim it builds at; GQA, causal with more keys than queries
    (1, 113, 1025, 8, 2, 128, True, torch.bfloat16),
    (2, 700, 700, 4, 2, 128, False, torch.float16),
    (2, 777, 777, 2, 1, 256, True, torch.bfloat16),
    (2, 300, 257, 4, 2, 96, True, torch.bfloat16),
]


@pytest.mark.slow  # (a build the settings do not pick)
def test_pingpong_builds_match_the_oracle():
    """The ping-pong build (``pingpong``: the two consumer warpgroups take turns issuing their wgmmas through
    named barriers) at head dims 96, 128 and 256, one program per SM and a few programs looping over many
    work items (the turns carry on from one item to the next), against the oracle."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parents[1]
    builds = {d: [b for b in _builds(d) if b.get("block_m", 128) == 128] for d in (96, 128, 256)}
    script = f"CASES = {PINGPONG_CASES!r}\nBUILDS = {builds!r}\n".replace("torch.", "")
    script = "from torch import bfloat16, float16\n" + script + PINGPONG_CHECK
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    try:
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"a ping-pong build hung (300 s); it had printed:\n{e.stdout}")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.count("ok") == len(PINGPONG_CASES), res.stdout


def test_block_m_is_checked():
    """A work item is two or three consumer warpgroups of 64 rows: other block_m values are refused, the
    ping-pong with three, and FP8 at a head dim of two column parts (96)."""
    from tileattn.kernels.gluon import forward as hopper

    case = (1, 64, 64, 2, 2, 64, False, torch.bfloat16)
    q, k, v = gluon_case_inputs(case, 3)
    with pytest.raises(ValueError, match="block_m must be one of"):
        hopper.attn_fwd(q, k, v, AttnParams(1, 64, 64, 64, 0.125), block_m=256)
    with pytest.raises(ValueError, match="pingpong takes turns between two"):
        hopper.attn_fwd(q, k, v, AttnParams(1, 64, 64, 64, 0.125), block_m=192, pingpong=True)
    q8 = torch.zeros(1, 64, 2, 96, device="cuda").to(torch.float8_e4m3fn)
    descales = torch.ones(3, 1, 2, device="cuda")
    with pytest.raises(ValueError, match=r"FP8 inputs take head dims \(64, 128, 256\)"):
        hopper.attn_fwd(q8, q8, q8, AttnParams(1, 64, 64, 96, 0.1, descales=descales))


@pytest.mark.parametrize("headdim", sorted(configs.HOPPER.fwd_gluon))
def test_public_call_runs_it_with_the_portable_backward(headdim, monkeypatch):
    """The public call runs the Gluon forward at the head dims the settings give it, with the portable
    backward behind it, against the oracle; settings that leave the head dim out run the portable forward,
    and so do the settings' own where the call has fewer keys than ``gluon_min_seqlen_k`` asks (head dim 64)."""
    from dataclasses import replace

    from tileattn.kernels.gluon import forward as hopper

    case = (2, 300, 300, 4, 2, headdim, True, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in gluon_case_inputs(case, 3))
    dout = torch.randn_like(q)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    ref = oracle.attention(qr, kr, vr, causal=True)
    ref.out.backward(dout.double())
    lows = [t.detach().requires_grad_() for t in (q, k, v)]
    low = oracle.attention(*lows, causal=True, precision=None)
    low.out.backward(dout)
    base = configs.for_device(q.device)
    drop = lambda table: {d: c for d, c in table.items() if d != headdim}  # noqa: E731
    runs = [
        (replace(base, gluon_min_seqlen_k={}), True),
        (replace(base, fwd_gluon=drop(base.fwd_gluon), fwd_gluon_short=drop(base.fwd_gluon_short)), False),
        (base, 300 >= base.gluon_min_seqlen_k.get(headdim, 0)),
    ]
    calls = record_calls(monkeypatch, hopper.Plan, "run")  # (the public calls run its plans)
    for settings, gluon in runs:
        calls.clear()
        for t in (q, k, v):
            t.grad = None
        with configs.override(settings):
            out = tileattn.flash_attn_func(q, k, v, causal=True)
            out.backward(dout)
        assert len(calls) == gluon, (sorted(settings.fwd_gluon), len(calls))
        check_close(f"out (Gluon: {gluon})", out, ref.out, low.out)
        for name, t, r, lo in zip("qkv", (q, k, v), (qr, kr, vr), lows):
            check_close(f"d{name} (Gluon forward: {gluon})", t.grad, r.grad, lo.grad)


def test_calls_it_cannot_compute_run_the_portable_kernels():
    """Dropout, softcap, a softmax scale of 0 or below, fp32, heads that are not one TMA row: not eligible
    (the portable forward runs); a packed qkv's q, k and v are, and windows."""
    from tileattn.kernels.gluon import forward as hopper

    q, k, v = gluon_case_inputs((1, 128, 128, 2, 2, 128, False, torch.bfloat16), 3)
    p = AttnParams(1, 128, 128, 128, 128**-0.5)
    assert hopper.eligible(q, k, v, p)
    for change in (dict(dropout_p=0.1), dict(softcap=5.0)):
        assert not hopper.eligible(q, k, v, AttnParams(1, 128, 128, 128, 128**-0.5, **change))
    assert hopper.eligible(q, k, v, AttnParams(1, 128, 128, 128, 128**-0.5, window_left=16, window_right=0))
    for scale in (0.0, -0.1):  # (masked -inf times the scale; the row max of the products is not the scores')
        assert not hopper.eligible(q, k, v, AttnParams(1, 128, 128, 128, scale))
    assert not hopper.eligible(q.float(), k.float(), v.float(), p)
    packed = torch.randn(1, 128, 3, 2, 128, device="cuda", dtype=torch.bfloat16)  # q of a packed qkv
    assert hopper.eligible(packed[:, :, 0], packed[:, :, 1], packed[:, :, 2], p)
    padded = torch.randn(1, 128, 2, 136, device="cuda", dtype=torch.bfloat16)[..., :128]  # heads apart
    assert not hopper.eligible(padded, k, v, p)


VARLEN_CASES = GLUON_VARLEN_CASES + [
    ([777, 5, 130], [777, 130, 5], 4, 4, 256, True, torch.bfloat16),  # rows before key 0's diagonal
    ([130, 0, 301], [77, 3, 301], 4, 1, 96, True, torch.bfloat16),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_packed_batches_match_the_oracle(case, monkeypatch):
    """Packed (varlen) batches: each sequence's rows start anywhere in the packed tensor, query tiles cross
    into the next sequence (whose rows they must not write), sequences with no rows or no keys, query
    blocks past a short sequence's end (the grid covers the longest, and skips those); each build, and
    through the public call."""
    from tileattn.kernels.gluon import forward as hopper

    lens_q, lens_k, nheads, nheads_k, headdim, causal, dtype = case
    g = torch.Generator(device="cuda").manual_seed(len(lens_q) * 1000 + headdim)
    cu_q, cu_k = ([0, *torch.tensor(lens).cumsum(0).tolist()] for lens in (lens_q, lens_k))
    q = torch.randn(cu_q[-1], nheads, headdim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(cu_k[-1], nheads_k, headdim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    ref = oracle.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    low = oracle.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, precision=None)
    cu_q_t, cu_k_t = (torch.tensor(cu, dtype=torch.int32, device="cuda") for cu in (cu_q, cu_k))
    p = AttnParams(
        len(lens_q), max(lens_q), max(lens_k), headdim, headdim**-0.5, window_right=0 if causal else -1,
        cu_seqlens_q=cu_q_t, cu_seqlens_k=cu_k_t,
    )  # fmt: skip
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    assert hopper.eligible(q4, k4, v4, p)
    for build in _builds(headdim):
        out, lse = hopper.attn_fwd(q4, k4, v4, p, **build)
        assert out.shape == q4.shape and lse.shape == (nheads, cu_q[-1])
        check_close(f"out {build}", out[0], ref.out, low.out)
        check_lse(f"lse {build}", lse, ref.lse, low.lse.float())
    calls = record_calls(monkeypatch, hopper.Plan, "run")  # (the public calls run its plans)
    out = tileattn.flash_attn_varlen_func(q, k, v, cu_q_t, cu_k_t, max(lens_q), max(lens_k), causal=causal)
    assert len(calls) == (configs.gluon_fwd_config(p, configs.for_device(q.device), headdim) is not None)
    check_close("out (public call)", out, ref.out, low.out)


WINDOW_CASES = GLUON_WINDOW_CASES + [
    (1, 300, 2000, 2, 1, 256, (-1, 17), torch.bfloat16),
    (1, 513, 513, 2, 2, 64, (32, 1), torch.float16),  # right side 1: row tiles' last rows reach the next key tile
    pytest.param((2, 700, 700, 4, 2, 96, (100, 0), torch.bfloat16), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("heads_apart", [False, True], ids=["rows-of-positions", "rows-of-one-head"])
def test_head_dim_96_reads_both_column_parts_in_each_layout(heads_apart):
    """Head dim 96 runs as two column parts (64 + 32, ``HEAD_PARTS``): the second part's TMA tiles start
    64 columns into each head, in both matrices TMA reads (flash_attn's rows of positions with the heads
    side by side, and rows of one head's positions, as a (batch, nheads, seqlen, headdim) tensor
    transposed), GQA, causal with more keys than queries; every column of the output against the oracle."""
    from tileattn.kernels.gluon import forward as hopper

    case = (2, 200, 333, 6, 2, 96, True, torch.bfloat16)
    q, k, v = gluon_case_inputs(case, 3)
    if heads_apart:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    ref = oracle.attention(q, k, v, causal=True)
    low = oracle.attention(q, k, v, causal=True, precision=None)
    p = AttnParams(2, 200, 333, 96, 96**-0.5, window_right=0)
    assert hopper.eligible(q, k, v, p)
    for build in _builds(96):
        out, lse = hopper.attn_fwd(q, k, v, p, **build)
        for part in (slice(0, 64), slice(64, 96)):  # (each part on its own: the error names the one off)
            check_close(
                f"out[..., {part.start}:{part.stop}] {build}", out[..., part], ref.out[..., part], low.out[..., part]
            )
        check_lse(f"lse {build}", lse, ref.lse, low.lse.float())


@pytest.mark.parametrize("case", WINDOW_CASES, ids=str)
def test_windows_match_the_oracle(case, monkeypatch):
    """Sliding windows (bottom-right aligned as flash_attn's): each side alone and both, rows whose window
    holds no key, key tiles starting at the first row's window; each build, and through the public call
    (dense, and the same rows as a packed batch)."""
    from tileattn.kernels.gluon import forward as hopper

    batch, seqlen_q, seqlen_k, _, _, headdim, window, _ = case
    q, k, v = gluon_case_inputs(case, 3)
    ref = oracle.attention(q, k, v, window_size=window)
    low = oracle.attention(q, k, v, window_size=window, precision=None)
    p = AttnParams(batch, seqlen_q, seqlen_k, headdim, headdim**-0.5, window_left=window[0], window_right=window[1])
    assert hopper.eligible(q, k, v, p)
    for build in _builds(headdim):
        out, lse = hopper.attn_fwd(q, k, v, p, **build)
        check_close(f"out {build}", out, ref.out, low.out)
        check_lse(f"lse {build}", lse, ref.lse, low.lse.float())
    calls = record_calls(monkeypatch, hopper.Plan, "run")  # (the public calls run its plans)
    out = tileattn.flash_attn_func(q, k, v, window_size=window)
    check_close("out (public call)", out, ref.out, low.out)
    cu_q, cu_k = (torch.arange(0, (batch + 1) * n, n, device="cuda", dtype=torch.int32) for n in (seqlen_q, seqlen_k))
    packed = tileattn.flash_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, seqlen_q, seqlen_k, window_size=window
    )
    check_close("out (packed)", packed.view(q.shape), ref.out, low.out)
    assert len(calls) == 2 * (configs.gluon_fwd_config(p, configs.for_device(q.device), headdim) is not None)
