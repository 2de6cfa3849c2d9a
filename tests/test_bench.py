"""The benchmark's own arithmetic: the work a masked problem does (``--features`` divides by it)."""

import pytest
import torch

from tileattn.bench.features import visible_pairs
from tileattn.reference import local_mask


@pytest.mark.parametrize(
    "causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 5)), (False, (7, 0)), (True, (3, 9))]
)
@pytest.mark.parametrize("seqlen", [1, 13, 64])
def test_visible_pairs_counts_the_mask(seqlen, causal, window):
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    mask = local_mask(i, j, seqlen, seqlen, (window[0], 0) if causal else window)
    assert visible_pairs(seqlen, causal, window) == int(mask.sum())
