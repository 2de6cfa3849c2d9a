"""flash_attn's internal interface (tileattn.interface): ``_flash_attn_forward`` / ``_flash_attn_backward``
and their varlen forms, with flash_attn 2.8.3's signatures, against a dense reference written here from
the definition; the backward writing into the caller's buffers (strided, GQA-sized); the ring-attention
pattern (K/V in chunks, outputs merged by their LSE, then a backward per chunk against the merged
output); dropout regenerated from ``rng_state``; torch.compile."""

import inspect
import shutil

import pytest
import torch

import helpers
from helpers import interpreter_skips, on
from tileattn import checks, interface
from tileattn.testing import check_close

F16 = torch.float16
# Inductor compiles the surrounding graph (C++ on CPU); aot_eager traces and functionalises the same way.
COMPILE_BACKEND = "inductor" if torch.cuda.is_available() or shutil.which("g++") else "aot_eager"


# --------------------------------------------------------------------------------------------------
# The reference: softmax(q kᵀ · scale) v with the mask built from its definition
# --------------------------------------------------------------------------------------------------


def visible(sq, sk, causal, window, device):
    """Bool (sq, sk): query i (aligned to the bottom right: its diagonal key is i + sk - sq) sees key j
    when j - diag is in [-left, right]; -1 leaves a side unbounded, causal makes right 0."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(sk, device=device).view(1, -1)
    rel = j - (i + sk - sq)
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        seen &= rel <= right
    if left >= 0:
        seen &= rel >= -left
    return seen


def dense_attention(q, k, v, scale, causal=False, window=(-1, -1), keep=None, dropout_p=0.0):
    """(out, lse) of (batch, seqlen, nheads, headdim) inputs, in their own dtype (upcast them for the
    oracle). lse is +inf for rows that see no key (their output is 0), as flash_attn returns it.
    ``keep``: (batch, nheads, sq, sk) dropout mask, kept entries scaled by 1 / (1 - dropout_p)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~visible(q.shape[1], k.shape[1], causal, window, q.device), float("-inf"))
    lse = torch.logsumexp(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1)
    empty = torch.isinf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse).unsqueeze(-1).to(s.dtype))
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out, torch.where(empty, float("inf"), lse)


def reference(q, k, v, dout, **kw):
    """(out, lse, (dq, dk, dv)) of the reference in fp64 and in the inputs' precision."""
    results = []
    for dtype in (torch.float64, q.dtype):
        qkv = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = dense_attention(*qkv, **kw)
        grads = torch.autograd.grad(out, qkv, dout.to(dtype))
        results.append((out, lse, grads))
    return results


def check_grads(name, grads, ref, ref_lowp):
    scale = torch.stack([g.abs().max() for g in ref])
    for gname, g, gr, gl in zip(("dq", "dk", "dv"), grads, ref, ref_lowp):
        check_close(f"{name} {gname}", g, gr, gl, floor_scale=scale)


def check_lse(lse, ref, ref_lowp):
    """The LSE with the tolerance rule (+inf exactly where a row sees no key), the PyTorch error being the
    reference's LSE in the inputs' precision."""
    helpers.check_lse("lse", lse, ref, ref_lowp)


def inputs(device, b=2, sq=37, sk=53, h=4, hk=2, d=32, dtype=F16):
    return (
        torch.randn(b, sq, h, d, dtype=dtype, device=device),
        torch.randn(b, sk, hk, d, dtype=dtype, device=device),
        torch.randn(b, sk, hk, d, dtype=dtype, device=device),
    )


FEATURES = [
    pytest.param({}, id="full"),
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"window": (9, 3)}, id="window9-3"),
    pytest.param({"causal": True, "window": (12, -1)}, id="causal-window12"),
]


def _window_args(kw):
    window = kw.get("window", (-1, -1))
    return kw.get("causal", False), window[0], window[1]


# --------------------------------------------------------------------------------------------------
# Signatures
# --------------------------------------------------------------------------------------------------

