"""Kernels written in Gluon (``triton.experimental.gluon``) for Hopper GPUs.

Gluon's API changes between Triton releases: these kernels are built and measured against Triton 3.6,
and ``available`` keeps every other Triton on the portable kernels. Gluon kernels do not run in Triton's
interpreter, so they are tested on the GPU only (tests/kernels/test_gluon_*.py; their sm90 builds are
compiled without a GPU in tests/kernels/test_sm90_builds.py).
"""

from __future__ import annotations

import functools

TESTED_TRITON = ("3.6",)


@functools.cache
def available() -> bool:
    """Whether this Triton has the Gluon API the kernels here are written for."""
    import triton

    if not triton.__version__.startswith(TESTED_TRITON):
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True
