"""The decode planner (kernels/decode/plan.py): the tiles, grids and table prefetch it plans for the GPU
(planned on the CPU with the H200's settings); and on the GPU the full grid's two-stage build, a TMA plan
launched again from another thread, and the attention kernel as a dependent launch that reads inputs
written just before it."""

import dataclasses

import pytest
import torch

import oracle
import tileattn
from kvcache_cases import _plans_made, _settings
from kvcache_ref import kvcache_ref
from tileattn.kernels import configs
from tileattn.params import AttnParams, CacheLayout, DecodeSettings
from tileattn.testing import check_close


def _gpu_plan(batch, cache_len, page, headdim=128, num_splits=0, s=None, max_seqlen_k=-1, **changes):
    """The split kernel's constexprs and grid as ``kernels.decode`` plans a decode step (GQA 32/8, one
    query token, bf16, full caches) under settings ``s``, by default the H200's for a GPU of 132 SMs
    with these ``DecodeSettings`` fields changed: CPU tensors, nothing launched."""
    from tileattn.kernels.decode import plan

    if s is None:
        s = dataclasses.replace(
            configs.HOPPER, decode=dataclasses.replace(configs.HOPPER.decode, sm_count=132, **changes)
        )
    nheads, nheads_k = 32, 8
    q = torch.empty(batch, 1, nheads, headdim, dtype=torch.bfloat16)
    table = None
    if page:
        cache = torch.empty(batch * cache_len // page, page, nheads_k, headdim, dtype=torch.bfloat16)
        table = torch.arange(batch * cache_len // page, dtype=torch.int32).view(batch, -1)
    else:
        cache = torch.empty(batch, cache_len, nheads_k, headdim, dtype=torch.bfloat16)
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32)
    p = AttnParams(batch=batch, seqlen_q=1, seqlen_k=cache_len, headdim=headdim, softmax_scale=0.1)
    max_k = cache_len if max_seqlen_k == -1 else max_seqlen_k
    c = CacheLayout(seqlens_k=seqlens, block_table=table, num_splits=num_splits, max_seqlen_k=max_k)
    attn, _ = plan.plan_call(q, cache, cache, p, c, s)
    return attn.constexprs, attn.grid


def test_plans_without_the_longest_sequence():
    """Calls whose kernels check the index values (tileattn.errors) do not read cache_seqlens on the host:
    they plan for the capacity, as CUDA graph capture does. The benchmark's rows (full caches) get the
    plans the host's longest sequence gave them; a cache far longer than its sequences gets more splits,
    each sharing out only the keys there are (the kernel's split bounds come from the lengths)."""
    for batch, length in ((1, 8192), (1, 131072), (8, 32768), (64, 4096), (64, 16384)):
        for page in (None, 16, 256):
            assert _gpu_plan(batch, length, page, max_seqlen_k=None) == _gpu_plan(batch, length, page)
    assert _gpu_plan(1, 131072, 16, max_seqlen_k=1024)[1] == (1, 8, 2)
    assert _gpu_plan(1, 131072, 16, max_seqlen_k=None)[1] == (1, 8, 16)


def test_gpu_plans_of_short_programs():
    """On the GPU (planned here on the CPU with the H200's settings, as for 132 SMs), one wave of
    programs with at most four 128-key tiles (eight unless the pages are smaller than such a tile) takes
    64-key tiles (DecodeSettings.short_block_n), and paged programs in grids under two waves prefetch
    their table sectors into L2 (paged_table_l2); the interpreter takes neither (its tests run 16-key
    tiles)."""
    cases = [  # (batch, cache length, page, head dim, num_splits): block_n, interleave, table to L2, grid
        ((1, 8192, None, 128, 0), (64, False, False, (1, 8, 16))),  # four tiles per program
        ((1, 8192, 16, 128, 0), (64, True, True, (1, 8, 16))),
        ((1, 8192, 64, 128, 0), (64, False, True, (1, 8, 16))),  # pages of 64: whole 64-key tiles
        ((1, 8192, 256, 128, 0), (64, False, True, (1, 8, 16))),
        ((1, 16384, None, 128, 0), (64, False, False, (1, 8, 16))),  # eight tiles
        ((1, 16384, 16, 128, 0), (128, True, True, (1, 8, 16))),  # small pages: four at most
        ((1, 16384, 256, 128, 0), (64, False, True, (1, 8, 16))),
        ((1, 32768, None, 128, 0), (128, False, False, (1, 8, 16))),  # sixteen tiles
        ((1, 8192, None, 128, 16), (64, False, False, (1, 8, 16))),  # 128 programs: one wave
        ((1, 8192, None, 128, 17), (128, False, False, (1, 8, 17))),  # 136: more than one wave
        ((1, 8192, 16, 256, 0), (64, True, True, (1, 8, 16))),  # head dim 256's tiles are 64 keys anyway
        ((64, 4096, 16, 128, 0), (128, False, False, (1, 512, 1))),  # full grid: no split, no prefetch
    ]
    for (batch, length, page, d, splits), (block_n, interleave, to_l2, grid) in cases:
        constexprs, got_grid = _gpu_plan(batch, length, page, d, splits)
        got = (constexprs["BLOCK_N"], constexprs["INTERLEAVE"], constexprs["TABLE_TO_L2"], got_grid)
        assert got == (block_n, interleave, to_l2, grid), (batch, length, page, d, splits)
    constexprs, _ = _gpu_plan(1, 8192, 16, short_block_n=0, paged_table_l2=False)
    assert (constexprs["BLOCK_N"], constexprs["INTERLEAVE"], constexprs["TABLE_TO_L2"]) == (128, True, False)
    interpreter = dataclasses.replace(configs.INTERPRETER, decode=DecodeSettings(sm_count=132))
    constexprs, _ = _gpu_plan(1, 8192, 16, s=interpreter)
    assert (constexprs["BLOCK_N"], constexprs["TABLE_TO_L2"]) == (16, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a full grid of decode programs runs on the GPU")
def test_full_grid_two_stage_build():
    """Contiguous decode in a full grid of short programs (34 sequences x 8 kv heads, 4k keys, head dim
    128) takes the two-stage build (DecodeSettings.full_grid_stages); it matches the three-stage build
    and the reference."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(34, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    kc, vc = (torch.randn(34, 4096, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    seqlens = torch.randint(3000, 4097, (34,), dtype=torch.int32, device=dev, generator=gen)
    s = configs.current(q.device)
    planned = _plans_made(s)
    two = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    with configs.override(_settings(dev, full_grid_stages=0)) as s3:
        planned3 = _plans_made(s3)
        three = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    assert [plan[0].options["num_stages"] for plan in list(planned) + list(planned3)] == [2, 3]
    for b in (0, 17, 33):
        n = int(seqlens[b])
        ref = oracle.attention(q[b : b + 1], kc[b : b + 1, :n], vc[b : b + 1, :n]).out
        low = oracle.attention(q[b : b + 1], kc[b : b + 1, :n], vc[b : b + 1, :n], precision=None).out
        check_close(f"full grid, two stages, sequence {b}", two[b : b + 1], ref, low)
        check_close(f"full grid, three stages, sequence {b}", three[b : b + 1], ref, low)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TMA builds run on the GPU")
def test_planned_tma_launch_in_another_thread():
    """A decode call planned in one thread (pages of 256 through TMA descriptors, which need Triton's
    scratch allocator) runs again from a new thread, whose context has no allocator yet."""
    import contextvars
    import threading

    dev = "cuda"
    s = _settings(dev, paged_tma=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    kc, vc = (torch.randn(17, 256, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    table = torch.randperm(17, device=dev, generator=gen)[:16].view(1, 16).int()
    seqlens = torch.tensor([4000], dtype=torch.int32, device=dev)
    planned = _plans_made(s)

    def call():
        with configs.override(s):  # (in the new thread's context too)
            return tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=1)

    first = call()
    assert [plan[0].constexprs["USE_TMA"] for plan in planned] == [True]
    results = []
    # (in a new, empty context: without an allocator whatever a thread inherits)
    thread = threading.Thread(target=lambda: contextvars.Context().run(lambda: results.append(call())))
    thread.start()
    thread.join()
    assert len(results) == 1 and torch.equal(results[0], first) and len(planned) == 1
    ref, lowp = (
        kvcache_ref(q, kc, vc, cache_seqlens=seqlens, block_table=table, precision=p) for p in (torch.float64, None)
    )
    check_close("TMA pages of 256", first, ref.out, lowp.out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launches run on the GPU")
@pytest.mark.parametrize("leftpad", [False, True])
def test_attention_reads_inputs_written_just_before(leftpad):
    """In a CUDA graph (no host checks, no syncs) each call comes right after torch kernels that rewrite
    its q, cache_seqlens, cache_leftpad and block table in place. The attention kernel, a programmatic
    dependent launch of the last of them on sm90+ (DecodeSettings.pdl_attn: it may start before they end),
    must read the new values: every output matches the oracle on that step's inputs. Pages of 16 at
    1 x 8k: the short, interleaved build whose table prefetch goes out before the wait."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    batch, pages_per_seq, page, steps = 2, 512, 16, 8
    pages = batch * pages_per_seq
    kc = torch.randn(pages, page, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    qs = torch.randn(steps, batch, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    tables = torch.stack([torch.randperm(pages, device=dev, generator=gen).int().view(batch, -1) for _ in range(steps)])
    lens = torch.randint(1, pages_per_seq * page + 1, (steps, batch), device=dev, dtype=torch.int32, generator=gen)
    pads = (torch.rand(steps, batch, device=dev, generator=gen) * lens * 0.5).int()
    q, table, seqlens, pad = qs[0].clone(), tables[0].clone(), lens[0].clone(), pads[0].clone()

    def step(i):
        q.copy_(qs[i])
        seqlens.copy_(lens[i])
        pad.copy_(pads[i])
        table.copy_(tables[i])  # (the kernel right before the attention kernel)
        return tileattn.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, block_table=table, cache_leftpad=pad if leftpad else None
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [step(i) for i in range(steps)]
    graph.replay()
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        args = dict(cache_seqlens=lens[i], block_table=tables[i], cache_leftpad=pads[i] if leftpad else None)
        ref, lowp = (kvcache_ref(qs[i], kc, vc, precision=p, **args) for p in (torch.float64, None))
        check_close(f"step {i}", out, ref.out, lowp.out)
