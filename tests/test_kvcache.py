"""Attention against a KV cache: in-place append, rotary, paged caches, split-KV, and the paged
prefill of flash_attn_varlen_func, each against the per-sequence reference (tests/kvcache_ref.py)."""

import dataclasses
import os

import pytest
import torch
from hypothesis import strategies as st

import tileattn
from helpers import PROPERTY_SHARDS, on, run_property
from kvcache_ref import dense_view, kvcache_ref
from tileattn.kernels import configs
from tileattn.params import AttnParams, CacheLayout, DecodeSettings, Settings, interpreting
from tileattn.reference import attention_ref
from tileattn.testing import check_close

F16 = torch.float16

# (seqlen_q, seqlen_new, options) per case; caches hold 3 sequences of capacity 37.
CASES = {
    "decode-rotary": (1, 1, {"causal": True, "rotary": "interleaved"}),
    "decode-no-append": (1, 0, {}),
    "chunk-causal-neox": (5, 5, {"causal": True, "rotary": "neox-partial"}),
    "window-softcap": (3, 3, {"window_size": (6, 0), "softcap": 3.0}),
    "alibi-leftpad": (2, 2, {"causal": True, "alibi": True, "leftpad": True}),
    "batch-idx": (2, 1, {"batch_idx": True, "causal": True}),
    "q-longer-than-new": (4, 2, {"rotary": "interleaved"}),
    # window sides at least the capacity (37, or 40 / 48 paged) are no window: q rotates at cache_seqlens
    "wide-window-rotary": (4, 2, {"window_size": (48, 60), "rotary": "neox-partial"}),
}
LAYOUTS = {"dense": None, "page4": 4, "page16": 16}


