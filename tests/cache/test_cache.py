"""PagedKVCache: allocation, growth by pages, forks with copy-on-write, errors that change nothing, and
the end-to-end example (its small decoder served from the cache against the same model with the oracle's
attention over whole histories; its command line checks itself and refuses bad arguments with a
sentence), and the pool's default dtype."""

import copy

import pytest
import torch

import oracle
import tileattn
from helpers import example, on, run_example
from tileattn.cache import CacheFullError, PagedKVCache
from tileattn.testing import check_close


def _cache(num_pages=8, page_size=4, device="cpu", dtype=torch.float16):
    return PagedKVCache(
        num_layers=2, num_pages=num_pages, page_size=page_size, nheads_k=2, headdim=16, dtype=dtype, device=device
    )


def _state(cache):
    return (cache.num_free_pages, {s: (cache.length(s), cache.pages(s)) for s in list(cache._seqs)})


def test_append_grows_by_pages_and_free_returns_them():
    cache = _cache()
    a, b = cache.add_sequence(), cache.add_sequence()
    step = cache.append([a, b], [5, 1])
    assert step.cache_seqlens.tolist() == [0, 0]
    assert len(cache.pages(a)) == 2 and len(cache.pages(b)) == 1 and cache.num_free_pages == 5
    step = cache.append([a, b], 3)
    assert step.cache_seqlens.tolist() == [5, 1] and cache.length(a) == 8 and len(cache.pages(a)) == 2
    assert step.block_table.shape == (2, 2) and step.block_table.dtype == torch.int32
    assert step.block_table[0].tolist() == cache.pages(a)
    cache.free(a)
    assert cache.num_free_pages == 7 and a not in cache and len(cache) == 1


def test_pool_exhausted_changes_nothing():
    cache = _cache(num_pages=3)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, 6)
    before = _state(cache)
    with pytest.raises(CacheFullError, match="needs 2 free pages .* has 1"):
        cache.append([a, b], [3, 4])
    assert _state(cache) == before


def test_unknown_sequence_and_bad_counts():
    cache = _cache()
    a = cache.add_sequence()
    with pytest.raises(KeyError, match="unknown sequence 7"):
        cache.append([a, 7], 1)
    with pytest.raises(KeyError, match="unknown sequence 7"):
        cache.free(7)
    with pytest.raises(ValueError, match="num_new"):
        cache.append(a, -1)
    with pytest.raises(ValueError, match="distinct"):
        cache.append([a, a], 1)
    assert cache.length(a) == 0 and cache.num_free_pages == 8
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(1, 4, 0, 1, 16)


def _gather(cache, seq, layer=0):
    pages = torch.tensor(cache.pages(seq))
    return cache.k[layer][pages].flatten(0, 1)[: cache.length(seq)].clone()


def test_fork_shares_prefix_and_copies_on_write(backend):
    """A fork shares its parent's pages; writing into the fork's partial last page copies it first, so
    the parent's keys are unchanged, and freeing one keeps the other's pages alive."""
    ctx, device = on(backend)
    cache = _cache(device=device)
    parent = cache.add_sequence()
    q = torch.randn(1, 6, 4, 16, dtype=torch.float16, device=device)
    k = torch.randn(1, 6, 2, 16, dtype=torch.float16, device=device)
    step = cache.append(parent, 6)
    with ctx:
        tileattn.flash_attn_with_kvcache(q, k=k, v=k, causal=True, **step.kwargs(0))
    child = cache.fork(parent)
    assert cache.pages(child) == cache.pages(parent) and cache.num_free_pages == 6
    parent_keys = _gather(cache, parent)
    step = cache.append(child, 1)
    assert cache.pages(child)[0] == cache.pages(parent)[0] and cache.pages(child)[1] != cache.pages(parent)[1]
    k1 = torch.randn(1, 1, 2, 16, dtype=torch.float16, device=device)
    with on(backend)[0]:
        tileattn.flash_attn_with_kvcache(q[:, :1], k=k1, v=k1, **step.kwargs(0))
    assert torch.equal(_gather(cache, parent), parent_keys), "the fork's write reached its parent"
    child_keys = _gather(cache, child)
    assert torch.equal(child_keys[:6], parent_keys) and torch.equal(child_keys[6], k1[0, 0])
    cache.free(parent)
    assert torch.equal(_gather(cache, child), child_keys) and cache.num_free_pages == 6


