"""Attention sinks (``learnable_sink``, also named ``s_aux``): one logit per query head that joins every row's
softmax denominator and takes a gradient. Every entry point that takes them, against the tests' oracle
(tests/oracle.py: a sink column appended to the masked scores and dropped after the softmax), forward, LSE
(which includes the sink) and backward with the sinks' gradient, on every backend; the gradient also by
finite differences; and the argument's checks."""

import math

import pytest
import torch

import oracle
import tileattn
from attention_cases import _cu
from helpers import check_lse, check_refused, interpreter_skips, on, randn
from kvcache_cases import _inputs, _ref_args
from kvcache_ref import dense_view, kvcache_ref
from tileattn import fp8
from tileattn.api import cpu_backend
from tileattn.testing import check_close


def _sinks(nheads, device, special=True):
    """Sink logits as a model learns them (N(0, 2), as gpt-oss's), with a large one that dominates the keys
    and one of -inf (no sink for that head) where there are enough heads."""
    sink = torch.randn(nheads, device=device) * 2
    if special and nheads >= 3:
        sink[1] = 12.0
        sink[2] = float("-inf")
    return sink


def _check(name, out, lse, grads, q, k, v, sink, dout, kwargs, varlen=None, check_grads=True):
    """``out``, ``lse`` and ``grads = (dq, dk, dv, dsink)`` of a call against the oracle in fp64 (its
    gradients by autograd), the tolerance rule's baseline being the oracle in the inputs' precision."""

    def run(*qkvs, **extra):
        if varlen is None:
            return oracle.attention(*qkvs[:3], sink=qkvs[3], **kwargs, **extra)
        return oracle.attention_varlen(*qkvs[:3], *varlen, sink=qkvs[3], **kwargs, **extra)

    exact = [t.detach().double().requires_grad_(check_grads) for t in (q, k, v, sink)]
    plain = [t.detach().clone().requires_grad_(check_grads) for t in (q, k, v)]
    plain.append(sink.detach().to(q.dtype).requires_grad_(check_grads))
    ref, lowp = run(*exact), run(*plain, precision=None)
    check_close(f"{name} out", out, ref.out, lowp.out)
    if lse is not None:
        check_lse(f"{name} lse", lse, ref.lse, lowp.lse)
    if not check_grads:
        return
    g_ref = torch.autograd.grad(ref.out, exact, dout.double(), allow_unused=True, materialize_grads=True)
    g_lowp = torch.autograd.grad(lowp.out, plain, dout, allow_unused=True, materialize_grads=True)
    scale = torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in g_ref[:3]])
    for gname, g, gr, gl in zip(("dq", "dk", "dv"), grads[:3], g_ref[:3], g_lowp[:3]):
        check_close(f"{name} {gname}", g, gr, gl, floor_scale=scale)
    check_close(f"{name} dsink", grads[3], g_ref[3], _dsink_baseline(ref, exact, dout, out, g_ref[3], g_lowp[3]))


def _dsink_baseline(ref, exact, dout, out, want, plain):
    """The tolerance rule's baseline for the sinks' gradient: plain PyTorch's, or where larger, the error that
    storing the output in its dtype alone makes. FlashAttention's backward (FlashAttention-4's sinks too)
    takes dsink = -Σ_i exp(sink - lse_i) Δ_i with Δ_i = rowsum(dO ∘ O) of the output as stored: rounding O
    moves each Δ_i, and dsink sums that over the head's rows (more than plain PyTorch's error where many
    rows hold a sizeable sink probability, in bf16). That error is computed here exactly, in fp64, from the
    oracle's output rounded to the call's dtype."""
    sink, lse = exact[3].detach(), ref.lse
    varlen = lse.dim() == 2
    weight = torch.exp(sink.view(-1, 1) - lse) if varlen else torch.exp(sink.view(1, -1, 1) - lse)
    weight = weight.nan_to_num(0.0)  # (rows that see nothing, and padding rows: LSE +inf)
    delta = (dout.double() * ref.out.detach().to(out.dtype).double()).sum(-1)  # (.., seqlen, nheads)
    delta = delta.transpose(0, 1) if varlen else delta.transpose(1, 2)
    stored = -(weight * delta).sum(-1)
    stored = stored if varlen else stored.sum(0)
    return stored if (stored - want).abs().max() > (plain.double() - want).abs().max() else plain


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, features): odd lengths and head dims, GQA, causal
# with seqlen_q > seqlen_k (rows that see no key: their LSE is the sink), windows, softcap, ALiBi.
CASES = [
    (1, 1, 1, 3, 1, 64, {}),
    (2, 63, 113, 4, 2, 40, {"causal": True}),
    (1, 113, 63, 4, 4, 59, {"causal": True}),
    (2, 47, 71, 6, 2, 96, {"window_size": (9, 4)}),
    (1, 63, 113, 3, 1, 111, {"softcap": 3.0}),
    (2, 113, 63, 4, 2, 64, {"alibi_slopes": "head", "causal": True}),
    (1, 60, 20, 3, 3, 16, {"window_size": (0, 0)}),  # rows 0..39 see no key
]