def _inputs(seqlen_q, seqlen_new, opts, page, device, h=8, hk=2, d=40, capacity=37, batch=3):
    q = torch.randn(batch, seqlen_q, h, d, dtype=F16, device=device)
    batch_cache = batch + 2 if opts.get("batch_idx") else batch
    args = {}
    if page:
        max_pages = -(-capacity // page)
        num_pages = batch * max_pages + 3
        kc = torch.randn(num_pages, page, hk, d, dtype=F16, device=device)
        args["block_table"] = torch.randperm(num_pages, device=device)[: batch * max_pages].view(batch, -1).int()
    else:
        kc = torch.randn(batch_cache, capacity, hk, d, dtype=F16, device=device)
    vc = torch.randn_like(kc)
    if seqlen_new:
        args["k"] = torch.randn(batch, seqlen_new, hk, d, dtype=F16, device=device)
        args["v"] = torch.randn(batch, seqlen_new, hk, d, dtype=F16, device=device)
    # One empty cache (with nothing appended it sees no key), one mid-size, one filled to capacity.
    full = capacity - seqlen_new
    args["cache_seqlens"] = torch.tensor([0, 17, full], dtype=torch.int32, device=device)
    if opts.get("leftpad"):
        args["cache_leftpad"] = torch.tensor([0, 5, 30], dtype=torch.int32, device=device)
    if opts.get("batch_idx"):
        args["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    if opts.get("alibi"):
        args["alibi_slopes"] = torch.rand(batch, h, device=device) * 0.3
    if "rotary" in opts:
        rotary_dim = 16 if opts["rotary"] == "neox-partial" else d
        angle = torch.rand(capacity + 4, rotary_dim // 2, device=device) * 6.283
        args["rotary_cos"], args["rotary_sin"] = angle.cos().to(F16), angle.sin().to(F16)
        args["rotary_interleaved"] = opts["rotary"] == "interleaved"
    for key in ("causal", "window_size", "softcap"):
        if key in opts:
            args[key] = opts[key]
    return q, kc, vc, args


def _kernel_device() -> str:
    """Where the Triton kernels run when a test calls them directly: the GPU, or the CPU under the
    interpreter (skipped on a CPU without it)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0":
        pytest.skip("needs the Triton kernels (GPU or interpreter)")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _settings(device: str, **changes) -> Settings:
    """The settings of ``device``'s kernels (the interpreter's on the CPU) with these ``DecodeSettings``
    fields changed: for ``configs.override`` around the calls of a test."""
    s = configs.for_device(torch.device(device))
    return dataclasses.replace(s, decode=dataclasses.replace(s.decode, **changes))


def _ref_args(args):
    ref = {key: val for key, val in args.items() if not key.startswith("rotary_")}
    if "rotary_cos" in args:
        ref["rotary"] = (args["rotary_cos"], args["rotary_sin"])
        ref["rotary_interleaved"] = args["rotary_interleaved"]
    return ref


@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_kvcache_matches_reference(backend, case, layout, num_splits):
    if LAYOUTS[layout] and CASES[case][2].get("batch_idx"):
        pytest.skip("cache_batch_idx applies to dense caches")
    if backend != "cuda" and num_splits == 0 and (layout != "dense" or case not in ("decode-rotary", "batch-idx")):
        pytest.skip("the split heuristic is covered by two cases under the interpreter")
    _check_case(backend, case, layout, num_splits)


@pytest.mark.parametrize("layout", ["dense", "page16"])
@pytest.mark.parametrize("case", ["chunk-causal-neox", "alibi-leftpad", "window-softcap"])
@pytest.mark.parametrize("d", [59, 96, 111])
def test_kvcache_odd_head_dims(backend, d, case, layout):
    """Head dims that are not powers of two (59 and 111 not even multiples of 8: the kernels pad the
    loads, the append writes exactly d columns), three splits."""
    _check_case(backend, case, layout, 3, d=d)


def _check_case(backend, case, layout, num_splits, d=40):
    seqlen_q, seqlen_new, opts = CASES[case]
    page = LAYOUTS[layout]
    ctx, device = on(backend)
    q, kc, vc, args = _inputs(seqlen_q, seqlen_new, opts, page, device, d=d)
    ref, k_ref, v_ref = kvcache_ref(q, kc, vc, **_ref_args(args))
    ref_lowp, _, _ = kvcache_ref(q, kc, vc, upcast=False, **_ref_args(args))
    untouched = kc.clone()
    with ctx:
        out, lse = tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits, return_softmax_lse=True, **args)
    check_close(f"{case} {layout} out", out, ref, ref_lowp)
    capacity = k_ref.shape[1]
    got_k = dense_view(kc, args.get("block_table"), capacity)
    got_v = dense_view(vc, args.get("block_table"), capacity)
    if "cache_batch_idx" in args:
        rows = args["cache_batch_idx"].long()
        got_k, got_v = got_k[rows], got_v[rows]
        spare = [r for r in range(kc.shape[0]) if r not in rows.tolist()]
        assert torch.equal(kc[spare], untouched[spare]), "rows no sequence maps to were written"
    assert torch.equal(got_k, k_ref.to(F16)), "k_cache after the append differs from the reference"
    assert torch.equal(got_v, v_ref.to(F16)), "v_cache after the append differs from the reference"
    # Rows that see no key (the empty cache, nothing appended) are 0 with LSE +inf.
    if seqlen_new == 0:
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
    assert lse.shape == (q.shape[0], q.shape[2], seqlen_q) and lse.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the head-dim-128 builds run on the GPU")
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("rotary", ["interleaved", "neox"])
@pytest.mark.parametrize("layout", ["dense", "page16"])
def test_rotary_q_builds_at_head_dim_128(layout, rotary, seqlen_q):
    """The builds that rotate q in the attention kernel at the decode shapes (head dim 128, GQA 32/8,
    one new token, not causal: q at cache_seqlens), against the reference. The contiguous interleaved
    build with four query tokens is the one ptxas gives 255 registers (tests/test_sm90_builds.py)."""
    q, kc, vc, args = _inputs(seqlen_q, 1, {"rotary": rotary}, LAYOUTS[layout], "cuda", h=32, hk=8, d=128, capacity=700)
    ref, k_ref, _ = kvcache_ref(q, kc, vc, **_ref_args(args))
    ref_lowp, _, _ = kvcache_ref(q, kc, vc, upcast=False, **_ref_args(args))
    out = tileattn.flash_attn_with_kvcache(q, kc, vc, **args)
    check_close(f"{layout} {rotary} seqlen_q {seqlen_q}", out, ref, ref_lowp)
    assert torch.equal(dense_view(kc, args.get("block_table"), k_ref.shape[1]), k_ref.to(F16))


def test_rotary_tables_as_strided_views(backend):
    """rotary_cos and rotary_sin may be views with row strides of their own (the kernels read one
    contiguous layout for both)."""
    ctx, device = on(backend)
    q, kc, vc, args = _inputs(1, 1, {"causal": True, "rotary": "interleaved"}, 4, device)
    ref, k_ref, _ = kvcache_ref(q, kc.clone(), vc.clone(), **_ref_args(args))
    lowp, _, _ = kvcache_ref(q, kc.clone(), vc.clone(), upcast=False, **_ref_args(args))
    sin = args["rotary_sin"]
    wide = torch.zeros(sin.shape[0], sin.shape[1] + 5, dtype=sin.dtype, device=device)
    wide[:, : sin.shape[1]] = sin
    args["rotary_sin"] = wide[:, : sin.shape[1]]
    with ctx:
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, **args)
    check_close("strided rotary_sin", out, ref, lowp)
    assert torch.equal(dense_view(kc, args["block_table"], k_ref.shape[1]), k_ref.to(F16))


def test_lse_matches_logsumexp(backend):
    ctx, device = on(backend)
    q = torch.randn(2, 3, 4, 32, dtype=F16, device=device)
    kc = torch.randn(2, 50, 4, 32, dtype=F16, device=device)
    seqlens = torch.tensor([50, 21], dtype=torch.int32, device=device)
    with ctx:
        _, lse = tileattn.flash_attn_with_kvcache(
            q, kc, kc, cache_seqlens=seqlens, num_splits=4, return_softmax_lse=True
        )
    for b, n in enumerate(seqlens.tolist()):
        s = torch.einsum("qhd,khd->hqk", q[b].double(), kc[b, :n].double()) / 32**0.5
        torch.testing.assert_close(lse[b].double(), s.logsumexp(-1), atol=2e-3, rtol=1e-3)


def test_int_cache_seqlens_and_mqa(backend):
    ctx, device = on(backend)
    q = torch.randn(2, 1, 6, 16, dtype=F16, device=device)
    kc = torch.randn(2, 20, 1, 16, dtype=F16, device=device)
    vc = torch.randn_like(kc)
    with ctx:
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=11)
    ref, _, _ = kvcache_ref(q, kc, vc, cache_seqlens=torch.tensor([11, 11]))
    lowp, _, _ = kvcache_ref(q, kc, vc, cache_seqlens=torch.tensor([11, 11]), upcast=False)
    check_close("int seqlens", out, ref, lowp)


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_varlen_prefill(backend, page, causal):
    """flash_attn_varlen_func with block_table equals the unpaged varlen call on the gathered keys."""
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
        expected = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=1e-3)


def test_paged_varlen_is_forward_only():
    q = torch.randn(4, 2, 16, dtype=F16, requires_grad=True)
    kp = torch.randn(2, 16, 2, 16, dtype=F16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    table = torch.tensor([[0]], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="forward only"):
        tileattn.flash_attn_varlen_func(q, kp, kp, cu, cu, 4, 4, block_table=table)


def test_paged_lookup_inside_the_loop(backend):
    """The full-occupancy variant of the paged kernel (block table read in the same iteration as the
    tile, not one ahead), forced by settings that count on a GPU of a single SM."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    with configs.override(_settings(on(backend)[1], sm_count=1)) as s:
        test_kvcache_matches_reference(backend, "chunk-causal-neox", "page4", 3)
        test_kvcache_matches_reference(backend, "alibi-leftpad", "page16", 1)
    planned = _api_plans(s)
    assert planned and not any(plan[0].constexprs["PREFETCH_TABLE"] for plan in planned)


def test_tma_reads(backend, monkeypatch):
    """K/V tiles through TMA descriptors (DecodeSettings.tma / paged_tma), which the launcher takes only
    for long programs (forced here: tma_tiles=0): contiguous caches, cache_batch_idx, windows, and paged
    caches whose pages hold whole key tiles (pages of 16 and 32 under the interpreter's 16-key tiles;
    with cache_leftpad the pointer loads)."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    with configs.override(_settings(on(backend)[1], tma_tiles=0, tma=True, paged_tma=True)) as s:
        test_kvcache_matches_reference(backend, "decode-no-append", "dense", 3)
        test_kvcache_matches_reference(backend, "batch-idx", "dense", 1)
        test_kvcache_matches_reference(backend, "window-softcap", "page16", 3)
        test_kvcache_matches_reference(backend, "chunk-causal-neox", "page16", 1)
        test_kvcache_matches_reference(backend, "alibi-leftpad", "page16", 3)
        # pages of two tiles: tiles start inside a page (the descriptor row adds the offset in the page)
        monkeypatch.setitem(LAYOUTS, "page32", 32)
        for case in ("decode-no-append", "window-softcap", "chunk-causal-neox"):
            for splits in (1, 3):
                test_kvcache_matches_reference(backend, case, "page32", splits)
    kernels = [plan[0].constexprs for plan in _api_plans(s)]
    assert any(c["USE_TMA"] and not c["PAGED"] for c in kernels)
    assert any(c["USE_TMA"] and c["PAGED"] for c in kernels) or not interpreting()  # (GPU: pages under a tile)


@pytest.mark.parametrize("per_load", [1, 2, 16])
def test_combine_reads_several_splits_per_load(backend, per_load):
    """The split combine reading its partials one or several splits at a time
    (DecodeSettings.combine_splits_per_load), three splits (a masked tail of the last load) and the
    heuristic's count, rows that see no key included."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    from tileattn.kernels.decode.combine import combine_tiles

    assert combine_tiles(3, 128, DecodeSettings(combine_splits_per_load=per_load))[1] == min(per_load, 4)
    with configs.override(_settings(on(backend)[1], combine_splits_per_load=per_load)) as s:
        test_kvcache_matches_reference(backend, "decode-no-append", "page4", 3)
        test_kvcache_matches_reference(backend, "window-softcap", "dense", 3)
        test_kvcache_matches_reference(backend, "decode-rotary", "dense", 0)
    chunks = {plan[1].constexprs["CHUNK"] for plan in _api_plans(s) if plan[1] is not None}
    assert all(chunk <= per_load for chunk in chunks), chunks
    assert chunks or not interpreting()  # (the GPU's 128-key tiles: one split at these lengths)


@st.composite
def kvcache_problems(draw, max_len):
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
    )


def _check_kvcache_problem(backend, pb):
    ctx, device = on(backend)
    b, h, hk, d, cap = pb["batch"], pb["nheads"], pb["nheads_k"], pb["headdim"], pb["capacity"]
    q = torch.randn(b, pb["seqlen_q"], h, d, dtype=F16, device=device)
    args = dict(causal=pb["causal"], window_size=pb["window"], softcap=pb["softcap"], num_splits=pb["num_splits"])
    if pb["page"]:
        pages = -(-cap // pb["page"])
        kc = torch.randn(b * pages + 2, pb["page"], hk, d, dtype=F16, device=device)
        args["block_table"] = torch.randperm(b * pages + 2, device=device)[: b * pages].view(b, pages).int()
    else:
        kc = torch.randn(b, cap, hk, d, dtype=F16, device=device)
    pad = 8 if pb["v_padded"] else 0
    vc = torch.randn(*kc.shape[:-1], d + pad, dtype=F16, device=device)[..., :d]
    args["cache_seqlens"] = torch.tensor(pb["seqlens"], dtype=torch.int32, device=device)
    if pb["seqlen_new"]:
        args["k"] = torch.randn(b, pb["seqlen_new"], hk, d, dtype=F16, device=device)
        args["v"] = torch.randn(b, pb["seqlen_new"], hk, d + pad, dtype=F16, device=device)[..., :d]
    if pb["leftpad"] is not None:
        args["cache_leftpad"] = torch.tensor(pb["leftpad"], dtype=torch.int32, device=device)
    if pb["alibi"]:
        args["alibi_slopes"] = torch.rand(b, h, device=device) * 0.5
    if pb["rotary"]:
        angle = torch.rand(cap + pb["seqlen_q"], d // 4, device=device) * 6.283
        args.update(rotary_cos=angle.cos().to(F16), rotary_sin=angle.sin().to(F16))
        args["rotary_interleaved"] = pb["rotary"] == "interleaved"
    ref_args = {key: val for key, val in args.items() if key != "num_splits"}
    ref, k_ref, v_ref = kvcache_ref(q, kc, vc, **_ref_args(ref_args))
    lowp, _, _ = kvcache_ref(q, kc, vc, upcast=False, **_ref_args(ref_args))
    with ctx:
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, **args)
    check_close(f"{pb} out", out, ref, lowp)
    got = dense_view(kc, args.get("block_table"), k_ref.shape[1])
    assert torch.equal(got, k_ref.to(F16)), f"{pb}: k_cache after append"
    got = dense_view(vc, args.get("block_table"), v_ref.shape[1])
    assert torch.equal(got, v_ref.to(F16)), f"{pb}: v_cache after append"


_KV_EXAMPLES = {"torch": 60, "interpret": 40, "cuda": 40}


@pytest.mark.parametrize("shard", range(PROPERTY_SHARDS))
def test_property_random_kvcache_calls(backend, shard):
    """Random decode / chunked-prefill calls: batch, GQA, head dim, capacity, page size (1 to 16 or
    contiguous), cache lengths (empty and full), new tokens, leftpad, rotary, causal, windows, softcap,
    ALiBi and split counts, against the per-sequence reference."""
    run_property(
        _check_kvcache_problem, kvcache_problems(200 if backend == "cuda" else 40), _KV_EXAMPLES, backend, shard
    )


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


def test_append_kernel_drops_out_of_range_writes():
    """What runs under CUDA graph capture, where the API cannot read index values: the append kernel
    writes rows whose position, cache row and page are in range and drops the others (nothing outside
    the caches is touched). Called directly, bypassing validation."""

    device = _kernel_device()
    from tileattn.kernels import decode

    pool = torch.zeros(4, 4, 1, 16, dtype=F16, device=device)
    before = pool.clone()
    new = torch.ones(3, 2, 1, 16, dtype=F16, device=device)
    table = torch.tensor([[0, 1], [2, 9], [3, -1]], dtype=torch.int32, device=device)  # 9 and -1 are bad pages
    seqlens = torch.tensor([7, 3, 1], dtype=torch.int32, device=device)  # 7 + 1 runs past capacity 8
    decode.kvcache_append(pool, pool.clone(), new, new, None, seqlens, None, table)
    written = (pool != before).any(-1).any(-1)  # (page, slot)
    expected = torch.zeros(4, 4, dtype=torch.bool, device=device)
    expected[1, 3] = True  # seq 0, position 7 -> page 1 slot 3; position 8 is past capacity
    expected[2, 3] = True  # seq 1, position 3 -> page 2 slot 3; position 4 -> page 9 dropped
    expected[3, 1] = expected[3, 2] = True  # seq 2, positions 1, 2 -> page 3
    assert torch.equal(written, expected), written


def test_append_kernel_clamps_rotary_positions():
    """Under CUDA graph capture the API cannot check the rotary tables' length against cache_seqlens:
    the append kernel then rotates a key whose position is past the tables at their last row (never
    reading past them), and writes it where the position says. Called directly, bypassing validation."""
    device = _kernel_device()
    from tileattn.kernels import decode
    from tileattn.rotary import rotary_at

    gen = torch.Generator(device=device).manual_seed(0)
    kc, vc = (torch.zeros(2, 12, 2, 16, dtype=F16, device=device) for _ in range(2))
    new = torch.randn(2, 2, 2, 16, dtype=F16, device=device, generator=gen)
    angle = torch.rand(5, 8, device=device, generator=gen) * 6.283
    cos, sin = angle.cos().to(F16), angle.sin().to(F16)
    seqlens = torch.tensor([2, 7], dtype=torch.int32, device=device)  # positions 2, 3 and 7, 8 of 5 rows
    decode.kvcache_append(kc, vc, new, new, (cos, sin, False), seqlens, None, None)
    positions = (seqlens.long()[:, None] + torch.arange(2, device=device)).clamp(max=4)
    expected = rotary_at(new, cos, sin, positions, False)
    for b in range(2):
        at = int(seqlens[b])
        assert torch.equal(kc[b, at : at + 2], expected[b]), b
        assert torch.equal(vc[b, at : at + 2], new[b]), b


@pytest.mark.parametrize("page", [4, 12, 16, 32])
def test_attention_kernel_clamps_bad_pages(page):
    """What runs under CUDA graph capture, where the API cannot read the block table: the attention
    kernel reads a page number outside the pool (negative or past it) as the pool's last page, never
    memory outside it. Pages of 4 (dividing the interpreter's 16-key tile), 12 (neither dividing it nor
    a multiple of it) and 16 / 32 (whole tiles) take the kernel's three lookups. Called directly,
    bypassing validation."""
    device = _kernel_device()
    from tileattn.kernels import decode

    gen = torch.Generator(device=device).manual_seed(0)
    blocks, num_pages = 3, 5
    q = torch.randn(2, 1, 4, 16, dtype=F16, device=device, generator=gen)
    kp, vp = (torch.randn(num_pages, page, 2, 16, dtype=F16, device=device, generator=gen) for _ in range(2))
    table = torch.tensor([[0, -1, 3], [num_pages, 2, -7]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([3 * page - 1, 2 * page + 1], dtype=torch.int32, device=device)
    p = AttnParams(batch=2, seqlen_q=1, seqlen_k=blocks * page, headdim=16, softmax_scale=0.25)
    for splits in (1, 2):
        c = CacheLayout(seqlens_k=seqlens, block_table=table, max_seqlen_k=blocks * page, num_splits=splits)
        out, _ = decode.attn_fwd_kvcache(q, kp, vp, p, c, configs.current(q.device))
        read = torch.where((table >= 0) & (table < num_pages), table, num_pages - 1)
        k_all, v_all = (dense_view(pool, read, blocks * page) for pool in (kp, vp))
        for b in range(2):
            n = int(seqlens[b])
            k, v = k_all[b : b + 1, :n], v_all[b : b + 1, :n]
            ref = attention_ref(q[b : b + 1], k, v, softmax_scale=0.25, upcast=torch.float64)[0]
            low = attention_ref(q[b : b + 1], k, v, softmax_scale=0.25, upcast=False)[0]
            check_close(f"pages of {page}, splits {splits}, sequence {b}", out[b : b + 1], ref, low)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_attention_kernel_rotates_q_at_clamped_positions(interleaved):
    """The attention kernel rotates q as it reads it (CacheLayout.q_rotary), per token at
    ``cache_seqlens + i``: against q rotated by tileattn.rotary beforehand (as the CPU path does), with
    a partial rotary dim and GQA. Positions past the tables, which only a captured CUDA graph can pass
    (the API refuses them otherwise), read the tables' last row. Called directly, bypassing
    validation."""
    device = _kernel_device()
    from tileattn.kernels import decode
    from tileattn.rotary import rotary_at

    gen = torch.Generator(device=device).manual_seed(0)
    batch, seqlen_q, cap, rot_len, d = 2, 3, 20, 9, 24
    q = torch.randn(batch, seqlen_q, 4, d, dtype=F16, device=device, generator=gen)
    kc, vc = (torch.randn(batch, cap, 2, d, dtype=F16, device=device, generator=gen) for _ in range(2))
    angle = torch.rand(rot_len, 6, device=device, generator=gen) * 6.283  # rotary dim 12 of 24
    cos, sin = angle.cos().to(F16), angle.sin().to(F16)
    seqlens = torch.tensor([4, 11], dtype=torch.int32, device=device)  # 11 + 2 is past the 9 rows
    p = AttnParams(batch=batch, seqlen_q=seqlen_q, seqlen_k=cap, headdim=d, softmax_scale=0.3)
    c = CacheLayout(seqlens_k=seqlens, max_seqlen_k=cap, q_rotary=(cos, sin, interleaved, True))
    out, _ = decode.attn_fwd_kvcache(q, kc, vc, p, c, configs.current(q.device))
    positions = (seqlens.long()[:, None] + torch.arange(seqlen_q, device=device)).clamp(max=rot_len - 1)
    q_rot = rotary_at(q, cos, sin, positions, interleaved)
    for b in range(batch):
        n = int(seqlens[b])
        k, v = kc[b : b + 1, :n], vc[b : b + 1, :n]
        ref = attention_ref(q_rot[b : b + 1], k, v, softmax_scale=0.3, upcast=torch.float64)[0]
        low = attention_ref(q_rot[b : b + 1], k, v, softmax_scale=0.3, upcast=False)[0]
        check_close(f"sequence {b}", out[b : b + 1], ref, low)


def test_offsets_widen_only_past_int32():
    """The decode kernel computes cache offsets in int32 unless one could pass 2**31 (paging.
    offsets_past_int32, from shapes and strides: meta tensors, nothing allocated). The kv head's and
    (contiguous caches) the cache row's starts are int64 in the kernel, so only pages, slots or positions
    and the head dim count; the plan widens them when either cache needs it (its OFFS_64), or for every
    call with DecodeSettings.offs_64_always."""
    from tileattn.kernels.decode import paging, plan

    def cache(shape, strides):
        return torch.empty_strided(shape, strides, dtype=F16, device="meta")

    def pool(pages, stride=16384):
        return cache((pages, 16, 8, 128), (stride, 1024, 128, 1))

    assert not paging.offsets_past_int32(pool(131072), True)  # the last element at 2**31 - 1
    assert paging.offsets_past_int32(pool(131073), True)
    assert paging.offsets_past_int32(pool(2, stride=2**31), True)
    # kv heads outermost: the head's start does not count
    assert not paging.offsets_past_int32(cache((131072, 16, 8, 128), (2048, 128, 2**28, 1)), True)
    assert not paging.offsets_past_int32(cache((0, 16, 8, 128), (16384, 1024, 128, 1)), True)
    # contiguous caches: one row of 2**31 + 1024 elements, against many rows of fewer
    assert paging.offsets_past_int32(cache((1, 2**21 + 1, 8, 128), (0, 1024, 128, 1)), False)
    assert not paging.offsets_past_int32(cache((64, 2**21, 8, 128), (2**31, 1024, 128, 1)), False)

    def offs_64(k_cache, v_cache, **changes):
        q = torch.empty(1, 1, 8, 128, dtype=F16, device="meta")
        table = torch.zeros(1, 4, dtype=torch.int32, device="meta")
        c = CacheLayout(seqlens_k=torch.zeros(1, dtype=torch.int32, device="meta"), block_table=table, max_seqlen_k=64)
        p = AttnParams(batch=1, seqlen_q=1, seqlen_k=64, headdim=128, softmax_scale=0.1)
        s = dataclasses.replace(configs.INTERPRETER, decode=DecodeSettings(**changes))
        return plan.plan_call(q, k_cache, v_cache, p, c, s)[0].constexprs["OFFS_64"]

    small, large = pool(16), pool(131073)
    assert not offs_64(small, small) and offs_64(small, large) and offs_64(large, small)
    assert offs_64(small, small, offs_64_always=True)


@pytest.mark.parametrize("bad", ["split", "general", "prefetch-off", "offsets-64"])
def test_paged_lookup_branches(backend, bad, monkeypatch):
    """The attention kernel's page lookups against the reference (``paging.cache_rows``): pages of 12 and
    24 (neither dividing the interpreter's 16-key tile nor a multiple of it: the per-row lookup), pages
    that divide it (4) or hold whole tiles (16, 32); the table read in the same iteration (no lookahead,
    unmasked reads in unmasked tiles: DecodeSettings.paged_prefetch_waves=0); 64-bit offsets forced on
    small caches (offs_64_always; test_offsets_widen_only_past_int32 checks that either cache widens
    them). With leftpad, windows, chunks and splits."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    from tileattn import kvcache

    kvcache.calls.clear()  # plan every call afresh (earlier tests' plans are kept)
    layouts = {"split": ["page4"], "general": ["page12", "page24"], "prefetch-off": ["page4", "page16"]}
    layouts["offsets-64"] = ["dense", "page4", "page12", "page16", "page32"]
    for name, page in (("page12", 12), ("page24", 24), ("page32", 32)):
        monkeypatch.setitem(LAYOUTS, name, page)
    changes = {"prefetch-off": {"paged_prefetch_waves": 0}, "offsets-64": {"offs_64_always": True}}
    with configs.override(_settings(on(backend)[1], **changes.get(bad, {}))) as s:
        planned = _plans_made(s)
        for layout in layouts[bad]:
            for case, splits in (("window-softcap", 3), ("alibi-leftpad", 1), ("chunk-causal-neox", 3)):
                test_kvcache_matches_reference(backend, case, layout, splits)
        if bad == "offsets-64":  # v_cache with other strides than k_cache's (no shared row offsets)
            for page, leftpad in ((None, None), (4, [0, 3]), (12, [2, 0]), (32, None)):
                problem = dict(batch=2, nheads_k=2, nheads=4, headdim=16, seqlen_q=2, seqlen_new=2, capacity=40)
                problem.update(page=page, seqlens=[30, 9], leftpad=leftpad, rotary="neox", causal=True)
                problem.update(window=(-1, -1), softcap=0.0, alibi=False, num_splits=3, v_padded=True)
                _check_kvcache_problem(backend, problem)
    assert planned and all(plan[0].constexprs["OFFS_64"] == (bad == "offsets-64") for plan in planned)
    # splits over pages smaller than a key tile take every num_splits-th tile; the others consecutive ones
    kernels = [plan[0].constexprs for plan in planned]
    assert all(c["INTERLEAVE"] == (c["SPLIT"] and c["PAGED"] and c["PAGE_SIZE"] < c["BLOCK_N"]) for c in kernels)
    assert any(c["INTERLEAVE"] for c in kernels) or not interpreting()  # (the GPU's 128-key tiles: one split)
    if bad == "prefetch-off":
        assert not any(c["PREFETCH_TABLE"] or c["TABLE_TO_L2"] for c in kernels)


@pytest.mark.parametrize("page, unit", [(4, 1), (12, 1), (4, 2), (12, 3)])
def test_interleaved_splits_partition_the_keys(backend, page, unit, monkeypatch):
    """Splits over pages smaller than a key tile take every num_splits-th tile (or, with
    DecodeSettings.interleave_unit, runs of that many tiles in turn): against the reference and against
    one split's LSE (a tile read by two splits, or by none, moves it), with several tiles per split in
    each mask segment: left and two-sided windows, causal over several query tokens, leftpad, an empty
    sequence, split counts that do not divide the tiles."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    from tileattn import kvcache

    device = on(backend)[1]
    s = _settings(device, interleave_unit=unit)
    kvcache.calls.clear()  # plan every call afresh (earlier tests' plans are kept)
    planned = _plans_made(s)
    block_n = 16 if interpreting() else 128  # (the GPU's 5 and 7 splits take 64-key tiles: more per split)
    b, h, hk, d, cap = 3, 4, 2, 16, 12 * block_n + 8
    pages = -(-cap // page)
    kc = torch.randn(b * pages + 2, page, hk, d, dtype=F16, device=device)
    vc = torch.randn_like(kc)
    table = torch.randperm(b * pages + 2, device=device)[: b * pages].view(b, pages).int()
    seqlens = torch.tensor([0, 8 * block_n + 3, cap], dtype=torch.int32, device=device)
    leftpad = torch.tensor([0, 2 * block_n + 5, 9], dtype=torch.int32, device=device)
    cases = [  # (window, causal, leftpad, query tokens, splits)
        ((6 * block_n, 0), False, True, 1, 3),
        ((4 * block_n + 6, 3 * block_n), False, False, 5, 5),
        ((-1, -1), True, True, 5, 3),
        ((9 * block_n, -1), True, False, 1, 5),
        ((-1, -1), False, False, 1, 7),
        ((cap - 6, -1), False, False, 1, 2),  # the last sequence's unmasked tiles start at tile 1 (mid-run)
    ]
    for window, causal, pad, sq, splits in cases:
        q = torch.randn(b, sq, h, d, dtype=F16, device=device)
        args = dict(cache_seqlens=seqlens, block_table=table, causal=causal, window_size=window)
        if pad:
            args["cache_leftpad"] = leftpad
        ref, _, _ = kvcache_ref(q, kc, vc, **args)
        with on(backend)[0], configs.override(s):
            _, lse1 = tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=1, return_softmax_lse=True, **args)
            out, lse = tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=splits, return_softmax_lse=True, **args)
        split_kernels = [plan[0].constexprs for plan in planned if plan[0].constexprs["SPLIT"]]
        assert split_kernels and all(c["INTERLEAVE"] and c["UNIT"] == unit for c in split_kernels)
        torch.testing.assert_close(out.float(), ref.float().nan_to_num(0), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, lse1, atol=1e-3, rtol=1e-3)


def _gpu_plan(batch, cache_len, page, headdim=128, num_splits=0, s=None, **changes):
    """The split kernel's constexprs and grid as ``kernels.decode`` plans a decode step (GQA 32/8, one
    query token, bf16, full caches) under settings ``s``, by default the H200's for a GPU of 132 SMs
    with these ``DecodeSettings`` fields changed: CPU tensors, nothing launched."""
    from tileattn.kernels.decode import plan

    if s is None:
        s = dataclasses.replace(
            configs.HOPPER, decode=dataclasses.replace(configs.HOPPER.decode, sm_count=132, **changes)
        )
    nheads, nheads_k = 32, 8
    q = torch.empty(batch, 1, nheads, headdim, dtype=torch.bfloat16)
    table = None
    if page:
        cache = torch.empty(batch * cache_len // page, page, nheads_k, headdim, dtype=torch.bfloat16)
        table = torch.arange(batch * cache_len // page, dtype=torch.int32).view(batch, -1)
    else:
        cache = torch.empty(batch, cache_len, nheads_k, headdim, dtype=torch.bfloat16)
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32)
    p = AttnParams(batch=batch, seqlen_q=1, seqlen_k=cache_len, headdim=headdim, softmax_scale=0.1)
    c = CacheLayout(seqlens_k=seqlens, block_table=table, num_splits=num_splits, max_seqlen_k=cache_len)
    attn, _ = plan.plan_call(q, cache, cache, p, c, s)
    return attn.constexprs, attn.grid


def test_gpu_plans_of_short_programs():
    """On the GPU (planned here on the CPU with the H200's settings, as for 132 SMs), one wave of
    programs with at most four 128-key tiles (eight unless the pages are smaller than such a tile) takes
    64-key tiles (DecodeSettings.short_block_n), and paged programs in grids under two waves prefetch
    their table sectors into L2 (paged_table_l2); the interpreter takes neither (its tests run 16-key
    tiles)."""
    cases = [  # (batch, cache length, page, head dim, num_splits): block_n, interleave, table to L2, grid
        ((1, 8192, None, 128, 0), (64, False, False, (1, 8, 16))),  # four tiles per program
        ((1, 8192, 16, 128, 0), (64, True, True, (1, 8, 16))),
        ((1, 8192, 64, 128, 0), (64, False, True, (1, 8, 16))),  # pages of 64: whole 64-key tiles
        ((1, 8192, 256, 128, 0), (64, False, True, (1, 8, 16))),
        ((1, 16384, None, 128, 0), (64, False, False, (1, 8, 16))),  # eight tiles
        ((1, 16384, 16, 128, 0), (128, True, True, (1, 8, 16))),  # small pages: four at most
        ((1, 16384, 256, 128, 0), (64, False, True, (1, 8, 16))),
        ((1, 32768, None, 128, 0), (128, False, False, (1, 8, 16))),  # sixteen tiles
        ((1, 8192, None, 128, 16), (64, False, False, (1, 8, 16))),  # 128 programs: one wave
        ((1, 8192, None, 128, 17), (128, False, False, (1, 8, 17))),  # 136: more than one wave
        ((1, 8192, 16, 256, 0), (64, True, True, (1, 8, 16))),  # head dim 256's tiles are 64 keys anyway
        ((64, 4096, 16, 128, 0), (128, False, False, (1, 512, 1))),  # full grid: no split, no prefetch
    ]
    for (batch, length, page, d, splits), (block_n, interleave, to_l2, grid) in cases:
        constexprs, got_grid = _gpu_plan(batch, length, page, d, splits)
        got = (constexprs["BLOCK_N"], constexprs["INTERLEAVE"], constexprs["TABLE_TO_L2"], got_grid)
        assert got == (block_n, interleave, to_l2, grid), (batch, length, page, d, splits)
    constexprs, _ = _gpu_plan(1, 8192, 16, short_block_n=0, paged_table_l2=False)
    assert (constexprs["BLOCK_N"], constexprs["INTERLEAVE"], constexprs["TABLE_TO_L2"]) == (128, True, False)
    interpreter = dataclasses.replace(configs.INTERPRETER, decode=DecodeSettings(sm_count=132))
    constexprs, _ = _gpu_plan(1, 8192, 16, s=interpreter)
    assert (constexprs["BLOCK_N"], constexprs["TABLE_TO_L2"]) == (16, False)


@pytest.mark.parametrize("unit", [1, 2])
def test_interleaved_splits_skip_empty_segments(backend, unit, monkeypatch):
    """A mask segment clamped to the end of a sequence's keys starts inside a tile and is empty: no
    split may read that tile again (found on the GPU by the property test, with runs of two tiles:
    window (0, 0), two keys, pages of 1)."""
    from tileattn import kvcache

    kvcache.calls.clear()
    problem = dict(batch=3, nheads_k=1, nheads=1, headdim=16, seqlen_q=1, seqlen_new=1, capacity=129, page=1)
    problem.update(seqlens=[0, 0, 1], leftpad=[0, 0, 0], rotary=None, causal=False, window=(0, 0), softcap=0.0)
    problem.update(alibi=False, v_padded=False)
    with configs.override(_settings(on(backend)[1], interleave_unit=unit)):
        for splits in (2, 3):
            _check_kvcache_problem(backend, dict(problem, num_splits=splits))


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


def test_append_past_int32_head_offsets(big_gpu_memory):
    """The append kernel writes a new key of a kv head that starts past 2**31 elements (kv heads
    outermost) where it belongs: its head offset is 64-bit. The cache is a view into a larger buffer
    that is allocated lazily (only touched pages take memory), so a wrapped int32 offset would land
    inside the buffer, at the place checked to stay zero. Called directly."""
    device = _kernel_device()
    from tileattn.kernels import decode

    heads, cap, d = 3, 4, 16
    head_stride, start = 2**30 + 2**29, 2**31  # head 2 starts at 2 * head_stride > 2**31
    buf = torch.empty(start + 2 * head_stride + cap * d, dtype=F16, device=device)
    kc = buf.as_strided((1, cap, heads, d), (cap * d, d, head_stride, 1), storage_offset=start)
    vc = torch.zeros(1, cap, heads, d, dtype=F16, device=device)
    right = start + 2 * head_stride + d  # head 2, position 1
    wrapped = start + ((2 * head_stride + d + 2**31) % 2**32 - 2**31)
    for at in (right, wrapped):
        buf[at : at + d] = 0
    new = torch.full((1, 1, heads, d), 7.0, dtype=F16, device=device)
    seqlens = torch.tensor([1], dtype=torch.int32, device=device)
    decode.kvcache_append(kc, vc, new, new.clone(), None, seqlens, None, None)
    assert torch.equal(buf[right : right + d], new[0, 0, 2])
    assert not buf[wrapped : wrapped + d].any()
    assert torch.equal(kc[0, 1], new[0, 0]) and torch.equal(vc[0, 1], new[0, 0])


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


def _api_plans(s: Settings | None = None) -> list:
    """The launch plans (each a (split kernel, combine) pair of ``decode.plan.Launch``) that
    flash_attn_with_kvcache keeps in its tables per call signature, for calls under settings ``s``
    (None: any)."""
    from tileattn import kvcache
    from tileattn.kernels.decode import plan

    return [launches for call in list(kvcache.calls.values()) for launches in plan.plans_in(call.plans, s)]


class _plans_made:
    """The launch plans ``_api_plans(s)`` holds that it did not when this was made: those planned since
    (a live list: ``len``, iteration and indexing read the tables again)."""

    def __init__(self, s: Settings | None = None):
        self.s = s
        self.before = _api_plans(s)  # (kept: their ids stay unique)
        self.seen = {id(launches) for launches in self.before}

    def _now(self) -> list:
        return [launches for launches in _api_plans(self.s) if id(launches) not in self.seen]

    def __len__(self):
        return len(self._now())

    def __iter__(self):
        return iter(self._now())

    def __getitem__(self, i):
        return self._now()[i]


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
        ref, k_ref, _ = kvcache_ref(q, kc.clone(), vc.clone(), **_ref_args(call))
        lowp, _, _ = kvcache_ref(q, kc.clone(), vc.clone(), upcast=False, **_ref_args(call))
        with on(backend)[0]:
            out = tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=2, **call)
        check_close(f"step {seqlens}", out, ref, lowp)
        assert torch.equal(dense_view(kc, args["block_table"], k_ref.shape[1]), k_ref.to(F16))

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
        strided = torch.randn(*q.shape[:3], 2 * q.shape[3], dtype=F16, device=device)[..., ::2]
        with pytest.raises(ValueError, match="contiguous in its last"):
            tileattn.flash_attn_with_kvcache(strided, kc, vc, num_splits=2, **args)
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


@pytest.mark.parametrize("max_values, max_rows", [(8192, 16), (16384, 16), (16384, 4)])
def test_combine_tiles_stay_small(max_values, max_rows):
    """_combine's [rows, splits, head dim] loads hold at most DecodeSettings.combine_max_values values, in
    powers of two, for any combine_splits_per_load and split count (up to the 128 splits allowed), and
    at most combine_max_rows rows."""
    from tileattn.kernels.decode.combine import combine_tiles

    limits = DecodeSettings(combine_max_values=max_values, combine_max_rows=max_rows)
    for per_load in (1, 3, 16, 128, 1000):
        d = dataclasses.replace(limits, combine_splits_per_load=per_load)
        for splits in (2, 5, 16, 128):
            for block_d in (16, 128, 256):
                rows, chunk = combine_tiles(splits, block_d, d)
                assert rows & (rows - 1) == 0 and chunk & (chunk - 1) == 0
                assert chunk == 1 or rows * chunk * block_d <= max_values, (per_load, splits, block_d, rows, chunk)
                assert chunk <= max(per_load, 1) * 2 and chunk <= 2 * splits
                assert rows <= max_rows
    if max_rows == 16:
        assert combine_tiles(16, 128, limits) == ((8, 16) if max_values == 16384 else (4, 16))  # (1 x 8k's)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launches run on the GPU")
@pytest.mark.parametrize("leftpad", [False, True])
def test_attention_reads_inputs_written_just_before(leftpad):
    """In a CUDA graph (no host checks, no syncs) each call comes right after torch kernels that rewrite
    its q, cache_seqlens, cache_leftpad and block table in place. The attention kernel, a programmatic
    dependent launch of the last of them on sm90+ (DecodeSettings.pdl_attn: it may start before they end),
    must read the new values: every output equals an eager one-split call on the same inputs. Pages of
    16 at 1 x 8k: the short, interleaved build whose table prefetch goes out before the wait."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    batch, pages_per_seq, page, steps = 2, 512, 16, 8
    pages = batch * pages_per_seq
    kc = torch.randn(pages, page, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    qs = torch.randn(steps, batch, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    tables = torch.stack([torch.randperm(pages, device=dev, generator=gen).int().view(batch, -1) for _ in range(steps)])
    lens = torch.randint(1, pages_per_seq * page + 1, (steps, batch), device=dev, dtype=torch.int32, generator=gen)
    pads = (torch.rand(steps, batch, device=dev, generator=gen) * lens * 0.5).int()
    q, table, seqlens, pad = qs[0].clone(), tables[0].clone(), lens[0].clone(), pads[0].clone()

    def step(i):
        q.copy_(qs[i])
        seqlens.copy_(lens[i])
        pad.copy_(pads[i])
        table.copy_(tables[i])  # (the kernel right before the attention kernel)
        return tileattn.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, block_table=table, cache_leftpad=pad if leftpad else None
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [step(i) for i in range(steps)]
    graph.replay()
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        want = tileattn.flash_attn_with_kvcache(
            qs[i],
            kc,
            vc,
            cache_seqlens=lens[i],
            block_table=tables[i],
            cache_leftpad=pads[i] if leftpad else None,
            num_splits=1,
        )
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=0, msg=f"step {i}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and streams run on the GPU")
def test_split_decoding_under_graphs_streams_and_pages():
    """Split decoding at sizes that split on the GPU: split counts that change from call to call, a
    CUDA graph of split calls replayed on new queries, two streams decoding at once, and paged caches
    (pages of 16 and 256, the five-stage build for long programs and interleaved splits included) all
    match the unsplit call on the contiguous cache."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(4, 1, 16, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(4, 4096, 4, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(4, 4096, 4, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor([4096, 1, 2047, 700], dtype=torch.int32, device=dev)

    def call(q, splits, **paged):
        k, v = paged.pop("caches", (kc, vc))
        return tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=splits, **paged)

    def close(got, want):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)

    want = call(q, 1)
    for splits in [2, 7, 16, 3, 23, 16, 5] * 3:
        close(call(q, splits), want)
    for page in (16, 256):
        perm = torch.randperm(4 * 4096 // page, device=dev, generator=gen)
        table = perm.view(4, -1).int()
        kp, vp = (torch.empty_like(x).view(-1, page, 4, 64) for x in (kc, vc))
        kp[perm], vp[perm] = kc.reshape(-1, page, 4, 64), vc.reshape(-1, page, 4, 64)
        for splits in (1, 2, 7, 23, 0):  # (pages of 16: every num_splits-th key tile)
            close(call(q, splits, caches=(kp, vp), block_table=table), want)

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
            close(out, call(x, 1))

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
            close(out, want)


def test_launch_key_covers_what_triton_specialises():
    """kernels.launch.Launcher's key: wherever Triton's own specialisation of an argument differs
    (native_specialize_impl, what JITFunction.run's binder calls), the keys differ; tensors enter by
    dtype and 16-byte alignment (not by address or subclass), floats by type, do_not_specialize
    parameters by type and int range; constexprs and options are part of the key."""
    from types import SimpleNamespace

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from tileattn.kernels.launch import Launcher

    def launcher(by_type):  # seed marked do_not_specialize, or no parameter marked (the two key paths)
        params = [SimpleNamespace(do_not_specialize=by_type and name == "seed") for name in ("X", "n", "scale", "seed")]
        return Launcher(SimpleNamespace(params=params, arg_names=["X", "n", "scale", "seed", "BLOCK"]))

    plain, marked = launcher(False), launcher(True)

    def key(x, n=64, scale=0.5, seed=7, block=16, warps=4, on=marked):
        return on._key((x, n, scale, seed), {"BLOCK": block}, {"num_warps": warps})

    a, b = torch.zeros(64, dtype=F16), torch.ones(64, dtype=F16)
    for which in (plain, marked):
        assert key(a, on=which) == key(b, on=which) == key(a, scale=2.0, on=which)
        assert key(torch.nn.Parameter(a), on=which) == key(a, on=which)
        assert key(a[1:], on=which) != key(a, on=which)  # 2 bytes off: not 16-byte aligned
        assert key(a[8:], on=which) == key(a, on=which)  # 16 bytes off: aligned
        assert key(a.float(), on=which) != key(a, on=which)
        assert key(a, block=32, on=which) != key(a, on=which) != key(a, warps=8, on=which)
    assert key(a) == key(a, seed=8)

    def triton_spec(value, specialize=True):
        return native_specialize_impl(BaseBackend, value, False, specialize, True)

    values = [0, 1, 2, 16, 17, 2**31, 2**40, 2**63, -1, True, False, 0.5, 1.0, None]
    for u in values:
        for w in values:
            if triton_spec(u) != triton_spec(w):
                assert key(a, n=u) != key(a, n=w), (u, w)
                assert key(a, n=u, on=plain) != key(a, n=w, on=plain), (u, w)
                assert key(a, seed=u, on=plain) != key(a, seed=w, on=plain), (u, w)
            if triton_spec(u, False) != triton_spec(w, False):
                assert key(a, seed=u) != key(a, seed=w), (u, w)


def test_launches_take_the_direct_path_by_default(monkeypatch):
    """Outside the interpreter and without Triton hooks, debug or instrumentation, launches skip
    JITFunction.run (Triton 3.6's launch hooks are empty HookChains by default, not None)."""
    from types import SimpleNamespace

    from triton import knobs

    from tileattn.kernels import launch

    # (plain_run_needed is also true under the interpreter, which runs these tests on CPU: ask the rest)
    fn = SimpleNamespace(pre_run_hooks=[])
    assert not launch._hooks_set(fn)
    fn.pre_run_hooks.append(print)
    assert launch._hooks_set(fn)
    fn.pre_run_hooks.clear()
    for knob, name, value in ((knobs.runtime, "debug", True), (knobs.compilation, "instrumentation_mode", "x")):
        with monkeypatch.context() as patch:
            patch.setattr(knob, name, value)
            assert launch._hooks_set(fn), name
    assert not launch._hooks_set(fn)
    hook = lambda *args: None  # noqa: E731
    if hasattr(knobs.runtime.launch_enter_hook, "add"):
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert launch._hooks_set(fn)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        assert launch._hooks_set(fn)


def test_bound_launches_install_the_scratch_allocator_in_each_context():
    """Triton keeps its scratch allocator per context (thread, asyncio task). A planned launch of a build
    that needs scratch (TMA descriptors made on the device) installs one in the context it runs in, also
    when the plan was made in another."""
    import contextvars
    import threading
    from types import SimpleNamespace

    from triton.runtime import _allocation

    from tileattn.kernels import launch

    class Recorder:
        fn = SimpleNamespace(pre_run_hooks=[])
        calls = []

        def __call__(self, grid, args, constexprs, **options):
            self.calls.append(isinstance(_allocation._allocator.get(), _allocation.NullAllocator))

    def bound(scratch):
        kernel = SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=scratch))  # (no C entry point)
        return launch.Bound(Recorder(), (1, 1, 1), (), kernel, (), {}, {})

    def fresh(fn):
        ctx = contextvars.copy_context()
        ctx.run(_allocation._allocator.set, _allocation.NullAllocator())
        ctx.run(fn)

    fresh(lambda: bound(0)(()))
    fresh(lambda: bound(128)(()))
    thread = threading.Thread(target=bound(128), args=((),))
    thread.start()
    thread.join()
    assert Recorder.calls == [True, False, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a full grid of decode programs runs on the GPU")
def test_full_grid_two_stage_build():
    """Contiguous decode in a full grid of short programs (34 sequences x 8 kv heads, 4k keys, head dim
    128) takes the two-stage build (DecodeSettings.full_grid_stages); it matches the three-stage build
    and the reference."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(34, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    kc, vc = (torch.randn(34, 4096, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    seqlens = torch.randint(3000, 4097, (34,), dtype=torch.int32, device=dev, generator=gen)
    s = configs.current(q.device)
    planned = _plans_made(s)
    two = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    with configs.override(_settings(dev, full_grid_stages=0)) as s3:
        planned3 = _plans_made(s3)
        three = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    assert [plan[0].options["num_stages"] for plan in list(planned) + list(planned3)] == [2, 3]
    torch.testing.assert_close(two.float(), three.float(), atol=2e-2, rtol=0)
    for b in (0, 33):
        n = int(seqlens[b])
        ref = attention_ref(q[b : b + 1], kc[b : b + 1, :n], vc[b : b + 1, :n], upcast=torch.float64)[0]
        low = attention_ref(q[b : b + 1], kc[b : b + 1, :n], vc[b : b + 1, :n], upcast=False)[0]
        check_close(f"full grid, sequence {b}", two[b : b + 1], ref, low)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="caches of 4-10 GiB on the GPU")
@pytest.mark.parametrize("layout", ["pages16", "pages256", "heads-outer", "pages16-heads-outer"])
def test_cache_offsets_past_int32(layout, big_gpu_memory):
    """Caches of more than 2**31 elements, keys stored past element 2**31 read where they are, against
    the reference:
    - a pool of pages of 16 or 256 (x 8 heads x 128) read at its last pages: 64-bit offsets (OFFS_64);
    - kv heads outermost (a contiguous cache, and a pool of pages of 16): the last kv head starts past
      2**31 while offsets within a head fit int32, so the head's start is what must be 64-bit."""
    planned = _plans_made()
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    if layout == "heads-outer":
        capacity = 2**21 + 2**19  # head 7 starts at 7 * 2 * capacity * 128 > 2**31 (10 GiB per cache)
        kc, vc = (torch.zeros(8, 2, capacity, 128, **bf16).permute(1, 2, 0, 3) for _ in range(2))
        start = torch.tensor([5, capacity - 300], dtype=torch.int32, device=dev)
        seqlens = torch.tensor([400, capacity - 3], dtype=torch.int32, device=dev)
        for c in (kc, vc):
            c[0, :400].normal_(generator=gen)
            c[1, capacity - 300 :].normal_(generator=gen)
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, cache_leftpad=start)
        keys = [tuple(c[b : b + 1, int(start[b]) : int(seqlens[b])] for c in (kc, vc)) for b in range(2)]
        widened = False
    else:
        page = 256 if layout == "pages256" else 16
        if layout == "pages16-heads-outer":
            pages = (2**21 + 2**19) // page
            kc, vc = (torch.zeros(8, pages, page, 128, **bf16).permute(1, 2, 0, 3) for _ in range(2))
        else:
            pages = 2**31 // (page * 1024) + 1
            kc, vc = (torch.zeros(pages, page, 8, 128, **bf16) for _ in range(2))
        per_seq = 4096 // page
        table = torch.arange(pages - 2 * per_seq, pages, device=dev, dtype=torch.int32).flip(0).view(2, per_seq)
        for c in (kc, vc):
            c[pages - 2 * per_seq :].normal_(generator=gen)
        seqlens = torch.tensor([4000, 1111], dtype=torch.int32, device=dev)
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)
        k_all, v_all = (dense_view(pool, table, 4096) for pool in (kc, vc))
        keys = [(k_all[b : b + 1, : int(seqlens[b])], v_all[b : b + 1, : int(seqlens[b])]) for b in range(2)]
        widened = layout != "pages16-heads-outer"
    assert planned and all(plan[0].constexprs["OFFS_64"] == widened for plan in planned)
    for b, (k, v) in enumerate(keys):
        ref = attention_ref(q[b : b + 1], k, v, upcast=torch.float64)[0]
        low = attention_ref(q[b : b + 1], k, v, upcast=False)[0]
        check_close(f"offsets past int32, {layout}, sequence {b}", out[b : b + 1], ref, low)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TMA builds run on the GPU")
