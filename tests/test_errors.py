"""Bad input is refused with a clear exception naming the argument, before anything runs."""

import pytest
import torch

import tileattn
from tileattn.bert_padding import unpad_input
from tileattn.cache import PagedKVCache
from tileattn.modules import MHA
from tileattn.rotary import apply_rotary_emb

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
    (
        "dropout-below-resolution",
        _dense(dropout_p=0.001),
        ValueError,
        ["dropout_p=0.001", "rounds to 0", "more than 1/512"],
    ),
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
    ("block-table-unpaged-k", _varlen(block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError, ["k", "paged"]),
    ("alibi-batch-varlen", _varlen(alibi_slopes=torch.rand(3, 4)), ValueError, ["alibi_slopes", "(2, 4)"]),
    # modules, rotary, padding helpers and the cache manager
    ("mha-embed-heads", lambda: MHA(60, 8), ValueError, ["embed_dim", "divisible by num_heads"]),
    ("mha-kv-heads", lambda: MHA(64, 4, num_heads_kv=3), ValueError, ["num_heads_kv"]),
    ("mha-rotary-odd", lambda: MHA(64, 4, rotary_emb_dim=5), ValueError, ["rotary_emb_dim", "even"]),
    ("mha-x-embed", lambda: MHA(64, 4)(torch.randn(2, 5, 32)), ValueError, ["x", "embed_dim=64"]),
    ("mha-x-rank", lambda: MHA(64, 4)(torch.randn(5, 64)), ValueError, ["x", "(batch, seqlen, embed_dim)"]),
    (
        "mha-padding-mask",
        lambda: MHA(64, 4)(torch.randn(2, 5, 64), key_padding_mask=torch.ones(2, 4, dtype=torch.bool)),
        ValueError,
        ["key_padding_mask", "(2, 5)"],
    ),
    (
        "mha-packed-max-seqlen",
        lambda: MHA(64, 4)(torch.randn(5, 64), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)),
        ValueError,
        ["max_seqlen"],
    ),
    (
        "rotary-table-short",
        lambda: apply_rotary_emb(q0, torch.ones(4, 8), torch.zeros(4, 8)),
        ValueError,
        ["cos/sin", "positions"],
    ),
    (
        "rotary-dim-too-big",
        lambda: apply_rotary_emb(q0, torch.ones(8, 9), torch.zeros(8, 9)),
        ValueError,
        ["rotary_dim", "head dim"],
    ),
    (
        "rotary-offsets-shape",
        lambda: apply_rotary_emb(q0, torch.ones(16, 8), torch.zeros(16, 8), seqlen_offsets=torch.zeros(3)),
        ValueError,
        ["seqlen_offsets", "(2,)"],
    ),
    (
        "unpad-mask-shape",
        lambda: unpad_input(torch.randn(2, 5, 8), torch.ones(2, 4, dtype=torch.bool)),
        ValueError,
        ["attention_mask", "(2, 5)"],
    ),
    ("cache-page-size", lambda: PagedKVCache(1, 4, 0, 2, 16), ValueError, ["page_size", "positive int"]),
    ("cache-unknown-seq", lambda: PagedKVCache(1, 4, 16, 2, 16).append([7], [1]), KeyError, ["unknown sequence"]),
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


# --------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: every rejected call leaves both caches bit-for-bit unchanged.
# --------------------------------------------------------------------------------------------------


def _kvcache_inputs(paged=False):
    q = torch.randn(2, 1, 4, 16, dtype=F16)
    if paged:
        kc = torch.randn(6, 4, 2, 16, dtype=F16)
    else:
        kc = torch.randn(2, 12, 2, 16, dtype=F16)
    new = torch.randn(2, 1, 2, 16, dtype=F16)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    angle = torch.rand(12, 8)
    return dict(
        q=q,
        k_cache=kc,
        v_cache=kc.clone(),
        k=new,
        v=new.clone(),
        cache_seqlens=torch.tensor([3, 11], dtype=torch.int32),
        block_table=table if paged else None,
        rotary_cos=angle.cos().to(F16),
        rotary_sin=angle.sin().to(F16),
    )


