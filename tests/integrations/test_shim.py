"""The opt-in flash_attn shim: code importing flash_attn runs on tileattn unchanged, and the import system
and importlib.metadata see a flash_attn 2.8.3 package (what transformers checks before using it)."""

import importlib
import importlib.metadata
import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import tileattn
from tileattn import shim

REAL_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None or any(
    d.metadata["Name"] in ("flash_attn", "flash-attn") for d in importlib.metadata.distributions()
)
# flash_attn 2.8.3 modules outside attention, which the shim does not serve
NOT_PROVIDED = [
    "flash_attn.losses",
    "flash_attn.losses.cross_entropy",
    "flash_attn.models",
    "flash_attn.models.gpt",
    "flash_attn.ops.layer_norm",
    "flash_attn.ops.rms_norm",
    "flash_attn.ops.fused_dense",
    "flash_attn.ops.activations",
    "flash_attn.ops.triton.layer_norm",
    "flash_attn.ops.triton.cross_entropy",
    "flash_attn.ops.triton.mlp",
    "flash_attn.modules.mlp",
    "flash_attn.layers.patch_embed",
    "flash_attn.cute",
]

# What flash_attn 2.8.x's own test files (tests/test_flash_attn.py, test_rotary.py, test_util.py,
# layers/test_rotary.py, as of 2.8.3 and the development tree after it) import from the served modules
FLASH_ATTN_TEST_IMPORTS = {
    "flash_attn": list(shim.FUNCTIONS),
    "flash_attn.bert_padding": ["pad_input", "unpad_input"],
    "flash_attn.flash_attn_interface": ["_get_block_size_n", "USE_TRITON_ROCM", "_flash_attn_varlen_forward"],
    "flash_attn.layers.rotary": [
        "RotaryEmbedding",
        "apply_rotary_emb",
        "apply_rotary_emb_func",
        "apply_rotary_emb_kv_",
        "apply_rotary_emb_qkv_",
        "apply_rotary_emb_torch",
    ],
    "flash_attn.ops.triton.rotary": ["rotary_kernel"],
    "flash_attn.modules.mha": ["MHA"],
    "flash_attn.utils.generation": ["InferenceParams"],
}


def _flash_attn_modules() -> list[str]:
    return [n for n in sys.modules if n.split(".")[0] == "flash_attn"]


@pytest.fixture
def installed():
    saved = {n: sys.modules.pop(n) for n in _flash_attn_modules()}
    meta_path = list(sys.meta_path)
    shim.install()
    yield
    shim.uninstall()
    assert sys.meta_path == meta_path
    sys.modules.update(saved)


def test_flash_attn_imports_resolve_to_tileattn(installed):
    import flash_attn
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
    from flash_attn.flash_attn_interface import flash_attn_qkvpacked_func
    from flash_attn.layers.rotary import apply_rotary_emb
    from flash_attn.modules.mha import MHA
    from flash_attn.ops.triton.rotary import apply_rotary
    from flash_attn.utils.generation import InferenceParams

    interface = sys.modules["flash_attn.flash_attn_interface"]
    for name in shim.FUNCTIONS:
        assert getattr(flash_attn, name) is getattr(interface, name)
        assert getattr(interface, name).__module__.startswith("tileattn."), name
    assert set(flash_attn.__all__) == set(shim.FUNCTIONS)
    assert flash_attn_qkvpacked_func is interface.flash_attn_qkvpacked_func
    assert unpad_input is tileattn.bert_padding.unpad_input and pad_input is tileattn.bert_padding.pad_input
    assert index_first_axis is tileattn.bert_padding.index_first_axis
    assert apply_rotary_emb is tileattn.rotary.apply_rotary_emb and MHA is tileattn.modules.MHA
    assert apply_rotary is tileattn.rotary.apply_rotary and InferenceParams is tileattn.modules.InferenceParams
    with pytest.raises(ImportError, match="decode"):
        from flash_attn.utils.generation import decode  # noqa: F401  (only InferenceParams is served)
    assert flash_attn.__version__ == "2.8.3" and flash_attn.__tileattn_version__ == tileattn.__version__
    q = torch.randn(1, 5, 2, 16)
    torch.testing.assert_close(flash_attn_func(q, q, q, causal=True), tileattn.flash_attn_func(q, q, q, causal=True))
    assert callable(flash_attn_varlen_func) and callable(flash_attn_with_kvcache)


