"""FP8 (e4m3) KV caches: ``flash_attn_with_kvcache`` with ``k_descale`` / ``v_descale`` against the
per-sequence reference on the dequantized caches (the tolerance rule, the PyTorch error being the
reference's in q's precision on the same values), the append's quantization, contiguous and paged caches,
split-KV, ``PagedKVCache(dtype=torch.float8_e4m3fn)``, and bad input (the caches untouched)."""

import pytest
import torch

import tileattn
from helpers import check_lse, check_refused, on
from kvcache_cases import CASES, LAYOUTS, _inputs, _kernel_device, _settings
from kvcache_ref import dense_view, kvcache_ref
from tileattn.cache import PagedKVCache
from tileattn.kernels import configs
from tileattn.testing import check_close

E4M3 = torch.float8_e4m3fn
FP8_CASES = ["decode-no-append", "window-softcap", "alibi-leftpad", "batch-idx"]


def _quantized(x, descale):
    """What the append writes for rows ``x (batch, n, nheads_k, d)`` of sequences with ``descale (batch,
    nheads_k)``: x / descale, saturated, rounded to nearest e4m3."""
    return (x.float() / descale[:, None, :, None]).clamp(-448, 448).to(E4M3)


def _dequantized_dense(cache, args, capacity, descale):
    """The FP8 cache's values for each sequence of the call, ``(batch, capacity, nheads_k, d)`` fp32."""
    dense = dense_view(cache, args.get("block_table"), capacity)
    if "cache_batch_idx" in args:
        dense = dense[args["cache_batch_idx"].long()]
    return dense.float() * descale[:, None, :, None]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_cache_matches_reference(backend, case, layout, num_splits, q_e4m3=False, p_e4m3=False, sink=False):
    """(q_e4m3: the call quantizes q's rows to e4m3, so the PyTorch error that sets the bound is that of
    the same rows quantized as ``_rows_e4m3`` does; p_e4m3: it rounds the probabilities to e4m3 too, so
    that error is plain FP8 attention's, its probabilities in e4m3 as the oracle's ``probs_dtype`` does;
    sink: with attention sinks.)"""
    seqlen_q, seqlen_new, opts = CASES[case]
    if opts.get("batch_idx") and LAYOUTS[layout]:
        pytest.skip("cache_batch_idx is for contiguous caches")
    ctx, device = on(backend)
    q, kc, vc, args = _inputs(seqlen_q, seqlen_new, opts, LAYOUTS[layout], device)
    batch, hk = q.shape[0], kc.shape[2]
    kd = 0.01 + 0.02 * torch.rand(batch, hk, device=device)
    vd = 0.01 + 0.02 * torch.rand(batch, hk, device=device)
    kc8, vc8 = (kc * 4).to(E4M3), vc.to(E4M3)  # (values of a few units: e4m3's normal range)
    before_k, before_v = kc8.clone(), vc8.clone()
    if sink:
        args["learnable_sink"] = torch.randn(q.shape[2], device=device)
    with ctx:
        out, lse = tileattn.flash_attn_with_kvcache(
            q, kc8, vc8, num_splits=num_splits, return_softmax_lse=True, k_descale=kd, v_descale=vd, **args
        )
    assert out.dtype == q.dtype
    capacity = args["block_table"].shape[1] * kc.shape[1] if "block_table" in args else kc.shape[1]
    seqlens = args["cache_seqlens"]
    if seqlen_new:  # the appended rows, quantized with their sequence's descales; the rest untouched
        for new, cache, before, d in ((args["k"], kc8, before_k, kd), (args["v"], vc8, before_v, vd)):
            got = dense_view(cache, args.get("block_table"), capacity)
            old = dense_view(before, args.get("block_table"), capacity)
            if "cache_batch_idx" in args:
                got, old = got[args["cache_batch_idx"].long()], old[args["cache_batch_idx"].long()]
            expected = old.clone().view(torch.uint8)
            for b, n in enumerate(seqlens.tolist()):
                expected[b, n : n + seqlen_new] = _quantized(new, d)[b].view(torch.uint8)
            assert torch.equal(got.view(torch.uint8), expected), "the FP8 append differs from x / descale in e4m3"
    else:
        assert torch.equal(kc8.view(torch.uint8), before_k.view(torch.uint8))
    # the reference over the caches after the append, dequantized per sequence (nothing left to append)
    ref_args = {key: val for key, val in args.items() if key not in ("k", "v", "block_table", "cache_batch_idx")}
    ref_args["cache_seqlens"] = seqlens + seqlen_new
    kf, vf = _dequantized_dense(kc8, args, capacity, kd), _dequantized_dense(vc8, args, capacity, vd)
    ref = kvcache_ref(q, kf, vf, **ref_args)
    q_lowp = _rows_e4m3(q) if q_e4m3 else q
    probs = {"probs_dtype": E4M3} if p_e4m3 else {}
    ref_lowp = kvcache_ref(q_lowp, kf.to(q.dtype), vf.to(q.dtype), precision=None, **probs, **ref_args)
    check_close(f"fp8 cache {case} {layout}", out, ref.out, ref_lowp.out)
    check_lse(f"fp8 cache {case} {layout} lse", lse, ref.lse, ref_lowp.lse)


