"""tileattn.modules (flash_attn.modules.mha) against a reference layer built in this file from the
module's own weights: the projections with F.linear, the depthwise convolution as a sum of shifted
copies, rotary from its definition (tests/rotary_ref.py, angles computed here), ALiBi slopes from the
paper's rule, and the attention of the tests' oracle (tests/oracle.py). Forward and gradients (of the
input and of every weight) follow the tolerance rule; generation step by step with InferenceParams is
checked against the reference on the whole sequence. Also flash_attn's signatures, weight names, the
inner attention modules and bad input."""

import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import oracle
import rotary_ref
from helpers import check_refused, on
from tileattn.modules import (
    MHA,
    CrossAttention,
    FlashCrossAttention,
    FlashSelfAttention,
    InferenceParams,
    SelfAttention,
    get_alibi_slopes,
)
from tileattn.testing import check_close


def _dtype(backend):
    return {"torch": torch.float32, "interpret": torch.float16, "cuda": torch.bfloat16}[backend]


def alibi_slopes(nheads: int) -> list[float]:
    """ALiBi (Press et al.): a geometric sequence starting at 2^(-8/n) with that ratio for n a power of two;
    otherwise the sequence of the largest power of two p below n, then the odd-numbered (1st, 3rd, ...)
    slopes of the sequence for 2p, up to n slopes in all."""
    p = 1 << (nheads.bit_length() - 1)
    first = [2.0 ** (-8.0 * (i + 1) / p) for i in range(p)]
    if p == nheads:
        return first
    double = [2.0 ** (-8.0 * (i + 1) / (2 * p)) for i in range(2 * p)]
    return first + double[0::2][: nheads - p]


