"""``python -m tileattn.bench --features`` with the forward's TMA reads switched on or off
(KernelConfig.tma; the backward tables are set to off either way), to compare the feature rows both ways
or to rerun a check with TMA on.

    python scripts/features_tma.py on|off [bench arguments, e.g. --headdim 128 64 256]
"""

import dataclasses
import sys

from tileattn.bench.__main__ import main
from tileattn.kernels import configs

if len(sys.argv) < 2 or sys.argv[1] not in ("on", "off"):
    sys.exit(__doc__)
for table in (configs._FWD, configs._BWD_DKDV, configs._BWD_DQ):
    for d, cfg in list(table.items()):
        table[d] = dataclasses.replace(cfg, tma=sys.argv[1] == "on" and table is configs._FWD)
sys.exit(main(["--features", *sys.argv[2:]]))
