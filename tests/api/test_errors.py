"""Bad input is refused with a clear exception naming the argument, before anything runs; the values of
index tensors (cu_seqlens, cache_seqlens, block tables) are read on the host once until they change
(tileattn.checks.checked_once)."""

import pytest
import torch

import tileattn
from helpers import check_refused
from kvcache_ref import dense_view, kvcache_ref
from tileattn.bert_padding import unpad_input
from tileattn.cache import PagedKVCache
from tileattn.modules import MHA
from tileattn.rotary import apply_rotary_emb
from tileattn.testing import check_close

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


def _fm(idx, causal=False, **kw):
    q, k, v = _qkv()
    return lambda: tileattn.flashmask_attention(q, k, v, idx, causal=causal, **kw)


def _fm_varlen(idx, causal=False):
    q = torch.randn(10, 4, 16, dtype=F16)
    k = torch.randn(10, 2, 16, dtype=F16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    return lambda: tileattn.flashmask_varlen_attention(q, k, k, cu, cu, 6, 6, idx, causal=causal)


def _bounds(*shape, value=0, dtype=torch.int32):
    return torch.full(shape, value, dtype=dtype)


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
    ("headdim-mismatch", _dense(k=k0[..., :8], v=v0[..., :8]), ValueError, ["q, k and v", "head dim"]),
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
    ("cu-last", _varlen(cu_q=(0, 4, 11), max_q=7), ValueError, ["cu_seqlens_q", "at most the number of tokens"]),
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
    ("fm-not-tensor", _fm([[0]]), TypeError, ["startend_row_indices", "int32 tensor"]),
    ("fm-int64", _fm(_bounds(2, 1, 8, 2, dtype=torch.int64)), TypeError, ["startend_row_indices", "int32"]),
    ("fm-rank", _fm(_bounds(1, 8, 2)), ValueError, ["startend_row_indices", "(batch, 1 or nheads, seqlen_k, C)"]),
    ("fm-C3", _fm(_bounds(2, 1, 8, 3)), ValueError, ["C in (1, 2, 4)"]),
    ("fm-C1-not-causal", _fm(_bounds(2, 1, 8, 1)), ValueError, ["C = 1", "causal=True"]),
    ("fm-C4-causal", _fm(_bounds(2, 1, 8, 4), causal=True), ValueError, ["C = 4", "causal=False"]),
    ("fm-heads", _fm(_bounds(2, 3, 8, 2)), ValueError, ["1 or 4", "(2, 3, 8, 2)"]),
    ("fm-batch", _fm(_bounds(1, 1, 8, 2)), ValueError, ["(2, 1 or 4, 8, C)"]),
    ("fm-seqlen", _fm(_bounds(2, 1, 7, 2)), ValueError, ["(2, 1 or 4, 8, C)"]),
    ("fm-above-seqlen-q", _fm(_bounds(2, 1, 8, 2, value=9)), ValueError, ["[0, 8]", "9"]),
    ("fm-negative", _fm(_bounds(2, 1, 8, 1, value=-1), causal=True), ValueError, ["[0, 8]", "-1"]),
    (
        "fm-start-after-end",
        _fm(torch.tensor([5, 3], dtype=torch.int32).expand(2, 1, 8, 2).contiguous(), causal=True),
        ValueError,
        ["LTS must be at most LTE", "5 > 3"],
    ),
    ("fm-varlen-shape", _fm_varlen(_bounds(1, 8, 2)), ValueError, ["(1 or nheads, total_k, C)", "(1 or 4, 10, C)"]),
    ("fm-varlen-above", _fm_varlen(_bounds(1, 10, 1, value=7), causal=True), ValueError, ["[0, 6]"]),
    (
        "unpad-mask-shape",
        lambda: unpad_input(torch.randn(2, 5, 8), torch.ones(2, 4, dtype=torch.bool)),
        ValueError,
        ["attention_mask", "(2, 5)"],
    ),
    ("cache-page-size", lambda: PagedKVCache(1, 4, 0, 2, 16), ValueError, ["page_size", "positive int"]),
    ("cache-unknown-seq", lambda: PagedKVCache(1, 4, 16, 2, 16).append([7], [1]), KeyError, ["unknown sequence"]),
]


