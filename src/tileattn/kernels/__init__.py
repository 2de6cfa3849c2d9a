"""Triton kernels and their host launchers. Nothing here validates arguments: the API layer does."""

from tileattn.params import interpreting

if interpreting():  # loop bounds under older interpreters with numpy 2.4 (kernels.compat), for every kernel module
    from tileattn.kernels import compat

    compat.patch_interpreter()
