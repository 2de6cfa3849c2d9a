"""FP8 (e4m3) inputs: quantize's scales and rounding, the attention functions on FP8 q, k, v with
FlashAttention-3's descales against the oracle on the dequantized inputs (the tolerance rule, the
PyTorch error being the oracle's in bf16 on them), packed batches with one descale per sequence, the
refused backward, and bad input."""

from dataclasses import replace

import pytest
import torch
from hypothesis import strategies as st

import oracle
import tileattn
from attention_cases import _cu
from helpers import SLOW, builds, check_attention, check_lse, check_refused, needs_gluon, on, record_calls, run_property
from tileattn import fp8
from tileattn.kernels import configs

E4M3 = torch.float8_e4m3fn
# The FP8 tolerance: the tolerance rule against plain FP8 attention, bf16 with its probabilities rounded to
# e4m3 at their row max (oracle.attention's probs_dtype), as FP8 tensor cores take them
FP8_PROBS = {"probs_dtype": E4M3}


def _descale_rows(descale, x_shape, cu_seqlens=None):
    """The descale of every element of an x of ``x_shape`` (dense, or packed with ``cu_seqlens``): query head
    h of sequence b takes ``descale[b, h // (nheads / nheads_k)]``, from the definition (not fp8.dequantize)."""
    nheads, nheads_k = x_shape[-2], descale.shape[1]
    per_head = descale.repeat_interleave(nheads // nheads_k, dim=1)  # (batch, nheads)
    if cu_seqlens is None:
        return per_head[:, None, :, None].expand(x_shape)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
    return per_head.repeat_interleave(lengths.to(per_head.device), dim=0)[:, :, None].expand(x_shape)


def _dequantized(x_fp8, descale, cu_seqlens=None):
    """x_fp8 * descale in fp32 (exact: an e4m3 value times an fp32 descale rounds once), the oracle's inputs."""
    return x_fp8.float() * _descale_rows(descale, x_fp8.shape, cu_seqlens)


def _within_e4m3(x, x_fp8, descale_rows):
    """|dequantized - x| within e4m3's rounding: half a unit of its 3-bit mantissa (2**-4 relative) for
    normal values, half its subnormal spacing (2**-10 of the descale) below."""
    back = x_fp8.float() * descale_rows
    bound = torch.maximum(x.abs() * 2**-4, descale_rows * 2**-10) * 1.0001
    assert ((back - x).abs() <= bound).all(), float(((back - x).abs() / bound).max())


def test_quantize_scales_each_kv_group_to_e4m3_max():
    x = torch.randn(3, 17, 4, 24) * torch.tensor([1.0, 50.0, 0.01])[:, None, None, None]
    x[2] = 0  # an all-zero sequence: descale 1
    x_fp8, descale = fp8.quantize(x, nheads_k=2)
    assert x_fp8.dtype == E4M3 and x_fp8.shape == x.shape and descale.shape == (3, 2)
    assert descale.dtype == torch.float32
    group_max = x.view(3, 17, 2, 2, 24).abs().amax((1, 3, 4))
    expected = torch.where(group_max > 0, group_max / 448, torch.ones_like(group_max))
    torch.testing.assert_close(descale, expected, rtol=0, atol=0)
    rows = descale[:, None, :, None, None].expand(3, 17, 2, 2, 24).reshape(x.shape)
    _within_e4m3(x, x_fp8, rows)
    torch.testing.assert_close(fp8.dequantize(x_fp8, descale, dtype=torch.float32), x_fp8.float() * rows)


def test_quantize_packed_batch_per_sequence():
    lengths = [5, 0, 12, 1]
    x = (
        torch.randn(sum(lengths), 2, 16)
        * torch.repeat_interleave(torch.tensor([1.0, 1.0, 9.0, 0.1]), torch.tensor(lengths))[:, None, None]
    )
    cu = _cu(lengths, "cpu")
    x_fp8, descale = fp8.quantize(x, cu_seqlens=cu)
    assert descale.shape == (4, 2) and (descale[1] == 1).all() and descale.dtype == torch.float32
    # from the definition: each sequence's largest magnitude per kv head maps to 448; 1 for an empty sequence
    expected = torch.stack(
        [x[a:b].abs().amax((0, 2)) / 448 if b > a else torch.ones(2) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    )
    torch.testing.assert_close(descale, expected, rtol=0, atol=0)
    rows = _descale_rows(descale, x.shape, cu)
    _within_e4m3(x, x_fp8, rows)
    assert torch.equal(x_fp8.view(torch.uint8), (x / rows).to(E4M3).view(torch.uint8)), "not round to nearest"
    torch.testing.assert_close(fp8.dequantize(x_fp8, descale, cu, torch.float32), x_fp8.float() * rows)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if end > start:
            alone, alone_descale = fp8.quantize(x[None, start:end])
            torch.testing.assert_close(descale[b], alone_descale[0], rtol=0, atol=0)
            assert torch.equal(x_fp8[start:end].view(torch.uint8), alone[0].view(torch.uint8))


FEATURES = [{}, {"causal": True}, {"window_size": (5, 3)}, {"softcap": 3.0, "causal": True}]


@pytest.mark.parametrize("feats", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize(
    "shape",
    [(2, 63, 113, 4, 2, 59), (1, 1, 40, 2, 1, 96), (1, 113, 63, 2, 2, 40)],
    ids=["63x113-gqa-d59", "1x40-mqa-d96", "113x63-d40"],  # (seqlen_q > seqlen_k: causal rows that see nothing)
)
def test_fp8_matches_oracle_on_dequantized_inputs(backend, shape, feats):
    _check_fp8_call(backend, shape, feats)


def _check_fp8_call(backend, shape, feats, scale=1.0):
    batch, sq, sk, h, hk, d = shape
    ctx, device = on(backend)
    q = torch.randn(batch, sq, h, d, device=device) * scale
    k = torch.randn(batch, sk, hk, d, device=device) * scale
    v = torch.randn(batch, sk, hk, d, device=device)
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, hk), fp8.quantize(k), fp8.quantize(v)
    with ctx:
        out, lse, _ = tileattn.flash_attn_func(
            q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True, **feats
        )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # the inputs' values in fp32 (x_fp8 * descale, exact to fp32's rounding), of which the oracle takes fp64
    # copies; its plain-PyTorch run is fp32 with e4m3 probabilities
    deq = [_dequantized(t, s) for t, s in ((q8, qd), (k8, kd), (v8, vd))]
    check_attention("fp8", out, None, *deq, None, feats, check_grads=False, lowp_kwargs=FP8_PROBS)
    # The LSE: FP8 tensor cores add the products of q·kᵀ with fewer bits than fp32 (about 2**-14 of
    # the largest term), so the bar is plain bf16 attention's LSE on the same values, and the rounding
    # floor is that accumulation's: 2**-14 of the largest sum of |products| (times the softmax scale), which
    # is above the bar where the scores are small sums of larger products (one key, small inputs)
    exact = oracle.attention(*(t.double() for t in deq), **feats).lse
    qa, ka = deq[0].double().abs(), deq[1].double().abs().repeat_interleave(h // hk, dim=2)
    terms = torch.einsum("bqhd,bkhd->bhqk", qa, ka).amax() * d**-0.5 if qa.numel() and ka.numel() else 0.0
    floor = torch.as_tensor(terms * 2.0**-14 / (2 * torch.finfo(torch.float32).eps))  # (check_close's floor)
    lowp = oracle.attention(*(t.bfloat16() for t in deq), precision=None, **feats).lse
    check_lse("fp8 lse", lse, exact, lowp, floor_scale=floor)


def test_fp8_transposed_v_build(backend):
    """The build that reads V through a key-major copy (Settings.fp8_v_transposed), dense and packed."""
    ctx, device = on(backend)
    base = configs.current(torch.device(device))
    with configs.override(replace(base, fp8_v_transposed=not base.fp8_v_transposed)):
        _check_fp8_call(backend, (2, 63, 113, 4, 2, 59), {"causal": True})
        test_fp8_varlen_one_descale_per_sequence(backend)


def test_fp8_exp2_poly_build(backend):
    """The forward with half its exponentials by polynomial (KernelConfig.exp2_poly; FP8's p at 2**8 times its
    value): GQA, rows that see no key."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    if backend == "cuda" and not SLOW:  # (the suite's default GPU run stays within one device call)
        pytest.skip("a build the settings do not pick (exp2_poly: docs/perf.md): TILEATTN_SLOW=1 runs it")
    with builds(backend, fwd=dict(exp2_poly=4), gluon=dict(exp2_poly=4)):
        _check_fp8_call(backend, (2, 63, 113, 4, 2, 59), {"causal": True})
        _check_fp8_call(backend, (1, 113, 63, 2, 2, 40), {"causal": True})


def test_fp8_peaked_scores_and_alibi(backend):
    """Large scores (a peaked softmax, where most probabilities are tiny) and ALiBi on top."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    _check_fp8_call(backend, (1, 70, 130, 4, 2, 64), {"causal": True}, scale=3.0)
    _check_fp8_call(backend, (1, 70, 130, 4, 2, 64), {"alibi_slopes": slopes.to(on(backend)[1])})


@st.composite
def _fp8_examples(draw):
    """(shape, features, input scale) of a random FP8 call: odd lengths (1 included), head dims 8-256,
    GQA, causal / windows / softcap, inputs from small to large (the descales absorb the scale)."""
    hk = draw(st.sampled_from([1, 2]))
    shape = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, 140)),
        draw(st.integers(1, 140)),
        hk * draw(st.sampled_from([1, 2])),
        hk,
        draw(st.sampled_from([8, 40, 59, 64, 111, 128, 256])),
    )
    feats = draw(
        st.sampled_from([{}, {"causal": True}, {"window_size": (9, 0)}, {"window_size": (3, 20)}, {"softcap": 2.0}])
    )
    # (scores up to tens of units: at hundreds, FP8 tensor cores' accumulation moves the winning scores
    # by more than plain FP8's error, docs/perf.md "FP8")
    return shape, feats, draw(st.sampled_from([0.05, 1.0, 3.0]))


