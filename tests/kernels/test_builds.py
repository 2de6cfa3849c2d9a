"""Build variants the tile tables do not pick (KernelConfig.tma, warp_spec, dq_atomic, q_major, through
helpers.builds), dense and varlen, with and without dropout, against the reference on the kernels (the
GPU or the interpreter); and on the GPU the tables' own builds at the size where one was miscompiled."""

import contextlib

import pytest
import torch

import tileattn
from attention_cases import CASES, LENGTHS, _case_id, _check_varlen, _run_case, _unaligned
from helpers import SLOW, builds, check_attention, interpreter_skips, on, randn

# The kernels' TMA variant (row tiles through tensor descriptors; a head dim of 59 is not 16-byte
# aligned and falls back to pointer loads) and, on the GPU, the forward's warp-specialised key loop.
TMA_CASES = [CASES[i] for i in (1, 3, 4, 5, 9, 10, 16, 18)]


@pytest.mark.gpu_cover(strength=1)  # (each case once on the GPU, tma and tma-ws in turn: tests/cover.py)
@pytest.mark.parametrize("warp_spec", [False, True], ids=["tma", "tma-ws"])
@pytest.mark.parametrize("case", TMA_CASES, ids=_case_id)
def test_tma_variants(backend, case, warp_spec):
    if backend == "torch":
        pytest.skip("a kernel variant")
    if warp_spec and backend != "cuda":
        pytest.skip("warp specialisation is a compiler schedule; the interpreter runs the tma case")
    fwd = dict(tma=True, warp_spec=warp_spec)
    if warp_spec:  # the dense tiles: Triton 3.6 fails to compile causal 64 x 64, 4-warp tiles warp-specialised
        fwd.update(block_m=128, block_n=64, num_warps=8, num_stages=2)
    with builds(backend, fwd=fwd, dkdv=dict(tma=True), dq=dict(tma=True)):
        _run_case(backend, case, torch.float16)


# dQ accumulated by the dK/dV pass (KernelConfig.dq_atomic: 1 fp32 atomic adds, 2 TMA reduce-adds, which
# the interpreter does not emulate: it runs mode 2 as atomic adds), in both score orientations (q_major).
DQ_ATOMIC_CASES = [CASES[i] for i in (1, 4, 5, 7, 10, 12, 15, 18)]


@pytest.mark.gpu_cover(strength=2)  # (every pair of values on the GPU: tests/cover.py)
@pytest.mark.parametrize("q_major", [False, True], ids=["k-major", "q-major"])
@pytest.mark.parametrize("mode", [1, 2], ids=["atomic", "tma-reduce"])
@pytest.mark.parametrize("case", DQ_ATOMIC_CASES, ids=_case_id)
def test_dq_atomic_variants(backend, case, mode, q_major):
    if backend == "torch":
        pytest.skip("a kernel variant")
    with builds(backend, dkdv=dict(dq_atomic=mode, q_major=q_major)):
        _run_case(backend, case, torch.float16)