def test_modules_have_specs_and_import_lazily(installed):
    spec = importlib.util.find_spec("flash_attn")  # before the import
    assert spec is not None and spec.name == "flash_attn" and spec.submodule_search_locations is not None
    import flash_attn

    assert flash_attn.__spec__ is not None and importlib.util.find_spec("flash_attn") is flash_attn.__spec__
    assert "flash_attn.layers.rotary" not in sys.modules and "flash_attn.modules.mha" not in sys.modules
    import flash_attn.layers.rotary

    assert sys.modules["flash_attn.layers"].__spec__.submodule_search_locations is not None
    assert flash_attn.layers.rotary.__spec__.name == "flash_attn.layers.rotary"
    assert flash_attn.layers.rotary.__spec__.submodule_search_locations is None  # a module, not a package
    for name in shim.SERVED:
        assert importlib.util.find_spec(name) is not None, name
        module = importlib.import_module(name)
        assert module.__spec__.name == name and module.__spec__.loader is not None, name
    assert flash_attn.bert_padding is sys.modules["flash_attn.bert_padding"]  # attribute access imports it


@pytest.mark.parametrize(
    "flash_attn_module, tileattn_module",
    [
        ("flash_attn.bert_padding", "tileattn.bert_padding"),
        ("flash_attn.layers.rotary", "tileattn.rotary"),
        ("flash_attn.ops.triton.rotary", "tileattn.rotary"),
        ("flash_attn.modules.mha", "tileattn.modules"),
    ],
)
def test_submodules_serve_every_name_of_their_tileattn_module(installed, flash_attn_module, tileattn_module):
    """Whatever the tileattn module defines (public or private) is served, as the same object; star
    imports get its ``__all__`` (or its public functions and classes)."""
    served = importlib.import_module(flash_attn_module)
    source = importlib.import_module(tileattn_module)
    for name, value in vars(source).items():
        if not name.startswith("__"):
            assert getattr(served, name) is value, name
    star = {}
    exec(f"from {flash_attn_module} import *", star)
    expected = getattr(source, "__all__", None) or [
        n
        for n, v in vars(source).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == tileattn_module
    ]
    assert set(star) - {"__builtins__"} == set(expected)


def test_interface_serves_tileattn_interface(installed):
    """flash_attn.flash_attn_interface serves tileattn.interface (flash_attn's whole interface, private
    _flash_attn_forward & co. included) once that module exists, tileattn.api + kvcache before."""
    from flash_attn import flash_attn_interface

    if importlib.util.find_spec("tileattn.interface") is None:
        pytest.skip("tileattn.interface is not written yet (test_interface_fallback covers this case)")
    source = importlib.import_module("tileattn.interface")
    for name, value in vars(source).items():
        if not name.startswith("__"):
            assert getattr(flash_attn_interface, name) is value, name


@pytest.mark.parametrize("module", list(FLASH_ATTN_TEST_IMPORTS))
def test_names_flash_attn_tests_import_exist(installed, module):
    """flash_attn's test files import through the shim; USE_TRITON_ROCM is False (tileattn has no ROCm
    Triton backend, so their CUDA branches run), rotary_kernel is the Triton kernel apply_rotary_emb runs.
    (``flash_attn_interface.flash_attn_gpu``, the compiled extension's raw entry points, is not served.)"""
    names = FLASH_ATTN_TEST_IMPORTS[module]
    exec(f"from {module} import {', '.join(names)}", {})
    served = importlib.import_module(module)
    if module == "flash_attn.flash_attn_interface":
        assert served.USE_TRITON_ROCM is False
    if module == "flash_attn.ops.triton.rotary":
        from tileattn.kernels import rotary

        assert served.rotary_kernel is rotary._rotary_kernel