def _rope_tables(mha, seqlen, dtype, exact):
    """(cos, sin, cos_k, sin_k) ``(seqlen, rotary_dim / 2)`` of the layer's rotary: angles ``t · base^(-2f /
    dim)`` in float64 (exact) or, as plain PyTorch computes them, in fp32 rounded to ``dtype``; xPos
    scales ``((2f + 0.4 dim) / (1.4 dim)) ^ ((t - seqlen // 2) / scale_base)`` on q, their inverse on k."""
    rot = mha.rotary_emb
    dim, base = rot.dim, rot.base
    if exact:
        t = torch.arange(seqlen, dtype=torch.float64)[:, None]
        angle = t * base ** (-2 * torch.arange(dim // 2, dtype=torch.float64) / dim)
    else:
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        angle = torch.arange(seqlen, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angle.cos(), angle.sin()
    cos_k, sin_k = cos, sin
    if rot.scale_base is not None:
        f = torch.arange(dim // 2, dtype=angle.dtype)
        t = torch.arange(seqlen, dtype=angle.dtype)[:, None]
        scale = ((2 * f + 0.4 * dim) / (1.4 * dim)) ** ((t - seqlen // 2) / rot.scale_base)
        cos, sin, cos_k, sin_k = cos * scale, sin * scale, cos / scale, sin / scale
    out_dtype = torch.float64 if exact else dtype
    return tuple(t.to(out_dtype) for t in (cos, sin, cos_k, sin_k))


def _dwconv(params, name, t):
    """The layer's causal depthwise convolution (kernel 3) of ``t (batch, seqlen, channels)``:
    ``out[s] = bias + w0·t[s-2] + w1·t[s-1] + w2·t[s]``."""
    w, b = params[f"{name}.weight"][:, 0], params[f"{name}.bias"]  # (channels, 3), (channels,)
    padded = F.pad(t, (0, 0, 2, 0))
    return b + w[:, 0] * padded[:, :-2] + w[:, 1] * padded[:, 1:-1] + w[:, 2] * padded[:, 2:]


def reference_mha(
    mha, params, x, x_kv=None, mask=None, mixer_subset=None, exact=True, rope_seqlen=None, visible_mask=None
):
    """The layer on ``x (batch, seqlen, embed_dim)``, from ``params`` (the module's weights, in the compute
    dtype): float64 if ``exact``, else x's dtype (plain PyTorch's error). ``mask``: bool (batch, seqlen) key
    padding (real tokens first): padded rows output 0; rotary positions are the indices in x;
    ``visible_mask``: the oracle's, False where a key is hidden from a row on top of the causal mask.
    Returns ``(batch, seqlen_q, embed_dim)``."""
    dtype = torch.float64 if exact else x.dtype

    def linear(name, t):
        bias = params.get(f"{name}.bias")
        return F.linear(t.to(dtype), params[f"{name}.weight"], bias)

    h, hk, d = mha.num_heads, mha.num_heads_kv, mha.head_dim
    if mha.cross_attn:
        q = linear("Wq", x if mixer_subset is None else x[:, mixer_subset])
        kv = linear("Wkv", x_kv if x_kv is not None else x)
    else:
        qkv = linear("Wqkv", x)
        if mha.dwconv and h == hk:
            qkv = _dwconv(params, "dwconv_qkv", qkv)
        q, kv = qkv[..., : h * d], qkv[..., h * d :]
    if mha.dwconv and (h != hk or mha.cross_attn):
        q, kv = _dwconv(params, "dwconv_q", q), _dwconv(params, "dwconv_kv", kv)
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], kv.shape[1]
    q = q.view(batch, seqlen_q, h, d)
    k, v = kv.view(batch, seqlen_k, 2, hk, d).unbind(2)
    if mha.rotary_emb_dim:
        cos, sin, cos_k, sin_k = _rope_tables(mha, rope_seqlen or seqlen_q, x.dtype, exact)
        positions = rotary_ref.dense_positions(batch, seqlen_q, 0)
        interleaved = mha.rotary_emb.interleaved
        q = rotary_ref.rotary(q, cos.to(q.device), sin.to(q.device), positions, interleaved, exact=exact)
        k = rotary_ref.rotary(k, cos_k.to(q.device), sin_k.to(q.device), positions, interleaved, exact=exact)
    inner = mha.inner_attn
    slopes = None
    if getattr(inner, "alibi_slopes", None) is not None:  # (use_alibi: the slopes from the rule above)
        slopes = torch.tensor(alibi_slopes(h), dtype=torch.float64)
    out = oracle.attention(
        q,
        k,
        v,
        softmax_scale=inner.softmax_scale,
        causal=mha.causal,
        window_size=getattr(inner, "window_size", (-1, -1)),
        alibi_slopes=slopes.to(q.device) if slopes is not None else None,
        query_padding_mask=mask if not mha.cross_attn else None,
        key_padding_mask=mask,
        visible_mask=visible_mask,
        precision=dtype,
    ).out
    out = linear("out_proj", out.flatten(-2))
    return out if mask is None or mha.cross_attn else out * mask[..., None]


def _params(mha, exact, requires_grad=True):
    dtype = torch.float64 if exact else next(mha.parameters()).dtype
    return {n: p.detach().to(dtype).requires_grad_(requires_grad) for n, p in mha.named_parameters()}


def check_layer(name, mha, inputs, out, grads, dout, **ref_kwargs):
    """``out`` and the gradients (``grads``: name -> gradient, for the inputs ``inputs`` (name -> tensor)
    and the layer's weights) against the reference with the tolerance rule."""
    results = {}
    for exact in (True, False):
        params = _params(mha, exact)
        leaves = {n: t.detach().to(torch.float64 if exact else t.dtype).requires_grad_() for n, t in inputs.items()}
        ref = reference_mha(mha, params, **leaves, exact=exact, **ref_kwargs)
        wrt = {**leaves, **params}
        g = torch.autograd.grad(ref, list(wrt.values()), dout.to(ref.dtype), allow_unused=True, materialize_grads=True)
        results[exact] = (ref, dict(zip(wrt, g)))
    (ref, g_ref), (ref_lowp, g_lowp) = results[True], results[False]
    check_close(f"{name} out", out, ref, ref_lowp)
    for gname, g in grads.items():
        check_close(f"{name} d{gname}", g, g_ref[gname], g_lowp[gname])


# Layers (MHA keyword arguments), with the key padding mask or not: flash_attn's default (the plain
# PyTorch attention), and tileattn's kernels with each feature.
LAYERS = {
    "eager": dict(causal=True, rotary_emb_dim=8),
    "eager-gqa-dwconv": dict(num_heads_kv=2, dwconv=True),
    "flash": dict(use_flash_attn=True),
    "flash-causal-gqa-rotary": dict(use_flash_attn=True, causal=True, rotary_emb_dim=8, num_heads_kv=2),
    "flash-window-mqa-gptj": dict(
        use_flash_attn=True, window_size=(3, 1), num_heads_kv=1, rotary_emb_dim=16, rotary_emb_interleaved=True
    ),
    "flash-alibi-6-heads": dict(use_flash_attn=True, use_alibi=True, causal=True, num_heads=6),
    "flash-xpos-checkpointing": dict(
        use_flash_attn=True, causal=True, rotary_emb_dim=16, rotary_emb_scale_base=64, checkpointing=True
    ),
    "flash-dwconv-no-bias": dict(use_flash_attn=True, dwconv=True, qkv_proj_bias=False, out_proj_bias=False),
    "flash-scale": dict(use_flash_attn=True, softmax_scale=0.3, causal=True),
}


def _mha(backend, opts, **extra):
    _, device = on(backend)
    opts = {**opts, **extra}
    heads = opts.pop("num_heads", 4)
    embed = 16 * heads
    torch.manual_seed(0)
    # (flash_attn's plain attention in float32: it materialises 16-bit scores, whose error is not the oracle's)
    dtype = _dtype(backend) if opts.get("use_flash_attn") else torch.float32
    mha = MHA(embed, heads, **opts, device=device, dtype=dtype)
    for conv in (m for m in mha.modules() if isinstance(m, torch.nn.Conv1d)):
        torch.nn.init.normal_(conv.weight, std=0.5)  # (weights of the size of the projections' outputs)
    return mha


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padding-mask"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_mha_matches_reference(backend, layer, padded):
    opts = LAYERS[layer]
    if backend == "interpret" and (not opts.get("use_flash_attn") or opts.get("dwconv")):
        pytest.skip("the plain PyTorch attention runs no kernel; float16 convolutions on CPU take seconds")
    ctx, device = on(backend)
    mha = _mha(backend, opts)
    embed = mha.embed_dim
    x = torch.randn(3, 11, embed, device=device, dtype=mha.out_proj.weight.dtype, requires_grad=True)
    mask = None
    if padded:
        mask = torch.arange(11, device=device)[None] < torch.tensor([11, 4, 7], device=device)[:, None]
    dout = torch.randn(3, 11, embed, device=device, dtype=x.dtype)
    if mask is not None:  # (padded rows are not compared: the plain attention leaves them as they come)
        dout = dout * mask[..., None]
    with ctx:
        out = mha(x, key_padding_mask=mask)
        grads = torch.autograd.grad(out, [x, *mha.parameters()], dout)
    if mask is not None and not mha.use_flash_attn:  # (flash_attn's plain attention leaves padded rows as they come)
        out = out * mask[..., None]
    elif mask is not None:
        assert out[~mask].abs().max() == 0, "padded positions must output 0"
    grads = dict(zip(["x", *(n for n, _ in mha.named_parameters())], grads))
    check_layer(layer, mha, {"x": x}, out, grads, dout, mask=mask)


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["eager", "flash"])
def test_cross_attention(backend, use_flash_attn):
    """cross_attn: queries from x (a mixer_subset of its tokens), keys and values from x_kv (GQA), the
    weights Wq and Wkv; return_residual returns x too."""
    if backend == "interpret" and not use_flash_attn:
        pytest.skip("the plain PyTorch attention runs no kernel")
    ctx, device = on(backend)
    mha = _mha(backend, dict(cross_attn=True, num_heads_kv=2, use_flash_attn=use_flash_attn, return_residual=True))
    x = torch.randn(2, 9, 64, device=device, dtype=mha.out_proj.weight.dtype, requires_grad=True)
    x_kv = torch.randn(2, 13, 64, device=device, dtype=x.dtype, requires_grad=True)
    subset = slice(2, 7)
    dout = torch.randn(2, 5, 64, device=device, dtype=x.dtype)
    with ctx:
        out, residual = mha(x, x_kv=x_kv, mixer_subset=subset)
        grads = torch.autograd.grad(out, [x, x_kv, *mha.parameters()], dout)
    assert residual is x
    grads = dict(zip(["x", "x_kv", *(n for n, _ in mha.named_parameters())], grads))
    check_layer("cross", mha, {"x": x, "x_kv": x_kv}, out, grads, dout, mixer_subset=subset)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_packed_input_with_rotary(backend, gqa):
    """A packed x (total, embed_dim) with cu_seqlens (use_flash_attn): each sequence as the layer on it
    alone, rotary positions from 0 in each (tileattn runs rotary on packed inputs; flash_attn refuses)."""
    ctx, device = on(backend)
    mha = _mha(backend, dict(use_flash_attn=True, causal=True, rotary_emb_dim=16, num_heads_kv=2 if gqa else 4))
    cu = [0, 6, 6, 17, 20]
    x = torch.randn(20, 64, device=device, dtype=mha.out_proj.weight.dtype, requires_grad=True)
    dout = torch.randn(20, 64, device=device, dtype=x.dtype)
    with ctx:
        out = mha(x, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device), max_seqlen=11)
        (dx,) = torch.autograd.grad(out, x, dout)
    for exact in (True, False):
        params = _params(mha, exact, requires_grad=False)
        xs = x.detach().to(torch.float64 if exact else x.dtype).requires_grad_()
        ref = torch.cat([reference_mha(mha, params, xs[None, a:b], exact=exact)[0] for a, b in zip(cu, cu[1:])])
        (g,) = torch.autograd.grad(ref, xs, dout.to(ref.dtype))
        if exact:
            ref64, g64 = ref, g
    check_close("packed out", out, ref64, ref)
    check_close("packed dx", dx, g64, g)


GENERATION = {
    "eager": dict(rotary_emb_dim=8),
    "eager-gqa": dict(num_heads_kv=2, rotary_emb_dim=16),
    "flash-fused-rotary": dict(use_flash_attn=True, rotary_emb_dim=16),
    "flash-rotary-8-gqa": dict(use_flash_attn=True, rotary_emb_dim=8, num_heads_kv=2),
    "flash-xpos": dict(use_flash_attn=True, rotary_emb_dim=16, rotary_emb_scale_base=64),
    "flash-alibi-window": dict(use_flash_attn=True, use_alibi=True, window_size=(4, 0), num_heads_kv=1),
}


@pytest.mark.parametrize("layer", list(GENERATION))
def test_generation_matches_whole_sequence(backend, layer):
    """A prompt, then one token at a time through InferenceParams (the cache of layer_idx, seqlen_offset),
    against the reference on the whole sequence; the cache holds the keys and values of every token."""
    opts = GENERATION[layer]
    if backend == "interpret" and not opts.get("use_flash_attn"):
        pytest.skip("the plain PyTorch attention runs no kernel")
    ctx, device = on(backend)
    mha = _mha(backend, dict(opts, causal=True, layer_idx=7))
    prompt, total = 5, 9
    x = torch.randn(2, total, 64, device=device, dtype=mha.out_proj.weight.dtype)
    params = InferenceParams(max_seqlen=12, max_batch_size=3)
    with ctx, torch.no_grad():
        steps = [mha(x[:, :prompt], inference_params=params)]
        for t in range(prompt, total):
            params.seqlen_offset = t
            steps.append(mha(x[:, t : t + 1], inference_params=params))
    out = torch.cat(steps, dim=1)
    cache = params.key_value_memory_dict[7]
    assert cache.shape == (3, 12, 2, mha.num_heads_kv, 16) and cache.dtype == x.dtype
    refs = [
        reference_mha(mha, _params(mha, exact, False), x, exact=exact, rope_seqlen=total) for exact in (True, False)
    ]
    check_close(f"{layer} generated", out, *refs)


def test_generation_lengths_per_sample(backend):
    """lengths_per_sample (use_flash_attn): sequences of different lengths in one batch, each new token
    written after its own sequence's tokens and rotated at its own position."""
    ctx, device = on(backend)
    mha = _mha(backend, dict(use_flash_attn=True, causal=True, rotary_emb_dim=16, num_heads_kv=2, layer_idx=0))
    x = torch.randn(2, 9, 64, device=device, dtype=mha.out_proj.weight.dtype)
    lengths = torch.zeros(2, dtype=torch.int32, device=device)
    params = InferenceParams(max_seqlen=10, max_batch_size=2, lengths_per_sample=lengths)
    with ctx, torch.no_grad():
        mha(x[:, :5], inference_params=params)  # (sequence 1's prompt is 3 tokens; tokens 3, 4 are padding)
        lengths.copy_(torch.tensor([5, 3]))
        steps = []
        for t in range(3):
            params.seqlen_offset = 5 + t
            steps.append(mha(x[:, 5 + t : 6 + t], inference_params=params))
            params.lengths_per_sample += 1
    out = torch.cat(steps, dim=1)  # (2, 3, 64)
    for b, n in enumerate([5, 3]):
        seq = torch.cat([x[b : b + 1, :n], x[b : b + 1, 5:8]], dim=1)
        refs = [reference_mha(mha, _params(mha, exact, False), seq, exact=exact)[:, n:] for exact in (True, False)]
        check_close(f"sequence {b}", out[b : b + 1], *refs)


def test_flash_inner_modules(backend):
    """FlashSelfAttention / FlashCrossAttention with flash_attn's arguments (alibi_slopes a constructor
    buffer, causal overridden per call), dense and packed, against the oracle."""
    ctx, device = on(backend)
    dtype = _dtype(backend)
    qkv = torch.randn(2, 9, 3, 4, 16, device=device, dtype=dtype)
    q = torch.randn(2, 5, 4, 16, device=device, dtype=dtype)
    kv = torch.randn(2, 9, 2, 2, 16, device=device, dtype=dtype)
    slopes = torch.tensor(alibi_slopes(4), device=device)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32, device=device)
    cu_q = torch.tensor([0, 5, 10], dtype=torch.int32, device=device)
    self_attn = FlashSelfAttention(causal=True, alibi_slopes=slopes.half())  # (.to(dtype) of a model)
    cross_attn = FlashCrossAttention(False, None, 0.0, slopes, (2, 2))
    assert "alibi_slopes" not in self_attn.state_dict()
    with ctx:
        outs = {
            "self": self_attn(qkv),
            "self non-causal": self_attn(qkv, causal=False),
            "self packed": self_attn(qkv.flatten(0, 1), cu_seqlens=cu, max_seqlen=9),
            "cross": cross_attn(q, kv),
            "cross packed": cross_attn(q.flatten(0, 1), kv.flatten(0, 1), None, cu_q, 5, cu, 9),
        }
    assert self_attn.alibi_slopes.dtype == torch.float32
    s16 = slopes.half().float()
    cases = {
        "self": (qkv.unbind(2), dict(causal=True, alibi_slopes=s16)),
        "self non-causal": (qkv.unbind(2), dict(alibi_slopes=s16)),
        "self packed": (qkv.unbind(2), dict(causal=True, alibi_slopes=s16)),
        "cross": ((q, *kv.unbind(2)), dict(alibi_slopes=slopes, window_size=(2, 2))),
        "cross packed": ((q, *kv.unbind(2)), dict(alibi_slopes=slopes, window_size=(2, 2))),
    }
    for name, (args, kwargs) in cases.items():
        ref = oracle.attention(*args, **kwargs).out
        ref_lowp = oracle.attention(*args, **kwargs, precision=None).out
        out = outs[name].view(ref.shape)
        check_close(name, out, ref, ref_lowp)


def test_plain_pytorch_inner_modules():
    """SelfAttention / CrossAttention: flash_attn's plain PyTorch attention (padding masked with -10000,
    causal aligned bottom-right on the kept keys, GQA by repetition), against the oracle."""
    qkv = torch.randn(3, 8, 3, 4, 16, dtype=torch.float64)
    mask = torch.arange(8)[None] < torch.tensor([8, 5, 2])[:, None]
    out = SelfAttention(causal=True, softmax_scale=0.2)(qkv, key_padding_mask=mask)
    ref = oracle.attention(
        *qkv.unbind(2), causal=True, softmax_scale=0.2, key_padding_mask=mask, query_padding_mask=mask
    )
    torch.testing.assert_close(out * mask[..., None, None], ref.out)
    q = torch.randn(3, 4, 4, 16, dtype=torch.float64)
    kv = torch.randn(3, 8, 2, 2, 16, dtype=torch.float64)
    out = CrossAttention(causal=True)(q, kv, key_padding_mask=mask)
    ref = oracle.attention(q, *kv.unbind(2), causal=True, key_padding_mask=mask)
    seen = (torch.tensor([8, 5, 2]) >= torch.arange(4, 0, -1)[:, None]).T  # rows that see a key
    torch.testing.assert_close(out[seen], ref.out[seen])
    assert torch.equal(CrossAttention()(q, kv, causal=False), CrossAttention(causal=False)(q, kv))


def test_alibi_slopes_and_layer_buffers():
    for n in [*range(1, 13), 16, 24, 40]:
        assert get_alibi_slopes(n) == pytest.approx(alibi_slopes(n), rel=1e-12), n
    mha = MHA(96, 6, use_flash_attn=True, use_alibi=True)
    torch.testing.assert_close(mha.inner_attn.alibi_slopes, torch.tensor(alibi_slopes(6)))
    assert mha.inner_cross_attn.alibi_slopes is not None and "inner_attn.alibi_slopes" not in mha.state_dict()


STATE_DICTS = {
    (): ["Wqkv.bias", "Wqkv.weight", "out_proj.bias", "out_proj.weight"],
    (("cross_attn", True), ("qkv_proj_bias", False)): ["Wkv.weight", "Wq.weight", "out_proj.bias", "out_proj.weight"],
    (("dwconv", True),): ["Wqkv.bias", "Wqkv.weight", "dwconv_qkv.bias", "dwconv_qkv.weight", "out_proj.bias", "out_proj.weight"],
    (("dwconv", True), ("num_heads_kv", 2), ("out_proj_bias", False), ("rotary_emb_dim", 8)): [
        "Wqkv.bias", "Wqkv.weight", "dwconv_kv.bias", "dwconv_kv.weight", "dwconv_q.bias", "dwconv_q.weight",
        "out_proj.weight",
    ],
}  # fmt: skip


@pytest.mark.parametrize("opts", list(STATE_DICTS), ids=["self", "cross", "dwconv", "dwconv-gqa"])
def test_weight_names_as_flash_attn(opts):
    """flash_attn's parameter names and shapes, so that its state dicts load; the rotary buffers are not
    saved (as flash_attn's)."""
    mha = MHA(64, 4, **dict(opts))
    state = mha.state_dict()
    assert sorted(state) == STATE_DICTS[opts]
    heads_kv = dict(opts).get("num_heads_kv", 4)
    if "Wqkv.weight" in state:
        assert state["Wqkv.weight"].shape == (16 * (4 + 2 * heads_kv), 64)
    clone = MHA(64, 4, **dict(opts))
    clone.load_state_dict(state)  # strict
    assert isinstance(mha.inner_attn, SelfAttention) and isinstance(mha.inner_cross_attn, CrossAttention)
    flash = MHA(64, 4, **dict(opts), use_flash_attn=True)
    assert isinstance(flash.inner_attn, FlashSelfAttention) and isinstance(flash.inner_cross_attn, FlashCrossAttention)


def test_fused_bias_fc_and_return_residual():
    """fused_bias_fc is accepted and ignored (as flash_attn 2.8.3 ignores it); return_residual returns
    (out, x); allocate_inference_cache is (batch, max_seqlen, 2, num_heads_kv, head_dim)."""
    torch.manual_seed(0)
    a = MHA(64, 4, causal=True, fused_bias_fc=True, return_residual=True)
    b = MHA(64, 4, causal=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 64)
    out, residual = a(x)
    assert residual is x and torch.equal(out, b(x))
    cache = MHA(64, 4, num_heads_kv=2, dtype=torch.float16).allocate_inference_cache(3, 20)
    assert cache.shape == (3, 20, 2, 2, 16) and cache.dtype == torch.float16


_E = inspect.Parameter.empty
FLASH_ATTN_SIGNATURES = {
    "MHA": [
        ("embed_dim", _E), ("num_heads", _E), ("num_heads_kv", None), ("cross_attn", False), ("qkv_proj_bias", True),
        ("out_proj_bias", True), ("dropout", 0.0), ("softmax_scale", None), ("causal", False), ("layer_idx", None),
        ("dwconv", False), ("rotary_emb_dim", 0), ("rotary_emb_base", 10000.0), ("rotary_emb_scale_base", None),
        ("rotary_emb_interleaved", False), ("use_alibi", False), ("window_size", (-1, -1)), ("fused_bias_fc", False),
        ("use_flash_attn", False), ("return_residual", False), ("checkpointing", False), ("device", None),
        ("dtype", None),
    ],
    "MHA.forward": [
        ("x", _E), ("x_kv", None), ("key_padding_mask", None), ("cu_seqlens", None), ("max_seqlen", None),
        ("mixer_subset", None), ("inference_params", None), ("kwargs", _E),
    ],
    "MHA.allocate_inference_cache": [("batch_size", _E), ("max_seqlen", _E), ("dtype", None)],
    "FlashSelfAttention": [
        ("causal", False), ("softmax_scale", None), ("attention_dropout", 0.0), ("window_size", (-1, -1)),
        ("alibi_slopes", None), ("deterministic", False),
    ],
    "FlashSelfAttention.forward": [("qkv", _E), ("causal", None), ("cu_seqlens", None), ("max_seqlen", None)],
    "FlashCrossAttention": [
        ("causal", False), ("softmax_scale", None), ("attention_dropout", 0.0), ("alibi_slopes", None),
        ("window_size", (-1, -1)), ("deterministic", False),
    ],
    "FlashCrossAttention.forward": [
        ("q", _E), ("kv", _E), ("causal", None), ("cu_seqlens", None), ("max_seqlen", None), ("cu_seqlens_k", None),
        ("max_seqlen_k", None),
    ],
    "SelfAttention": [("causal", False), ("softmax_scale", None), ("attention_dropout", 0.0)],
    "SelfAttention.forward": [("qkv", _E), ("causal", None), ("key_padding_mask", None)],
    "CrossAttention": [("causal", False), ("softmax_scale", None), ("attention_dropout", 0.0)],
    "CrossAttention.forward": [("q", _E), ("kv", _E), ("causal", None), ("key_padding_mask", None)],
}  # fmt: skip


@pytest.mark.parametrize("name", list(FLASH_ATTN_SIGNATURES))
def test_flash_attn_signatures(name):
    import tileattn.modules as modules

    obj = modules
    for part in name.split("."):
        obj = getattr(obj, part)
    params = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    positional = [(p.name, p.default) for p in params if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert positional == FLASH_ATTN_SIGNATURES[name]
    # tileattn's extras are keyword-only
    assert all(p.default is not _E for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY)


def test_inference_params_fields():
    fields = [(f.name, f.default) for f in dataclasses.fields(InferenceParams)]
    assert [name for name, _ in fields] == [
        "max_seqlen",
        "max_batch_size",
        "seqlen_offset",
        "batch_size_offset",
        "key_value_memory_dict",
        "lengths_per_sample",
    ]
    params = InferenceParams(10, 2, lengths_per_sample=torch.tensor([3, 4], dtype=torch.int32))
    params.seqlen_offset = 5
    params.reset(20, 4)
    assert (params.max_seqlen, params.max_batch_size, params.seqlen_offset) == (20, 4, 0)
    assert params.lengths_per_sample.tolist() == [0, 0] and params.key_value_memory_dict == {}


def test_torch_compile_fullgraph():
    """The flash layer with rotary traces without graph breaks (custom ops), forward and backward: the
    compiled layer against the reference layer (the tolerance rule)."""
    torch.manual_seed(0)
    mha = MHA(64, 4, use_flash_attn=True, causal=True, rotary_emb_dim=16, num_heads_kv=2)
    x = torch.randn(2, 9, 64, requires_grad=True)
    dout = torch.randn(2, 9, 64)
    compiled = torch.compile(mha, fullgraph=True, backend="aot_eager")(x)
    grads = torch.autograd.grad(compiled, [x, *mha.parameters()], dout)
    grads = dict(zip(["x", *(n for n, _ in mha.named_parameters())], grads))
    check_layer("compiled", mha, {"x": x}, compiled, grads, dout)


_x = torch.randn(2, 5, 64)
BAD = [
    ("embed-heads", lambda: MHA(60, 8), ["embed_dim", "divisible by num_heads"]),
    ("kv-heads", lambda: MHA(64, 4, num_heads_kv=3), ["num_heads_kv"]),
    ("rotary-odd", lambda: MHA(64, 4, rotary_emb_dim=5), ["rotary_emb_dim", "even"]),
    ("rotary-wide", lambda: MHA(64, 4, rotary_emb_dim=32), ["rotary_emb_dim", "head dim (16)"]),
    ("rotary-cross", lambda: MHA(64, 4, rotary_emb_dim=8, cross_attn=True), ["rotary_emb_dim", "cross_attn"]),
    ("alibi-eager", lambda: MHA(64, 4, use_alibi=True), ["use_alibi", "use_flash_attn=True"]),
    ("window-eager", lambda: MHA(64, 4, window_size=(2, 2)), ["window_size", "use_flash_attn=True"]),
    ("x-embed", lambda: MHA(64, 4)(torch.randn(2, 5, 32)), ["x", "embed_dim=64"]),
    ("x-rank", lambda: MHA(64, 4)(torch.randn(5, 64)), ["x", "(batch, seqlen, embed_dim)"]),
    ("x-kv-self", lambda: MHA(64, 4)(_x, x_kv=_x), ["x_kv", "cross_attn=True"]),
    ("mask-shape", lambda: MHA(64, 4)(_x, key_padding_mask=torch.ones(2, 4, dtype=torch.bool)), ["key_padding_mask", "(2, 5)"]),
    ("mask-cross-flash", lambda: MHA(64, 4, cross_attn=True, use_flash_attn=True)(_x, key_padding_mask=torch.ones(2, 5, dtype=torch.bool)), ["key_padding_mask", "self-attention"]),
    ("packed-max-seqlen", lambda: MHA(64, 4, use_flash_attn=True)(_x[0], cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), ["max_seqlen"]),
    ("packed-eager", lambda: MHA(64, 4)(_x[0], cu_seqlens=torch.tensor([0, 5], dtype=torch.int32), max_seqlen=5), ["cu_seqlens", "use_flash_attn=True"]),
    ("generation-layer-idx", lambda: MHA(64, 4)(_x, inference_params=InferenceParams(8, 2)), ["layer_idx"]),
    ("generation-dwconv", lambda: MHA(64, 4, dwconv=True, layer_idx=0)(_x, inference_params=InferenceParams(8, 2)), ["dwconv"]),
    ("generation-too-long", lambda: MHA(64, 4, layer_idx=0)(_x, inference_params=InferenceParams(4, 2)), ["positions 0..4", "max_seqlen"]),
    ("generation-batch", lambda: MHA(64, 4, layer_idx=0)(_x, inference_params=InferenceParams(8, 1)), ["max_batch_size"]),
    ("flash-cross-packed", lambda: FlashCrossAttention()(_x[0].view(5, 4, 16), _x[0].view(5, 2, 2, 16), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32), max_seqlen=5), ["cu_seqlens_k"]),
]  # fmt: skip


@pytest.mark.parametrize("call,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_refused(call, words):
    check_refused(call, ValueError, words)


def test_dropout_only_in_training():
    """attention_dropout (self.drop.p) applies in training mode only, on both attention paths."""
    for use_flash_attn in (False, True):
        torch.manual_seed(0)
        mha = MHA(64, 4, dropout=0.5, use_flash_attn=use_flash_attn)
        x = torch.randn(2, 7, 64)
        mha.eval()
        assert torch.equal(mha(x), mha(x))
        mha.train()
        assert not torch.allclose(mha(x), mha.eval()(x))
    assert math.isclose(FlashSelfAttention(attention_dropout=0.25).drop.p, 0.25)


def test_mha_takes_a_flashmask(backend):
    """MHA (no rotary) over a row of packed documents under their causal document FlashMask, dense and in the
    packed (cu_seqlens) form with the varlen FlashMask, against the reference layer whose rows see only their
    own document's keys; the inner modules refuse ALiBi with a FlashMask and MHA refuses one without
    use_flash_attn."""
    from tileattn import masks
    from tileattn.checks import InvalidArgument

    ctx, device = on(backend)
    dtype = _dtype(backend)
    torch.manual_seed(0)
    mha = MHA(64, 4, num_heads_kv=2, causal=True, use_flash_attn=True, device=device, dtype=dtype)
    x = torch.randn(1, 13, 64, device=device, dtype=dtype)
    idx = masks.causal_document_mask([5, 8]).to(device)
    cu = torch.tensor([0, 13], dtype=torch.int32, device=device)
    with ctx:
        out = mha(x, startend_row_indices=idx)
        packed = mha(x[0], cu_seqlens=cu, max_seqlen=13, startend_row_indices=idx[0])
        with pytest.raises(InvalidArgument, match="ALiBi"):
            FlashSelfAttention(causal=True, alibi_slopes=torch.ones(4, device=device))(
                torch.randn(1, 13, 3, 4, 16, device=device, dtype=dtype), startend_row_indices=idx
            )
    document = torch.tensor([0] * 5 + [1] * 8)
    same_document = (document[:, None] == document[None, :])[None, None]  # (1, 1, 13, 13)
    ref, ref_lowp = (
        reference_mha(mha, _params(mha, exact, False), x.to(torch.float64 if exact else dtype), exact=exact,
                      visible_mask=same_document)
        for exact in (True, False)
    )  # fmt: skip
    check_close("document mask", out, ref, ref_lowp)
    check_close("document mask, packed", packed[None], ref, ref_lowp)
    with pytest.raises(InvalidArgument, match="use_flash_attn"):
        MHA(64, 4, use_flash_attn=False, device=device, dtype=dtype)(x, startend_row_indices=idx)
