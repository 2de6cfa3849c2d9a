"""Shared test helpers: running on a backend, random inputs, and comparing against the tests' oracle
(tests/oracle.py) with the one tolerance rule (tileattn.testing.check_close)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings

import oracle
from tileattn.api import cpu_backend
from tileattn.testing import check_close


def record_calls(monkeypatch, module, name: str) -> list:
    """Wraps ``module.name`` for the test: each call still runs it and appends its keyword arguments to the
    returned list (which build a dispatch picked, and how often)."""
    calls = []
    run = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(kw) or run(*a, **kw))
    return calls


def needs_gluon(what: str):
    """The skip mark of tests of a Gluon kernel (``kernels.gluon``): they need an sm90 GPU and the Triton
    its Gluon was written for (they do not run in the interpreter)."""
    from tileattn.kernels import gluon

    on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    return pytest.mark.skipif(not (on_sm90 and gluon.available()), reason=f"{what} needs an sm90 GPU and Triton 3.6")


def case_seed(case) -> int:
    """The seed of a test case's random inputs: the CRC-32 of its text, the same in every process (``hash``
    of a case that holds a ``torch.dtype`` changes from one process to the next)."""
    return zlib.crc32(repr(case).encode())


def gluon_case_inputs(case: tuple, count: int, device="cuda") -> tuple[torch.Tensor, ...]:
    """``count`` random tensors of a Gluon test case ``(batch, seqlen_q, seqlen_k, nheads, nheads_k,
    headdim, causal, dtype)``: q, k, v, then more shaped like q (dO), from a generator seeded by
    ``case_seed(case)``, which is printed (pytest shows it with a failure: the case replays from it)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, _, dtype = case
    print(f"inputs of {case!r}: seed {case_seed(case)} on {device}")
    g = torch.Generator(device=device).manual_seed(case_seed(case))
    shapes = [(batch, seqlen_q, nheads, headdim)] + [(batch, seqlen_k, nheads_k, headdim)] * 2
    shapes += [shapes[0]] * (count - 3)
    return tuple(torch.randn(shape, device=device, dtype=dtype, generator=g) for shape in shapes)


# The Gluon kernels' shared test cases (both kernels' head dims; test_gluon_forward.py adds head dim 256).
# Packed batches: query lengths, key lengths, nheads, nheads_k, headdim, causal, dtype.
GLUON_VARLEN_CASES = [
    ([37, 0, 1, 130, 300], [5, 9, 0, 200, 300], 4, 2, 128, True, torch.bfloat16),  # empty, one row, no key
    ([64, 129, 1000], [64, 129, 1000], 4, 1, 64, True, torch.float16),
    ([113, 1, 257], [1025, 63, 7], 8, 2, 64, False, torch.bfloat16),
    ([300, 63], [200, 500], 2, 2, 128, False, torch.float16),
]
# Sliding windows: batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, window_size, dtype.
GLUON_WINDOW_CASES = [
    (2, 1025, 1025, 4, 2, 128, (256, 0), torch.bfloat16),  # causal sliding window
    (1, 1000, 700, 4, 4, 64, (100, 50), torch.float16),  # both sides; the first 250 rows see no key
    (1, 300, 2000, 2, 1, 128, (-1, 17), torch.bfloat16),  # right side only
    (1, 513, 513, 2, 2, 64, (64, -1), torch.bfloat16),  # left side only
    (2, 63, 1025, 2, 2, 128, (0, 0), torch.float16),  # the diagonal alone: key blocks no row sees
]


def builds(
    backend: str, fwd: dict | None = None, dkdv: dict | None = None, dq: dict | None = None, gluon: dict | None = None
):
    """Context in which calls on ``backend`` launch the kernels with these KernelConfig fields changed in
    every table entry of its settings (``configs.with_builds``): the build variants the tables do not
    pick (tma, warp_spec, q_major, dq_atomic, exp2_poly)."""
    from tileattn.kernels import configs

    device = torch.device("cuda" if backend == "cuda" else "cpu")
    return configs.override(configs.with_builds(configs.current(device), fwd=fwd, dkdv=dkdv, dq=dq, gluon=gluon))


