"""Index values checked by the kernels (tileattn.errors), as CUDA calls check them by default; here on
CPU tensors under the interpreter too, with Settings.sync_checks=False. Each bad value leaves the caches
bit for bit as they were, except the new tokens of entries that are valid; the next call raises it, with
the host check's words, and so does tileattn.check_errors(); valid calls work after it. With
sync_checks=True the same values are refused before anything runs."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import oracle
import tileattn
from helpers import check_refused
from kvcache_cases import F16, _check_case, _kernel_device
from tileattn import errors, mla, params
from tileattn.kernels import configs
from tileattn.testing import check_close

I32 = torch.int32


@pytest.fixture
def device():
    return _kernel_device()


def _checks(device, sync):
    """Calls on ``device`` under its settings with ``sync_checks`` set (False: the kernels check)."""
    return configs.override(dataclasses.replace(configs.current(torch.device(device)), sync_checks=sync))


@pytest.fixture(autouse=True)
def _no_error_left():
    """Every test consumes the errors it makes: one still pending after it fails the test (and is cleared,
    so that it does not leak into the next test of this process)."""
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pending = {str(key): int(record.words[0]) for key, record in errors._RECORDS.items() if int(record.words[0])}
    for record in errors._RECORDS.values():
        record.words[0] = 0
    if pending:
        pytest.fail(f"kernel-side errors left pending after the test (error word by device): {pending}")


def _settled(device):
    """After a call whose kernels found a bad value: on the GPU they run behind the host, and the next call
    raises only what they have written by then."""
    if device != "cpu":
        torch.cuda.synchronize()


def _inputs(device, paged=False):
    """Two sequences appending one token (rotated) into a cache of capacity 12: entry 0 at position 3,
    entry 1 at 11 (the last slot)."""
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(6 if paged else 2, 4 if paged else 12, 2, 16, dtype=F16, generator=gen)
    angle = torch.rand(12, 8, generator=gen)
    args = dict(
        q=torch.randn(2, 1, 4, 16, dtype=F16, generator=gen),
        k_cache=kc,
        v_cache=kc.clone() + 1,
        k=torch.randn(2, 1, 2, 16, dtype=F16, generator=gen),
        v=torch.randn(2, 1, 2, 16, dtype=F16, generator=gen),
        cache_seqlens=torch.tensor([3, 11], dtype=I32),
        rotary_cos=angle.cos().to(F16),
        rotary_sin=angle.sin().to(F16),
        causal=True,
    )
    if paged:
        args["block_table"] = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=I32)
    return {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in args.items()}


# (id, changes, paged, words of the message, the (row or page, slot) pairs the append may write)
BAD = [
    ("seqlens-negative", {"cache_seqlens": [3, -1]}, False, ["cache_seqlens must be >= 0, got -1 at batch entry 1"], {(0, 3)}),
    ("seqlens-past-capacity", {"cache_seqlens": [3, 12]}, False, ["cache_seqlens[1] + seqlen_new = 12 + 1", "capacity 12"], {(0, 3)}),
    ("leftpad", {"cache_leftpad": [0, 12]}, False, ["cache_leftpad must be in [0, cache_seqlens], got 12", "batch entry 1"], {(0, 3)}),
    ("batch-idx-range", {"cache_batch_idx": [0, 2]}, False, ["cache_batch_idx must be in [0, 2), got 2 at batch entry 1"], {(0, 3)}),
    ("batch-idx-repeated", {"cache_batch_idx": [1, 1]}, False, ["cache_batch_idx[1] = 1 repeats an earlier entry"], set()),
    ("rotary-too-short", {"rotary_rows": 11}, False, ["have 11 positions but position 11 is needed at batch entry 1"], {(0, 3)}),
    ("table-new-page", {"block_table": [[0, 1, 2], [3, 4, 9]]}, True, ["block_table[1, 2] = 9 is not a page", "[0, 6)"], {(0, 3)}),
    # a bad entry of older keys only: the attention reports it, the new token goes where its page says
    ("table-old-page", {"block_table": [[0, 1, 2], [-1, 4, 5]]}, True, ["block_table[1, 0] = -1 is not a page"], {(0, 3), (5, 3)}),
]  # fmt: skip


def _bad_call(device, changes, paged):
    args = _inputs(device, paged)
    for name, value in changes.items():
        if name == "rotary_rows":
            args["rotary_cos"], args["rotary_sin"] = args["rotary_cos"][:value], args["rotary_sin"][:value]
        else:
            args[name] = torch.tensor(value, dtype=I32, device=device)
    return args


def _written(before, after):
    """The (row or page, slot) pairs of a cache that changed."""
    return {tuple(x) for x in (before != after).any(-1).any(-1).nonzero().tolist()}


def _valid_call(args):
    """A call with nothing wrong: no append, the first three keys of each sequence."""
    seqlens = torch.full((2,), 3, dtype=I32, device=args["q"].device)
    tables = {"block_table": args["block_table"][:, :1].clone().fill_(0)} if "block_table" in args else {}
    return tileattn.flash_attn_with_kvcache(
        args["q"], args["k_cache"], args["v_cache"], cache_seqlens=seqlens, **tables
    )


def _check_valid_call(out, args):
    """``_valid_call``'s output against the oracle on the caches as they are: each sequence's first three
    keys (with a block table, page 0's for both)."""
    kc, vc = args["k_cache"].cpu(), args["v_cache"].cpu()
    if "block_table" in args:
        kc, vc = kc[:1].expand(2, -1, -1, -1), vc[:1].expand(2, -1, -1, -1)
    q, k, v = args["q"].cpu(), kc[:, :3], vc[:, :3]
    ref, lowp = (oracle.attention(q, k, v, precision=p).out for p in (torch.float64, None))
    check_close("valid call after the error", out.cpu(), ref, lowp)


@pytest.mark.parametrize("changes, paged, words, writes", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_values_raise_at_the_next_call(device, changes, paged, words, writes):
    args = _bad_call(device, changes, paged)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with _checks(device, False):
        tileattn.flash_attn_with_kvcache(**args)  # (returns: its kernels found the value)
        _settled(device)
        for cache, old in zip((args["k_cache"], args["v_cache"]), before):
            assert _written(old, cache) == writes, "an entry with a bad value appended, or another's row changed"
        error = check_refused(lambda: _valid_call(args), tileattn.InvalidArgument, [*words, "earlier", "did not run"])
        assert isinstance(error, RuntimeError)
        _valid_call(args)  # (raised once: the record was cleared)
        tileattn.flash_attn_with_kvcache(**args)
        check_refused(tileattn.check_errors, tileattn.InvalidArgument, [*words, "earlier", "check_errors"])
        tileattn.check_errors()
        out = _valid_call(args)
    _check_valid_call(out, args)


@pytest.mark.parametrize("changes, paged, words, writes", [c[1:] for c in BAD[:3]], ids=[c[0] for c in BAD[:3]])
def test_sync_checks_refuse_before_anything_runs(device, changes, paged, words, writes):
    args = _bad_call(device, changes, paged)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with _checks(device, True):
        error = check_refused(lambda: tileattn.flash_attn_with_kvcache(**args), tileattn.InvalidArgument, words)
        assert "earlier" not in str(error)
        tileattn.check_errors()
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


def test_int_cache_seqlens_checked_before_the_call(device):
    """An int cache_seqlens is known on the host: refused at once; the index tensors beside it are
    checked by the kernels."""
    args = _inputs(device, paged=True)
    with _checks(device, False):
        args["cache_seqlens"] = 12
        check_refused(
            lambda: tileattn.flash_attn_with_kvcache(**args), tileattn.InvalidArgument, ["12 + 1", "capacity 12"]
        )
        args["cache_seqlens"] = 3
        args["block_table"] = torch.tensor([[0, 1, 2], [7, 4, 5]], dtype=I32, device=device)
        before = args["k_cache"].clone()
        tileattn.flash_attn_with_kvcache(**args)
        assert _written(before, args["k_cache"]) == {(0, 3)}
        check_refused(tileattn.check_errors, tileattn.InvalidArgument, ["block_table[1, 0] = 7"])


def test_paged_varlen_table_checked_by_the_kernel(device):
    q = torch.randn(10, 4, 16, dtype=F16, device=device)
    pool = torch.randn(4, 8, 2, 16, dtype=F16, device=device)
    cu_q = torch.tensor([0, 4, 10], dtype=I32, device=device)
    cu_k = torch.tensor([0, 4, 10], dtype=I32, device=device)
    good = torch.tensor([[0], [1]], dtype=I32, device=device)
    bad = torch.tensor([[0], [7]], dtype=I32, device=device)
    with _checks(device, False):
        tileattn.flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 6, 6, block_table=bad)
        _settled(device)
        words = ["block_table[1, 0] = 7", "[0, 4)", "flash_attn_varlen_func", "did not run"]
        check_refused(
            lambda: tileattn.flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 6, 6, block_table=good),
            tileattn.InvalidArgument,
            words,
        )
        tileattn.flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 6, 6, block_table=good)
        long = torch.tensor([0, 4, 13], dtype=I32, device=device)  # (lengths are read on the host: refused at once)
        check_refused(
            lambda: tileattn.flash_attn_varlen_func(q, pool, pool, cu_q, long, 6, 9, block_table=good),
            tileattn.InvalidArgument,
            ["exceeds the cache capacity 8"],
        )
        tileattn.check_errors()


