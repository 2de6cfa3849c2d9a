"""The decode rows whose cache is split (1 × 8k, 1 × 128k, 8 × 32k), with the split combine reading its
partials one split per load (the layout of the measured table) and several at a time
(decode.COMBINE_SPLITS_PER_LOAD), cuDNN in the same run; the decode bench's timing (CUDA graphs,
caches rotated past L2).

    python scripts/decode_combine.py [SPLITS_PER_LOAD ...]   (default: 1 4 16)
"""

import sys

from tileattn.bench.decode import format_decode, run_decode
from tileattn.kernels import decode

CASES = [(1, 8192), (1, 131072), (8, 32768)]
rows = run_decode(cases=CASES, backends=["sdpa-cudnn"])
for per_load in [int(a) for a in sys.argv[1:]] or [1, 4, 16]:
    decode.COMBINE_SPLITS_PER_LOAD = per_load
    for r in run_decode(cases=CASES, backends=["tileattn", "tileattn paged16"]):
        if r["backend"].startswith("tileattn"):
            r["backend"] = f"{r['backend']} x{per_load}"
        rows.append(r)
print(format_decode(rows))
