"""The kernels' dropout draws: Triton's tl.rand and the keep-mask helper of kernels/common.py equal
tileattn.rng's Philox replica bit for bit, and the tests' own mask from the definition (dropout_ref), through
the interpreter on CPU, or on the GPU."""

import numpy as np
import pytest
import torch

import dropout_ref
from tileattn import rng
from tileattn.kernels import common  # noqa: F401  (used by a kernel defined in a test)
from tileattn.params import dropout_threshold


def test_philox_replica_matches_triton():
    """tileattn.rng reproduces tl.rand bit for bit (checked through the interpreter on CPU, or on GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rand(Out, seed, base, BLOCK: tl.constexpr):
        offs = base + tl.arange(0, BLOCK).to(tl.int64)
        tl.store(Out + tl.arange(0, BLOCK), tl.rand(seed, offs))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(64, device=device)
    seed, base = 0x1234_5678_9ABC, 3 * 2**32 + 17
    _rand[(1,)](out, seed, base, BLOCK=64)
    expected = rng.philox_uniform(seed, torch.arange(64, dtype=torch.int64) + base)
    assert torch.equal(out.cpu(), expected)
    # the tests' own Philox (dropout_ref), through tl.rand's mapping of the first word to [0, 1)
    word = dropout_ref.philox4x32_10(seed, np.arange(64, dtype=np.uint64) + np.uint64(base))[0].astype(np.int64)
    word = np.where(word >= 2**31, word - 2**32, word)
    assert torch.equal(out.cpu(), torch.from_numpy(np.where(word < 0, -word - 1, word)).float() * 4.6566127342e-10)


def test_grouped_dropout_bits_match_the_replica():
    """The kernels' keep-mask helper (16 columns per Philox draw, 8 bits each) equals
    tileattn.rng.dropout_keep element for element, at an unaligned row, a later column block and a
    key length that is not a multiple of 64."""
    import triton
    import triton.language as tl

    @triton.jit
    def _keep(Out, seed, base, row_groups, p, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_m = 3 + tl.arange(0, BLOCK_M)
        keep = common.dropout_keep(seed, base, offs_m, start_n, row_groups, p, BLOCK_M, BLOCK_N)
        tl.store(Out + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], keep.to(tl.int32))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.zeros(16, 128, dtype=torch.int32, device=device)
    seed, sq, sk, nheads, b, h = 0x1234_5678_9ABC, 40, 300, 3, 1, 2
    row_groups = 4 * ((sk + 63) // 64)
    p = 0.37
    threshold = float(dropout_threshold(p))
    _keep[(1,)](out, seed, (b * nheads + h) * sq * row_groups, row_groups, threshold, 64, BLOCK_M=16, BLOCK_N=128)
    i, j = (3 + torch.arange(16)).view(-1, 1), (64 + torch.arange(128)).view(1, -1)
    expected = rng.dropout_keep(seed, rng.dropout_offsets(b, h, i, j, nheads, sq, sk), p)
    assert torch.equal(out.cpu().bool(), expected)
    # and the mask written from the definition apart from tileattn.rng (the tests' dropout_ref)
    assert torch.equal(out.cpu().bool(), dropout_ref.keep_mask(seed, p, b + 1, nheads, sq, sk)[b, h, 3:19, 64:192])


@pytest.mark.parametrize(
    "p, kept",
    [(0.0, 256), (0.37, 161), (0.1, 230), (0.2, 205), (1e-6, 255), (0.9999999, 1)],
)
def test_dropout_threshold_is_flash_attns_rule(p, kept):
    """flash_attn keeps a byte at most floor(255 · (1 - p)) with 1 - p in fp32 (0.8 in fp32 is a little above
    0.8, so p = 0.2 keeps 205 byte values, where 255 · 0.8 in fp64 would give 204); the threshold here counts
    the same bytes from the other end."""
    assert 256 - dropout_threshold(p) == kept == dropout_ref.kept_bytes(p)