def _case_id(case):
    b, sq, sk, h, hk, d, feats = case
    return f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}" + "".join(f"-{key}" for key in feats)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dense(backend, case, dtype):
    interpreter_skips(backend, dtype)
    b, sq, sk, h, hk, d, feats = case
    ctx, device = on(backend)
    q = randn(b, sq, h, d, dtype=dtype, device=device)
    k = randn(b, sk, hk, d, dtype=dtype, device=device)
    v = randn(b, sk, hk, d, dtype=dtype, device=device)
    sink = _sinks(h, device).requires_grad_()
    kwargs = dict(feats)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = torch.rand(h, device=device) * 0.5
    dout = torch.randn_like(q)
    with ctx:
        out, lse, _ = tileattn.flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    _check(_case_id(case), out, lse, grads, q, k, v, sink, dout, kwargs)


# The Gluon kernels' head dims on sm90 (forward and backward), dense and windowed, and the persistent grid
# of short key ranges; on other GPUs the portable kernels at these shapes.
GPU_CASES = [
    (2, 1025, 1025, 8, 2, 128, {"causal": True}),
    (1, 777, 1300, 4, 4, 128, {}),
    (2, 1000, 1000, 4, 2, 128, {"window_size": (256, 0)}),
    (1, 1025, 2047, 4, 1, 256, {"causal": True}),
    (2, 513, 513, 4, 4, 256, {}),
    (2, 1025, 1025, 8, 8, 64, {"causal": True}),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon and large-tile builds run on the GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_dense_gpu(case, dtype):
    test_dense("cuda", case, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon and large-tile builds run on the GPU")
@pytest.mark.parametrize("headdim", [128, 256])
def test_varlen_gpu(headdim):
    """Packed batches at the Gluon kernels' head dims (a tile's rows past its sequence are the next one's)."""
    lq = lk = [300, 1, 0, 1029, 64]
    q = randn(sum(lq), 8, headdim, dtype=torch.bfloat16, device="cuda")
    k = randn(sum(lk), 2, headdim, dtype=torch.bfloat16, device="cuda")
    v = randn(sum(lk), 2, headdim, dtype=torch.bfloat16, device="cuda")
    sink = _sinks(8, "cuda").requires_grad_()
    dout = torch.randn_like(q)
    cu = _cu(lq, "cuda")
    out, lse, _ = tileattn.flash_attn_varlen_func(
        q, k, v, cu, cu, max(lq), max(lk), causal=True, learnable_sink=sink, return_attn_probs=True
    )
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    _check("varlen gpu", out, lse, grads, q, k, v, sink, dout, {"causal": True}, varlen=(cu, cu, max(lk)))


def test_rows_that_see_no_key_have_the_sink_as_lse(backend):
    """Causal with seqlen_q > seqlen_k: the first rows see no key; with a sink their output is 0, their LSE
    is the sink (the softmax holds the sink alone), and nothing is NaN; a sink of -inf leaves them +inf."""
    ctx, device = on(backend)
    q = randn(1, 40, 3, 32, dtype=torch.float16, device=device)
    k = randn(1, 10, 3, 32, dtype=torch.float16, device=device)
    sink = torch.tensor([0.5, -3.0, float("-inf")], device=device, requires_grad=True)
    with ctx:
        out, lse, _ = tileattn.flash_attn_func(q, k, k, causal=True, learnable_sink=sink, return_attn_probs=True)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, sink))
    assert torch.equal(out[:, :30], torch.zeros_like(out[:, :30]))
    assert torch.equal(lse[0, :2, :30], sink[:2, None].detach().expand(2, 30))
    assert torch.isposinf(lse[0, 2, :30]).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_sink_of_minus_inf_is_no_sink_and_s_aux_is_learnable_sink(backend):
    """A sink of -inf adds exp(-inf) = 0: the same bits as no sink. ``s_aux`` is the same argument as
    ``learnable_sink`` (the same bits), and passing both is refused."""
    ctx, device = on(backend)
    q, k, v = (randn(2, 37, 4, 40, dtype=torch.float16, device=device, requires_grad=False) for _ in range(3))
    minus_inf = torch.full((4,), float("-inf"), device=device)
    sink = _sinks(4, device)
    with ctx:
        plain = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        none = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=minus_inf)
        named = tileattn.flash_attn_func(q, k, v, learnable_sink=sink)
        aux = tileattn.flash_attn_func(q, k, v, s_aux=sink)
        check_refused(
            lambda: tileattn.flash_attn_func(q, k, v, learnable_sink=sink, s_aux=sink),
            tileattn.InvalidArgument,
            ["learnable_sink", "s_aux", "not both"],
        )
    assert torch.equal(plain[0], none[0]) and torch.equal(plain[1], none[1])
    assert torch.equal(named, aux)
    assert not torch.equal(named, tileattn.flash_attn_func(q, k, v))