# the helpers' cases (the end of CASES); the attention functions raise tileattn.InvalidArgument, which
# flash_attn code catches as the RuntimeError flash_attn raises
HELPERS = ("mha-", "rotary-", "unpad-", "cache-page-size", "cache-unknown-seq")


@pytest.mark.parametrize("name,call,exc,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(name, call, exc, words):
    error = check_refused(call, exc, words)
    if not name.startswith(HELPERS):
        assert isinstance(error, (tileattn.InvalidArgument, NotImplementedError)), type(error)
        assert isinstance(error, RuntimeError)


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
        "cache-last-dim-strided",
        {"k_cache": torch.randn(2, 12, 2, 32, dtype=F16)[..., ::2]},
        False,
        ValueError,
        ["k_cache", "written in place", "contiguous in its last"],
    ),
    (
        "cache-headdim",
        {"k_cache": torch.randn(2, 12, 2, 8, dtype=F16), "v_cache": torch.randn(2, 12, 2, 8, dtype=F16)},
        False,
        ValueError,
        ["q, k_cache and v_cache must share the head dim", "16, 8, 8"],
    ),
    ("q-headdim", {"q": torch.randn(2, 1, 4, 8, dtype=F16)}, False, ValueError, ["q, k_cache and v_cache", "8, 16"]),
    (
        "cache-heads",
        {"k_cache": torch.randn(2, 12, 3, 16, dtype=F16), "v_cache": torch.randn(2, 12, 3, 16, dtype=F16)},
        False,
        ValueError,
        ["nheads (4, q's heads)", "nheads_k (3, k_cache's)", "divisible"],
    ),
    (
        "paged-cache-headdim",
        {"k_cache": torch.randn(6, 4, 2, 8, dtype=F16), "v_cache": torch.randn(6, 4, 2, 8, dtype=F16)},
        True,
        ValueError,
        ["q, k_cache and v_cache must share the head dim"],
    ),
    ("new-v-headdim", {"v": torch.randn(2, 1, 2, 8, dtype=F16)}, False, ValueError, ["v must have shape", "2, 8)"]),
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
    error = check_refused(lambda: tileattn.flash_attn_with_kvcache(**args), exc, words)
    assert isinstance(error, tileattn.InvalidArgument)  # (a RuntimeError, as flash_attn raises)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a rejected call wrote the cache"


def test_kvcache_valid_inputs_pass():
    """The base inputs of the table above are valid, so each case fails for its own reason: the call
    computes what the oracle does (and appends)."""
    for paged in (False, True):
        args = _kvcache_inputs(paged)
        ref_args = {n: t for n, t in args.items() if not n.startswith("rotary_") and t is not None}
        ref_args["rotary"] = (args["rotary_cos"], args["rotary_sin"])
        ref, ref_lowp = (kvcache_ref(**ref_args, precision=p) for p in (torch.float64, None))
        out = tileattn.flash_attn_with_kvcache(**args)
        check_close(f"valid inputs, paged={paged}", out, ref.out, ref_lowp.out)
        capacity = ref.k_cache.shape[1]
        assert torch.equal(dense_view(args["k_cache"], args["block_table"], capacity), ref.k_cache.to(F16))


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
    check_refused(call, ValueError, words)


def test_empty_pool_refused():
    """A paged cache of no pages cannot serve a block table with columns: refused up front (the kernels
    clamp table entries to the pool's pages, which needs one)."""
    q = torch.randn(1, 1, 4, 16, dtype=F16)
    empty = torch.zeros(0, 16, 2, 16, dtype=F16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="holds no pages"):
        tileattn.flash_attn_with_kvcache(q, empty, empty, cache_seqlens=0, block_table=table)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="holds no pages"):
        tileattn.flash_attn_varlen_func(q[0], empty, empty, cu, cu, 1, 1, block_table=table)


