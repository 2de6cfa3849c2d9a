"""``python -m tileattn.bench --features`` with the forward's TMA reads switched on or off
(KernelConfig.tma; the backward tables are set to off either way), to compare the feature rows both ways
or to rerun a check with TMA on. "off" gives head dim 256's forward its pointer-load tiles
(configs._FWD_POINTER), not the TMA tiles without TMA (a miscompiled build, docs/perf.md).

    python scripts/features_tma.py on|off [bench arguments, e.g. --headdim 128 64 256]
"""

import dataclasses
import sys

from tileattn.bench.__main__ import main
from tileattn.kernels import configs

if len(sys.argv) < 2 or sys.argv[1] not in ("on", "off"):
    sys.exit(__doc__)
on = sys.argv[1] == "on"
for table in (configs._FWD, configs._BWD_DKDV, configs._BWD_DQ):
    for d, cfg in list(table.items()):
        if table is configs._FWD and not on and d in configs._FWD_POINTER:
            table[d] = configs._FWD_POINTER[d]
        else:
            table[d] = dataclasses.replace(cfg, tma=on and table is configs._FWD)
sys.exit(main(["--features", *sys.argv[2:]]))
