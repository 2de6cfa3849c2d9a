"""Dropout: the kernels draw exactly the Philox mask of tileattn.rng, at the requested rate, the
backward agrees with a reference built from that same mask, and torch.manual_seed reproduces it."""

import pytest
import torch

import tileattn
from helpers import builds, check_attention, interpreter_skips, on, randn
from tileattn import rng
from tileattn.kernels import common  # noqa: F401  (used by a kernel defined in a test)


def test_philox_replica_matches_triton():
    """tileattn.rng reproduces tl.rand bit for bit (checked through the interpreter on CPU, or on GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rand(Out, seed, base, BLOCK: tl.constexpr):
        offs = base + tl.arange(0, BLOCK).to(tl.int64)
        tl.store(Out + tl.arange(0, BLOCK), tl.rand(seed, offs))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(64, device=device)
    seed, base = 0x1234_5678_9ABC, 3 * 2**32 + 17
    _rand[(1,)](out, seed, base, BLOCK=64)
    expected = rng.philox_uniform(seed, torch.arange(64, dtype=torch.int64) + base)
    assert torch.equal(out.cpu(), expected)


def test_grouped_dropout_bits_match_the_replica():
    """The kernels' keep-mask helper (16 columns per Philox draw, 8 bits each) equals
    tileattn.rng.dropout_keep element for element, at an unaligned row, a later column block and a
    key length that is not a multiple of 64."""
    import triton
    import triton.language as tl

    @triton.jit
    def _keep(Out, seed, base, row_groups, p, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_m = 3 + tl.arange(0, BLOCK_M)
        keep = common.dropout_keep(seed, base, offs_m, start_n, row_groups, p, BLOCK_M, BLOCK_N)
        tl.store(Out + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], keep.to(tl.int32))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.zeros(16, 128, dtype=torch.int32, device=device)
    seed, sq, sk, nheads, b, h = 0x1234_5678_9ABC, 40, 300, 3, 1, 2
    row_groups = 4 * ((sk + 63) // 64)
    p = rng.quantize_dropout_p(0.37)
    _keep[(1,)](out, seed, (b * nheads + h) * sq * row_groups, row_groups, p, 64, BLOCK_M=16, BLOCK_N=128)
    i, j = (3 + torch.arange(16)).view(-1, 1), (64 + torch.arange(128)).view(1, -1)
    expected = rng.dropout_keep(seed, rng.dropout_offsets(b, h, i, j, nheads, sq, sk), p)
    assert torch.equal(out.cpu().bool(), expected)
    assert p == 95 / 256 and rng.quantize_dropout_p(0.9999999) == 255 / 256


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