_EMPTY = inspect.Parameter.empty
# flash_attn 2.8.3, flash_attn/flash_attn_interface.py: (name, default) per parameter
SIGNATURES = {
    "_flash_attn_forward": [
        *[(n, _EMPTY) for n in ("q", "k", "v", "dropout_p", "softmax_scale", "causal")],
        *[(n, _EMPTY) for n in ("window_size_left", "window_size_right", "softcap", "alibi_slopes")],
        ("return_softmax", _EMPTY),
    ],
    "_flash_attn_varlen_forward": [
        *[(n, _EMPTY) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")],
        *[(n, _EMPTY) for n in ("dropout_p", "softmax_scale", "causal")],
        ("window_size_left", -1),
        ("window_size_right", -1),
        ("softcap", 0.0),
        ("alibi_slopes", None),
        ("return_softmax", False),
        ("block_table", None),
        ("leftpad_k", None),
        ("seqused_k", None),
        ("zero_tensors", False),
    ],
    "_flash_attn_backward": [
        *[(n, _EMPTY) for n in ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv")],
        *[(n, _EMPTY) for n in ("dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right")],
        *[(n, _EMPTY) for n in ("softcap", "alibi_slopes", "deterministic")],
        ("rng_state", None),
    ],
    "_flash_attn_varlen_backward": [
        *[(n, _EMPTY) for n in ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv")],
        *[(n, _EMPTY) for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")],
        *[(n, _EMPTY) for n in ("dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right")],
        *[(n, _EMPTY) for n in ("softcap", "alibi_slopes", "deterministic")],
        ("rng_state", None),
        ("zero_tensors", False),
    ],
}
PUBLIC = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_are_flash_attns(name):
    params = inspect.signature(getattr(interface, name)).parameters.values()
    assert [(p.name, p.default) for p in params] == SIGNATURES[name]
    assert getattr(interface, "_wrapped" + name) is getattr(interface, name)


def test_public_functions_are_tileattns():
    import tileattn

    for name in PUBLIC:
        assert getattr(interface, name) is getattr(tileattn, name)


# --------------------------------------------------------------------------------------------------
# Forward and backward against the reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", FEATURES)
def test_forward_and_backward_match_reference(backend, kw):
    ctx, device = on(backend)
    q, k, v = inputs(device)
    dout = torch.randn_like(q)
    scale = 0.21
    causal, left, right = _window_args(kw)
    with ctx:
        out, lse, s_dmask, rng_state = interface._flash_attn_forward(
            q, k, v, 0.0, scale, causal, left, right, 0.0, None, False
        )
        # the caller's buffers, filled with NaN: every element must be written
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        softmax_d = interface._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, left, right, 0.0, None, False, rng_state
        )
    (ref, ref_lse, ref_grads), (ref_lowp, lowp_lse, lowp_grads) = reference(q, k, v, dout, scale=scale, **kw)
    check_close("out", out, ref, ref_lowp)
    check_lse(lse, ref_lse, lowp_lse)
    assert s_dmask.numel() == 0 and s_dmask.dtype == q.dtype
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    check_grads("backward", (dq, dk, dv), ref_grads, lowp_grads)
    # softmax_d: rowsum(dout ∘ out), flash_attn's (batch, nheads, round_up(seqlen_q, 128)) with zeros after
    assert softmax_d.shape == (2, 4, 128) and softmax_d.dtype == torch.float32
    expected = (dout.double() * out.double()).sum(-1).transpose(1, 2)  # (of the out it was given)
    check_close("softmax_d", softmax_d[..., :37], expected, (dout.float() * out.float()).sum(-1).transpose(1, 2))
    assert not softmax_d[..., 37:].any()


def test_backward_into_strided_buffers(backend):
    """Buffers that are views of larger tensors (flash_attn's packed backward passes dqkv[:, :, i]), and one
    whose last dimension is not contiguous: written in place, nothing around them touched."""
    ctx, device = on(backend)
    q, k, v = inputs(device, b=1, sq=20, sk=20, h=2, hk=2, d=16)
    dout = torch.randn_like(q)
    dqkv = torch.full((1, 20, 3, 2, 16), 7.0, dtype=F16, device=device)
    dv_t = torch.full((1, 20, 2, 16), 7.0, dtype=F16, device=device).transpose(-1, -2)
    with ctx:
        out, lse, _, rng_state = interface._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
        interface._flash_attn_backward(
            dout, q, k, v, out, lse, dqkv[:, :, 0], dqkv[:, :, 1], dv_t.transpose(-1, -2), 0.0, None, True, -1, -1,
            0.0, None, False, rng_state,
        )  # fmt: skip
        expected = [torch.empty_like(t) for t in (q, k, v)]
        interface._flash_attn_backward(
            dout, q, k, v, out, lse, *expected, 0.0, None, True, -1, -1, 0.0, None, False, rng_state
        )
    assert torch.equal(dqkv[:, :, 0], expected[0]) and torch.equal(dqkv[:, :, 1], expected[1])
    assert torch.equal(dv_t.transpose(-1, -2), expected[2])
    assert (dqkv[:, :, 2] == 7.0).all()


def test_backward_with_none_buffers_writes_nothing(backend):
    """None for dq and dv: the backward writes dk alone (against the reference)."""
    ctx, device = on(backend)
    q, k, v = inputs(device, b=1, sq=9, sk=9, h=2, hk=1, d=16)
    dout = torch.randn_like(q)
    with ctx:
        out, lse, _, rng_state = interface._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False)
        dk = torch.zeros_like(k)
        interface._flash_attn_backward(
            dout, q, k, v, out, lse, None, dk, None, 0.0, None, False, -1, -1, 0.0, None, False
        )
    (_, _, ref_grads), (_, _, lowp_grads) = reference(q, k, v, dout, scale=16**-0.5)
    scale = torch.stack([g.abs().max() for g in ref_grads])
    check_close("dk", dk, ref_grads[1], lowp_grads[1], floor_scale=scale)


# --------------------------------------------------------------------------------------------------
# The ring-attention pattern
# --------------------------------------------------------------------------------------------------


def merge(out, lse, block_out, block_lse):
    """ring-flash-attention's update: out, lse of (batch, seqlen, nheads, d) / (batch, seqlen, nheads, 1)
    in fp32, merged with a block's out and lse (batch, nheads, seqlen)."""
    block_out = block_out.float()
    block_lse = block_lse.transpose(-2, -1).unsqueeze(-1)
    if out is None:
        return block_out, block_lse
    out = out - torch.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return out, lse


def ring(q_chunks, k_chunks, v_chunks, dout_chunks, scale, causal):
    """Rank r holds chunk r of q, k, v; its queries see the K/V chunks 0..r (causal: chunk r with the causal
    mask, the earlier ones in full) or every chunk (not causal). Returns the outputs, LSEs and gradients
    each rank computes, the K/V gradients summed over the ranks that used the chunk."""
    n = len(q_chunks)
    outs, lses = [], []
    for r in range(n):
        out = lse = None
        for j in range(n):
            if causal and j > r:
                continue
            block_out, block_lse, _, _ = interface._flash_attn_forward(
                q_chunks[r], k_chunks[j], v_chunks[j], 0.0, scale, causal and j == r, -1, -1, 0.0, None, False
            )
            out, lse = merge(out, lse, block_out, block_lse)
        outs.append(out.to(q_chunks[r].dtype))
        # (batch, nheads, seqlen) over (batch, seqlen, nheads) storage, as ring-flash-attention keeps it
        lses.append(lse.contiguous().squeeze(-1).transpose(1, 2))
    dq = [torch.zeros_like(t, dtype=torch.float32) for t in q_chunks]
    dk = [torch.zeros_like(t, dtype=torch.float32) for t in k_chunks]
    dv = [torch.zeros_like(t, dtype=torch.float32) for t in v_chunks]
    bufs = [torch.empty_like(t) for t in (q_chunks[0], k_chunks[0], v_chunks[0])]
    for r in range(n):
        for j in range(n):
            if causal and j > r:
                continue
            interface._flash_attn_backward(
                dout_chunks[r], q_chunks[r], k_chunks[j], v_chunks[j], outs[r], lses[r], *bufs, 0.0, scale,
                causal and j == r, -1, -1, 0.0, None, False, None,
            )  # fmt: skip
            dq[r] += bufs[0]
            dk[j] += bufs[1]
            dv[j] += bufs[2]
    return outs, lses, dq, dk, dv


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_pattern(backend, causal):
    """Two ranks, each with a chunk of 24 tokens: their merged forwards and summed backwards equal full
    attention over the 48 tokens (GQA 4:2)."""
    ctx, device = on(backend)
    q, k, v = inputs(device, b=2, sq=48, sk=48, h=4, hk=2, d=32)
    dout = torch.randn_like(q)
    scale = 32**-0.5
    with ctx:
        outs, lses, dq, dk, dv = ring(q.split(24, 1), k.split(24, 1), v.split(24, 1), dout.split(24, 1), scale, causal)
    refs = reference(q, k, v, dout, scale=scale, causal=causal)
    (ref, ref_lse, ref_grads), (ref_lowp, lowp_lse, lowp_grads) = refs
    check_close("ring out", torch.cat(outs, 1), ref, ref_lowp)
    check_lse(torch.cat(lses, 2), ref_lse, lowp_lse)
    grads = [torch.cat(g, 1).to(F16) for g in (dq, dk, dv)]
    check_grads("ring", grads, ref_grads, lowp_grads)


def test_ring_with_uneven_chunks(backend):
    """Not causal, the keys split 17 + 30: merged forward and summed backward of one query block."""
    ctx, device = on(backend)
    q, k, v = inputs(device, b=1, sq=21, sk=47, h=2, hk=2, d=16)
    dout = torch.randn_like(q)
    chunks = list(zip(k.split([17, 30], 1), v.split([17, 30], 1)))
    with ctx:
        out = lse = None
        for kc, vc in chunks:
            block_out, block_lse, _, _ = interface._flash_attn_forward(
                q, kc, vc, 0.0, None, False, -1, -1, 0.0, None, False
            )
            out, lse = merge(out, lse, block_out, block_lse)
        out, lse = out.to(F16), lse.contiguous().squeeze(-1).transpose(1, 2)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk, dv = [], []
        for kc, vc in chunks:
            bufs = torch.empty_like(q), torch.empty_like(kc), torch.empty_like(vc)
            interface._flash_attn_backward(dout, q, kc, vc, out, lse, *bufs, 0.0, None, False, -1, -1, 0.0, None, False)
            dq += bufs[0]
            dk.append(bufs[1])
            dv.append(bufs[2])
    (ref, _, ref_grads), (ref_lowp, _, lowp_grads) = reference(q, k, v, dout, scale=16**-0.5)
    check_close("uneven out", out, ref, ref_lowp)
    check_grads("uneven", (dq.to(F16), torch.cat(dk, 1), torch.cat(dv, 1)), ref_grads, lowp_grads)


# --------------------------------------------------------------------------------------------------
# Dropout: rng_state regenerates the forward's mask
# --------------------------------------------------------------------------------------------------


def test_rng_state_regenerates_the_dropout_mask(backend):
    ctx, device = on(backend)
    q, k, v = inputs(device, b=2, sq=33, sk=45, h=4, hk=2, d=32)
    dout = torch.randn_like(q)
    p = 0.25
    with ctx:
        out, lse, s_dmask, rng_state = interface._flash_attn_forward(q, k, v, p, None, False, -1, -1, 0.0, None, True)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        interface._flash_attn_backward(
            dout, q, k, v, out, lse, *grads, p, None, False, -1, -1, 0.0, None, False, rng_state
        )
        # another forward's rng_state (another seed): another mask, other gradients
        _, _, _, other = interface._flash_attn_forward(q, k, v, p, None, False, -1, -1, 0.0, None, False)
        wrong = [torch.empty_like(t) for t in (q, k, v)]
        interface._flash_attn_backward(dout, q, k, v, out, lse, *wrong, p, None, False, -1, -1, 0.0, None, False, other)
    assert s_dmask.shape == (2, 4, 33, 45)
    keep = s_dmask >= 0
    assert 0.6 < keep.float().mean() < 0.9
    (ref, ref_lse, ref_grads), (ref_lowp, lowp_lse, lowp_grads) = reference(
        q, k, v, dout, scale=32**-0.5, keep=keep, dropout_p=p
    )
    check_close("dropout out", out, ref, ref_lowp)
    check_lse(lse, ref_lse, lowp_lse)  # (the LSE is of the scores before dropout)
    check_grads("dropout", grads, ref_grads, lowp_grads)
    assert int(other[0]) != int(rng_state[0]) and int(rng_state[1]) == 0
    assert not torch.allclose(wrong[1].float(), grads[1].float(), atol=1e-2)


def test_dropout_backward_needs_rng_state():
    q, k, v = inputs("cpu", b=1, sq=8, sk=8, h=2, hk=2, d=16)
    out, lse, _, _ = interface._flash_attn_forward(q, k, v, 0.2, None, False, -1, -1, 0.0, None, False)
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    with pytest.raises(RuntimeError, match="rng_state is required with dropout_p > 0"):
        interface._flash_attn_backward(q, q, k, v, out, lse, *bufs, 0.2, None, False, -1, -1, 0.0, None, False)
    with pytest.raises(TypeError, match="rng_state must be the int64 tensor of shape"):
        interface._flash_attn_backward(
            q, q, k, v, out, lse, *bufs, 0.2, None, False, -1, -1, 0.0, None, False, torch.zeros(1, dtype=torch.int64)
        )


# --------------------------------------------------------------------------------------------------
# Varlen
# --------------------------------------------------------------------------------------------------


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_and_backward(backend, causal):
    ctx, device = on(backend)
    lq, lk = [5, 0, 19, 11], [9, 4, 19, 3]
    q = torch.randn(sum(lq), 4, 32, dtype=F16, device=device)
    k = torch.randn(sum(lk), 2, 32, dtype=F16, device=device)
    v = torch.randn(sum(lk), 2, 32, dtype=F16, device=device)
    dout = torch.randn_like(q)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    with ctx:
        out, lse, s_dmask, rng_state = interface._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max(lq), max(lk), 0.0, None, causal
        )
        bufs = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        softmax_d = interface._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, *bufs, cu_q, cu_k, max(lq), max(lk), 0.0, None, causal, -1, -1, 0.0, None, False,
            rng_state,
        )  # fmt: skip
    assert lse.shape == (4, sum(lq)) and s_dmask.numel() == 0
    for b in range(4):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs, ds = q[rq][None], k[rk][None], v[rk][None], dout[rq][None]
        refs = reference(qs, ks, vs, ds, scale=32**-0.5, causal=causal)
        (ref, ref_lse, ref_grads), (ref_lowp, lowp_lse, lowp_grads) = refs
        check_close(f"seq {b} out", out[rq][None], ref, ref_lowp)
        check_lse(lse[:, rq], ref_lse[0], lowp_lse[0])
        if lq[b]:
            check_grads(f"seq {b}", (bufs[0][rq][None], bufs[1][rk][None], bufs[2][rk][None]), ref_grads, lowp_grads)
        else:  # a sequence without queries: its keys get no gradient
            assert not bufs[1][rk].any() and not bufs[2][rk].any()
        # softmax_d: (nheads, total_q + 128 * batch), sequence b's rows from cu_seqlens_q[b] + 128 * b
        start = int(cu_q[b]) + 128 * b
        got = softmax_d[:, start : start + lq[b]]
        exact, lowp = ((ds[0].to(t) * out[rq].to(t)).sum(-1).t() for t in (torch.float64, torch.float32))
        check_close(f"seq {b} softmax_d", got, exact, lowp)
    assert softmax_d.shape == (4, sum(lq) + 128 * 4)
    assert int((softmax_d != 0).sum()) <= 4 * sum(lq)


