"""Where the decode kernel finds its keys (kernels/decode/paging.py): the page lookups against the
reference (per row, pages that divide a key tile or hold whole ones, the table read one tile ahead or in
the same iteration), table entries outside the pool clamped to it, entries past a sequence never read,
and cache offsets that widen to 64 bits only past int32."""

import dataclasses

import pytest
import torch

import oracle
import tileattn
from helpers import on
from kvcache_cases import (
    F16,
    LAYOUTS,
    _api_plans,
    _check_case,
    _check_kvcache_problem,
    _inputs,
    _kernel_device,
    _plans_made,
    _ref_args,
    _settings,
)
from kvcache_ref import dense_view, kvcache_ref
from tileattn.kernels import configs
from tileattn.params import AttnParams, CacheLayout, DecodeSettings, interpreting
from tileattn.testing import check_close


def test_paged_lookup_inside_the_loop(backend):
    """The full-occupancy variant of the paged kernel (block table read in the same iteration as the
    tile, not one ahead), forced by settings that count on a GPU of a single SM."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    with configs.override(_settings(on(backend)[1], sm_count=1)) as s:
        _check_case(backend, "chunk-causal-neox", "page4", 3)
        _check_case(backend, "alibi-leftpad", "page16", 1)
    planned = _api_plans(s)
    assert planned and not any(plan[0].constexprs["PREFETCH_TABLE"] for plan in planned)


@pytest.mark.parametrize("page", [4, 12, 16, 32])
def test_attention_kernel_clamps_bad_pages(page):
    """What runs under CUDA graph capture, where the API cannot read the block table: the attention
    kernel reads a page number outside the pool (negative or past it) as the pool's last page, never
    memory outside it. Pages of 4 (dividing the interpreter's 16-key tile), 12 (neither dividing it nor
    a multiple of it) and 16 / 32 (whole tiles) take the kernel's three lookups. Called directly,
    bypassing validation."""
    device = _kernel_device()
    from tileattn.kernels import decode

    gen = torch.Generator(device=device).manual_seed(0)
    blocks, num_pages = 3, 5
    q = torch.randn(2, 1, 4, 16, dtype=F16, device=device, generator=gen)
    kp, vp = (torch.randn(num_pages, page, 2, 16, dtype=F16, device=device, generator=gen) for _ in range(2))
    table = torch.tensor([[0, -1, 3], [num_pages, 2, -7]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([3 * page - 1, 2 * page + 1], dtype=torch.int32, device=device)
    p = AttnParams(batch=2, seqlen_q=1, seqlen_k=blocks * page, headdim=16, softmax_scale=0.25)
    for splits in (1, 2):
        c = CacheLayout(seqlens_k=seqlens, block_table=table, max_seqlen_k=blocks * page, num_splits=splits)
        out, _ = decode.attn_fwd_kvcache(q, kp, vp, p, c, configs.current(q.device))
        read = torch.where((table >= 0) & (table < num_pages), table, num_pages - 1)
        k_all, v_all = (dense_view(pool, read, blocks * page) for pool in (kp, vp))
        for b in range(2):
            n = int(seqlens[b])
            k, v = k_all[b : b + 1, :n], v_all[b : b + 1, :n]
            ref = oracle.attention(q[b : b + 1], k, v, softmax_scale=0.25).out
            low = oracle.attention(q[b : b + 1], k, v, softmax_scale=0.25, precision=None).out
            check_close(f"pages of {page}, splits {splits}, sequence {b}", out[b : b + 1], ref, low)


def test_offsets_widen_only_past_int32():
    """The decode kernel computes cache offsets in int32 unless one could pass 2**31 (paging.
    offsets_past_int32, from shapes and strides: meta tensors, nothing allocated). The kv head's and
    (contiguous caches) the cache row's starts are int64 in the kernel, so only pages, slots or positions
    and the head dim count; the plan widens them when either cache needs it (its OFFS_64), or for every
    call with DecodeSettings.offs_64_always."""
    from tileattn.kernels.decode import paging, plan

    def cache(shape, strides):
        return torch.empty_strided(shape, strides, dtype=F16, device="meta")

    def pool(pages, stride=16384):
        return cache((pages, 16, 8, 128), (stride, 1024, 128, 1))

    assert not paging.offsets_past_int32(pool(131072), True)  # the last element at 2**31 - 1
    assert paging.offsets_past_int32(pool(131073), True)
    assert paging.offsets_past_int32(pool(2, stride=2**31), True)
    # kv heads outermost: the head's start does not count
    assert not paging.offsets_past_int32(cache((131072, 16, 8, 128), (2048, 128, 2**28, 1)), True)
    assert not paging.offsets_past_int32(cache((0, 16, 8, 128), (16384, 1024, 128, 1)), True)
    # contiguous caches: one row of 2**31 + 1024 elements, against many rows of fewer
    assert paging.offsets_past_int32(cache((1, 2**21 + 1, 8, 128), (0, 1024, 128, 1)), False)
    assert not paging.offsets_past_int32(cache((64, 2**21, 8, 128), (2**31, 1024, 128, 1)), False)

    def offs_64(k_cache, v_cache, **changes):
        q = torch.empty(1, 1, 8, 128, dtype=F16, device="meta")
        table = torch.zeros(1, 4, dtype=torch.int32, device="meta")
        c = CacheLayout(seqlens_k=torch.zeros(1, dtype=torch.int32, device="meta"), block_table=table, max_seqlen_k=64)
        p = AttnParams(batch=1, seqlen_q=1, seqlen_k=64, headdim=128, softmax_scale=0.1)
        s = dataclasses.replace(configs.INTERPRETER, decode=DecodeSettings(**changes))
        return plan.plan_call(q, k_cache, v_cache, p, c, s)[0].constexprs["OFFS_64"]

    small, large = pool(16), pool(131073)
    assert not offs_64(small, small) and offs_64(small, large) and offs_64(large, small)
    assert offs_64(small, small, offs_64_always=True)


@pytest.mark.parametrize("bad", ["split", "general", "prefetch-off", "offsets-64"])
def test_paged_lookup_branches(backend, bad, monkeypatch):
    """The attention kernel's page lookups against the reference (``paging.cache_rows``): pages of 12 and
    24 (neither dividing the interpreter's 16-key tile nor a multiple of it: the per-row lookup), pages
    that divide it (4) or hold whole tiles (16, 32); the table read in the same iteration (no lookahead,
    unmasked reads in unmasked tiles: DecodeSettings.paged_prefetch_waves=0); 64-bit offsets forced on
    small caches (offs_64_always; test_offsets_widen_only_past_int32 checks that either cache widens
    them). With leftpad, windows, chunks and splits."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    from tileattn import kvcache

    kvcache.calls.clear()  # plan every call afresh (earlier tests' plans are kept)
    layouts = {"split": ["page4"], "general": ["page12", "page24"], "prefetch-off": ["page4", "page16"]}
    layouts["offsets-64"] = ["dense", "page4", "page12", "page16", "page32"]
    for name, page in (("page12", 12), ("page24", 24), ("page32", 32)):
        monkeypatch.setitem(LAYOUTS, name, page)
    changes = {"prefetch-off": {"paged_prefetch_waves": 0}, "offsets-64": {"offs_64_always": True}}
    with configs.override(_settings(on(backend)[1], **changes.get(bad, {}))) as s:
        planned = _plans_made(s)
        for layout in layouts[bad]:
            for case, splits in (("window-softcap", 3), ("alibi-leftpad", 1), ("chunk-causal-neox", 3)):
                _check_case(backend, case, layout, splits)
        if bad == "offsets-64":  # v_cache with other strides than k_cache's (no shared row offsets)
            for page, leftpad in ((None, None), (4, [0, 3]), (12, [2, 0]), (32, None)):
                problem = dict(batch=2, nheads_k=2, nheads=4, headdim=16, seqlen_q=2, seqlen_new=2, capacity=40)
                problem.update(page=page, seqlens=[30, 9], leftpad=leftpad, rotary="neox", causal=True)
                problem.update(window=(-1, -1), softcap=0.0, alibi=False, num_splits=3, v_padded=True)
                _check_kvcache_problem(backend, problem)
    assert planned and all(plan[0].constexprs["OFFS_64"] == (bad == "offsets-64") for plan in planned)
    # splits over pages smaller than a key tile take every num_splits-th tile; the others consecutive ones
    kernels = [plan[0].constexprs for plan in planned]
    assert all(c["INTERLEAVE"] == (c["SPLIT"] and c["PAGED"] and c["PAGE_SIZE"] < c["BLOCK_N"]) for c in kernels)
    assert any(c["INTERLEAVE"] for c in kernels) or not interpreting()  # (the GPU's 128-key tiles: one split)
    if bad == "prefetch-off":
        assert not any(c["PREFETCH_TABLE"] or c["TABLE_TO_L2"] for c in kernels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="caches of 4-10 GiB on the GPU")
@pytest.mark.parametrize("layout", ["pages16", "pages256", "heads-outer", "pages16-heads-outer"])
def test_cache_offsets_past_int32(layout, big_gpu_memory):
    """Caches of more than 2**31 elements, keys stored past element 2**31 read where they are, against
    the reference:
    - a pool of pages of 16 or 256 (x 8 heads x 128) read at its last pages: 64-bit offsets (OFFS_64);
    - kv heads outermost (a contiguous cache, and a pool of pages of 16): the last kv head starts past
      2**31 while offsets within a head fit int32, so the head's start is what must be 64-bit."""
    planned = _plans_made()
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    if layout == "heads-outer":
        capacity = 2**21 + 2**19  # head 7 starts at 7 * 2 * capacity * 128 > 2**31 (10 GiB per cache)
        kc, vc = (torch.zeros(8, 2, capacity, 128, **bf16).permute(1, 2, 0, 3) for _ in range(2))
        start = torch.tensor([5, capacity - 300], dtype=torch.int32, device=dev)
        seqlens = torch.tensor([400, capacity - 3], dtype=torch.int32, device=dev)
        for c in (kc, vc):
            c[0, :400].normal_(generator=gen)
            c[1, capacity - 300 :].normal_(generator=gen)
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, cache_leftpad=start)
        keys = [tuple(c[b : b + 1, int(start[b]) : int(seqlens[b])] for c in (kc, vc)) for b in range(2)]
        widened = False
    else:
        page = 256 if layout == "pages256" else 16
        if layout == "pages16-heads-outer":
            pages = (2**21 + 2**19) // page
            kc, vc = (torch.zeros(8, pages, page, 128, **bf16).permute(1, 2, 0, 3) for _ in range(2))
        else:
            pages = 2**31 // (page * 1024) + 1
            kc, vc = (torch.zeros(pages, page, 8, 128, **bf16) for _ in range(2))
        per_seq = 4096 // page
        table = torch.arange(pages - 2 * per_seq, pages, device=dev, dtype=torch.int32).flip(0).view(2, per_seq)
        for c in (kc, vc):
            c[pages - 2 * per_seq :].normal_(generator=gen)
        seqlens = torch.tensor([4000, 1111], dtype=torch.int32, device=dev)
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)
        k_all, v_all = (dense_view(pool, table, 4096) for pool in (kc, vc))
        keys = [(k_all[b : b + 1, : int(seqlens[b])], v_all[b : b + 1, : int(seqlens[b])]) for b in range(2)]
        widened = layout != "pages16-heads-outer"
    assert planned and all(plan[0].constexprs["OFFS_64"] == widened for plan in planned)
    for b, (k, v) in enumerate(keys):
        ref = oracle.attention(q[b : b + 1], k, v).out
        low = oracle.attention(q[b : b + 1], k, v, precision=None).out
        check_close(f"offsets past int32, {layout}, sequence {b}", out[b : b + 1], ref, low)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("fill", [-1, 2**31 - 1])
