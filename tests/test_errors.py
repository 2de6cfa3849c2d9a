"""Bad input is refused with a clear exception naming the argument, before anything runs."""

import pytest
import torch

import tileattn

F16 = torch.float16


def _qkv(b=2, sq=8, sk=8, h=4, hk=2, d=16, dtype=F16):
    return (
        torch.randn(b, sq, h, d, dtype=dtype),
        torch.randn(b, sk, hk, d, dtype=dtype),
        torch.randn(b, sk, hk, d, dtype=dtype),
    )


def _dense(**kw):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update(kw)
    return lambda: tileattn.flash_attn_func(**args)


def _varlen(q_tokens=10, k_tokens=10, cu_q=(0, 4, 10), cu_k=(0, 4, 10), max_q=6, max_k=6, **kw):
    q = torch.randn(q_tokens, 4, 16, dtype=F16)
    k = torch.randn(k_tokens, 2, 16, dtype=F16)
    cq = cu_q if isinstance(cu_q, torch.Tensor) else torch.tensor(cu_q, dtype=torch.int32)
    ck = cu_k if isinstance(cu_k, torch.Tensor) else torch.tensor(cu_k, dtype=torch.int32)
    return lambda: tileattn.flash_attn_varlen_func(q, k, k, cq, ck, max_q, max_k, **kw)


q0, k0, v0 = _qkv()
CASES = [
    # (id, call, exception, words the message must contain)
    ("q-not-tensor", _dense(q=[1, 2]), TypeError, ["q", "torch.Tensor"]),
    ("q-rank3", _dense(q=q0[0]), ValueError, ["q", "4 dims"]),
    ("k-rank5", _dense(k=k0[None]), ValueError, ["k", "4 dims"]),
    ("int-dtype", _dense(q=q0.to(torch.int32)), TypeError, ["q", "float16"]),
    ("float64", _dense(q=q0.double(), k=k0.double(), v=v0.double()), TypeError, ["q", "float16"]),
    ("mixed-dtype", _dense(k=k0.bfloat16()), TypeError, ["k", "dtype"]),
    ("kv-shape", _dense(v=v0[:, :5]), ValueError, ["k and v", "shape"]),
    ("batch-mismatch", _dense(k=k0[:1], v=v0[:1]), ValueError, ["batch"]),
    ("headdim-mismatch", _dense(k=k0[..., :8], v=v0[..., :8]), ValueError, ["head dim"]),
    (
        "gqa-divisible",
        _dense(k=torch.randn(2, 8, 3, 16, dtype=F16), v=torch.randn(2, 8, 3, 16, dtype=F16)),
        ValueError,
        ["nheads", "divisible"],
    ),
    ("zero-heads", _dense(q=torch.randn(2, 8, 0, 16, dtype=F16)), ValueError, ["nheads", "at least 1"]),
    (
        "headdim-257",
        _dense(
            q=torch.randn(1, 4, 1, 257, dtype=F16),
            k=torch.randn(1, 4, 1, 257, dtype=F16),
            v=torch.randn(1, 4, 1, 257, dtype=F16),
        ),
        ValueError,
        ["headdim", "256"],
    ),
    ("last-dim-strided", _dense(q=torch.randn(2, 8, 4, 32, dtype=F16)[..., ::2]), ValueError, ["q", "contiguous"]),
    ("dropout-1", _dense(dropout_p=1.0), ValueError, ["dropout_p", "[0, 1)"]),
    ("dropout-neg", _dense(dropout_p=-0.1), ValueError, ["dropout_p"]),
    ("dropout-str", _dense(dropout_p="0.1"), ValueError, ["dropout_p"]),
    ("scale-str", _dense(softmax_scale="x"), TypeError, ["softmax_scale"]),
    ("scale-nan", _dense(softmax_scale=float("nan")), TypeError, ["softmax_scale"]),
    ("window-int", _dense(window_size=3), ValueError, ["window_size", "pair"]),
    ("window-triple", _dense(window_size=(1, 2, 3)), ValueError, ["window_size", "pair"]),
    ("window-float", _dense(window_size=(1.5, 2)), ValueError, ["window_size"]),
    ("window-below", _dense(window_size=(-2, 0)), ValueError, ["window_size", ">= -1"]),
    ("softcap-neg", _dense(softcap=-1.0), ValueError, ["softcap", ">= 0"]),
    ("causal-str", _dense(causal="yes"), TypeError, ["causal", "bool"]),
    ("alibi-shape", _dense(alibi_slopes=torch.rand(3)), ValueError, ["alibi_slopes", "shape"]),
    ("alibi-dtype", _dense(alibi_slopes=torch.rand(4, dtype=F16)), TypeError, ["alibi_slopes", "float32"]),
    ("alibi-list", _dense(alibi_slopes=[0.1] * 4), TypeError, ["alibi_slopes"]),
    (
        "qkv-packed-shape",
        lambda: tileattn.flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 8, dtype=F16)),
        ValueError,
        ["qkv", "3"],
    ),
    (
        "kv-packed-shape",
        lambda: tileattn.flash_attn_kvpacked_func(q0, torch.randn(2, 8, 3, 2, 16, dtype=F16)),
        ValueError,
        ["kv", "2"],
    ),
    ("cu-int64", _varlen(cu_q=torch.tensor([0, 4, 10])), TypeError, ["cu_seqlens_q", "int32"]),
    ("cu-2d", _varlen(cu_q=torch.tensor([[0, 4, 10]], dtype=torch.int32)), ValueError, ["cu_seqlens_q", "1-D"]),
    ("cu-start", _varlen(cu_q=(1, 4, 10)), ValueError, ["cu_seqlens_q", "start at 0"]),
    ("cu-decreasing", _varlen(cu_k=(0, 6, 4, 10), cu_q=(0, 4, 4, 10)), ValueError, ["cu_seqlens_k", "non-decreasing"]),
    ("cu-last", _varlen(cu_q=(0, 4, 9)), ValueError, ["cu_seqlens_q", "number of tokens"]),
    ("cu-batch", _varlen(cu_k=(0, 10), max_k=10), ValueError, ["same batch"]),
    ("max-seqlen-small", _varlen(max_q=5), ValueError, ["max_seqlen_q", "longest"]),
    ("max-seqlen-float", _varlen(max_k=6.0), TypeError, ["max_seqlen_k", "int"]),
    (
        "varlen-rank",
        lambda: tileattn.flash_attn_varlen_func(
            q0, k0, v0, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 1, 1
        ),
        ValueError,
        ["q", "3 dims"],
    ),
    ("block-table", _varlen(block_table=torch.zeros(2, 1, dtype=torch.int32)), NotImplementedError, ["block_table"]),
    ("alibi-batch-varlen", _varlen(alibi_slopes=torch.rand(3, 4)), ValueError, ["alibi_slopes", "(2, 4)"]),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value), f"message {str(info.value)!r} does not mention {word!r}"


