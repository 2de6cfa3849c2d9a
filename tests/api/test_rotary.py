"""tileattn.rotary (flash_attn.layers.rotary and flash_attn.ops.triton.rotary) against the reference written
from the definition (tests/rotary_ref.py), forward and backward, with the tolerance rule, on every backend
(the Triton kernel on the GPU or under the interpreter, and the PyTorch path): dense and packed (varlen)
inputs, int and tensor offsets, partial rotary, both pair styles, in place, the qkv/kv helpers, the
RotaryEmbedding module and its xPos tables, flash_attn's signatures, bad input, torch.compile."""

import inspect
import math

import pytest
import torch

import rotary_ref
from helpers import check_refused, interpreter_skips, on
from tileattn import rotary
from tileattn.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
)
from tileattn.testing import check_close

F16 = torch.float16
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (batch, seqlen, nheads, headdim, rotary_dim): odd lengths and head dims, partial rotary of a width that is
# not a power of two, the smallest rotary_dim (2), and the widest head.
CASES = [
    (2, 7, 3, 16, 16),
    (1, 33, 2, 40, 24),
    (3, 5, 1, 64, 2),
    (2, 17, 4, 59, 32),
    (1, 1, 5, 128, 128),
    (2, 9, 2, 256, 96),
]


def _case_id(case):
    b, s, h, d, r = case
    return f"B{b}-S{s}-H{h}-D{d}-R{r}"


def _skip(backend, dtype):
    interpreter_skips(backend, dtype)
    if backend == "interpret" and dtype != F16:
        pytest.skip("the interpreter runs the kernels on float16 CPU tensors only (others take the PyTorch path)")


def _check(name, out, x, cos, sin, positions, interleaved, dout=None, grad=None, conjugate=False):
    """out (and x's gradient ``grad`` for ``dout``) against the reference with the tolerance rule."""
    exact_x = x.detach().double().requires_grad_()
    plain_x = x.detach().clone().requires_grad_()
    ref = rotary_ref.rotary(exact_x, cos, sin, positions, interleaved, conjugate=conjugate)
    ref_lowp = rotary_ref.rotary(plain_x, cos, sin, positions, interleaved, exact=False, conjugate=conjugate)
    check_close(f"{name} out", out, ref, ref_lowp)
    if dout is not None:
        (g_ref,) = torch.autograd.grad(ref, exact_x, dout.double())
        (g_lowp,) = torch.autograd.grad(ref_lowp, plain_x, dout)
        check_close(f"{name} dx", grad, g_ref, g_lowp)