I32 = torch.int32
KVCACHE_CASES = [
    (
        "seqlens-past-capacity",
        {"cache_seqlens": torch.tensor([3, 12], dtype=I32)},
        False,
        ValueError,
        ["cache_seqlens[1]", "capacity 12"],
    ),
    (
        "seqlens-negative",
        {"cache_seqlens": torch.tensor([-1, 2], dtype=I32)},
        False,
        ValueError,
        ["cache_seqlens", ">= 0"],
    ),
    ("seqlens-int-negative", {"cache_seqlens": -1}, False, ValueError, ["cache_seqlens", "[0, 12]"]),
    ("seqlens-int-huge", {"cache_seqlens": 2**40}, False, ValueError, ["cache_seqlens", "capacity"]),
    ("seqlens-int64", {"cache_seqlens": torch.tensor([3, 4])}, False, TypeError, ["cache_seqlens", "int32"]),
    ("seqlens-shape", {"cache_seqlens": torch.tensor([3], dtype=I32)}, False, ValueError, ["cache_seqlens", "(2,)"]),
    ("seqlens-missing", {"cache_seqlens": None}, False, ValueError, ["cache_seqlens", "required"]),
    ("k-without-v", {"v": None}, False, ValueError, ["k and v", "together"]),
    ("k-shape", {"k": torch.randn(2, 1, 1, 16, dtype=F16)}, False, ValueError, ["k must have shape"]),
    ("k-dtype", {"k": torch.randn(2, 1, 2, 16, dtype=torch.bfloat16)}, False, TypeError, ["k", "dtype"]),
    (
        "cache-shapes",
        {"v_cache": torch.randn(2, 10, 2, 16, dtype=F16)},
        False,
        ValueError,
        ["k_cache and v_cache", "shape"],
    ),
    ("cache-rank", {"k_cache": torch.randn(2, 12, 32, dtype=F16)}, False, ValueError, ["k_cache", "4 dims"]),
    (
        "cache-headdim",
        {"k_cache": torch.randn(2, 12, 2, 8, dtype=F16), "v_cache": torch.randn(2, 12, 2, 8, dtype=F16)},
        False,
        ValueError,
        ["head dim"],
    ),
    (
        "table-out-of-range",
        {"block_table": torch.tensor([[0, 1, 2], [3, 4, 9]], dtype=I32)},
        True,
        ValueError,
        ["block_table[1, 2]", "[0, 6)"],
    ),
    (
        "table-negative",
        {"block_table": torch.tensor([[-1, 1, 2], [3, 4, 5]], dtype=I32)},
        True,
        ValueError,
        ["block_table[0, 0]"],
    ),
    ("table-int64", {"block_table": torch.tensor([[0, 1, 2], [3, 4, 5]])}, True, TypeError, ["block_table", "int32"]),
    ("table-rank", {"block_table": torch.tensor([0, 1, 2], dtype=I32)}, True, ValueError, ["block_table", "2-D"]),
    ("table-batch", {"block_table": torch.tensor([[0, 1, 2]], dtype=I32)}, True, ValueError, ["block_table", "shape"]),
    (
        "table-and-batch-idx",
        {"cache_batch_idx": torch.tensor([0, 1], dtype=I32)},
        True,
        ValueError,
        ["cache_batch_idx", "block_table"],
    ),
    (
        "batch-idx-range",
        {"cache_batch_idx": torch.tensor([0, 2], dtype=I32)},
        False,
        ValueError,
        ["cache_batch_idx", "[0, 2)"],
    ),
    (
        "batch-idx-repeated",
        {"cache_batch_idx": torch.tensor([1, 1], dtype=I32)},
        False,
        ValueError,
        ["cache_batch_idx[1] = 1", "repeats", "new k and v"],
    ),
    (
        "leftpad-past-seqlens",
        {"cache_leftpad": torch.tensor([4, 0], dtype=I32)},
        False,
        ValueError,
        ["cache_leftpad", "[0, cache_seqlens]"],
    ),
    (
        "rotary-empty",
        {"rotary_cos": torch.rand(0, 8).half(), "rotary_sin": torch.rand(0, 8).half()},
        False,
        ValueError,
        ["rotary_cos", "no rows"],
    ),
    (
        "rotary-too-short",
        {"rotary_cos": torch.rand(11, 8).half(), "rotary_sin": torch.rand(11, 8).half()},
        False,
        ValueError,
        ["rotary_cos", "11 positions", "position 11"],
    ),
    (
        "rotary-too-wide",
        {"rotary_cos": torch.rand(12, 9).half(), "rotary_sin": torch.rand(12, 9).half()},
        False,
        ValueError,
        ["rotary_dim", "18", "head dim"],
    ),
    ("rotary-shapes", {"rotary_sin": torch.rand(12, 4).half()}, False, ValueError, ["rotary_cos and rotary_sin"]),
    ("rotary-1d", {"rotary_cos": torch.rand(12).half()}, False, ValueError, ["rotary_cos", "2-D"]),
    ("rotary-alone", {"rotary_sin": None}, False, ValueError, ["rotary_cos and rotary_sin", "together"]),
    ("rotary-without-new", {"k": None, "v": None}, False, ValueError, ["rotary", "pass k and v"]),
    ("num-splits", {"num_splits": -1}, False, ValueError, ["num_splits", ">= 0"]),
    ("window", {"window_size": (2,)}, False, ValueError, ["window_size"]),
    ("softcap", {"softcap": -1.0}, False, ValueError, ["softcap"]),
    ("alibi-shape", {"alibi_slopes": torch.rand(3)}, False, ValueError, ["alibi_slopes", "shape"]),
    ("lse-flag", {"return_softmax_lse": 1}, False, TypeError, ["return_softmax_lse", "bool"]),
]