def _fp8_property_check(backend, example):
    shape, feats, scale = example
    _check_fp8_call(backend, shape, feats, scale=scale)


@pytest.mark.parametrize("shard", range(2))
def test_fp8_random_calls(backend, shard):
    run_property(_fp8_property_check, _fp8_examples(), {"cuda": 40, "torch": 20, "interpret": 6}, backend, shard)


def test_fp8_varlen_one_descale_per_sequence(backend):
    _check_fp8_varlen(backend, 32)


def _check_fp8_varlen(backend, headdim):
    ctx, device = on(backend)
    lengths = [9, 0, 30, 1]
    cu = _cu(lengths, device)
    total = sum(lengths)
    scale = torch.repeat_interleave(torch.tensor([1.0, 1.0, 20.0, 0.05]), torch.tensor(lengths))[:, None, None]
    q, k, v = (torch.randn(total, heads, headdim) * scale for heads in (4, 2, 2))
    q, k, v = q.to(device), k.to(device), v.to(device)
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t, 2, cu) for t in (q, k, v))
    with ctx:
        out = tileattn.flash_attn_varlen_func(
            q8, k8, v8, cu, cu, 30, 30, causal=True, q_descale=qd, k_descale=kd, v_descale=vd
        )
    deq = [_dequantized(t, s, cu) for t, s in ((q8, qd), (k8, kd), (v8, vd))]
    check_attention(
        "fp8 varlen",
        out,
        None,
        *deq,
        None,
        {"causal": True},
        check_grads=False,
        varlen=(cu, cu, 30),
        lowp_kwargs=FP8_PROBS,
    )


