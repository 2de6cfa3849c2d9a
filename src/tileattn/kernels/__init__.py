"""Triton kernels and their host launchers. Nothing here validates arguments: the API layer does."""
