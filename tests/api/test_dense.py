"""flash_attn_func and its packed variants against the tests' oracle (tests/oracle.py), forward and backward, on every
backend (the Triton kernels on the GPU or under the interpreter on CPU, and the CPU path): the features,
softmax scales of 0 and below, rows that see no key, the LSE, calls without gradients, empty and strided
inputs, a deterministic backward, and on the GPU large shapes."""

import pytest
import torch

import oracle
import tileattn
from attention_cases import CASES, _case_id, _run_case
from helpers import check_attention, check_lse, on, randn
from tileattn.testing import check_close

GPU_ONLY_CASES = [
    (2, 1025, 1025, 8, 2, 128, {}),
    (2, 1025, 1025, 8, 8, 128, {"causal": True}),
    (1, 1025, 2047, 4, 1, 64, {"causal": True, "window_size": (256, 0)}),
    (1, 2047, 1025, 8, 2, 256, {"causal": True}),
    (2, 1025, 1025, 4, 4, 96, {"softcap": 30.0, "alibi": "batch"}),
]


DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.gpu_cover(strength=1)  # (each case once on the GPU, fp16 and bf16 in turn: tests/cover.py)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward(backend, case, dtype):
    _run_case(backend, case, dtype)


# A softmax scale of 0 or below: the kernels then scale inside the scores (AttnParams.defer_scale), since
# the row max of the raw products is no longer that of the scaled scores and masked -inf would turn into
# NaN or +inf; with masked tails, causal and a window.
SCALE_CASES = [
    (2, 63, 113, 2, 1, 40, {"softmax_scale": -0.3, "causal": True}),
    (1, 47, 33, 2, 2, 64, {"softmax_scale": 0.0}),
    (1, 33, 47, 2, 1, 32, {"softmax_scale": -0.2, "window_size": (8, 3)}),
    (1, 47, 33, 2, 2, 128, {"softmax_scale": -0.25, "causal": True}),  # (not for sm90's Gluon kernels)
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
        kwargs = {"softmax_scale": scale, "causal": True}
        check_attention(f"decode scale {scale}", out, None, q, k, v, None, kwargs, check_grads=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes run on the GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_ONLY_CASES, ids=_case_id)
def test_forward_backward_large(case, dtype):
    _run_case("cuda", case, dtype)


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_packed(backend, packing):
    ctx, device = on(backend)
    b, s, h, d = 2, 37, 4, 32
    dtype = torch.float16
    if packing == "qkv":
        qkv = randn(b, s, 3, h, d, dtype=dtype, device=device)
        dout = torch.randn(b, s, h, d, dtype=dtype, device=device)
        with ctx:
            out = tileattn.flash_attn_qkvpacked_func(qkv, causal=True)
            (g,) = torch.autograd.grad(out, (qkv,), dout)
        q, k, v = qkv.unbind(2)
        grads = g.unbind(2)
    else:
        q = randn(b, s, h, d, dtype=dtype, device=device)
        kv = randn(b, s + 5, 2, 2, d, dtype=dtype, device=device)
        dout = torch.randn_like(q)
        with ctx:
            out = tileattn.flash_attn_kvpacked_func(q, kv, causal=True)
            dq, dkv = torch.autograd.grad(out, (q, kv), dout)
        k, v = kv.unbind(2)
        grads = (dq, *dkv.unbind(2))
    check_attention(f"{packing}-packed", out, grads, q, k, v, dout, {"causal": True})


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
    """The LSE (natural log, fp32) and S_dmask (the probabilities in flash_attn's blockwise scaling) against
    the oracle's, with rows that see no key (LSE +inf) and GQA."""
    ctx, device = on(backend)
    q = randn(2, 45, 4, 64, dtype=torch.float16, device=device, requires_grad=False)
    k = randn(2, 37, 2, 64, dtype=torch.float16, device=device, requires_grad=False)
    with ctx:  # (S_dmask only with dropout, as in flash_attn: its magnitudes are the probabilities)
        _, lse, probs = tileattn.flash_attn_func(q, k, k, dropout_p=0.25, causal=True, return_attn_probs=True)
    ref = oracle.attention(q, k, k, causal=True)
    lowp = oracle.attention(q, k, k, causal=True, precision=None)
    check_lse("lse", lse, ref.lse, lowp.lse)
    block_n = oracle.flash_attn_block_n(64, True, True, _capability(device))
    unnormalized = oracle.flash_attn_unnormalized
    check_close("probs", probs.abs(), unnormalized(ref.probs, block_n), unnormalized(lowp.probs.float(), block_n))


def _capability(device: str) -> tuple[int, int]:
    return torch.cuda.get_device_capability() if device == "cuda" else (0, 0)


def test_calls_without_gradients(backend):
    """A call that no gradient can reach (no input requires one, or under no_grad / inference_mode) makes no
    autograd node and returns what the grad-tracking call returns, bit for bit; the grad-tracking call
    keeps its node."""
    ctx, device = on(backend)
    q, k, v = (randn(2, 45, 4, 64, dtype=torch.float16, device=device) for _ in range(3))
    with ctx:
        tracked = tileattn.flash_attn_func(*(t.detach().requires_grad_() for t in (q, k, v)), causal=True)
        plain = tileattn.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True)
        with torch.no_grad():
            no_grad = tileattn.flash_attn_func(q, k, v, causal=True)
        with torch.inference_mode():
            inference = tileattn.flash_attn_func(q, k, v, causal=True)
    assert tracked.grad_fn is not None
    for out in (plain, no_grad, inference):
        assert out.grad_fn is None and not out.requires_grad and torch.equal(out, tracked.detach())


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
