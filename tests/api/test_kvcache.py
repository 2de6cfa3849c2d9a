"""flash_attn_with_kvcache, and the paged prefill of flash_attn_varlen_func, against the per-sequence
reference (tests/kvcache_ref.py, through the tests' oracle): in-place append, rotary, paged caches,
split-KV, the LSE, random calls, empty batches, NaN in the cache, window sides, caches' autograd state,
checks and plans kept per call signature, and on the GPU CUDA graphs and streams."""

import dataclasses

import pytest
import torch
from hypothesis import strategies as st

import oracle
import tileattn
from helpers import PROPERTY_SHARDS, check_lse, interpreter_skips, on, run_property
from kvcache_cases import (
    CASES,
    F16,
    LAYOUTS,
    _check_case,
    _check_kvcache_problem,
    _inputs,
    _plans_made,
    _ref_args,
)
from kvcache_ref import dense_view, kvcache_ref
from tileattn.kernels import configs
from tileattn.testing import check_close


def _applies(case, layout, **_):
    return not (LAYOUTS[layout] and CASES[case][2].get("batch_idx"))


@pytest.mark.gpu_cover(strength=2, valid=_applies)  # (every pair of values on the GPU: tests/cover.py)
@pytest.mark.parametrize("dtype", [F16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_kvcache_matches_reference(backend, case, layout, num_splits, dtype):
    if not _applies(case, layout):
        pytest.skip("cache_batch_idx applies to dense caches")
    if backend != "cuda" and num_splits == 0 and (layout != "dense" or case not in ("decode-rotary", "batch-idx")):
        pytest.skip("the split heuristic is covered by two cases under the interpreter")
    interpreter_skips(backend, dtype)
    _check_case(backend, case, layout, num_splits, dtype=dtype)


@pytest.mark.parametrize("layout", ["dense", "page16"])
@pytest.mark.parametrize("case", ["chunk-causal-neox", "alibi-leftpad", "window-softcap"])
@pytest.mark.parametrize("d", [59, 96, 111])
def test_kvcache_odd_head_dims(backend, d, case, layout):
    """Head dims that are not powers of two (59 and 111 not even multiples of 8: the kernels pad the
    loads, the append writes exactly d columns), three splits."""
    _check_case(backend, case, layout, 3, d=d)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the head-dim-128 builds run on the GPU")
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("rotary", ["interleaved", "neox"])
@pytest.mark.parametrize("layout", ["dense", "page16"])
def test_rotary_q_builds_at_head_dim_128(layout, rotary, seqlen_q):
    """The builds that rotate q in the attention kernel at the decode shapes (head dim 128, GQA 32/8,
    one new token, not causal: q at cache_seqlens), against the reference. The contiguous interleaved
    build with four query tokens is the one ptxas gives 255 registers (tests/kernels/test_sm90_builds.py)."""
    q, kc, vc, args = _inputs(seqlen_q, 1, {"rotary": rotary}, LAYOUTS[layout], "cuda", h=32, hk=8, d=128, capacity=700)
    ref = kvcache_ref(q, kc, vc, **_ref_args(args))
    ref_lowp = kvcache_ref(q, kc, vc, precision=None, **_ref_args(args))
    out = tileattn.flash_attn_with_kvcache(q, kc, vc, **args)
    check_close(f"{layout} {rotary} seqlen_q {seqlen_q}", out, ref.out, ref_lowp.out)
    assert torch.equal(dense_view(kc, args.get("block_table"), ref.k_cache.shape[1]), ref.k_cache)


def test_rotary_tables_as_strided_views(backend):
    """rotary_cos and rotary_sin may be views with row strides of their own (the kernels read one
    contiguous layout for both)."""
    ctx, device = on(backend)
    q, kc, vc, args = _inputs(1, 1, {"causal": True, "rotary": "interleaved"}, 4, device)
    ref = kvcache_ref(q, kc, vc, **_ref_args(args))
    lowp = kvcache_ref(q, kc, vc, precision=None, **_ref_args(args))
    sin = args["rotary_sin"]
    wide = torch.zeros(sin.shape[0], sin.shape[1] + 5, dtype=sin.dtype, device=device)
    wide[:, : sin.shape[1]] = sin
    args["rotary_sin"] = wide[:, : sin.shape[1]]
    with ctx:
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, **args)
    check_close("strided rotary_sin", out, ref.out, lowp.out)
    assert torch.equal(dense_view(kc, args["block_table"], ref.k_cache.shape[1]), ref.k_cache)


def test_lse_matches_logsumexp(backend):
    """The LSE of a split call (natural log, fp32) against the oracle's: a full cache and a shorter one."""
    ctx, device = on(backend)
    q = torch.randn(2, 3, 4, 32, dtype=F16, device=device)
    kc = torch.randn(2, 50, 4, 32, dtype=F16, device=device)
    seqlens = torch.tensor([50, 21], dtype=torch.int32, device=device)
    with ctx:
        out, lse = tileattn.flash_attn_with_kvcache(
            q, kc, kc, cache_seqlens=seqlens, num_splits=4, return_softmax_lse=True
        )
    ref = kvcache_ref(q, kc, kc, cache_seqlens=seqlens)
    lowp = kvcache_ref(q, kc, kc, cache_seqlens=seqlens, precision=None)
    check_lse("split lse", lse, ref.lse, lowp.lse)
    check_close("split out", out, ref.out, lowp.out)


def test_int_cache_seqlens_and_mqa(backend):
    ctx, device = on(backend)
    q = torch.randn(2, 1, 6, 16, dtype=F16, device=device)
    kc = torch.randn(2, 20, 1, 16, dtype=F16, device=device)
    vc = torch.randn_like(kc)
    with ctx:
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=11)
    ref = kvcache_ref(q, kc, vc, cache_seqlens=torch.tensor([11, 11]))
    lowp = kvcache_ref(q, kc, vc, cache_seqlens=torch.tensor([11, 11]), precision=None)
    check_close("int seqlens", out, ref.out, lowp.out)


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_varlen_prefill(backend, page, causal):
    """flash_attn_varlen_func with block_table: the oracle on the keys gathered through the table."""
    ctx, device = on(backend)
    lq, lk = [3, 0, 9, 1], [10, 4, 9, 30]
    h, hk, d = 4, 2, 24
    max_pages = -(-max(lk) // page)
    num_pages = len(lk) * max_pages
    kp = torch.randn(num_pages, page, hk, d, dtype=F16, device=device)
    vp = torch.randn_like(kp)
    table = torch.randperm(num_pages, device=device).view(len(lk), max_pages).int()
    q = torch.randn(sum(lq), h, d, dtype=F16, device=device)
    cu_q = torch.tensor([0, 3, 3, 12, 13], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 10, 14, 23, 53], dtype=torch.int32, device=device)
    dense_k = dense_view(kp, table, max_pages * page)
    dense_v = dense_view(vp, table, max_pages * page)
    k = torch.cat([dense_k[b, :n] for b, n in enumerate(lk)])
    v = torch.cat([dense_v[b, :n] for b, n in enumerate(lk)])
    with ctx:
        out = tileattn.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lq), max(lk), causal=causal, block_table=table)
    ref = oracle.attention_varlen(q, k, v, cu_q, cu_k, max(lk), causal=causal).out
    lowp = oracle.attention_varlen(q, k, v, cu_q, cu_k, max(lk), causal=causal, precision=None).out
    check_close("paged varlen", out, ref, lowp)


