"""The opt-in flash_attn shim: code importing flash_attn runs on tileattn unchanged."""

import subprocess
import sys
import textwrap

import pytest
import torch

import tileattn
from tileattn import shim


@pytest.fixture
def installed():
    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "flash_attn"}
    for name in saved:
        del sys.modules[name]
    shim.install()
    yield
    shim.uninstall()
    sys.modules.update(saved)


def test_flash_attn_imports_resolve_to_tileattn(installed):
    import flash_attn
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.flash_attn_interface import flash_attn_qkvpacked_func
    from flash_attn.layers.rotary import apply_rotary_emb
    from flash_attn.modules.mha import MHA

    assert flash_attn_func is tileattn.flash_attn_func and flash_attn_varlen_func is tileattn.flash_attn_varlen_func
    assert flash_attn_with_kvcache is tileattn.flash_attn_with_kvcache
    assert flash_attn_qkvpacked_func is tileattn.flash_attn_qkvpacked_func
    assert unpad_input is tileattn.bert_padding.unpad_input and pad_input is tileattn.bert_padding.pad_input
    assert apply_rotary_emb is tileattn.rotary.apply_rotary_emb and MHA is tileattn.modules.MHA
    assert flash_attn.__version__.startswith("2.8.3+tileattn")
    q = torch.randn(1, 5, 2, 16)
    torch.testing.assert_close(flash_attn_func(q, q, q, causal=True), tileattn.flash_attn_func(q, q, q, causal=True))


def test_real_flash_attn_is_not_replaced_silently():
    fake_real = type(sys)("flash_attn")
    saved = sys.modules.get("flash_attn")
    sys.modules["flash_attn"] = fake_real
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            shim.install()
    finally:
        if saved is None:
            del sys.modules["flash_attn"]
        else:
            sys.modules["flash_attn"] = saved


def test_run_a_script_with_the_shim(tmp_path):
    script = tmp_path / "uses_flash_attn.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch
            from flash_attn import flash_attn_func
            q = torch.randn(1, 4, 2, 8)
            print(type(flash_attn_func).__module__, sys.argv[1:], tuple(flash_attn_func(q, q, q).shape))
            """
        )
    )
    res = subprocess.run(
        [sys.executable, "-m", "tileattn.shim", str(script), "--flag"], capture_output=True, text=True, check=True
    )
    assert "['--flag'] (1, 4, 2, 8)" in res.stdout, res.stdout + res.stderr
