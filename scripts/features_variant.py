"""``python -m tileattn.bench --features`` (or any bench mode) with the kernels' tile tables changed, to
time a KernelConfig variant against the tables in a separate run:

    python scripts/features_variant.py fwd@128:num_stages=3 fwd@128:maxnreg=0 -- --headdim 128
    python scripts/features_variant.py fwd:tma=1 -- --headdim 64

Each change is ``TABLE[@HEADDIMS]:FIELD=VALUE`` with TABLE one of fwd, fwdlong (key lengths from
configs.LONG_SEQLEN_K up), fwdcausal (causal calls), fwdwindow (calls with a left window; entries these
three lack start from fwd's), dkdv, dkdvcausal (causal calls), dkdvvarlen (varlen calls without
dropout; entries these two lack start from dkdv's), dq; HEADDIMS the padded head dims it applies to
(default: all) and FIELD a KernelConfig field (ints; 0/1 for flags; maxnreg=0 removes the cap). Turning
the forward's TMA off where the table reads through TMA takes that head dim's pointer-load tiles where
configs._FWD_POINTER has them (head dim 256, whose same tiles without TMA are a miscompiled build), else
the same tiles without TMA. ``tables_as_given`` restores the tables between variants in one process
(scripts/bwd_variants.py).
Everything after ``--`` goes to the bench (``--features`` is added unless another mode is given;
``--grid`` runs the default grid instead).
"""

from __future__ import annotations

import dataclasses
import sys

from tileattn.kernels import configs

TABLES = {
    "fwd": configs._FWD,
    "fwdlong": configs._FWD_LONG,
    "fwdcausal": configs._FWD_CAUSAL,
    "fwdwindow": configs._FWD_WINDOW,
    "dkdv": configs._BWD_DKDV,
    "dkdvcausal": configs._BWD_DKDV_CAUSAL,
    "dkdvvarlen": configs._BWD_DKDV_VARLEN,
    "dq": configs._BWD_DQ,
}
# the shape tables' entries start from these tables' where they have none
BASES = {
    "fwdlong": configs._FWD,
    "fwdcausal": configs._FWD,
    "fwdwindow": configs._FWD,
    "dkdvcausal": configs._BWD_DKDV,
    "dkdvvarlen": configs._BWD_DKDV,
}


class tables_as_given:
    """Snapshot of the tables at creation; ``reset(changes)`` restores it and applies ``changes``."""

    def __init__(self):
        self.saved = {name: dict(table) for name, table in TABLES.items()}

    def reset(self, changes=()) -> None:
        for name, table in TABLES.items():
            table.clear()
            table.update(self.saved[name])
        for change in changes:
            apply(change)


def apply(change: str) -> None:
    """Applies one ``TABLE[@HEADDIMS]:FIELD=VALUE`` change to the tables."""
    target, _, assignment = change.partition(":")
    name, _, dims = target.partition("@")
    field, _, value = assignment.partition("=")
    if name not in TABLES or not field or not value:
        raise SystemExit(f"bad change {change!r}\n\n{__doc__}")
    table = TABLES[name]
    forward = name.startswith("fwd")
    base = BASES.get(name, table)
    keys = [int(d) for d in dims.split(",")] if dims else list(base)
    fields = [f.name for f in dataclasses.fields(configs.KernelConfig)]
    if field not in fields:
        raise SystemExit(f"{field!r} is not a KernelConfig field ({', '.join(fields)})")
    parsed = bool(int(value)) if field in ("q_major", "tma", "warp_spec") else int(value)
    if field == "maxnreg" and not parsed:
        parsed = None  # maxnreg=0: no cap
    for d in keys:
        cfg = table[d] if d in table else base[d]
        if forward and field == "tma" and not parsed and cfg.tma and d in configs._FWD_POINTER:
            cfg = configs._FWD_POINTER[d]
        table[d] = dataclasses.replace(cfg, **{field: parsed})


def main(argv: list[str]) -> int:
    from tileattn.bench.__main__ import main as bench

    changes, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    for change in changes:
        apply(change)
    if "--grid" in bench_args:
        bench_args.remove("--grid")
    elif not any(a in bench_args for a in ("--decode", "--varlen", "--features")):
        bench_args = ["--features", *bench_args]
    for name, table in TABLES.items():
        print(name, {d: dataclasses.astuple(c) for d, c in table.items()}, flush=True)
    return bench(bench_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
