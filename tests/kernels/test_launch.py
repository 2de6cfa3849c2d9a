"""kernels/launch.py: the launch key against Triton's own specialisation, the direct launch path that
skips JITFunction.run, and the scratch allocator a bound launch installs in each context."""

import pytest
import torch

F16 = torch.float16


def test_launch_key_covers_what_triton_specialises():
    """kernels.launch.Launcher's key: wherever Triton's own specialisation of an argument differs
    (native_specialize_impl, what JITFunction.run's binder calls), the keys differ; tensors enter by
    dtype and 16-byte alignment (not by address or subclass), floats by type, do_not_specialize
    parameters by type and int range; constexprs and options are part of the key."""
    from types import SimpleNamespace

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from tileattn.kernels.launch import Launcher

    def launcher(by_type):  # seed marked do_not_specialize, or no parameter marked (the two key paths)
        params = [SimpleNamespace(do_not_specialize=by_type and name == "seed") for name in ("X", "n", "scale", "seed")]
        return Launcher(SimpleNamespace(params=params, arg_names=["X", "n", "scale", "seed", "BLOCK"]))

    plain, marked = launcher(False), launcher(True)

    def key(x, n=64, scale=0.5, seed=7, block=16, warps=4, on=marked):
        return on._key((x, n, scale, seed), {"BLOCK": block}, {"num_warps": warps})

    a, b = torch.zeros(64, dtype=F16), torch.ones(64, dtype=F16)
    for which in (plain, marked):
        assert key(a, on=which) == key(b, on=which) == key(a, scale=2.0, on=which)
        assert key(torch.nn.Parameter(a), on=which) == key(a, on=which)
        assert key(a[1:], on=which) != key(a, on=which)  # 2 bytes off: not 16-byte aligned
        assert key(a[8:], on=which) == key(a, on=which)  # 16 bytes off: aligned
        assert key(a.float(), on=which) != key(a, on=which)
        assert key(a, block=32, on=which) != key(a, on=which) != key(a, warps=8, on=which)
    assert key(a) == key(a, seed=8)

    def triton_spec(value, specialize=True):
        return native_specialize_impl(BaseBackend, value, False, specialize, True)

    values = [0, 1, 2, 16, 17, 2**31, 2**40, 2**63, -1, True, False, 0.5, 1.0, None]
    for u in values:
        for w in values:
            if triton_spec(u) != triton_spec(w):
                assert key(a, n=u) != key(a, n=w), (u, w)
                assert key(a, n=u, on=plain) != key(a, n=w, on=plain), (u, w)
                assert key(a, seed=u, on=plain) != key(a, seed=w, on=plain), (u, w)
            if triton_spec(u, False) != triton_spec(w, False):
                assert key(a, seed=u) != key(a, seed=w), (u, w)


def test_launch_key_covers_what_triton_specialises_of_a_tma_descriptor():
    """Gluon's host-side TMA descriptors (with the Triton the Gluon kernels are written for) enter the key
    as Triton specialises them: by dtype, block shape and shared layout, not by their tensor's shape,
    strides or address."""
    import pytest
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from tileattn.kernels import gluon as kernels_gluon
    from tileattn.kernels.launch import _descriptor_key

    if not kernels_gluon.available():
        pytest.skip("the Gluon kernels' Triton only")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia import hopper as gluon

    def desc(rows, cols, block, dtype=torch.bfloat16):
        t = torch.zeros(rows, cols, dtype=dtype)
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
        return gluon.TensorDescriptor.from_tensor(t, block, layout)

    variants = [desc(256, 2048, [64, 128]), desc(250, 2056, [64, 128]), desc(256, 2048, [128, 128]),
                desc(256, 2048, [64, 64]), desc(256, 2048, [64, 128], torch.float16)]  # fmt: skip
    for u in variants:
        hash(_descriptor_key(u))
        for w in variants:
            same_spec = native_specialize_impl(BaseBackend, u, False, True, True) == native_specialize_impl(
                BaseBackend, w, False, True, True
            )
            assert (_descriptor_key(u) == _descriptor_key(w)) == same_spec


