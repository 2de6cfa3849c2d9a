"""Launching a Triton kernel with less host work per call.

``JITFunction.run`` binds and specialises every argument on every launch (a generated binder), derives
the compile-cache key and looks the build up: about 20 µs of host time for the decode kernel's 56
parameters on the development machine, more than the kernel itself runs at small decode sizes.
``Launcher`` does that once per *launch key* and then launches the build it got directly
(``CompiledKernel[grid](*args)``, Triton's own launch entry point for a compiled build).

The launch key holds everything the build depends on: each tensor argument's dtype and whether its
address is 16-byte aligned (the only tensor properties Triton specialises on), each int argument's
value (Triton specialises ints on their value: 1, multiples of 16, 64-bit range), bools as bools, the
type of each float argument (floats are not specialised), the constexpr values, the launch options and
the current CUDA device (builds are loaded per device). It is a superset of Triton's specialisation
key, so a hit launches the build Triton would have chosen. Parameters marked ``do_not_specialize``
enter the key by type (ints by their range: 32-bit, 64-bit signed or unsigned).

A hit skips what ``JITFunction.run`` does besides choosing the build: its pre-run hooks and
instrumentation mode (``Launcher`` falls back to ``JITFunction.run`` while either is set, and under the
interpreter, Triton's debug mode or a launch hook) and its check that the kernel's global variables
have not changed since it was compiled (tileattn's kernels read none). With the environment variable
``TILEATTN_VERIFY_LAUNCH=1`` (the GPU tests set it) every hit is checked against the build
``JITFunction.run`` selects.
"""

from __future__ import annotations

import os

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from tileattn.kernels.configs import interpreting

_MAX_PLANS = 4096  # builds remembered per kernel; beyond that the table starts over
_INT32 = range(-(2**31), 2**31)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed: a function (before Triton 3.5) or a non-empty
    ``HookChain`` (an empty chain is the default since)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def plain_run_needed(fn) -> bool:
    """Whether launches of ``fn`` must go through ``JITFunction.run``: under the interpreter, in Triton's
    debug or instrumentation mode, or while a launch hook or one of ``fn``'s pre-run hooks is set."""
    return bool(
        interpreting()
        or knobs.runtime.debug
        or _hooked(knobs.runtime.launch_enter_hook)
        or _hooked(knobs.runtime.launch_exit_hook)
        or knobs.compilation.instrumentation_mode
        or getattr(fn, "pre_run_hooks", None)
    )


class Launcher:
    """``Launcher(kernel)(grid, args, constexprs, **options)`` launches ``kernel[grid](*args, **constexprs,
    **options)``, where ``args`` are the leading parameters in order and ``constexprs`` name all the
    others (a kernel with constexpr defaults left out is launched through ``JITFunction.run`` every time)."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self.plans: dict[tuple, tuple] = {}
        # (the interpreter's kernels have no params: they always take JITFunction.run's path)
        self.by_type = [i for i, p in enumerate(getattr(fn, "params", ())) if p.do_not_specialize]

    def _key(self, args: tuple, constexprs: dict, options: dict) -> tuple:
        tensor = torch.Tensor
        # ints by value, bools tagged (True == 1 as dict keys), floats by type, None as it is
        key = [
            (a.dtype, a.data_ptr() % 16 == 0)
            if isinstance(a, tensor)
            else float
            if type(a) is float
            else (bool, a)
            if type(a) is bool
            else a
            for a in args
        ]
        for i in self.by_type:  # do_not_specialize: by type, ints by range (Triton's i32 / i64 / u64)
            if i < len(args):
                a = args[i]
                key[i] = (int, a in _INT32, a >= 2**63) if type(a) is int else type(a)
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        return (device, tuple(key), tuple(constexprs.items()), tuple(options.items()))

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, **options) -> None:
        if plain_run_needed(self.fn) or not (args and isinstance(args[0], torch.Tensor) and args[0].is_cuda):
            self.fn[grid](*args, **constexprs, **options)
            return
        grid = (*grid, 1, 1)[:3]
        key = self._key(args, constexprs, options)
        plan = self.plans.get(key)
        if plan is None:
            kernel = self.fn[grid](*args, **constexprs, **options)
            names = self.fn.arg_names[len(args) :]
            if kernel is None or set(names) != set(constexprs):  # not every parameter named: no plan
                return
            if len(self.plans) >= _MAX_PLANS:
                self.plans.clear()
            self.plans[key] = (kernel, tuple(constexprs[name] for name in names))
            return
        kernel, tail = plan
        if os.environ.get("TILEATTN_VERIFY_LAUNCH") == "1":
            chosen = self.fn.run(*args, grid=grid, warmup=True, **constexprs, **options)
            if chosen is not kernel:
                raise AssertionError(f"{self.fn.__name__}: the launch key chose another build than Triton")
        kernel[grid](*args, *tail)
