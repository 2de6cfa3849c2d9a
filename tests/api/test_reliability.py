"""Reliability: numerics at the edges, non-finite inputs, determinism, tensors past 2**31 elements,
devices and streams, and property-based tests against the tests' oracle (tests/oracle.py) over random
shapes and features."""

import pytest
import torch
from hypothesis import strategies as st

import oracle
import tileattn
from helpers import PROPERTY_SHARDS, check_attention, on, randn, run_property
from tileattn.testing import check_close

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="runs on the GPU")


# ------------------------------------------------------------------------------------------------
# Numerics at the edges
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_huge_scores_stay_finite_and_exact(backend, causal):
    """Scores near 1e4 (fp16 inputs of norm ~1e3): the online softmax never overflows. Plain fp16
    PyTorch overflows here, so the low-precision baseline is the fp32 reference."""
    ctx, device = on(backend)
    d = 64
    q = randn(1, 40, 2, d, dtype=torch.float16, device=device, requires_grad=False)
    k = randn(1, 56, 2, d, dtype=torch.float16, device=device, requires_grad=False)
    q = (q / q.norm(dim=-1, keepdim=True) * 1000).half()
    k = (k / k.norm(dim=-1, keepdim=True) * 80).half()  # |q·k|·scale up to 1e4
    v = randn(1, 56, 2, d, dtype=torch.float16, device=device, requires_grad=False)
    with ctx:
        out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.abs().max() > 1000  # the scores really were huge
    ref = oracle.attention(q, k, v, causal=causal).out
    lowp = oracle.attention(q, k, v, causal=causal, precision=torch.float32).out.half()  # (fp32, output in fp16)
    check_close("huge scores", out, ref, lowp)


def test_nan_in_one_query_row_stays_in_that_row(backend):
    """NaN in query row i makes output row i NaN and leaves every other row bit-identical."""
    ctx, device = on(backend)
    q = randn(1, 37, 2, 32, dtype=torch.float16, device=device, requires_grad=False)
    k = randn(1, 45, 2, 32, dtype=torch.float16, device=device, requires_grad=False)
    bad = q.clone()
    bad[0, 11, 1, 5] = float("nan")
    with ctx:
        clean = tileattn.flash_attn_func(q, k, k)
        out = tileattn.flash_attn_func(bad, k, k)
    assert torch.isnan(out[0, 11, 1]).all()
    keep = torch.ones(37, 2, dtype=torch.bool, device=device)
    keep[11, 1] = False
    assert torch.equal(out[0][keep], clean[0][keep])


@pytest.mark.parametrize("where", ["k", "v"])
def test_nonfinite_keys_propagate_without_crash(backend, where):
    """Inf/NaN in k or v reaches the output as NaN/Inf (documented in README: no silent finite
    garbage, no hang, no crash) in the rows that see the key."""
    ctx, device = on(backend)
    q = randn(1, 20, 1, 16, dtype=torch.float16, device=device, requires_grad=False)
    k = randn(1, 20, 1, 16, dtype=torch.float16, device=device, requires_grad=False)
    v = k.clone()
    (k if where == "k" else v)[0, 7, 0, :] = float("inf")
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, causal=True)
    assert not torch.isfinite(out[0, 7:]).all(dim=-1).any()  # every row that sees key 7


def test_nan_key_reaches_the_gradients_with_dropout(backend):
    """A NaN key's scores are NaN: with dropout too, dV of that key is NaN wherever a row that sees it kept
    it (not a finite value that hides it), and nothing else in its head's dV or in the other head's
    gradients is (head dim 64: the Gluon backward on sm90). The rows whose sum turned NaN take the
    convention of rows that saw no key (LSE +inf), so their other weights are 0."""
    ctx, device = on(backend)
    q, k, v = (randn(1, 20, 2, 64, dtype=torch.float16, device=device) for _ in range(3))
    with torch.no_grad():
        k[0, 7, 1, 3] = float("nan")
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.isfinite(out[0, :7]).all() and torch.isfinite(out[0, :, 0]).all()
    nan_keys = torch.isnan(dv[0, :, 1]).any(dim=-1).cpu()
    assert nan_keys.tolist() == [j == 7 for j in range(20)]  # (13 rows see key 7: all dropping it is ~1e-9)
    assert all(torch.isfinite(g[0, :, 0]).all() for g in (dq, dk, dv))


