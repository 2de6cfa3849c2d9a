"""Seeds every test and, on machines without a GPU, turns on Triton's interpreter before anything
imports triton, so that the kernels themselves run on CPU tensors."""

import gc
import importlib.util
import os
import sys
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # every launch through tileattn.kernels.launch is checked against the build Triton selects
    os.environ.setdefault("TILEATTN_VERIFY_LAUNCH", "1")

import pytest  # noqa: E402

# pytest-xdist's workers share the machine's cores: each takes its share of torch's threads (and so do the
# processes they start, through OMP_NUM_THREADS), rather than every worker taking all of them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _THREADS = max(1, _CORES // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(min(torch.get_num_threads(), _THREADS))

from cover import covering_sample  # noqa: E402
from helpers import SLOW  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# Where the attention runs: "cuda" (the kernels on the GPU), "torch" (the CPU path) and
# "interpret" (the kernels under Triton's interpreter, on CPU tensors). The CPU path runs on every
# machine, the GPU's included.
BACKENDS = ["cuda", "torch"] if HAS_CUDA else ["torch", "interpret"]


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    if SLOW:
        return
    skip = pytest.mark.skip(reason="marked slow (large shapes, an exhaustive grid): TILEATTN_SLOW=1 runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
    if HAS_CUDA:
        _sample_gpu_grids(items)
        _longest_first(items)


def _shard(config, items) -> None:
    """``TILEATTN_SHARD=i/n`` (0 <= i < n): only the items whose node id hashes to i of n (crc32), so that the
    suite can run as n device calls, each within the call's time limit; the n shards together run every item
    once. The same on every xdist worker (their collections must agree)."""
    spec = os.environ.get("TILEATTN_SHARD")
    if not spec:
        return
    parts = spec.split("/")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or not int(parts[0]) < int(parts[1]):
        raise pytest.UsageError(f"TILEATTN_SHARD must be i/n with 0 <= i < n, got {spec!r}")
    shard, shards = int(parts[0]), int(parts[1])
    keep, drop = [], []
    for item in items:
        (keep if zlib.crc32(item.nodeid.encode()) % shards == shard else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _longest_first(items) -> None:
    """On the GPU, the items that take minutes start first, spread over pytest-xdist's workers, so that none of them
    starts last and runs on alone, and no worker gets them all: the property tests' shards (each new feature
    combination compiles: 30-180 s a shard on an H100), the tests marked ``long`` and the Gluon kernels' tests
    (large shapes, 10-40 s a case). Work stealing (``pytest_xdist_make_scheduler`` below) first hands each worker
    one contiguous block of the items in order, ``len(left) // workers_left`` of them in turn; each block here
    starts with its share of the long items (dealt in turn), the others keep their order. (Load scheduling, xdist's
    default, handed its first blocks of ~100 items the same way: one worker drew every shard and then every Gluon
    test, 11 items in 550 s, while the others ran out of work.)"""

    def rank(item) -> int:
        if "shard" in getattr(getattr(item, "callspec", None), "params", {}) and _runs_on_gpu(item):
            return 0
        if item.get_closest_marker("long") is not None:
            return 0
        return 1 if "gluon" in item.nodeid.split("::")[0] else 2

    ranked = sorted(items, key=rank)  # (stable)
    long, rest = [i for i in ranked if rank(i) < 2], [i for i in ranked if rank(i) == 2]
    blocks, left, start, out = [long[w::_WORKERS] for w in range(_WORKERS)], len(items), 0, []
    for w, block in enumerate(blocks):
        size = left // (_WORKERS - w)
        take = max(size - len(block), 0)
        out += block + rest[start : start + take]
        start, left = start + take, left - size
    items[:] = out + rest[start:]


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        """Work stealing for ``-n N`` (``--dist load``, the default there): a worker that runs out of items
        takes half of the longest queue, where load scheduling left the rest of a worker's first block to
        it alone."""
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log) if config.getoption("dist") == "load" else None


_TIMES = os.environ.get("TILEATTN_TEST_TIMES")
if _TIMES and "PYTEST_XDIST_WORKER" not in os.environ:

    def pytest_runtest_logreport(report):
        """``TILEATTN_TEST_TIMES=FILE``: each test phase's duration, outcome and worker appended to FILE as
        it ends, a failure's report to FILE.failures (a run stopped at a time limit still says what took the
        time and what failed)."""
        worker = getattr(getattr(report, "node", None), "gateway", None)
        with open(_TIMES, "a") as out:
            out.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{getattr(worker, 'id', '-')}\t"
                      f"{report.nodeid}\n")  # fmt: skip
        if report.failed:  # its traceback and output too, in FILE.failures (pytest prints them only at the end)
            with open(f"{_TIMES}.failures", "a") as out:
                sections = "".join(f"--- {title}\n{text}\n" for title, text in report.sections)
                out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n{sections}\n")


def _runs_on_gpu(item) -> bool:
    params = getattr(item, "callspec", None)
    return params is None or params.params.get("backend", "cuda") == "cuda"


def _sample_gpu_grids(items) -> None:
    """The GPU items of each test marked ``gpu_cover`` (tests/cover.py) outside its covering sample are
    skipped, saying so; the items its ``valid`` refuses (which skip themselves) take no part in it."""
    grids: dict = {}
    for item in items:
        mark = item.get_closest_marker("gpu_cover")
        if mark is None or not hasattr(item, "callspec") or not _runs_on_gpu(item):
            continue
        params = {k: v for k, v in item.callspec.params.items() if k != "backend"}
        valid = mark.kwargs.get("valid")
        if valid is None or valid(**params):
            grids.setdefault(item.function, (mark.kwargs.get("strength", 2), []))[1].append((item, params))
    for strength, members in grids.values():
        names = sorted(members[0][1])
        rows = [tuple(repr(params[n]) for n in names) for _, params in members]
        kept = covering_sample(rows, strength)
        reason = (
            f"outside this grid's {strength}-wise covering sample on the GPU ({len(kept)} of {len(rows)}; "
            "tests/cover.py); CPU CI runs the whole grid under the interpreter (bf16 and GPU-only builds aside), "
            "TILEATTN_SLOW=1 runs it here"
        )
        for i, (item, _) in enumerate(members):
            if i not in kept:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory):
    """A folder of this test session that every pytest-xdist worker sees (the session's base folder's
    parent under xdist; the base folder itself without it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture
def big_gpu_memory(shared_tmp):
    """For tests that hold tens of GiB on the GPU (tensors past 2**31 elements, fp64 references at scale):
    one at a time across pytest-xdist's workers, which share the GPU (several at once can run it out of
    memory), and their memory handed back to the device afterwards. Without a GPU, nothing."""
    if not HAS_CUDA:
        yield
        return
    from filelock import FileLock

    with FileLock(shared_tmp / "big_gpu_memory.lock"):
        yield
        # a failed test's traceback (kept for post-mortem debugging) holds its frames' tensors
        sys.last_type = sys.last_value = sys.last_traceback = None
        if hasattr(sys, "last_exc"):
            sys.last_exc = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
