"""The Gluon backward (kernels/gluon/backward.py) on an sm90 GPU against the tests' oracle: odd lengths
(one row, tails of a 64-row tile and of a 128-key block), GQA/MQA, causal with seqlen_q != seqlen_k (rows
that see no key), packed (varlen) batches, fp16 and bf16, head dims 64, 128 and 256,
each build the settings or the bench may pick (ring depth, query tiles of 128 rows at head dim 64, dQ by
TMA reduce-adds or atomic adds), sliding windows (key blocks no row sees), dropout, head-major layouts, and the portable backward's
dispatch to it when the settings ask. Gluon kernels do not run in Triton's interpreter: off sm90, or with a Triton
whose Gluon the kernels were not written for, these tests skip (the builds themselves are checked without
a GPU in test_sm90_builds.py)."""

import pytest
import torch

import dropout_ref
import oracle
import tileattn
from helpers import GLUON_VARLEN_CASES, GLUON_WINDOW_CASES, SLOW, gluon_case_inputs, needs_gluon, record_calls
from tileattn.kernels import configs
from tileattn.params import AttnParams
from tileattn.testing import check_close

pytestmark = needs_gluon("the Gluon backward")

CASES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, dtype
    (2, 1, 1, 4, 4, 64, False, torch.bfloat16),
    (2, 1, 1, 4, 4, 128, True, torch.float16),
    (2, 63, 63, 4, 4, 128, True, torch.bfloat16),
    (1, 113, 1025, 8, 2, 128, True, torch.bfloat16),  # each row sees most keys (the diagonal at the bottom right)
    (1, 1025, 113, 8, 2, 64, True, torch.bfloat16),  # rows before key 0's diagonal see no key
    (3, 1025, 1025, 4, 1, 128, False, torch.float16),
    (1, 113, 1025, 2, 1, 64, False, torch.float16),
    (2, 1000, 1000, 6, 3, 64, True, torch.float16),
    (2, 777, 300, 8, 8, 128, False, torch.bfloat16),
]
# dq_first at head dims 64 and 128: a tile's dK issued after its dQ, whose add then runs under it (by TMA
# reduce-adds or atomic adds), a build the settings do not pick (docs/perf.md, "Decisions"), run with
# TILEATTN_SLOW=1 (the suite's default run stays within one device call)
DQ_FIRST = SLOW
BUILDS = [dict(stages=2), dict(stages=3), dict(stages=2, dq_tma=False), dict(stages=2, lse_load="load")]
BUILDS += [dict(stages=3, dq_first=True), dict(stages=2, dq_tma=False, dq_first=True)] if DQ_FIRST else []
WIDE_BUILDS = {  # query tiles of 128
    64: [dict(block_m=128, stages=2), dict(block_m=128, stages=2, dq_tma=False)]
    + ([dict(block_m=128, dq_first=True)] if DQ_FIRST else [])
}
# head dim 256, the split build (64 keys a program, each warpgroup half the head dim of dK and dV): dQ by
# atomic adds on a ring of 2, or by TMA reduce-adds (whose staging leaves room for a ring of 1)
SPLIT_BUILDS = [
    dict(block_n=64, stages=2, dq_tma=False),
    dict(block_n=64, stages=1),
    dict(block_n=64, stages=2, dq_tma=False, lse_load="load"),
    dict(block_n=64, stages=1, lse_load="load"),
    dict(block_n=64, stages=2, dq_tma=False, dq_first=True),  # dQ's first chunk before dV and dK
    dict(block_n=64, stages=1, dq_first=True),
    dict(block_n=64, stages=2, dq_chunk=32, dq_first=True),  # dQ in chunks of 32 columns: room for 2 stages
    dict(block_n=64, stages=1, dq_chunk=32),
]
SPLIT_CASES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, dtype
    (2, 1, 1, 2, 2, 256, False, torch.bfloat16),
    (2, 63, 63, 2, 2, 256, True, torch.float16),
    (1, 113, 1025, 4, 2, 256, True, torch.bfloat16),  # each row sees most keys
    (1, 1025, 113, 4, 1, 256, True, torch.bfloat16),  # rows before key 0's diagonal see no key
    (2, 777, 300, 3, 3, 256, False, torch.float16),
]