@pytest.mark.parametrize(
    "lengths, table_change, words",
    [
        ([40, 70], None, ["cache_seqlens[1] + seqlen_new = 70 + 0", "capacity 64"]),
        ([-3, 20], None, ["cache_seqlens must be >= 0, got -3 at batch entry 0"]),
        ([40, 20], (1, 1, 99), ["block_table[1, 1] = 99 is not a page"]),
    ],
    ids=["past-capacity", "negative", "table"],
)
def test_mla_values_checked_by_the_kernel(device, lengths, table_change, words):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(9, 16, 1, 64, dtype=F16, generator=gen).to(device)
    q = torch.randn(2, 1, 16, 64, dtype=F16, generator=gen).to(device)
    table = torch.arange(8, dtype=I32, device=device).view(2, 4)
    if table_change is not None:
        table[table_change[:2]] = table_change[2]
    seqlens = torch.tensor(lengths, dtype=I32, device=device)
    before = kv.clone()
    with _checks(device, False):
        mla.flash_mla_with_kvcache(q, kv, table, seqlens, 64)
        _settled(device)
        good = torch.tensor([5, 5], dtype=I32, device=device)
        call = lambda: mla.flash_mla_with_kvcache(q, kv, torch.arange(8, dtype=I32, device=device).view(2, 4), good, 64)  # noqa: E731
        check_refused(call, tileattn.InvalidArgument, [*words, "flash_mla_with_kvcache", "did not run"])
        call()
        tileattn.check_errors()
    assert torch.equal(kv, before)


