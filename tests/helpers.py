"""Shared test helpers: running on a backend, random inputs, and comparing against the reference
with the one tolerance rule (tileattn.testing.check_close)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings

from tileattn.api import cpu_backend
from tileattn.reference import attention_ref
from tileattn.testing import check_close


def builds(backend: str, fwd: dict | None = None, dkdv: dict | None = None, dq: dict | None = None):
    """Context in which calls on ``backend`` launch the kernels with these KernelConfig fields changed in
    every table entry of its settings (``configs.with_builds``): the build variants the tables do not
    pick (tma, warp_spec, q_major, dq_atomic)."""
    from tileattn.kernels import configs

    device = torch.device("cuda" if backend == "cuda" else "cpu")
    return configs.override(configs.with_builds(configs.current(device), fwd=fwd, dkdv=dkdv, dq=dq))


def record_launches(monkeypatch, *kernels: str) -> list[tuple[str, tuple, dict]]:
    """Records the launches of the named Triton kernels instead of running them (the launchers run as on
    a GPU, nothing is compiled or launched); returns the list that each launch appends ``(kernel name,
    grid, keyword arguments)`` to. Other kernels run as usual. (Triton's own launch entry point,
    ``run`` of the kernels' class, is what is replaced: tileattn itself is not patched.)"""
    from tileattn.kernels import backward, forward

    launches = []
    classes = {type(getattr(forward if hasattr(forward, name) else backward, name)) for name in kernels}
    for cls in classes:

        def run(self, *args, grid, warmup, original=cls.run, **kwargs):
            if self.__name__ in kernels:
                launches.append((self.__name__, grid, kwargs))
                return None
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    return launches


def interpreter_skips(backend: str, dtype: torch.dtype) -> None:
    """Triton's interpreter cannot multiply bfloat16 (tileattn routes it to the CPU path there)."""
    if backend == "interpret" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bfloat16 tl.dot on raw bits; bf16 kernels are tested on GPU")


def on(backend: str):
    """Context in which calls run on ``backend``; returns (context, device)."""
    if backend == "cuda":
        return contextlib.nullcontext(), "cuda"
    return cpu_backend("triton" if backend == "interpret" else "torch"), "cpu"


def randn(*shape, dtype, device, requires_grad=True):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)


def check_attention(name, out, grads, q, k, v, dout, ref_kwargs, check_grads=True):
    """Checks out and (dq, dk, dv) against attention_ref in fp64 with the tolerance rule, where the
    PyTorch error comes from attention_ref in the inputs' precision."""
    ref, _ = attention_ref(q, k, v, upcast=torch.float64, **ref_kwargs)
    ref_lowp, _ = attention_ref(q, k, v, upcast=False, **ref_kwargs)
    check_close(f"{name} out", out, ref, ref_lowp)
    if not check_grads:
        return
    g_ref = torch.autograd.grad(ref, (q, k, v), dout)
    g_lowp = torch.autograd.grad(ref_lowp, (q, k, v), dout)
    scale = torch.stack([gr.abs().max() for gr in g_ref])
    for gname, g, gr, gl in zip(("dq", "dk", "dv"), grads, g_ref, g_lowp):
        check_close(f"{name} {gname}", g, gr, gl, floor_scale=scale)


# Property tests: derandomized on the CPU path and the interpreter (CI is reproducible); on the GPU each
# test runs in shards of fresh examples, spread over pytest-xdist workers since every new feature
# combination compiles. TILEATTN_HYPOTHESIS_SHARDS / TILEATTN_HYPOTHESIS_EXAMPLES override the counts.
PROPERTY_SHARDS = int(os.environ.get("TILEATTN_HYPOTHESIS_SHARDS", "4")) if torch.cuda.is_available() else 1


def run_property(check, strategy, examples: dict, backend: str, shard: int) -> None:
    """Runs ``check(backend, example)`` over examples drawn from ``strategy``: ``examples[backend]`` of
    them (per shard on the GPU, each shard with its own seed)."""
    n = int(os.environ.get("TILEATTN_HYPOTHESIS_EXAMPLES", examples[backend]))
    gpu = backend == "cuda"

    @settings(
        max_examples=n, deadline=None, derandomize=not gpu, suppress_health_check=list(HealthCheck), database=None
    )
    @given(strategy)
    def run(example):
        check(backend, example)

    if gpu:
        run = seed(shard)(run)
    run()
