"""Host cost of Triton's argument binding and cache-key lookup for the training kernels, without a GPU:
the binder Triton generates for a kernel's signature (what ``JITFunction.run`` calls on every launch)
is built for an sm90 target and run on representative arguments (CPU tensors stand in for the pointers).

    python scripts/binder_cost.py
"""

import time

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

from tileattn.kernels import backward, forward

FLAGS = ("HAS", "MASK", "IS_", "USE", "WARP", "Q_MAJOR")


def representative_args(kernel):
    args = []
    for p in kernel.params:
        if p.is_constexpr:
            args.append(True if p.name.startswith(FLAGS) else 64)
        elif p.name[0].isupper():
            args.append(torch.empty(16, dtype=torch.bfloat16))
        elif "scale" in p.name or p.name in ("softcap", "dropout_p"):
            args.append(0.125)
        else:
            args.append(4096)
    return args


def main():
    backend = make_backend(GPUTarget("cuda", 90, 32))
    options = dict(num_warps=8, num_stages=3, debug=False, instrumentation_mode="")
    for kernel in (forward._attn_fwd, backward._attn_bwd_dkdv, backward._attn_bwd_dq):
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        args = representative_args(kernel)
        key_cache = {}
        for _ in range(100):
            _, spec, opts = binder(*args, **options)
            compute_cache_key(key_cache, spec, opts)
        n = 5000
        t0 = time.perf_counter()
        for _ in range(n):
            _, spec, opts = binder(*args, **options)
            compute_cache_key(key_cache, spec, opts)
        us = (time.perf_counter() - t0) / n * 1e6
        print(f"{kernel.fn.__name__}: {len(kernel.params)} parameters, binder + cache key {us:.1f} us per launch")


if __name__ == "__main__":
    main()