def test_gradient_by_finite_differences():
    """The sinks' gradient from the backward against central differences of the loss, on the CPU path in
    fp32 (rows that see no key included: causal with seqlen_q > seqlen_k)."""
    torch.manual_seed(3)
    q = torch.randn(2, 19, 3, 16, dtype=torch.float32)
    k = torch.randn(2, 11, 3, 16, dtype=torch.float32)
    v = torch.randn(2, 11, 3, 16, dtype=torch.float32)
    w = torch.randn(2, 19, 3, 16, dtype=torch.float32)
    sink = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float32, requires_grad=True)

    def loss(s):
        with cpu_backend("torch"):
            return (tileattn.flash_attn_func(q, k, v, causal=True, learnable_sink=s) * w).double().sum()

    (grad,) = torch.autograd.grad(loss(sink), (sink,))
    eps = 1e-2
    for h in range(3):
        step = torch.zeros(3)
        step[h] = eps
        with torch.no_grad():
            numeric = (loss(sink + step) - loss(sink - step)) / (2 * eps)
        # central differences err by eps² · f''' / 6 (~1e-5 here) plus fp32 rounding of the loss over 2·eps
        assert math.isclose(grad[h].item(), numeric.item(), rel_tol=2e-3, abs_tol=2e-3), (h, grad[h], numeric)


