"""The decode bench's rows (CUDA graphs, caches rotated past L2; cuDNN once, in the same run) for
variants of the decode kernels' settings, each as ``name=value`` changes separated by commas:

    python scripts/decode_variants.py [--out FILE] "" "combine=16" "stages=2" "combine=16,stages=2"

combine: splits the combine reads per load (decode.COMBINE_SPLITS_PER_LOAD; 16 in the table, 1 before);
stages: pipeline stages of the decode kernel's key loop (decode.DECODE_STAGES; 3 is the measured table);
waves: waves of programs the split count aims for (decode.DECODE_WAVES; 1 in the table);
plong: pipeline stages of long paged programs in small grids (decode.PAGED_LONG_STAGES; 0: none);
ptiles: key tiles from which a paged program counts as long (decode.PAGED_LONG_TILES);
tma: 1 reads contiguous caches through TMA descriptors (decode.DECODE_TMA; off in the table);
ptma: 1 reads paged caches of whole-tile pages through them (decode.PAGED_TMA); ptstages: their stages
(decode.PAGED_TMA_STAGES); tmatiles: key tiles per program from which TMA is used (decode.DECODE_TMA_TILES);
pdl: 1 launches the combine as a programmatic dependent launch (decode.DECODE_PDL);
pwarps: warps of the paged pointer-load builds (decode.PAGED_WARPS);
fstages, ftiles: stages of contiguous full-grid builds of at most ftiles key tiles per program
(decode.FULL_GRID_STAGES, 0: stages; decode.FULL_GRID_TILES).
With ``--out`` each variant's rows are appended (JSON lines and CSV) as soon as it is timed.
"""

import argparse
from pathlib import Path

from decode_variants_settings import apply
from tabulate import tabulate

from tileattn.bench.__main__ import append_results
from tileattn.bench.decode import DECODE_CASES, format_decode, run_decode

ap = argparse.ArgumentParser()
ap.add_argument("--out", type=Path)
ap.add_argument("variants", nargs="*", default=[""])
args = ap.parse_args()
rows = run_decode(cases=DECODE_CASES, backends=["sdpa-cudnn"])
if args.out:
    append_results(args.out, rows)
for variant in args.variants:
    label = variant or "table"
    with apply(variant):
        new = run_decode(cases=DECODE_CASES, backends=["tileattn", "tileattn paged16", "tileattn paged256"])
    for r in new:
        if r["backend"].startswith("tileattn"):
            r["backend"] = f"{r['backend']} [{label}]"
        r["variant"] = label
    if args.out:
        append_results(args.out, new)
    rows += new
print(format_decode(rows))
# last, one line per backend and variant: GB/s of K+V per case (copy read+write: bytes read + written)
cases = list(dict.fromkeys((r["batch"], r["cache_len"]) for r in rows))
gbps = {(r["backend"], r["batch"], r["cache_len"]): r.get("gbps") for r in rows}
print(
    tabulate(
        [
            [name] + [f"{gbps[(name, *case)]:.0f}" if gbps.get((name, *case)) else "-" for case in cases]
            for name in dict.fromkeys(r["backend"] for r in rows)
        ],
        headers=["backend"] + [f"{b}x{n // 1024}k" for b, n in cases],
        tablefmt="github",
    )
)