def test_parent_and_fork_appended_in_one_step(backend):
    """A parent and its fork grow in one append while they share a partial last page: one copies it,
    the other keeps it (no page leaks, freeing both returns every page), the count of free pages the
    step needs is one copy, not one per sharer, and each sees its own new token after the page."""
    ctx, device = on(backend)
    cache = _cache(num_pages=3, device=device)
    parent = cache.add_sequence()
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16, device=device)
    k = torch.randn(1, 2, 2, 16, dtype=torch.float16, device=device)
    step = cache.append(parent, 2)
    with ctx:
        tileattn.flash_attn_with_kvcache(q[:1], k=k, v=k, **step.kwargs(0))
    child = cache.fork(parent)
    third = cache.fork(parent)
    cache.append(cache.add_sequence(), 4)  # one free page left
    with pytest.raises(CacheFullError, match="needs 2 free pages .* has 1"):
        cache.append([parent, child], 1)  # a third sharer holds the page: both copy
    cache.free(third)
    step = cache.append([parent, child], 1)  # the step holds every sharer: one copy
    assert cache.num_free_pages == 0 and len({cache.pages(parent)[0], cache.pages(child)[0]}) == 2
    k1 = torch.randn(2, 1, 2, 16, dtype=torch.float16, device=device)
    with on(backend)[0]:
        tileattn.flash_attn_with_kvcache(q, k=k1, v=k1, **step.kwargs(0))
    for row, seq in enumerate((parent, child)):
        keys = _gather(cache, seq)
        assert torch.equal(keys[:2], k[0]) and torch.equal(keys[2], k1[row, 0])
    cache.free(parent)
    cache.free(child)
    assert cache.num_free_pages == 2


def test_steps_pad_short_table_rows_with_no_page(backend):
    """A step's block table pads rows shorter than the widest with -1, so new tokens that reach past a
    sequence's pages (here: b made room for one token, the step writes three) are refused, and no other
    sequence's page is written: before anything runs on the CPU; on the GPU the kernels find it (the
    next check raises it), b appends nothing and a its three tokens."""
    ctx, device = on(backend)
    cache = _cache(device=device)
    a, b = cache.add_sequence(), cache.add_sequence()
    step = cache.append([a, b], [9, 1])
    assert step.block_table.tolist()[1] == [cache.pages(b)[0], -1, -1]
    pool = cache.k.clone()
    q = torch.randn(2, 3, 4, 16, dtype=torch.float16, device=device)
    k = torch.randn(2, 3, 2, 16, dtype=torch.float16, device=device)
    kwargs = dict(step.kwargs(0), cache_seqlens=torch.tensor([0, 3], dtype=torch.int32, device=device))
    with ctx:
        if device == "cuda":
            tileattn.flash_attn_with_kvcache(q, k=k, v=k, **kwargs)
            with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1"):
                tileattn.check_errors(device)
            pool[0, cache.pages(a)[0], :3] = k[0]
        else:
            with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1"):
                tileattn.flash_attn_with_kvcache(q, k=k, v=k, **kwargs)
    assert torch.equal(cache.k, pool)


