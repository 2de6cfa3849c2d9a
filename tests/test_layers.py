"""The package's layers import one way (docs/design.md): API → ops → kernels' launchers → kernels, with
the shared types below them all, and ``import tileattn`` loads no Triton."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tileattn

ROOT = Path(tileattn.__file__).parent

# Lowest first: a module may import modules of its own layer or below, never above.
LAYERS = [
    {"params", "reference", "rng", "rotary_torch", "testing", "bert_padding", "cache", "flashmask"},
    {"checks", "cpu", "kernels"},
    {"backend", "errors"},
    {"ops"},
    {"api", "kvcache", "rotary", "interface", "masks", "fp8", "mla", "inner_attention", "distributed"},
    {"modules", "shim", "integrations", "bench", "__init__"},
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every tileattn module ``path`` imports, at module level or inside functions."""
    modules = {_module_name(p) for p in ROOT.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tileattn")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tileattn"):
            for alias in node.names:  # ``from package import module`` imports the module, not the package's names
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
    return {name for name in found if name in modules} - {_module_name(path)}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module} is in no layer of this test: add it to LAYERS")


def test_every_module_has_a_layer():
    for module in _graph():
        _layer(module)


def test_imports_point_down():
    wrong = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if _layer(target) > _layer(module) and not module.startswith(target + ".")  # a package's own __init__
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ is imported by its submodules' imports; count only explicit edges
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_params_imports_nothing_of_tileattn():
    assert _graph()["tileattn.params"] == set()


@pytest.mark.parametrize("module", ["tileattn", "tileattn.cache", "tileattn.modules"])
def test_import_loads_no_triton(module):
    """Importing tileattn adds no Triton module to what importing torch loads (the kernels load on first use)."""
    code = (
        "import sys, torch; before = {m for m in sys.modules if m.split('.')[0] == 'triton'}; "
        f"import {module}; after = {{m for m in sys.modules if m.split('.')[0] == 'triton'}}; "
        "assert after == before, sorted(after - before)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})