@pytest.mark.parametrize("needs_grad", ["q", "kv", "sink"])
def test_paged_varlen_runs_forward_with_grad_and_refuses_backward(backend, needs_grad):
    """Inputs that require grad (as flash_attn's tests pass them): the forward runs as under no_grad and
    matches the oracle; a backward that reaches the paged call raises, naming block_table, while other
    branches of the graph still differentiate."""
    ctx, device = on(backend)
    page, lk = 8, [9, 20]
    kp = torch.randn(6, page, 2, 16, dtype=F16, device=device)
    vp = torch.randn_like(kp)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=device)
    q = torch.randn(7, 4, 16, dtype=F16, device=device)
    cu_q = torch.tensor([0, 5, 7], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 29], dtype=torch.int32, device=device)
    k, v = (torch.cat([dense_view(t, table, 3 * page)[b, :n] for b, n in enumerate(lk)]) for t in (kp, vp))
    sink = torch.randn(4, device=device) if needs_grad == "sink" else None
    ref = oracle.attention_varlen(q, k, v, cu_q, cu_k, max(lk), causal=True, sink=sink)
    lowp = oracle.attention_varlen(q, k, v, cu_q, cu_k, max(lk), causal=True, sink=sink, precision=None)
    for t in {"q": (q,), "kv": (kp, vp), "sink": (sink,)}[needs_grad]:
        t.requires_grad_(True)
    with ctx:
        out, lse, _ = tileattn.flash_attn_varlen_func(
            q, kp, vp, cu_q, cu_k, 5, max(lk), causal=True, block_table=table, return_attn_probs=True,
            learnable_sink=sink,
        )  # fmt: skip
    assert out.requires_grad and lse.requires_grad
    check_close("paged varlen, inputs that require grad", out.detach(), ref.out, lowp.out)
    for output in (out, lse):
        with pytest.raises(NotImplementedError, match="block_table"):
            output.sum().backward()
    if needs_grad == "q":  # the gradient of q through another branch is untouched
        (q * 2).sum().backward()
        assert torch.equal(q.grad, torch.full_like(q, 2))