def test_dropout(backend):
    """Dropout keeps or drops the keys' probabilities (the sink has no value to drop); the mask comes back in
    S_dmask, in flash_attn's scaling (the sink is no key: it is in no block's running max)."""
    ctx, device = on(backend)
    b, sq, sk, h, hk, d, p = 2, 47, 71, 4, 2, 40, 0.17
    q = randn(b, sq, h, d, dtype=torch.float16, device=device)
    k = randn(b, sk, hk, d, dtype=torch.float16, device=device)
    v = randn(b, sk, hk, d, dtype=torch.float16, device=device)
    sink = _sinks(h, device).requires_grad_()
    dout = torch.randn_like(q)
    with ctx:
        out, lse, s_dmask = tileattn.flash_attn_func(
            q, k, v, dropout_p=p, causal=True, learnable_sink=sink, return_attn_probs=True
        )
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    kwargs = dict(causal=True, dropout_p=p, dropout_mask=s_dmask >= 0)
    _check("dropout", out, lse, grads, q, k, v, sink, dout, kwargs)
    ref = oracle.attention(q.detach(), k.detach(), k.detach() * 0, causal=True, sink=sink.detach())
    lowp = oracle.attention(q.detach(), k.detach(), k.detach() * 0, causal=True, sink=sink.detach(), precision=None)
    block_n = oracle.flash_attn_block_n(
        40, True, True, torch.cuda.get_device_capability() if device == "cuda" else (0, 0)
    )
    unnormalized = oracle.flash_attn_unnormalized
    check_close(
        "dropout S_dmask", s_dmask.abs(), unnormalized(ref.probs, block_n), unnormalized(lowp.probs.float(), block_n)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon backward with dropout runs on the GPU")
@pytest.mark.parametrize("headdim", [128, 256])
def test_dropout_gpu(headdim):
    """Dropout with sinks at the Gluon backward's head dims."""
    b, s, h, p = 2, 777, 4, 0.17
    q, k, v = (randn(b, s, h, headdim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    sink = _sinks(h, "cuda").requires_grad_()
    dout = torch.randn_like(q)
    out, lse, s_dmask = tileattn.flash_attn_func(
        q, k, v, dropout_p=p, causal=True, learnable_sink=sink, return_attn_probs=True
    )
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    _check(
        "dropout gpu", out, lse, grads, q, k, v, sink, dout, dict(causal=True, dropout_p=p, dropout_mask=s_dmask >= 0)
    )


@pytest.mark.parametrize("feats", [{}, {"causal": True}, {"window_size": (5, 2), "softcap": 2.0}], ids=str)
def test_varlen(backend, feats):
    """Packed sequences with empty ones and padding rows after the last sequence (which see nothing, not even
    a sink: LSE +inf, output 0, no gradient)."""
    ctx, device = on(backend)
    lq, lk = [17, 0, 1, 45, 6], [17, 3, 0, 30, 6]
    h, hk, d = 4, 2, 40
    pad = 3
    q = randn(sum(lq) + pad, h, d, dtype=torch.float16, device=device)
    k = randn(sum(lk), hk, d, dtype=torch.float16, device=device)
    v = randn(sum(lk), hk, d, dtype=torch.float16, device=device)
    sink = _sinks(h, device).requires_grad_()
    dout = torch.randn_like(q)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    with ctx:
        out, lse, _ = tileattn.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lq), max(lk), learnable_sink=sink, return_attn_probs=True, **feats
        )
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    used = sum(lq)
    assert torch.equal(out[used:], torch.zeros_like(out[used:])) and torch.isposinf(lse[:, used:]).all()
    assert torch.equal(grads[0][used:], torch.zeros_like(grads[0][used:]))
    real = slice(0, used)
    _check(
        "varlen", out[real], lse[:, real], (grads[0][real], *grads[1:]), q[real], k, v, sink, dout[real], feats,
        varlen=(cu_q, cu_k, max(lk)),
    )  # fmt: skip


@pytest.mark.parametrize("form", ["qkv", "kv", "varlen-qkv", "varlen-kv"])
def test_packed_forms(backend, form):
    """The packed functions take the sinks (by either name) and pass their gradient back."""
    ctx, device = on(backend)
    s, h, d = 29, 4, 32
    sink = _sinks(h, device).requires_grad_()
    qkv = randn(2, s, 3, h, d, dtype=torch.float16, device=device)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device=device)
    with ctx:
        if form == "qkv":
            out = tileattn.flash_attn_qkvpacked_func(qkv, causal=True, s_aux=sink)
        elif form == "kv":
            out = tileattn.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True, learnable_sink=sink)
        elif form == "varlen-qkv":
            out = tileattn.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, s, causal=True, learnable_sink=sink)
        else:
            kv = torch.stack([k, v], 2).flatten(0, 1)
            out = tileattn.flash_attn_varlen_kvpacked_func(q.flatten(0, 1), kv, cu, cu, s, s, causal=True, s_aux=sink)
        (dsink,) = torch.autograd.grad(out.float().square().sum(), (sink,))
    ref = oracle.attention(*(t.detach().double() for t in (q, k, v)), causal=True, sink=sink.detach().double())
    lowp = oracle.attention(q.detach(), k.detach(), v.detach(), causal=True, sink=sink.detach().half(), precision=None)
    check_close(form, out.view(q.shape), ref.out, lowp.out)
    assert torch.isfinite(dsink).all() and dsink[0] != 0


