"""tileattn.modules against the same layers written with the reference attention."""

import pytest
import torch

from helpers import on
from tileattn.modules import MHA, CrossAttention, SelfAttention
from tileattn.reference import attention_ref
from tileattn.rotary import apply_rotary_emb


def _reference_mha(mha: MHA, x, mask=None):
    """The same layer: projections, rotary from position 0, attention_ref with a key padding mask."""
    q, k, v = mha._split(mha.Wqkv(x))
    if mha.rotary_emb is not None:
        cos, sin = mha.rotary_emb.tables(x.shape[1], x.device, x.dtype)
        q = apply_rotary_emb(q, cos, sin, mha.rotary_emb.interleaved)
        k = apply_rotary_emb(k, cos, sin, mha.rotary_emb.interleaved)
    out, _ = attention_ref(
        q, k, v, query_padding_mask=mask, key_padding_mask=mask, causal=mha.causal, window_size=mha.window_size
    )
    out = mha.out_proj(out.flatten(-2))
    if mask is not None:
        out = out.masked_fill(~mask[..., None], 0.0)
    return out


@pytest.mark.parametrize(
    "opts",
    [
        dict(causal=True, rotary_emb_dim=8, num_heads_kv=2),
        dict(window_size=(3, 1), num_heads_kv=1, rotary_emb_dim=16, rotary_emb_interleaved=True),
        dict(qkv_proj_bias=False),
    ],
    ids=["causal-gqa-rotary", "window-mqa-interleaved", "plain"],
)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padding-mask"])
def test_mha_matches_reference_layer(backend, opts, padded):
    ctx, device = on(backend)
    dtype = torch.float32 if backend == "torch" else torch.float16
    if backend == "cuda":
        dtype = torch.bfloat16
    torch.manual_seed(0)
    mha = MHA(64, 4, **opts).to(device, dtype)
    x = torch.randn(3, 11, 64, device=device, dtype=dtype, requires_grad=True)
    mask = None
    if padded:
        mask = torch.arange(11, device=device)[None] < torch.tensor([11, 4, 7], device=device)[:, None]
    with ctx:
        out = mha(x, key_padding_mask=mask)
        (g,) = torch.autograd.grad(out.float().square().sum(), x)
    ref = _reference_mha(mha, x, mask)
    (g_ref,) = torch.autograd.grad(ref.float().square().sum(), x)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(g.float(), g_ref.float(), atol=10 * tol, rtol=10 * tol)


def test_self_and_cross_attention_wrappers(backend):
    ctx, device = on(backend)
    dtype = torch.float32 if backend == "torch" else torch.float16
    qkv = torch.randn(2, 9, 3, 4, 16, device=device, dtype=dtype)
    q, kv = (
        torch.randn(2, 5, 4, 16, device=device, dtype=dtype),
        torch.randn(2, 9, 2, 2, 16, device=device, dtype=dtype),
    )
    with ctx:
        out_self = SelfAttention(causal=True)(qkv)
        out_cross = CrossAttention()(q, kv)
        cu = torch.tensor([0, 9, 18], dtype=torch.int32, device=device)
        out_varlen = SelfAttention(causal=True)(qkv.flatten(0, 1), cu_seqlens=cu, max_seqlen=9)
    ref_self, _ = attention_ref(*qkv.unbind(2), causal=True)
    ref_cross, _ = attention_ref(q, *kv.unbind(2))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out_self, ref_self, atol=tol, rtol=tol)
    torch.testing.assert_close(out_cross, ref_cross, atol=tol, rtol=tol)
    torch.testing.assert_close(out_varlen, ref_self.flatten(0, 1), atol=tol, rtol=tol)
