"""Seeds every test and, on machines without a GPU, turns on Triton's interpreter before anything
imports triton, so that the kernels themselves run on CPU tensors."""

import gc
import os
import sys

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

from helpers import SLOW  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# Where the attention runs: "cuda" (the kernels on the GPU), "torch" (the CPU path) and
# "interpret" (the kernels under Triton's interpreter, on CPU tensors). The CPU path runs on every
# machine, the GPU's included.
BACKENDS = ["cuda", "torch"] if HAS_CUDA else ["torch", "interpret"]


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    skip = pytest.mark.skip(reason="marked slow (large shapes, an exhaustive grid): TILEATTN_SLOW=1 runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
