"""flash_attn_func and its packed variants against the reference, forward and backward, on every
backend: the Triton kernels (on the GPU, or under the interpreter on CPU) and the CPU path."""

import pytest
import torch

import tileattn
from helpers import builds, check_attention, interpreter_skips, on, randn, record_launches
from tileattn.params import AttnParams, KernelConfig
from tileattn.reference import attention_ref

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, features). Small enough for the interpreter;
# odd lengths and head dims, GQA/MQA, and both seqlen_q < seqlen_k and seqlen_q > seqlen_k.
CASES = [
    (1, 1, 1, 1, 1, 64, {}),
    (2, 33, 47, 2, 1, 1, {"causal": True}),
    (1, 47, 33, 3, 3, 3, {"window_size": (4, 4)}),
    (2, 63, 63, 4, 4, 40, {}),
    (1, 113, 203, 2, 1, 59, {}),
    (1, 203, 113, 4, 2, 96, {"causal": True}),
    (2, 63, 113, 4, 2, 111, {"causal": True}),
    (1, 1, 203, 4, 1, 128, {"causal": True}),
    (1, 113, 63, 2, 2, 64, {"causal": True}),
    (1, 63, 63, 2, 2, 256, {"causal": True}),
    (1, 113, 203, 6, 2, 64, {"window_size": (17, 5)}),
    (1, 203, 113, 2, 2, 40, {"window_size": (9, -1)}),
    (1, 113, 113, 2, 1, 64, {"window_size": (-1, 7)}),
    (1, 113, 203, 2, 2, 64, {"causal": True, "window_size": (31, 31)}),
    (2, 63, 113, 4, 2, 64, {"softcap": 2.5}),
    (1, 113, 113, 2, 2, 96, {"softcap": 10.0, "causal": True}),
    (2, 63, 113, 4, 2, 64, {"alibi": "head"}),
    (2, 113, 63, 4, 4, 59, {"alibi": "batch", "causal": True}),
    (1, 63, 113, 3, 1, 40, {"softmax_scale": 0.3, "softcap": 4.0, "alibi": "head", "window_size": (20, 3)}),
]
GPU_ONLY_CASES = [
    (2, 1025, 1025, 8, 2, 128, {}),
    (2, 1025, 1025, 8, 8, 128, {"causal": True}),
    (1, 1025, 2047, 4, 1, 64, {"causal": True, "window_size": (256, 0)}),
    (1, 2047, 1025, 8, 2, 256, {"causal": True}),
    (2, 1025, 1025, 4, 4, 96, {"softcap": 30.0, "alibi": "batch"}),
]
DTYPES = [torch.float16, torch.bfloat16]


def _case_id(case):
    b, sq, sk, h, hk, d, feats = case
    return f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}" + "".join(f"-{k}" for k in feats)


def _call_kwargs(feats, batch, nheads, device):
    kwargs = {k: v for k, v in feats.items() if k != "alibi"}
    if "alibi" in feats:
        shape = (nheads,) if feats["alibi"] == "head" else (batch, nheads)
        kwargs["alibi_slopes"] = torch.rand(shape, device=device) * 0.5
    return kwargs