@pytest.mark.parametrize(
    "overrides, paged, exc, words", [c[1:] for c in KVCACHE_CASES], ids=[c[0] for c in KVCACHE_CASES]
)
def test_kvcache_bad_input(overrides, paged, exc, words):
    args = _kvcache_inputs(paged)
    args.update(overrides)
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(exc) as info:
        tileattn.flash_attn_with_kvcache(**args)
    for word in words:
        assert word in str(info.value), f"{word!r} not in message: {info.value}"
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a rejected call wrote the cache"


def test_kvcache_valid_inputs_pass():
    """The base inputs of the table above are valid, so each case fails for its own reason."""
    for paged in (False, True):
        tileattn.flash_attn_with_kvcache(**_kvcache_inputs(paged))


def _paged_varlen(table, cu_k=(0, 4, 10)):
    q = torch.randn(10, 4, 16, dtype=F16)
    pool = torch.randn(4, 8, 2, 16, dtype=F16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu = torch.tensor(cu_k, dtype=torch.int32)
    table = torch.tensor(table, dtype=torch.int32)
    return lambda: tileattn.flash_attn_varlen_func(
        q, pool, pool, cu_q, cu, 6, max(cu_k[1] - cu_k[0], cu_k[2] - cu_k[1]), block_table=table
    )


@pytest.mark.parametrize(
    "call, words",
    [
        (_paged_varlen([[0], [7]]), ["block_table[1, 0]", "[0, 4)"]),
        (_paged_varlen([[0], [1]], cu_k=(0, 4, 13)), ["exceeds the cache capacity 8"]),
        (_paged_varlen([[0, 1]]), ["block_table", "shape"]),
    ],
    ids=["page-out-of-range", "keys-past-pages", "table-batch"],
)
def test_paged_varlen_bad_input(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value), f"{word!r} not in message: {info.value}"
