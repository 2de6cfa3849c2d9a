"""The split kernel and its combine (kernels/decode/split.py, combine.py): key tiles read through TMA
descriptors, interleaved splits that partition the keys, and the combine's loads and tile sizes."""

import dataclasses

import pytest
import torch

import tileattn
from helpers import check_lse, on
from kvcache_cases import F16, LAYOUTS, _api_plans, _check_case, _check_kvcache_problem, _plans_made, _settings
from kvcache_ref import kvcache_ref
from tileattn.kernels import configs
from tileattn.params import DecodeSettings, interpreting
from tileattn.testing import check_close


def test_tma_reads(backend, monkeypatch):
    """K/V tiles through TMA descriptors (DecodeSettings.tma / paged_tma), which the launcher takes only
    for long programs (forced here: tma_tiles=0): contiguous caches, cache_batch_idx, windows, and paged
    caches whose pages hold whole key tiles (pages of 16 and 32 under the interpreter's 16-key tiles;
    with cache_leftpad the pointer loads)."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    with configs.override(_settings(on(backend)[1], tma_tiles=0, tma=True, paged_tma=True)) as s:
        _check_case(backend, "decode-no-append", "dense", 3)
        _check_case(backend, "batch-idx", "dense", 1)
        _check_case(backend, "window-softcap", "page16", 3)
        _check_case(backend, "chunk-causal-neox", "page16", 1)
        _check_case(backend, "alibi-leftpad", "page16", 3)
        # pages of two tiles: tiles start inside a page (the descriptor row adds the offset in the page)
        monkeypatch.setitem(LAYOUTS, "page32", 32)
        for case in ("decode-no-append", "window-softcap", "chunk-causal-neox"):
            for splits in (1, 3):
                _check_case(backend, case, "page32", splits)
    kernels = [plan[0].constexprs for plan in _api_plans(s)]
    assert any(c["USE_TMA"] and not c["PAGED"] for c in kernels)
    assert any(c["USE_TMA"] and c["PAGED"] for c in kernels) or not interpreting()  # (GPU: pages under a tile)


@pytest.mark.parametrize("per_load", [1, 2, 16])
def test_combine_reads_several_splits_per_load(backend, per_load):
    """The split combine reading its partials one or several splits at a time
    (DecodeSettings.combine_splits_per_load), three splits (a masked tail of the last load) and the
    heuristic's count, rows that see no key included."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    from tileattn.kernels.decode.combine import combine_tiles

    assert combine_tiles(3, 128, DecodeSettings(combine_splits_per_load=per_load))[1] == min(per_load, 4)
    with configs.override(_settings(on(backend)[1], combine_splits_per_load=per_load)) as s:
        _check_case(backend, "decode-no-append", "page4", 3)
        _check_case(backend, "window-softcap", "dense", 3)
        _check_case(backend, "decode-rotary", "dense", 0)
    chunks = {plan[1].constexprs["CHUNK"] for plan in _api_plans(s) if plan[1] is not None}
    assert all(chunk <= per_load for chunk in chunks), chunks
    assert chunks or not interpreting()  # (the GPU's 128-key tiles: one split at these lengths)


