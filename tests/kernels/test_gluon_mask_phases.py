"""The Gluon forward's three-loop key loop (``mask_loops``) skips the mask on the tiles ``_mask_phases``
names: each of them must be fully visible to every row of the warpgroup, and every fully visible tile of
the loop should be among them. ``_mask_phases`` is scalar arithmetic: its own code runs here on Python ints
(Gluon's ``maximum``, ``minimum`` and ``cdiv`` as Python's), on CPU, against the visibility rule itself."""

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileattn.kernels import gluon

pytestmark = pytest.mark.skipif(not gluon.available(), reason="the Gluon kernels are written for Triton 3.6's Gluon")

_PY_GL = types.SimpleNamespace(maximum=max, minimum=min, cdiv=lambda a, b: -(-a // b))


def _mask_phases(*args):
    """``kernels.gluon.forward._mask_phases``' own code, on Python ints."""
    from tileattn.kernels.gluon import forward

    fn = forward._mask_phases.fn
    return types.FunctionType(fn.__code__, {**fn.__globals__, "gl": _PY_GL}, fn.__name__)(*args)


def _fully_visible(start, block_n, rows, seqlen_q, seqlen_k, window, mask_left, mask_right) -> bool:
    """Whether every row in ``rows`` sees every key of the tile at ``start`` (bottom-right aligned windows,
    flash_attn's rule: row i sees key k iff i + shift - left <= k <= i + shift + right, keys < seqlen_k)."""
    shift = seqlen_k - seqlen_q
    left, right = window
    for key in range(start, start + block_n):
        if key >= seqlen_k:
            return False
        for i in rows:
            if (mask_right and key > i + shift + right) or (mask_left and key < i + shift - left):
                return False
    return True


@st.composite
def _cases(draw):
    block_n = draw(st.sampled_from([64, 128]))
    rows = 64
    seqlen_q, seqlen_k = draw(st.integers(1, 700)), draw(st.integers(1, 700))
    kind = draw(st.sampled_from(["dense", "causal", "window", "left", "right"]))
    left = draw(st.integers(0, 300)) if kind in ("window", "left") else -1
    right = {"causal": 0, "window": draw(st.integers(0, 40)), "right": draw(st.integers(0, 200))}.get(kind, -1)
    first_row = draw(st.integers(0, max(seqlen_q - 1, 0)))
    lo = draw(st.integers(0, seqlen_k // block_n))
    n_tiles = draw(st.integers(0, -(-seqlen_k // block_n) - lo))
    return block_n, rows, seqlen_q, seqlen_k, (left, right), first_row, lo, n_tiles


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_cases())
def test_the_tiles_without_a_mask_are_the_fully_visible_ones(case):
    block_n, rows, seqlen_q, seqlen_k, window, first_row, lo, n_tiles = case
    mask_left, mask_right = window[0] >= 0, window[1] >= 0
    bounds = (seqlen_q, seqlen_k, max(window[0], 0), max(window[1], 0))
    a, b = _mask_phases(lo, n_tiles, first_row, bounds, rows, block_n, mask_left, mask_right)
    assert 1 <= a <= b <= max(n_tiles, 1) or (n_tiles <= 1 and a == b), (a, b)
    wg_rows = range(first_row, first_row + rows)
    visible = {
        j
        for j in range(1, n_tiles)
        if _fully_visible((lo + j) * block_n, block_n, wg_rows, seqlen_q, seqlen_k, bounds[2:], mask_left, mask_right)
    }
    assert set(range(a, b)) == visible, (a, b, sorted(visible))
