"""flash_attn semantics that code written for flash_attn relies on: ``return_attn_probs`` without dropout
materialises nothing (S_dmask is empty, as flash_attn returns it); a last dimension that is not
contiguous is copied (and refused where a copy would hide an in-place write); ``window_size`` as any pair
of integers (tensors, NumPy); argument errors that flash_attn raises as RuntimeError are RuntimeErrors
here too (``tileattn.InvalidArgument``); paged K/V is forward only, as in flash_attn."""

import numpy as np
import pytest
import torch

import oracle
import tileattn
from helpers import check_lse, on
from tileattn.modules import FlashSelfAttention
from tileattn.testing import check_close

F16 = torch.float16
I32 = torch.int32


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=I32, device=device)


# --------------------------------------------------------------------------------------------------
# return_attn_probs
# --------------------------------------------------------------------------------------------------


def _calls(device):
    """(name, call) for every public function that takes return_attn_probs, each on small inputs."""
    q = torch.randn(2, 13, 4, 16, dtype=F16, device=device)
    k = torch.randn(2, 17, 2, 16, dtype=F16, device=device)
    qkv = torch.randn(2, 13, 3, 4, 16, dtype=F16, device=device)
    kv = torch.randn(2, 17, 2, 2, 16, dtype=F16, device=device)
    cu_q, cu_k = _cu([5, 8], device), _cu([9, 8], device)
    pool = torch.randn(6, 4, 2, 16, dtype=F16, device=device)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=I32, device=device)
    return [
        ("dense", lambda **kw: tileattn.flash_attn_func(q, k, k, **kw)),
        ("qkvpacked", lambda **kw: tileattn.flash_attn_qkvpacked_func(qkv, **kw)),
        ("kvpacked", lambda **kw: tileattn.flash_attn_kvpacked_func(q, kv, **kw)),
        ("varlen", lambda **kw: tileattn.flash_attn_varlen_func(q[0], k[0], k[0], cu_q, cu_k, 8, 9, **kw)),
        ("varlen-qkvpacked", lambda **kw: tileattn.flash_attn_varlen_qkvpacked_func(qkv[0], cu_q, 8, **kw)),
        (
            "varlen-kvpacked",
            lambda **kw: tileattn.flash_attn_varlen_kvpacked_func(q[0], kv[0], cu_q, cu_k, 8, 9, **kw),
        ),
        (
            "paged",
            lambda **kw: tileattn.flash_attn_varlen_func(q[0], pool, pool, cu_q, cu_k, 8, 9, block_table=table, **kw),
        ),
    ]


def test_return_attn_probs_without_dropout_materialises_nothing(backend, monkeypatch):
    """S_dmask is an empty tensor of the inputs' dtype (flash_attn's ``torch.empty(0)``), the N×N
    probabilities are never built, and out and softmax_lse are those of the plain call."""
    ctx, device = on(backend)

    def refuse(*args):
        raise AssertionError("S_dmask was materialised without dropout")

    monkeypatch.setattr(tileattn.ops.attention, "attn_probs", refuse)
    with ctx:
        results = [
            (name, call(causal=True, return_attn_probs=True), call(causal=True)) for name, call in _calls(device)
        ]
    for name, (out, lse, s_dmask), plain in results:
        assert s_dmask.shape == (0,) and s_dmask.dtype == F16 and s_dmask.device == out.device, name
        assert lse.dtype == torch.float32, name
        assert torch.equal(out, plain), name


def test_return_attn_probs_lse(backend):
    ctx, device = on(backend)
    q = torch.randn(2, 13, 4, 16, dtype=F16, device=device)
    k = torch.randn(2, 17, 2, 16, dtype=F16, device=device)
    with ctx:
        _, lse, _ = tileattn.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
        cu_q, cu_k = _cu([13], device), _cu([17], device)
        _, lse_varlen, _ = tileattn.flash_attn_varlen_func(
            q[0], k[0], k[0], cu_q, cu_k, 13, 17, causal=True, return_attn_probs=True
        )
        pool = k[0].reshape(17, 1, 2, 16)  # pages of one key
        table = torch.arange(17, dtype=I32, device=device).view(1, 17)
        _, lse_paged, _ = tileattn.flash_attn_varlen_func(
            q[0], pool, pool, cu_q, cu_k, 13, 17, causal=True, block_table=table, return_attn_probs=True
        )
    ref, lowp = (oracle.attention(q, k, k, causal=True, precision=p).lse for p in (torch.float64, None))
    check_lse("lse", lse, ref, lowp.float())
    check_lse("varlen lse", lse_varlen, ref[0], lowp[0].float())
    check_lse("paged lse", lse_paged, ref[0], lowp[0].float())


