"""flash_attn's own tests through ``tileattn.shim``: a seeded sample of each test function's cases.

    python scripts/flash_attn_tests.py PATH/TO/test_flash_attn.py [--per-test 6] [--seed 0] [-- PYTEST_ARGS]

The file (flash_attn 2.8.3's ``tests/test_flash_attn.py``, from the flash-attention repository at tag v2.8.3;
it imports einops) runs unchanged: it is copied into a temporary directory beside a ``conftest.py`` that
installs the shim before the file imports ``flash_attn``, and that keeps ``--per-test`` cases of each test
function, drawn with ``--seed`` from its parametrizations in collection order (every case with
``--per-test 0``), the same in every pytest-xdist worker. Arguments after ``--`` go to pytest (``-n 8``,
``-x``, ``--junitxml=...``); its exit status is this script's. flash_attn's file asks the CUDA device's
capability when imported: it needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

CONFTEST = """\
import os
import random
from collections import defaultdict

import tileattn.shim

tileattn.shim.install()  # (before the test file imports flash_attn)


def pytest_collection_modifyitems(config, items):
    per_test = int(os.environ["TILEATTN_FA_PER_TEST"])
    if per_test <= 0:
        return
    rng = random.Random(int(os.environ["TILEATTN_FA_SEED"]))
    cases = defaultdict(list)
    for item in items:
        cases[item.originalname].append(item)
    keep = set()
    for name in sorted(cases):
        keep.update(id(item) for item in rng.sample(cases[name], min(per_test, len(cases[name]))))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in keep])
    items[:] = [item for item in items if id(item) in keep]
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("test_file", type=pathlib.Path, help="flash_attn's tests/test_flash_attn.py (or another test file)")
    ap.add_argument("--per-test", type=int, default=6, help="cases kept per test function, 0 for all (default 6)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    args = ap.parse_args(argv)
    if not args.test_file.is_file():
        ap.error(f"no such file: {args.test_file}")
    with tempfile.TemporaryDirectory(prefix="flash_attn_tests_") as tmp:
        shutil.copy(args.test_file, pathlib.Path(tmp) / args.test_file.name)
        (pathlib.Path(tmp) / "conftest.py").write_text(CONFTEST)
        (pathlib.Path(tmp) / "pytest.ini").write_text("[pytest]\n")  # (no configuration from the directories above)
        env = dict(os.environ, TILEATTN_FA_PER_TEST=str(args.per_test), TILEATTN_FA_SEED=str(args.seed))
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", tmp, args.test_file.name]
        return subprocess.run(command + extra, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