def test_interface_fallback(installed, monkeypatch):
    """While tileattn.interface does not exist, flash_attn_interface serves flash_attn's seven functions
    from tileattn.api and tileattn.kvcache, and nothing else of them."""
    monkeypatch.setitem(shim.SERVED, "flash_attn.flash_attn_interface", (("tileattn._not_written_yet",), None))
    monkeypatch.setitem(shim.FALLBACKS, "tileattn._not_written_yet", shim.FALLBACKS["tileattn.interface"])
    from flash_attn import flash_attn_interface

    from tileattn import api, kvcache

    assert flash_attn_interface.__all__ == list(shim.FUNCTIONS)
    for name in shim.FUNCTIONS:
        assert getattr(flash_attn_interface, name) is getattr(api if hasattr(api, name) else kvcache, name)
    with pytest.raises(AttributeError, match="cpu_backend"):
        flash_attn_interface.cpu_backend  # noqa: B018  (api's own names are not served)
    with pytest.raises(ImportError):
        from flash_attn.flash_attn_interface import _flash_attn_forward  # noqa: F401


def test_distribution_metadata(installed):
    md = importlib.metadata
    for spelling in ("flash_attn", "flash-attn", "Flash.Attn"):
        assert md.version(spelling) == "2.8.3"
    dist = md.distribution("flash_attn")
    assert dist.metadata["Name"] == "flash_attn" and dist.metadata["Version"] == "2.8.3"
    assert tileattn.__version__ in dist.metadata["Summary"]
    assert dist.read_text("top_level.txt").split() == ["flash_attn"]
    assert dist.files is None
    assert "flash_attn" in md.packages_distributions()["flash_attn"]
    assert any(d.metadata["Name"] == "flash_attn" for d in md.distributions())
    assert not any(d.metadata["Name"] == "flash_attn" for d in md.distributions(path=[]))  # another path


@pytest.mark.skipif(REAL_FLASH_ATTN, reason="a real flash_attn is installed")
def test_uninstall_removes_modules_and_metadata():
    saved = {n: sys.modules.pop(n) for n in _flash_attn_modules()}
    try:
        shim.install()
        shim.install()  # idempotent
        assert sum(isinstance(f, shim.ShimFinder) for f in sys.meta_path) == 1
        import flash_attn.bert_padding  # noqa: F401
    finally:
        shim.uninstall()
        sys.modules.update(saved)
    assert not any(isinstance(f, shim.ShimFinder) for f in sys.meta_path) and not shim.is_installed()
    assert importlib.util.find_spec("flash_attn") is None
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("flash_attn")
    assert "flash_attn" not in importlib.metadata.packages_distributions()


@pytest.mark.parametrize("name", NOT_PROVIDED)
def test_modules_outside_attention_are_absent(installed, name):
    """Probes say absent (find_spec is None; under an absent package it raises ModuleNotFoundError, as for
    any missing package), imports raise ModuleNotFoundError naming the module and saying why, and
    ``try/except ImportError`` fallbacks take their other branch."""
    parent = name.rpartition(".")[0]
    if parent in shim.SERVED:
        assert importlib.util.find_spec(name) is None
    else:
        with pytest.raises(ModuleNotFoundError, match="attention only"):
            importlib.util.find_spec(name)
    for attempt in (lambda: importlib.import_module(name), lambda: exec(f"import {name}", {})):
        with pytest.raises(ModuleNotFoundError, match="attention only") as info:
            attempt()
        assert f"'{name.split('.')[0]}.{name.split('.')[1]}" in str(info.value)  # the missing module's name
        assert info.value.name is not None and name.startswith(info.value.name)
    scope = {}
    exec(
        textwrap.dedent(
            f"""
            try:
                from {name} import something
            except ImportError:
                something = "fallback"
            """
        ),
        scope,
    )
    assert scope["something"] == "fallback"