def _unaligned(t):
    """A leaf copy of ``t`` whose data starts one element past a 16-byte boundary (TMA cannot read it)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return buf[1:].view_as(t).copy_(t).requires_grad_(t.requires_grad)


def _run_case(backend, case, dtype, unaligned=False):
    b, sq, sk, h, hk, d, feats = case
    interpreter_skips(backend, dtype)
    ctx, device = on(backend)
    q = randn(b, sq, h, d, dtype=dtype, device=device)
    k = randn(b, sk, hk, d, dtype=dtype, device=device)
    v = randn(b, sk, hk, d, dtype=dtype, device=device)
    if unaligned:
        q, k, v = (_unaligned(t.detach()).requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    kwargs = _call_kwargs(feats, b, h, device)
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention(_case_id(case), out, grads, q, k, v, dout, kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward(backend, case, dtype):
    _run_case(backend, case, dtype)


# The kernels' TMA variant (row tiles through tensor descriptors; a head dim of 59 is not 16-byte
# aligned and falls back to pointer loads) and, on the GPU, the forward's warp-specialised key loop.
TMA_CASES = [CASES[i] for i in (1, 3, 4, 5, 9, 10, 16, 18)]


# A softmax scale of 0 or below: the kernels then scale inside the scores (AttnParams.defer_scale), since
# the row max of the raw products is no longer that of the scaled scores and masked -inf would turn into
# NaN or +inf; with masked tails, causal and a window.
SCALE_CASES = [
    (2, 63, 113, 2, 1, 40, {"softmax_scale": -0.3, "causal": True}),
    (1, 47, 33, 2, 2, 64, {"softmax_scale": 0.0}),
    (1, 33, 47, 2, 1, 32, {"softmax_scale": -0.2, "window_size": (8, 3)}),
]


@pytest.mark.parametrize("case", SCALE_CASES, ids=_case_id)
def test_zero_and_negative_softmax_scale(backend, case):
    _run_case(backend, case, torch.float16)


def test_zero_and_negative_softmax_scale_decode(backend):
    """The decode kernel with a negative and a zero softmax scale (one query token, a full cache)."""
    ctx, device = on(backend)
    q = randn(2, 1, 4, 64, dtype=torch.float16, device=device, requires_grad=False)
    k, v = (randn(2, 77, 2, 64, dtype=torch.float16, device=device, requires_grad=False) for _ in range(2))
    with ctx:
        outs = {
            scale: tileattn.flash_attn_with_kvcache(q, k, v, softmax_scale=scale, causal=True) for scale in (-0.3, 0.0)
        }
    for scale, out in outs.items():
        check_attention(f"decode scale {scale}", out, None, q, k, v, None, {"softmax_scale": scale}, False)


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


@pytest.mark.parametrize("q_major", [False, True], ids=["k-major", "q-major"])
@pytest.mark.parametrize("mode", [1, 2], ids=["atomic", "tma-reduce"])
@pytest.mark.parametrize("case", DQ_ATOMIC_CASES, ids=_case_id)
def test_dq_atomic_variants(backend, case, mode, q_major):
    if backend == "torch":
        pytest.skip("a kernel variant")
    with builds(backend, dkdv=dict(dq_atomic=mode, q_major=q_major)):
        _run_case(backend, case, torch.float16)


def _bwd_launches(monkeypatch, dq_atomic: int, deterministic: bool = False, headdim: int = 64):
    """The backward's launches, (kernel, DQ_ATOMIC), with the H200's settings and the dK/dV config asking
    for ``dq_atomic`` (recorded, nothing compiled)."""
    from tileattn.kernels import backward, configs

    launches = record_launches(monkeypatch, "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")
    s = configs.with_builds(configs.HOPPER, dkdv=dict(dq_atomic=dq_atomic))
    q = torch.zeros(1, 128, 2, headdim, dtype=torch.float16)
    p = AttnParams(batch=1, seqlen_q=128, seqlen_k=128, headdim=headdim, softmax_scale=1.0, deterministic=deterministic)
    backward.attn_bwd(q, q, q, q, q, torch.zeros(1, 2, 128), p, s)
    return [(name, kw.get("DQ_ATOMIC")) for name, _, kw in launches]


def test_dq_atomic_not_deterministic(monkeypatch):
    """deterministic=True takes the dQ pass even where the config asks for atomic dQ (launches recorded)."""
    runs = {deterministic: _bwd_launches(monkeypatch, 1, deterministic) for deterministic in (False, True)}
    assert runs[False] == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", 1)]
    assert runs[True] == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", 0), ("_attn_bwd_dq", None)]


@pytest.mark.parametrize("tma_ok", [True, False], ids=["tma", "no-tma"])
def test_dq_reduce_add_falls_back_to_the_dq_pass(tma_ok, monkeypatch):
    """dq_atomic=2 (TMA reduce-adds) launches the dK/dV pass alone where TMA can write dQ's fp32 buffer,
    and the two passes where it cannot (head dim 62: rows of 248 bytes, not a multiple of 16): the atomic
    adds are slower than the dQ pass (launches recorded)."""
    runs = _bwd_launches(monkeypatch, 2, headdim=64 if tma_ok else 62)
    if tma_ok:
        assert runs == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", 2)]
    else:
        assert runs == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", 0), ("_attn_bwd_dq", None)]


def test_dq_reduce_add_runs_as_atomic_adds_under_the_interpreter(monkeypatch):
    """The interpreter does not emulate TMA reduce-adds: settings for it (Settings.interpret) launch
    dq_atomic=2 as fp32 atomic adds (launches recorded)."""
    import dataclasses

    from tileattn.kernels import backward, configs

    launches = record_launches(monkeypatch, "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")
    s = configs.with_builds(dataclasses.replace(configs.HOPPER, interpret=True), dkdv=dict(dq_atomic=2))
    q = torch.zeros(1, 128, 2, 64, dtype=torch.float16)
    p = AttnParams(batch=1, seqlen_q=128, seqlen_k=128, headdim=64, softmax_scale=1.0)
    backward.attn_bwd(q, q, q, q, q, torch.zeros(1, 2, 128), p, s)
    assert [(name, kw.get("DQ_ATOMIC")) for name, _, kw in launches] == [
        ("_bwd_preprocess", None),
        ("_attn_bwd_dkdv", 1),
    ]


def test_backward_runs_with_the_settings_of_its_call(backend, monkeypatch):
    """The backward launches the builds of the settings its call ran under (here dQ added by the dK/dV
    pass), also where autograd runs it on a worker thread (CUDA tensors), so that the tests of build
    variants test those variants (launches recorded, nothing computed)."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    launches = record_launches(monkeypatch, "_attn_fwd", "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")
    ctx, device = on(backend)
    q = randn(1, 64, 2, 32, dtype=torch.float16, device=device)
    with ctx, builds(backend, dkdv=dict(dq_atomic=1)):
        out = tileattn.flash_attn_func(q, q, q)
        torch.autograd.grad(out, q, torch.ones_like(out))
    assert [(name, kw.get("DQ_ATOMIC")) for name, _, kw in launches] == [
        ("_attn_fwd", None),
        ("_bwd_preprocess", None),
        ("_attn_bwd_dkdv", 1),
    ]