@pytest.mark.parametrize("offsets", ["int", "tensor"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_apply_rotary_emb(backend, case, dtype, interleaved, offsets):
    _skip(backend, dtype)
    ctx, device = on(backend)
    b, s, h, d, r = case
    cos, sin = rotary_ref.tables(s + 3 * b + 4, r, dtype, device)
    offs = 3 if offsets == "int" else [3 * i + (i % 2) for i in range(b)]
    seqlen_offsets = offs if offsets == "int" else torch.tensor(offs, dtype=torch.int32, device=device)
    x = torch.randn(b, s, h, d, dtype=dtype, device=device, requires_grad=True)
    dout = torch.randn_like(x)
    with ctx:
        out = apply_rotary_emb(x, cos, sin, interleaved, False, seqlen_offsets)
        (grad,) = torch.autograd.grad(out, x, dout)
    _check(f"{_case_id(case)}", out, x, cos, sin, rotary_ref.dense_positions(b, s, offs), interleaved, dout, grad)


@pytest.mark.parametrize("offsets", ["int", "tensor"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_apply_rotary_emb_varlen(backend, interleaved, offsets):
    """Packed (total, nheads, headdim) with cu_seqlens: positions restart in each sequence (an empty one
    among them); rows past cu_seqlens[-1] are padding and come out unchanged."""
    ctx, device = on(backend)
    cu = [0, 5, 5, 22, 23, 40]
    total, h, d, r = 43, 3, 48, 32
    max_seqlen = 17
    cos, sin = rotary_ref.tables(max_seqlen + 20, r, F16, device)
    offs = 2 if offsets == "int" else [0, 7, 3, 19, 1]
    seqlen_offsets = offs if offsets == "int" else torch.tensor(offs, dtype=torch.int64, device=device)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    x = torch.randn(total, h, d, dtype=F16, device=device, requires_grad=True)
    dout = torch.randn_like(x)
    with ctx:
        out = apply_rotary_emb(x, cos, sin, interleaved, False, seqlen_offsets, cu_seqlens, max_seqlen)
        (grad,) = torch.autograd.grad(out, x, dout)
    positions = rotary_ref.packed_positions(cu, total, offs)
    _check("varlen", out, x, cos, sin, positions, interleaved, dout, grad)
    assert torch.equal(out[cu[-1] :], x[cu[-1] :]), "padding rows past cu_seqlens[-1] changed"


def test_in_place(backend):
    """inplace=True (also positionally, flash_attn's fifth argument) rotates x itself and returns it;
    autograd sees the write (mark_dirty): the gradient flows to the tensor x was computed from."""
    ctx, device = on(backend)
    cos, sin = rotary_ref.tables(20, 16, F16, device)
    base = torch.randn(2, 9, 3, 24, dtype=F16, device=device, requires_grad=True)
    dout = torch.randn(2, 9, 3, 24, dtype=F16, device=device)
    with ctx:
        x = base * 1  # (a non-leaf: rotated in place)
        before = x.detach().clone()
        out = apply_rotary_emb(x, cos, sin, True, True, 2)
        assert out is x
        (grad,) = torch.autograd.grad(out, base, dout)
    _check("in place", out, before, cos, sin, rotary_ref.dense_positions(2, 9, 2), True)
    _check("in place grad", grad, dout, cos, sin, rotary_ref.dense_positions(2, 9, 2), True, conjugate=True)
    with on(backend)[0], pytest.raises(RuntimeError, match="in-place"):  # a leaf that requires grad: as torch's own ops
        apply_rotary_emb(base, cos, sin, inplace=True)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_apply_rotary_conjugate_and_strides(backend, interleaved):
    """flash_attn.ops.triton.rotary.apply_rotary: conjugate rotates by -angle; x may be a strided view
    (the queries of a packed qkv) and written in place through it."""
    ctx, device = on(backend)
    cos, sin = rotary_ref.tables(30, 20, F16, device)
    qkv = torch.randn(2, 11, 3, 4, 32, dtype=F16, device=device)
    q = qkv[:, :, 0]
    positions = rotary_ref.dense_positions(2, 11, [4, 9])
    offsets = torch.tensor([4, 9], device=device)
    with ctx:
        out = apply_rotary(q, cos, sin, offsets, interleaved=interleaved, conjugate=True)
        _check("conjugate", out, q, cos, sin, positions, interleaved, conjugate=True)
        before = qkv.clone()
        res = apply_rotary(q, cos, sin, offsets, interleaved=interleaved, inplace=True)
    assert res is q
    _check("strided in place", qkv[:, :, 0], before[:, :, 0], cos, sin, positions, interleaved)
    assert torch.equal(qkv[:, :, 1:], before[:, :, 1:]), "in place through a view wrote outside it"


@pytest.mark.parametrize("layout", ["3-heads", "gqa", "xpos-tables", "strided"])
def test_apply_rotary_emb_qkv_(backend, layout):
    """In place on the queries and keys of a packed qkv (5-D, or 4-D GQA with num_heads_q), with separate
    key tables (xPos), on a qkv whose (3, nheads) dims do not merge (two launches); the values pass
    through; the backward."""
    ctx, device = on(backend)
    b, s, h, d, r = 2, 13, 3, 40, 24
    cos, sin = rotary_ref.tables(s + 5, r, F16, device)
    cos_k, sin_k = rotary_ref.tables(s + 5, r, F16, device) if layout == "xpos-tables" else (None, None)
    view = lambda t: t  # noqa: E731  (qkv's layout from the leaf's)
    parts = lambda t: t.unbind(2)  # noqa: E731
    kwargs = {}
    shape = (b, s, 3, h, d)
    if layout == "gqa":
        hq, hk = 4, 2
        shape = (b, s, hq + 2 * hk, d)
        parts = lambda t: (t[:, :, :hq], t[:, :, hq : hq + hk], t[:, :, hq + hk :])  # noqa: E731
        kwargs = {"num_heads_q": hq}
    elif layout == "strided":
        shape = (b, s, h, 3, d)
        view = lambda t: t.transpose(2, 3)  # noqa: E731
    base = torch.randn(shape, dtype=F16, device=device, requires_grad=True)
    dout = torch.randn(view(base).shape, dtype=F16, device=device)
    with ctx:
        qkv = view(base * 1)
        before = qkv.detach().clone()
        out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, False, 1, **kwargs)
        assert out is qkv
        (grad,) = torch.autograd.grad(out, base, dout)
    positions = rotary_ref.dense_positions(b, s, 1)
    (q0, k0, v0), (q1, k1, v1) = parts(before), parts(qkv.detach())
    _check(f"{layout} q", q1, q0, cos, sin, positions, False)
    ck, sk = (cos, sin) if cos_k is None else (cos_k, sin_k)
    _check(f"{layout} k", k1, k0, ck, sk, positions, False)
    assert torch.equal(v1, v0), "the values changed"
    (dq, dk, dv), (gq, gk, gv) = parts(dout), parts(view(grad))
    _check(f"{layout} dq", gq, dq, cos, sin, positions, False, conjugate=True)
    _check(f"{layout} dk", gk, dk, ck, sk, positions, False, conjugate=True)
    assert torch.equal(gv, dv)


def test_apply_rotary_emb_kv_(backend):
    ctx, device = on(backend)
    cos, sin = rotary_ref.tables(20, 16, F16, device)
    base = torch.randn(2, 7, 2, 3, 16, dtype=F16, device=device, requires_grad=True)
    dout = torch.randn_like(base)
    offsets = torch.tensor([0, 11], dtype=torch.int32, device=device)
    with ctx:
        kv = base * 1
        before = kv.detach().clone()
        out = apply_rotary_emb_kv_(kv, cos, sin, True, offsets)
        (grad,) = torch.autograd.grad(out, base, dout)
    assert out is kv
    positions = rotary_ref.dense_positions(2, 7, [0, 11])
    _check("kv k", kv[:, :, 0], before[:, :, 0], cos, sin, positions, True)
    assert torch.equal(kv[:, :, 1], before[:, :, 1])
    _check("kv dk", grad[:, :, 0], dout[:, :, 0], cos, sin, positions, True, conjugate=True)
    assert torch.equal(grad[:, :, 1], dout[:, :, 1])


def _tables_from_definition(dim, base, seqlen, scale_base=None):
    """RoPE angles ``t · base^(-2f/dim)`` and xPos scales ``((2f + 0.4 dim) / (1.4 dim)) ^ ((t - seqlen // 2) /
    scale_base)``, in float64: (cos, sin, cos_k, sin_k)."""
    t = torch.arange(seqlen, dtype=torch.float64)[:, None]
    f = torch.arange(dim // 2, dtype=torch.float64)[None]
    angle = t * base ** (-2 * f / dim)
    if scale_base is None:
        return angle.cos(), angle.sin(), None, None
    scale = ((2 * f + 0.4 * dim) / (1.4 * dim)) ** ((t - seqlen // 2) / scale_base)
    return angle.cos() * scale, angle.sin() * scale, angle.cos() / scale, angle.sin() / scale


@pytest.mark.parametrize("scale_base", [None, 512], ids=["rope", "xpos"])
def test_rotary_embedding_tables(scale_base):
    """The cos/sin cache against the definition: fp32 angles (flash_attn's precision: the error is the
    rounding of ``t · inv_freq`` in fp32, below 4 ulps of the largest angle)."""
    dim, seqlen = 24, 300
    module = RotaryEmbedding(dim, base=500.0, scale_base=scale_base)
    module._update_cos_sin_cache(seqlen, device=torch.device("cpu"), dtype=torch.float32)
    expected = _tables_from_definition(dim, 500.0, seqlen, scale_base)
    got = (module._cos_cached, module._sin_cached, module._cos_k_cached, module._sin_k_cached)
    tol = 4 * torch.finfo(torch.float32).eps * seqlen * 2  # (angles up to seqlen; xPos scales up to ~2)
    for name, g, e in zip(("cos", "sin", "cos_k", "sin_k"), got, expected):
        if e is None:
            assert g is None
            continue
        assert g.dtype == torch.float32 and g.shape == (seqlen, dim // 2)
        torch.testing.assert_close(g.double(), e, atol=tol, rtol=0, msg=name)
    # the cache grows, follows the dtype, and is not rebuilt for shorter sequences
    module._update_cos_sin_cache(10, device=torch.device("cpu"), dtype=torch.float32)
    assert module._seq_len_cached == seqlen
    module._update_cos_sin_cache(10, device=torch.device("cpu"), dtype=torch.float16)
    assert module._cos_cached.dtype == torch.float16 and module._seq_len_cached == 10
    assert "inv_freq" not in module.state_dict() and "scale" not in module.state_dict()


@pytest.mark.parametrize("scale_base", [None, 512], ids=["rope", "xpos"])
@pytest.mark.parametrize("mode", ["qkv", "gqa", "q-kv", "tensor-offset"])
def test_rotary_embedding_forward(backend, mode, scale_base):
    """RotaryEmbedding.forward rotates in place and returns what flash_attn returns: qkv, or (q, kv); q
    with the q tables and k with the k tables (they differ with xPos), v untouched."""
    ctx, device = on(backend)
    b, s, h, d, dim = 2, 9, 2, 32, 16
    module = RotaryEmbedding(dim, interleaved=True, scale_base=scale_base, device=device)
    offset = 3
    max_seqlen = None
    if mode == "tensor-offset":
        offset, max_seqlen = torch.tensor([2, 5], dtype=torch.int32, device=device), 20
    with ctx:
        if mode == "q-kv":
            q = torch.randn(b, s, h, d, dtype=F16, device=device)
            kv = torch.randn(b, s, 2, 1, d, dtype=F16, device=device)
            q0, kv0 = q.clone(), kv.clone()
            out = module(q, kv, seqlen_offset=offset)
            assert isinstance(out, tuple) and out[0] is q and out[1] is kv
            pieces = [(q, q0, "q"), (kv[:, :, 0], kv0[:, :, 0], "k")]
            untouched = (kv[:, :, 1], kv0[:, :, 1])
        else:
            heads = 2 * h + 2 if mode == "gqa" else 3 * h
            qkv = torch.randn(b, s, heads, d, dtype=F16, device=device)
            qkv0 = qkv.clone()
            if mode == "gqa":
                out = module(qkv, seqlen_offset=offset, num_heads_q=2 * h)
                pieces = [
                    (qkv[:, :, : 2 * h], qkv0[:, :, : 2 * h], "q"),
                    (qkv[:, :, 2 * h : 2 * h + 1], qkv0[:, :, 2 * h : 2 * h + 1], "k"),
                ]
                untouched = (qkv[:, :, 2 * h + 1 :], qkv0[:, :, 2 * h + 1 :])
            else:
                qkv, qkv0 = qkv.unflatten(2, (3, h)), qkv0.unflatten(2, (3, h))
                out = module(qkv, seqlen_offset=offset, max_seqlen=max_seqlen)
                pieces = [(qkv[:, :, 0], qkv0[:, :, 0], "q"), (qkv[:, :, 1], qkv0[:, :, 1], "k")]
                untouched = (qkv[:, :, 2], qkv0[:, :, 2])
            assert out is qkv
    offs = offset.tolist() if isinstance(offset, torch.Tensor) else offset
    positions = rotary_ref.dense_positions(b, s, offs)
    assert module._seq_len_cached == (max_seqlen if max_seqlen is not None else s + offset)
    tables = {"q": (module._cos_cached, module._sin_cached)}  # (checked against the definition above)
    tables["k"] = (module._cos_k_cached, module._sin_k_cached) if scale_base is not None else tables["q"]
    for got, before, name in pieces:
        assert tables[name][0].dtype == F16
        _check(f"{mode} {name}", got, before, *tables[name], positions, True)
    assert torch.equal(*untouched)


def test_triton_kernel_matches_torch_path_bitwise(backend):
    """The kernel and the PyTorch path compute the same fp32 products and sums (no FMA contraction) and
    round once: the same bits, on every layout."""
    if backend == "torch":
        pytest.skip("compares the kernel (GPU or interpreter) with the PyTorch path")
    ctx, device = on(backend)
    from tileattn.api import cpu_backend

    cos, sin = rotary_ref.tables(64, 40, F16, device)
    x = torch.randn(3, 21, 5, 72, dtype=F16, device=device)
    cu = torch.tensor([0, 20, 41, 63], dtype=torch.int32, device=device)
    offsets = torch.tensor([1, 0, 30], device=device)

    def calls(x, cos, sin, cu, offsets, interleaved):
        return [
            apply_rotary_emb(x, cos, sin, interleaved, False, offsets),
            apply_rotary(x.flatten(0, 1), cos, sin, 3, cu, 22, interleaved, conjugate=True),
            apply_rotary_emb(x[:, :, 1:4], cos[:, :8], sin[:, :8], interleaved, True, 5),
        ]

    for interleaved in (False, True):
        with on(backend)[0]:
            kernel = calls(x.clone(), cos, sin, cu, offsets, interleaved)
        with cpu_backend("torch"):
            torch_path = calls(x.cpu(), cos.cpu(), sin.cpu(), cu.cpu(), offsets.cpu(), interleaved)
        for k, t in zip(kernel, torch_path):
            assert torch.equal(k.cpu(), t), (k.cpu().float() - t.float()).abs().max()


def test_empty_inputs(backend):
    ctx, device = on(backend)
    cos, sin = rotary_ref.tables(8, 8, F16, device)
    with ctx:
        for x in (torch.zeros(0, 4, 2, 8, dtype=F16, device=device), torch.zeros(2, 0, 2, 8, dtype=F16, device=device)):
            assert apply_rotary_emb(x, cos, sin).shape == x.shape
        packed = torch.randn(3, 2, 8, dtype=F16, device=device)
        out = apply_rotary_emb(
            packed, cos, sin, cu_seqlens=torch.zeros(1, dtype=torch.int32, device=device), max_seqlen=0
        )
    assert torch.equal(out, packed)  # no sequences: all rows are padding


def test_apply_rotary_emb_torch_and_rotate_half():
    """flash_attn's plain-PyTorch helpers, in x's precision, with per-batch tables too."""
    x = torch.randn(2, 6, 3, 20, dtype=torch.float64)
    cos, sin = rotary_ref.tables(6, 12, torch.float64)
    for interleaved in (False, True):
        out = apply_rotary_emb_torch(x, cos, sin, interleaved)
        ref = rotary_ref.rotary(x, cos, sin, rotary_ref.dense_positions(2, 6, 0), interleaved)
        torch.testing.assert_close(out, ref)
        per_batch = apply_rotary_emb_torch(x, cos.expand(2, 6, 6), sin.expand(2, 6, 6), interleaved)
        torch.testing.assert_close(per_batch, ref)
    y = torch.arange(4.0)
    assert rotary.rotate_half(y).tolist() == [-2.0, -3.0, 0.0, 1.0]
    assert rotary.rotate_half(y, interleaved=True).tolist() == [-1.0, 0.0, -3.0, 2.0]


# flash_attn 2.8.3's parameters (name, default) of each public name, read from its sources.
_EMPTY = inspect.Parameter.empty
FLASH_ATTN_SIGNATURES = {
    "apply_rotary_emb": [
        ("x", _EMPTY),
        ("cos", _EMPTY),
        ("sin", _EMPTY),
        ("interleaved", False),
        ("inplace", False),
        ("seqlen_offsets", 0),
        ("cu_seqlens", None),
        ("max_seqlen", None),
    ],
    "apply_rotary_emb_qkv_": [
        ("qkv", _EMPTY),
        ("cos", _EMPTY),
        ("sin", _EMPTY),
        ("cos_k", None),
        ("sin_k", None),
        ("interleaved", False),
        ("seqlen_offsets", 0),
        ("num_heads_q", None),
    ],
    "apply_rotary_emb_kv_": [
        ("kv", _EMPTY),
        ("cos", _EMPTY),
        ("sin", _EMPTY),
        ("interleaved", False),
        ("seqlen_offsets", 0),
    ],
    "apply_rotary": [
        ("x", _EMPTY),
        ("cos", _EMPTY),
        ("sin", _EMPTY),
        ("seqlen_offsets", 0),
        ("cu_seqlens", None),
        ("max_seqlen", None),
        ("interleaved", False),
        ("inplace", False),
        ("conjugate", False),
    ],
    "RotaryEmbedding": [
        ("dim", _EMPTY),
        ("base", 10000.0),
        ("interleaved", False),
        ("scale_base", None),
        ("device", None),
    ],
    "RotaryEmbedding.forward": [
        ("qkv", _EMPTY),
        ("kv", None),
        ("seqlen_offset", 0),
        ("max_seqlen", None),
        ("num_heads_q", None),
    ],
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_SIGNATURES))
def test_flash_attn_signatures(name):
    obj = rotary
    for part in name.split("."):
        obj = getattr(obj, part)
    params = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    assert [(p.name, p.default) for p in params] == FLASH_ATTN_SIGNATURES[name]
    assert rotary.apply_rotary_emb_func is apply_rotary_emb
    assert set(rotary.__all__) >= {"apply_rotary_emb", "apply_rotary", "RotaryEmbedding", "apply_rotary_emb_func"}


_x = torch.randn(2, 8, 4, 16, dtype=F16)
_c, _s = torch.ones(16, 8, dtype=F16), torch.zeros(16, 8, dtype=F16)
_cu = torch.tensor([0, 4, 8], dtype=torch.int32)
BAD = [
    ("x-rank", lambda: apply_rotary_emb(_x[None], _c, _s), ValueError, ["x", "(batch, seqlen, nheads, headdim)"]),
    ("x-dtype", lambda: apply_rotary_emb(_x.int(), _c, _s), TypeError, ["x", "float16"]),
    ("cos-1d", lambda: apply_rotary_emb(_x, _c[0], _s), ValueError, ["cos", "2-D"]),
    ("cos-sin-shapes", lambda: apply_rotary_emb(_x, _c, _s[:, :4]), ValueError, ["cos and sin", "shape"]),
    ("rotary-too-wide", lambda: apply_rotary_emb(_x, _c[:, :1].expand(16, 9), _c[:, :1].expand(16, 9)), ValueError, ["rotary_dim", "18", "head dim"]),
    ("table-short", lambda: apply_rotary_emb(_x, _c, _s, seqlen_offsets=9), ValueError, ["cos/sin", "16 positions", "9...16"]),
    ("offset-negative", lambda: apply_rotary_emb(_x, _c, _s, seqlen_offsets=-1), ValueError, ["positions -1"]),
    ("offset-float", lambda: apply_rotary_emb(_x, _c, _s, seqlen_offsets=1.0), TypeError, ["seqlen_offsets", "int"]),
    ("offsets-shape", lambda: apply_rotary_emb(_x, _c, _s, seqlen_offsets=torch.zeros(3, dtype=torch.int32)), ValueError, ["seqlen_offsets", "(2,)"]),
    ("offsets-float", lambda: apply_rotary_emb(_x, _c, _s, seqlen_offsets=torch.zeros(2)), ValueError, ["seqlen_offsets", "int32/int64"]),
    ("offsets-too-far", lambda: apply_rotary_emb(_x, _c, _s, seqlen_offsets=torch.tensor([0, 9])), ValueError, ["seqlen_offsets[1] = 9", "9...16", "16 positions"]),
    ("offsets-negative", lambda: apply_rotary_emb(_x, _c, _s, seqlen_offsets=torch.tensor([-2, 0])), ValueError, ["seqlen_offsets[0] = -2"]),
    ("varlen-rank", lambda: apply_rotary_emb(_x, _c, _s, cu_seqlens=_cu, max_seqlen=6), ValueError, ["(total, nheads, headdim)"]),
    ("varlen-max-seqlen", lambda: apply_rotary_emb(_x[0], _c, _s, cu_seqlens=_cu), TypeError, ["max_seqlen"]),
    ("varlen-int64", lambda: apply_rotary_emb(_x[0], _c, _s, cu_seqlens=_cu.long(), max_seqlen=6), TypeError, ["cu_seqlens", "int32"]),
    ("varlen-values", lambda: apply_rotary_emb(_x[0], _c, _s, cu_seqlens=torch.tensor([0, 4, 9, 7], dtype=torch.int32), max_seqlen=6), ValueError, ["cu_seqlens", "non-decreasing"]),
    ("varlen-longest", lambda: apply_rotary_emb(_x[0], _c, _s, cu_seqlens=_cu, max_seqlen=3), ValueError, ["max_seqlen", "longest"]),
    ("varlen-table", lambda: apply_rotary_emb(_x[0], _c, _s, 0, False, 11, _cu, 6), ValueError, ["cos/sin", "max_seqlen"]),
    ("qkv-no-heads", lambda: apply_rotary_emb_qkv_(_x, _c, _s), ValueError, ["num_heads_q"]),
    ("qkv-heads", lambda: apply_rotary_emb_qkv_(_x, _c, _s, num_heads_q=3), ValueError, ["num_heads_q (3)"]),
    ("qkv-three", lambda: apply_rotary_emb_qkv_(_x[:, :, None].expand(2, 8, 2, 4, 16), _c, _s), ValueError, ["qkv", "3"]),
    ("kv-shape", lambda: apply_rotary_emb_kv_(_x, _c, _s), ValueError, ["kv must be (batch, seqlen, 2, nheads, headdim)"]),
    ("module-odd-dim", lambda: RotaryEmbedding(5), ValueError, ["dim", "even"]),
    ("module-tensor-offset", lambda: RotaryEmbedding(8)(_x, seqlen_offset=torch.zeros(2, dtype=torch.int32), num_heads_q=2), ValueError, ["max_seqlen"]),
]  # fmt: skip


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_refused(call, exc, words):
    check_refused(call, exc, words)


def test_refused_before_writing():
    """A refused in-place call leaves x untouched."""
    x = _x.clone()
    with pytest.raises(ValueError):
        apply_rotary_emb(x, _c * 0.5, _s + 0.5, inplace=True, seqlen_offsets=torch.tensor([0, 12]))
    assert torch.equal(x, _x)


@pytest.mark.parametrize("inplace", [False, True])
def test_torch_compile_fullgraph(inplace):
    """apply_rotary_emb (and, in place, RotaryEmbedding on qkv) trace as custom ops without graph breaks,
    forward and backward, with the eager results."""
    x = torch.randn(2, 7, 3, 16, requires_grad=True)
    cos, sin = rotary_ref.tables(12, 8, torch.float32)
    module = RotaryEmbedding(8, scale_base=512)

    def fn(x):
        if inplace:
            return module((x * 2).unsqueeze(2).repeat(1, 1, 3, 1, 1)) * 1
        return apply_rotary_emb_func(x * 2, cos, sin, True, False, torch.tensor([1, 4]))

    eager = fn(x)
    (g_eager,) = torch.autograd.grad(eager.square().sum(), x)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    (g_compiled,) = torch.autograd.grad(compiled.square().sum(), x)
    assert torch.equal(compiled, eager) and torch.equal(g_compiled, g_eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a sequence spanning more than 2**31 elements needs a GPU")
def test_long_sequence_64_bit_offsets(big_gpu_memory):
    """Row offsets past 2**31 elements (one sequence of 2**19 + 3 tokens × 32 heads × 128 channels), in
    place and out of place, at the last rows against the reference."""
    s, h, d = 2**19 + 3, 32, 128
    x = torch.randn(1, s, h, d, dtype=F16, device="cuda")
    cos, sin = rotary_ref.tables(s + 2, 64, F16, "cuda")
    out = apply_rotary_emb(x, cos, sin, False, False, 2)
    tail = slice(s - 5, s)
    positions = rotary_ref.dense_positions(1, s, 2)[:, tail]
    _check("long out", out[:, tail], x[:, tail], cos, sin, positions, False)
    head = x[:, tail].clone()
    apply_rotary_emb(x, cos, sin, True, True, 2)
    _check("long in place", x[:, tail], head, cos, sin, positions, True)
    assert math.isfinite(out.float().abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    """Captured calls read no index values on the host (tensor offsets, cu_seqlens) and replay with the
    values the tensors hold at replay: dense with tensor offsets, and packed out of place with padding
    rows past cu_seqlens[-1] copied unchanged."""
    cos, sin = rotary_ref.tables(40, 32, F16, "cuda")
    x = torch.randn(2, 9, 4, 64, dtype=F16, device="cuda")
    packed = torch.randn(20, 4, 64, dtype=F16, device="cuda")
    offsets = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device="cuda")
    calls = lambda: (  # noqa: E731
        apply_rotary_emb(x, cos, sin, False, False, offsets),
        apply_rotary_emb(packed, cos, sin, True, False, offsets, cu, 9),
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # (warm-up: the launch plans)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_packed = calls()
    x.copy_(torch.randn_like(x))
    packed.copy_(torch.randn_like(packed))
    offsets.copy_(torch.tensor([5, 1]))
    cu.copy_(torch.tensor([0, 4, 13]))
    graph.replay()
    torch.cuda.synchronize()
    _check("graph dense", out, x, cos, sin, rotary_ref.dense_positions(2, 9, [5, 1]), False)
    _check("graph packed", out_packed, packed, cos, sin, rotary_ref.packed_positions([0, 4, 13], 20, [5, 1]), True)