def test_not_provided_message_names_the_module(installed):
    with pytest.raises(ModuleNotFoundError) as info:
        import flash_attn.ops.triton.layer_norm  # noqa: F401
    message = str(info.value)
    assert "flash_attn.ops.triton.layer_norm" in message and "tileattn covers attention only" in message
    assert info.value.name == "flash_attn.ops.triton.layer_norm"


def test_real_flash_attn_is_not_replaced_silently():
    fake_real = type(sys)("flash_attn")
    saved = {n: sys.modules.pop(n) for n in _flash_attn_modules()}
    sys.modules["flash_attn"] = fake_real
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            shim.install()
        assert not shim.is_installed()
        shim.install(force=True)
        import flash_attn

        assert flash_attn is not fake_real and flash_attn.__tileattn_shim__
    finally:
        shim.uninstall()
        sys.modules.pop("flash_attn", None)
        sys.modules.update(saved)


def test_run_a_script_with_the_shim(tmp_path):
    script = tmp_path / "uses_flash_attn.py"
    script.write_text(
        textwrap.dedent(
            """
            import importlib.metadata, importlib.util, sys, torch
            from flash_attn import flash_attn_func
            from flash_attn.bert_padding import unpad_input
            q = torch.randn(1, 4, 2, 8)
            print(flash_attn_func.__module__.split(".")[0], sys.argv[1:], tuple(flash_attn_func(q, q, q).shape))
            print(importlib.metadata.version("flash_attn"), importlib.util.find_spec("flash_attn").name)
            """
        )
    )
    res = subprocess.run(
        [sys.executable, "-m", "tileattn.shim", str(script), "--flag"], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "tileattn ['--flag'] (1, 4, 2, 8)" in res.stdout, res.stdout + res.stderr
    assert "2.8.3 flash_attn" in res.stdout, res.stdout + res.stderr


FLASH_ATTN_STYLE_TESTS = """
import flash_attn
import pytest
from flash_attn import flash_attn_func
from flash_attn.flash_attn_interface import USE_TRITON_ROCM


@pytest.mark.parametrize("i", range(10))
def test_many(i):
    assert flash_attn.__version__ == "2.8.3" and flash_attn_func.__module__.startswith("tileattn")


@pytest.mark.parametrize("i", range(3))
@pytest.mark.parametrize("j", range(2))
def test_grid(i, j):
    assert USE_TRITON_ROCM is False


def test_single():
    assert flash_attn_func is not None
"""


def test_flash_attn_tests_runner_samples_each_function(tmp_path):
    """scripts/flash_attn_tests.py runs a flash_attn-style test file unchanged with the shim installed before
    it imports flash_attn, keeping ``--per-test`` cases of each function (all of those with fewer), the
    same cases for the same seed, every case with 0; pytest's exit status is the script's."""

    script = pathlib.Path(__file__).parents[2] / "scripts" / "flash_attn_tests.py"
    test_file = tmp_path / "test_flash_attn.py"
    test_file.write_text(FLASH_ATTN_STYLE_TESTS)

    def run(*args):
        res = subprocess.run(
            [sys.executable, str(script), str(test_file), *args, "--", "-q", "-rA"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        passed = sorted(re.findall(r"^PASSED \S+::(\S+)", res.stdout, re.M))
        return res.returncode, passed, res.stdout

    code, passed, out = run("--per-test", "2", "--seed", "3")
    assert code == 0 and "5 passed, 12 deselected" in out, out
    assert [p.split("[")[0] for p in passed].count("test_many") == 2 and "test_single" in passed, passed
    assert run("--per-test", "2", "--seed", "3")[1] == passed  # (the same sample again)
    assert "17 passed" in run("--per-test", "0")[2]
    test_file.write_text(FLASH_ATTN_STYLE_TESTS + "\n\ndef test_fails():\n    assert False\n")
    code, _, out = run("--per-test", "1")
    assert code == 1 and "1 failed" in out, out