@pytest.mark.parametrize("seqlen_k, headdim, causal", [(13, 16, False), (300, 64, True), (130, 96, False)])
def test_return_attn_probs_with_dropout_keeps_s_dmask(backend, seqlen_k, headdim, causal):
    """S_dmask in flash_attn's scaling (what its tests' normalize_flash_attn_S undoes): per key block of
    flash_attn's size (128 columns at head dim 16; 64 at 64 and 96 with dropout), the weights before
    normalisation, exp(s - m) with m the running max from the last block back to this one; negated where
    dropped. Against the oracle's probabilities so scaled; with several blocks, causal and not."""
    ctx, device = on(backend)
    q = torch.randn(2, 37, 4, headdim, dtype=F16, device=device)
    k = torch.randn(2, seqlen_k, 2, headdim, dtype=F16, device=device)
    with ctx:
        out, lse, s_dmask = tileattn.flash_attn_func(q, k, k, dropout_p=0.3, causal=causal, return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 37, seqlen_k) and s_dmask.dtype == torch.float32
    assert (s_dmask < 0).any() and (s_dmask > 0).any()
    block_n = oracle.flash_attn_block_n(headdim, True, causal, (0, 0))
    ref = oracle.flash_attn_unnormalized(oracle.attention(q, k, k, causal=causal).probs, block_n)
    lowp = oracle.flash_attn_unnormalized(
        oracle.attention(q, k, k, causal=causal, precision=None).probs.float(), block_n
    )
    check_close("S_dmask", s_dmask.abs(), ref, lowp)


# --------------------------------------------------------------------------------------------------
# A last dimension that is not contiguous
# --------------------------------------------------------------------------------------------------


def _strided(*shape, device):
    """A tensor of ``shape`` whose last dimension has stride 2, and its contiguous copy."""
    base = torch.randn(*shape[:-1], 2 * shape[-1], dtype=F16, device=device)
    t = base[..., ::2]
    assert t.stride(-1) == 2
    return t, t.contiguous()


def test_strided_last_dim_is_copied(backend):
    """Non-contiguous q, k, v give the results of their contiguous copies; gradients reach them."""
    ctx, device = on(backend)
    (q, q_c), (k, k_c), (v, v_c) = (_strided(2, 11, 4, 16, device=device) for _ in range(3))
    for t in (q, k, v, q_c, k_c, v_c):
        t.requires_grad_()
    dout = torch.randn(2, 11, 4, 16, dtype=F16, device=device)
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, causal=True)
        expected = tileattn.flash_attn_func(q_c, k_c, v_c, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        expected_grads = torch.autograd.grad(expected, (q_c, k_c, v_c), dout)
        cu = _cu([4, 7], device)
        out_varlen = tileattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 7, 7)
        expected_varlen = tileattn.flash_attn_varlen_func(q_c[0], k_c[0], v_c[0], cu, cu, 7, 7)
    assert torch.equal(out, expected) and torch.equal(out_varlen, expected_varlen)
    for g, e in zip(grads, expected_grads):
        assert torch.equal(g, e)


