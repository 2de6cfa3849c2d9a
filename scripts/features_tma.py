"""``python -m tileattn.bench --features`` with the forward's TMA reads switched on or off (the backward
tables' TMA off either way), to compare the feature rows both ways or to rerun a check with TMA on. "off"
gives head dim 256's forward its pointer-load tiles (configs._FWD_POINTER), not the TMA tiles without
TMA (a miscompiled build, docs/perf.md). A shorthand for scripts/features_variant.py.

    python scripts/features_tma.py on|off [bench arguments, e.g. --headdim 128 64 256]
"""

import sys

from features_variant import main

if len(sys.argv) < 2 or sys.argv[1] not in ("on", "off"):
    sys.exit(__doc__)
fwd = "fwd:tma=1" if sys.argv[1] == "on" else "fwd:tma=0"
sys.exit(main([fwd, "dkdv:tma=0", "dq:tma=0", "--", *sys.argv[2:]]))