@pytest.mark.parametrize("needs_grad", ["q", "new", "cache", "sink"])
def test_kvcache_runs_forward_with_grad_and_refuses_backward(backend, needs_grad):
    """flash_attn_with_kvcache has no backward: with inputs that require grad the append and the forward
    run and match the reference, and a backward that reaches the call raises (not a gradient that misses
    the cache's part of the scores, nor none at all), on every path."""
    ctx, device = on(backend)
    q, kc, vc, args = _inputs(2, 2, {"causal": True, "rotary": "neox"}, None, device)
    if needs_grad == "sink":
        args["learnable_sink"] = torch.randn(q.shape[2], device=device)
    ref = kvcache_ref(q, kc, vc, **_ref_args(args))
    lowp = kvcache_ref(q, kc, vc, precision=None, **_ref_args(args))
    grads = {"q": (q,), "new": (args["k"], args["v"]), "cache": (kc, vc), "sink": (args.get("learnable_sink"),)}
    for t in grads[needs_grad]:
        t.requires_grad_(True)
    with ctx:
        out, lse = tileattn.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **args)
    check_close("kvcache, inputs that require grad", out.detach(), ref.out, lowp.out)
    assert torch.equal(kc.detach(), ref.k_cache) and torch.equal(vc.detach(), ref.v_cache)
    assert kc.grad_fn is None and vc.grad_fn is None  # the caches stay leaves (no graph through the append)
    for output in (out, lse):
        with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache has no backward"):
            output.sum().backward()


