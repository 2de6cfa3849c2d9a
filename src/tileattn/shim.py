"""Run code written for ``flash_attn`` on tileattn without changing it (opt-in).

``install()`` registers an import finder and a metadata finder (nothing is written to disk), so that

- ``flash_attn``, ``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``,
  ``flash_attn.layers.rotary``, ``flash_attn.ops.triton.rotary``, ``flash_attn.modules.mha`` and
  ``flash_attn.utils.generation`` (``InferenceParams``) import lazily, by name, as modules served by
  tileattn's ``interface`` (or ``api`` + ``kvcache``), ``bert_padding``, ``rotary`` and ``modules``; each
  has a ``__spec__``, so ``importlib.util.find_spec("flash_attn")`` answers before and after the import
  (``flash_attn.ops.triton.rotary.rotary_kernel`` is tileattn's Triton rotary kernel, ``ALIASES``);
- a distribution ``flash_attn`` version ``2.8.3`` (the API tileattn follows) is visible to
  ``importlib.metadata`` (``version("flash_attn")``, ``version("flash-attn")``, ``distribution``,
  ``packages_distributions()``), which is how Hugging Face transformers decides that
  ``attn_implementation="flash_attention_2"`` is available;
- every other ``flash_attn.*`` module (``losses``, ``models``, ``ops.layer_norm``, ``ops.rms_norm``,
  ``ops.fused_dense``, ``ops.triton.layer_norm``, ...) is absent: ``importlib.util.find_spec`` returns
  None for it, and importing it raises ``ModuleNotFoundError`` (an ``ImportError``) saying that tileattn
  covers attention only, so ``try: import ... except ImportError:`` fallbacks take their other branch.
  (``from flash_attn.ops import rms_norm`` gets Python's own "cannot import name" ImportError.)

Two ways in::

    import tileattn.shim; tileattn.shim.install()      # before the code imports flash_attn
    python -m tileattn.shim train.py --args ...        # run a script with the shim installed

The shim takes precedence over a real ``flash_attn`` installed beside it, but refuses to replace one that
is already imported (``install(force=True)`` drops it from ``sys.modules``). ``flash_attn.__version__``
is ``"2.8.3"``; tileattn's own version is ``flash_attn.__tileattn_version__``. transformers caches its
availability checks: ``install()`` and ``uninstall()`` clear those caches when transformers is imported.
Processes started by the program (spawned workers) import the real package unless they install the
shim too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import runpy
import sys
import types
from pathlib import Path

import tileattn

API_VERSION = "2.8.3"
DIST_NAME = "flash_attn"

# The names ``flash_attn/__init__.py`` exports.
FUNCTIONS = (
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
)


# Each served flash_attn module: the tileattn modules whose names it serves (the first that has a name
# wins) and the names it serves (None: every name of those modules). A module with no sources is a
# package holding only its submodules.
SERVED: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None]] = {
    "flash_attn": (("flash_attn.flash_attn_interface",), FUNCTIONS),
    "flash_attn.flash_attn_interface": (("tileattn.interface",), None),
    "flash_attn.bert_padding": (("tileattn.bert_padding",), None),
    "flash_attn.layers": ((), ()),
    "flash_attn.layers.rotary": (("tileattn.rotary",), None),
    "flash_attn.ops": ((), ()),
    "flash_attn.ops.triton": ((), ()),
    "flash_attn.ops.triton.rotary": (("tileattn.rotary",), None),
    "flash_attn.modules": ((), ()),
    "flash_attn.modules.mha": (("tileattn.modules",), None),
    "flash_attn.utils": ((), ()),
    "flash_attn.utils.generation": (("tileattn.modules",), ("InferenceParams",)),
}
# A serving module that does not exist (yet) is replaced by these modules, serving these names.
FALLBACKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tileattn.interface": (("tileattn.api", "tileattn.kvcache"), FUNCTIONS),
}
# Names a served module holds under another name in tileattn: (tileattn module, name), imported on first access.
ALIASES: dict[str, tuple[str, str]] = {
    "flash_attn.ops.triton.rotary.rotary_kernel": ("tileattn.kernels.rotary", "_rotary_kernel"),  # a Triton JIT
}
_PACKAGES = {name.rpartition(".")[0] for name in SERVED if "." in name}

_METADATA = f"""\
Metadata-Version: 2.1
Name: {DIST_NAME}
Version: {API_VERSION}
Summary: flash_attn {API_VERSION}'s Python API served by tileattn {tileattn.__version__} (tileattn.shim)
Requires-Dist: tileattn=={tileattn.__version__}
"""


def _is_flash_attn(name: str) -> bool:
    return name == DIST_NAME or name.startswith(DIST_NAME + ".")


def not_provided_message(name: str) -> str:
    served = ", ".join(n for n in SERVED if n not in _PACKAGES or SERVED[n][0])
    return (
        f"No module named {name!r}: tileattn covers attention only, and its flash_attn shim (tileattn.shim) "
        f"serves {served}; {name} is not provided"
    )


def _sources(name: str) -> tuple[list[types.ModuleType], tuple[str, ...] | None]:
    """The modules serving flash_attn module ``name`` and the names it serves."""
    modules, names = SERVED[name]
    if len(modules) == 1 and modules[0] in FALLBACKS and importlib.util.find_spec(modules[0]) is None:
        modules, names = FALLBACKS[modules[0]]
    return [importlib.import_module(m) for m in modules], names


def _exported(module: types.ModuleType) -> list[str]:
    """``__all__``, or else the public functions and classes defined in the module."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        ]
    return list(names)