@pytest.mark.parametrize(
    "case, layout, num_splits",
    [("decode-rotary", "page4", 3), ("alibi-leftpad", "dense", 0), ("batch-idx", "dense", 1), ("q-longer-than-new", "page16", 0)],
)  # fmt: skip
def test_valid_calls_whose_kernels_check(device, case, layout, num_splits):
    """The builds that check index values compute what the others do (the reference, the caches after
    the append), planned for the capacity; and find nothing wrong."""
    with _checks(device, False):
        _check_case("cuda" if device == "cuda" else "interpret", case, layout, num_splits)
        tileattn.check_errors()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_record_copied_from_the_device(device, num_splits, monkeypatch):
    """With errors.ZERO_COPY off (the default; also where the driver does not map pinned memory), the
    record lives on the device and each checked call brings it into pinned memory behind its kernels:
    the combine of a split call stores the words there itself (its plan says so), a call without one
    queues a copy. Errors are raised the same way. (Under the interpreter the record is put in that mode
    by hand: its device words a tensor apart from the host's.)"""
    from tileattn import kvcache
    from tileattn.kernels.decode import plan

    key = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    monkeypatch.setattr(errors, "ZERO_COPY", False)
    rec = errors._Record(key)
    if device != "cuda":
        rec.copied, rec.tensor = True, torch.zeros_like(rec.host)
    monkeypatch.setitem(errors._RECORDS, key, rec)
    assert rec.copied and rec.tensor.data_ptr() != rec.host.data_ptr()
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, 16, dtype=F16, generator=gen).to(device)
    kc, vc = (torch.randn(2, 300, 2, 16, dtype=F16, generator=gen).to(device) for _ in range(2))  # 3+ key tiles

    def call(lengths):
        seqlens = torch.tensor(lengths, dtype=I32, device=device)
        return tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=num_splits)

    words = ["cache_seqlens[1] + seqlen_new = 301 + 0", "capacity 300"]
    kvcache.calls.clear()
    with _checks(device, False):
        call([3, 301])
        _settled(device)
        assert rec.words[0] == params.ERR_SEQLENS_CAPACITY, "the host copy holds the error"
        (call_,) = kvcache.calls.values()
        assert [merge is not None and merge.constexprs["MIRROR"] for _, merge in plan.plans_in(call_.plans)] == [
            num_splits > 1
        ]
        check_refused(tileattn.check_errors, tileattn.InvalidArgument, words)
        assert rec.words[0] == 0 and not rec.tensor.any()
        call([3, 301])  # (replayed)
        _settled(device)
        check_refused(lambda: call([3, 300]), tileattn.InvalidArgument, [*words, "did not run"])
        call([3, 300])
        tileattn.check_errors()