def test_kvcache_copies_read_tensors_and_refuses_strided_caches(backend):
    """flash_attn_with_kvcache: q and the new k, v are copied if need be; the caches, written in place,
    must be contiguous in their last dimension (a copy would hide the write), as flash_attn asserts."""
    ctx, device = on(backend)
    q, q_c = _strided(2, 1, 4, 16, device=device)
    k, k_c = _strided(2, 1, 2, 16, device=device)
    v, v_c = _strided(2, 1, 2, 16, device=device)
    k_cache = torch.randn(2, 10, 2, 16, dtype=F16, device=device)
    v_cache = torch.randn(2, 10, 2, 16, dtype=F16, device=device)
    seqlens = torch.tensor([3, 7], dtype=I32, device=device)
    caches = [k_cache.clone(), v_cache.clone()]
    strided_cache, _ = _strided(2, 10, 2, 16, device=device)
    before = strided_cache.clone()
    with ctx:
        out = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
        expected = tileattn.flash_attn_with_kvcache(q_c, *caches, k_c, v_c, cache_seqlens=seqlens)
        with pytest.raises(tileattn.InvalidArgument, match="k_cache is written in place and must be contiguous"):
            tileattn.flash_attn_with_kvcache(q, strided_cache, v_cache, k, v, cache_seqlens=seqlens)
    assert torch.equal(out, expected)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    assert torch.equal(k_cache[1, 7], k_c[1, 0])
    assert torch.equal(strided_cache, before)


# --------------------------------------------------------------------------------------------------
# window_size: any pair of integers
# --------------------------------------------------------------------------------------------------

WINDOWS = [
    pytest.param((torch.tensor(5), torch.tensor(2)), id="0d-tensors"),
    pytest.param(torch.tensor([5, 2]), id="1d-tensor"),
    pytest.param(torch.tensor([5, 2], dtype=I32), id="1d-int32"),
    pytest.param(np.array([5, 2]), id="numpy-array"),
    pytest.param((np.int64(5), np.int32(2)), id="numpy-ints"),
    pytest.param([5, 2], id="list"),
]


@pytest.mark.parametrize("window", WINDOWS)
def test_window_size_as_any_pair_of_integers(backend, window):
    ctx, device = on(backend)
    q = torch.randn(2, 13, 4, 16, dtype=F16, device=device)
    k = torch.randn(2, 13, 2, 16, dtype=F16, device=device)
    cu = _cu([6, 7], device)
    cache = torch.randn(2, 13, 2, 16, dtype=F16, device=device)
    qkv = torch.randn(2, 13, 3, 4, 16, dtype=F16, device=device)
    with ctx:
        calls = [
            lambda w: tileattn.flash_attn_func(q, k, k, window_size=w),
            lambda w: tileattn.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 7, 7, window_size=w),
            lambda w: tileattn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=9, window_size=w),
            lambda w: FlashSelfAttention(window_size=w)(qkv),
        ]
        for call in calls:
            assert torch.equal(call(window), call((5, 2)))
            assert not torch.equal(call((5, 2)), call((-1, -1)))  # (the window hides keys here)


def test_window_drawn_as_flash_attns_tests_draw_it():
    """flash_attn's tests: ``window_size = torch.randint(0, seqlen_k, (2,))``."""
    q = torch.randn(1, 20, 2, 16, dtype=F16)
    for _ in range(3):
        window = torch.randint(0, 20, (2,))
        out = tileattn.flash_attn_func(q, q, q, window_size=window)
        assert torch.equal(out, tileattn.flash_attn_func(q, q, q, window_size=tuple(window.tolist())))


@pytest.mark.parametrize(
    "window",
    [
        pytest.param(torch.tensor([5.0, 2.0]), id="float-tensor"),
        pytest.param((1.5, 2), id="float"),
        pytest.param(torch.tensor([1, 2, 3]), id="three"),
        pytest.param(torch.tensor([[1, 2]]), id="2d"),
        pytest.param(torch.tensor([True, False]), id="bool-tensor"),
        pytest.param((True, -1), id="bool"),
        pytest.param(np.array([1.0, 2.0]), id="numpy-float"),
        pytest.param((torch.tensor([1]), 2), id="1d-side"),
        pytest.param("ab", id="str"),
        pytest.param(3, id="int"),
    ],
)
def test_window_size_refusals(window):
    q = torch.randn(1, 8, 2, 16, dtype=F16)
    cache = torch.randn(1, 8, 2, 16, dtype=F16)
    with pytest.raises(tileattn.InvalidArgument, match="window_size must be a pair of ints"):
        tileattn.flash_attn_func(q, q, q, window_size=window)
    with pytest.raises(tileattn.InvalidArgument, match="window_size must be a pair of ints"):
        tileattn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=4, window_size=window)