def test_bwd_dkdv_config_takes_the_causal_table():
    """Causal calls without a left window take Settings.bwd_dkdv_causal's entry where one is given; other
    masks, and head dims without an entry, the plain table."""
    import dataclasses

    from tileattn.kernels import configs

    causal_cfg = KernelConfig(32, 32, 2, 2, dq_atomic=2)
    s = dataclasses.replace(configs.HOPPER, bwd_dkdv_causal={64: causal_cfg})
    for headdim, cfg in s.bwd_dkdv.items():
        p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=headdim, softmax_scale=1.0)
        causal = dataclasses.replace(p, window_right=0)
        assert configs.bwd_dkdv_config(p, s) is cfg
        assert configs.bwd_dkdv_config(causal, s) is (causal_cfg if headdim == 64 else cfg)
        assert configs.bwd_dkdv_config(dataclasses.replace(causal, window_left=64), s) is cfg
        assert configs.bwd_dkdv_config(dataclasses.replace(p, window_right=4), s) is cfg
        assert configs.bwd_dkdv_config(dataclasses.replace(causal, deterministic=True), s) is cfg
    # the H200's tables: head dim 128's causal entry adds dQ by TMA reduce-adds
    p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=128, softmax_scale=1.0, window_right=0)
    assert configs.bwd_dkdv_config(p, configs.HOPPER).dq_atomic == 2
    assert configs.bwd_dkdv_config(dataclasses.replace(p, deterministic=True), configs.HOPPER).dq_atomic == 0