def _builds(headdim: int) -> list[dict]:
    """The builds a test runs at this head dim: the split ones at 256."""
    if headdim == 256:
        return SPLIT_BUILDS
    return [dict(stages=2), dict(stages=2, dq_tma=False)] + WIDE_BUILDS.get(headdim, [])


def _references(q, k, v, dout, causal, window=(-1, -1), **dropout):
    """The oracle's gradients (fp64) and plain PyTorch's (the inputs' precision), with the oracle's output
    and LSE (the backward's inputs); ``dropout``: the oracle's dropout_p and dropout_mask."""
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = oracle.attention(qr, kr, vr, causal=causal, window_size=window, **dropout)
    ref.out.backward(dout.double())
    lows = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low = oracle.attention(*lows, causal=causal, window_size=window, precision=None, **dropout)
    low.out.backward(dout)
    return ref, (qr.grad, kr.grad, vr.grad), tuple(t.grad for t in lows)


def _lse_delta(ref, dout):
    """The backward's LSE and Δ = rowsum(dO ∘ O) of a dense call, ``(batch, nheads, seqlen_q)`` fp32, from the
    oracle's result (its output in dO's precision, as the forward returns it; LSE +inf for rows that see no
    key)."""
    delta = (dout.float() * ref.out.to(dout.dtype).float()).sum(-1).transpose(1, 2).contiguous()
    return ref.lse.float().contiguous(), delta


@pytest.mark.parametrize("case", CASES + SPLIT_CASES, ids=str)
def test_builds_match_the_oracle(case):
    """Each build at each case; head dim 256, the split builds: each warpgroup computes Sᵀ and dPᵀ of its half
    of a tile's queries and the dK, dV and dQ of its half of the head dim, from Pᵀ and dSᵀ tiles both halves
    write."""
    from tileattn.kernels.gluon import backward as hopper

    batch, seqlen_q, seqlen_k, _, _, headdim, causal, dtype = case
    q, k, v, dout = gluon_case_inputs(case, 4)
    ref, grads_ref, grads_low = _references(q, k, v, dout, causal)
    lse, delta = _lse_delta(ref, dout)
    p = AttnParams(batch, seqlen_q, seqlen_k, headdim, headdim**-0.5, window_right=0 if causal else -1)
    assert hopper.eligible(q, k, v, dout, p)
    # (the rounding floor at the gradients' scale, as tests/helpers.py sets it: one row and one key give
    # dk = 0 exactly, from dP - delta, two fp32 sums of the same products in another order)
    scale = torch.stack([r.abs().max() for r in grads_ref])
    for build in SPLIT_BUILDS if headdim == 256 else BUILDS + WIDE_BUILDS.get(headdim, []):
        grads = hopper.attn_bwd(dout, q, k, v, lse, delta, p, **build)
        for name, t, r, lo in zip(("dq", "dk", "dv"), grads, grads_ref, grads_low):
            assert t.dtype == dtype and t.shape == r.shape
            check_close(f"{name} {build}", t, r, lo, floor_scale=scale)


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_public_call_runs_it_when_the_settings_ask(headdim, monkeypatch):
    from tileattn.kernels.gluon import backward as hopper

    calls = record_calls(monkeypatch, hopper.Plan, "run")  # (the public calls run its plans)
    case = (2, 300, 300, 4, 2, headdim, True, torch.bfloat16)
    q, k, v, dout = gluon_case_inputs(case, 4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with configs.override(configs.HOPPER):
        out = tileattn.flash_attn_func(q, k, v, causal=True)
        out.backward(dout)
    assert len(calls) == 1
    _, grads_ref, grads_low = _references(q, k, v, dout, True)
    scale = torch.stack([r.abs().max() for r in grads_ref])
    for name, t, r, lo in zip("qkv", (q, k, v), grads_ref, grads_low):
        check_close(f"d{name}", t.grad, r, lo, floor_scale=scale)


DROPOUT_CASES = [  # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, dtype
    (1, 1, 1, 2, 2, 64, False, torch.bfloat16),
    (2, 63, 63, 4, 4, 128, True, torch.bfloat16),
    (1, 113, 1025, 8, 2, 128, True, torch.float16),  # each row sees most keys
    (1, 1025, 113, 8, 2, 64, True, torch.bfloat16),  # rows that see no key
    (2, 300, 257, 4, 2, 64, False, torch.float16),
    (2, 63, 63, 2, 2, 256, True, torch.bfloat16),  # the split build: each warpgroup's half tile draws
    (1, 300, 257, 4, 2, 256, False, torch.float16),
    (1, 1025, 113, 2, 1, 256, True, torch.bfloat16),
]


def _dropout_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k, device="cuda"):
    """The keep mask the kernels must draw, from its definition (``dropout_ref``: not tileattn.rng's offsets)."""
    return dropout_ref.keep_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k).to(device)


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=str)
def test_dropout_matches_the_oracle(case):
    """Dropout: each warpgroup evaluates its share of the tile's Philox counters and reads the draws of its
    own elements back from shared memory; the gradients against the oracle given the mask the forward
    kernels draw, for the settings' build and the others."""
    from tileattn.kernels.gluon import backward as hopper

    batch, seqlen_q, seqlen_k, nheads, _, headdim, causal, dtype = case
    q, k, v, dout = gluon_case_inputs(case, 4)
    dropout_p, seed = 0.17, 0x2545F4914F6CDD1D + seqlen_q
    keep = _dropout_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k)
    assert keep.numel() < 1000 or 0.75 < keep.float().mean() < 0.9  # (keeps 212 bytes of 256)
    ref, grads_ref, grads_low = _references(q, k, v, dout, causal, dropout_p=dropout_p, dropout_mask=keep)
    lse, delta = _lse_delta(ref, dout)
    p = AttnParams(
        batch, seqlen_q, seqlen_k, headdim, headdim**-0.5, window_right=0 if causal else -1, dropout_p=dropout_p,
        philox_seed=seed,
    )  # fmt: skip
    assert hopper.eligible(q, k, v, dout, p)
    scale = torch.stack([r.abs().max() for r in grads_ref])
    if headdim == 256:
        builds = SPLIT_BUILDS
    else:
        config = hopper.config_options(configs.HOPPER.bwd_gluon_dropout[headdim])
        builds = [config, dict(stages=2, dq_tma=False), dict(stages=2, lse_load="load")]
        builds += [dict(config, dq_first=True)] if DQ_FIRST else []
        builds += WIDE_BUILDS.get(headdim, [])
    for build in builds:
        grads = hopper.attn_bwd(dout, q, k, v, lse, delta, p, **build)
        for name, t, r, lo in zip(("dq", "dk", "dv"), grads, grads_ref, grads_low):
            check_close(f"{name} {build}", t, r, lo, floor_scale=scale)