def test_sync_checks_from_the_environment():
    """TILEATTN_SYNC_CHECKS=1 when tileattn is imported sets Settings.sync_checks in every table."""
    code = "from tileattn.kernels import configs; print(configs.HOPPER.sync_checks, configs.INTERPRETER.sync_checks)"
    env = dict(os.environ, TILEATTN_SYNC_CHECKS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.stdout.split() == ["True", "True"], res.stderr[-2000:]


def test_eager_decode_replays_the_launches_of_its_signature(device, monkeypatch):
    """An eager decode step whose values the kernels check (no append, no rotary, a tensor cache_seqlens, its
    arguments as given) runs the last such call's launches when it has the same signature: no checks and no
    planning on the host, each call's own tensors and values, exact; a bad value is still recorded by the
    kernels and raised by the next call. The partials (and an LSE not asked for) go to one scratch buffer per
    stream, which every replayed call reuses; an LSE asked for is the host path's. Not under other settings,
    nor for a call whose arguments needed a copy (a strided alibi_slopes)."""
    from tileattn import kvcache
    from tileattn.ops import kvcache as ops
    from tileattn.params import REPLAY

    gen = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn(2, 300, 2, 16, dtype=F16, generator=gen).to(device) for _ in range(2))  # (3+ tiles)
    slopes = torch.rand(8, generator=gen).to(device)[::2]  # (strided: the call copies it)

    def step(lengths, **extra):
        q = torch.randn(2, 1, 4, 16, dtype=F16, generator=gen).to(device)
        seqlens = torch.tensor(lengths, dtype=I32, device=device)  # a new tensor every step
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=2, **extra)
        keys = torch.arange(300, device=device)[None] < seqlens[:, None].long()
        ref, lowp = (
            oracle.attention(q, kc, vc, key_padding_mask=keys, precision=p, **extra).out for p in (torch.float64, None)
        )
        check_close(f"step {lengths}", out, ref, lowp)

    kvcache.calls.clear()
    calls = []
    impl = ops.fwd_kvcache_impl
    monkeypatch.setattr(ops, "fwd_kvcache_impl", lambda *a, **kw: calls.append(1) or impl(*a, **kw))
    with _checks(device, False):
        step([30, 7])
        (call,) = kvcache.calls.values()
        assert REPLAY in call.plans and len(calls) == 1
        for lengths in ([31, 8], [1, 300], [170, 17]):
            step(lengths)
        assert len(calls) == 1, "a step of the same signature ran the host path"
        assert call.plans[REPLAY][1].split_at and len(call.plans[REPLAY][1].scratch) == 1
        q = torch.randn(2, 1, 4, 16, dtype=F16, generator=gen).to(device)
        lse_call = lambda: tileattn.flash_attn_with_kvcache(  # noqa: E731
            q, kc, vc, cache_seqlens=torch.tensor([30, 250], dtype=I32, device=device), num_splits=2,
            return_softmax_lse=True,
        )  # fmt: skip
        first, again = lse_call(), lse_call()  # (the host path, then its replay)
        assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(first, again))
        bad = torch.tensor([3, 301], dtype=I32, device=device)
        q = torch.zeros(2, 1, 4, 16, dtype=F16, device=device)
        tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=bad, num_splits=2)  # (replayed: returns)
        _settled(device)
        check_refused(lambda: step([5, 5]), tileattn.InvalidArgument, ["cache_seqlens", "301", "earlier"])
        step([5, 5])
        kvcache.calls.clear()
        step([9, 9], alibi_slopes=slopes)
        step([9, 9], alibi_slopes=slopes)
        assert len(calls) == 4 and all(REPLAY not in c.plans for c in kvcache.calls.values())
        step([9, 9], alibi_slopes=slopes.contiguous())
        step([9, 9], alibi_slopes=slopes.contiguous())
        assert len(calls) == 5
    with _checks(device, True):  # other settings: the host path (and its checks)
        step([30, 7])
    assert len(calls) == 6