def test_only_the_sinks_require_grad(backend):
    """A call whose only input that requires a gradient is the sinks still makes an autograd node."""
    ctx, device = on(backend)
    q, k, v = (randn(1, 21, 3, 16, dtype=torch.float16, device=device, requires_grad=False) for _ in range(3))
    sink = _sinks(3, device, special=False).requires_grad_()
    dout = torch.randn_like(q)
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, learnable_sink=sink)
        (dsink,) = torch.autograd.grad(out, (sink,), dout)
    exact = sink.detach().double().requires_grad_()
    ref = oracle.attention(q.double(), k.double(), v.double(), sink=exact).out
    (want,) = torch.autograd.grad(ref, (exact,), dout.double())
    lowp_sink = sink.detach().half().requires_grad_()
    (lowp,) = torch.autograd.grad(oracle.attention(q, k, v, sink=lowp_sink, precision=None).out, (lowp_sink,), dout)
    check_close("dsink", dsink, want, lowp)


@pytest.mark.parametrize("layout", ["dense", "page4", "page16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache(backend, layout, num_splits):
    """flash_attn_with_kvcache with an append, GQA and causal: one split (the sink in the split kernel) and
    three (the sink in the combine), contiguous and paged caches; the LSE includes the sink."""
    ctx, device = on(backend)
    page = {"dense": None, "page4": 4, "page16": 16}[layout]
    q, kc, vc, args = _inputs(2, 1, {"causal": True}, page, device)
    sink = _sinks(q.shape[2], device)
    ref = kvcache_ref(q, kc, vc, learnable_sink=sink, **_ref_args(args))
    lowp = kvcache_ref(q, kc, vc, precision=None, learnable_sink=sink, **_ref_args(args))
    with ctx:
        out, lse = tileattn.flash_attn_with_kvcache(
            q, kc, vc, num_splits=num_splits, return_softmax_lse=True, learnable_sink=sink, **args
        )
        again = tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits, s_aux=sink, **args)
    check_close(f"kvcache {layout} out", out, ref.out, lowp.out)
    check_lse(f"kvcache {layout} lse", lse, ref.lse, lowp.lse)
    assert torch.isfinite(again).all()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_kvcache_without_keys_and_replayed(backend, num_splits):
    """Decode steps over caches, one of them empty (its row sees only the sink: output 0, LSE the sink), called
    twice with the same signature (the second call replays the first one's launches) and once more with
    other sink values."""
    _, device = on(backend)
    q, kc, vc, args = _inputs(1, 0, {}, None, device)
    args["cache_seqlens"] = torch.tensor([0, 17, 37], dtype=torch.int32, device=device)
    for step in range(3):
        sink = _sinks(q.shape[2], device)
        ref = kvcache_ref(q, kc, vc, learnable_sink=sink, **_ref_args(args))
        lowp = kvcache_ref(q, kc, vc, precision=None, learnable_sink=sink, **_ref_args(args))
        with on(backend)[0]:
            out, lse = tileattn.flash_attn_with_kvcache(
                q, kc, vc, num_splits=num_splits, return_softmax_lse=True, learnable_sink=sink, **args
            )
        check_close(f"step {step} out", out, ref.out, lowp.out)
        check_lse(f"step {step} lse", lse, ref.lse, lowp.lse)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_paged_varlen_prefill(backend):
    """flash_attn_varlen_func with block_table and sinks: the oracle on the keys gathered through the table."""
    ctx, device = on(backend)
    lq, lk, page = [3, 0, 9, 1], [10, 4, 9, 30], 4
    h, hk, d = 4, 2, 24
    max_pages = -(-max(lk) // page)
    num_pages = len(lk) * max_pages
    kp = torch.randn(num_pages, page, hk, d, dtype=torch.float16, device=device)
    vp = torch.randn_like(kp)
    table = torch.randperm(num_pages, device=device).view(len(lk), max_pages).int()
    q = torch.randn(sum(lq), h, d, dtype=torch.float16, device=device)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    dense_k, dense_v = dense_view(kp, table, max_pages * page), dense_view(vp, table, max_pages * page)
    k = torch.cat([dense_k[b, :n] for b, n in enumerate(lk)])
    v = torch.cat([dense_v[b, :n] for b, n in enumerate(lk)])
    sink = _sinks(h, device)
    with ctx:
        out = tileattn.flash_attn_varlen_func(
            q, kp, vp, cu_q, cu_k, max(lq), max(lk), causal=True, block_table=table, learnable_sink=sink
        )
    ref = oracle.attention_varlen(q, k, v, cu_q, cu_k, max(lk), causal=True, sink=sink).out
    lowp = oracle.attention_varlen(q, k, v, cu_q, cu_k, max(lk), causal=True, sink=sink, precision=None).out
    check_close("paged varlen", out, ref, lowp)


def test_flashmask(backend):
    """flashmask_attention with sinks: a document mask (causal within documents), forward, LSE, backward."""
    ctx, device = on(backend)
    n, h = 70, 4
    idx = tileattn.masks.causal_document_mask([30, 25, 15])
    q = randn(1, n, h, 40, dtype=torch.float16, device=device)
    k = randn(1, n, 2, 40, dtype=torch.float16, device=device)
    v = randn(1, n, 2, 40, dtype=torch.float16, device=device)
    sink = _sinks(h, device).requires_grad_()
    dout = torch.randn_like(q)
    with ctx:
        out, lse = tileattn.flashmask_attention(
            q, k, v, idx.to(device), causal=True, learnable_sink=sink, return_softmax_lse=True
        )
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    kwargs = dict(causal=True, visible_mask=oracle.flashmask_visible(idx, True, n))
    _check("flashmask", out, lse, grads, q, k, v, sink, dout, kwargs)


def test_fp8_forward(backend):
    """FP8 inputs with sinks (forward only): the oracle on the dequantized inputs, with e4m3 probabilities as
    its low-precision run (the FP8 tests' rule)."""
    ctx, device = on(backend)
    b, sq, sk, h, hk, d = 2, 63, 113, 4, 2, 64
    q, k, v = (torch.randn(b, s, n, d, device=device) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, hk), fp8.quantize(k), fp8.quantize(v)
    sink = _sinks(h, device)
    with ctx:
        out = tileattn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, s_aux=sink)
    deq = [fp8.dequantize(t, s, dtype=torch.float32) for t, s in ((q8, qd), (k8, kd), (v8, vd))]
    ref = oracle.attention(*(t.double() for t in deq), causal=True, sink=sink.double()).out
    lowp = oracle.attention(*deq, causal=True, sink=sink, precision=None, probs_dtype=torch.float8_e4m3fn).out
    check_close("fp8 out", out, ref, lowp)


@pytest.mark.parametrize(
    "sink, words",
    [
        (torch.zeros(3), ["learnable_sink", "(nheads,)", "(4,)", "(3,)"]),
        (torch.zeros(4, dtype=torch.int32), ["learnable_sink", "float32", "int32"]),
        (torch.zeros(4).to(torch.float8_e4m3fn), ["learnable_sink", "float32"]),
        ([0.0] * 4, ["learnable_sink", "tensor", "list"]),
    ],
    ids=["shape", "int", "fp8", "list"],
)
def test_bad_sinks_are_refused(sink, words):
    q = torch.randn(1, 8, 4, 16)
    for call in (
        lambda: tileattn.flash_attn_func(q, q, q, learnable_sink=sink),
        lambda: tileattn.flash_attn_with_kvcache(q, q, q, learnable_sink=sink),
        lambda: tileattn.flash_attn_varlen_func(
            q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8, 8,
            learnable_sink=sink,
        ),
    ):  # fmt: skip
        check_refused(call, tileattn.InvalidArgument, words)
