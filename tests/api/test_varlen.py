"""Packed (varlen) batches: each sequence of the packed call equals the tests' oracle on that sequence
alone, forward and backward, for every feature; and the padding helpers round-trip."""

import pytest
import torch

import oracle
import tileattn
from attention_cases import LENGTHS, _check_varlen, _cu
from helpers import check_attention, on, randn
from tileattn.bert_padding import pad_input, unpad_input
from tileattn.testing import check_close

FEATURES = [
    {},
    {"causal": True},
    {"window_size": (6, 2)},
    {"softcap": 4.0, "alibi": "batch"},
    {"causal": True, "alibi": "head"},
]


@pytest.mark.gpu_cover(strength=2)  # (every pair of values on the GPU: tests/cover.py)
@pytest.mark.parametrize("feats", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_matches_per_sequence_reference(backend, lengths, feats, dtype):
    _check_varlen(backend, lengths, feats, dtype)


@pytest.mark.parametrize("headdim", [111, 256])
def test_varlen_head_dims(backend, headdim):
    """Padded head dims (111 -> 128) and the largest (256), GQA 4/1, causal, forward and backward."""
    ctx, device = on(backend)
    lens = [33, 0, 17, 1]
    q = randn(sum(lens), 4, headdim, dtype=torch.float16, device=device)
    k = randn(sum(lens), 1, headdim, dtype=torch.float16, device=device)
    v = randn(sum(lens), 1, headdim, dtype=torch.float16, device=device)
    dout = torch.randn_like(q)
    cu = _cu(lens, device)
    with ctx:
        out = tileattn.flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention(f"varlen d{headdim}", out, grads, q, k, v, dout, {"causal": True}, varlen=(cu, cu, 33))


def test_padding_after_the_last_sequence_holds_anything(backend):
    """Rows after cu_seqlens[-1] are padding, as flash_attn allows, and may hold anything (an unwritten
    buffer): NaN there changes nothing in the sequences' outputs and gradients (kernels that read whole
    tiles past a sequence's end weigh those rows 0, and 0 · NaN is NaN), and the padding's own output and
    gradients are 0."""
    ctx, device = on(backend)
    lens, pad, d = [33, 70], 21, 128
    used = sum(lens)
    q, k, v, dout = (randn(used + pad, 4, d, dtype=torch.float16, device=device) for _ in range(4))
    cu = _cu(lens, device)
    with ctx:
        ref = tileattn.flash_attn_varlen_func(*(t[:used] for t in (q, k, v)), cu, cu, 70, 70, causal=True)
        grads_ref = torch.autograd.grad(ref, (q, k, v), dout[:used])
        for t in (q, k, v, dout):
            t.data[used:] = float("nan")
        out = tileattn.flash_attn_varlen_func(q, k, v, cu, cu, 70, 70, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    # (the same kernels on the same rows; dQ's fp32 adds may come in another order on the GPU)
    torch.testing.assert_close(out[:used], ref, rtol=0, atol=0)
    assert not out[used:].any()
    for name, g, r in zip("qkv", grads, grads_ref):
        torch.testing.assert_close(g[:used], r[:used], rtol=1e-2, atol=1e-3, msg=f"d{name}")
        assert not g[used:].any(), name


def test_varlen_dropout_matches_dense_mask(backend):
    """Varlen dropout uses offsets over (max_seqlen_q, max_seqlen_k): S_dmask gives the mask per
    sequence, and the packed result equals the masked reference."""
    ctx, device = on(backend)
    lq, lk = [9, 30, 1], [20, 30, 5]
    q = randn(sum(lq), 2, 32, dtype=torch.float16, device=device)
    k = randn(sum(lk), 2, 32, dtype=torch.float16, device=device)
    with ctx:
        out, lse, s_dmask = tileattn.flash_attn_varlen_func(
            q, k, k, _cu(lq, device), _cu(lk, device), 30, 30, dropout_p=0.25, causal=True, return_attn_probs=True
        )
    assert lse.shape == (2, sum(lq)) and s_dmask.shape == (3, 2, 30, 30)
    kw = dict(causal=True, dropout_p=0.25, dropout_mask=s_dmask >= 0)
    varlen = (_cu(lq, device), _cu(lk, device), 30)
    check_attention("varlen dropout", out, None, q, k, k, None, kw, check_grads=False, varlen=varlen)


def test_varlen_packed_variants(backend):
    ctx, device = on(backend)
    lens = [7, 0, 19]
    qkv = randn(sum(lens), 3, 2, 16, dtype=torch.float16, device=device)
    cu = _cu(lens, device)
    with ctx:
        a = tileattn.flash_attn_varlen_qkvpacked_func(qkv, cu, 19, causal=True)
        b = tileattn.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 19, 19, causal=True)
        c = tileattn.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, 19, 19, causal=True)
    assert torch.equal(a, c) and torch.equal(b, c)
    check_attention("varlen packed", c, None, *qkv.unbind(1), None, {"causal": True}, False, varlen=(cu, cu, 19))


def test_unpad_pad_roundtrip_matches_padded_reference(backend):
    """unpad_input -> varlen -> pad_input equals the padded reference with a key padding mask."""
    ctx, device = on(backend)
    batch, seqlen, h, d = 3, 24, 2, 16
    lens = torch.tensor([24, 5, 13], device=device)
    mask = torch.arange(seqlen, device=device)[None] < lens[:, None]
    x = randn(batch, seqlen, 3, h, d, dtype=torch.float16, device=device, requires_grad=False)
    x_unpad, indices, cu, max_s, seqused = unpad_input(x, mask)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 24, 29, 42] and max_s == 24
    assert seqused.tolist() == [24, 5, 13]
    with ctx:
        out_unpad = tileattn.flash_attn_varlen_qkvpacked_func(x_unpad, cu, max_s, causal=True)
    out = pad_input(out_unpad, indices, batch, seqlen)
    q, k, v = x.unbind(2)
    kw = dict(query_padding_mask=mask, key_padding_mask=mask, causal=True)
    check_close("padded", out, oracle.attention(q, k, v, **kw).out, oracle.attention(q, k, v, precision=None, **kw).out)
    assert torch.equal(pad_input(x_unpad, indices, batch, seqlen), x * mask[:, :, None, None, None])


def test_varlen_schedule_one_long_many_short(backend):
    """One long and many short sequences: every tile is computed (the grid is sized by total tokens,
    not batch x max_seqlen)."""
    ctx, device = on(backend)
    lens = [100] + [2] * 30
    q = randn(sum(lens), 1, 16, dtype=torch.float16, device=device, requires_grad=False)
    cu = _cu(lens, device)
    with ctx:
        out = tileattn.flash_attn_varlen_func(q, q, q, cu, cu, 100, 100, causal=True)
    check_attention("one long, many short", out, None, q, q, q, None, {"causal": True}, False, varlen=(cu, cu, 100))
