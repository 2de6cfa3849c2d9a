"""FlashMask's column-interval masks: what ``startend_row_indices`` means, and the one form every path reads.

FlashMask (Wang et al., 2025) describes a mask per key column ``j`` by the query rows it hides, at most
two intervals of rows, so a mask costs O(seqlen_k) memory. ``startend_row_indices`` is int32 with a last
dimension ``C`` of 1, 2 or 4 bounds per column; what they mean depends on ``C`` and on causal (the
causal mask applies on top):

=========== ======== ===============================================================
C           causal   rows ``i`` that key column ``j`` hides
=========== ======== ===============================================================
1           yes      ``i >= LTS_j``
2           yes      ``LTS_j <= i < LTE_j``
2           no       ``i >= LTS_j`` or ``i < UTE_j`` (the two values are LTS and UTE)
4           no       ``LTS_j <= i < LTE_j`` or ``UTS_j <= i < UTE_j``
=========== ======== ===============================================================

(LT/UT: the lower / upper triangle's interval, S/E: start / end.) ``canonical`` turns every mode into
the four bounds ``[lower_start, lower_end, upper_start, upper_end]`` per key token (``params.FlashMask``);
``hidden`` is the predicate the CPU path applies, and the Triton kernels apply the same one
(``kernels.common.flashmask_bounds``, ``flashmask_hides``).
"""

from __future__ import annotations

import torch

from tileattn.params import FlashMask

# an interval that hides no row: below, (EMPTY, EMPTY) (past any query row); above, (0, 0)
EMPTY = 2**30


def uses_upper(columns: int, causal: bool) -> bool:
    """Whether mode (``columns``, ``causal``) uses the upper interval."""
    return columns == 4 or (columns == 2 and not causal)


def canonical(startend_row_indices: torch.Tensor, causal: bool, varlen: bool) -> FlashMask:
    """The four bounds of every key token from the caller's ``startend_row_indices``: dense
    ``(batch, nheads_mask, seqlen_k, C)`` (tokens ``b * seqlen_k + j``) or varlen ``(nheads_mask,
    total_k, C)``. Values are checked before (``checks.flashmask_values``)."""
    idx = startend_row_indices
    if varlen:
        cols = idx.permute(0, 2, 1)  # (nheads_mask, C, total_k)
    else:
        batch, heads, seqlen_k, c = idx.shape
        cols = idx.permute(1, 3, 0, 2).reshape(heads, c, batch * seqlen_k)
    columns = cols.shape[1]
    empty = torch.full_like(cols[:, 0], EMPTY)
    zero = torch.zeros_like(cols[:, 0])
    lower_start = cols[:, 0]
    lower_end = cols[:, 1] if columns == 4 or (columns == 2 and causal) else empty
    upper_start, upper_end = zero, zero
    if columns == 4:
        upper_start, upper_end = cols[:, 2], cols[:, 3]
    elif columns == 2 and not causal:
        upper_end = cols[:, 1]
    lower_none = lower_start >= lower_end
    upper_none = upper_start >= upper_end
    bounds = torch.stack(
        [
            torch.where(lower_none, empty, lower_start),
            torch.where(lower_none, empty, lower_end),
            torch.where(upper_none, zero, upper_start),
            torch.where(upper_none, zero, upper_end),
        ],
        1,
    )
    return FlashMask(bounds.to(torch.int32).contiguous(), uses_upper(columns, causal))


def hidden(bounds: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """True where a key column hides query row ``i``: ``bounds`` ``(..., 4, n)`` of ``n`` columns and
    ``i`` ``(m, 1)`` rows give ``(..., m, n)``."""
    lower_start, lower_end, upper_start, upper_end = (bounds[..., c, None, :] for c in range(4))
    return ((i >= lower_start) & (i < lower_end)) | ((i >= upper_start) & (i < upper_end))
