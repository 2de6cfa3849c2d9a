"""Dropout through the public API: the backward agrees with a reference built from the mask the call
returns (S_dmask), the rate is the requested one, torch.manual_seed reproduces it, and CUDA graph capture
refuses it."""

import pytest
import torch

import dropout_ref
import tileattn
from helpers import check_attention, interpreter_skips, on, randn


@pytest.mark.parametrize("feats", [{}, {"causal": True}, {"window_size": (10, 4), "softcap": 3.0}], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dropout_matches_masked_reference(backend, feats, dtype):
    interpreter_skips(backend, dtype)
    ctx, device = on(backend)
    b, sq, sk, h, hk, d = 2, 47, 71, 4, 2, 40
    p = 0.17
    q = randn(b, sq, h, d, dtype=dtype, device=device)
    k = randn(b, sk, hk, d, dtype=dtype, device=device)
    v = randn(b, sk, hk, d, dtype=dtype, device=device)
    dout = torch.randn_like(q)
    with ctx:
        out, _, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **feats)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = s_dmask >= 0
    check_attention("dropout", out, grads, q, k, v, dout, dict(feats, dropout_p=p, dropout_mask=keep))


def test_dropout_mask_is_the_documented_one(backend):
    """The mask a call draws is the definition's (``dropout_ref``: Philox at each element's documented
    offset, the seed the next 62-bit draw of PyTorch's CPU generator), dense and packed (sequence b
    numbered as batch entry b, its rows and keys from 0, padded to the longest)."""
    ctx, device = on(backend)
    p = 0.17
    q = torch.randn(2, 45, 3, 16, dtype=torch.float16, device=device)
    k = torch.randn(2, 70, 3, 16, dtype=torch.float16, device=device)
    with ctx:
        torch.manual_seed(5)
        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
        torch.manual_seed(5)
        _, _, s_dmask = tileattn.flash_attn_func(q, k, k, dropout_p=p, return_attn_probs=True)
        lens_q, lens_k = [45, 1, 20], [70, 9, 33]
        cu_q, cu_k = ([0, *torch.tensor(n).cumsum(0).tolist()] for n in (lens_q, lens_k))
        qp = torch.randn(sum(lens_q), 3, 16, dtype=torch.float16, device=device)
        kp = torch.randn(sum(lens_k), 3, 16, dtype=torch.float16, device=device)
        torch.manual_seed(6)
        seed_packed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
        torch.manual_seed(6)
        cu_q_t, cu_k_t = (torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k))
        _, _, s_packed = tileattn.flash_attn_varlen_func(
            qp, kp, kp, cu_q_t, cu_k_t, 45, 70, dropout_p=p, return_attn_probs=True
        )
    assert torch.equal((s_dmask >= 0).cpu(), dropout_ref.keep_mask(seed, p, 2, 3, 45, 70))
    want = dropout_ref.keep_mask(seed_packed, p, 3, 3, 45, 70)
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        got = (s_packed[b, :, :n_q, :n_k] >= 0).cpu()
        assert torch.equal(got, want[b, :, :n_q, :n_k]), f"sequence {b}"


def test_dropout_rate_and_reproducibility(backend):
    ctx, device = on(backend)
    q = randn(2, 64, 4, 32, dtype=torch.float16, device=device, requires_grad=False)
    p = 0.3
    with ctx:
        torch.manual_seed(123)
        out1, _, s1 = tileattn.flash_attn_func(q, q, q, dropout_p=p, return_attn_probs=True)
        torch.manual_seed(123)
        out2, _, s2 = tileattn.flash_attn_func(q, q, q, dropout_p=p, return_attn_probs=True)
        out3 = tileattn.flash_attn_func(q, q, q, dropout_p=p)
    assert torch.equal(out1, out2) and torch.equal(s1, s2)
    assert not torch.equal(out1, out3)
    dropped = (s1 < 0).float().mean().item()
    n = s1.numel()
    assert abs(dropped - p) < 5 * (p * (1 - p) / n) ** 0.5, f"dropped fraction {dropped:.4f}, expected {p}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs run on the GPU")
def test_dropout_under_graph_capture_is_refused():
    """The dropout seed is drawn on the host, so a captured call would replay one mask: capture refuses
    dropout (and nothing else: the same call without dropout captures and replays)."""
    q, k, v = (torch.randn(1, 64, 2, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    tileattn.flash_attn_func(q, k, v, dropout_p=0.1)  # (warm: compiled outside the capture)
    tileattn.flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(NotImplementedError, match="CUDA graph capture"), torch.cuda.graph(graph):
        tileattn.flash_attn_func(q, k, v, dropout_p=0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileattn.flash_attn_func(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, tileattn.flash_attn_func(q, k, v))