def test_bwd_dkdv_config_takes_the_varlen_table():
    """Varlen calls without dropout take Settings.bwd_dkdv_varlen's entry (head dim 256's 32-key tiles on
    the H200); dropout keeps 64-key tiles (its draws cover 64 key columns), and dense calls the plain
    table."""
    import dataclasses

    from tileattn.kernels import configs

    s = configs.HOPPER
    cu = torch.tensor([0, 8], dtype=torch.int32)
    for causal in (-1, 0):
        p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=256, softmax_scale=1.0, window_right=causal)
        varlen = dataclasses.replace(p, cu_seqlens_q=cu, cu_seqlens_k=cu)
        assert configs.bwd_dkdv_config(varlen, s) is s.bwd_dkdv_varlen[256]
        assert configs.bwd_dkdv_config(varlen, s).block_n == 32
        assert configs.bwd_dkdv_config(dataclasses.replace(varlen, dropout_p=0.1), s).block_n == 64
        assert configs.bwd_dkdv_config(p, s) is s.bwd_dkdv[256]
    p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=128, softmax_scale=1.0, window_right=0)
    varlen = dataclasses.replace(p, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert configs.bwd_dkdv_config(varlen, s) is s.bwd_dkdv_causal[128]  # no varlen entry at 128
    both = KernelConfig(32, 32, 2, 2)
    s = dataclasses.replace(s, bwd_dkdv_varlen={**s.bwd_dkdv_varlen, 128: both})
    assert configs.bwd_dkdv_config(varlen, s) is s.bwd_dkdv_causal[128]  # the causal entry comes first
    assert configs.bwd_dkdv_config(dataclasses.replace(varlen, window_right=-1), s) is both


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes run on the GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_ONLY_CASES, ids=_case_id)
def test_forward_backward_large(case, dtype):
    _run_case("cuda", case, dtype)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes run on the GPU")