@needs_gluon("the Gluon forward")
@pytest.mark.slow  # (a build the settings do not pick yet: docs/perf.md)
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_fp8_gluon_forward(headdim, monkeypatch):
    """The Gluon forward on FP8 inputs (``Settings.fwd_gluon_fp8``, empty until it is timed): Q·Kᵀ and P·V
    on FP8 wgmma, V read through its transposed copy, P through shared memory; GQA, causal with more keys
    than queries, a window, packed with a descale per sequence; also with the ping-pong and the three-loop
    key loop, and with half its exponentials by polynomial; every call through it (recorded), against the
    oracle on the dequantized inputs."""
    from tileattn.kernels.gluon import forward as hopper
    from tileattn.params import KernelConfig

    base = configs.for_device(torch.device("cuda"))
    entry = KernelConfig(128, 64 if headdim == 256 else 128, 4, 2)
    calls = record_calls(monkeypatch, hopper.Plan, "run")
    for cfg in (entry, replace(entry, mask_loops=True, pingpong=True), replace(entry, exp2_poly=4)):
        with configs.override(replace(base, fwd_gluon_fp8={headdim: cfg})):
            _check_fp8_call("cuda", (2, 300, 557, 4, 2, headdim), {"causal": True})
            _check_fp8_call("cuda", (1, 257, 129, 2, 2, headdim), {"window_size": (40, 7)}, scale=3.0)
            _check_fp8_varlen("cuda", headdim)
    assert len(calls) == 9