def test_zero_lengths(backend):
    ctx, device = on(backend)
    with ctx:
        for b, s in ((0, 5), (3, 0)):
            q = randn(b, s, 2, 16, dtype=torch.float16, device=device)
            out = tileattn.flash_attn_func(q, q, q, causal=True)
            assert out.shape == q.shape
            out.sum().backward()
            assert torch.equal(q.grad, torch.zeros_like(q))
        # A packed batch of only empty sequences, and a batch of none.
        for cu in ([0, 0, 0], [0]):
            cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
            q = randn(0, 2, 16, dtype=torch.float16, device=device)
            out, lse, _ = tileattn.flash_attn_varlen_func(q, q, q, cu_t, cu_t, 0, 0, return_attn_probs=True)
            assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


# ------------------------------------------------------------------------------------------------
# Determinism
# ------------------------------------------------------------------------------------------------


def test_bitwise_determinism(backend):
    """Forward (out, LSE) identical over 100 repeats and backward (dq with deterministic=True, dk, dv)
    over 50 on the GPU; 3 repeats elsewhere. Dropout identical under the same seed (dq as without it:
    bitwise with deterministic=True)."""
    ctx, device = on(backend)
    n_fwd, n_bwd = (100, 50) if backend == "cuda" else (3, 3)
    # head dim 128 causal: the default backward there adds dQ by reduce-adds, which deterministic=True avoids
    size = (2, 300, 8, 2, 128) if backend == "cuda" else (1, 40, 4, 2, 32)
    b, s, h, hk, d = size
    q = randn(b, s, h, d, dtype=torch.float16, device=device)
    k = randn(b, s, hk, d, dtype=torch.float16, device=device)
    v = randn(b, s, hk, d, dtype=torch.float16, device=device)
    dout = torch.randn_like(q)
    with ctx:
        out0, lse0, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        for _ in range(n_fwd):
            out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
            assert torch.equal(out, out0) and torch.equal(lse, lse0)
        g0 = torch.autograd.grad(tileattn.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
        for _ in range(n_bwd):
            g = torch.autograd.grad(tileattn.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
            assert all(torch.equal(a, b) for a, b in zip(g, g0))
        # dropout: the same seed, the same mask; dq bitwise with deterministic=True, dk and dv always (the
        # default backward adds dQ in an order that varies: the Gluon one on sm90, dropout included). The two
        # settings may run different backwards (on sm90 deterministic=True is the portable one): each against
        # the oracle given the mask, and every dq that differs from its first too
        runs = {}
        for deterministic in (True, False):
            for _ in range(n_bwd):
                torch.manual_seed(7)
                out, _, s_dmask = tileattn.flash_attn_func(
                    q, k, v, dropout_p=0.2, deterministic=deterministic, return_attn_probs=True
                )
                grads = torch.autograd.grad(out, (q, k, v), dout)
                first = runs.setdefault(deterministic, (out, *grads, s_dmask))
                assert all(torch.equal(a, b) for a, b in zip((out, *grads[1:], s_dmask), first[:1] + first[2:]))
                assert torch.equal(grads[0], first[1]) or not deterministic
                if not torch.equal(grads[0], first[1]):
                    feats = {"dropout_p": 0.2, "dropout_mask": s_dmask >= 0}
                    check_attention("dropout, a repeat's dq", out, grads, q, k, v, dout, feats)
    for a, b in zip(runs[False][:1] + runs[False][-1:], runs[True][:1] + runs[True][-1:]):  # (out, S_dmask)
        assert torch.equal(a, b), "the same seed drew another mask or the forward changed with deterministic"
    for deterministic, (out, *grads, s_dmask) in runs.items():
        feats = {"dropout_p": 0.2, "dropout_mask": s_dmask >= 0}
        check_attention(f"dropout, deterministic={deterministic}", out, grads, q, k, v, dout, feats)


# ------------------------------------------------------------------------------------------------
# Large sizes, devices, streams (GPU)
# ------------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_tensors_past_int32_elements(varlen, big_gpu_memory):
    """q, k, v of 1025 x 1024 x 16 x 128 = 2.15e9 elements each (> 2**31): the last sequence, whose
    offsets need 64 bits, matches the reference forward and backward."""
    b, s, h, d = 1025, 1024, 16, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    assert q.numel() > 2**31
    for t in (q, k, v):
        t.requires_grad_()
    dout = torch.zeros_like(q)
    dout[-1] = torch.randn(s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    if varlen:
        cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
        out = tileattn.flash_attn_varlen_func(*(t.view(b * s, h, d) for t in (q, k, v)), cu, cu, s, s, causal=True)
        out = out.view(b, s, h, d)
    else:
        out = tileattn.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    last = [t[-1:].detach().requires_grad_() for t in (q, k, v)]
    check_attention("last sequence", out[-1:], [g[-1:] for g in grads], *last, dout[-1:], {"causal": True})


def test_heads_outermost_past_int32(backend, big_gpu_memory):
    """q, k, v with heads outermost whose last head starts past 2**31 elements (views into one buffer,
    allocated lazily on the CPU: only touched pages take memory), forward and backward against the
    reference on copies: the kernels' head offsets are 64-bit."""
    ctx, device = on(backend)
    seqlen, heads, d = 5, 3, 16
    head_stride, start = 2**30 + 2**29, 2**31 - 3 * seqlen * d  # head 2 starts past 2**31
    buf = torch.empty(start + 2 * head_stride + 3 * seqlen * d, dtype=torch.float16, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    views = []
    for i in range(3):  # q, k, v side by side in each head's region
        t = buf.as_strided((1, seqlen, heads, d), (seqlen * d, d, head_stride, 1), start + i * seqlen * d)
        t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float16))
        views.append(t.requires_grad_())
    dout = torch.randn(1, seqlen, heads, d, generator=gen, device=device, dtype=torch.float16)
    with ctx:
        out = tileattn.flash_attn_func(*views, causal=True)
        grads = torch.autograd.grad(out, views, dout)
    copies = [t.detach().clone().requires_grad_() for t in views]
    check_attention("heads outermost", out, grads, *copies, dout, {"causal": True})


@needs_gpu
def test_runs_on_current_stream():
    q = torch.randn(2, 500, 4, 64, device="cuda", dtype=torch.float16)
    expected = tileattn.flash_attn_func(q, q, q, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = tileattn.flash_attn_func(q, q, q, causal=True)
    side.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs (no second device to pass)")
def test_non_default_device():
    """Inputs on cuda:1 while cuda:0 is current run on cuda:1, forward and backward, against the oracle; the
    forward bit for bit as on cuda:0."""
    qkv0 = [torch.randn(2, 300, 4, 64, device="cuda:0", dtype=torch.float16) for _ in range(3)]
    out0 = tileattn.flash_attn_func(*qkv0, causal=True)
    qkv1 = [t.to("cuda:1").requires_grad_() for t in qkv0]
    dout = torch.randn_like(qkv1[0])
    with torch.cuda.device(0):
        out1 = tileattn.flash_attn_func(*qkv1, causal=True)
        grads = torch.autograd.grad(out1, qkv1, dout)
    assert out1.device == torch.device("cuda:1") and all(g.device == out1.device for g in grads)
    assert torch.equal(out1.cpu(), out0.cpu())
    check_attention("on cuda:1", out1, grads, *qkv1, dout, {"causal": True})


# ------------------------------------------------------------------------------------------------
# Property-based: random shapes and feature combinations against the reference
# ------------------------------------------------------------------------------------------------

# Examples per backend: CI runs 120 on the CPU path and 100 under the interpreter (>= 200 in all);
# the GPU runs PROPERTY_SHARDS shards of fresh examples (helpers.run_property).
_EXAMPLES = {"torch": 120, "interpret": 100, "cuda": 75}


F16, BF16 = torch.float16, torch.bfloat16


def _dtypes(backend):
    """fp16 and bf16; fp16 alone under the interpreter, where bf16 calls take the CPU path (run as "torch")."""
    return (F16,) if backend == "interpret" else (F16, BF16)


@st.composite
def attention_problems(draw, max_len, dtypes=(F16,)):
    nheads_k = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3]))
    window = (-1, -1)
    causal = draw(st.booleans())
    if draw(st.booleans()):
        window = (draw(st.integers(-1, 40)), draw(st.integers(-1, 40)))
    return dict(
        batch=draw(st.integers(1, 2)),
        seqlen_q=draw(st.integers(1, max_len)),
        seqlen_k=draw(st.integers(1, max_len)),
        nheads_k=nheads_k,
        nheads=nheads_k * group,
        headdim=draw(st.sampled_from([8, 16, 24, 40, 59, 64, 80, 96, 111, 128, 256])),
        causal=causal,
        window=window,
        softcap=draw(st.sampled_from([0.0, 0.0, 1.5, 20.0])),
        alibi=draw(st.sampled_from([None, None, "head", "batch"])),
        scale=draw(st.sampled_from([None, None, 0.05, 0.9])),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.0, 0.17])),
        dtype=draw(st.sampled_from(dtypes)),
    )


