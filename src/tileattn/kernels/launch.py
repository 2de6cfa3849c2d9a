"""Launching a Triton kernel with less host work per call.

``JITFunction.run`` binds and specialises every argument on every launch (a generated binder), derives
the compile-cache key and looks the build up: about 20 µs of host time for the decode kernel's 56
parameters on the development machine, more than the kernel itself runs at small decode sizes.
``Launcher`` does that once per *launch key* and then launches the build it got directly: through the
build's launcher (the C entry point on Triton 3.6 for builds without scratch memory), without the
launch-metadata object and hook arguments ``CompiledKernel[grid](*args)`` makes on every call (no hook
is set on that path).

The launch key holds everything the build depends on: each tensor argument's dtype and whether its
address is 16-byte aligned (the only tensor properties Triton specialises on), each int argument's
value (Triton specialises ints on their value: 1, multiples of 16, 64-bit range), bools as bools, the
type of each float argument (floats are not specialised), each host-side TMA descriptor's dtype, block
shape, shared layout and padding (a Gluon kernel's, ``kernels.gluon``: what Triton specialises it on),
the constexpr values, the launch options and the current CUDA device (builds are loaded per device). It
is a superset of Triton's specialisation key, so a hit launches the build Triton would have chosen.
Parameters marked ``do_not_specialize`` enter the key by type (ints by their range: 32-bit, 64-bit
signed or unsigned).

A hit skips what ``JITFunction.run`` does besides choosing the build: its pre-run hooks and
instrumentation mode (``Launcher`` falls back to ``JITFunction.run`` while either is set, and under the
interpreter, Triton's debug mode or a launch hook) and its check that the kernel's global variables
have not changed since it was compiled (tileattn's kernels read none). With the environment variable
``TILEATTN_VERIFY_LAUNCH=1`` set when this module is imported (the GPU tests set it) every hit is
checked against the build ``JITFunction.run`` selects.

``Launcher.bind`` also returns the build it launched as a ``Bound``: callers that know their next
launches have the same key (``kernels.decode`` plans its launches once per call signature) launch it
again without computing the key.
"""

from __future__ import annotations

import os

import torch
import triton
from triton import knobs
from triton.runtime import _allocation, driver
from triton.runtime.jit import JITFunction

from tileattn.params import interpreting, remember

# Checks every launch against Triton's own choice of build (read once, when this module is imported).
VERIFY = os.environ.get("TILEATTN_VERIFY_LAUNCH") == "1"
_MAX_PLANS = 4096  # builds remembered per kernel; beyond that the oldest go
_INT32 = range(-(2**31), 2**31)


def _descriptor_key(d) -> tuple:
    """What Triton specialises a host-side TMA descriptor on (Gluon's or ``triton.tools``'): its dtype, block
    shape, shared layout and padding; its shape and strides are launch arguments."""
    return (type(d), d.base.dtype, tuple(d.block_shape), getattr(d, "layout", None), d.padding)


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Builds that make TMA descriptors on the device take global scratch memory from Triton's allocator,
    which Triton keeps per context (a context variable: each thread and asyncio task has its own): one
    backed by PyTorch's caching allocator is installed in the current context unless one is set."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed: a function (before Triton 3.5) or a non-empty
    ``HookChain`` (an empty chain is the default since)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def plain_run_needed(fn) -> bool:
    """Whether launches of ``fn`` must go through ``JITFunction.run``: under the interpreter, in Triton's
    debug or instrumentation mode, or while a launch hook or one of ``fn``'s pre-run hooks is set."""
    return interpreting() or _hooks_set(fn)


def _hooks_set(fn) -> bool:
    """``plain_run_needed`` but for the interpreter (fixed once a kernel is defined)."""
    runtime = knobs.runtime
    return bool(
        runtime.debug
        or _hooked(runtime.launch_enter_hook)
        or _hooked(runtime.launch_exit_hook)
        or knobs.compilation.instrumentation_mode
        or getattr(fn, "pre_run_hooks", None)
    )


