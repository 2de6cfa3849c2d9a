"""The tests' oracle (tests/oracle.py) checked against what does not share its code: masks written out by
hand, PyTorch's own attention (``scaled_dot_product_attention`` with explicit boolean masks and
``causal_lower_right``), and rotations worked out by hand; then the package's shipped reference
(``tileattn.reference``) and rotary (``tileattn.rotary``) against the oracle, since users test with them."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import oracle

F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# Masks and windows, written out by hand
# ------------------------------------------------------------------------------------------------


def _rows(*rows):
    return torch.tensor([[c == "x" for c in row] for row in rows])


def test_masks_by_hand():
    """Bottom-right alignment, windows on either side, rows that see nothing, sides as wide as the keys."""
    sides = oracle.window_sides
    # 3 queries, 5 keys, window (1, 0): row i's diagonal is key i + 2
    assert torch.equal(oracle.visible(3, 5, *sides(False, (1, 0), 5), 3, 5), _rows(".xx..", "..xx.", "...xx"))
    # 5 queries, 3 keys, causal: the diagonal of rows 0 and 1 lies left of the keys
    assert torch.equal(oracle.visible(5, 3, *sides(True, (-1, -1), 3), 5, 3), _rows("...", "...", "x..", "xx.", "xxx"))
    # window (0, 1) on a square: the diagonal and the key right of it
    assert torch.equal(oracle.visible(3, 3, *sides(False, (0, 1), 3), 3, 3), _rows("xx.", ".xx", "..x"))
    # a side at least seqlen_k is unbounded; one less is not (row i then sees keys up to i - 2 + 2)
    assert sides(False, (3, 3), 3) == (None, None) and sides(False, (2, 2), 3) == (2, 2)
    assert sides(True, (7, 5), 7) == (None, 0) and sides(True, (6, -1), 7) == (6, 0)
    assert torch.equal(oracle.visible(5, 3, *sides(False, (-1, 3), 3), 5, 3), torch.ones(5, 3, dtype=torch.bool))
    assert torch.equal(oracle.visible(5, 3, *sides(False, (-1, 2), 3), 5, 3), _rows("x..", "xx.", "xxx", "xxx", "xxx"))
    # padding: 2 real queries of 4 rows, 3 real keys of 5 columns, causal
    assert torch.equal(oracle.visible(2, 3, None, 0, 4, 5), _rows("xx...", "xxx..", ".....", "....."))


def _sdpa_mask(seqlen_q, seqlen_k, left, right):
    """The window as flash_attn_func's docstring writes it: key j in [i + sk - sq - left, i + sk - sq + right]
    (-1: unbounded), by comparisons over the whole matrix."""
    i = torch.arange(seqlen_q).view(-1, 1)
    j = torch.arange(seqlen_k).view(1, -1)
    diagonal = i + seqlen_k - seqlen_q
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        mask &= j >= diagonal - left
    if right >= 0:
        mask &= j <= diagonal + right
    return mask


def _sdpa(q, k, v, mask, scale=None):
    """PyTorch's attention on (batch, seqlen, nheads, headdim) tensors with GQA; rows that see no key are 0."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, window (left, right), softmax_scale)