@pytest.mark.parametrize("feats", AT_SCALE_FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize(
    "headdim,variant",
    [(16, "table"), (32, "table"), (64, "table"), (128, "table"), (128, "fallback"), (128, "long")]
    + [(256, "table"), (256, "fallback")],
    ids=str,
)
def test_tables_gqa_at_scale(headdim, variant, feats):
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


def test_forward_launch_takes_the_fallback_tiles_without_tma(monkeypatch):
    """attn_fwd launches head dim 256 with the H200's TMA tiles when TMA can read the inputs, and with
    Settings.fwd_pointer's tiles (USE_TMA off) when it cannot: keys and values one element past a
    16-byte boundary (launches recorded, nothing compiled)."""
    from tileattn.kernels import configs, forward

    s = configs.HOPPER
    launches = record_launches(monkeypatch, "_attn_fwd")
    q = torch.zeros(1, 300, 2, 256, dtype=torch.float16)
    p = AttnParams(batch=1, seqlen_q=300, seqlen_k=300, headdim=256, softmax_scale=1.0)
    forward.attn_fwd(q, q, q, p, s)
    kv = _unaligned(q)
    forward.attn_fwd(q, kv, kv, p, s)
    (_, grid_tma, with_tma), (_, grid_ptr, without) = launches
    tma_cfg, ptr_cfg = s.fwd[256], s.fwd_pointer[256]
    assert with_tma["USE_TMA"] and (with_tma["BLOCK_M"], with_tma["num_warps"]) == (tma_cfg.block_m, tma_cfg.num_warps)
    assert not without["USE_TMA"] and without["maxnreg"] == ptr_cfg.maxnreg and with_tma["maxnreg"] == tma_cfg.maxnreg
    assert (without["BLOCK_M"], without["BLOCK_N"], without["num_warps"], without["num_stages"]) == (
        ptr_cfg.block_m,
        ptr_cfg.block_n,
        ptr_cfg.num_warps,
        ptr_cfg.num_stages,
    )
    assert grid_ptr[0] == -(-300 // ptr_cfg.block_m) and grid_tma[0] == -(-300 // tma_cfg.block_m)


def test_launches_pass_the_register_cap(monkeypatch):
    """KernelConfig.maxnreg reaches the forward, dK/dV and dQ launches (launches recorded, nothing
    compiled)."""
    import dataclasses

    from tileattn.kernels import backward, configs, forward

    launches = record_launches(monkeypatch, "_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_bwd_preprocess")
    s = configs.HOPPER
    capped = {
        name: {**table, 64: dataclasses.replace(table[64], maxnreg=cap)}
        for name, table, cap in (("fwd", s.fwd, 120), ("bwd_dkdv", s.bwd_dkdv, 168), ("bwd_dq", s.bwd_dq, 128))
    }
    s = dataclasses.replace(s, **capped)
    q = torch.zeros(1, 128, 2, 64, dtype=torch.float16)
    p = AttnParams(batch=1, seqlen_q=128, seqlen_k=128, headdim=64, softmax_scale=1.0)
    forward.attn_fwd(q, q, q, p, s)
    backward.attn_bwd(q, q, q, q, q, torch.zeros(1, 2, 128), p, s)
    assert {name: kw["maxnreg"] for name, _, kw in launches if "maxnreg" in kw} == {
        "_attn_fwd": 120,
        "_attn_bwd_dkdv": 168,
        "_attn_bwd_dq": 128,
    }


def test_forward_config_falls_back_without_tma():
    """A forward table entry that reads through TMA has pointer-load tiles for inputs TMA cannot read
    (Settings.fwd_pointer, else the same tiles without TMA); long key loops take Settings.fwd_long's
    tiles, causal calls Settings.fwd_causal's and calls with a left window (without dropout)
    Settings.fwd_window's where they have them (sentinel entries here, over the H200's tables)."""
    import dataclasses

    from tileattn.kernels import configs

    long_cfg = KernelConfig(16, 16, 1, 1, tma=True)
    causal_cfg = KernelConfig(32, 32, 2, 2, tma=True)
    window_cfg = KernelConfig(32, 16, 2, 2)
    s = configs.HOPPER
    s = dataclasses.replace(
        s,
        fwd_long={d: long_cfg for d in s.fwd},
        fwd_window={d: window_cfg for d in s.fwd},
        fwd_causal={d: causal_cfg for d in s.fwd},
    )
    for headdim, cfg in s.fwd.items():
        p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=headdim, softmax_scale=1.0)
        assert configs.fwd_config(p, s) is cfg
        long = dataclasses.replace(p, seqlen_k=s.long_seqlen_k)
        assert configs.fwd_config(long, s) is long_cfg
        pointer = s.fwd_pointer.get(headdim, dataclasses.replace(long_cfg, tma=False))
        assert configs.fwd_config(long, s, tma_ok=False) == pointer
        assert configs.fwd_config(dataclasses.replace(long, window_right=0), s) is long_cfg  # long causal
        assert configs.fwd_config(dataclasses.replace(long, window_left=512, window_right=0), s) is window_cfg
        causal = dataclasses.replace(p, window_right=0)
        assert configs.fwd_config(causal, s) is causal_cfg
        assert not configs.fwd_config(causal, s, tma_ok=False).tma
        assert configs.fwd_config(dataclasses.replace(causal, window_left=64), s) is window_cfg  # not causal
        assert configs.fwd_config(dataclasses.replace(causal, window_left=64, dropout_p=0.1), s) is cfg
        assert configs.fwd_config(dataclasses.replace(p, window_right=64), s) is cfg  # right window only
        fallback = configs.fwd_config(p, s, tma_ok=False)
        assert not fallback.tma
        if cfg.tma:
            assert fallback == s.fwd_pointer.get(headdim, dataclasses.replace(cfg, tma=False))
        else:
            assert fallback is cfg
    assert configs.HOPPER.fwd[256].tma and not configs.HOPPER.fwd_pointer[256].tma


def test_cpu_path_float32():
    """The CPU path also takes float32 (compared against float64)."""
    ctx, device = on("torch")
    q, k, v = (randn(2, 77, 4, 48, dtype=torch.float32, device="cpu") for _ in range(3))
    dout = torch.randn_like(q)
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, causal=True, softcap=3.0)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention("fp32", out, grads, q, k, v, dout, {"causal": True, "softcap": 3.0})


