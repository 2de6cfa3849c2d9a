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


def patch_configs(monkeypatch, fwd: dict | None = None, dkdv: dict | None = None, dq: dict | None = None) -> None:
    """Makes the kernels launch with their table config changed by these KernelConfig fields (for
    variants that are off in the tables: tma, warp_spec, q_major)."""
    import dataclasses

    from tileattn.kernels import backward, forward

    for module, name, changes in (
        (forward, "fwd_config", fwd),
        (backward, "bwd_dkdv_config", dkdv),
        (backward, "bwd_dq_config", dq),
    ):
        if changes:
            original = getattr(module, name)
            monkeypatch.setattr(
                module, name, lambda p, *a, f=original, c=changes, **kw: dataclasses.replace(f(p, *a, **kw), **c)
            )


def record_launches(monkeypatch, *kernels: str) -> list[tuple[str, tuple, dict]]:
    """Replaces the named Triton kernels of tileattn.kernels' forward / backward modules with recorders
    (the launchers run as on a GPU, nothing is compiled or launched); returns the list that each launch
    appends ``(kernel name, grid, keyword arguments)`` to."""
    from tileattn.kernels import backward, configs, forward

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid, kwargs))

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    for name in kernels:
        module = forward if hasattr(forward, name) else backward
        monkeypatch.setattr(module, name, Recorder(name))
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
