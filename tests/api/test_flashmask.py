"""FlashMask: every builder against the mask it stands for (written here element by element), the
attention under those masks and under random bounds against the tests' oracle (forward, LSE, backward)
on every path, packed batches, the tile schedules against the dense mask (skipped tiles are the fully
hidden ones), and random masks as property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

import oracle
import tileattn
from attention_cases import _cu
from helpers import check_attention, check_lse, interpreter_skips, on, randn, run_property
from tileattn import masks

# --------------------------------------------------------------------------------------------------
# The builders' masks from their definitions: True where row i sees key j
# --------------------------------------------------------------------------------------------------


def _ids(lengths):
    """Each token's segment number."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _definition(name, args):
    if name == "causal_document":
        d = _ids(args[0])
        return (d[:, None] == d[None, :]) & torch.ones(len(d), len(d), dtype=torch.bool).tril()
    if name == "document":
        d = _ids(args[0])
        return d[:, None] == d[None, :]
    if name == "shared_question":
        question, answers = args
        seg = torch.cat([torch.full((question,), -1), _ids(answers)])
        n = len(seg)
        sees = (seg[None, :] == -1) | (seg[:, None] == seg[None, :])
        return sees & torch.ones(n, n, dtype=torch.bool).tril()
    if name == "prefix_lm_causal":
        n, prefix = args
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (j < prefix) | (j <= i)
    if name == "prefix_lm_document":
        lengths, prefixes = args
        d = _ids(lengths)
        starts = torch.tensor([sum(lengths[:b]) for b in range(len(lengths))])
        n = len(d)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        prefix_end = (starts + torch.tensor(prefixes))[d]
        return (d[:, None] == d[None, :]) & ((j < prefix_end[None, :]) | (j <= i))
    if name == "sliding_window":
        n, window = args
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (j <= i) & (j >= i - window)
    if name == "global_sliding_window":
        n, glob, window = args
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (i < glob) | (j < glob) | ((i - j).abs() <= window)
    if name == "causal_blockwise":
        d = _ids(args[0])
        last = len(args[0]) - 1
        n = len(d)
        return ((d[:, None] == d[None, :]) | (d[:, None] == last)) & torch.ones(n, n, dtype=torch.bool).tril()
    raise AssertionError(name)


BUILDERS = {
    # name: (builder, causal flag to pass)
    "causal_document": (masks.causal_document_mask, True),
    "document": (masks.document_mask, False),
    "shared_question": (masks.shared_question_mask, True),
    "prefix_lm_causal": (masks.prefix_lm_causal_mask, False),
    "prefix_lm_document": (masks.prefix_lm_document_mask, False),
    "sliding_window": (masks.sliding_window_mask, True),
    "global_sliding_window": (masks.global_sliding_window_mask, False),
    "causal_blockwise": (masks.causal_blockwise_mask, True),
}

# odd sizes: single tokens, 63, 113, segments that straddle tiles
BUILDER_CASES = [
    ("causal_document", ([1],)),
    ("causal_document", ([40, 23],)),
    ("causal_document", ([13, 1, 50, 49],)),
    ("document", ([63],)),
    ("document", ([13, 1, 50, 49],)),
    ("shared_question", (1, [1])),
    ("shared_question", (30, [20, 40, 23])),
    ("prefix_lm_causal", (113, 0)),
    ("prefix_lm_causal", (113, 50)),
    ("prefix_lm_causal", (63, 63)),
    ("prefix_lm_document", ([40, 73], [10, 0])),
    ("prefix_lm_document", ([1, 62], [1, 30])),
    ("sliding_window", (113, 0)),
    ("sliding_window", (113, 17)),
    ("sliding_window", (63, 100)),
    ("global_sliding_window", (113, 3, 10)),
    ("global_sliding_window", (63, 0, 5)),
    ("global_sliding_window", (40, 40, 1)),
    ("causal_blockwise", ([10, 20, 33],)),
    ("causal_blockwise", ([63],)),
    ("causal_blockwise", ([1, 1, 111],)),
]


def _case_id(case):
    return f"{case[0]}{list(case[1])}".replace(" ", "")


