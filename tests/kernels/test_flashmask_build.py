"""kernels/flashmask.py, what a new mask costs on the device: its kernels' form and value checks in one
launch (against ``tileattn.flashmask.canonical`` and ``checks.flashmask_values``, the CPU path's), and the
tile schedules of two launches (key tiles' statistics, then each program's runs) against
``reference_tile_runs``, the same rules in torch ops, on dense and packed batches with ragged and empty
sequences, one mask per head or one for all, every C, windows, both sides (programs owning query tiles
or key tiles), spare programs, and more list tiles than a chunk holds. (tests/api/test_flashmask.py
checks the schedules against the dense mask itself.)"""

import dataclasses
import itertools

import pytest
import torch

from tileattn import checks, flashmask
from tileattn.kernels import flashmask as kernel_flashmask
from tileattn.params import AttnParams, FlashMask, cdiv

CPU = torch.device("cpu")
# where the kernels run: the GPU, or the CPU under Triton's interpreter (the references run on the CPU)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (varlen, heads, C, causal, window, block_m, block_n, lengths): lengths of (query, key) per sequence
CASES = [
    (False, 1, 1, True, (-1, 0), 16, 32, [(63, 63)] * 2),
    (False, 3, 2, True, (-1, 0), 32, 16, [(40, 75)]),
    (False, 1, 2, False, (-1, -1), 16, 16, [(75, 40)] * 3),
    (False, 2, 4, False, (5, 3), 16, 32, [(90, 90)]),
    (True, 1, 1, True, (-1, 0), 16, 16, [(20, 20), (0, 7), (45, 45), (1, 1)]),
    (True, 3, 4, False, (-1, -1), 32, 16, [(33, 50), (70, 12), (16, 16)]),
    (True, 1, 2, False, (20, 30), 16, 32, [(64, 64), (3, 40), (57, 9)]),
    (True, 2, 2, True, (12, 0), 16, 16, [(1, 30), (48, 48)]),
]


def _id(case):
    varlen, heads, c, causal, (left, right), bm, bn, lengths = case
    form = "varlen" if varlen else "dense"
    return f"{form}-H{heads}-C{c}-{'causal' if causal else 'full'}-W{left},{right}-M{bm}N{bn}-B{len(lengths)}"


def _params(case, seed):
    """A call's AttnParams with a random FlashMask of the case's mode (intervals sorted where a mode needs
    start <= end), and the padding tokens past the last sequence a packed batch may carry."""
    varlen, heads, c, causal, (left, right), _, _, lengths = case
    g = torch.Generator().manual_seed(seed)
    lq, lk = zip(*lengths)
    seqlen_q, seqlen_k = max(lq), max(lk)
    if varlen:
        cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
        cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
        idx = torch.randint(0, seqlen_q + 1, (heads, int(cu_k[-1]) + 5, c), generator=g, dtype=torch.int32)
    else:
        cu_q = cu_k = None
        idx = torch.randint(0, seqlen_q + 1, (len(lengths), heads, seqlen_k, c), generator=g, dtype=torch.int32)
    if c == 4 or (c == 2 and causal):  # ([start, end) pairs: start <= end)
        idx = idx.sort(-1).values
    # most columns hide no row, so that whole tiles are full and the rules for ragged tiles matter
    none = torch.full_like(idx, seqlen_q)
    if c == 2 and not causal:
        none[..., 1] = 0  # (i < UTE hides nothing)
    groups = torch.rand((*idx.shape[:-2], cdiv(idx.shape[-2], 8)), generator=g) < 0.7  # (8 columns at a time)
    idx = torch.where(groups.repeat_interleave(8, -1)[..., : idx.shape[-2], None], none, idx)
    return AttnParams(
        batch=len(lengths), seqlen_q=seqlen_q, seqlen_k=seqlen_k, headdim=32, softmax_scale=1.0,
        window_left=left, window_right=right, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        flashmask=flashmask.canonical(idx, causal, varlen),
    )  # fmt: skip


def _programs(p, block, by_keys):
    """A launch's programs: dense, batch times the tiles; packed, ``cdiv(total, block) + batch`` (spare
    programs at the end), as the kernels' grids."""
    if not p.is_varlen:
        return p.batch * cdiv(p.seqlen_k if by_keys else p.seqlen_q, block)
    cu = p.cu_seqlens_k if by_keys else p.cu_seqlens_q
    return cdiv(int(cu[-1]), block) + p.batch


def _on_device(p):
    """``p`` with its mask and cu_seqlens on ``DEVICE``."""

    def move(t):
        return None if t is None else t.to(DEVICE)

    fm = FlashMask(p.flashmask.bounds.to(DEVICE), p.flashmask.has_upper)
    return dataclasses.replace(p, flashmask=fm, cu_seqlens_q=move(p.cu_seqlens_q), cu_seqlens_k=move(p.cu_seqlens_k))


