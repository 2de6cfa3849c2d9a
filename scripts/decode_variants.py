"""The decode bench's rows (CUDA graphs, caches rotated past L2; cuDNN once, in the same run) for
variants of the decode kernels' settings, each as ``name=value`` changes separated by commas:

    python scripts/decode_variants.py "" "combine=16" "stages=2" "combine=16,stages=2"

combine: splits the combine reads per load (decode.COMBINE_SPLITS_PER_LOAD; 1 is the measured table);
stages: pipeline stages of the decode kernel's key loop (decode.DECODE_STAGES; 3 is the measured table).
"""

import sys

from tileattn.bench.decode import DECODE_CASES, format_decode, run_decode
from tileattn.kernels import decode

SETTINGS = {"combine": "COMBINE_SPLITS_PER_LOAD", "stages": "DECODE_STAGES"}
defaults = {name: getattr(decode, attr) for name, attr in SETTINGS.items()}
rows = run_decode(cases=DECODE_CASES, backends=["sdpa-cudnn"])
for variant in sys.argv[1:] or [""]:
    changes = dict(defaults)
    for change in filter(None, variant.split(",")):
        name, _, value = change.partition("=")
        changes[name] = int(value)
    for name, value in changes.items():
        setattr(decode, SETTINGS[name], value)
    label = variant or "table"
    for r in run_decode(cases=DECODE_CASES, backends=["tileattn", "tileattn paged16", "tileattn paged256"]):
        if r["backend"].startswith("tileattn"):
            r["backend"] = f"{r['backend']} [{label}]"
        rows.append(r)
print(format_decode(rows))