class Launcher:
    """``Launcher(kernel)(grid, args, constexprs, **options)`` launches ``kernel[grid](*args, **constexprs,
    **options)``, where ``args`` are the leading parameters in order and ``constexprs`` name all the
    others (a kernel with constexpr defaults left out is launched through ``JITFunction.run`` every time,
    which ``TILEATTN_VERIFY_LAUNCH=1`` refuses)."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self.plans: dict[tuple, tuple] = {}
        # (the interpreter's kernels have no params: they always take JITFunction.run's path)
        self.by_type = [i for i, p in enumerate(getattr(fn, "params", ())) if p.do_not_specialize]

    def _key(self, args: tuple, constexprs: dict, options: dict) -> tuple:
        tensor = torch.Tensor
        # ints by value, bools tagged (True == 1 as dict keys), floats by type, None as it is, Gluon's
        # TMA descriptors as Triton specialises them (dtype, block shape, shared layout, padding)
        key = [
            a  # (ints first: most arguments are, and their value is their key)
            if type(a) is int
            else (a.dtype, a.data_ptr() % 16 == 0)
            if isinstance(a, tensor)
            else float
            if type(a) is float
            else (bool, a)
            if type(a) is bool
            else _descriptor_key(a)
            if hasattr(a, "block_shape")
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
        self._launch(grid, args, constexprs, options)

    def bind(self, grid: tuple, args: tuple, constexprs: dict, **options) -> Bound | None:
        """Launches like ``__call__``; returns the build it launched bound to this grid, constexprs and
        options (None when the launch went through ``JITFunction.run``)."""
        launched = self._launch(grid, args, constexprs, options)
        if launched is None:
            return None
        grid, key, plan = launched
        return Bound(self, grid, key, plan[0], plan[1], constexprs, options)

    def _launch(self, grid: tuple, args: tuple, constexprs: dict, options: dict) -> tuple | None:
        """The launch: (grid, key, plan) of the build it launched, or None when it went through
        ``JITFunction.run``."""
        ensure_scratch_allocator()  # (a build may need scratch on either path)
        first = getattr(args[0], "base", args[0]) if args else None  # (a TMA descriptor's tensor)
        if plain_run_needed(self.fn) or not (isinstance(first, torch.Tensor) and first.is_cuda):
            self.fn[grid](*args, **constexprs, **options)
            return None
        grid = (*grid, 1, 1)[:3]
        key = self._key(args, constexprs, options)
        plan = self.plans.get(key)
        if plan is None:
            kernel = self.fn[grid](*args, **constexprs, **options)
            names = self.fn.arg_names[len(args) :]
            if kernel is None or set(names) != set(constexprs):  # not every parameter named: no plan
                if VERIFY and kernel is not None:  # (each later launch would pay JITFunction.run's host time)
                    raise AssertionError(
                        f"{self.fn.__name__}: parameters {sorted(set(names) - set(constexprs))} not named"
                    )
                return None
            tail = tuple(constexprs[name] for name in names)
            plan = remember(self.plans, key, (kernel, tail, _direct(kernel)), _MAX_PLANS)
        else:
            kernel, tail, direct = plan
            if VERIFY:
                self.verify(kernel, grid, args, constexprs, options)
            if direct is None:
                kernel[grid](*args, *tail)
            else:  # (no hook is set: plain_run_needed above)
                launch, head, (device, stream) = direct
                launch(*grid, stream(device()), *head, *args, *tail)
        return grid, key, plan

    def verify(self, kernel, grid: tuple, args: tuple, constexprs: dict, options: dict) -> None:
        chosen = self.fn.run(*args, grid=grid, warmup=True, **constexprs, **options)
        if chosen is not kernel:
            raise AssertionError(f"{self.fn.__name__}: the launch key chose another build than Triton")


# Triton versions whose CUDA launcher (``CudaLauncher``) is called here without its Python wrapper: its
# C ``launch(grid x, y, z, stream, function, cooperative, pdl, global scratch, profile scratch,
# packed metadata, launch metadata, enter hook, exit hook, *args)``, read from Triton 3.6's driver.
_C_LAUNCH_VERSIONS = ("3.6.",)


def _direct(kernel) -> tuple | None:
    """How to launch ``kernel`` (a ``CompiledKernel`` whose handles are loaded) without its runner's
    launch-metadata and hook calls, for use while no hook is set: ``(launch, head, (device, stream))``, called
    as ``launch(x, y, z, stream(device()), *head, *args)``. ``launch`` is the launcher's C entry point where
    that is known (Triton 3.6, builds without scratch memory), else its Python wrapper (which allocates the
    scratch); None for kernels that are not such a build."""
    if not all(hasattr(kernel, name) for name in ("run", "function", "packed_metadata")):
        return None
    active = driver.active
    stream = (active.get_current_device, active.get_current_stream)
    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    c_entry = all(
        hasattr(run, name)
        for name in ("launch", "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid")
    )
    if c_entry and triton.__version__.startswith(_C_LAUNCH_VERSIONS) and hasattr(run, "launch_pdl"):
        if not run.global_scratch_size and not run.profile_scratch_size:
            head = (function, run.launch_cooperative_grid, run.launch_pdl, None, None, metadata, None, None, None)
            return run.launch, head, stream
    # what CompiledKernel's runner passes, with no launch metadata and no hooks (none is set)
    return run, (function, metadata, None, None, None), stream


class Bound:
    """One build of a kernel at one grid: ``bound(args)`` launches it with leading arguments ``args``,
    which the caller guarantees to have the launch key it was bound with (the same dtypes, 16-byte
    alignments, int values, ... as the arguments of the launch that bound it). That skips the key as
    well: a launch is Triton's launcher call alone, without its launch-metadata and hook calls (made
    only while no hook is set; otherwise the launch goes through ``Launcher`` again). Builds that need
    no scratch memory are launched by the launcher's C entry point directly (Triton 3.6; others through
    its Python wrapper, which allocates the scratch, from the allocator ``ensure_scratch_allocator``
    installs in the calling context if it has none). With ``TILEATTN_VERIFY_LAUNCH=1`` every launch
    checks the key of ``args`` and Triton's own choice of build."""

    __slots__ = (
        "launcher",
        "grid",
        "key",
        "kernel",
        "tail",
        "constexprs",
        "options",
        "_launch",
        "_head",
        "_stream",
        "_scratch",
    )

    def __init__(self, launcher: Launcher, grid: tuple, key: tuple, kernel, tail: tuple, constexprs, options):
        self.launcher, self.grid, self.key, self.kernel, self.tail = launcher, grid, key, kernel, tail
        self.constexprs, self.options = constexprs, options
        self._scratch = bool(getattr(getattr(kernel, "metadata", None), "global_scratch_size", 0))
        direct = _direct(kernel)
        self._launch, self._head, self._stream = direct if direct is not None else (None, None, None)

    def __call__(self, args: tuple) -> None:
        if self._scratch:  # (this thread or task may not have launched the build before)
            ensure_scratch_allocator()
        if self._launch is None or _hooks_set(self.launcher.fn):  # (a bound kernel is not interpreted)
            self.launcher(self.grid, args, self.constexprs, **self.options)
            return
        if VERIFY:
            if self.launcher._key(args, self.constexprs, self.options) != self.key:
                raise AssertionError(f"{self.launcher.fn.__name__}: bound launch with arguments of another key")
            self.launcher.verify(self.kernel, self.grid, args, self.constexprs, self.options)
        device, stream = self._stream
        self._launch(*self.grid, stream(device()), *self._head, *args, *self.tail)


