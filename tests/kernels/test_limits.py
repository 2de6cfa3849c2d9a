"""Calls past the grid's and the scheduler's limits: packed batches of more sequences than the kernels
scan in registers (binary search over tile counts), dense batches past CUDA's 65,535 programs on the grid's
z axis (run as packed batches of equal lengths), and packed token buffers with padding after the last
sequence (``cu_seqlens[-1] < total``, as flash_attn accepts).

On CPU the limits are lowered through the settings (``configs.override``) so that the interpreter runs the
same code paths on tiny shapes; on a GPU the real sizes run too. The reference is written here: each
sequence's softmax(QKᵀ·scale)·V in fp64, with its own bottom-right causal mask."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import tileattn
from conftest import HAS_CUDA
from helpers import check_attention, interpreter_skips, on
from tileattn.kernels import configs
from tileattn.testing import check_close


def _dense_attention(q, k, v, causal: bool, upcast: bool) -> torch.Tensor:
    """One sequence: q ``(sq, h, d)``, k/v ``(sk, hk, d)``; GQA by repeating kv heads."""
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
    sq, sk = q.shape[0], k.shape[0]
    if causal:  # query i sees keys j <= i + sk - sq
        i = torch.arange(sq).view(-1, 1)
        j = torch.arange(sk).view(1, -1)
        scores = scores.masked_fill(j > i + sk - sq, float("-inf"))
    probs = torch.softmax(scores.float() if not upcast else scores, dim=-1).to(dtype).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", probs, v)


def _packed_reference(q, k, v, cu_q, cu_k, causal, upcast):
    out = torch.zeros(q.shape, dtype=torch.float64 if upcast else q.dtype)
    for b in range(len(cu_q) - 1):
        rows = slice(cu_q[b], cu_q[b + 1])
        keys = slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] > cu_q[b]:
            out[rows] = _dense_attention(q[rows], k[keys], v[keys], causal, upcast)
    return out


def _limits(device: str, **changes):
    return configs.override(dataclasses.replace(configs.current(torch.device(device)), **changes))


def _check_packed(backend, lengths_q, lengths_k, causal, pad_q=0, pad_k=0, **limits):
    """Forward and backward of a packed batch on ``backend`` against the reference; ``pad_*`` rows of
    padding after the last sequence must come back as zeros (out, LSE +inf, gradients)."""
    dtype = torch.float16
    interpreter_skips(backend, dtype)
    ctx, device = on(backend)
    cu_q = [0, *torch.tensor(lengths_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lengths_k).cumsum(0).tolist()]
    q = torch.randn(cu_q[-1] + pad_q, 4, 24, dtype=dtype)
    k = torch.randn(cu_k[-1] + pad_k, 2, 24, dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    qd, kd, vd = (t.to(device, copy=True).requires_grad_() for t in (q, k, v))
    cq = torch.tensor(cu_q, dtype=torch.int32, device=device)
    ck = torch.tensor(cu_k, dtype=torch.int32, device=device)
    with ctx, _limits(device, **limits):
        out, lse, _ = tileattn.flash_attn_varlen_func(
            qd, kd, vd, cq, ck, max(lengths_q), max(lengths_k), causal=causal, return_attn_probs=True
        )
        out.backward(dout.to(device))

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = _packed_reference(q64, k64, v64, cu_q, cu_k, causal, upcast=True)
    ref.backward(dout.double())
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    ref_lowp = _packed_reference(ql, kl, vl, cu_q, cu_k, causal, upcast=False)
    ref_lowp.backward(dout)
    check_close("out", out.detach().cpu(), ref.detach(), ref_lowp.detach())
    grads_ref = (q64.grad, k64.grad, v64.grad)
    scale = torch.stack([g.abs().max() for g in grads_ref]).max()
    for name, got, want, lowp in zip(("dq", "dk", "dv"), (qd.grad, kd.grad, vd.grad), grads_ref, (ql, kl, vl)):
        check_close(name, got.cpu(), want, lowp.grad, floor_scale=scale)
    if pad_q:
        assert (out[cu_q[-1] :] == 0).all() and (qd.grad[cu_q[-1] :] == 0).all()
        assert torch.isinf(lse[:, cu_q[-1] :]).all()
    if pad_k:
        assert (kd.grad[cu_k[-1] :] == 0).all() and (vd.grad[cu_k[-1] :] == 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_more_sequences_than_the_scan_holds(backend, causal):
    """More sequences than ``varlen_scan_batch``: tiles map to sequences by binary search (empty sequences
    and one longer than a tile among them)."""
    lengths_q = [3, 0, 17, 1, 5, 40, 2]
    lengths_k = [5, 4, 17, 1, 9, 33, 2]
    _check_packed(backend, lengths_q, lengths_k, causal, varlen_scan_batch=2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_token_buffer(backend, causal):
    """cu_seqlens ending before the tensors do: the rows after are padding, left as zeros."""
    _check_packed(backend, [7, 19, 4], [9, 19, 4], causal, pad_q=5, pad_k=3)


def test_dense_batch_past_the_grid(backend):
    """A dense batch over ``grid_z_batch`` runs as a packed batch: same results as the dense launch,
    dropout masks included (the counters are the same), forward and backward."""
    if backend == "torch":
        pytest.skip("the CPU path has no grid")
    dtype = torch.float16
    interpreter_skips(backend, dtype)
    device = on(backend)[1]
    q = torch.randn(5, 19, 4, 24, dtype=dtype, device=device)
    k = torch.randn(5, 23, 2, 24, dtype=dtype, device=device)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    results = []
    for limit in (65535, 2):
        qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(1)
        with on(backend)[0], _limits(device, grid_z_batch=limit):
            out, lse, s_dmask = tileattn.flash_attn_func(
                qd, kd, vd, dropout_p=0.25, causal=True, return_attn_probs=True
            )
            out.backward(dout)
        results.append((out, lse, qd.grad, kd.grad, vd.grad, s_dmask))
    # the packed launch against the oracle (given the mask it returns, itself checked against the dense one)
    out, lse, dq, dk, dv, s_dmask = results[1]
    feats = dict(causal=True, dropout_p=0.25, dropout_mask=s_dmask >= 0)
    check_attention("past the grid", out, (dq, dk, dv), q, k, v, dout, feats)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "S_dmask"), *results):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not HAS_CUDA, reason="the real sizes need a GPU")
@pytest.mark.slow
def test_real_limits_on_gpu():
    """70,000 dense sequences and 3,000 packed ones on the GPU, against the oracle; the dense batch runs as
    the packed one of the same sequences, bit for bit."""
    q, k, v = (torch.randn(70000, 3, 2, 32, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out = tileattn.flash_attn_func(q, k, v, causal=True)
    check_attention("70,000 sequences", out, None, q, k, v, None, {"causal": True}, check_grads=False)
    want = tileattn.flash_attn_varlen_func(
        *(t.reshape(-1, 2, 32) for t in (q, k, v)),
        *(torch.arange(0, 70001, dtype=torch.int32, device="cuda") * 3,) * 2,
        3,
        3,
        causal=True,
    )
    torch.testing.assert_close(out.reshape(-1, 2, 32), want, atol=0, rtol=0)
    lengths = torch.randint(0, 40, (3000,)).tolist()
    _check_packed("cuda", lengths, lengths, True)