SDPA_CASES = [
    (2, 7, 7, 2, 2, 16, (-1, -1), None),
    (1, 5, 13, 4, 2, 8, (3, 2), None),
    (2, 13, 5, 3, 1, 8, (1, 1), 0.7),
    (1, 9, 9, 2, 1, 16, (0, 0), None),
    (1, 11, 4, 2, 2, 8, (-1, 1), None),  # rows that see no key
    (1, 6, 17, 2, 2, 8, (4, -1), -0.5),
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=str)
def test_oracle_matches_sdpa_with_explicit_masks(case):
    """Output, gradients and LSE of the oracle against SDPA with the window as a boolean mask built by
    comparisons, GQA through SDPA's enable_gqa and the LSE through logsumexp."""
    b, sq, sk, h, hk, d, window, scale = case
    q = torch.randn(b, sq, h, d, dtype=F64, requires_grad=True)
    k, v = (torch.randn(b, sk, hk, d, dtype=F64, requires_grad=True) for _ in range(2))
    mask = _sdpa_mask(sq, sk, *window)
    res = oracle.attention(q, k, v, window_size=window, softmax_scale=scale)
    want = _sdpa(q, k, v, mask, scale)
    torch.testing.assert_close(res.out, want, atol=1e-12, rtol=1e-10)
    dout = torch.randn_like(want)
    got_g = torch.autograd.grad(res.out, (q, k, v), dout)
    want_g = torch.autograd.grad(want, (q, k, v), dout)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(h // hk, 2)) * (d**-0.5 if scale is None else scale)
    lse = scores.masked_fill(~mask, -math.inf).logsumexp(-1)
    torch.testing.assert_close(res.lse, lse.masked_fill(~mask.any(-1), math.inf), atol=1e-12, rtol=1e-10)
    assert torch.equal(res.probs.sum(-1) > 0, mask.any(-1).expand(b, h, sq))


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("shape", [(7, 7), (4, 11), (11, 4)], ids=str)
def test_oracle_causal_matches_sdpa_lower_right(shape):
    """Causal against PyTorch's own bottom-right causal bias (torch.nn.attention.bias.causal_lower_right)."""
    sq, sk = shape
    q = torch.randn(2, sq, 4, 16, dtype=F64)
    k, v = (torch.randn(2, sk, 2, 16, dtype=F64) for _ in range(2))
    want = _sdpa(q, k, v, causal_lower_right(sq, sk)).nan_to_num(0)  # (rows that see no key: NaN there)
    torch.testing.assert_close(oracle.attention(q, k, v, causal=True).out, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("alibi", ["head", "batch"])
def test_oracle_softcap_and_alibi_match_sdpa_with_a_float_mask(softcap, alibi):
    """Softcap (tanh before ALiBi) and ALiBi (``-slope·|i + sk - sq - j|``) through SDPA's additive mask:
    the bias that turns q·kᵀ·scale into the capped, biased scores, -inf outside the window."""
    b, sq, sk, h, hk, d = 2, 6, 9, 4, 2, 8
    q = torch.randn(b, sq, h, d, dtype=F64)
    k, v = (torch.randn(b, sk, hk, d, dtype=F64) for _ in range(2))
    slopes = torch.rand(h if alibi == "head" else (b, h), dtype=torch.float32)
    raw = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(h // hk, 2)) / math.sqrt(d)
    capped = softcap * torch.tanh(raw / softcap) if softcap else raw
    distance = torch.tensor([[abs(i + sk - sq - j) for j in range(sk)] for i in range(sq)], dtype=F64)
    bias = capped - raw - slopes.double().reshape(-1, h, 1, 1) * distance
    bias = bias.masked_fill(~_sdpa_mask(sq, sk, 2, 1), -math.inf)
    want = _sdpa(q, k, v, bias)
    got = oracle.attention(q, k, v, softcap=softcap, alibi_slopes=slopes, window_size=(2, 1)).out
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_oracle_dropout_of_whole_key_columns():
    """Dropping key columns J with probability p: output = (probability mass kept) · (attention over the
    other keys) / (1 - p), the second factor from SDPA with J masked."""
    b, sq, sk, h, d, p = 1, 5, 8, 2, 8, 0.25
    q = torch.randn(b, sq, h, d, dtype=F64)
    k, v = (torch.randn(b, sk, h, d, dtype=F64) for _ in range(2))
    kept = torch.tensor([True, False, True, True, False, True, True, True])
    keep = kept.expand(b, h, sq, sk)
    got = oracle.attention(q, k, v, dropout_p=p, dropout_mask=keep).out
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    mass = (scores[..., kept].logsumexp(-1) - scores.logsumexp(-1)).exp()  # (b, h, sq)
    want = _sdpa(q, k, v, kept.expand(sq, sk)) * mass.transpose(1, 2).unsqueeze(-1) / (1 - p)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="dropout_mask"):
        oracle.attention(q, k, v, dropout_p=p)


def test_oracle_padding_and_varlen_are_per_sequence():
    """Padding masks (real tokens first) and packed batches mean each sequence alone, aligned to its own
    real lengths; a varlen window side is unbounded from max_seqlen_k on."""
    lens_q, lens_k = [3, 6, 0], [5, 2, 4]
    q = torch.randn(3, 6, 2, 8, dtype=F64)
    k, v = (torch.randn(3, 5, 1, 8, dtype=F64) for _ in range(2))
    slopes = torch.rand(3, 2)
    pad_q = torch.arange(6)[None] < torch.tensor(lens_q)[:, None]
    pad_k = torch.arange(5)[None] < torch.tensor(lens_k)[:, None]
    kw = dict(causal=True, window_size=(1, -1), alibi_slopes=slopes)
    padded = oracle.attention(q, k, v, query_padding_mask=pad_q, key_padding_mask=pad_k, **kw)
    cu_q = [0, *torch.tensor(lens_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lens_k).cumsum(0).tolist()]
    packed = oracle.attention_varlen(q[pad_q], k[pad_k], v[pad_k], cu_q, cu_k, 5, **kw)
    torch.testing.assert_close(padded.out[pad_q], packed.out, atol=1e-12, rtol=1e-10)
    assert torch.equal(padded.out[~pad_q], torch.zeros_like(padded.out[~pad_q]))
    for b in range(3):
        alone = oracle.attention(
            q[b : b + 1, : lens_q[b]], k[b : b + 1, : lens_k[b]], v[b : b + 1, : lens_k[b]],
            causal=True, window_size=(1, -1), alibi_slopes=slopes[b], window_seqlen_k=5,
        )  # fmt: skip
        torch.testing.assert_close(padded.out[b : b + 1, : lens_q[b]], alone.out, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="real tokens first"):
        oracle.attention(q, k, v, key_padding_mask=pad_k.flip(-1))


def test_oracle_plain_precision_is_the_inputs():
    """``precision=None`` computes in the inputs' dtype (the tolerance rule's PyTorch error); by default
    in float64."""
    q = torch.randn(1, 9, 2, 16, dtype=torch.float16)
    plain, exact = oracle.attention(q, q, q, precision=None), oracle.attention(q, q, q)
    assert plain.out.dtype == torch.float16 and exact.out.dtype == F64
    err = (plain.out.double() - exact.out).abs().max().item()
    assert 0 < err < 1e-2


# ------------------------------------------------------------------------------------------------
# Rotary, by hand
# ------------------------------------------------------------------------------------------------


def test_rotary_by_hand():
    """Channel pairs turned by the table's angle: (0, 1), (2, 3) interleaved; (0, 2), (1, 3) NeoX; the
    channels past rotary_dim untouched."""
    c, s = math.cos(0.5), math.sin(0.5)
    cos = torch.tensor([[1.0, 1.0], [c, 0.0]], dtype=F64)  # position 1: frequency 0 by 0.5 rad, frequency 1 by pi/2
    sin = torch.tensor([[0.0, 0.0], [s, 1.0]], dtype=F64)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64).view(1, 1, 1, 5)
    at1 = torch.ones(1, 1, dtype=torch.long)
    inter = oracle.rotary(x, cos, sin, at1, interleaved=True).flatten().tolist()
    neox = oracle.rotary(x, cos, sin, at1, interleaved=False).flatten().tolist()
    # interleaved: (1, 2) by 0.5 rad; (3, 4) by pi/2 -> (-4, 3)
    assert inter == pytest.approx([c - 2 * s, s + 2 * c, -4.0, 3.0, 5.0], abs=1e-6)
    # NeoX: (x0, x2) = (1, 3) by 0.5 rad; (x1, x3) = (2, 4) by pi/2 -> (-4, 2)
    assert neox == pytest.approx([c - 3 * s, -4.0, s + 3 * c, 2.0, 5.0], abs=1e-6)
    at0 = torch.zeros(1, 1, dtype=torch.long)
    assert torch.equal(oracle.rotary(x, cos, sin, at0, interleaved=True), x)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_rotary_scores_depend_on_relative_positions(interleaved):
    """With tables from angles ``position · frequency``, ⟨R(m) q, R(n) k⟩ depends only on m - n, and the
    rotation keeps norms."""
    d = 16
    freq = 1.0 / 100 ** (torch.arange(0, d, 2, dtype=F64) / d)
    angle = torch.arange(40, dtype=F64)[:, None] * freq
    cos, sin = angle.cos(), angle.sin()
    q, k = torch.randn(1, 1, 1, d, dtype=F64), torch.randn(1, 1, 1, d, dtype=F64)

    def at(x, position):
        return oracle.rotary(x, cos, sin, torch.tensor([[position]]), interleaved).flatten()

    for m, n in ((5, 2), (13, 10), (33, 30)):
        assert (at(q, m) @ at(k, n)).item() == pytest.approx((at(q, 3) @ at(k, 0)).item(), rel=1e-9)
    assert at(q, 17).norm().item() == pytest.approx(q.norm().item(), rel=1e-12)
    assert (at(q, 5) @ at(k, 2)).item() != pytest.approx((at(q, 2) @ at(k, 5)).item(), rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_rotary_rounds_once_from_fp32(dtype):
    """16-bit inputs: the result is x·cos ∓ y·sin computed in fp32 and rounded to x's dtype, within half a
    unit in the last place of the exact rotation (fp64)."""
    x = torch.randn(2, 7, 3, 24, dtype=torch.float32).to(dtype)
    angle = torch.rand(9, 8) * 6.283
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    pos = torch.randint(0, 9, (2, 7))
    got = oracle.rotary(x, cos, sin, pos, interleaved=False)
    c, s = cos[pos].double().unsqueeze(2), sin[pos].double().unsqueeze(2)
    a, b = x[..., :8].double(), x[..., 8:16].double()
    exact = torch.cat((a * c - b * s, a * s + b * c, x[..., 16:].double()), -1)
    assert torch.equal(got, torch.cat((exact[..., :16].float().to(dtype), x[..., 16:]), -1))
    ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((got.double() - exact).abs() <= ulp).all()


# ------------------------------------------------------------------------------------------------
# The package's shipped reference and rotary against the oracle
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "feats",
    [
        {"causal": True},
        {"window_size": (3, 5), "softcap": 2.0},
        {"window_size": (9, 0), "alibi": "batch"},
        {"causal": True, "alibi": "head", "padding": True},
        {"window_size": (2, -1), "dropout_p": 0.3},
    ],
    ids=str,
)
def test_package_reference_matches_oracle(feats):
    """tileattn.reference.attention_ref (users check against it) and its local_mask give the oracle's
    results in float64, GQA, queries longer and shorter than the keys."""
    from tileattn.reference import attention_ref, causal_window, local_mask

    for sq, sk in ((7, 12), (12, 7)):
        b, h, hk, d = 2, 4, 2, 8
        q = torch.randn(b, sq, h, d, dtype=F64)
        k, v = (torch.randn(b, sk, hk, d, dtype=F64) for _ in range(2))
        kw = {key: val for key, val in feats.items() if key not in ("alibi", "padding")}
        if "alibi" in feats:
            kw["alibi_slopes"] = torch.rand(h if feats["alibi"] == "head" else (b, h))
        if "padding" in feats:
            kw["query_padding_mask"] = torch.arange(sq)[None] < torch.tensor([sq, sq - 3])[:, None]
            kw["key_padding_mask"] = torch.arange(sk)[None] < torch.tensor([sk - 2, sk])[:, None]
        if "dropout_p" in feats:
            kw["dropout_mask"] = torch.rand(b, h, sq, sk) > feats["dropout_p"]
        out, probs = attention_ref(q, k, v, upcast=F64, **kw)
        want = oracle.attention(q, k, v, **kw)
        torch.testing.assert_close(out, want.out, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(probs, want.probs, atol=1e-12, rtol=1e-10)
        window = causal_window(kw.get("causal", False), kw.get("window_size", (-1, -1)), sk)
        sides = oracle.window_sides(kw.get("causal", False), kw.get("window_size", (-1, -1)), sk)
        mask = local_mask(torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1), sq, sk, window)
        assert torch.equal(mask, oracle.visible(sq, sk, *sides, sq, sk))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_package_rotary_matches_oracle(dtype, interleaved):
    """tileattn.rotary.apply_rotary_emb (offsets per sequence, partial rotary_dim) gives the oracle's
    rotation: bit for bit in 16-bit dtypes, to fp32 rounding in fp32."""
    from tileattn.rotary import apply_rotary_emb

    x = torch.randn(3, 5, 2, 20).to(dtype)
    angle = torch.rand(12, 6) * 6.283
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    offsets = torch.tensor([0, 4, 7])
    got = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
    want = oracle.rotary(x, cos, sin, offsets[:, None] + torch.arange(5), interleaved)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(got, want)
