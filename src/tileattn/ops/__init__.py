"""The ``torch.library`` custom ops every public function runs through (fake impls for tracing,
autograd): ``tileattn::fwd`` / ``tileattn::bwd`` (``attention``), ``tileattn::fwd_kvcache`` and
``tileattn::fwd_paged_varlen`` (``kvcache``). Importing this package registers them. The ops call the
launchers of ``tileattn.kernels`` (imported on first use) or the PyTorch path of ``tileattn.cpu``, and
never import the API layer.
"""

from tileattn.ops import attention, kvcache

__all__ = ["attention", "kvcache"]
