"""Packed (varlen) batches: each sequence of the packed call equals the dense reference of that
sequence alone, forward and backward, for every feature; and the padding helpers round-trip."""

import pytest
import torch

import tileattn
from helpers import builds, interpreter_skips, on, randn
from tileattn.bert_padding import pad_input, unpad_input
from tileattn.reference import attention_ref
from tileattn.testing import check_close

# Per-sequence (seqlen_q, seqlen_k), with empty and length-1 sequences and q/k lengths that differ.
LENGTHS = {
    "mixed": [(17, 17), (0, 0), (1, 1), (45, 45), (3, 3)],
    "qk-differ": [(5, 31), (40, 12), (0, 7), (1, 1), (23, 64), (6, 0)],
}
FEATURES = [
    {},
    {"causal": True},
    {"window_size": (6, 2)},
    {"softcap": 4.0, "alibi": "batch"},
    {"causal": True, "alibi": "head"},
]


def _cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


@pytest.mark.parametrize("feats", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_matches_per_sequence_reference(backend, lengths, feats, dtype):
    _check_varlen(backend, lengths, feats, dtype)


@pytest.mark.parametrize("variant", ["tma", "dq-atomic"])
@pytest.mark.parametrize("feats", [{"causal": True}, {"window_size": (6, 2)}], ids=str)
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=str)
def test_varlen_tma_variant(backend, lengths, feats, variant):
    """The kernels' TMA reads (KernelConfig.tma) on packed batches: descriptors per sequence, empty ones
    included, rows past a sequence read as zeros; and dQ added from the dK/dV pass (KernelConfig.dq_atomic:
    TMA reduce-adds on the GPU, atomic adds under the interpreter) at each sequence's rows."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    if variant == "tma":
        variant_builds = builds(backend, fwd=dict(tma=True), dkdv=dict(tma=True), dq=dict(tma=True))
    else:
        variant_builds = builds(backend, dkdv=dict(dq_atomic=2))
    with variant_builds:
        _check_varlen(backend, lengths, feats, torch.float16)


def _check_varlen(backend, lengths, feats, dtype):
    interpreter_skips(backend, dtype)
    ctx, device = on(backend)
    seqs = LENGTHS[lengths]
    h, hk, d = 4, 2, 40
    lq, lk = [s[0] for s in seqs], [s[1] for s in seqs]
    q = randn(sum(lq), h, d, dtype=dtype, device=device)
    k = randn(sum(lk), hk, d, dtype=dtype, device=device)
    v = randn(sum(lk), hk, d, dtype=dtype, device=device)
    dout = torch.randn_like(q)
    kwargs = {key: val for key, val in feats.items() if key != "alibi"}
    if "alibi" in feats:
        shape = (h,) if feats["alibi"] == "head" else (len(seqs), h)
        kwargs["alibi_slopes"] = torch.rand(shape, device=device) * 0.5
    with ctx:
        out = tileattn.flash_attn_varlen_func(q, k, v, _cu(lq, device), _cu(lk, device), max(lq), max(lk), **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), dout)

    # The reference, one sequence at a time, assembled into packed tensors.
    refs, lowps = [], []
    for b, (sq, sk) in enumerate(seqs):
        oq, ok = sum(lq[:b]), sum(lk[:b])
        qs, ks, vs = (t[None, o : o + n] for t, o, n in ((q, oq, sq), (k, ok, sk), (v, ok, sk)))
        ref_kwargs = dict(kwargs, window_seqlen_k=max(lk))  # (the call's window is resolved at max_seqlen_k)
        if "alibi_slopes" in kwargs and kwargs["alibi_slopes"].dim() == 2:
            ref_kwargs["alibi_slopes"] = kwargs["alibi_slopes"][b]
        refs.append(attention_ref(qs, ks, vs, upcast=torch.float64, **ref_kwargs)[0][0])
        lowps.append(attention_ref(qs, ks, vs, upcast=False, **ref_kwargs)[0][0])
    ref, ref_lowp = torch.cat(refs), torch.cat(lowps)
    check_close("varlen out", out, ref, ref_lowp)
    g_ref = torch.autograd.grad(ref, (q, k, v), dout)
    g_lowp = torch.autograd.grad(ref_lowp, (q, k, v), dout)
    for name, g, gr, gl in zip(("dq", "dk", "dv"), grads, g_ref, g_lowp):
        check_close(f"varlen {name}", g, gr, gl)


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
    # The packed batch as a padded one: the reference with padding masks (real tokens first).
    mask = torch.arange(33, device=device)[None] < torch.tensor(lens, device=device)[:, None]
    padded = [pad_input(t, mask.flatten().nonzero().flatten(), len(lens), 33) for t in (q, k, v)]
    kw = dict(query_padding_mask=mask, key_padding_mask=mask, causal=True)
    ref = attention_ref(*padded, upcast=torch.float64, **kw)[0]
    lowp = attention_ref(*padded, upcast=False, **kw)[0]
    indices = mask.flatten().nonzero().flatten()
    ref_p, lowp_p = (t.reshape(-1, *t.shape[2:])[indices] for t in (ref, lowp))
    check_close("varlen out", out, ref_p, lowp_p)
    g_ref = torch.autograd.grad(ref_p, (q, k, v), dout, retain_graph=True)  # shares the padding graph
    g_lowp = torch.autograd.grad(lowp_p, (q, k, v), dout)
    for name, g, gr, gl in zip(("dq", "dk", "dv"), grads, g_ref, g_lowp):
        check_close(f"varlen {name}", g, gr, gl)


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
    for b in range(3):
        oq, ok = sum(lq[:b]), sum(lk[:b])
        qs, ks = q[None, oq : oq + lq[b]], k[None, ok : ok + lk[b]]
        keep = s_dmask[b : b + 1, :, : lq[b], : lk[b]] >= 0
        kw = dict(causal=True, dropout_p=0.25, dropout_mask=keep)
        ref = attention_ref(qs, ks, ks, upcast=torch.float64, **kw)[0]
        lowp = attention_ref(qs, ks, ks, upcast=False, **kw)[0]
        check_close(f"varlen dropout seq {b}", out[None, oq : oq + lq[b]], ref, lowp)


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
    ref = attention_ref(q, k, v, upcast=torch.float64, **kw)[0]
    lowp = attention_ref(q, k, v, upcast=False, **kw)[0]
    check_close("padded", out, ref, lowp)
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
    for b, n in enumerate(lens):
        o = sum(lens[:b])
        ref = attention_ref(
            q[None, o : o + n], q[None, o : o + n], q[None, o : o + n], causal=True, upcast=torch.float64
        )[0][0]
        lowp = attention_ref(q[None, o : o + n], q[None, o : o + n], q[None, o : o + n], causal=True, upcast=False)[0][
            0
        ]
        check_close(f"seq {b}", out[o : o + n], ref, lowp)


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
    assert checked_once.runs - runs == 2  # cu_seqlens_q and cu_seqlens_k, once each
    tileattn.flash_attn_varlen_func(q, q, q, cu_q, cu_k, 6, 6)  # another max_seqlen: checked again
    assert checked_once.runs - runs == 4
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