def test_planned_tma_launch_in_another_thread():
    """A decode call planned in one thread (pages of 256 through TMA descriptors, which need Triton's
    scratch allocator) runs again from a new thread, whose context has no allocator yet."""
    import contextvars
    import threading

    dev = "cuda"
    s = _settings(dev, paged_tma=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    kc, vc = (torch.randn(17, 256, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    table = torch.randperm(17, device=dev, generator=gen)[:16].view(1, 16).int()
    seqlens = torch.tensor([4000], dtype=torch.int32, device=dev)
    planned = _plans_made(s)

    def call():
        with configs.override(s):  # (in the new thread's context too)
            return tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=1)

    first = call()
    assert [plan[0].constexprs["USE_TMA"] for plan in planned] == [True]
    results = []
    # (in a new, empty context: without an allocator whatever a thread inherits)
    thread = threading.Thread(target=lambda: contextvars.Context().run(lambda: results.append(call())))
    thread.start()
    thread.join()
    assert len(results) == 1 and torch.equal(results[0], first) and len(planned) == 1


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("fill", [-1, 2**31 - 1])
def test_table_entries_past_a_sequence_are_not_read(backend, fill, page, num_splits):
    """Block-table entries past the pages a sequence's keys (and new tokens) cover may hold anything
    (flash_attn: only those entries are read); PagedKVCache pads short rows with -1. The call with such
    entries matches the one whose table holds real pages there, output and pool alike."""
    _, device = on(backend)
    q, kc, vc, args = _inputs(5, 5, {"causal": True, "rotary": "interleaved"}, page, device)
    table = args["block_table"]
    ends = args["cache_seqlens"].long() + 5
    used = (ends + page - 1) // page
    padded = table.clone()
    padded[torch.arange(table.shape[1], device=device) >= used.unsqueeze(1)] = fill
    assert (padded == fill).any()
    outs, pools = [], []
    for tb in (table, padded):
        k_pool, v_pool = kc.clone(), vc.clone()
        call = {**args, "block_table": tb, "num_splits": num_splits}
        with on(backend)[0]:
            outs.append(tileattn.flash_attn_with_kvcache(q, k_pool, v_pool, **call))
        pools.append((k_pool, v_pool))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])


def test_window_sides_as_wide_as_the_keys_are_unbounded(backend):
    """As in flash_attn, a window side at least the call's key length (k's seqlen, max_seqlen_k, or the
    cache capacity) is unbounded: with more queries than keys, (-1, seqlen_k) is no window at all, while
    (-1, seqlen_k - 1) hides every key from the first rows (the diagonal lies left of the keys)."""
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
        with on(backend)[0]:
            plain, wide, narrow = call((-1, -1)), call((-1, 4)), call((-1, 3))
        assert torch.equal(plain, wide), name
        assert (narrow[0, 0] == 0).all() and not (plain[0, 0] == 0).all(), name
        ref, _ = attention_ref(q, k, v, window_size=(-1, 4))
        check_close(f"{name} wide window", wide, ref, attention_ref(q, k, v, window_size=(-1, 4), upcast=False)[0])


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