def _built(case):
    name, args = case
    builder, causal = BUILDERS[name]
    return builder(*args), causal


def _causal_visible(n_q, n_k):
    """The causal mask (bottom-right aligned) as the oracle's window draws it."""
    return oracle.visible(n_q, n_k, None, 0, n_q, n_k)


@pytest.mark.parametrize("case", BUILDER_CASES, ids=_case_id)
def test_builder_is_the_mask_it_stands_for(case):
    idx, causal = _built(case)
    expected = _definition(*case)
    n = expected.shape[0]
    assert idx.dtype == torch.int32 and idx.shape[:3] == (1, 1, n) and idx.shape[3] in (1, 2, 4)
    seen = oracle.flashmask_visible(idx, causal, n)[0, 0]
    if causal:
        seen = seen & _causal_visible(n, n)
    assert torch.equal(seen, expected), f"{_case_id(case)}: built\n{seen.int()}\nexpected\n{expected.int()}"


def test_builders_refuse_bad_arguments():
    with pytest.raises(ValueError, match="seqlens"):
        masks.causal_document_mask([3, 0])
    with pytest.raises(ValueError, match="prefix_lens"):
        masks.prefix_lm_document_mask([3, 2], [4, 0])
    with pytest.raises(ValueError, match="window"):
        masks.sliding_window_mask(8, -1)


# --------------------------------------------------------------------------------------------------
# Attention under a FlashMask against the oracle
# --------------------------------------------------------------------------------------------------


def _check(backend, name, q, k, v, idx, causal, *, window_size=(-1, -1), dtype=None):
    """One flashmask_attention call, forward (and LSE) and backward, against the oracle with the mask."""
    ctx, device = on(backend)
    dout = torch.randn_like(q)
    with ctx:
        out, lse = tileattn.flashmask_attention(
            q, k, v, idx.to(device), causal=causal, window_size=window_size, return_softmax_lse=True
        )
        grads = torch.autograd.grad(out, (q, k, v), dout)
    seen = oracle.flashmask_visible(idx.cpu(), causal, q.shape[1])
    kw = dict(causal=causal, window_size=window_size, visible_mask=seen)
    check_attention(name, out, grads, q, k, v, dout, kw)
    ref = oracle.attention(q.detach(), k.detach(), v.detach(), **kw)
    ref_lowp = oracle.attention(q.detach(), k.detach(), v.detach(), precision=None, **kw)
    check_lse(f"{name} lse", lse, ref.lse, ref_lowp.lse)
    return out, grads


HEAD_DIMS = [40, 59, 96, 111]