def test_varlen_leftpad_and_seqused_k(backend):
    """leftpad_k / seqused_k: sequence b attends to keys [leftpad_k[b], seqused_k[b]) of its range."""
    ctx, device = on(backend)
    lq, lk = [6, 9, 4], [12, 20, 7]
    pad, used = [3, 0, 2], [12, 14, 5]
    q = torch.randn(sum(lq), 2, 16, dtype=F16, device=device)
    k = torch.randn(sum(lk), 1, 16, dtype=F16, device=device)
    v = torch.randn(sum(lk), 1, 16, dtype=F16, device=device)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    i32 = dict(dtype=torch.int32, device=device)
    with ctx:
        out, lse, _, _ = interface._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, 9, 20, 0.0, None, True,
            leftpad_k=torch.tensor(pad, **i32), seqused_k=torch.tensor(used, **i32),
        )  # fmt: skip
        only_used, _, _, _ = interface._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, 9, 20, 0.0, None, False, seqused_k=torch.tensor(used, **i32)
        )
    for b in range(3):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]) + pad[b], int(cu_k[b]) + used[b])
        (ref, ref_lse, _), (ref_lowp, lowp_lse, _) = reference(
            q[rq][None], k[keys][None], v[keys][None], torch.zeros_like(q[rq][None]), scale=0.25, causal=True
        )
        check_close(f"leftpad seq {b}", out[rq][None], ref, ref_lowp)
        check_lse(lse[:, rq], ref_lse[0], lowp_lse[0])
        keys = slice(int(cu_k[b]), int(cu_k[b]) + used[b])
        (ref, _, _), (ref_lowp, _, _) = reference(
            q[rq][None], k[keys][None], v[keys][None], torch.zeros_like(q[rq][None]), scale=0.25
        )
        check_close(f"seqused seq {b}", only_used[rq][None], ref, ref_lowp)
    with pytest.raises(RuntimeError, match=r"seqused_k\[1\] = 21 must be in \[0, 20\]"):
        interface._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, 9, 20, 0.0, None, False, seqused_k=torch.tensor([1, 21, 1], **i32)
        )
    with pytest.raises(RuntimeError, match=r"leftpad_k\[0\] = 5 must be in \[0, 4\]"):
        interface._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, 9, 20, 0.0, None, False,
            leftpad_k=torch.tensor([5, 0, 0], **i32), seqused_k=torch.tensor([4, 1, 1], **i32),
        )  # fmt: skip