@pytest.mark.parametrize("page, unit", [(4, 1), (12, 1), (4, 2), (12, 3)])
def test_interleaved_splits_partition_the_keys(backend, page, unit, monkeypatch):
    """Splits over pages smaller than a key tile take every num_splits-th tile (or, with
    DecodeSettings.interleave_unit, runs of that many tiles in turn): output and LSE against the oracle
    (a tile read by two splits, or by none, moves the LSE), with several tiles per split in
    each mask segment: left and two-sided windows, causal over several query tokens, leftpad, an empty
    sequence, split counts that do not divide the tiles."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    from tileattn import kvcache

    device = on(backend)[1]
    s = _settings(device, interleave_unit=unit)
    kvcache.calls.clear()  # plan every call afresh (earlier tests' plans are kept)
    planned = _plans_made(s)
    block_n = 16 if interpreting() else 128  # (the GPU's 5 and 7 splits take 64-key tiles: more per split)
    b, h, hk, d, cap = 3, 4, 2, 16, 12 * block_n + 8
    pages = -(-cap // page)
    kc = torch.randn(b * pages + 2, page, hk, d, dtype=F16, device=device)
    vc = torch.randn_like(kc)
    table = torch.randperm(b * pages + 2, device=device)[: b * pages].view(b, pages).int()
    seqlens = torch.tensor([0, 8 * block_n + 3, cap], dtype=torch.int32, device=device)
    leftpad = torch.tensor([0, 2 * block_n + 5, 9], dtype=torch.int32, device=device)
    cases = [  # (window, causal, leftpad, query tokens, splits)
        ((6 * block_n, 0), False, True, 1, 3),
        ((4 * block_n + 6, 3 * block_n), False, False, 5, 5),
        ((-1, -1), True, True, 5, 3),
        ((9 * block_n, -1), True, False, 1, 5),
        ((-1, -1), False, False, 1, 7),
        ((cap - 6, -1), False, False, 1, 2),  # the last sequence's unmasked tiles start at tile 1 (mid-run)
    ]
    for window, causal, pad, sq, splits in cases:
        q = torch.randn(b, sq, h, d, dtype=F16, device=device)
        args = dict(cache_seqlens=seqlens, block_table=table, causal=causal, window_size=window)
        if pad:
            args["cache_leftpad"] = leftpad
        ref, lowp = (kvcache_ref(q, kc, vc, precision=p, **args) for p in (torch.float64, None))
        with on(backend)[0], configs.override(s):
            out, lse = tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=splits, return_softmax_lse=True, **args)
        split_kernels = [plan[0].constexprs for plan in planned if plan[0].constexprs["SPLIT"]]
        assert split_kernels and all(c["INTERLEAVE"] and c["UNIT"] == unit for c in split_kernels)
        check_close(f"window {window}, {splits} splits", out, ref.out, lowp.out)
        check_lse(f"window {window}, {splits} splits lse", lse, ref.lse, lowp.lse)


@pytest.mark.parametrize("unit", [1, 2])
def test_interleaved_splits_skip_empty_segments(backend, unit, monkeypatch):
    """A mask segment clamped to the end of a sequence's keys starts inside a tile and is empty: no
    split may read that tile again (found on the GPU by the property test, with runs of two tiles:
    window (0, 0), two keys, pages of 1)."""
    from tileattn import kvcache

    kvcache.calls.clear()
    problem = dict(batch=3, nheads_k=1, nheads=1, headdim=16, seqlen_q=1, seqlen_new=1, capacity=129, page=1)
    problem.update(seqlens=[0, 0, 1], leftpad=[0, 0, 0], rotary=None, causal=False, window=(0, 0), softcap=0.0)
    problem.update(alibi=False, v_padded=False)
    with configs.override(_settings(on(backend)[1], interleave_unit=unit)):
        for splits in (2, 3):
            _check_kvcache_problem(backend, dict(problem, num_splits=splits))


@pytest.mark.parametrize("max_values, max_rows", [(8192, 16), (16384, 16), (16384, 4)])
def test_combine_tiles_stay_small(max_values, max_rows):
    """_combine's [rows, splits, head dim] loads hold at most DecodeSettings.combine_max_values values, in
    powers of two, for any combine_splits_per_load and split count (up to the 128 splits allowed), and
    at most combine_max_rows rows."""
    from tileattn.kernels.decode.combine import combine_tiles

    limits = DecodeSettings(combine_max_values=max_values, combine_max_rows=max_rows)
    for per_load in (1, 3, 16, 128, 1000):
        d = dataclasses.replace(limits, combine_splits_per_load=per_load)
        for splits in (2, 5, 16, 128):
            for block_d in (16, 128, 256):
                rows, chunk = combine_tiles(splits, block_d, d)
                assert rows & (rows - 1) == 0 and chunk & (chunk - 1) == 0
                assert chunk == 1 or rows * chunk * block_d <= max_values, (per_load, splits, block_d, rows, chunk)
                assert chunk <= max(per_load, 1) * 2 and chunk <= 2 * splits
                assert rows <= max_rows
    if max_rows == 16:
        assert combine_tiles(16, 128, limits) == ((8, 16) if max_values == 16384 else (4, 16))  # (1 x 8k's)
