"""The in-place append and the rotation it shares with the split kernel (kernels/decode/append.py,
rotary.py), the kernels called directly: entries with values out of range append nothing, rotary
positions past the tables clamped (for q), and kv heads that start past int32 offsets."""

import pytest
import torch

import oracle
from kvcache_cases import F16, _kernel_device
from tileattn.kernels import configs
from tileattn.params import AttnParams, CacheLayout
from tileattn.testing import check_close


def test_append_kernel_skips_entries_with_bad_values():
    """What runs under CUDA graph capture, where the API cannot read index values, and in calls whose
    checks the kernels make: a batch entry whose position runs past the capacity, or one of whose new
    tokens' pages is outside the pool, appends nothing (not the tokens that would fit); the others
    append as usual. Called directly, bypassing validation."""

    device = _kernel_device()
    from tileattn.kernels import decode

    pool = torch.zeros(4, 4, 1, 16, dtype=F16, device=device)
    before = pool.clone()
    new = torch.ones(3, 2, 1, 16, dtype=F16, device=device)
    table = torch.tensor([[0, 1], [2, 9], [3, -1]], dtype=torch.int32, device=device)  # 9 and -1 are bad pages
    seqlens = torch.tensor([7, 3, 1], dtype=torch.int32, device=device)  # 7 + 2 runs past capacity 8
    decode.kvcache_append(pool, pool.clone(), new, new, None, seqlens, None, table)
    written = (pool != before).any(-1).any(-1)  # (page, slot)
    expected = torch.zeros(4, 4, dtype=torch.bool, device=device)
    # seq 0: position 7 would fit (page 1 slot 3), 8 is past capacity: nothing written
    # seq 1: position 3 -> page 2 slot 3, position 4 -> page 9: nothing written
    expected[3, 1] = expected[3, 2] = True  # seq 2, positions 1, 2 -> page 3 (its table's -1 is past them)
    assert torch.equal(written, expected), written


def test_append_kernel_skips_entries_past_the_rotary_tables():
    """Under CUDA graph capture the API cannot check the rotary tables' length against cache_seqlens:
    the append kernel then writes nothing for an entry whose positions run past the tables (reading
    them at clamped positions, never past them), and rotates the others' keys at their positions.
    Called directly, bypassing validation."""
    device = _kernel_device()
    from tileattn.kernels import decode

    gen = torch.Generator(device=device).manual_seed(0)
    kc, vc = (torch.zeros(2, 12, 2, 16, dtype=F16, device=device) for _ in range(2))
    new = torch.randn(2, 2, 2, 16, dtype=F16, device=device, generator=gen)
    angle = torch.rand(5, 8, device=device, generator=gen) * 6.283
    cos, sin = angle.cos().to(F16), angle.sin().to(F16)
    seqlens = torch.tensor([2, 7], dtype=torch.int32, device=device)  # positions 2, 3 and 7, 8 of 5 rows
    decode.kvcache_append(kc, vc, new, new, (cos, sin, False), seqlens, None, None)
    positions = seqlens.long()[:1, None] + torch.arange(2, device=device)
    expected = oracle.rotary(new[:1], cos, sin, positions, False)
    assert torch.equal(kc[0, 2:4], expected[0]) and torch.equal(vc[0, 2:4], new[0])
    assert not kc[0, :2].any() and not kc[0, 4:].any() and not vc[0, 4:].any()
    assert not kc[1].any() and not vc[1].any()


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_attention_kernel_rotates_q_at_clamped_positions(interleaved):
    """The attention kernel rotates q as it reads it (CacheLayout.q_rotary), per token at
    ``cache_seqlens + i``: against the oracle on q rotated beforehand (oracle.rotary), with
    a partial rotary dim and GQA. Positions past the tables, which only a captured CUDA graph can pass
    (the API refuses them otherwise), read the tables' last row. Called directly, bypassing
    validation."""
    device = _kernel_device()
    from tileattn.kernels import decode

    gen = torch.Generator(device=device).manual_seed(0)
    batch, seqlen_q, cap, rot_len, d = 2, 3, 20, 9, 24
    q = torch.randn(batch, seqlen_q, 4, d, dtype=F16, device=device, generator=gen)
    kc, vc = (torch.randn(batch, cap, 2, d, dtype=F16, device=device, generator=gen) for _ in range(2))
    angle = torch.rand(rot_len, 6, device=device, generator=gen) * 6.283  # rotary dim 12 of 24
    cos, sin = angle.cos().to(F16), angle.sin().to(F16)
    seqlens = torch.tensor([4, 11], dtype=torch.int32, device=device)  # 11 + 2 is past the 9 rows
    p = AttnParams(batch=batch, seqlen_q=seqlen_q, seqlen_k=cap, headdim=d, softmax_scale=0.3)
    c = CacheLayout(seqlens_k=seqlens, max_seqlen_k=cap, q_rotary=(cos, sin, interleaved, True))
    out, _ = decode.attn_fwd_kvcache(q, kc, vc, p, c, configs.current(q.device))
    positions = (seqlens.long()[:, None] + torch.arange(seqlen_q, device=device)).clamp(max=rot_len - 1)
    q_rot = oracle.rotary(q, cos, sin, positions, interleaved)
    for b in range(batch):
        n = int(seqlens[b])
        k, v = kc[b : b + 1, :n], vc[b : b + 1, :n]
        ref = oracle.attention(q_rot[b : b + 1], k, v, softmax_scale=0.3).out
        low = oracle.attention(q_rot[b : b + 1], k, v, softmax_scale=0.3, precision=None).out
        check_close(f"sequence {b}", out[b : b + 1], ref, low)


def test_append_past_int32_head_offsets(big_gpu_memory):
    """The append kernel writes a new key of a kv head that starts past 2**31 elements (kv heads
    outermost) where it belongs: its head offset is 64-bit. The cache is a view into a larger buffer
    that is allocated lazily (only touched pages take memory), so a wrapped int32 offset would land
    inside the buffer, at the place checked to stay zero. Called directly."""
    device = _kernel_device()
    from tileattn.kernels import decode

    heads, cap, d = 3, 4, 16
    head_stride, start = 2**30 + 2**29, 2**31  # head 2 starts at 2 * head_stride > 2**31
    buf = torch.empty(start + 2 * head_stride + cap * d, dtype=F16, device=device)
    kc = buf.as_strided((1, cap, heads, d), (cap * d, d, head_stride, 1), storage_offset=start)
    vc = torch.zeros(1, cap, heads, d, dtype=F16, device=device)
    right = start + 2 * head_stride + d  # head 2, position 1
    wrapped = start + ((2 * head_stride + d + 2**31) % 2**32 - 2**31)
    for at in (right, wrapped):
        buf[at : at + d] = 0
    new = torch.full((1, 1, heads, d), 7.0, dtype=F16, device=device)
    seqlens = torch.tensor([1], dtype=torch.int32, device=device)
    decode.kvcache_append(kc, vc, new, new.clone(), None, seqlens, None, None)
    assert torch.equal(buf[right : right + d], new[0, 0, 2])
    assert not buf[wrapped : wrapped + d].any()
    assert torch.equal(kc[0, 1], new[0, 0]) and torch.equal(vc[0, 1], new[0, 0])