def _check_problem(backend, pb):
    ctx, device = on(backend)
    dtype = pb["dtype"]
    q = randn(pb["batch"], pb["seqlen_q"], pb["nheads"], pb["headdim"], dtype=dtype, device=device)
    k = randn(pb["batch"], pb["seqlen_k"], pb["nheads_k"], pb["headdim"], dtype=dtype, device=device)
    v = randn(pb["batch"], pb["seqlen_k"], pb["nheads_k"], pb["headdim"], dtype=dtype, device=device)
    dout = torch.randn_like(q)
    kwargs = dict(causal=pb["causal"], window_size=pb["window"], softcap=pb["softcap"], softmax_scale=pb["scale"])
    if pb["alibi"]:
        shape = (pb["nheads"],) if pb["alibi"] == "head" else (pb["batch"], pb["nheads"])
        kwargs["alibi_slopes"] = torch.rand(shape, device=device)
    with ctx:
        out, _, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=pb["dropout"], return_attn_probs=True, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    if pb["dropout"]:  # (the oracle given the mask the call drew; the mask itself: test_dropout.py)
        kwargs.update(dropout_p=pb["dropout"], dropout_mask=s_dmask >= 0)
    check_attention(str(pb), out, grads, q, k, v, dout, kwargs)


@pytest.mark.parametrize("shard", range(PROPERTY_SHARDS))
def test_property_random_problems(backend, shard):
    strategy = attention_problems(300 if backend == "cuda" else 48, _dtypes(backend))
    run_property(_check_problem, strategy, _EXAMPLES, backend, shard)