def test_varlen_paged_forward(backend):
    """block_table: the keys of sequence b are the first cu_seqlens_k lengths (or seqused_k) of its
    pages; returns the LSE too."""
    ctx, device = on(backend)
    lq, lk = [3, 7], [10, 13]
    page = 4
    q = torch.randn(sum(lq), 2, 16, dtype=F16, device=device)
    pool_k = torch.randn(9, page, 1, 16, dtype=F16, device=device)
    pool_v = torch.randn(9, page, 1, 16, dtype=F16, device=device)
    table = torch.tensor([[5, 0, 7, 2], [1, 8, 3, 6]], dtype=torch.int32, device=device)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    used = torch.tensor([9, 13], dtype=torch.int32, device=device)
    with ctx:
        out, lse, s_dmask, rng_state = interface._flash_attn_varlen_forward(
            q, pool_k, pool_v, cu_q, cu_k, 7, 13, 0.0, None, True, block_table=table
        )
        out_used, _, _, _ = interface._flash_attn_varlen_forward(
            q, pool_k, pool_v, cu_q, cu_k, 7, 13, 0.0, None, True, block_table=table, seqused_k=used
        )
    assert s_dmask.numel() == 0 and rng_state.shape == (2,)
    for b, n_keys in enumerate(lk):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = pool_k[table[b].long()].flatten(0, 1)
        values = pool_v[table[b].long()].flatten(0, 1)
        for got, n in ((out, n_keys), (out_used, int(used[b]))):
            (ref, ref_lse, _), (ref_lowp, lowp_lse, _) = reference(
                q[rq][None], keys[:n][None], values[:n][None], torch.zeros_like(q[rq][None]), scale=0.25, causal=True
            )
            check_close(f"paged seq {b} keys {n}", got[rq][None], ref, ref_lowp)
            if got is out:
                check_lse(lse[:, rq], ref_lse[0], lowp_lse[0])
    with pytest.raises(RuntimeError, match="leftpad_k cannot be combined with block_table"):
        interface._flash_attn_varlen_forward(
            q, pool_k, pool_v, cu_q, cu_k, 7, 13, 0.0, None, True, block_table=table, leftpad_k=used
        )


# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------


def test_interface_arguments_are_checked():
    q, k, v = inputs("cpu", b=1, sq=8, sk=8, h=2, hk=2, d=16)
    with pytest.raises(RuntimeError, match="return_softmax is only supported with dropout_p > 0"):
        interface._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, True)
    out, lse, _, rng_state = interface._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False)
    args = (0.0, None, False, -1, -1, 0.0, None, False, rng_state)
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    with pytest.raises(RuntimeError, match=r"dq must have q's shape \(1, 8, 2, 16\)"):
        interface._flash_attn_backward(q, q, k, v, out, lse, bufs[0][:, :4], *bufs[1:], *args)
    with pytest.raises(TypeError, match="dk must have k's dtype"):
        interface._flash_attn_backward(q, q, k, v, out, lse, bufs[0], bufs[1].float(), bufs[2], *args)
    with pytest.raises(RuntimeError, match=r"softmax_lse must have shape \(1, 2, 8\)"):
        interface._flash_attn_backward(q, q, k, v, out, lse[..., :4], *bufs, *args)
    with pytest.raises(TypeError, match="softmax_lse must be float32"):
        interface._flash_attn_backward(q, q, k, v, out, lse.half(), *bufs, *args)
    with pytest.raises(RuntimeError, match="dout must have q's shape"):
        interface._flash_attn_backward(q[:, :4], q, k, v, out, lse, *bufs, *args)
    with pytest.raises(checks.InvalidArgument, match="window_size"):
        interface._flash_attn_forward(q, k, v, 0.0, None, False, 1.5, -1, 0.0, None, False)