@st.composite
def kvcache_problems(draw, max_len, dtypes=(F16,)):
    batch = draw(st.integers(1, 3))
    nheads_k = draw(st.integers(1, 2))
    page = draw(st.sampled_from([None, None, 1, 4, 16]))
    seqlen_new = draw(st.integers(0, 4))
    capacity = draw(st.integers(max(seqlen_new, 1), max_len))
    seqlens = draw(st.lists(st.integers(0, capacity - seqlen_new), min_size=batch, max_size=batch))
    leftpad = draw(st.booleans())
    rotary = draw(st.sampled_from([None, "interleaved", "neox"])) if seqlen_new else None
    window = (draw(st.integers(-1, 20)), draw(st.integers(-1, 20))) if draw(st.booleans()) else (-1, -1)
    return dict(
        batch=batch,
        nheads_k=nheads_k,
        nheads=nheads_k * draw(st.sampled_from([1, 2, 4])),
        headdim=draw(st.sampled_from([16, 24, 40, 64])),
        seqlen_q=draw(st.integers(1, 5)),
        seqlen_new=seqlen_new,
        capacity=capacity,
        page=page,
        seqlens=seqlens,
        leftpad=[draw(st.integers(0, n)) for n in seqlens] if leftpad else None,
        rotary=rotary,
        causal=draw(st.booleans()),
        window=window,
        softcap=draw(st.sampled_from([0.0, 0.0, 4.0])),
        alibi=draw(st.booleans()),
        num_splits=draw(st.sampled_from([0, 1, 2, 5])),
        v_padded=draw(st.booleans()),  # v and v_cache as views with other strides than k's
        dtype=draw(st.sampled_from(dtypes)),
    )


_KV_EXAMPLES = {"torch": 60, "interpret": 40, "cuda": 40}


@pytest.mark.parametrize("shard", range(PROPERTY_SHARDS))
def test_property_random_kvcache_calls(backend, shard):
    """Random decode / chunked-prefill calls: batch, GQA, head dim, capacity, page size (1 to 16 or
    contiguous), cache lengths (empty and full), new tokens, leftpad, rotary, causal, windows, softcap,
    ALiBi, split counts and fp16 or bf16 (fp16 alone under the interpreter, where bf16 takes the CPU
    path), against the per-sequence reference."""
    dtypes = (F16,) if backend == "interpret" else (F16, torch.bfloat16)
    strategy = kvcache_problems(200 if backend == "cuda" else 40, dtypes)
    run_property(_check_kvcache_problem, strategy, _KV_EXAMPLES, backend, shard)


def test_empty_batch_and_empty_queries(backend):
    ctx, device = on(backend)
    kc = torch.randn(2, 8, 1, 16, dtype=F16, device=device)
    with ctx:
        out, lse = tileattn.flash_attn_with_kvcache(
            torch.randn(0, 1, 2, 16, dtype=F16, device=device), kc, kc, cache_seqlens=3, return_softmax_lse=True
        )
        assert out.shape == (0, 1, 2, 16) and lse.shape == (0, 2, 1)
        out = tileattn.flash_attn_with_kvcache(
            torch.randn(2, 0, 2, 16, dtype=F16, device=device), kc, kc, cache_seqlens=3
        )
        assert out.shape == (2, 0, 2, 16)


def test_nan_in_the_cache_reaches_only_rows_that_see_it(backend):
    """A NaN key at position 5 of sequence 0: that sequence's rows are NaN once they see position 5
    (not before, with causal decoding), sequence 1 is untouched; no hang, no crash. (A NaN *value* also
    reaches rows that load its tile without seeing it, through 0 · NaN, as in FlashAttention.)"""
    ctx, device = on(backend)
    q = torch.randn(2, 4, 2, 16, dtype=F16, device=device)
    kc = torch.randn(2, 16, 1, 16, dtype=F16, device=device)
    vc = torch.randn_like(kc)
    kc[0, 5, 0, 3] = float("nan")
    with ctx:
        out = tileattn.flash_attn_with_kvcache(
            q,
            kc,
            vc,
            cache_seqlens=torch.tensor([6, 9], dtype=torch.int32, device=device),
            causal=True,
            num_splits=2,
        )
    # sequence 0 has 6 keys and 4 queries: query i sees keys <= i + 2, so row 3 (it sees key 5) is NaN
    assert torch.isfinite(out[0, :3]).all() and torch.isnan(out[0, 3]).all()
    assert torch.isfinite(out[1]).all()


