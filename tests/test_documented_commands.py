"""Every command the README's shell blocks and the examples' docstrings show runs as written, on the CPU
when there is no GPU, each in a fresh process from an empty folder (with the examples beside it): the
commands are read out of the files, so a new one is tested without a new test. Excluded, each for a
reason written here: installs, the test suite itself, and commands marked ``# GPU only`` where there is no
GPU. The command-line tools also give every option a line and its default in ``--help``."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import EXAMPLES, example

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", flags=re.S | re.M)


def _commands_of(text: str) -> list[tuple[str, str]]:
    """``(command, comment)`` of each ``python ...`` command on the lines of ``text`` (commands joined
    by ``&&`` count one by one; a ``# comment`` after the last one is kept)."""
    found = []
    for line in text.splitlines():
        line = line.strip().removeprefix("$ ")
        line, _, comment = line.partition("  #")
        for part in line.split("&&"):
            part = part.strip()
            if part.startswith("python "):
                found.append((part, comment.strip()))
    return found


def documented_commands() -> list[tuple[str, str, str]]:
    """``(where, command, comment)`` of each command once: the README's shell blocks, then each example's
    module docstring."""
    found = [("README.md", text) for block in SHELL_BLOCK.findall(README.read_text()) for text in _commands_of(block)]
    for path in sorted(EXAMPLES.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        found += [(f"examples/{path.name}", text) for text in _commands_of(doc)]
    unique = {}
    for where, (command, comment) in found:
        unique.setdefault(command, (where, command, comment))
    return list(unique.values())


def _excluded(command: str, comment: str) -> str | None:
    """Why a documented command is not run here, or None."""
    if command.startswith("python -m pytest"):
        return "the test suite itself"
    if "GPU only" in comment and not torch.cuda.is_available():
        return "marked GPU only, and there is no GPU"
    return None


COMMANDS = documented_commands()


def test_the_docs_have_commands():
    """The parse finds the commands (a change of format must not leave this file testing nothing)."""
    commands = [c for _, c, _ in COMMANDS]
    assert "python -m tileattn.bench --quick" in commands
    for name in ("paged_decode", "mla_decode", "context_parallel"):
        assert f"python examples/{name}.py" in commands, name
    assert any("--scheme ulysses" in c for c in commands)


@pytest.mark.long  # (on a GPU 4-65 s a command: bench --quick 65 s on an H100)
@pytest.mark.parametrize("where, command, comment", COMMANDS, ids=[c for _, c, _ in COMMANDS])
def test_documented_command_runs(where, command, comment, tmp_path):
    why = _excluded(command, comment)
    if why:
        pytest.skip(why)
    (tmp_path / "examples").symlink_to(EXAMPLES)  # the command's paths as written, its outputs in tmp_path
    args = [sys.executable, *command.split()[1:]]
    res = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    output = f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert res.returncode == 0, f"{where}: `{command}` failed ({res.returncode}):\n{output}"


def test_context_parallel_refuses_an_impossible_split_before_spawning(capsys):
    """A combination the layer cannot split ends in argparse's usage and one line saying why, before any
    process starts (no multiprocess traceback)."""
    module = example("context_parallel")
    for argv, words in [
        (["--world", "3", "--scheme", "ulysses", "--seqlen", "384"], ["--world 3", "divide 8", "1, 2, 4 or 8"]),
        (["--seqlen", "90"], ["--seqlen 90", "4 equal chunks"]),
        (["--world", "3", "--scheme", "ring", "--seqlen", "100"], ["--seqlen 100", "3 equal chunks"]),
        (["--world", "0"], ["--world must be at least 1"]),
    ]:
        with pytest.raises(SystemExit) as exc:
            module.main(argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err and "error: " in last and all(w in last for w in words), (argv, err)
    for world, scheme, seqlen in [(2, "zigzag", 256), (4, "ulysses", 384), (8, "ulysses", 64), (3, "ring", 96)]:
        assert module.refusal(world, scheme, seqlen) is None


def _option_blocks(help_text: str) -> dict[str, str]:
    """``{option: its help text}`` of an argparse ``--help`` (an option's lines up to the next option or
    group heading)."""
    blocks, current = {}, None
    for line in help_text.splitlines():
        start = re.match(r"  (?:-\w, )?(--[\w-]+)", line)
        if start:
            current = start.group(1)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    blocks.pop("--help", None)
    return blocks


def _help_of(main) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return out.getvalue()


@pytest.mark.parametrize(
    "tool",
    ["tileattn.bench", "tileattn.bench.tune", "flash_attn_tests", "paged_decode", "mla_decode", "context_parallel"],
)
def test_help_gives_every_option_a_line_and_its_default(tool, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    if tool == "tileattn.bench":
        from tileattn.bench.__main__ import parse_args as main
    elif tool == "tileattn.bench.tune":
        from tileattn.bench.tune import main
    elif tool == "flash_attn_tests":  # (scripts/)
        spec = importlib.util.spec_from_file_location(tool, ROOT / "scripts" / f"{tool}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        main = module.main
    else:
        main = example(tool).main
    blocks = _option_blocks(_help_of(main))
    assert len(blocks) >= 2, blocks
    for option, text in blocks.items():
        assert re.search(r"\bdefault\b", text), f"{tool} --help: {option} does not say its default: {text!r}"