@st.composite
def varlen_problems(draw, max_len, dtypes=(F16,)):
    n = draw(st.integers(1, 4))
    lengths_q = draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    same = draw(st.booleans())
    lengths_k = lengths_q if same else draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    nheads_k = draw(st.integers(1, 2))
    window = (draw(st.integers(-1, 20)), draw(st.integers(-1, 20))) if draw(st.booleans()) else (-1, -1)
    return dict(
        lengths_q=lengths_q,
        lengths_k=lengths_k,
        nheads_k=nheads_k,
        nheads=nheads_k * draw(st.sampled_from([1, 2])),
        headdim=draw(st.sampled_from([16, 40, 64, 96])),
        causal=draw(st.booleans()),
        window=window,
        softcap=draw(st.sampled_from([0.0, 0.0, 5.0])),
        alibi=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)),
    )


def _check_varlen_problem(backend, pb):
    ctx, device = on(backend)
    lq, lk = pb["lengths_q"], pb["lengths_k"]
    h, hk, d = pb["nheads"], pb["nheads_k"], pb["headdim"]
    q = randn(sum(lq), h, d, dtype=pb["dtype"], device=device)
    k = randn(sum(lk), hk, d, dtype=pb["dtype"], device=device)
    v = randn(sum(lk), hk, d, dtype=pb["dtype"], device=device)
    dout = torch.randn_like(q)
    kwargs = dict(causal=pb["causal"], window_size=pb["window"], softcap=pb["softcap"])
    if pb["alibi"]:
        kwargs["alibi_slopes"] = torch.rand(len(lq), h, device=device)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    with ctx:
        out = tileattn.flash_attn_varlen_func(q, k, v, cu(lq), cu(lk), max(lq), max(lk), **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention(str(pb), out, grads, q, k, v, dout, kwargs, varlen=(cu(lq), cu(lk), max(lk)))


_VARLEN_EXAMPLES = {"torch": 60, "interpret": 40, "cuda": 30}


@pytest.mark.parametrize("shard", range(PROPERTY_SHARDS))
def test_property_random_varlen_batches(backend, shard):
    strategy = varlen_problems(200 if backend == "cuda" else 40, _dtypes(backend))
    run_property(_check_varlen_problem, strategy, _VARLEN_EXAMPLES, backend, shard)


@st.composite
def padded_problems(draw, max_len, dtypes=(F16,)):
    """A padded batch (real tokens first, as flash_attn's bert_padding takes it) of random lengths, 0 to
    the padded length, for queries and keys."""
    batch = draw(st.integers(1, 3))
    seqlen_q, seqlen_k = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    nheads_k = draw(st.integers(1, 2))
    window = (draw(st.integers(-1, 20)), draw(st.integers(-1, 20))) if draw(st.booleans()) else (-1, -1)
    return dict(
        lengths_q=draw(st.lists(st.integers(0, seqlen_q), min_size=batch, max_size=batch)),
        lengths_k=draw(st.lists(st.integers(0, seqlen_k), min_size=batch, max_size=batch)),
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads_k=nheads_k,
        nheads=nheads_k * draw(st.sampled_from([1, 2])),
        headdim=draw(st.sampled_from([16, 40, 64, 128, 256])),
        causal=draw(st.booleans()),
        window=window,
        alibi=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)),
    )