class Launch:
    """One launch of a plan: the kernel's grid, constexprs and the arguments after the leading ones fixed,
    the leading (tensor) arguments given per call, and a trailing part per call too where the kernel's last
    arguments vary (a dropout seed). The first call launches through the ``Launcher``; later calls launch
    the build that call bound (``Bound``), valid because a plan is only reused for calls whose arguments
    have the same dtypes, alignments and values (its key)."""

    __slots__ = ("launcher", "grid", "fixed", "constexprs", "options", "bound", "direct")

    def __init__(self, launcher: Launcher, grid: tuple, fixed: tuple, constexprs: dict, **options):
        self.launcher, self.grid, self.fixed = launcher, grid, fixed
        self.constexprs, self.options = constexprs, options
        self.bound = None
        self.direct = None

    def __call__(self, tensors: tuple, tail: tuple = ()) -> None:
        if self.direct is not None and not _hooks_set(self.launcher.fn):
            self.direct(tensors, tail)
        elif self.bound is not None:
            self.bound(tensors + self.fixed + tail)
        else:
            self.bound = self.launcher.bind(self.grid, tensors + self.fixed + tail, self.constexprs, **self.options)
            if self.bound is not None and not VERIFY:
                self.direct = _descriptor_launch(self.bound, len(tensors), len(self.fixed), self.fixed)


def _descriptor_launch(bound: Bound, heads: int, fixed_len: int, fixed: tuple):
    """A launch of ``bound``'s build with the fixed arguments as they are, for a Gluon build whose leading
    arguments hold host-side TMA descriptors: Triton 3.6's launcher takes each descriptor apart (its
    tensor map, shape and strides) in a Python loop over every argument on every launch; here only the
    leading arguments are looked at, the others passed through. None where that launcher is not found
    (another Triton, no descriptors, a descriptor past the leading arguments, scratch memory)."""
    launch = bound._launch
    code = getattr(launch, "__code__", None)
    if code is None or getattr(launch, "__name__", "") != "inner" or bound._scratch:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch.__closure__ or ())))
    c_launch, indices, metas = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
    expand = getattr(__import__(launch.__module__, fromlist=["make_tensordesc_arg"]), "make_tensordesc_arg", None)
    if c_launch is None or indices is None or expand is None or not metas or any(i >= heads for i in indices):
        return None
    meta = dict(zip(sorted(indices), metas))
    descs = tuple(meta.get(i) for i in range(heads))
    grid, head, tail_c = bound.grid, bound._head, bound.tail
    device, stream = bound._stream

    def direct(tensors: tuple, tail: tuple) -> None:
        args = []
        for a, m in zip(tensors, descs):
            if m is None:
                args.append(a)
            else:
                args.extend(expand(a, m))
        c_launch(*grid, stream(device()), *head, *args, *fixed, *tail, *tail_c)

    return direct