_MISSING = object()


def _lookup(sources: list[types.ModuleType], attr: str) -> object:
    for source in sources:
        value = getattr(source, attr, _MISSING)
        if value is not _MISSING:
            return value
    return _MISSING


def _called_by_import() -> bool:
    """Whether the finder was asked by an import (the statement, ``importlib.import_module``: both go
    through ``importlib._bootstrap._find_and_load_unlocked``) rather than by a probe such as
    ``importlib.util.find_spec``: the caller of ``importlib._bootstrap._find_spec``, which calls find_spec.
    (Where that frame is named otherwise, imports get Python's plain "No module named" message.)"""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name == "_find_spec":
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_find_and_load_unlocked"


class _Distribution(importlib.metadata.Distribution):
    """The ``flash_attn`` distribution's metadata (no files: ``files`` is None)."""

    def read_text(self, filename: str) -> str | None:
        return {"METADATA": _METADATA, "top_level.txt": f"{DIST_NAME}\n"}.get(filename)

    def locate_file(self, path) -> Path:
        return Path(tileattn.__file__).parent / path


class ShimFinder(importlib.metadata.DistributionFinder, importlib.abc.Loader):
    """Finds and loads the served ``flash_attn`` modules, refuses the others, and reports the
    ``flash_attn`` distribution to ``importlib.metadata``. ``install()`` puts one first on
    ``sys.meta_path``."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if not _is_flash_attn(fullname):
            return None
        if fullname in SERVED:
            return importlib.machinery.ModuleSpec(
                fullname, self, origin="tileattn.shim", is_package=fullname in _PACKAGES
            )
        if _called_by_import():
            raise ModuleNotFoundError(not_provided_message(fullname), name=fullname)
        return None  # a probe: absent

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        sources, names = _sources(name)
        module.__tileattn_shim__ = True
        if name == DIST_NAME:
            module.__version__ = API_VERSION
            module.__tileattn_version__ = tileattn.__version__
        exported = names if names is not None else [n for s in sources[:1] for n in _exported(s)]
        served = {n: _lookup(sources, n) for n in exported}
        module.__all__ = [n for n, value in served.items() if value is not _MISSING]
        module.__dict__.update({n: served[n] for n in module.__all__})

        def __getattr__(attr: str):
            """Submodules import on first access; other names (private ones such as
            ``_flash_attn_forward`` included) come from the serving modules."""
            if f"{name}.{attr}" in SERVED:
                return importlib.import_module(f"{name}.{attr}")
            value = (
                _lookup(sources, attr) if not attr.startswith("__") and (names is None or attr in names) else _MISSING
            )
            if value is not _MISSING:
                return value
            if f"{name}.{attr}" in ALIASES:
                source, source_name = ALIASES[f"{name}.{attr}"]
                return getattr(importlib.import_module(source), source_name)
            raise AttributeError(f"module {name!r} (served by tileattn.shim) has no attribute {attr!r}")

        def __dir__() -> list[str]:
            children = [n.rpartition(".")[2] for n in SERVED if n.rpartition(".")[0] == name]
            return sorted({*module.__dict__, *children})

        module.__getattr__ = __getattr__
        module.__dir__ = __dir__

    def find_distributions(self, context=None):
        """The ``flash_attn`` distribution, for queries on the default path (``sys.path``) that ask for it
        by any spelling (``flash_attn``, ``flash-attn``, ``Flash.Attn``) or for every distribution."""
        context = context or importlib.metadata.DistributionFinder.Context()
        if context.path is not sys.path:
            return iter(())
        if context.name is not None and re.sub(r"[-_.]+", "_", context.name).lower() != DIST_NAME:
            return iter(())
        return iter((_Distribution(),))


def _finders() -> list[object]:
    return [f for f in sys.meta_path if isinstance(f, ShimFinder)]


def _clear_transformers_caches() -> None:
    """transformers caches whether flash_attn is available and the distribution of each top-level
    package (``functools.cache``); clear them so that they see the shim come or go."""
    import_utils = sys.modules.get("transformers.utils.import_utils")
    if import_utils is None:
        return
    # transformers < 5.2x reads the mapping once, at import, into a dict: keep it in step with the shim
    mapping = getattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", None)
    if isinstance(mapping, dict):
        if is_installed():
            names = mapping.setdefault("flash_attn", [])
            if "flash_attn" not in names:
                names.append("flash_attn")
        elif mapping.get("flash_attn") == ["flash_attn"] and importlib.util.find_spec("flash_attn") is None:
            del mapping["flash_attn"]
    for attr in (
        "_package_distribution_mapping",
        "is_flash_attn_2_available",
        "is_flash_attn_3_available",
        "is_flash_attn_4_available",
        "is_flash_attn_greater_or_equal",
    ):
        clear = getattr(getattr(import_utils, attr, None), "cache_clear", None)
        if clear is not None:
            clear()


def is_installed() -> bool:
    return bool(_finders())


def install(force: bool = False) -> None:
    """Makes ``import flash_attn`` (and the submodules listed in this module's docstring) resolve to
    tileattn, and ``importlib.metadata`` see a ``flash_attn`` 2.8.3 distribution. Idempotent.

    Args:
        force: replace a real ``flash_attn`` that is already imported (its modules are dropped from
            ``sys.modules``; objects already taken from them stay what they were). Without it, that
            case raises RuntimeError.
    """
    loaded = [n for n in sys.modules if _is_flash_attn(n)]
    real = [n for n in loaded if not getattr(sys.modules[n], "__tileattn_shim__", False)]
    if real and not force:
        raise RuntimeError(
            "flash_attn is already imported (the real package); install the shim before anything imports "
            "flash_attn, or pass force=True to replace it"
        )
    for name in real:
        del sys.modules[name]
    if not is_installed():
        sys.meta_path.insert(0, ShimFinder())
    importlib.invalidate_caches()
    _clear_transformers_caches()


def uninstall() -> None:
    """Removes the finders and the shim's modules (a real flash_attn imports normally afterwards)."""
    for finder in _finders():
        sys.meta_path.remove(finder)
    for name in [n for n, m in sys.modules.items() if _is_flash_attn(n)]:
        if getattr(sys.modules[name], "__tileattn_shim__", False):
            del sys.modules[name]
    importlib.invalidate_caches()
    _clear_transformers_caches()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m tileattn.shim script.py [args...]")
    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