@pytest.mark.parametrize("case", GLUON_WINDOW_CASES[:2], ids=str)
def test_dropout_with_windows(case):
    """Dropout with a sliding window: the query tiles a key block sees start and end inside the
    sequence, so their counters' rows are not the tiles of a dense call."""
    from tileattn.kernels.gluon import backward as hopper

    batch, seqlen_q, seqlen_k, nheads, _, headdim, window, dtype = case
    q, k, v, dout = gluon_case_inputs(case, 4)
    dropout_p, seed = 0.25, 1234 + seqlen_k
    keep = _dropout_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k)
    ref, grads_ref, grads_low = _references(q, k, v, dout, False, window, dropout_p=dropout_p, dropout_mask=keep)
    lse, delta = _lse_delta(ref, dout)
    p = AttnParams(
        batch, seqlen_q, seqlen_k, headdim, headdim**-0.5, window_left=window[0], window_right=window[1],
        dropout_p=dropout_p, philox_seed=seed,
    )  # fmt: skip
    assert hopper.eligible(q, k, v, dout, p)
    scale = torch.stack([r.abs().max() for r in grads_ref])
    grads = hopper.attn_bwd(
        dout, q, k, v, lse, delta, p, **hopper.config_options(configs.HOPPER.bwd_gluon_dropout[headdim])
    )
    for name, t, r, lo in zip(("dq", "dk", "dv"), grads, grads_ref, grads_low):
        check_close(name, t, r, lo, floor_scale=scale)


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_dropout_through_the_public_call(headdim, monkeypatch):
    """flash_attn_func with dropout: the portable forward draws the mask, the Gluon backward the same one
    (the gradients against the oracle given the mask S_dmask returns); a packed batch as well. (Head dim
    256: the split build.)"""
    with configs.override(configs.HOPPER):
        _dropout_through_the_public_call(headdim, monkeypatch)


