"""Context parallelism (tileattn.distributed): the ring's plan against brute-force masks, and spawned
groups of 2 and 3 CPU processes (gloo), and on GPUs NCCL groups of 1 and 2 ranks, whose outputs and
gradients are asserted against the fp64 oracle of the whole sequence (tests/distributed/workers.py runs
the cases on each rank)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
import workers
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from tileattn import distributed as cp
from tileattn.ops import context
from tileattn.ops.context import Layout


def _visible(lo, hi, rows, keys):
    """Brute force: key j visible to row i when lo <= j - i <= hi (None unbounded)."""
    i = torch.arange(rows)[:, None]
    j = torch.arange(keys)[None, :]
    mask = torch.ones(rows, keys, dtype=torch.bool)
    if lo is not None:
        mask &= j - i >= lo
    if hi is not None:
        mask &= j - i <= hi
    return mask


def _call_mask(rows, keys, q0, q1, k0, k1, left, right):
    """What the kernels see for one call: oracle.visible on the slices, placed in the tile."""
    mask = torch.zeros(rows, keys, dtype=torch.bool)
    sq, sk = q1 - q0, k1 - k0
    mask[q0:q1, k0:k1] = oracle.visible(sq, sk, None if left < 0 else left, None if right < 0 else right, sq, sk)
    return mask


bound = st.one_of(st.none(), st.integers(-40, 40))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.integers(1, 20), st.integers(1, 20), bound, bound)
def test_band_is_the_mask(rows, keys, lo, hi):
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    want = _visible(lo, hi, rows, keys)
    part = context.band(rows, keys, lo, hi)
    if part is None:
        assert not want.any()
        return
    q0, q1, k0, k1, left, right = part
    assert left >= -1 and right >= -1
    assert torch.equal(_call_mask(rows, keys, *part), want)
    assert want[q0:q1].any(1).all(), "a row of the call sees no key"
    assert want[:, k0:k1].any(0).all(), "a key of the call is seen by no row"


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0), (5, 2), (0, -1), (-1, 7), (-1, 4), (0, 0)])
def test_plan_covers_each_pair_once(layout, world, window):
    """Over the ring's steps, each rank's calls cover exactly the visible (query, key) pairs of its rows,
    each once, and skip what nothing sees."""
    chunk = 6
    seqlen = world * chunk
    left, right = window
    want = _visible(None if left < 0 else -left, None if right < 0 else right, seqlen, seqlen)
    for rank in range(world):
        rows = [p for start, n in context.segments(layout, rank, world, chunk) for p in range(start, start + n)]
        seen = torch.zeros(chunk, seqlen, dtype=torch.int64)
        calls = 0
        for step in range(world):
            source = (rank - step) % world
            keys = [p for start, n in context.segments(layout, source, world, chunk) for p in range(start, start + n)]
            for c in context.plan(layout, rank, source, world, chunk, left, right):
                calls += 1
                local = _call_mask(chunk, chunk, c.q0, c.q1, c.k0, c.k1, c.left, c.right)
                seen[:, keys] += local.long()
            full = [c for c in context.plan(layout, rank, source, world, chunk, left, right) if c.full]
            for a in full:  # calls that see everything and touch are one call
                for b in full:
                    assert not ((a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0), (a, b)
                    assert not ((a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0), (a, b)
        assert torch.equal(seen, want[rows].long()), (rank, seen, want[rows])
        if window == (-1, -1):
            assert calls == world, "calls that see everything merge into one per step"


def test_zigzag_balances_causal_work():
    world, chunk = 4, 8
    work = []
    for rank in range(world):
        pairs = 0
        for step in range(world):
            for c in context.plan(Layout.ZIGZAG, rank, (rank - step) % world, world, chunk, -1, 0):
                pairs += int(_call_mask(chunk, chunk, c.q0, c.q1, c.k0, c.k1, c.left, c.right).sum())
        work.append(pairs)
    assert len(set(work)) == 1, work


def test_refused_without_a_process_group():
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="init_process_group"):
        cp.ring_flash_attn_func(x, x, x)


def _spawn(world: int, which: list[str], tmp_path, interpret: bool, backend="gloo", env=None) -> dict[str, list[str]]:
    """Runs ``workers.main`` on ``world`` spawned processes (the CPU path, or with ``interpret`` the Triton
    kernels under the interpreter; ``env``: more variables the ranks see); ``{case: [rank 0's result, ...]}``."""
    results = str(tmp_path / "results")
    env = {"TRITON_INTERPRET": "1" if interpret else "0", **(env or {})}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        mp.start_processes(
            workers.main,
            args=(world, str(tmp_path / "store"), results, which, backend),
            nprocs=world,
            start_method="spawn",
        )
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    reports = []
    for rank in range(world):
        with open(f"{results}.{rank}") as f:
            reports.append(json.load(f))
    return {name: [r.get(name, "missing") for r in reports] for name in which}


NAMES = {
    (world, interpret): [c.name for c in workers.interpreter_cases(world)]
    if interpret
    else [c.name for c in workers.cases(world) + workers.varlen_cases(world)]
    + ["dropout", "opcheck", "refusals", "mismatched_groups"]
    for world in (2, 3)
    for interpret in (False, True)
}
CASES = [(w, n) for (w, interpret), names in NAMES.items() for n in names if not interpret or w == 2]


@pytest.fixture(scope="module")
def group_runs(shared_tmp):
    """The group of each (world, interpret) runs every case of NAMES once per test session: the first
    pytest-xdist worker to need it spawns it, the others wait for it and read its results."""
    from filelock import FileLock

    def run(world, interpret):
        key = f"world{world}" + ("-interpret" if interpret else "")
        done = shared_tmp / f"{key}.json"
        with FileLock(shared_tmp / f"{key}.lock"):
            if not done.exists():
                folder = shared_tmp / key
                folder.mkdir(exist_ok=True)
                done.write_text(json.dumps(_spawn(world, NAMES[(world, interpret)], folder, interpret)))
        return json.loads(done.read_text())

    return run


@pytest.mark.parametrize(("world", "name"), CASES)
def test_group(group_runs, world, name):
    """One case on a spawned gloo group of ``world`` CPU processes: every rank's result."""
    results = group_runs(world, name.endswith("interpret"))[name]
    failures = [f"rank {r}: {res}" for r, res in enumerate(results) if res != "ok"]
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the CUDA kernels on a NCCL group")
@pytest.mark.long  # (89 s on an H100: every case compiles in the spawned rank)
@pytest.mark.parametrize("world", [1, 2])
def test_groups_on_the_gpu(world, tmp_path):
    """The exactness cases (``workers.cases``; float32 ones in bfloat16) on a NCCL group of ``world`` ranks,
    one GPU each (TILEATTN_CP_DEVICE=cuda), against the oracle. One rank runs on any GPU: the kernels, the
    NCCL agreement and Ulysses's all-to-all of a group of one. The ring's transfers between ranks need a GPU
    per rank: NCCL refuses two ranks on one device, and gloo does not send or receive CUDA tensors (the
    package refuses CUDA tensors on a gloo group)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"{world} NCCL ranks need {world} GPUs (one rank per device), {torch.cuda.device_count()} here")
    names = [c.name for c in workers.cases(world)]
    results = _spawn(world, names, tmp_path, False, backend="nccl", env={"TILEATTN_CP_DEVICE": "cuda"})
    failures = [f"{name}, rank {r}: {res}" for name, got in results.items() for r, res in enumerate(got) if res != "ok"]
    assert not failures, "\n".join(failures)
