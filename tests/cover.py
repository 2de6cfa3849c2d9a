"""Covering samples of parametrized grids, for the GPU's run of the suite.

A test marked ``gpu_cover(strength=t)`` runs on the GPU, by default, only on a sample of its grid in which
every combination of ``t`` parameter values that occurs in the grid occurs at least once (t = 1: every value
of every parameter; t = 2: every pair of values of any two parameters). Nearly all of a kernel test's GPU
time is compiling the builds its case selects, and the builds follow the parameters: a faulty feature, or a
fault in two features together, still meets the GPU, in one case rather than in every case that holds it.
What the sample leaves out still runs (tests/conftest.py):
- on CPU, in every CI run, where the kernels run under Triton's interpreter on the whole grid (fp16: the
  interpreter computes bf16 on raw bits);
- on the GPU with TILEATTN_SLOW=1, the whole grid.
Items the CPU path computes (``backend="torch"``) are never sampled.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Sequence


def covering_sample(rows: Sequence[Sequence[Hashable]], strength: int) -> set[int]:
    """Indices of a subset of ``rows`` (each a tuple of parameter values, one position per parameter) in
    which every combination of ``strength`` positions' values that some row holds is held by a chosen row.
    Greedy and deterministic: the row holding the most combinations still missing first; among equals, the
    row whose values were chosen least often (so that, at strength 1 over a case and a dtype, the dtypes
    alternate over the cases), then the earliest."""
    if not rows:
        return set()
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise ValueError("covering_sample: every row needs the same number of values")
    t = min(strength, width)
    if t < 1:
        raise ValueError(f"covering_sample: strength must be at least 1, got {strength}")
    held = [{(dims, tuple(r[i] for i in dims)) for dims in itertools.combinations(range(width), t)} for r in rows]
    missing = set().union(*held)
    used: Counter = Counter()
    chosen: set[int] = set()
    while missing:
        best = min(
            (i for i in range(len(rows)) if i not in chosen),
            key=lambda i: (-len(held[i] & missing), sum(used[(j, v)] for j, v in enumerate(rows[i])), i),
        )
        chosen.add(best)
        missing -= held[best]
        used.update(enumerate(rows[best]))
    return chosen
