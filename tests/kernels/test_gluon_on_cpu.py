"""What of the Gluon forward runs without a GPU, run on CPU: the three-loop key loop (``mask_loops``) skips
the mask on the tiles ``_mask_phases`` names, and each of them must be fully visible to every row of the
warpgroup, every fully visible tile of the loop among them (``_mask_phases`` is scalar arithmetic: its own
code runs here on Python ints, Gluon's ``maximum``, ``minimum`` and ``cdiv`` as Python's, against the
visibility rule itself); the order of the work items (``schedule.work_item``, its own code likewise, and
``head_group``); and FP8's V, the transposed copy as the TMA matrix the kernel reads."""

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileattn.kernels import gluon

pytestmark = pytest.mark.skipif(not gluon.available(), reason="the Gluon kernels are written for Triton 3.6's Gluon")

_PY_GL = types.SimpleNamespace(maximum=max, minimum=min, cdiv=lambda a, b: -(-a // b))


def _on_ints(jit_fn, gl=_PY_GL, **names):
    """A Gluon function's own code as a Python function on ints: Gluon's ``maximum``, ``minimum`` and
    ``cdiv`` as Python's (``gl``: a namespace with those and any others it calls), and the Gluon functions it
    calls given in ``names`` the same way."""
    fn = jit_fn.fn
    calls = {name: _on_ints(other, gl) for name, other in names.items()}
    return types.FunctionType(fn.__code__, {**fn.__globals__, "gl": gl, **calls}, fn.__name__)


def _mask_phases(*args):
    """``kernels.gluon.forward._mask_phases``' own code, on Python ints."""
    from tileattn.kernels.gluon import forward

    return _on_ints(forward._mask_phases)(*args)


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


def _work_item(*args, programs=1):
    """``kernels.gluon.schedule.work_item``'s own code on Python ints (a dense call: ``sequence``'s own code
    reads no cu_seqlens), in a grid of ``programs``."""
    from tileattn.kernels.gluon import schedule

    gl = types.SimpleNamespace(**vars(_PY_GL), num_programs=lambda axis: programs)
    return _on_ints(schedule.work_item, gl, sequence=schedule.sequence)(*args)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    num_m=st.integers(1, 9), nheads=st.integers(1, 6), batch=st.integers(1, 4), head_group=st.integers(1, 30),
    kind=st.sampled_from(["causal", "dense", "window"]),
)  # fmt: skip
def test_the_work_items_are_each_block_once_longest_first_by_head_group(num_m, nheads, batch, head_group, kind):
    """Every (query block, head, batch entry) is exactly one work item. Causal: the pairs (batch entry,
    head) come in groups of ``head_group`` consecutive ones (the last may be smaller; all of them at once
    when ``head_group`` covers them: the order before groups), each group's blocks with the most keys
    first and its items before the next group's. The others: each head's blocks together, in order."""
    item, block_n, seqlen = 128, 128, 128 * num_m
    mask_left, mask_right = kind == "window", kind != "dense"
    pairs = nheads * batch
    order = []
    for t in range(num_m * pairs):
        q_base, h, b, q0, seqlen_q, k0, seqlen_k, lo, n_tiles = _work_item(
            t, num_m, nheads, batch, head_group, 0, seqlen, seqlen, None, None, 64, 0, item, block_n, mask_left,
            mask_right, False,
        )  # fmt: skip
        assert (q0, k0, seqlen_q, seqlen_k) == (b * seqlen, b * seqlen, seqlen, seqlen)
        order.append((q_base // item, b * nheads + h, n_tiles))
    assert sorted((m, hb) for m, hb, _ in order) == [(m, hb) for m in range(num_m) for hb in range(pairs)]
    if kind != "causal":
        assert [(m, hb) for m, hb, _ in order] == [(m, hb) for hb in range(pairs) for m in range(num_m)]
        return
    step = min(head_group, pairs)
    for first in range(0, pairs, step):
        part = order[first * num_m : min(first + step, pairs) * num_m]
        assert {hb for _, hb, _ in part} == set(range(first, min(first + step, pairs)))
        assert [n for _, _, n in part] == sorted((n for _, _, n in part), reverse=True)
        assert [m for m, _, _ in part] == sorted((m for m, _, _ in part), reverse=True)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(num_m=st.integers(1, 9), pairs=st.integers(1, 12), head_group=st.integers(1, 12), programs=st.integers(1, 20))
def test_snake_reverses_every_other_wave_of_the_grouped_order(num_m, pairs, head_group, programs):
    """With ``snake``, program p's i-th item (t = i * programs + p) is, in odd waves, the grouped order's item
    that the wave's last program would otherwise take first: the wave's items reversed (the last wave: only
    its own items), so every item is still taken exactly once."""
    seqlen = 128 * num_m

    def items(snake):
        return [
            _work_item(
                t, num_m, pairs, 1, head_group, snake, seqlen, seqlen, None, None, 0, 0, 128, 128, False, True, False,
                programs=programs,
            )[:2]
            for t in range(num_m * pairs)
        ]  # fmt: skip

    plain, snake = items(0), items(1)
    total = num_m * pairs
    for t in range(total):
        wave, lane = divmod(t, programs)
        width = min(programs, total - wave * programs)
        assert snake[t] == plain[wave * programs + (width - 1 - lane if wave % 2 else lane)], (t, snake, plain)
    assert sorted(snake) == sorted(plain)


def _busiest(num_m, pairs, group, programs, tiles, cost):
    """The most a program takes (key tiles plus ``cost`` an item) from the grouped longest-first order in snake
    order, written out item by item (not ``balanced_group``'s code)."""
    order = []
    for first in range(0, pairs, group):
        size = min(group, pairs - first)
        order += [tiles[m] for m in reversed(range(num_m)) for _ in range(size)]
    load = [0.0] * programs
    for t, n in enumerate(order):
        wave, lane = divmod(t, programs)
        width = min(programs, len(order) - wave * programs)
        load[width - 1 - lane if wave % 2 else lane] += n + cost
    return max(load)


@pytest.mark.parametrize(
    "num_m, pairs, most, programs, shift",
    [(8, 256, 64, 132, 0), (16, 128, 32, 132, 0), (16, 64, 16, 132, 0), (8, 37, 9, 10, 0), (5, 12, 12, 7, 300)],
)
def test_balanced_group_loads_the_busiest_program_least(num_m, pairs, most, programs, shift):
    """``balanced_group`` picks, of the group sizes up to ``most``, one whose busiest program takes the least
    (or within 0.1 % of it), against the order written out item by item."""
    from tileattn.kernels.gluon import schedule

    tiles = [-(-max(0, (m + 1) * 128 + shift) // 128) for m in range(num_m)]
    loads = {g: _busiest(num_m, pairs, g, programs, tiles, schedule.ITEM_COST) for g in range(1, most + 1)}
    g = schedule.balanced_group(num_m, pairs, most, programs, 128, 128, shift)
    assert 1 <= g <= most and loads[g] <= min(loads.values()) * 1.001, (g, loads)


@pytest.mark.parametrize(
    "args, expected",
    [
        ((8, 16, 16, 2048, 128, 2, 32 << 20), 32),  # 1 MiB of K/V a head: 32 heads of the 128
        ((8, 16, 4, 2048, 128, 2, 32 << 20), 128),  # GQA 4: 32 key/value heads, 4 query heads each
        ((1, 16, 16, 16384, 128, 2, 32 << 20), 4),  # 8 MiB a head
        ((1, 2, 2, 1 << 20, 256, 2, 32 << 20), 1),  # one head's K/V past the budget: one at a time
        ((8, 16, 16, 2048, 128, 2, 0), 128),  # 0: every pair in one group
        ((2, 3, 3, 64, 64, 1, 32 << 20), 6),  # FP8, short: all of them
    ],
)
def test_head_groups_hold_their_keys_and_values_in_the_l2_budget(args, expected):
    from tileattn.kernels.gluon import schedule

    assert schedule.head_group(*args) == expected


@pytest.mark.parametrize("shape", [(2, 37, 3, 64), (1, 130, 2, 128)])
def test_fp8_reads_v_through_its_transposed_rows(shape):
    """FP8's V: the transposed copy as the TMA matrix the kernel reads (``transposed_rows``): the tile of
    (batch entry b, kv head h) starts at row b * batch_rows + h * head_rows, head-dim column c is row c
    after it, key s is column s; rows are padded to 16 bytes (TMA's row pitch)."""
    import torch

    from tileattn.kernels.common import transposed_v
    from tileattn.kernels.gluon.forward import transposed_rows

    v = torch.randn(shape).to(torch.float8_e4m3fn)
    batch, seqlen, nheads_k, headdim = shape
    rows = transposed_rows(v, transposed_v(v))
    assert rows.matrix.shape == (batch * nheads_k * headdim, seqlen) and rows.matrix.stride(0) % 16 == 0
    assert (rows.batch_rows, rows.head_rows, rows.head_cols) == (nheads_k * headdim, headdim, 0)
    for b in range(batch):
        for h in range(nheads_k):
            first = b * rows.batch_rows + h * rows.head_rows
            tile = rows.matrix[first : first + headdim].view(torch.uint8)
            assert torch.equal(tile, v[b, :, h, :].T.contiguous().view(torch.uint8))


def _named(fn) -> set[str]:
    """The constexpr parameters of a Gluon kernel: those a planned launch must name (``kernels.launch``)."""
    return {param.name for param in fn.params if param.is_constexpr}


@pytest.mark.parametrize(
    "headdim, dtype, options",
    [
        (128, "bf16", {}),
        (96, "fp16", dict(mask_loops=True)),
        (128, "bf16", dict(pingpong=True, sink=True, window=True)),
        (128, "fp8", {}),
        (64, "bf16", dict(block_m=192, block_n=64, varlen=True)),
    ],
)
def test_gluon_forward_plans_name_every_constexpr(headdim, dtype, options):
    """A launch that leaves a constexpr to its default gets no launch plan: every call pays Triton's slow
    launch path (and ``TILEATTN_VERIFY_LAUNCH=1`` refuses it). The plan is built here on CPU tensors; its
    launch is not run."""
    import torch

    from tileattn.kernels.gluon import forward
    from tileattn.kernels.gluon.common import tma_rows
    from tileattn.params import AttnParams

    batch, seqlen, nheads = 2, 200, 4
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[dtype]
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim).to(torch_dtype) for _ in range(3))
    extra = {}
    if options.get("varlen"):
        extra.update(cu_seqlens_q=torch.tensor([0, 150, 400], dtype=torch.int32))
        extra.update(cu_seqlens_k=extra["cu_seqlens_q"])
        q, k, v = (t.view(1, batch * seqlen, nheads, headdim) for t in (q, k, v))
    if options.get("sink"):
        extra.update(learnable_sink=torch.zeros(nheads))
    if options.get("window"):
        extra.update(window_left=50)
    if dtype == "fp8":
        extra.update(descales=torch.ones(3, batch, nheads))
    p = AttnParams(batch, seqlen, seqlen, headdim, headdim**-0.5, window_right=0, **extra)
    # (eligible_rows asks for an sm90 GPU: the rows it would return)
    rows = (tma_rows(q), tma_rows(k), forward.transposed_rows(v) if p.is_fp8 else tma_rows(v))
    build = {name: options[name] for name in ("block_m", "block_n", "pingpong", "mask_loops") if name in options}
    plan = forward.Plan(q, k, v, p, rows, programs=4, **build)
    assert set(plan.launch.constexprs) == _named(plan.launch.launcher.fn)


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_gluon_backward_plans_name_every_constexpr(headdim):
    """As the forward's: the backward's plans (the split build at head dim 256) name every constexpr."""
    import torch

    from tileattn.kernels.gluon import backward
    from tileattn.kernels.gluon.common import tma_rows
    from tileattn.params import AttnParams

    batch, seqlen, nheads = 2, 200, 4
    q, k, v, do = (torch.randn(batch, seqlen, nheads, headdim, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.zeros(batch, nheads, seqlen)
    p = AttnParams(batch, seqlen, seqlen, headdim, headdim**-0.5, window_right=0)
    rows = tuple(tma_rows(t) for t in (q, k, v, do))  # (eligible_rows' on an sm90 GPU)
    plan = backward.Plan(q, k, v, do, lse, p, rows)
    assert set(plan.launch.constexprs) == _named(plan.launch.launcher.fn)
