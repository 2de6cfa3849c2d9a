"""FP8 (e4m3) inputs: quantize's scales and rounding, the attention functions on FP8 q, k, v with
FlashAttention-3's descales against the oracle on the dequantized inputs (the tolerance rule, the
PyTorch error being the oracle's in bf16 on them), packed batches with one descale per sequence, the
refused backward, and bad input."""

import pytest
import torch

import tileattn
from attention_cases import _cu
from helpers import check_attention, on
from tileattn import fp8

E4M3 = torch.float8_e4m3fn


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
    assert descale.shape == (4, 2) and (descale[1] == 1).all()
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if end > start:
            alone, alone_descale = fp8.quantize(x[None, start:end])
            torch.testing.assert_close(descale[b], alone_descale[0], rtol=0, atol=0)
            assert torch.equal(x_fp8[start:end].view(torch.uint8), alone[0].view(torch.uint8))


FEATURES = [{}, {"causal": True}, {"window_size": (5, 3)}, {"softcap": 3.0, "causal": True}]


@pytest.mark.parametrize("feats", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize(
    "shape", [(2, 63, 113, 4, 2, 59), (1, 1, 40, 2, 1, 96)], ids=["63x113-gqa-d59", "1x40-mqa-d96"]
)
def test_fp8_matches_oracle_on_dequantized_inputs(backend, shape, feats):
    batch, sq, sk, h, hk, d = shape
    _, device = on(backend)
    ctx, _ = on(backend)
    q = torch.randn(batch, sq, h, d, device=device)
    k = torch.randn(batch, sk, hk, d, device=device)
    v = torch.randn(batch, sk, hk, d, device=device)
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, hk), fp8.quantize(k), fp8.quantize(v)
    with ctx:
        out, lse, _ = tileattn.flash_attn_func(
            q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True, **feats
        )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    deq = [fp8.dequantize(t, s) for t, s in ((q8, qd), (k8, kd), (v8, vd))]
    check_attention("fp8", out, None, *deq, None, feats, check_grads=False)


def test_fp8_varlen_one_descale_per_sequence(backend):
    _, device = on(backend)
    ctx, _ = on(backend)
    lengths = [9, 0, 30, 1]
    cu = _cu(lengths, device)
    total = sum(lengths)
    scale = torch.repeat_interleave(torch.tensor([1.0, 1.0, 20.0, 0.05]), torch.tensor(lengths))[:, None, None]
    q, k, v = (torch.randn(total, heads, 32) * scale for heads in (4, 2, 2))
    q, k, v = q.to(device), k.to(device), v.to(device)
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t, 2, cu) for t in (q, k, v))
    with ctx:
        out = tileattn.flash_attn_varlen_func(
            q8, k8, v8, cu, cu, 30, 30, causal=True, q_descale=qd, k_descale=kd, v_descale=vd
        )
    deq = [fp8.dequantize(t, s, cu) for t, s in ((q8, qd), (k8, kd), (v8, vd))]
    check_attention("fp8 varlen", out, None, *deq, None, {"causal": True}, check_grads=False, varlen=(cu, cu, 30))


def test_fp8_descales_default_to_one_and_backward_is_refused():
    q8, k8, v8 = (torch.randn(1, 8, 2, 16).to(E4M3).requires_grad_() for _ in range(3))
    out = tileattn.flash_attn_func(q8, k8, v8)
    plain = tileattn.flash_attn_func(*(t.detach().to(torch.bfloat16) for t in (q8, k8, v8)))
    assert torch.equal(out, plain)
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
        "descale-without-fp8",
        "quantize-heads",
        "quantize-fp8",
    ],
)
def test_fp8_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value), f"message {str(info.value)!r} does not mention {word!r}"
