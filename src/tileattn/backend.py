"""Where a call runs: CUDA tensors take the Triton launchers (``tileattn.kernels``, imported on first
use, so ``import tileattn`` works where Triton does not install); CPU tensors take the blockwise PyTorch
path (``tileattn.cpu``), or the kernels under Triton's interpreter when ``TRITON_INTERPRET=1`` is set.
Also the device guard the launches run under and the test for the ops' direct (eager) path.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import torch

from tileattn import cpu
from tileattn.params import interpreting

# None: CPU tensors take the Triton interpreter when TRITON_INTERPRET=1 is set, else the PyTorch path.
_CPU_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("tileattn_cpu_backend", default=None)


@contextlib.contextmanager
def cpu_backend(name: str) -> Iterator[None]:
    """Forces the implementation used for CPU tensors inside the block: ``"torch"`` (the blockwise
    PyTorch path) or ``"triton"`` (the kernels under Triton's interpreter, float16 only; needs
    TRITON_INTERPRET=1)."""
    if name not in ("torch", "triton"):
        raise ValueError(f"cpu_backend: name must be 'torch' or 'triton', got {name!r}")
    if name == "triton" and not interpreting():
        raise RuntimeError("cpu_backend('triton') needs TRITON_INTERPRET=1 set before triton is imported")
    token = _CPU_BACKEND.set(name)
    try:
        yield
    finally:
        _CPU_BACKEND.reset(token)


def implementation(q: torch.Tensor) -> ModuleType | SimpleNamespace:
    """The module whose ``attn_fwd`` / ``attn_bwd`` run this call.

    Under the interpreter only float16 and FP8 take the kernels: Triton 3.6's interpreter multiplies
    bfloat16 ``tl.dot`` operands as raw 16-bit integers, so bfloat16 CPU tensors stay on the PyTorch path."""
    if not q.is_cuda:
        chosen = _CPU_BACKEND.get()
        wants_triton = chosen == "triton" or (chosen is None and interpreting())
        if not (wants_triton and q.dtype in (torch.float16, torch.float8_e4m3fn)):
            return cpu
    return _triton_implementation()


@functools.cache
def _triton_implementation() -> SimpleNamespace:
    """The Triton launchers behind the same interface as ``tileattn.cpu``, imported on first use."""
    from tileattn.kernels import backward, decode, forward  # (Triton loads here, on first use)
    from tileattn.kernels.decode import mla

    return SimpleNamespace(
        attn_fwd=forward.attn_fwd,
        attn_bwd=backward.attn_bwd,
        attn_fwd_kvcache=decode.attn_fwd_kvcache,
        kvcache_append=decode.kvcache_append,
        mla_fwd=mla.mla_fwd,
    )


class _DeviceGuard:
    """``torch.cuda.device(index)`` without its argument parsing (on every call of the API)."""

    __slots__ = ("index", "previous")

    def __init__(self, index: int):
        self.index = index

    def __enter__(self) -> None:
        self.previous = torch.cuda._exchange_device(self.index)

    def __exit__(self, *exc) -> bool:
        torch.cuda._maybe_exchange_device(self.previous)
        return False


_NO_GUARD = contextlib.nullcontext()
_GUARD = _DeviceGuard if hasattr(torch.cuda, "_maybe_exchange_device") else torch.cuda.device


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device and its current stream: make the tensors' device
    current (its current stream is the caller's), so inputs on ``cuda:1`` never run on ``cuda:0``."""
    return _GUARD(t.device.index) if t.is_cuda else _NO_GUARD


def direct(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may run its custom op's implementation directly, skipping the dispatcher: not
    while torch.compile / export / torch.jit trace, not under a dispatch or function mode (fake tensors, flop
    counters, ...), and only for plain tensors (not subclasses)."""
    if (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
    ):
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


def nothing_to_attend(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No query rows, or no keys at all: every output row is 0 (LSE +inf) and every gradient 0."""
    return q.numel() == 0 or k.shape[-3] == 0


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (no host reads then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