def test_mixed_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU for a second device")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="device"):
        tileattn.flash_attn_func(q.cuda(), k, v.cuda())


def test_cu_seqlens_on_another_device():
    """cu_seqlens must live with q (meta tensors stand in for a second device, costing nothing)."""
    q = torch.empty(10, 4, 16, dtype=F16, device="meta")
    k = torch.empty(10, 2, 16, dtype=F16, device="meta")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q is on cpu but q is on meta"):
        tileattn.flash_attn_varlen_func(q, k, k, cu, cu, 6, 6)


def test_batch_limits():
    q = torch.empty(70000, 2, 1, 16, dtype=F16, device="meta")
    with pytest.raises(NotImplementedError, match="batch 70000 is above 65535"):
        tileattn.flash_attn_func(q, q, q)
    cu = torch.arange(0, 3000, dtype=torch.int32)
    q = torch.zeros(2999, 1, 16, dtype=F16)
    with pytest.raises(NotImplementedError, match="2999 sequences"):
        tileattn.flash_attn_varlen_func(q, q, q, cu, cu, 1, 1)


def test_cuda_float32_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    q, k, v = (t.float().cuda() for t in _qkv())
    with pytest.raises(TypeError, match="CUDA"):
        tileattn.flash_attn_func(q, k, v)


def test_sequence_past_int32_offsets_is_refused():
    """A single sequence whose rows span 2**31 elements is refused before anything runs (meta tensors
    cost no memory)."""
    q = torch.empty(1, 2**18, 2**7, 64, dtype=F16, device="meta")
    k = torch.empty(1, 2**18, 1, 64, dtype=F16, device="meta")
    with pytest.raises(NotImplementedError, match="q: one sequence spans"):
        tileattn.flash_attn_func(q, k, k)


def test_rejected_call_leaves_inputs_unchanged():
    q, k, v = _qkv()
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(ValueError):
        tileattn.flash_attn_func(q, k, v, window_size=(-3, 0))
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