def test_cu_seqlens_checked_once_until_modified():
    """The values of a cu_seqlens tensor are read on the host once (a device sync), not once per layer:
    later calls with the same, unmodified tensor reuse the result; an in-place change is checked again."""
    from tileattn.checks import checked_once

    q = torch.randn(9, 2, 16)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = cu_q.clone()
    runs = checked_once.runs
    for _ in range(3):
        tileattn.flash_attn_varlen_func(q, q, q, cu_q, cu_k, 5, 5)
    assert checked_once.runs - runs == 1  # cu_seqlens_q and cu_seqlens_k, together once
    tileattn.flash_attn_varlen_func(q, q, q, cu_q, cu_k, 6, 6)  # another max_seqlen: checked again
    assert checked_once.runs - runs == 2
    cu_k[1] = 10  # now decreasing
    with pytest.raises(ValueError, match="non-decreasing"):
        tileattn.flash_attn_varlen_func(q, q, q, cu_q, cu_k, 6, 6)


def test_checked_once_keeps_the_latest_entries_when_full():
    """A full table of remembered checks drops its oldest entry, never the ones just made: the layers
    of a step keep sharing one check however many other tensors were checked before."""
    from tileattn.checks import CheckedOnce

    checked = CheckedOnce(limit=3)
    tensors = [torch.zeros(1) for _ in range(5)]
    calls = []
    for t in tensors:
        checked((t,), (), lambda: calls.append(1))
    checked((tensors[3],), (), lambda: calls.append(1))
    checked((tensors[4],), (), lambda: calls.append(1))
    assert len(calls) == 5 and len(checked) == 3


def test_cache_values_checked_once_per_step():
    """cache_seqlens and block_table are read on the host (a device sync) once until they change, not
    once per layer: calls with the same, unmodified tensors reuse the check; an in-place update (the
    next decode step) is checked again, and bad values are still refused with the caches unchanged."""
    from tileattn.checks import checked_once

    class _Reads:  # the host reads since the test began
        def __init__(self):
            self.start = checked_once.runs

        def __len__(self):
            return checked_once.runs - self.start

    reads = _Reads()
    page, hk, d = 4, 2, 16
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    layers = [(torch.zeros(6, page, hk, d, dtype=F16), torch.zeros(6, page, hk, d, dtype=F16)) for _ in range(3)]
    q = torch.randn(2, 1, 4, d, dtype=F16)
    k_new, v_new = (torch.randn(2, 1, hk, d, dtype=F16) for _ in range(2))
    for kc, vc in layers:  # one decode step over three layers
        tileattn.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table)
    assert len(reads) == 1
    seqlens += 1  # the next step
    for kc, vc in layers:
        tileattn.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table)
    assert len(reads) == 2
    assert all(torch.equal(kc[1, 0], k_new[0, 0]) and torch.equal(kc[5, 0], k_new[1, 0]) for kc, _ in layers)
    table[1, 2] = 9  # a page that does not exist, now covering sequence 1's new token
    before = [t.clone() for t in layers[0]]
    with pytest.raises(ValueError, match="block_table"):
        tileattn.flash_attn_with_kvcache(q, *layers[0], k_new, v_new, cache_seqlens=seqlens, block_table=table)
    assert all(torch.equal(a, b) for a, b in zip(before, layers[0]))
    with torch.inference_mode():  # no version counter: checked on every call
        s = torch.tensor([1, 1], dtype=torch.int32)
        for _ in range(2):
            tileattn.flash_attn_with_kvcache(q, *layers[0], cache_seqlens=s, block_table=table[:, :1].clone())
    assert len(reads) == 5


def test_paged_prefill_values_checked_once():
    """The paged varlen call checks cu_seqlens and the block table once until they change."""
    from tileattn.checks import checked_once

    runs = checked_once.runs
    kp = torch.randn(4, 4, 2, 16, dtype=F16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    q = torch.randn(5, 4, 16, dtype=F16)
    for _ in range(3):
        tileattn.flash_attn_varlen_func(q, kp, kp, cu_q, cu_k, 3, 7, block_table=table)
    assert checked_once.runs - runs == 3  # cu_seqlens_q, cu_seqlens_k and the table, once each
    table[1, 1] = 7
    with pytest.raises(ValueError, match="block_table"):
        tileattn.flash_attn_varlen_func(q, kp, kp, cu_q, cu_k, 3, 7, block_table=table)
