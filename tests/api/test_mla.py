"""MLA decoding (``tileattn.mla``): ``flash_mla_with_kvcache`` against the tests' dense oracle over the
same paged latent cache (keys the cache rows, values their first head_dim_v dims), with the tolerance
rule; the schedule of ``get_mla_metadata`` (every key block done once, every sequence written); the op
under torch.compile and CUDA graphs; and bad input refused with the cache untouched."""

import dataclasses
import math

import pytest
import torch
from hypothesis import strategies as st

import oracle
import tileattn
from helpers import check_lse, check_refused, example, interpreter_skips, on, run_property
from kvcache_ref import dense_view
from tileattn import mla
from tileattn.cache import PagedKVCache
from tileattn.kernels import configs
from tileattn.params import MLASettings
from tileattn.testing import check_close

GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _case(device, dtype, batch, seqlen_q, nheads, lengths, block_size=64, nheads_k=1, d=576, spare=3):
    """q, a shuffled pool of pages, its block table and the lengths (int32)."""
    max_blocks = max(1, math.ceil(max(lengths, default=0) / block_size))
    lengths = torch.tensor(lengths, dtype=torch.int32)
    pool = batch * max_blocks + spare
    table = torch.randperm(pool)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    kv = torch.randn(pool, block_size, nheads_k, d, dtype=dtype)
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype)
    return q.to(device), kv.to(device), table.to(device), lengths.to(device)


def _reference(q, kv, table, lengths, head_dim_v, causal, softmax_scale=None, precision=torch.float64):
    """The oracle on the dense view of each sequence's cache rows: keys the rows, values their first
    head_dim_v dims, the sequence's length as its key padding (bottom-right causal alignment)."""
    capacity = table.shape[1] * kv.shape[1]
    dense = dense_view(kv, table, capacity)  # (batch, capacity, nheads_k, d)
    padding = torch.arange(capacity, device=q.device)[None, :] < lengths[:, None].long()
    return oracle.attention(
        q,
        dense,
        dense[..., :head_dim_v],
        causal=causal,
        softmax_scale=softmax_scale,
        key_padding_mask=padding,
        precision=precision,
    )


def _check(name, q, kv, table, lengths, head_dim_v, causal, out, lse, softmax_scale=None):
    ref = _reference(q, kv, table, lengths, head_dim_v, causal, softmax_scale)
    lowp = _reference(q, kv, table, lengths, head_dim_v, causal, softmax_scale, precision=None)
    check_close(f"{name} out", out, ref.out, lowp.out)
    check_lse(f"{name} lse", lse, ref.lse, lowp.lse.float())