def test_table_entries_past_a_sequence_are_not_read(backend, fill, page, num_splits):
    """Block-table entries past the pages a sequence's keys (and new tokens) cover may hold anything
    (flash_attn: only those entries are read); PagedKVCache pads short rows with -1. The call with such
    entries matches the one whose table holds real pages there, output and pool alike, and the oracle."""
    _, device = on(backend)
    q, kc, vc, args = _inputs(5, 5, {"causal": True, "rotary": "interleaved"}, page, device)
    table = args["block_table"]
    ends = args["cache_seqlens"].long() + 5
    used = (ends + page - 1) // page
    padded = table.clone()
    padded[torch.arange(table.shape[1], device=device) >= used.unsqueeze(1)] = fill
    assert (padded == fill).any()
    outs, pools = [], []
    for tb in (table, padded):
        k_pool, v_pool = kc.clone(), vc.clone()
        call = {**args, "block_table": tb, "num_splits": num_splits}
        with on(backend)[0]:
            outs.append(tileattn.flash_attn_with_kvcache(q, k_pool, v_pool, **call))
        pools.append((k_pool, v_pool))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    ref, lowp = (kvcache_ref(q, kc, vc, precision=p, **_ref_args(args)) for p in (torch.float64, None))
    check_close(f"fill {fill}", outs[0], ref.out, lowp.out)