def test_fp8_descales_default_to_one_and_backward_is_refused():
    q8, k8, v8 = (torch.randn(1, 8, 2, 16).to(E4M3).requires_grad_() for _ in range(3))
    out = tileattn.flash_attn_func(q8, k8, v8)
    ones = torch.ones(1, 2)
    assert torch.equal(out, tileattn.flash_attn_func(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=ones))
    with pytest.raises(NotImplementedError, match="forward only"):
        out.sum().backward()


def _fp8_call(q=None, k=None, v=None, **kw):
    q = torch.randn(2, 8, 4, 16).to(E4M3) if q is None else q
    k = torch.randn(2, 8, 2, 16).to(E4M3) if k is None else k
    v = torch.randn(2, 8, 2, 16).to(E4M3) if v is None else v
    return lambda: tileattn.flash_attn_func(q, k, v, **kw)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (_fp8_call(k=torch.randn(2, 8, 2, 16, dtype=torch.bfloat16)), TypeError, ["k", "float8_e4m3fn"]),
        (_fp8_call(q=torch.randn(2, 8, 4, 16).to(torch.float8_e5m2)), TypeError, ["e5m2 is not supported"]),
        (_fp8_call(q_descale=torch.ones(2, 4)), ValueError, ["q_descale", "(2, 2)"]),
        (_fp8_call(k_descale=torch.ones(2, 2, dtype=torch.float16)), TypeError, ["k_descale", "float32"]),
        (_fp8_call(v_descale=[1.0]), TypeError, ["v_descale", "float32 tensor"]),
        (_fp8_call(dropout_p=0.1), ValueError, ["dropout_p", "float8_e4m3fn"]),
        (
            lambda: tileattn.flash_attn_func(
                *(torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(3)), q_descale=torch.ones(1, 2)
            ),
            ValueError,
            ["q_descale", "not FP8"],
        ),
        (lambda: fp8.quantize(torch.randn(2, 8, 3, 16), nheads_k=2), ValueError, ["nheads_k", "divide"]),
        (lambda: fp8.quantize(torch.randn(2, 8, 2, 16).to(E4M3)), TypeError, ["quantize"]),
    ],
    ids=[
        "mixed",
        "e5m2",
        "descale-shape",
        "descale-dtype",
        "descale-type",
        "dropout",
        "descale-without-fp8",
        "quantize-heads",
        "quantize-fp8",
    ],
)
def test_fp8_bad_input(call, exc, words):
    check_refused(call, exc, words)