def _check_equal(p, block_m, block_n, by_keys):
    programs = _programs(p, block_n if by_keys else block_m, by_keys)
    want_runs, want_counts = kernel_flashmask.reference_tile_runs(p, block_m, block_n, by_keys, programs, CPU)
    on = _on_device(p)
    stats = kernel_flashmask.key_tile_stats(on, block_n)
    runs, counts = (t.cpu() for t in kernel_flashmask.build_tile_runs(on, block_m, block_n, by_keys, programs, stats))
    assert torch.equal(counts, want_counts), f"counts: {counts.tolist()} != {want_counts.tolist()}"
    for h, t in itertools.product(range(counts.shape[0]), range(programs)):
        n = int(counts[h, t].sum())
        got, want = runs[h, t, :n].tolist(), want_runs[h, t, :n].tolist()
        assert got == want, f"head {h} program {t}: runs {got} != {want}"


@pytest.mark.parametrize("by_keys", [False, True], ids=["by-queries", "by-keys"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_schedule_matches_reference(case, by_keys):
    p = _params(case, seed=len(_id(case)))
    _check_equal(p, case[5], case[6], by_keys)


def test_schedule_past_one_chunk(monkeypatch):
    """More list tiles and more sequences than one chunk: the kernels loop, carrying ranks and tile counts."""
    monkeypatch.setattr(kernel_flashmask, "LIST_CHUNK", 16)
    monkeypatch.setattr(kernel_flashmask, "SEQ_CHUNK", 16)
    lengths = [(5 + 3 * i, 9 + 2 * i) for i in range(18)] + [(300, 260)]
    p = _params((True, 1, 2, False, (-1, -1), 16, 16, lengths), seed=3)
    for by_keys in (False, True):
        _check_equal(p, 16, 16, by_keys)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="32k tokens at the kernels' tile sizes: too slow for the interpreter")
def test_schedule_at_scale():
    """The launches' own tile sizes on 32k tokens: one causal document mask, and a packed batch of 41
    sequences with two mask heads."""
    from tileattn import masks

    idx = masks.causal_document_mask([4000, 9000, 123, 19645])
    p = AttnParams(
        batch=1, seqlen_q=32768, seqlen_k=32768, headdim=128, softmax_scale=1.0, window_right=0,
        flashmask=flashmask.canonical(idx, True, varlen=False),
    )  # fmt: skip
    for block_m, block_n, by_keys in ((128, 128, False), (128, 64, True), (64, 128, False)):
        _check_equal(p, block_m, block_n, by_keys)
    lengths = [(5 + 37 * i, 9 + 29 * i) for i in range(40)] + [(3000, 2600)]
    p = _params((True, 2, 2, False, (-1, -1), 64, 64, lengths), seed=3)
    for block_m, block_n, by_keys in ((128, 64, False), (64, 128, True)):
        _check_equal(p, block_m, block_n, by_keys)


# --------------------------------------------------------------------------------------------------
# The kernels' form and the value checks
# --------------------------------------------------------------------------------------------------

MODES = [(1, True), (2, True), (2, False), (4, False)]


def _error(fn, *args):
    try:
        fn(*args)
    except checks.InvalidArgument as e:
        return str(e)
    return None


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"C{m[0]}-{'causal' if m[1] else 'full'}")
def test_canonical_matches_the_cpu_path(mode, varlen):
    """Bounds equal to the torch conversion's on valid masks (a non-contiguous view too); on masks with a
    value out of range or a start past its end, the same error as the host check's."""
    c, causal = mode
    g = torch.Generator().manual_seed(c + 2 * causal + 4 * varlen)
    seqlen_q = 37
    shape = (3, 1500, c) if varlen else (2, 3, 700, c)  # (more tokens than one program's block)
    idx = torch.randint(0, seqlen_q + 1, shape, generator=g, dtype=torch.int32)
    if c == 4 or (c == 2 and causal):
        idx = idx.sort(-1).values
    views = [idx, idx.transpose(-2, -3).contiguous().transpose(-2, -3)]  # (strides of another layout)
    for view in views:
        got = kernel_flashmask.canonical(view.to(DEVICE), causal, varlen, seqlen_q)
        want = flashmask.canonical(view, causal, varlen)
        assert torch.equal(got.bounds.cpu(), want.bounds) and got.has_upper == want.has_upper
    bad = [(0, 5, seqlen_q + 3), (0, 9, -2)]  # (flat column, bound, value)
    if c == 4 or (c == 2 and causal):
        bad.append((0, 11, None))  # start past its end
    if c == 4:
        bad.append((2, 13, None))
    for bound, column, value in bad:
        broken = idx.clone()
        flat = broken.view(-1, c)
        if value is None:
            flat[column, bound], flat[column, bound + 1] = 20, 10
            flat[column + 200, bound], flat[column + 200, bound + 1] = 30, 4  # (the first one is named)
        else:
            flat[column * 7, bound] = value
        want = _error(checks.flashmask_values, broken, causal, seqlen_q)
        assert want is not None
        assert _error(kernel_flashmask.canonical, broken.to(DEVICE), causal, varlen, seqlen_q) == want