# (batch, seqlen_q, nheads, lengths, block_size): seqlens 1, 63, 113, 1025 and empty sequences; pages
# smaller than, equal to and larger than the kernels' key tiles; speculative tokens longer than a cache
CASES = {
    "decode": (3, 1, 16, [63, 1, 113], 64),
    "long": (2, 1, 16, [1025, 300], 64),
    "spec-tokens": (3, 3, 16, [70, 2, 129], 16),
    "empty-seqs": (4, 2, 16, [0, 40, 0, 17], 32),
    "big-pages": (2, 2, 32, [300, 5], 256),
    "many-heads": (2, 2, 128, [33, 80], 64),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_mla_matches_reference(backend, case, causal):
    batch, seqlen_q, nheads, lengths, block_size = CASES[case]
    dtype = {"cuda": torch.bfloat16, "torch": torch.float32, "interpret": torch.float16}[backend]
    if backend == "interpret" and (nheads > 32 or max(lengths) > 200):
        pytest.skip("large for the interpreter (covered on the GPU and the CPU path)")
    ctx, device = on(backend)
    q, kv, table, lengths_t = _case(device, dtype, batch, seqlen_q, nheads, lengths, block_size)
    before = kv.clone()
    with ctx:
        out, lse = mla.flash_mla_with_kvcache(q, kv, table, lengths_t, 512, causal=causal)
    assert out.shape == (batch, seqlen_q, nheads, 512) and out.dtype == dtype
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    _check(case, q, kv, table, lengths_t, 512, causal, out, lse)
    assert torch.equal(kv, before)


@pytest.mark.parametrize("needs_grad", ["q", "k_cache"])
def test_mla_runs_forward_with_grad_and_refuses_backward(backend, needs_grad):
    """flash_mla_with_kvcache has no backward: with inputs that require grad the forward runs and matches
    the oracle, and a backward that reaches it raises (not a gradient on one path and none on another)."""
    dtype = {"cuda": torch.bfloat16, "torch": torch.float32, "interpret": torch.float16}[backend]
    ctx, device = on(backend)
    q, kv, table, lengths = _case(device, dtype, 2, 2, 16, [40, 7], 16)
    (q if needs_grad == "q" else kv).requires_grad_(True)
    with ctx:
        out, lse = mla.flash_mla_with_kvcache(q, kv, table, lengths, 512, causal=True)
    _check("inputs that require grad", q.detach(), kv.detach(), table, lengths, 512, True, out.detach(), lse.detach())
    for output in (out, lse):
        with pytest.raises(NotImplementedError, match="flash_mla_with_kvcache has no backward"):
            output.sum().backward()


@pytest.mark.parametrize(
    "d, head_dim_v, nheads_k, scale",
    [(576, 512, 2, None), (192, 128, 1, 0.3), (256, 256, 1, None), (320, 256, 4, -0.05), (112, 64, 1, None)],
)
def test_mla_other_widths(backend, d, head_dim_v, nheads_k, scale):
    dtype = {"cuda": torch.float16, "torch": torch.bfloat16, "interpret": torch.float16}[backend]
    interpreter_skips(backend, dtype)
    ctx, device = on(backend)
    q, kv, table, lengths = _case(device, dtype, 3, 2, 4 * nheads_k, [50, 1, 97], 16, nheads_k, d)
    with ctx:
        out, lse = mla.flash_mla_with_kvcache(q, kv, table, lengths, head_dim_v, softmax_scale=scale, causal=True)
    _check(f"d{d}/{head_dim_v}", q, kv, table, lengths, head_dim_v, True, out, lse, scale)


def _schedule_covers(lengths, num_parts, block):
    """Runs ``mla.schedule`` and checks what the kernel relies on: each part's range is a run of whole
    blocks, every sequence is held by num_splits[b + 1] - num_splits[b] >= 1 parts, each part knows its
    split index, and every key block of every sequence is in exactly one part."""
    m = MLASettings(schedule_block=block)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    metadata, num_splits = mla.schedule(seqlens, num_parts, m)
    assert metadata.shape == (num_parts, 8) and metadata.dtype == torch.int32
    assert num_splits.shape == (len(lengths) + 1,) and int(num_splits[0]) == 0
    done = [[0] * math.ceil(n / block) for n in lengths]
    held = [[] for _ in lengths]
    for p, (b0, s0, b1, s1, split, *rest) in enumerate(metadata.tolist()):
        assert rest == [0, 0, 0]
        for b in range(b0, b1 + 1):
            lo = s0 if b == b0 else 0
            hi = s1 if b == b1 else lengths[b]
            assert lo % block == 0 and (hi % block == 0 or hi == lengths[b]) and 0 <= lo and hi <= lengths[b]
            for j in range(lo // block, math.ceil(hi / block)):
                done[b][j] += 1
            if b == b0:
                assert split == len(held[b])
            held[b].append(p)
    for b, n in enumerate(lengths):
        assert done[b] == [1] * math.ceil(n / block), f"sequence {b}: blocks done {done[b]}"
        assert len(held[b]) == int(num_splits[b + 1] - num_splits[b]) >= 1
    return metadata, num_splits


def test_schedule_examples():
    metadata, num_splits = _schedule_covers([1000, 0, 64, 1, 5000], 8, 64)
    counts = (num_splits[1:] - num_splits[:-1]).tolist()
    assert counts[1] == counts[3] == 1 and counts[4] > 1  # the long sequence is split, the empty ones not
    # cost balance: no part holds more than its share plus a block and a sequence's overhead
    _schedule_covers([64] * 100, 132, 64)
    _schedule_covers([0, 0, 0], 4, 64)
    _schedule_covers([7], 1, 16)


@pytest.mark.parametrize("shard", range(2))
def test_schedule_property(backend, shard):
    if backend != "torch":
        pytest.skip("the schedule is plain PyTorch (checked once)")
    strategy = st.tuples(
        st.lists(st.integers(0, 3000), min_size=1, max_size=40), st.integers(1, 140), st.sampled_from([16, 64])
    )
    run_property(lambda _, ex: _schedule_covers(*ex), strategy, {"torch": 150}, backend, shard)


@pytest.mark.parametrize("parts", [1, 3, 17])
def test_mla_given_metadata(backend, parts):
    """Any schedule over any number of parts gives the same answer (the splits merge exactly), and the
    metadata of ``get_mla_metadata`` is what the call makes by itself."""
    dtype = torch.float32 if backend == "torch" else torch.float16
    ctx, device = on(backend)
    q, kv, table, lengths = _case(device, dtype, 3, 2, 16, [150, 3, 64], 16)
    with ctx:
        # split points every 24 keys: not whole tiles of the kernels (16 under the interpreter, 64 on GPUs)
        metadata, num_splits = mla.schedule(lengths, parts, MLASettings(schedule_block=24))
        out, lse = mla.flash_mla_with_kvcache(q, kv, table, lengths, 512, metadata, num_splits, causal=True)
        _check(f"{parts} parts", q, kv, table, lengths, 512, True, out, lse)
        made = mla.get_mla_metadata(lengths, 2 * 16, 1)
        out2 = mla.flash_mla_with_kvcache(q, kv, table, lengths, 512, *made, causal=True, return_lse=False)
        out3 = mla.flash_mla_with_kvcache(q, kv, table, lengths, 512, causal=True, return_lse=False)
    torch.testing.assert_close(out2, out3, rtol=0, atol=0)


def test_metadata_counts_sms_and_rows():
    lengths = torch.full((8,), 100, dtype=torch.int32)
    m = configs.current(lengths.device).mla
    sms = m.sm_count or 132
    narrow = m.narrow_parts_per_sm if m.min_block_m < m.block_m else m.parts_per_sm
    assert mla.get_mla_metadata(lengths, 1, 1)[0].shape[0] == sms * narrow
    rows = 4 * m.block_m  # four row blocks per kv head: a quarter of the parts
    assert mla.get_mla_metadata(lengths, rows, 2)[0].shape[0] == max(1, sms * m.parts_per_sm // 2 // 4)
    # the Gluon build of fewer rows (gluon_narrow) pads them to 64-row programs, one block an SM
    s = configs.current(lengths.device)
    narrow_gluon = dataclasses.replace(m, gluon=True, gluon_narrow=True, narrow_parts_per_sm=2, parts_per_sm=1)
    with configs.override(dataclasses.replace(s, mla=narrow_gluon)):
        assert mla.get_mla_metadata(lengths, 16, 1)[0].shape[0] == sms
        assert mla.get_mla_metadata(lengths, rows, 1)[0].shape[0] == max(1, sms // 4)


def test_mla_compiles(backend):
    """The custom op under torch.compile (fullgraph), its fake implementation checked by opcheck."""
    dtype = torch.float32 if backend == "torch" else torch.float16 if backend == "interpret" else torch.bfloat16
    ctx, device = on(backend)
    q, kv, table, lengths = _case(device, dtype, 2, 2, 16, [40, 9], 16)
    with ctx:
        metadata, num_splits = mla.get_mla_metadata(lengths, 32, 1)
        eager = mla.flash_mla_with_kvcache(q, kv, table, lengths, 512, metadata, num_splits, causal=True)
        compiled = torch.compile(
            mla.flash_mla_with_kvcache, fullgraph=True, backend="eager" if device == "cpu" else "inductor"
        )
        got = compiled(q, kv, table, lengths, 512, metadata, num_splits, causal=True)
        torch.library.opcheck(
            torch.ops.tileattn.mla_fwd.default,
            (q, kv, table, lengths, metadata, num_splits, 512, 576**-0.5, True),
            test_utils=("test_schema", "test_faketensor"),
        )
    for a, b in zip(eager, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@GPU_ONLY
def test_mla_cuda_graph():
    """A decode step captured once and replayed with new lengths and new cache rows: the schedule
    (made inside the graph) and the kernel follow the tensors."""
    q, kv, table, lengths = _case("cuda", torch.bfloat16, 4, 1, 16, [300, 40, 1, 129], 64, spare=1)

    def step():
        return mla.flash_mla_with_kvcache(q, kv, table, lengths, 512, causal=True)

    step()  # (compiles, and checks the values, outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for new in ([301, 41, 2, 130], [5, 0, 200, 64]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        kv.normal_()
        graph.replay()
        _check(f"replay {new}", q, kv, table, lengths, 512, True, out, lse)


# (batch, seqlen_q, nheads, lengths): the Gluon build's 64-row programs (16 rows padded, one, four and a
# half-empty second row block), lengths 1, 63, 113, 1025 and empty sequences, last pages partly used
GLUON_CASES = {
    "narrow": (3, 1, 16, [63, 1, 113]),  # (16 rows padded to 64: MLASettings.gluon_narrow)
    "one-block": (4, 1, 64, [63, 1, 1025, 0]),
    "four-blocks": (2, 2, 128, [113, 300]),
    "rows-past": (2, 3, 32, [70, 129]),
}


def _gluon_build():
    """The settings that run MLA programs in Gluon (those of fewer rows too), and its module; skips where it
    cannot run."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA build needs an sm90 GPU")
    from tileattn.kernels import gluon

    if not gluon.available():
        pytest.skip("this Triton's Gluon is not the one the kernels are written for")
    from tileattn.kernels.gluon import mla as gluon_mla

    s = configs.current(torch.device("cuda"))
    return dataclasses.replace(s, mla=dataclasses.replace(s.mla, gluon=True, gluon_narrow=True)), gluon_mla


# (the default build's cases run by default; the narrow programs, which the settings do not pick, with
# TILEATTN_SLOW=1)
GLUON_PARAMS = [
    pytest.param(case, causal, parts, marks=pytest.mark.slow if case == "narrow" else ())
    for case in GLUON_CASES
    for causal in (False, True)
    for parts in (None, 17)
]


@pytest.mark.parametrize("case, causal, parts", GLUON_PARAMS)
def test_mla_gluon_matches_reference(case, causal, parts, monkeypatch):
    """The Gluon build (``MLASettings.gluon``) against the reference, written whole or as split partials
    (17 parts), with the unused rows of each sequence's last page NaN (they must not reach the output:
    0 · NaN is NaN) and checks deferred to the kernels as the default calls do; it is the build that ran."""
    settings, gluon_mla = _gluon_build()
    batch, seqlen_q, nheads, lengths = GLUON_CASES[case]
    q, kv, table, lengths_t = _case("cuda", torch.bfloat16, batch, seqlen_q, nheads, lengths, 64)
    clean = kv.clone()
    for b, n in enumerate(lengths):
        if n % 64:
            kv[table[b, n // 64], n % 64 :] = float("nan")
    launches = []
    launch = gluon_mla.mla_fwd_gluon
    monkeypatch.setattr(gluon_mla, "mla_fwd_gluon", lambda *args: launches.append(1) or launch(*args))
    with configs.override(settings):
        given = () if parts is None else mla.schedule(lengths_t, parts, MLASettings(schedule_block=64))
        out, lse = mla.flash_mla_with_kvcache(q, kv, table, lengths_t, 512, *given, causal=causal)
        tileattn.check_errors("cuda")
    assert launches == [1]
    _check(f"gluon {case}", q, clean, table, lengths_t, 512, causal, out, lse)


def test_mla_gluon_finds_bad_lengths():
    """The Gluon build's call runs the deferred index checks that its kernel leaves out."""
    settings, _ = _gluon_build()
    q, kv, table, lengths = _case("cuda", torch.bfloat16, 2, 1, 64, [100, 20], 64)
    with configs.override(settings):
        mla.flash_mla_with_kvcache(q, kv, table, torch.tensor([100, 200], dtype=torch.int32, device="cuda"), 512)
        check_refused(lambda: tileattn.check_errors("cuda"), mla.InvalidArgument, ["exceeds", "capacity"])


@pytest.mark.parametrize("bad", ["past-capacity", "negative", "table"])
def test_mla_checks_as_a_kernel_of_their_own(backend, bad):
    """The deferred index checks that the Gluon build's call runs in a kernel of their own
    (``kernels.decode.mla._check_parts``, one program per part of the schedule) record what the portable
    kernel's own checks record for the same call and schedule: the same error words, each a real error."""
    if backend != "interpret":
        pytest.skip("the Triton kernels under the interpreter (on an sm90 GPU the Gluon tests run them)")
    from tileattn.kernels.decode import mla as kernels
    from tileattn.params import CALL_MLA, RECORD_WORDS

    q, kv, table, lengths = _case("cpu", torch.float16, 3, 1, 16, [100, 20, 70], 64)
    if bad == "past-capacity":
        lengths[1] = table.shape[1] * 64 + 1
    elif bad == "negative":
        lengths[2] = -5
    else:
        table[2, 1] = kv.shape[0] + 3
    meta, splits = mla.schedule(lengths.clamp(0, table.shape[1] * 64), 5, MLASettings())
    alone, inside = (torch.zeros(RECORD_WORDS, dtype=torch.int64) for _ in range(2))
    with on("interpret")[0]:
        kernels.CHECKS(
            (meta.shape[0], 1, 1),
            (alone, lengths, table, meta, table.stride(0), meta.stride(0), 3, kv.shape[0], table.shape[1] * 64),
            {"BLOCK_N": 64, "PAGE_SIZE": 64, "CHECK": CALL_MLA},
        )
        kernels.mla_fwd(q, kv, table, lengths, meta, splits, 512, 0.1, False, configs.current(q.device), inside)
    assert alone[0] > 0 and torch.equal(alone, inside), (alone.tolist(), inside.tolist())


def test_mla_bad_input(backend):
    dtype = torch.float32 if backend == "torch" else torch.float16
    ctx, device = on(backend)
    q, kv, table, lengths = _case(device, dtype, 2, 1, 16, [100, 20], 64)
    before = kv.clone()
    call = mla.flash_mla_with_kvcache
    i32 = torch.int32
    bad = [
        (lambda: call(q[..., :512], kv, table, lengths, 512), ["last dim", "576"]),
        (lambda: call(q, kv, table, lengths, 500), ["head_dim_v", "512"]),
        (lambda: call(q, kv, table, lengths, 448), ["head_dim_v", "[0, 64]"]),
        (lambda: call(q[:, :, :15], kv.view(-1, 32, 2, 576), table, lengths, 512), ["multiple", "nheads_k"]),
        (lambda: call(q, kv.view(-1, 8, 1, 576), table, lengths, 512), ["block_size", "16"]),
        (lambda: call(q, kv, table.long(), lengths, 512), ["block_table", "int32"]),
        (lambda: call(q, kv, table, lengths[:1], 512), ["cache_seqlens", "batch"]),
        (lambda: call(q, kv, table, lengths, 512, torch.zeros(4, 8, dtype=i32)), ["go together"]),
        (
            lambda: call(q, kv, table, lengths, 512, torch.zeros(4, 7, dtype=i32), torch.zeros(3, dtype=i32)),
            ["(num_sm_parts, 8)"],
        ),
        (
            lambda: call(q, kv, table, lengths, 512, torch.zeros(4, 8, dtype=i32), torch.zeros(2, dtype=i32)),
            ["num_splits", "(3,)"],
        ),
        (lambda: call(q, kv, table, lengths, 512, causal=1), ["causal", "bool"]),
        (lambda: call(q, kv, table, lengths, 512, softmax_scale=float("nan")), ["softmax_scale"]),
        (lambda: call(q.double(), kv.double(), table, lengths, 512), ["float16"]),
    ]
    # index values: refused at once on the CPU; on the GPU the kernel finds them, the next check raises
    bad_values = [
        (lambda: call(q, kv, table, torch.tensor([100, 200], dtype=i32, device=device), 512), ["exceeds", "capacity"]),
        (lambda: call(q, kv, table, torch.tensor([-1, 20], dtype=i32, device=device), 512), [">= 0"]),
        (lambda: call(q, kv, table + kv.shape[0], lengths, 512), ["block_table", "not a page"]),
    ]
    with ctx:
        for fn, words in bad:
            check_refused(fn, mla.InvalidArgument, words)
        for fn, words in bad_values:
            if backend == "cuda":
                fn()
                check_refused(lambda: tileattn.check_errors(device), mla.InvalidArgument, words)
            else:
                check_refused(fn, mla.InvalidArgument, words)
        check_refused(lambda: mla.get_mla_metadata(lengths, 0, 1), mla.InvalidArgument, ["num_q_tokens_per_head_k"])
        check_refused(lambda: mla.get_mla_metadata(lengths.long(), 16, 1), mla.InvalidArgument, ["int32"])
    assert torch.equal(kv, before)


def test_example_matches_layer_without_absorption(backend):
    """The MLA layer decoding over a latent PagedKVCache with the projections absorbed agrees, step by
    step, with the same layer expanded per head over the whole history without a cache."""
    ctx, device = on(backend)
    dtype = {"cuda": torch.bfloat16, "torch": torch.float32, "interpret": torch.float16}[backend]
    with ctx:
        worst = example("mla_decode").run(device, dtype, steps=3 if backend == "interpret" else 8, verbose=False)
    assert worst <= (1e-4 if dtype == torch.float32 else 3e-2), worst


def test_latent_pool_writes_rows_where_the_step_says():
    cache = PagedKVCache(2, 8, 4, 1, 24, dtype=torch.float32, values=False)
    assert cache.v is None
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a, b], [5, 2])
    step = cache.append([a, b], [3, 1])
    rows = torch.randn(2, 3, 1, 24)
    step.write(1, rows)
    kw = step.mla_kwargs(1)
    assert kw["cache_seqlens"].tolist() == [8, 3] and kw["k_cache"].data_ptr() == cache.k[1].data_ptr()
    for row, (seq, start, n) in enumerate([(a, 5, 3), (b, 2, 1)]):
        pages = cache.pages(seq)
        for i in range(n):
            pos = start + i
            assert torch.equal(cache.k[1, pages[pos // 4], pos % 4], rows[row, i])
    assert cache.k[0].abs().sum() == 0  # the other layer untouched
    check_refused(lambda: step.kwargs(0), ValueError, ["latent pool", "mla_kwargs"])
    check_refused(lambda: step.write(0, rows[:, :2]), ValueError, ["3"])
    check_refused(lambda: step.write(0, rows[..., :16]), ValueError, ["(batch, n, nheads_k, headdim)"])
    check_refused(lambda: step.write(0, rows, rows), ValueError, ["values"])
    check_refused(
        lambda: PagedKVCache(1, 4, 4, 1, 576, dtype=torch.float8_e4m3fn, values=False), ValueError, ["latent pool"]
    )