@pytest.mark.parametrize("case", BUILDER_CASES, ids=_case_id)
def test_builder_masks_match_oracle(backend, case):
    """Every builder's mask, forward and backward, GQA (4 query heads on 2 kv heads), the odd head dims."""
    idx, causal = _built(case)
    n = idx.shape[2]
    _, device = on(backend)
    d = HEAD_DIMS[BUILDER_CASES.index(case) % len(HEAD_DIMS)]
    q = randn(1, n, 4, d, dtype=torch.float16, device=device)
    k = randn(1, n, 2, d, dtype=torch.float16, device=device)
    v = randn(1, n, 2, d, dtype=torch.float16, device=device)
    _check(backend, _case_id(case), q, k, v, idx, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_batch_of_masks_and_long_sequence(backend, dtype):
    """A batch whose sequences have different documents, 1025 tokens (skipped under the interpreter,
    whose 2-core CI run it would take minutes), bf16 and fp16."""
    interpreter_skips(backend, dtype)
    if backend == "interpret":
        pytest.skip("1025 tokens under the interpreter: the kernels' paths are covered at smaller sizes")
    _, device = on(backend)
    idx = torch.cat([masks.causal_document_mask([500, 1, 524]), masks.causal_document_mask([1025])])
    q = randn(2, 1025, 2, 64, dtype=dtype, device=device)
    k = randn(2, 1025, 1, 64, dtype=dtype, device=device)
    v = randn(2, 1025, 1, 64, dtype=dtype, device=device)
    _check(backend, "batch 1025", q, k, v, idx, True)


@pytest.mark.parametrize(
    "columns,causal,seqlen_q,seqlen_k",
    [(1, True, 37, 70), (2, True, 70, 37), (2, False, 45, 45), (4, False, 37, 70), (4, False, 1, 63)],
    ids=lambda x: str(x),
)
def test_random_bounds_per_head(backend, columns, causal, seqlen_q, seqlen_k):
    """Random bounds, one mask per query head, seqlen_q != seqlen_k (the causal diagonal bottom-right)."""
    _, device = on(backend)
    nheads = 3
    idx = _random_bounds(
        torch.Generator().manual_seed(seqlen_q * columns), 2, nheads, seqlen_k, columns, causal, seqlen_q
    )
    q = randn(2, seqlen_q, nheads, 32, dtype=torch.float16, device=device)
    k = randn(2, seqlen_k, 1, 32, dtype=torch.float16, device=device)
    v = randn(2, seqlen_k, 1, 32, dtype=torch.float16, device=device)
    _check(backend, f"random C{columns}", q, k, v, idx, causal)


def _random_bounds(gen, batch, heads, seqlen_k, columns, causal, seqlen_q):
    """Valid random ``startend_row_indices``: values in [0, seqlen_q], starts at most their ends."""
    vals = torch.randint(0, seqlen_q + 1, (batch, heads, seqlen_k, columns), generator=gen)
    if columns == 4 or (columns == 2 and causal):
        vals[..., :2] = vals[..., :2].sort(-1).values
    if columns == 4:
        vals[..., 2:] = vals[..., 2:].sort(-1).values
    return vals.to(torch.int32)


def test_rows_that_see_nothing_output_zero(backend):
    """Rows 5..19 hidden from every key, and a whole head hidden: output 0, LSE +inf, gradients 0, no NaN."""
    _, device = on(backend)
    n = 40
    idx = torch.zeros(1, 2, n, 4, dtype=torch.int32)
    idx[:, 0, :, 0], idx[:, 0, :, 1] = 5, 20  # head 0: rows [5, 20) hidden
    idx[:, 1, :, 0], idx[:, 1, :, 1] = 0, n  # head 1: every row hidden
    q = randn(1, n, 2, 32, dtype=torch.float16, device=device)
    k = randn(1, n, 2, 32, dtype=torch.float16, device=device)
    v = randn(1, n, 2, 32, dtype=torch.float16, device=device)
    out, grads = _check(backend, "hidden rows", q, k, v, idx, False)
    assert not out.isnan().any() and (out[0, 5:20, 0] == 0).all() and (out[0, :, 1] == 0).all()
    assert all(not g.isnan().any() for g in grads) and (grads[1][0, :, 1] == 0).all()


def test_window_on_top_of_mask(backend):
    _, device = on(backend)
    idx = masks.causal_document_mask([30, 47, 36])
    q = randn(1, 113, 2, 48, dtype=torch.float16, device=device)
    k = randn(1, 113, 2, 48, dtype=torch.float16, device=device)
    v = randn(1, 113, 2, 48, dtype=torch.float16, device=device)
    _check(backend, "window", q, k, v, idx, True, window_size=(9, 0))


def test_dropout_under_a_mask(backend):
    """Dropout draws are the unmasked call's (the same seed gives flash_attn_func's S_dmask, whose sign is the
    keep mask); the masked output is the oracle's with that keep mask."""
    ctx, device = on(backend)
    n, p = 70, 0.25
    idx = masks.causal_blockwise_mask([20, 15, 35])
    q = randn(1, n, 2, 32, dtype=torch.float16, device=device)
    k = randn(1, n, 2, 32, dtype=torch.float16, device=device)
    with ctx:
        torch.manual_seed(7)
        out = tileattn.flashmask_attention(q, k, k, idx.to(device), causal=True, dropout_p=p)
        torch.manual_seed(7)
        _, _, s_dmask = tileattn.flash_attn_func(q, k, k, dropout_p=p, causal=True, return_attn_probs=True)
    kw = dict(causal=True, dropout_p=p, dropout_mask=s_dmask >= 0, visible_mask=oracle.flashmask_visible(idx, True, n))
    check_attention("dropout", out, None, q, k, k, None, kw, check_grads=False)


def test_varlen(backend):
    """A packed batch (an empty sequence and a single token among them), each sequence under its own
    builder's mask, forward and backward, against the oracle per sequence."""
    _, device = on(backend)
    ctx, _ = on(backend)
    lengths = [33, 0, 1, 70]
    built = [
        masks.causal_document_mask([20, 13]),
        torch.zeros(1, 1, 0, 1, dtype=torch.int32),
        masks.causal_document_mask([1]),
        masks.shared_question_mask(10, [30, 30]),
    ]
    idx = torch.cat([b[0, 0] for b in built]).unsqueeze(0)  # (1, total_k, 1)
    cu = _cu(lengths, device)
    total = sum(lengths)
    q = randn(total, 4, 40, dtype=torch.float16, device=device)
    k = randn(total, 2, 40, dtype=torch.float16, device=device)
    v = randn(total, 2, 40, dtype=torch.float16, device=device)
    dout = torch.randn_like(q)
    with ctx:
        out = tileattn.flashmask_varlen_attention(q, k, v, cu, cu, 70, 70, idx.to(device), causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    seen = [oracle.flashmask_visible(b, True, b.shape[2]) for b in built]
    check_attention("varlen", out, grads, q, k, v, dout, dict(causal=True, visible_masks=seen), varlen=(cu, cu, 70))


# --------------------------------------------------------------------------------------------------
# Tile schedules
# --------------------------------------------------------------------------------------------------


def _schedule(idx, causal, seqlen_q, block_m, block_n, by_keys):
    from tileattn import flashmask
    from tileattn.kernels.flashmask import build_tile_runs, key_tile_stats
    from tileattn.params import AttnParams, cdiv

    batch, _, seqlen_k, _ = idx.shape
    # (the build kernels run where the attention would: the GPU if there is one, else the interpreter)
    idx = idx.to("cuda" if torch.cuda.is_available() else "cpu")
    p = AttnParams(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, headdim=32, softmax_scale=1.0,
        window_right=0 if causal else -1, flashmask=flashmask.canonical(idx, causal, varlen=False),
    )  # fmt: skip
    per_seq = cdiv(seqlen_k if by_keys else seqlen_q, block_n if by_keys else block_m)
    return build_tile_runs(p, block_m, block_n, by_keys, batch * per_seq, key_tile_stats(p, block_n))


@pytest.mark.parametrize("by_keys", [False, True], ids=["by-queries", "by-keys"])
@pytest.mark.parametrize("case", BUILDER_CASES, ids=_case_id)
def test_schedule_skips_exactly_the_hidden_tiles(case, by_keys):
    """For every builder's mask: each tile with a visible element is listed (as full only if all of its
    elements are visible and its loads need no row mask), and every tile the mask hides entirely is skipped."""
    idx, causal = _built(case)
    n = idx.shape[2]
    seen = oracle.flashmask_visible(idx, causal, n)[0, 0]
    if causal:
        seen = seen & _causal_visible(n, n)
    bm, bn = 16, 32
    runs, counts = _schedule(idx, causal, n, bm, bn, by_keys)
    for prog in range(runs.shape[1]):
        n_partial, n_full = counts[0, prog].tolist()
        kinds = {}
        for r, (first, end) in enumerate(runs[0, prog, : n_partial + n_full].tolist()):
            assert first < end, f"{_case_id(case)}: empty run"
            for tile in range(first, end):
                assert tile not in kinds, f"{_case_id(case)}: tile {tile} in two runs"
                kinds[tile] = "partial" if r < n_partial else "full"
        for other in range(-(-n // (bm if by_keys else bn))):
            m, kb = (other, prog) if by_keys else (prog, other)
            block = seen[m * bm : (m + 1) * bm, kb * bn : (kb + 1) * bn]
            kind = kinds.get(other, "skipped")
            where = f"{_case_id(case)} rows {m * bm} keys {kb * bn}: {kind}"
            if block.any():
                assert kind != "skipped", where
            else:
                assert kind == "skipped", where
            if kind == "full":  # (ragged key tiles, and ragged query tiles of a dK/dV program, need the mask)
                assert block.all() and block.shape[1] == bn and (block.shape[0] == bm or not by_keys), where


def test_schedules_remembered_per_mask_tensor():
    """A model's layers pass one mask tensor: its schedule is built once per launch shape, and again after the
    tensor changes in place."""
    from tileattn import flashmask
    from tileattn.kernels import flashmask as kernel_flashmask
    from tileattn.params import AttnParams

    # (the build kernels run where the attention would: the GPU if there is one, else the interpreter)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    idx = masks.causal_document_mask([20, 43]).to(device)

    def schedule(by_keys=False):
        p = AttnParams(
            batch=1, seqlen_q=63, seqlen_k=63, headdim=32, softmax_scale=1.0, window_right=0,
            startend_row_indices=idx, mask_causal=True, flashmask=flashmask.canonical(idx, True, varlen=False),
        )  # fmt: skip
        return kernel_flashmask.tile_runs(p, 16, 32, by_keys, 2 if by_keys else 4, device)

    first = schedule()
    built = kernel_flashmask.SCHEDULES.runs
    assert schedule()[0] is first[0] and kernel_flashmask.SCHEDULES.runs == built
    schedule(by_keys=True)  # (the key tiles' statistics are shared: the schedule alone is built)
    assert kernel_flashmask.SCHEDULES.runs == built + 1
    idx[0, 0, 5, 0] = 7
    again = schedule()  # (statistics and schedule again)
    assert again[0] is not first[0] and kernel_flashmask.SCHEDULES.runs == built + 3


# --------------------------------------------------------------------------------------------------
# Property tests: random builder parameters and random raw bounds
# --------------------------------------------------------------------------------------------------


@st.composite
def _masks(draw):
    """(startend_row_indices, causal, seqlen_q, nheads): a builder with random arguments or random bounds."""
    kind = draw(st.sampled_from(["raw", *BUILDERS]))
    n = draw(st.integers(1, 80))
    if kind == "raw":
        columns, causal = draw(st.sampled_from([(1, True), (2, True), (2, False), (4, False)]))
        heads = draw(st.sampled_from([1, 2]))
        seed = draw(st.integers(0, 2**16))
        return _random_bounds(torch.Generator().manual_seed(seed), 1, heads, n, columns, causal, n), causal, n, 2

    def cuts(total):
        points = sorted(draw(st.sets(st.integers(1, total - 1), max_size=4))) if total > 1 else []
        return [b - a for a, b in zip([0, *points], [*points, total])]

    builder, causal = BUILDERS[kind]
    if kind in ("causal_document", "document", "causal_blockwise"):
        args = (cuts(n),)
    elif kind == "shared_question":
        question = draw(st.integers(1, n))
        args = (question, cuts(n - question)) if n > question else (n - 1 or 1, [1])
    elif kind == "prefix_lm_causal":
        args = (n, draw(st.integers(0, n)))
    elif kind == "prefix_lm_document":
        lengths = cuts(n)
        args = (lengths, [draw(st.integers(0, length)) for length in lengths])
    elif kind == "sliding_window":
        args = (n, draw(st.integers(0, n)))
    else:
        args = (n, draw(st.integers(0, n)), draw(st.integers(0, n)))
    idx = builder(*args)
    return idx, causal, idx.shape[2], 2


def _property_check(backend, example):
    idx, causal, n, nheads = example
    _, device = on(backend)
    q = randn(1, n, nheads, 24, dtype=torch.float16, device=device)
    k = randn(1, n, 1, 24, dtype=torch.float16, device=device)
    v = randn(1, n, 1, 24, dtype=torch.float16, device=device)
    _check(backend, "property", q, k, v, idx, causal)


@pytest.mark.parametrize("shard", range(2))
def test_random_masks(backend, shard):
    run_property(_property_check, _masks(), {"cuda": 40, "torch": 25, "interpret": 6}, backend, shard)