def test_example_decoding_matches_the_oracle(backend):
    """The example's model decoding through the cache as the example does (prompts of 5, 11 and 3 tokens
    prefilled one at a time, then batched steps, a fork after four): each new token's logits against the
    same weights with the oracle's rotary and attention over the sequence's whole history, in fp64 and in
    the compute dtype (the tolerance rule)."""
    ctx, device = on(backend)
    dtype = {"torch": torch.float32, "interpret": torch.float16, "cuda": torch.bfloat16}[backend]
    ex = example("paged_decode")
    torch.manual_seed(0)
    model = ex.TinyDecoder().to(device=device, dtype=dtype).eval()
    # (the tables as the model holds them, in its dtype, are inputs of both: the oracle's are them upcast)
    models = {exact: copy.deepcopy(model).to("cpu", torch.float64 if exact else dtype) for exact in (True, False)}
    cache = PagedKVCache(2, 64, 4, 2, 16, dtype=dtype, device=device)
    history = {}

    def uncached(seq, exact):
        m = models[exact]
        positions = torch.arange(len(history[seq]))[None]

        def attend(q, k, v):
            q, k = (oracle.rotary(t, m.cos, m.sin, positions, interleaved=False) for t in (q, k))
            return oracle.attention(q, k, v, causal=True, precision=None).out  # (in the model's dtype)

        x = m.embed(torch.tensor([history[seq]]))
        for layer in range(len(m.qkv)):
            x = m._block(x, layer, attend)
        return m.head(x)[0, -1]

    def check(seq, logits, what):
        check_close(f"{what}: sequence {seq}", logits.cpu(), uncached(seq, True), uncached(seq, False))
        nxt[seq], second[seq] = logits.topk(2).indices.tolist()

    nxt, second = {}, {}
    with ctx, torch.no_grad():
        for n in (5, 11, 3):
            seq = cache.add_sequence()
            history[seq] = torch.randint(0, 101, (n,)).tolist()
            logits = model.forward_cached(torch.tensor([history[seq]], device=device), cache.append(seq, n))
            check(seq, logits[0, -1], "prefill")
        for t in range(6):
            if t == 4:
                child = cache.fork(0)
                history[child] = list(history[0])
                nxt[child] = second[0]  # (the fork takes the parent's second choice)
            ids = sorted(nxt)
            for seq in ids:
                history[seq].append(nxt[seq])
            step = cache.append(ids, 1)
            logits = model.forward_cached(torch.tensor([[nxt[s]] for s in ids], device=device), step)[:, -1]
            for row, seq in enumerate(ids):
                check(seq, logits[row], f"step {t}")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--device", "cuda"], ["--device cuda", "no CUDA GPU", "--device cpu"]),
        (["--device", "nonsense"], ["'nonsense'", "cuda or cpu"]),
        (["--device", "meta"], ["cuda or cpu"]),
        (["--steps", "201"], ["--steps", "between 0 and 200"]),
    ],
    ids=["cuda-without-gpu", "unknown-device", "meta", "too-many-steps"],
)
def test_example_refuses_bad_arguments_with_a_sentence(args, words):
    """Bad arguments end in argparse's usage line and a sentence naming the argument (exit status 2), not
    a traceback from deep inside."""
    if args[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("there is a GPU here")
    res = run_example("paged_decode", *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    for word in words:
        assert word in res.stderr, res.stderr


def test_default_dtype_follows_the_device():
    """dtype=None: the default dtype on CPU (what a CPU model holds, so fp32 queries meet an fp32 pool),
    bf16 on CUDA; a dtype that is not a torch.dtype is refused by name."""
    assert PagedKVCache(1, 2, 4, 1, 8).k.dtype == torch.float32
    assert PagedKVCache(1, 2, 4, 1, 8, device="cpu").v.dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert PagedKVCache(1, 2, 4, 1, 8, device="cpu").k.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert PagedKVCache(1, 2, 4, 1, 8, dtype=torch.float16).k.dtype == torch.float16
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        PagedKVCache(1, 2, 4, 1, 8, dtype="bf16")
    if torch.cuda.is_available():
        assert PagedKVCache(1, 2, 4, 1, 8, device="cuda").k.dtype == torch.bfloat16
    cache = PagedKVCache(1, 4, 4, 2, 16)
    seq = cache.add_sequence()
    q, k = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16)
    out = tileattn.flash_attn_with_kvcache(q, k=k, v=k, causal=True, **cache.append(seq, 3).kwargs(0))
    assert out.dtype == torch.float32 and torch.equal(cache.k[0, cache.pages(seq)[0], :3], k[0])
