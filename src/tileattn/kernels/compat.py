"""What differs between the Triton versions tileattn runs on (the Tritons of PyTorch 2.10 to 2.15, 3.6 to
3.9), where a kernel cannot be written to work on all of them alike.

Triton's interpreter (``TRITON_INTERPRET=1``) holds a scalar as a one-element numpy array and, before
Triton 3.7, converts it to a Python int with ``int(array)``: numpy 2.4 refuses that (numpy 1.25 to 2.3
warn), so a loop ``for j in range(lo, hi, step)`` over tensor bounds, as every tileattn kernel has,
fails with "only 0-dimensional arrays can be converted to Python scalars" (triton-lang/triton#9171).
``patch_interpreter`` makes the conversion take the array's one element instead, as newer Tritons do,
for the interpreters that need it, so that users do not have to pin numpy.
"""

from __future__ import annotations

import operator
import types
import warnings

import numpy as np


def _index(self) -> int:
    """``tensor.__index__`` under the interpreter: the scalar's one element as a Python int."""
    return int(self.handle.data.item())


def _index_needs_patch(interpreter) -> bool:
    """Whether this interpreter's ``tensor.__index__`` refuses (or warns about) a one-element array: it is
    installed on a stand-in class, called on one, and taken away again."""
    probe = type("Probe", (), {})
    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(probe, scope)
    try:
        scalar = probe()
        scalar.handle = types.SimpleNamespace(data=np.array([3], dtype=np.int32))
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            return operator.index(scalar) != 3
    except (TypeError, DeprecationWarning):
        return True
    finally:
        scope.restore()


def patch_interpreter() -> bool:
    """Makes Triton's interpreter convert scalars (loop bounds, ``range`` arguments) to ints in a way that
    numpy 2.4 accepts, if this Triton does not already; returns whether it patched. Safe to call more
    than once. An interpreter whose internals differ from the ones known here is left as it is."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_tileattn_index", False):
        return False
    try:
        needed = _index_needs_patch(interpreter)
    except AttributeError:  # (another interpreter: nothing known to patch)
        return False
    if not needed:
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patch_lang_tensor._tileattn_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
