"""What differs between the Triton versions tileattn supports (3.6 to 3.9), checked on whichever one is
installed (CI runs 3.6.0 and the newest): Triton 3.9's interpreter refuses load and store masks that are
not boolean, and the interpreters before 3.7 convert tensor loop bounds in a way numpy 2.4 refuses
(kernels/compat.py). Both run under the interpreter only; on a GPU, tests/kernels/test_sm90_builds.py
compiles the kernels with the installed Triton instead."""

import traceback
import warnings

import pytest
import torch

from conftest import HAS_CUDA
from helpers import on
from tileattn.params import AttnParams, CacheLayout, interpreting

pytestmark = pytest.mark.skipif(HAS_CUDA or not interpreting(), reason="Triton's interpreter (CPU) only")

F16 = torch.float16


@pytest.fixture
def masks_seen(monkeypatch):
    """Every mask the interpreter's masked loads and stores receive, as (numpy dtype, the kernel line
    that passed it)."""
    from triton.runtime import interpreter

    seen = []

    def where() -> str:
        frames = [f for f in traceback.extract_stack() if "/tileattn/kernels/" in f.filename.replace("\\", "/")]
        return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "?"

    builder = interpreter.InterpreterBuilder

    def masked_load(self, ptrs, mask, *rest, original=builder.create_masked_load):
        seen.append((mask.data.dtype, where()))
        return original(self, ptrs, mask, *rest)

    def masked_store(self, ptrs, value, mask, *rest, original=builder.create_masked_store):
        seen.append((mask.data.dtype, where()))
        return original(self, ptrs, value, mask, *rest)

    monkeypatch.setattr(builder, "create_masked_load", masked_load)
    monkeypatch.setattr(builder, "create_masked_store", masked_store)
    return seen


def _not_boolean(seen) -> list[str]:
    return sorted({f"{dtype} at {line}" for dtype, line in seen if dtype.kind != "b"})


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_masks_are_boolean(masks_seen, paged):
    """The KV-cache kernels (the append with rotary keys, the split kernel rotating q at one position for
    all rows and at a position per token, the combine) hand the interpreter boolean masks only: a scalar
    condition combined with a block (the append's ``first``, its ``in_range``) is broadcast by the
    interpreter as int32, which Triton 3.9's refuses."""
    from tileattn.kernels import configs, decode

    gen = torch.Generator().manual_seed(0)
    batch, hk, d, cap = 2, 2, 16, 32
    if paged:
        kc, vc = (torch.zeros(8, 8, hk, d, dtype=F16) for _ in range(2))
        table = torch.arange(8, dtype=torch.int32).view(batch, 4)
    else:
        kc, vc = (torch.zeros(batch, cap, hk, d, dtype=F16) for _ in range(2))
        table = None
    angle = torch.rand(cap, 4, generator=gen) * 6.283  # rotary dim 8 of 16
    cos, sin = angle.cos().to(F16), angle.sin().to(F16)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    new = torch.randn(batch, 2, hk, d, dtype=F16, generator=gen)
    decode.kvcache_append(kc, vc, new, new, (cos, sin, False), seqlens, None, table)
    for seqlen_q, per_token in ((1, False), (3, True)):
        q = torch.randn(batch, seqlen_q, 2 * hk, d, dtype=F16, generator=gen)
        p = AttnParams(batch=batch, seqlen_q=seqlen_q, seqlen_k=cap, headdim=d, softmax_scale=0.25)
        rotary = (cos, sin, True, per_token)
        c = CacheLayout(seqlens_k=seqlens, block_table=table, num_splits=2, max_seqlen_k=cap, q_rotary=rotary)
        decode.attn_fwd_kvcache(q, kc, vc, p, c, configs.current(q.device))
    assert len(masks_seen) > 0, "no masked load or store reached the interpreter"
    assert not _not_boolean(masks_seen), _not_boolean(masks_seen)


def test_attention_masks_are_boolean(masks_seen):
    """The forward and backward kernels (causal with a window, dense and packed) hand the interpreter
    boolean masks only."""
    from tileattn import flash_attn_func, flash_attn_varlen_func

    ctx, device = on("interpret")
    q, k, v = (torch.randn(2, 37, 2, 16, dtype=F16, device=device, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    with ctx:
        out = flash_attn_func(q, k, v, causal=True, window_size=(7, 0))
        out.sum().backward()
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 20, 20, causal=True)
        out.sum().backward()
    assert len(masks_seen) > 0, "no masked load or store reached the interpreter"
    assert not _not_boolean(masks_seen), _not_boolean(masks_seen)


def test_interpreter_takes_tensor_loop_bounds():
    """A loop over bounds loaded from memory (tensors, as in every tileattn kernel) runs under the
    interpreter once tileattn's kernels are loaded, with no numpy deprecation: before Triton 3.7 the
    interpreter converts them with ``int()`` of a one-element array, which numpy 2.4 refuses and numpy
    1.25 to 2.3 warn about (kernels/compat.py patches the conversion)."""
    import triton
    import triton.language as tl

    import tileattn.kernels.launch  # noqa: F401  (loading the kernels patches the interpreter where needed)

    @triton.jit
    def fill(X, Bounds):
        lo = tl.load(Bounds)
        hi = tl.load(Bounds + 1)
        for j in range(lo, hi, 2):
            tl.store(X + j, j + 1)

    x = torch.zeros(12, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        fill[(1,)](x, torch.tensor([3, 10], dtype=torch.int32))
    expected = torch.zeros(12, dtype=torch.int32)
    for j in (3, 5, 7, 9):
        expected[j] = j + 1
    assert torch.equal(x, expected), x


def test_interpreter_patch_applies_once():
    """``compat.patch_interpreter`` patches an interpreter at most once, and leaves one whose scalar
    conversion is already fine (Triton 3.7 and later) as it is."""
    from triton.runtime import interpreter

    from tileattn.kernels import compat

    compat.patch_interpreter()
    assert not compat._index_needs_patch(interpreter)
    assert compat.patch_interpreter() is False
