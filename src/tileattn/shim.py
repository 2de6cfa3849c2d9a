"""Run code written for ``flash_attn`` on tileattn without changing it (opt-in).

``install()`` puts modules named ``flash_attn``, ``flash_attn.flash_attn_interface``,
``flash_attn.bert_padding``, ``flash_attn.layers.rotary`` and ``flash_attn.modules.mha`` in
``sys.modules``, backed by tileattn, so that ``from flash_attn import flash_attn_func`` (and the varlen,
kvcache, padding, rotary and MHA imports) resolve to tileattn. Two ways in::

    import tileattn.shim; tileattn.shim.install()      # before the code imports flash_attn
    python -m tileattn.shim train.py --args ...        # run a script with the shim installed

It refuses to replace a real ``flash_attn`` that is already imported. ``flash_attn.__version__`` reads
``2.8.3+tileattn...``, the API version tileattn follows.
"""

from __future__ import annotations

import runpy
import sys
import types

import tileattn
from tileattn import api, bert_padding, modules, rotary
from tileattn.kvcache import flash_attn_with_kvcache

API_VERSION = "2.8.3"
_FUNCTIONS = {
    "flash_attn_func": api.flash_attn_func,
    "flash_attn_qkvpacked_func": api.flash_attn_qkvpacked_func,
    "flash_attn_kvpacked_func": api.flash_attn_kvpacked_func,
    "flash_attn_varlen_func": api.flash_attn_varlen_func,
    "flash_attn_varlen_qkvpacked_func": api.flash_attn_varlen_qkvpacked_func,
    "flash_attn_varlen_kvpacked_func": api.flash_attn_varlen_kvpacked_func,
    "flash_attn_with_kvcache": flash_attn_with_kvcache,
}


def _module(name: str, doc: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    mod.__dict__.update(attrs)
    mod.__tileattn_shim__ = True
    return mod


def install(force: bool = False) -> None:
    """Makes ``import flash_attn`` (and its submodules above) resolve to tileattn."""
    existing = sys.modules.get("flash_attn")
    if existing is not None and not getattr(existing, "__tileattn_shim__", False) and not force:
        raise RuntimeError(
            "flash_attn is already imported (the real package); install the shim before anything imports "
            "flash_attn, or pass force=True to replace it"
        )
    version = f"{API_VERSION}+tileattn.{tileattn.__version__}"
    interface = _module("flash_attn.flash_attn_interface", "flash_attn's interface, served by tileattn", **_FUNCTIONS)
    padding = _module(
        "flash_attn.bert_padding",
        "flash_attn.bert_padding, served by tileattn",
        unpad_input=bert_padding.unpad_input,
        pad_input=bert_padding.pad_input,
        index_first_axis=bert_padding.index_first_axis,
    )
    rotary_mod = _module(
        "flash_attn.layers.rotary", "rotary embeddings, served by tileattn", apply_rotary_emb=rotary.apply_rotary_emb
    )
    layers = _module("flash_attn.layers", "flash_attn.layers (shim)", rotary=rotary_mod)
    mha = _module(
        "flash_attn.modules.mha",
        "flash_attn.modules.mha, served by tileattn",
        MHA=modules.MHA,
        SelfAttention=modules.SelfAttention,
        CrossAttention=modules.CrossAttention,
        FlashSelfAttention=modules.SelfAttention,
        FlashCrossAttention=modules.CrossAttention,
    )
    modules_pkg = _module("flash_attn.modules", "flash_attn.modules (shim)", mha=mha)
    root = _module(
        "flash_attn",
        "flash_attn served by tileattn (tileattn.shim)",
        __version__=version,
        __path__=[],
        flash_attn_interface=interface,
        bert_padding=padding,
        layers=layers,
        modules=modules_pkg,
        **_FUNCTIONS,
    )
    for mod in (root, interface, padding, layers, rotary_mod, modules_pkg, mha):
        sys.modules[mod.__name__] = mod


def uninstall() -> None:
    """Removes the shim's modules (a real flash_attn imports normally afterwards)."""
    for name in [n for n, m in sys.modules.items() if n.split(".")[0] == "flash_attn"]:
        if getattr(sys.modules[name], "__tileattn_shim__", False):
            del sys.modules[name]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m tileattn.shim script.py [args...]")
    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