# The tables are tuned with the H200's Triton, 3.6. Where another Triton allocates registers differently,
# a compiled build's property may hold only there (Triton 3.9 spills 16 bytes in head dim 64's window forward).
TUNED_TRITON = importlib.metadata.version("triton").startswith("3.6.")


def compiled_sm90(cases: str) -> list[dict]:
    """The rows ``cases`` (lines of scripts/compile_report.py calls adding to ``rows``) print, compiled for
    sm_90a without a GPU in a fresh interpreter outside TRITON_INTERPRET (test_sm90_builds.py)."""
    script = "\n".join(
        [
            "import json, sys",
            f"sys.path.insert(0, {str(Path(__file__).parents[1] / 'scripts')!r})",
            "import compile_report",
            "compile_report._install()",
            "rows = []",
            cases,
            "print(json.dumps(rows))",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


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


EXAMPLES = Path(__file__).parents[1] / "examples"


def example(name: str):
    """The module of ``examples/<name>.py``, imported."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python examples/<name>.py *args`` in a child process, its output captured."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args], capture_output=True, text=True, timeout=600
    )


def check_refused(call, exc, words):
    """Calls ``call``, which must raise ``exc`` with a message that mentions every one of ``words``;
    returns the exception."""
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"message {message!r} does not mention {word!r}"
    return info.value


def randn(*shape, dtype, device, requires_grad=True):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)


def check_attention(name, out, grads, q, k, v, dout, ref_kwargs, check_grads=True, varlen=None, lowp_kwargs=None):
    """Checks ``out`` and ``grads = (dq, dk, dv)`` of an attention call on ``q, k, v`` (and ``dout``)
    with the tolerance rule: against ``oracle.attention`` in fp64 (on fp64 copies of the inputs, so its
    gradients are not rounded either), where the PyTorch error is the oracle's in the inputs' precision.
    ``ref_kwargs``: the call's keyword arguments (``dropout_mask`` with dropout); ``varlen``: for a packed
    call, ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_k)`` (``oracle.attention_varlen``); ``lowp_kwargs``:
    more arguments of the low-precision run (FP8's ``probs_dtype``).

    The gradients' floor also allows ``delta_rounding``: what the rounding of the stored ``out`` does to
    dq and dk through Δ = rowsum(dO ∘ O)."""

    def run(*qkv, **kwargs):
        if varlen is None:
            return oracle.attention(*qkv, **ref_kwargs, **kwargs)
        return oracle.attention_varlen(*qkv, *varlen, **ref_kwargs, **kwargs)

    exact = [t.detach().double().requires_grad_(check_grads) for t in (q, k, v)]
    plain = [t.detach().clone().requires_grad_(check_grads) for t in (q, k, v)]
    ref = run(*exact, lse_grad=check_grads)
    ref_lowp = run(*plain, precision=None, **(lowp_kwargs or {})).out
    check_close(f"{name} out", out, ref.out, ref_lowp)
    if not check_grads or not out.numel():
        return
    g_ref = torch.autograd.grad(
        ref.out, exact, dout.double(), allow_unused=True, materialize_grads=True, retain_graph=True
    )
    g_lowp = torch.autograd.grad(ref_lowp, plain, dout, allow_unused=True, materialize_grads=True)
    shift = [t.abs().max().item() if t.numel() else 0.0 for t in delta_rounding(out, ref, dout, exact)] + [0.0]
    scale = torch.stack([gr.abs().max() if gr.numel() else gr.new_zeros(()) for gr in g_ref])
    for gname, g, gr, gl, allowance in zip(("dq", "dk", "dv"), grads, g_ref, g_lowp, shift):
        check_close(f"{name} {gname}", g, gr, gl, floor_scale=scale, allowance=allowance)


def delta_rounding(out, ref, dout, exact) -> tuple[torch.Tensor, torch.Tensor]:
    """The change that the rounding of ``out`` makes to dq and dk of a FlashAttention backward (fp64).

    The backward reads the stored low-precision O: its Δ_i = rowsum(dO ∘ O)_i is off by
    δ_i = rowsum(dO ∘ (out - O_exact))_i, and dS_ij = P_ij (dP_ij - Δ_i) carries -P_ij δ_i. Since
    Σ_j P_ij ∂s_ij = ∂lse_i, dq and dk move by exactly -∂(Σ_i δ_i lse_i)/∂(q, k), and dv not at all; in a
    row that sees one key, where the exact dq is 0, this is all of its error. Computed on the oracle ``ref``
    (run with ``lse_grad=True``) over its fp64 inputs ``exact``; ``out`` is the call's output, which the
    tolerance rule has already accepted."""
    lse = ref.lse  # (batch, nheads, seqlen_q) or, packed, (nheads, total_q)
    delta = (dout.double() * (out.detach().double() - ref.out.detach())).sum(-1).transpose(-1, -2)
    weighted = torch.where(torch.isfinite(lse), lse, 0.0) * delta
    dq, dk = torch.autograd.grad(-weighted.sum(), exact[:2], allow_unused=True, materialize_grads=True)
    return dq, dk


def check_lse(name, lse, ref, ref_lowp, floor_scale=None):
    """Checks a softmax LSE (fp32) against the oracle's ``ref`` (fp64) with the tolerance rule, the PyTorch
    error being the oracle's LSE in the inputs' precision (``ref_lowp``): +inf exactly in the rows that
    see no key (``check_close`` matches non-finite entries exactly), the rule on the others (``floor_scale``
    as ``check_close``'s)."""
    check_close(name, lse, ref, ref_lowp, floor_scale=floor_scale)


# Tests marked ``slow`` (large shapes, exhaustive grids) run only with TILEATTN_SLOW=1 (tests/conftest.py)
SLOW = os.environ.get("TILEATTN_SLOW") == "1"
# Property tests: derandomized on the CPU path and the interpreter (CI is reproducible); on the GPU each
# test runs in shards spread over pytest-xdist workers, since every new feature combination compiles (5 s an
# example): by default 2 shards of a third of each test's GPU count (the suite's run in one device call),
# with TILEATTN_SLOW=1 4 shards of all of it. The GPU draws fresh examples each run (runs add up to more
# cases than one fixed sample: when every run drew the same, cutting the count lost cases for good); a
# test prints the seed that replays it, TILEATTN_HYPOTHESIS_SEED=N (the shard's seed is N + shard).
# TILEATTN_HYPOTHESIS_SHARDS / TILEATTN_HYPOTHESIS_EXAMPLES override the counts.
PROPERTY_SHARDS = (
    int(os.environ.get("TILEATTN_HYPOTHESIS_SHARDS", "4" if SLOW else "2")) if torch.cuda.is_available() else 1
)
_GPU_SHARE = 1 if SLOW else 3


def property_seed() -> int:
    """The GPU property tests' seed: TILEATTN_HYPOTHESIS_SEED, else a fresh one per test."""
    given_seed = os.environ.get("TILEATTN_HYPOTHESIS_SEED")
    return int(given_seed) if given_seed else int.from_bytes(os.urandom(4), "little") >> 1


def run_property(check, strategy, examples: dict, backend: str, shard: int) -> None:
    """Runs ``check(backend, example)`` over examples drawn from ``strategy``: ``examples[backend]`` of
    them (per shard on the GPU, fresh each run, printing the seed that replays them)."""
    gpu = backend == "cuda"
    n = int(os.environ.get("TILEATTN_HYPOTHESIS_EXAMPLES", examples[backend] // (_GPU_SHARE if gpu else 1)))
    if not gpu and shard:  # (derandomized: every shard would draw the same examples)
        pytest.skip("off the GPU one shard draws the examples")

    @settings(
        max_examples=n, deadline=None, derandomize=not gpu, suppress_health_check=list(HealthCheck), database=None
    )
    @given(strategy)
    def run(example):
        check(backend, example)

    if not gpu:
        run()
        return
    base = property_seed()  # (printed: pytest shows it with a failure)
    print(f"hypothesis seed {base + shard}: TILEATTN_HYPOTHESIS_SEED={base} replays this shard's examples")
    seed(base + shard)(run)()