# --------------------------------------------------------------------------------------------------
# Errors: RuntimeError where flash_attn raises one
# --------------------------------------------------------------------------------------------------


def test_invalid_argument_is_value_error_and_runtime_error():
    assert issubclass(tileattn.InvalidArgument, ValueError) and issubclass(tileattn.InvalidArgument, RuntimeError)
    assert issubclass(tileattn.InvalidArgumentType, tileattn.InvalidArgument)
    assert issubclass(tileattn.InvalidArgumentType, TypeError)


def _raises(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


def test_flash_attn_runtime_errors_are_runtime_errors():
    """Calls flash_attn refuses with a RuntimeError (its C++ TORCH_CHECKs) raise one here too, while
    staying the ValueError / TypeError they were."""
    q = torch.randn(1, 8, 2, 16, dtype=F16)
    cases = {
        "dtype": (lambda: tileattn.flash_attn_func(q.to(torch.int32), q, q), TypeError),
        "mixed dtype": (lambda: tileattn.flash_attn_func(q, q.bfloat16(), q), TypeError),
        "head dim": (lambda: tileattn.flash_attn_func(*(torch.randn(1, 4, 1, 264, dtype=F16),) * 3), ValueError),
        "shape": (lambda: tileattn.flash_attn_func(q, q[:, :4], q), ValueError),
        "gqa": (lambda: tileattn.flash_attn_func(torch.randn(1, 8, 3, 16, dtype=F16), q, q), ValueError),
        "cu_seqlens dtype": (
            lambda: tileattn.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8]), _cu([8]), 8, 8),
            TypeError,
        ),
        "cu_seqlens values": (
            lambda: tileattn.flash_attn_varlen_func(q[0], q[0], q[0], _cu([9]), _cu([8]), 9, 8),
            ValueError,
        ),  # fmt: skip
        "cache past its block table": (
            lambda: tileattn.flash_attn_with_kvcache(
                q[:, :1],
                torch.randn(4, 4, 2, 16, dtype=F16),
                torch.randn(4, 4, 2, 16, dtype=F16),
                q[:, :1],
                q[:, :1],
                cache_seqlens=torch.tensor([8], dtype=I32),
                block_table=torch.tensor([[0, 1]], dtype=I32),
            ),
            ValueError,
        ),
    }
    for name, (call, kind) in cases.items():
        error = _raises(call)
        assert isinstance(error, RuntimeError) and isinstance(error, kind), f"{name}: {type(error)} {error}"
        assert isinstance(error, tileattn.InvalidArgument), name


# --------------------------------------------------------------------------------------------------
# Paged K/V: forward only, as flash_attn
# --------------------------------------------------------------------------------------------------


def test_paged_varlen_backward_refused_as_in_flash_attn():
    """flash_attn 2.8.3's varlen backward (mha_varlen_bwd) takes no block_table, so FlashAttnVarlenFunc
    cannot differentiate a paged call, but runs its forward; tileattn runs the forward too (the same
    output as under no_grad) and refuses the backward with a message that says so."""
    q = torch.randn(4, 2, 16, dtype=F16, requires_grad=True)
    pool = torch.randn(2, 4, 2, 16, dtype=F16)
    cu = _cu([4])
    table = torch.tensor([[0]], dtype=I32)
    out = tileattn.flash_attn_varlen_func(q, pool, pool, cu, cu, 4, 4, block_table=table)
    with torch.no_grad():
        plain = tileattn.flash_attn_varlen_func(q, pool, pool, cu, cu, 4, 4, block_table=table)
    assert out.shape == q.shape and torch.equal(out.detach(), plain) and not plain.requires_grad
    with pytest.raises(NotImplementedError, match="block_table .*no backward.*flash_attn 2.8.3"):
        out.sum().backward()