def _dropout_through_the_public_call(headdim, monkeypatch):
    from tileattn.kernels.gluon import backward as hopper

    calls = record_calls(monkeypatch, hopper.Plan, "run")  # (the public calls run its plans)
    case = (2, 300, 300, 4, 2, headdim, True, torch.bfloat16)
    q, k, v, dout = gluon_case_inputs(case, 4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=0.1, causal=True, return_attn_probs=True)
    out.backward(dout)
    assert len(calls) == 1
    keep = s_dmask >= 0
    dropout_p = 0.1
    ref, grads_ref, grads_low = _references(q, k, v, dout, True, dropout_p=dropout_p, dropout_mask=keep)
    check_close("out", out, ref.out, oracle.attention(q, k, v, causal=True, precision=None, dropout_p=dropout_p,
                                                      dropout_mask=keep).out)  # fmt: skip
    scale = torch.stack([r.abs().max() for r in grads_ref])
    for name, t, r, lo in zip("qkv", (q, k, v), grads_ref, grads_low):
        check_close(f"d{name}", t.grad, r, lo, floor_scale=scale)
    # a packed batch: each sequence's counters from its own (b, h) and local rows
    lens = [37, 300, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(headdim)
    qp, kp, vp, dp = (
        torch.randn(sum(lens), h, headdim, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2, 4)
    )
    qp, kp, vp = (t.requires_grad_() for t in (qp, kp, vp))
    outp, _, s_p = tileattn.flash_attn_varlen_func(
        qp, kp, vp, cu, cu, max(lens), max(lens), dropout_p=0.1, causal=True, return_attn_probs=True
    )
    outp.backward(dp)
    assert len(calls) == 2
    cu_list = cu.tolist()
    refs = [t.detach().double().requires_grad_() for t in (qp, kp, vp)]
    ref = oracle.attention_varlen(*refs, cu_list, cu_list, causal=True, dropout_p=dropout_p, dropout_mask=s_p >= 0)
    ref.out.backward(dp.double())
    lows = [t.detach().clone().requires_grad_() for t in (qp, kp, vp)]
    low = oracle.attention_varlen(
        *lows, cu_list, cu_list, causal=True, precision=None, dropout_p=dropout_p, dropout_mask=s_p >= 0
    )
    low.out.backward(dp)
    scale = torch.stack([r.grad.abs().max() for r in refs])
    for name, t, r, lo in zip("qkv", (qp, kp, vp), refs, lows):
        check_close(f"d{name} (packed)", t.grad, r.grad, lo.grad, floor_scale=scale)


def test_calls_it_cannot_compute_are_not_eligible():
    """Softcap, deterministic, a softmax scale of 0 or below, fp32, heads that are not one TMA row: not
    eligible (the portable backward runs); windows and dropout are, and head dim 256 (the split build)."""
    from tileattn.kernels.gluon import backward as hopper

    q, k, v, dout = gluon_case_inputs((1, 128, 128, 2, 2, 128, False, torch.bfloat16), 4)
    p = AttnParams(1, 128, 128, 128, 128**-0.5)
    assert hopper.eligible(q, k, v, dout, p)
    assert hopper.eligible(q, k, v, dout, AttnParams(1, 128, 128, 128, 128**-0.5, dropout_p=0.1, philox_seed=3))
    for change in (
        dict(softcap=5.0),
        dict(deterministic=True),
    ):
        assert not hopper.eligible(q, k, v, dout, AttnParams(1, 128, 128, 128, 128**-0.5, **change))
    for scale in (0.0, -0.1):  # (masked -inf times the scale)
        assert not hopper.eligible(q, k, v, dout, AttnParams(1, 128, 128, 128, scale))
    assert hopper.eligible(q, k, v, dout, AttnParams(1, 128, 128, 128, 128**-0.5, window_left=16, window_right=0))
    assert not hopper.eligible(q.float(), k.float(), v.float(), dout.float(), p)
    wide = torch.randn(1, 128, 2, 256, device="cuda", dtype=torch.bfloat16)
    assert hopper.eligible(wide, wide, wide, wide, AttnParams(1, 128, 128, 256, 256**-0.5))
    assert hopper.eligible(
        wide, wide, wide, wide, AttnParams(1, 128, 128, 256, 256**-0.5, dropout_p=0.1, philox_seed=3)
    )
    narrow = AttnParams(1, 128, 128, 256, 256**-0.5)
    with pytest.raises(ValueError, match="block_n"):
        hopper.attn_bwd(wide, wide, wide, wide, *(torch.zeros(1, 2, 128, device="cuda"),) * 2, narrow, block_n=128)
    with pytest.raises(ValueError, match="block_m"):
        hopper.attn_bwd(wide, wide, wide, wide, *(torch.zeros(1, 2, 128, device="cuda"),) * 2, narrow, block_m=128)
    padded = torch.randn(1, 128, 2, 136, device="cuda", dtype=torch.bfloat16)[..., :128]  # heads apart
    assert not hopper.eligible(q, k, v, padded, p)


@pytest.mark.parametrize(
    "case", GLUON_VARLEN_CASES + [([37, 0, 300], [130, 9, 200], 2, 1, 256, True, torch.bfloat16)], ids=str
)
def test_packed_batches_match_the_oracle(case, monkeypatch):
    """Packed (varlen) batches: each sequence's rows start anywhere in the packed tensor, tiles cross into
    the next sequence (whose rows they must not change), sequences with no rows or no keys, and key
    blocks past a short sequence's end (the grid covers the longest); through the public call as well."""
    from tileattn.kernels.gluon import backward as hopper

    lens_q, lens_k, nheads, nheads_k, headdim, causal, dtype = case
    g = torch.Generator(device="cuda").manual_seed(len(lens_q) * 1000 + headdim)
    cu_q, cu_k = ([0, *torch.tensor(lens).cumsum(0).tolist()] for lens in (lens_q, lens_k))
    q, dout = (torch.randn(cu_q[-1], nheads, headdim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(cu_k[-1], nheads_k, headdim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = oracle.attention_varlen(qr, kr, vr, cu_q, cu_k, causal=causal)
    ref.out.backward(dout.double())
    grads_ref = (qr.grad, kr.grad, vr.grad)
    lows = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    oracle.attention_varlen(*lows, cu_q, cu_k, causal=causal, precision=None).out.backward(dout)
    grads_low = tuple(t.grad for t in lows)
    scale = torch.stack([r.abs().max() for r in grads_ref])
    cu_q_t, cu_k_t = (torch.tensor(cu, dtype=torch.int32, device="cuda") for cu in (cu_q, cu_k))
    p = AttnParams(
        len(lens_q), max(lens_q), max(lens_k), headdim, headdim**-0.5, window_right=0 if causal else -1,
        cu_seqlens_q=cu_q_t, cu_seqlens_k=cu_k_t,
    )  # fmt: skip
    q4, k4, v4, do4 = (t.unsqueeze(0) for t in (q, k, v, dout))
    assert hopper.eligible(q4, k4, v4, do4, p)
    lse = ref.lse.float().contiguous()  # (nheads, total_q), +inf for rows that see no key
    delta = (dout.float() * ref.out.to(dtype).float()).sum(-1).transpose(0, 1).contiguous()
    for build in _builds(headdim):
        grads = hopper.attn_bwd(do4, q4, k4, v4, lse, delta, p, **build)
        for name, t, r, lo in zip(("dq", "dk", "dv"), grads, grads_ref, grads_low):
            assert t.shape == (1, *r.shape)
            check_close(f"{name} {build}", t[0], r, lo, floor_scale=scale)
    calls = record_calls(monkeypatch, hopper.Plan, "run")  # (the public calls run its plans)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with configs.override(configs.HOPPER):
        out = tileattn.flash_attn_varlen_func(q, k, v, cu_q_t, cu_k_t, max(lens_q), max(lens_k), causal=causal)
        out.backward(dout)
    assert len(calls) == 1
    for name, t, r, lo in zip("qkv", (q, k, v), grads_ref, grads_low):
        check_close(f"d{name} (public call)", t.grad, r, lo, floor_scale=scale)


@pytest.mark.parametrize("case", GLUON_WINDOW_CASES + [(1, 700, 1000, 2, 2, 256, (100, 50), torch.bfloat16)], ids=str)
def test_windows_match_the_oracle(case, monkeypatch):
    """Sliding windows (bottom-right aligned as flash_attn's): each side alone and both, rows whose window
    holds no key, key blocks no row sees (the diagonal alone), query tiles from the first whose last row
    reaches a block to the last whose first row does; each build, and through the public call."""
    from tileattn.kernels.gluon import backward as hopper

    batch, seqlen_q, seqlen_k, _, _, headdim, window, dtype = case
    q, k, v, dout = gluon_case_inputs(case, 4)
    ref, grads_ref, grads_low = _references(q, k, v, dout, False, window)
    lse, delta = _lse_delta(ref, dout)
    p = AttnParams(batch, seqlen_q, seqlen_k, headdim, headdim**-0.5, window_left=window[0], window_right=window[1])
    assert hopper.eligible(q, k, v, dout, p)
    scale = torch.stack([r.abs().max() for r in grads_ref])
    for build in _builds(headdim):
        grads = hopper.attn_bwd(dout, q, k, v, lse, delta, p, **build)
        for name, t, r, lo in zip(("dq", "dk", "dv"), grads, grads_ref, grads_low):
            check_close(f"{name} {build}", t, r, lo, floor_scale=scale)
    calls = record_calls(monkeypatch, hopper.Plan, "run")  # (the public calls run its plans)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with configs.override(configs.HOPPER):  # (the table's build)
        tileattn.flash_attn_func(q, k, v, window_size=window).backward(dout)
    assert len(calls) == 1
    for name, t, r, lo in zip("qkv", (q, k, v), grads_ref, grads_low):
        check_close(f"d{name} (public call)", t.grad, r, lo, floor_scale=scale)


@pytest.mark.parametrize("headdim", [64, 128])
def test_head_major_layouts(headdim, monkeypatch):
    """q, k and dO laid out head by head (``(batch, nheads, seqlen, headdim)`` transposed, as Hugging Face
    models hand queries and keys after their rotary embedding) beside v in flash_attn's layout: TMA reads
    each as rows of one head's positions, no copy; the kernels alone and the public call, forward and
    backward, against the oracle."""
    from tileattn.kernels.gluon import backward as hopper
    from tileattn.kernels.gluon import forward as hopper_fwd
    from tileattn.kernels.gluon.common import tma_rows

    batch, seqlen, nheads, nheads_k, dtype = 2, 300, 8, 2, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(headdim)

    def heads_major(h):
        return torch.randn(batch, h, seqlen, headdim, device="cuda", dtype=dtype, generator=g).transpose(1, 2)

    q, k, dout = heads_major(nheads), heads_major(nheads_k), heads_major(nheads)
    v = torch.randn(batch, seqlen, nheads_k, headdim, device="cuda", dtype=dtype, generator=g)
    assert not q.is_contiguous() and tma_rows(q).head_rows == seqlen and tma_rows(v).head_rows == 0
    ref, grads_ref, grads_low = _references(q, k, v, dout, True)
    p = AttnParams(batch, seqlen, seqlen, headdim, headdim**-0.5, window_right=0)
    assert hopper.eligible(q, k, v, dout, p) and hopper_fwd.eligible(q, k, v, p)
    low = oracle.attention(q, k, v, causal=True, precision=None)
    out, lse = hopper_fwd.attn_fwd(q, k, v, p)
    check_close("out", out, ref.out, low.out)
    lse_ref, delta = _lse_delta(ref, dout)
    scale = torch.stack([r.abs().max() for r in grads_ref])
    for name, t, r, lo in zip(
        ("dq", "dk", "dv"), hopper.attn_bwd(dout, q, k, v, lse_ref, delta, p), grads_ref, grads_low
    ):
        check_close(name, t, r, lo, floor_scale=scale)
    calls = []
    for cls, name in ((hopper.Plan, "attn_bwd"), (hopper_fwd.Plan, "attn_fwd")):  # (the public calls run plans)
        run = cls.run
        monkeypatch.setattr(cls, "run", lambda *a, run=run, name=name, **kw: calls.append(name) or run(*a, **kw))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    tileattn.flash_attn_func(q, k, v, causal=True).backward(dout)
    assert calls == ["attn_fwd"] * (configs.gluon_fwd_config(p, configs.for_device(q.device), headdim) is not None) + [
        "attn_bwd"
    ]
    for name, t, r, lo in zip("qkv", (q, k, v), grads_ref, grads_low):
        check_close(f"d{name} (public call)", t.grad, r, lo, floor_scale=scale)