@pytest.mark.gpu_cover(strength=2)  # (every pair of values on the GPU: tests/cover.py)
@pytest.mark.parametrize("variant", ["tma", "dq-atomic"])
@pytest.mark.parametrize("feats", [{"causal": True}, {"window_size": (6, 2)}], ids=str)
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=str)
def test_varlen_tma_variant(backend, lengths, feats, variant):
    """The kernels' TMA reads (KernelConfig.tma) on packed batches: descriptors per sequence, empty ones
    included, rows past a sequence read as zeros; and dQ added from the dK/dV pass (KernelConfig.dq_atomic:
    TMA reduce-adds on the GPU, atomic adds under the interpreter) at each sequence's rows."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    if variant == "tma":
        variant_builds = builds(backend, fwd=dict(tma=True), dkdv=dict(tma=True), dq=dict(tma=True))
    else:
        variant_builds = builds(backend, dkdv=dict(dq_atomic=2))
    with variant_builds:
        _check_varlen(backend, lengths, feats, torch.float16)


@pytest.mark.parametrize(
    "feats",
    [
        {"dropout_p": 0.17, "causal": True},
        {"dropout_p": 0.17, "softcap": 3.0, "window_size": (20, 5)},
        {"causal": True},
    ],
    ids=str,
)
@pytest.mark.parametrize("dq_atomic", [0, 1], ids=["dq-pass", "dq-atomic"])
def test_dkdv_query_major_tiles(backend, feats, dq_atomic):
    """The dK/dV kernel's query x key orientation (KernelConfig.q_major) gives the same gradients as
    the reference, with and without dropout (GQA, odd lengths and head dim); also with dQ added from the
    dK/dV pass (KernelConfig.dq_atomic), where dropout's mask must match the dQ pass's."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    ctx, device = on(backend)
    b, sq, sk, h, hk, d = 2, 47, 71, 4, 2, 40
    q = randn(b, sq, h, d, dtype=torch.float16, device=device)
    k = randn(b, sk, hk, d, dtype=torch.float16, device=device)
    v = randn(b, sk, hk, d, dtype=torch.float16, device=device)
    dout = torch.randn_like(q)
    with ctx, builds(backend, dkdv=dict(q_major=True, dq_atomic=dq_atomic)):
        out, _, s_dmask = tileattn.flash_attn_func(q, k, v, return_attn_probs=True, **feats)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_kwargs = dict(feats)
    if "dropout_p" in feats:
        ref_kwargs["dropout_mask"] = s_dmask >= 0
    check_attention("q-major dkdv", out, grads, q, k, v, dout, ref_kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dq_from_the_dkdv_pass_with_dropout(backend, dtype, monkeypatch):
    """The H100/H200 tables' own causal backward at head dims 65-128 where the Gluon backward does not run
    (softcap, ALiBi): dQ added from the dK/dV pass (``bwd_dkdv_causal``; TMA reduce-adds on the GPU, atomic
    adds under the interpreter), here with dropout, per-batch ALiBi, GQA, the tail tiles of both lengths and
    the rows that see no key (seqlen_q > seqlen_k), against the oracle given the call's mask. No other test
    puts dropout through the reduce-adds. (The interpreter's tables have no such entry: there every dK/dV
    build is asked for the reduce-adds, which it runs as atomic adds.)"""
    if backend == "torch":
        pytest.skip("a kernel variant")
    interpreter_skips(backend, dtype)
    from tileattn.kernels import backward

    plans = []
    plan_bwd = backward.plan_bwd
    monkeypatch.setattr(backward, "plan_bwd", lambda *a: plans.append(plan_bwd(*a)) or plans[-1])
    ctx, device = on(backend)
    tables = contextlib.nullcontext() if backend == "cuda" else builds(backend, dkdv=dict(dq_atomic=2))
    b, sq, sk, h, hk, d = 2, 83, 61, 4, 2, 80
    q = randn(b, sq, h, d, dtype=dtype, device=device)
    k = randn(b, sk, hk, d, dtype=dtype, device=device)
    v = randn(b, sk, hk, d, dtype=dtype, device=device)
    dout = torch.randn_like(q)
    feats = dict(causal=True, softcap=1.5, alibi_slopes=torch.rand(b, h, device=device), dropout_p=0.17)
    with ctx, tables:
        out, _, s_dmask = tileattn.flash_attn_func(q, k, v, return_attn_probs=True, **feats)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention("dQ from the dK/dV pass", out, grads, q, k, v, dout, dict(feats, dropout_mask=s_dmask >= 0))
    before_sm90 = backend == "cuda" and torch.cuda.get_device_capability()[0] < 9
    expected = 0 if before_sm90 else 2 if backend == "cuda" else 1  # (TMA reduce-adds need sm90)
    assert [plan.dq_atomic for plan in plans] == [expected], plans


# The H200's tile tables at the size where one of their builds was miscompiled (head dim 256's 128 x 64
# pointer-load forward, wrong for GQA at 4 x 4096 tokens only; docs/perf.md): every forward table entry
# (with the backward tables of its head dim), the pointer-load fallbacks of the TMA entries (inputs TMA
# cannot read: Settings.fwd_pointer) and the long-key entries (Settings.fwd_long), GQA 4:1, forward and
# backward, for the feature flags that compile separate builds (causal, window, softcap + ALiBi, varlen).
AT_SCALE_FEATURES = [
    {},
    {"causal": True},
    {"window_size": (512, 0)},
    {"softcap": 30.0, "alibi": "head"},
    {"varlen": True},
    {"varlen": True, "causal": True},
]


AT_SCALE_BUILDS = [(16, "table"), (32, "table"), (64, "table"), (128, "table"), (128, "fallback"), (128, "long")]
AT_SCALE_BUILDS += [(256, "table"), (256, "fallback")]
# By default one case per build and per feature flag (the miscompiled one first); the rest of the grid
# (48 cases, which take the GPU one at a time) is marked slow.
AT_SCALE_DEFAULT = {
    (256, "table", "plain"),
    (128, "long", "causal"),
    (128, "fallback", "window_size"),
    (16, "table", "softcap-alibi"),
    (64, "table", "varlen-causal"),
    (32, "table", "varlen"),
    (256, "fallback", "varlen"),
    (128, "table", "causal"),
}


def _at_scale_cases():
    cases = {
        (headdim, variant, "-".join(feats) or "plain"): feats
        for headdim, variant in AT_SCALE_BUILDS
        for feats in AT_SCALE_FEATURES
    }
    assert AT_SCALE_DEFAULT <= cases.keys(), AT_SCALE_DEFAULT - cases.keys()
    return [
        pytest.param(
            h, v, feats, id=f"{h}-{v}-{name}", marks=() if (h, v, name) in AT_SCALE_DEFAULT else pytest.mark.slow
        )
        for (h, v, name), feats in cases.items()
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes run on the GPU")
@pytest.mark.parametrize("headdim,variant,feats", _at_scale_cases())
def test_tables_gqa_at_scale(headdim, variant, feats, big_gpu_memory):
    # up to ~30 GiB each (the fp64 reference's scores): several at once ran the H200 out of memory
    from tileattn.kernels import configs

    unaligned = variant == "fallback"  # inputs TMA cannot read: the pointer-load fallback tiles
    # the failing size; 2 keeps the fp64 reference small; Settings.fwd_long from long_seqlen_k keys on
    batch = 4 if headdim == 256 and not feats else 2
    seqlen = 4096
    if variant == "long":
        batch, seqlen = 1, configs.current(torch.device("cuda")).long_seqlen_k
    if "varlen" not in feats:
        _run_case("cuda", (batch, seqlen, seqlen, 8, 2, headdim, feats), torch.bfloat16, unaligned)
        return
    q = randn(batch, seqlen, 8, headdim, dtype=torch.bfloat16, device="cuda")
    k, v = (randn(batch, seqlen, 2, headdim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    if unaligned:
        q, k, v = (_unaligned(t.detach()).requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="cuda")
    causal = feats.get("causal", False)
    out = tileattn.flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, seqlen, seqlen, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout.flatten(0, 1))
    check_attention("varlen at scale", out.view_as(q), grads, q, k, v, dout, {"causal": causal})


# The forward's exponentials split between MUFU and a polynomial on the FMA units (KernelConfig.exp2_poly,
# kernels/exp2.py), in the portable forward and on sm90 the Gluon one: 3 of every 8 scores, and all of them
# (under the interpreter every score takes the polynomial): rows that see no key, windows, softcap and ALiBi,
# GQA, odd head dims and lengths. On the GPU with TILEATTN_SLOW=1 only: the tables do not take it.
EXP2_CASES = [CASES[i] for i in (1, 3, 5, 6, 8, 9, 11, 15, 17)]


@pytest.mark.parametrize("poly", [3, 8])
@pytest.mark.parametrize("case", EXP2_CASES, ids=_case_id)
def test_exp2_poly_variant(backend, case, poly):
    if backend == "torch":
        pytest.skip("a kernel variant")
    if backend == "cuda" and not SLOW:  # (the suite's default GPU run stays within one device call)
        pytest.skip("a build the settings do not pick (exp2_poly: docs/perf.md): TILEATTN_SLOW=1 runs it")
    with builds(backend, fwd=dict(exp2_poly=poly), gluon=dict(exp2_poly=poly)):
        _run_case(backend, case, torch.float16)
        if backend == "cuda":
            _run_case(backend, case, torch.bfloat16)


def test_exp2_poly_keeps_nan():
    """A NaN among the keys makes the rows that see it NaN through the polynomial too (its clamp propagates
    NaN), as through exp2; the rows that do not see it (causal) stay finite."""
    backend = "cuda" if torch.cuda.is_available() else "interpret"
    ctx, device = on(backend)
    q, k, v = (randn(1, 40, 2, 64, dtype=torch.float16, device=device, requires_grad=False) for _ in range(3))
    k[0, 20, 1, 5] = float("nan")
    with builds(backend, fwd=dict(exp2_poly=8), gluon=dict(exp2_poly=8)), ctx:
        out = tileattn.flash_attn_func(q, k, v, causal=True)
    assert out[0, 20:, 1].isnan().all() and out[0, :20].isfinite().all() and out[0, :, 0].isfinite().all()