def _check_padded_problem(backend, pb):
    """unpad_input, the packed call, pad_input: against the oracle with the padding masks (padded rows 0)."""
    from tileattn.bert_padding import pad_input, unpad_input

    ctx, device = on(backend)
    batch, sq, sk, h, hk, d = (pb[n] for n in ("lengths_q", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim"))
    batch = len(batch)
    q = randn(batch, sq, h, d, dtype=pb["dtype"], device=device)
    k, v = (randn(batch, sk, hk, d, dtype=pb["dtype"], device=device) for _ in range(2))
    mask_q = torch.arange(sq, device=device)[None] < torch.tensor(pb["lengths_q"], device=device)[:, None]
    mask_k = torch.arange(sk, device=device)[None] < torch.tensor(pb["lengths_k"], device=device)[:, None]
    dout = torch.randn_like(q) * mask_q[..., None, None]  # (padded rows' gradient: none)
    kwargs = dict(causal=pb["causal"], window_size=pb["window"])
    if pb["alibi"]:
        kwargs["alibi_slopes"] = torch.rand(h, device=device)
    with ctx:
        q_u, idx_q, cu_q, max_q = unpad_input(q, mask_q)[:4]
        k_u, idx_k, cu_k, max_k = unpad_input(k, mask_k)[:4]
        v_u = unpad_input(v, mask_k)[0]
        out_u = tileattn.flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, **kwargs)
        out = pad_input(out_u, idx_q, batch, sq)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    # (a window side of at least the call's max_seqlen_k is unbounded: the oracle resolves sides there too)
    ref_kwargs = dict(kwargs, query_padding_mask=mask_q, key_padding_mask=mask_k, window_seqlen_k=int(max_k))
    check_attention(str(pb), out, grads, q, k, v, dout, ref_kwargs)


_PADDED_EXAMPLES = {"torch": 20, "interpret": 12, "cuda": 30}


@pytest.mark.parametrize("shard", range(PROPERTY_SHARDS))
def test_property_random_padded_batches(backend, shard):
    """Padding masks through bert_padding and the packed call, fp16 and bf16, head dims to 256, causal,
    windows and ALiBi."""
    strategy = padded_problems(200 if backend == "cuda" else 24, _dtypes(backend))
    run_property(_check_padded_problem, strategy, _PADDED_EXAMPLES, backend, shard)
