"""``python -m tileattn.bench --features`` with the TMA forward switched off (a diagnosis aid: compares the
feature rows with K/V through descriptors and through pointer loads)."""

import dataclasses
import sys

from tileattn.bench.__main__ import main
from tileattn.kernels import configs

for d, cfg in list(configs._FWD.items()):
    configs._FWD[d] = dataclasses.replace(cfg, tma=False)
sys.exit(main(["--features", *sys.argv[1:]]))
