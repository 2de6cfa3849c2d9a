"""Dense and varlen cases and their checks against the tests' oracle (tests/oracle.py), forward and
backward: shared by the API's tests (tests/api) and the kernels' build variants
(tests/kernels/test_builds.py)."""

import torch

import tileattn
from helpers import check_attention, interpreter_skips, on, randn

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, features). Small enough for the interpreter;
# odd lengths and head dims, GQA/MQA, and both seqlen_q < seqlen_k and seqlen_q > seqlen_k.
CASES = [
    (1, 1, 1, 1, 1, 64, {}),
    (2, 33, 47, 2, 1, 1, {"causal": True}),
    (1, 47, 33, 3, 3, 3, {"window_size": (4, 4)}),
    (2, 63, 63, 4, 4, 40, {}),
    (1, 113, 203, 2, 1, 59, {}),
    (1, 203, 113, 4, 2, 96, {"causal": True}),
    (2, 63, 113, 4, 2, 111, {"causal": True}),
    (1, 1, 203, 4, 1, 128, {"causal": True}),
    (1, 113, 63, 2, 2, 64, {"causal": True}),
    (1, 63, 63, 2, 2, 256, {"causal": True}),
    (1, 113, 203, 6, 2, 64, {"window_size": (17, 5)}),
    (1, 203, 113, 2, 2, 40, {"window_size": (9, -1)}),
    (1, 113, 113, 2, 1, 64, {"window_size": (-1, 7)}),
    (1, 113, 203, 2, 2, 64, {"causal": True, "window_size": (31, 31)}),
    (2, 63, 113, 4, 2, 64, {"softcap": 2.5}),
    (1, 113, 113, 2, 2, 96, {"softcap": 10.0, "causal": True}),
    (2, 63, 113, 4, 2, 64, {"alibi": "head"}),
    (2, 113, 63, 4, 4, 59, {"alibi": "batch", "causal": True}),
    (1, 63, 113, 3, 1, 40, {"softmax_scale": 0.3, "softcap": 4.0, "alibi": "head", "window_size": (20, 3)}),
]


def _case_id(case):
    b, sq, sk, h, hk, d, feats = case
    return f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}" + "".join(f"-{k}" for k in feats)


def _call_kwargs(feats, batch, nheads, device):
    kwargs = {k: v for k, v in feats.items() if k != "alibi"}
    if "alibi" in feats:
        shape = (nheads,) if feats["alibi"] == "head" else (batch, nheads)
        kwargs["alibi_slopes"] = torch.rand(shape, device=device) * 0.5
    return kwargs


def _unaligned(t):
    """A leaf copy of ``t`` whose data starts one element past a 16-byte boundary (TMA cannot read it)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return buf[1:].view_as(t).copy_(t).requires_grad_(t.requires_grad)


def _run_case(backend, case, dtype, unaligned=False):
    b, sq, sk, h, hk, d, feats = case
    interpreter_skips(backend, dtype)
    ctx, device = on(backend)
    q = randn(b, sq, h, d, dtype=dtype, device=device)
    k = randn(b, sk, hk, d, dtype=dtype, device=device)
    v = randn(b, sk, hk, d, dtype=dtype, device=device)
    if unaligned:
        q, k, v = (_unaligned(t.detach()).requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    kwargs = _call_kwargs(feats, b, h, device)
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention(_case_id(case), out, grads, q, k, v, dout, kwargs)


# Per-sequence (seqlen_q, seqlen_k), with empty and length-1 sequences and q/k lengths that differ.
LENGTHS = {
    "mixed": [(17, 17), (0, 0), (1, 1), (45, 45), (3, 3)],
    "qk-differ": [(5, 31), (40, 12), (0, 7), (1, 1), (23, 64), (6, 0)],
}


def _cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


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

    # the oracle one sequence at a time; the call's window is resolved at max_seqlen_k
    varlen = (_cu(lq, device), _cu(lk, device), max(lk))
    check_attention(f"varlen {lengths}", out, grads, q, k, v, dout, kwargs, varlen=varlen)