def test_launches_take_the_direct_path_by_default(monkeypatch):
    """Outside the interpreter and without Triton hooks, debug or instrumentation, launches skip
    JITFunction.run (Triton 3.6's launch hooks are empty HookChains by default, not None)."""
    from types import SimpleNamespace

    from triton import knobs

    from tileattn.kernels import launch

    # (plain_run_needed is also true under the interpreter, which runs these tests on CPU: ask the rest)
    fn = SimpleNamespace(pre_run_hooks=[])
    assert not launch._hooks_set(fn)
    fn.pre_run_hooks.append(print)
    assert launch._hooks_set(fn)
    fn.pre_run_hooks.clear()
    for knob, name, value in ((knobs.runtime, "debug", True), (knobs.compilation, "instrumentation_mode", "x")):
        with monkeypatch.context() as patch:
            patch.setattr(knob, name, value)
            assert launch._hooks_set(fn), name
    assert not launch._hooks_set(fn)
    hook = lambda *args: None  # noqa: E731
    if hasattr(knobs.runtime.launch_enter_hook, "add"):
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert launch._hooks_set(fn)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        assert launch._hooks_set(fn)


def test_bound_launches_install_the_scratch_allocator_in_each_context():
    """Triton keeps its scratch allocator per context (thread, asyncio task). A planned launch of a build
    that needs scratch (TMA descriptors made on the device) installs one in the context it runs in, also
    when the plan was made in another."""
    import contextvars
    import threading
    from types import SimpleNamespace

    from triton.runtime import _allocation

    from tileattn.kernels import launch

    class Recorder:
        fn = SimpleNamespace(pre_run_hooks=[])
        calls = []

        def __call__(self, grid, args, constexprs, **options):
            self.calls.append(isinstance(_allocation._allocator.get(), _allocation.NullAllocator))

    def bound(scratch):
        kernel = SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=scratch))  # (no C entry point)
        return launch.Bound(Recorder(), (1, 1, 1), (), kernel, (), {}, {})

    def fresh(fn):
        ctx = contextvars.copy_context()
        ctx.run(_allocation._allocator.set, _allocation.NullAllocator())
        ctx.run(fn)

    fresh(lambda: bound(0)(()))
    fresh(lambda: bound(128)(()))
    thread = threading.Thread(target=bound(128), args=((),))
    thread.start()
    thread.join()
    assert Recorder.calls == [True, False, False]


def test_planned_launches_pass_the_launcher_what_its_python_wrapper_would(monkeypatch):
    """A planned launch calls the build's launcher without CompiledKernel's runner: on Triton 3.6 its C entry
    point, with the arguments the launcher's Python wrapper passes it (no launch metadata, no hooks), and the
    wrapper itself where the build needs scratch memory or the C signature is not known."""
    from types import SimpleNamespace

    import triton

    from tileattn.kernels import launch

    nvidia = pytest.importorskip("triton.backends.nvidia.driver")
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 0)
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=active))  # (no CUDA driver here)
    calls = []
    for scratch in (0, 64):
        run = object.__new__(nvidia.CudaLauncher)  # (attributes set by hand: no CUDA on the test machine)
        attrs = dict(launch_cooperative_grid=False, launch_pdl=True, global_scratch_size=scratch)
        attrs.update(profile_scratch_size=0, global_scratch_align=128, num_ctas=1, profile_scratch_align=1)
        for name, value in attrs.items():
            setattr(run, name, value)
        run.launch = lambda *a: calls.append(a)
        kernel = SimpleNamespace(run=run, function=7, packed_metadata=("meta",))
        fn, head, _ = launch._direct(kernel)
        args = (torch.empty(1), 3, 1.5)
        if triton.__version__.startswith(launch._C_LAUNCH_VERSIONS) and not scratch:
            assert fn is run.launch
            fn(2, 1, 1, 0, *head, *args)
            run(2, 1, 1, 0, 7, ("meta",), None, None, None, *args)
            assert calls[-2] == calls[-1]
        else:
            assert fn is run and head == (7, ("meta",), None, None, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the launchers' C entry points run on the GPU")
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_planned_launches_without_verification(headdim, monkeypatch):
    """The planned calls' launches as they run outside the tests (``TILEATTN_VERIFY_LAUNCH`` unset): a Gluon
    build's descriptors taken apart by ``launch._descriptor_launch`` and the others by the bound build; the
    first call binds, the later ones launch directly. Every call's output and gradients against the oracle."""
    import tileattn
    from helpers import check_attention
    from tileattn.kernels import launch

    monkeypatch.setattr(launch, "VERIFY", False)
    monkeypatch.setattr(tileattn.api, "calls", {})  # (new calls: their plans bind with VERIFY off)
    q, k, v = (torch.randn(2, 300, 4, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    dout = torch.randn_like(q)
    for _ in range(3):
        out = tileattn.flash_attn_func(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        check_attention(f"hd{headdim}", out, grads, q, k, v, dout, {"causal": True})