def _rows_e4m3(q):
    """q with each row (of the head dim) through e4m3 by its own factor, amax / 448, in q's dtype."""
    amax = q.float().abs().amax(-1, keepdim=True)
    factor = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return ((q.float() / factor).clamp(-448, 448).to(E4M3).float() * factor).to(q.dtype)


@pytest.mark.parametrize("widen", ["q", "f16", "fp8", "none"])
def test_fp8_cache_widenings(widen):
    """Each way the decode kernel widens FP8 tiles (DecodeSettings.fp8_widen), paged and split: the launches
    build the setting's way (WIDEN), and compute what the reference does ("fp8": with q's rows in e4m3;
    "none": and the probabilities)."""
    from tileattn import kvcache
    from tileattn.kernels.decode import plan

    device = _kernel_device()
    kvcache.calls.clear()
    with configs.override(_settings(device, fp8_widen=widen)):
        backend = "cuda" if device == "cuda" else "interpret"
        for splits, sink in ((3, False), (1, True)):  # (one split: the sinks are the split kernel's to add)
            test_fp8_cache_matches_reference(
                backend, "alibi-leftpad", "page4", splits, widen in ("fp8", "none"), widen == "none", sink
            )
    built = [attn.constexprs["WIDEN"] for call in kvcache.calls.values() for attn, _ in plan.plans_in(call.plans)]
    assert built and set(built) == {{"q": 0, "f16": 1, "fp8": 2, "none": 3}[widen]}, built


def test_paged_kv_cache_fp8_steps(backend):
    """Prefill then decode steps through an FP8 PagedKVCache: each step matches the reference over the
    values the pool holds, with the pool's descales."""
    device = on(backend)[1]
    hk, h, d = 2, 4, 32
    cache = PagedKVCache(
        2, 16, 8, hk, d, dtype=E4M3, device=device, k_descale=torch.tensor([0.02, 0.05]), v_descale=0.03
    )
    assert cache.k.dtype == E4M3 and cache.k_descale.shape == (2, hk)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    for step_len in (11, 1, 1):
        step = cache.append(seqs, step_len)
        q = torch.randn(2, step_len, h, d, dtype=torch.float16, device=device)
        k, v = (torch.randn(2, step_len, hk, d, dtype=torch.float16, device=device) for _ in range(2))
        for layer in range(2):
            kw = step.kwargs(layer)
            assert kw["k_descale"].shape == (2, hk) and kw["k_descale"].is_contiguous()
            with on(backend)[0]:
                out = tileattn.flash_attn_with_kvcache(q, k=k, v=v, causal=True, **kw)
            lengths = step.cache_seqlens + step_len
            capacity = step.block_table.shape[1] * 8
            kf = dense_view(kw["k_cache"], step.block_table, capacity).float() * kw["k_descale"][:, None, :, None]
            vf = dense_view(kw["v_cache"], step.block_table, capacity).float() * kw["v_descale"][:, None, :, None]
            ref = kvcache_ref(q, kf, vf, cache_seqlens=lengths, causal=True)
            ref_lowp = kvcache_ref(q, kf.half(), vf.half(), cache_seqlens=lengths, causal=True, precision=None)
            check_close(f"paged fp8 step {step_len} layer {layer}", out, ref.out, ref_lowp.out)


def _cache_call(**kw):
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    kc = kw.pop("k_cache", torch.zeros(2, 8, 2, 16, dtype=E4M3))
    vc = kw.pop("v_cache", torch.zeros(2, 8, 2, 16, dtype=E4M3))
    return lambda: tileattn.flash_attn_with_kvcache(kw.pop("q", q), kc, vc, cache_seqlens=3, **kw)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (_cache_call(v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16)), TypeError, ["v_cache", "float8_e4m3fn"]),
        (_cache_call(v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.float8_e5m2)), TypeError, ["e5m2"]),
        (_cache_call(q=torch.zeros(2, 1, 4, 16, dtype=E4M3)), TypeError, ["q", "float16 or bfloat16"]),
        (_cache_call(k_descale=torch.ones(2, 4)), ValueError, ["k_descale", "(2, 2)"]),
        (_cache_call(v_descale=torch.ones(2, 2, dtype=torch.float64)), TypeError, ["v_descale", "float32"]),
        (
            _cache_call(
                k_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16),
                v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16),
                k_descale=torch.ones(2, 2),
            ),
            ValueError,
            ["k_descale", "not FP8"],
        ),
        (lambda: PagedKVCache(1, 4, 8, 2, 16, k_descale=0.5), ValueError, ["float8_e4m3fn pool"]),
        (lambda: PagedKVCache(1, 4, 8, 2, 16, dtype=E4M3, v_descale=-1.0), ValueError, ["positive"]),
        (
            lambda: PagedKVCache(1, 4, 8, 2, 16, dtype=E4M3, k_descale=[1.0, 2.0, 3.0]),
            ValueError,
            ["broadcastable"],
        ),
    ],
    ids=[
        "mixed-caches",
        "e5m2",
        "fp8-q",
        "descale-shape",
        "descale-dtype",
        "descale-without-fp8",
        "pool-descale-bf16",
        "pool-negative",
        "pool-shape",
    ],
)
def test_fp8_cache_bad_input(call, exc, words):
    check_refused(call, exc, words)