def test_checks_and_plans_kept_per_call_signature(backend, monkeypatch):
    """flash_attn_with_kvcache checks a call's metadata, and the kernels plan its launches, once per
    signature (shapes, strides, dtypes, devices, address alignment, options with their types): a decode
    loop's later calls reuse both with new values and stay exact. A call that differs only in a value's
    type, a tensor's strides or its alignment has another signature: it is checked (and refused where it
    must be) and planned again; so is a call under other decode settings."""
    from tileattn import kvcache

    device = on(backend)[1]
    q, kc, vc, args = _inputs(1, 1, {"causal": True, "rotary": "interleaved"}, 4, device)
    planned = _plans_made()
    kvcache.calls.clear()

    def step(seqlens, **changes):
        call = {**args, "cache_seqlens": torch.tensor(seqlens, dtype=torch.int32, device=device), **changes}
        ref = kvcache_ref(q, kc, vc, **_ref_args(call))
        lowp = kvcache_ref(q, kc, vc, precision=None, **_ref_args(call))
        with on(backend)[0]:
            out = tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=2, **call)
        check_close(f"step {seqlens}", out, ref.out, lowp.out)
        assert torch.equal(dense_view(kc, args["block_table"], ref.k_cache.shape[1]), ref.k_cache)

    kernels = backend != "torch"  # (the PyTorch path plans no launches)
    for seqlens in ([0, 17, 35], [5, 2, 34], [6, 3, 33]):  # key tiles per split alike: one plan
        step(seqlens)
    assert len(kvcache.calls) == 1 and len(planned) == kernels
    step([1, 2, 3])  # fewer key tiles per program under the interpreter (16-key tiles): planned again
    plans = kernels + (backend == "interpret")
    assert len(kvcache.calls) == 1 and len(planned) == plans
    with on(backend)[0]:
        # (what step() passes, with one change each)
        with pytest.raises(TypeError, match="causal"):
            tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=2, **{**args, "causal": 1})
        tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=2, window_size=(1, -1), **args)  # valid
        with pytest.raises(ValueError, match="window_size"):
            tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=2, window_size=(True, -1), **args)
        # (a cache is written in place: its last dimension must be contiguous; q's would be copied)
        strided = torch.randn(*kc.shape[:3], 2 * kc.shape[3], dtype=F16, device=device)[..., ::2]
        with pytest.raises(ValueError, match="contiguous in its last"):
            tileattn.flash_attn_with_kvcache(q, strided, vc, num_splits=2, **args)
    assert len(kvcache.calls) == 2  # (and the window's)
    shifted = torch.empty(q.numel() + 1, dtype=F16, device=device)[1:].view(q.shape)  # 2 bytes off
    shifted.copy_(q)
    q = shifted
    step([7, 8, 9])
    assert len(kvcache.calls) == 3 and len(planned) == plans + 2 * kernels
    s = configs.current(torch.device(device))
    with configs.override(dataclasses.replace(s, decode=dataclasses.replace(s.decode, stages=s.decode.stages + 1))):
        step([7, 8, 9])
    assert len(planned) == plans + 3 * kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and streams run on the GPU")