def test_cpu_path_memory_is_linear():
    """The CPU path never allocates a seqlen x seqlen matrix: forward and backward over one
    16k-token sequence (whose fp32 score matrix alone is 1 GiB) raise the peak RSS by far less."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import resource, torch, tileattn
        from tileattn.api import cpu_backend
        q = torch.randn(1, 16384, 1, 16, requires_grad=True)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with cpu_backend("torch"):
            out = tileattn.flash_attn_func(q, q, q, causal=True)
            out.sum().backward()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    grown_mib = int(
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
        ).stdout.split()[-1]
    )
    assert grown_mib < 256, f"peak RSS grew by {grown_mib} MiB"


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_packed(backend, packing):
    ctx, device = on(backend)
    b, s, h, d = 2, 37, 4, 32
    dtype = torch.float16
    if packing == "qkv":
        qkv = randn(b, s, 3, h, d, dtype=dtype, device=device)
        with ctx:
            out = tileattn.flash_attn_qkvpacked_func(qkv, causal=True)
            (g,) = torch.autograd.grad(out.sum(), (qkv,))
        q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    else:
        q = randn(b, s, h, d, dtype=dtype, device=device)
        kv = randn(b, s + 5, 2, 2, d, dtype=dtype, device=device)
        with ctx:
            out = tileattn.flash_attn_kvpacked_func(q, kv, causal=True)
            (g,) = torch.autograd.grad(out.sum(), (kv,))
        k, v = (t.detach().requires_grad_() for t in kv.unbind(2))
    ref, _ = attention_ref(q, k, v, causal=True, upcast=torch.float64)
    ref_lowp, _ = attention_ref(q, k, v, causal=True, upcast=False)
    from tileattn.testing import check_close

    check_close("packed out", out, ref, ref_lowp)
    g_ref = torch.stack(torch.autograd.grad(ref.sum(), (k, v)), 2)
    g_lowp = torch.stack(torch.autograd.grad(ref_lowp.sum(), (k, v)), 2)
    check_close("packed grad", g[:, :, -2:], g_ref, g_lowp)


def test_fully_masked_rows(backend):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key. They output 0
    (not NaN), their LSE is +inf and their gradient is 0; the other rows are unaffected."""
    ctx, device = on(backend)
    b, sq, sk, h, d = 2, 70, 30, 2, 32
    q = randn(b, sq, h, d, dtype=torch.float16, device=device)
    k = randn(b, sk, h, d, dtype=torch.float16, device=device)
    v = randn(b, sk, h, d, dtype=torch.float16, device=device)
    dout = torch.randn_like(q)
    with ctx:
        out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    hidden = sq - sk
    assert torch.equal(out[:, :hidden], torch.zeros_like(out[:, :hidden]))
    assert torch.isinf(lse[:, :, :hidden]).all() and (lse[:, :, :hidden] > 0).all()
    assert torch.isfinite(lse[:, :, hidden:]).all()
    assert torch.equal(grads[0][:, :hidden], torch.zeros_like(grads[0][:, :hidden]))
    check_attention("masked rows", out, grads, q, k, v, dout, {"causal": True})