def test_window_sides_as_tensors():
    """flash_attn's tests draw the window with torch.randint: 0-d tensors as window_size_left/right."""
    q, k, v = inputs("cpu", b=1, sq=16, sk=16, h=2, hk=2, d=16)
    a = interface._flash_attn_forward(q, k, v, 0.0, None, False, torch.tensor(3), torch.tensor(1), 0.0, None, False)
    b = interface._flash_attn_forward(q, k, v, 0.0, None, False, 3, 1, 0.0, None, False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------


def test_compiled_forward_and_backward():
    """A ring step compiled whole (fullgraph): the interface traces to the custom ops, the buffers are
    written in place; out, LSE and gradients against the reference, as the eager step's."""
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 24, 2, 16, dtype=dtype, device=device) for _ in range(3))
    dout = torch.randn_like(q)

    def step(q, k, v, dout, dq, dk, dv):
        out, lse, _, rng_state = interface._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
        interface._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True, -1, -1, 0.0, None, False, rng_state
        )
        return out, lse

    compiled = torch.compile(step, fullgraph=True, backend=COMPILE_BACKEND)
    (ref, ref_lse, ref_grads), (ref_lowp, lowp_lse, lowp_grads) = reference(q, k, v, dout, scale=0.25, causal=True)
    for name, run in (("compiled", compiled), ("eager", step)):
        bufs = [torch.zeros_like(t) for t in (q, k, v)]
        out, lse = run(q, k, v, dout, *bufs)
        check_close(f"{name} out", out, ref, ref_lowp)
        check_lse(lse, ref_lse, lowp_lse)
        check_grads(name, bufs, ref_grads, lowp_grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_forward_dtypes(backend, dtype):
    interpreter_skips(backend, dtype)
    ctx, device = on(backend)
    q, k, v = inputs(device, b=1, sq=29, sk=29, h=2, hk=1, d=64, dtype=dtype)
    dout = torch.randn_like(q)
    with ctx:
        out, lse, _, rng_state = interface._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        interface._flash_attn_backward(
            dout, q, k, v, out, lse, *grads, 0.0, None, True, -1, -1, 0.0, None, True, rng_state
        )
    (ref, _, ref_grads), (ref_lowp, _, lowp_grads) = reference(q, k, v, dout, scale=64**-0.5, causal=True)
    check_close("out", out, ref, ref_lowp)
    check_grads(str(dtype), grads, ref_grads, lowp_grads)


def test_get_block_size_n_follows_flash_attn():
    """flash_attn's helper (imported by code written for it, its own tests among them): its table."""
    from tileattn.interface import _get_block_size_n

    assert [_get_block_size_n("cpu", d, False, False) for d in (32, 64, 96, 128, 256)] == [128, 128, 64, 64, 64]
    assert [_get_block_size_n("cpu", d, True, False) for d in (64, 128)] == [64, 32]
    with pytest.raises(ValueError, match="head_dim"):
        _get_block_size_n("cpu", 300, False, False)