def test_split_decoding_under_graphs_streams_and_pages():
    """Split decoding at sizes that split on the GPU: split counts that change from call to call, a
    CUDA graph of split calls replayed on new queries, two streams decoding at once, and paged caches
    (pages of 16 and 256, the five-stage build for long programs and interleaved splits included) all
    match the oracle (kvcache_ref) by the tolerance rule."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(4, 1, 16, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(4, 4096, 4, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(4, 4096, 4, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor([4096, 1, 2047, 700], dtype=torch.int32, device=dev)

    def call(q, splits, **paged):
        k, v = paged.pop("caches", (kc, vc))
        return tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=splits, **paged)

    def expected(x):
        return kvcache_ref(x, kc, vc, cache_seqlens=seqlens).out, kvcache_ref(
            x, kc, vc, cache_seqlens=seqlens, precision=None
        ).out

    def close(got, want, what):
        check_close(what, got, *want)

    want = expected(q)
    for splits in [1, 2, 7, 16, 3, 23, 16, 5] * 3:
        close(call(q, splits), want, f"{splits} splits")
    for page in (16, 256):
        perm = torch.randperm(4 * 4096 // page, device=dev, generator=gen)
        table = perm.view(4, -1).int()
        kp, vp = (torch.empty_like(x).view(-1, page, 4, 64) for x in (kc, vc))
        kp[perm], vp[perm] = kc.reshape(-1, page, 4, 64), vc.reshape(-1, page, 4, 64)
        for splits in (1, 2, 7, 23, 0):  # (pages of 16: every num_splits-th key tile)
            close(call(q, splits, caches=(kp, vp), block_table=table), want, f"pages of {page}, {splits} splits")

    qs = [torch.randn_like(q) for _ in range(3)]
    static = [x.clone() for x in qs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        [call(x, s) for x, s in zip(static, (4, 9, 16))]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call(x, s) for x, s in zip(static, (4, 9, 16))]
    for _ in range(3):
        fresh = [torch.randn_like(q) for _ in qs]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        call(q, 5)  # an eager split call between replays
        for out, x in zip(outs, fresh):
            close(out, expected(x), "graph replay")

    streams = [torch.cuda.Stream() for _ in range(2)]
    results = [[], []]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(20):
        for stream, res in zip(streams, results):
            with torch.cuda.stream(stream):
                res.append(call(q, 12))
    torch.cuda.synchronize()
    for res in results:
        for out in res:
            close(out, want, "two streams")


def test_window_sides_as_wide_as_the_keys_are_unbounded(backend):
    """As in flash_attn, a window side at least the call's key length (k's seqlen, max_seqlen_k, or the
    cache capacity) is unbounded: with more queries than keys, (-1, seqlen_k) is no window at all, while
    (-1, seqlen_k - 1) hides every key from the first rows (the diagonal lies left of the keys); on the
    left, (seqlen_k, 0) is causal and (seqlen_k - 1, 0) a window. Each against the oracle."""
    _, device = on(backend)
    q = torch.randn(1, 12, 2, 16, dtype=F16, device=device)
    k, v = (torch.randn(1, 4, 1, 16, dtype=F16, device=device) for _ in range(2))
    cu_q = torch.tensor([0, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4], dtype=torch.int32, device=device)
    calls = {
        "dense": lambda w: tileattn.flash_attn_func(q, k, v, window_size=w),
        "varlen": lambda w: tileattn.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 12, 4, window_size=w)[None],
        "kvcache": lambda w: tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=4, window_size=w),
    }
    for name, call in calls.items():
        for window in ((-1, -1), (-1, 4), (-1, 3), (4, 0), (3, 0)):
            with on(backend)[0]:
                out = call(window)
            ref = oracle.attention(q, k, v, window_size=window).out
            check_close(
                f"{name} window {window}", out, ref, oracle.attention(q, k, v, window_size=window, precision=None).out
            )
            if window[1] == 3:
                assert (out[0, 0] == 0).all(), name


def test_caches_that_require_grad_or_are_inference_tensors_are_written(backend):
    """As flash_attn's kernel does, the append writes caches whatever their autograd state: a cache that
    requires grad, or one made under torch.inference_mode and used outside it (torch's own in-place
    writes refuse both, and the second cache's refusal would come after the first cache's write)."""
    _, device = on(backend)
    q = torch.randn(2, 1, 4, 16, dtype=F16, device=device)
    new = torch.randn(2, 1, 2, 16, dtype=F16, device=device)
    seqlens = torch.tensor([1, 2], dtype=torch.int32, device=device)
    with torch.inference_mode():
        inference = torch.randn(2, 4, 2, 16, dtype=F16, device=device)
    needs_grad = torch.randn(2, 4, 2, 16, dtype=F16, device=device).requires_grad_(True)
    for v_cache in (needs_grad, inference):
        k_cache = torch.randn(2, 4, 2, 16, dtype=F16, device=device)
        with on(backend)[0]:
            tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens)
        for b, n in enumerate(seqlens.tolist()):
            assert torch.equal(k_cache[b, n], new[b, 0]) and torch.equal(v_cache[b, n].detach(), new[b, 0])