def test_window_hiding_rows(backend):
    """seqlen_q = 60 > seqlen_k = 20 with window (0, 0): row i sees only key i - 40, so rows 0..39
    see nothing and output 0 with zero gradient, forward and backward."""
    ctx, device = on(backend)
    q = randn(1, 60, 2, 16, dtype=torch.float16, device=device)
    k = randn(1, 20, 2, 16, dtype=torch.float16, device=device)
    v = randn(1, 20, 2, 16, dtype=torch.float16, device=device)
    dout = torch.randn_like(q)
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, window_size=(0, 0))
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(out[:, :40], torch.zeros_like(out[:, :40]))
    assert torch.equal(grads[0][:, :40], torch.zeros_like(grads[0][:, :40]))
    check_attention("window rows", out, grads, q, k, v, dout, {"window_size": (0, 0)})


def test_lse_matches_reference(backend):
    ctx, device = on(backend)
    q = randn(2, 45, 4, 64, dtype=torch.float16, device=device, requires_grad=False)
    k = randn(2, 77, 2, 64, dtype=torch.float16, device=device, requires_grad=False)
    with ctx:
        _, lse, probs = tileattn.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k.double().repeat_interleave(2, 2)) / 8.0
    i = torch.arange(45, device=device).view(-1, 1)
    j = torch.arange(77, device=device).view(1, -1)
    scores = scores.masked_fill(j > i + 32, float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-3, rtol=1e-3)
    _, attn = attention_ref(q, k, k, causal=True, upcast=torch.float64)
    torch.testing.assert_close(probs.double(), attn.double(), atol=2e-3, rtol=1e-2)


def test_empty_inputs(backend):
    ctx, device = on(backend)
    with ctx:
        q = randn(0, 8, 2, 16, dtype=torch.float16, device=device)
        out = tileattn.flash_attn_func(q, q, q)
        assert out.shape == q.shape
        q = randn(1, 5, 2, 16, dtype=torch.float16, device=device)
        k = randn(1, 0, 2, 16, dtype=torch.float16, device=device)
        out, lse, _ = tileattn.flash_attn_func(q, k, k, return_attn_probs=True)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
        (g,) = torch.autograd.grad(out.sum(), (q,))
        assert torch.equal(g, torch.zeros_like(g))


def test_strided_inputs(backend):
    """Inputs that are views with free strides (last dim contiguous) are read in place."""
    ctx, device = on(backend)
    base = randn(2, 40, 6, 72, dtype=torch.float16, device=device, requires_grad=False)
    q = base[:, :, :4, :64].requires_grad_()
    k = base[:, ::2, 4:, 8:].contiguous().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    v = k.detach().clone().requires_grad_()
    dout = torch.randn_like(q)
    with ctx:
        out = tileattn.flash_attn_func(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention("strided", out, grads, q, k, v, dout, {})


def test_deterministic_backward(backend):
    ctx, device = on(backend)
    q = randn(1, 50, 4, 32, dtype=torch.float16, device=device)
    k = randn(1, 50, 1, 32, dtype=torch.float16, device=device)
    dout = torch.randn_like(q)
    with ctx:
        runs = []
        for _ in range(3):
            out = tileattn.flash_attn_func(q, k, k, causal=True, deterministic=True)
            runs.append(torch.autograd.grad(out, (q, k), dout))
    for a, b in zip(runs[0], runs[-1]):
        assert torch.equal(a, b)


def test_host_size_helpers_match_triton():
    """params.cdiv / next_power_of_2 (host copies of Triton's constexpr functions) give Triton's values."""
    import triton

    from tileattn import params

    assert all(params.next_power_of_2(n) == triton.next_power_of_2(n) for n in range(0, 3000))
    assert all(params.cdiv(a, b) == triton.cdiv(a, b) for a in range(-70, 3000) for b in (1, 3, 16, 64, 128))
