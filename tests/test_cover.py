"""The covering samples the GPU's run of the suite takes of marked grids (tests/cover.py, tests/conftest.py):
every combination of the strength's number of values kept, the grid smaller, the same choice in every
process, and only GPU items sampled."""

import itertools
from types import SimpleNamespace

import pytest

import conftest
from cover import covering_sample


def _held(rows, chosen, t):
    """The t-wise value combinations the chosen rows hold."""
    return {
        (dims, tuple(rows[i][d] for d in dims))
        for i in chosen
        for dims in itertools.combinations(range(len(rows[0])), t)
    }


@pytest.mark.parametrize("strength", [1, 2, 3])
def test_every_combination_of_the_grid_is_kept(strength):
    grid = list(itertools.product(range(8), "abc", (0, 1, 3), ("fp16", "bf16")))
    kept = covering_sample(grid, strength)
    assert _held(grid, kept, strength) == _held(grid, range(len(grid)), strength)
    bound = {1: 8, 2: 8 * 3 + 6, 3: 8 * 3 * 3 + 20}[strength]  # (the largest product of t dims, and some slack)
    assert len(kept) <= bound < len(grid)


def test_pairs_of_a_sparse_grid_and_the_same_choice_each_time():
    """A grid with holes (combinations a test refuses): only pairs that occur are asked for; two calls give
    the same rows (every pytest-xdist worker must skip the same items)."""
    grid = [r for r in itertools.product(range(6), range(4), range(3)) if (r[0] + r[1]) % 3]
    kept = covering_sample(grid, 2)
    assert _held(grid, kept, 2) == _held(grid, range(len(grid)), 2)
    assert kept == covering_sample(list(grid), 2)


def test_strength_one_alternates_the_second_value():
    """Each case once, the dtypes in turn (not every case with the first dtype)."""
    grid = [(case, dtype) for case in range(10) for dtype in ("fp16", "bf16")]
    kept = [grid[i] for i in sorted(covering_sample(grid, 1))]
    assert sorted(c for c, _ in kept) == list(range(10))
    assert sum(d == "bf16" for _, d in kept) == 5


def test_a_full_strength_keeps_everything_and_bad_rows_are_refused():
    grid = list(itertools.product(range(3), range(2)))
    assert covering_sample(grid, 2) == covering_sample(grid, 5) == set(range(6))
    assert covering_sample([], 2) == set()
    with pytest.raises(ValueError, match="same number"):
        covering_sample([(1, 2), (1,)], 1)
    with pytest.raises(ValueError, match="strength"):
        covering_sample(grid, 0)


class _Item:
    """What conftest._sample_gpu_grids reads of a collected pytest item."""

    def __init__(self, function, params, mark):
        self.function, self.callspec, self.mark, self.skips = function, SimpleNamespace(params=params), mark, []

    def get_closest_marker(self, name):
        return self.mark if name == "gpu_cover" else None

    def add_marker(self, mark):
        self.skips.append(mark.kwargs["reason"])


def test_only_the_gpu_items_of_a_marked_grid_are_sampled():
    """The CPU path's items (backend "torch") and unmarked tests keep their whole grid; items ``valid``
    refuses take no part (they skip themselves); the GPU items outside the sample skip, saying why."""

    def marked(**_):
        pass

    def unmarked(**_):
        pass

    mark = SimpleNamespace(kwargs=dict(strength=1, valid=lambda case, dtype: case != 3))
    grid = [dict(case=c, dtype=d) for c in range(6) for d in ("fp16", "bf16")]
    gpu = [_Item(marked, dict(backend="cuda", **p), mark) for p in grid]
    cpu = [_Item(marked, dict(backend="torch", **p), mark) for p in grid]
    plain = [_Item(unmarked, dict(backend="cuda", **p), None) for p in grid]
    conftest._sample_gpu_grids(gpu + cpu + plain)
    ran = [it.callspec.params for it in gpu if not it.skips]
    assert sorted(p["case"] for p in ran) == [0, 1, 2, 3, 3, 4, 5]  # (case 3: refused by valid, left alone)
    assert {p["dtype"] for p in ran if p["case"] != 3} == {"fp16", "bf16"}
    assert all("covering sample" in it.skips[0] and "TILEATTN_SLOW=1" in it.skips[0] for it in gpu if it.skips)
    assert not any(it.skips for it in cpu + plain)


class _Timed:
    """What conftest._longest_first reads of a collected pytest item."""

    def __init__(self, nodeid, params=None, long=False):
        self.nodeid, self.callspec, self.long = nodeid, SimpleNamespace(params=params or {}), long

    def get_closest_marker(self, name):
        return object() if name == "long" and self.long else None

    def __repr__(self):
        return self.nodeid


def test_long_items_lead_each_workers_first_block(monkeypatch):
    """On the GPU the property shards, the tests marked ``long`` and the Gluon tests are dealt in turn to the
    front of each worker's first block (work stealing hands out ``len(left) // workers_left`` items in
    order); the others keep their order, none lost."""
    monkeypatch.setattr(conftest, "_WORKERS", 4)
    rest = [_Timed(f"tests/t.py::quick[{i}]") for i in range(40)]
    shards = [_Timed(f"tests/t.py::prop[cuda-{s}]", dict(backend="cuda", shard=s)) for s in range(2)]
    cpu_shard = _Timed("tests/t.py::prop[torch-0]", dict(backend="torch", shard=0))
    marked = [_Timed(f"tests/t.py::spawn[{w}]", long=True) for w in (1, 2)]
    gluon = [_Timed(f"tests/kernels/test_gluon_forward.py::case[{i}]") for i in range(4)]
    items = rest[:10] + gluon + rest[10:20] + shards + [cpu_shard] + rest[20:25] + marked + rest[25:]
    before = list(items)
    conftest._longest_first(items)
    assert sorted(map(repr, items)) == sorted(map(repr, before))
    blocks, left = [], list(items)
    for w in range(4):  # (the blocks work stealing deals first)
        size = len(left) // (4 - w)
        blocks.append(left[:size])
        left = left[size:]
    long = set(map(repr, marked + shards + gluon))
    for block in blocks:
        heads = [repr(it) for it in block[: sum(repr(it) in long for it in block)]]
        assert all(h in long for h in heads) and 1 <= len(heads) <= 3, block
    assert [repr(it) for it in items if repr(it) not in long] == [repr(it) for it in before if repr(it) not in long]
