"""The README as a new user meets it: every Python block runs as printed, each in a fresh interpreter
(on the GPU if there is one, else on the CPU with the sizes the snippet picks there), and the commands
and files it names exist."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def _first_line(code: str) -> str:
    return next(line for line in code.splitlines() if line.strip() and not line.startswith(("import", "from")))


def test_readme_has_its_snippets():
    assert len(BLOCKS) >= 3, "the README's Use section lost its python blocks"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs_as_printed(code, tmp_path):
    """A fresh ``python`` runs the block alone, from an empty folder: every name it uses is defined in it."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, f"README block starting {_first_line(code)!r} failed:\n{res.stderr[-3000:]}"


def test_readme_names_files_and_commands_that_exist():
    for path in re.findall(r"python (examples/\S+\.py)", README):
        assert (ROOT / path).is_file(), path
    from tileattn.bench.__main__ import parse_args

    for command in re.findall(r"python -m tileattn\.bench([^`\n]*)", README):
        parse_args(command.split())


def test_readme_installs_the_cpu_build_of_torch_from_its_index():
    """The CPU install line selects PyTorch's CPU wheel index: PyPI's ``torch`` is the CUDA build."""
    line = re.search(r"`pip install torch[^`]*`", README)
    assert line and "--index-url https://download.pytorch.org/whl/cpu" in line.group(0), line
