"""The benchmark's own arithmetic (the work a masked problem does, which ``--features`` divides by) and
its harnesses on the CPU path: features, decode A/B, host time, dropout, and the CLI's options."""

import ast
import itertools
import json
import pathlib
from dataclasses import replace

import pytest
import torch

import oracle
from tileattn.bench.features import visible_pairs
from tileattn.testing import check_close


@pytest.mark.parametrize(
    "causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 5)), (False, (7, 0)), (True, (3, 9))]
)
@pytest.mark.parametrize("seqlen", [1, 13, 64])
def test_visible_pairs_counts_the_mask(seqlen, causal, window):
    mask = oracle.visible(seqlen, seqlen, *oracle.window_sides(causal, window, seqlen), seqlen, seqlen)
    assert visible_pairs(seqlen, causal, window) == int(mask.sum())


def test_features_harness_on_the_cpu_path():
    """run_features end to end on small CPU inputs (a fixed fake timer): every case passes its check,
    each row's work matches visible_pairs, ratios are against the right baseline, and progress names
    each case before it runs."""
    from tileattn.bench.features import format_features, run_features

    lines = []
    times = itertools.cycle([1.0, 3.0])  # forward, forward + backward

    def fake_time(fn, device):
        assert device == "cpu"
        fn()
        return next(times)

    rows = run_features(
        fake_time,
        headdim=16,
        seqlen=48,
        tokens=96,
        hidden=64,
        window=8,
        dtype=torch.float32,
        progress=lines.append,
        device="cpu",
    )
    assert [r["case"] for r in rows] == [
        "dense",
        "causal",
        "GQA 4:1",
        "GQA 4:1 causal",
        "window (8, 8)",
        "window (8, 0)",
        "varlen (same lengths)",
        "varlen causal",
    ]
    assert all("error" not in r for r in rows)
    assert sum("checking" in line for line in lines) == len(rows)
    by_case = {r["case"]: r for r in rows}
    # a fixed time: TFLOP/s ratios are the ratios of work, i.e. of visible pairs
    assert by_case["causal"]["fwd_ratio"] == pytest.approx(visible_pairs(48, True, (-1, -1)) / 48**2)
    assert by_case["GQA 4:1 causal"]["baseline"] == "causal" and by_case["GQA 4:1 causal"][
        "fwd_ratio"
    ] == pytest.approx(1.0)
    assert by_case["window (8, 0)"]["fwd_ratio"] == pytest.approx(visible_pairs(48, False, (8, 0)) / 48**2)
    assert "window (8, 0)" in format_features(rows)


def test_tuner_gradient_check_catches_a_wrong_group():
    """The tuner's gradient check (bench.tune._check_grads) passes the CPU path's GQA gradients and
    refuses them when one query head of the checked group is wrong."""
    import tileattn
    from tileattn.bench.tune import _check_grads

    q = torch.randn(2, 40, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, 40, 2, 16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    grads = torch.autograd.grad(tileattn.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    _check_grads("cpu", grads, q, k, v, dout, True)
    bad = grads[0].clone()
    bad[0, :, 3] *= 1.01  # query head 3 shares kv head 0 (groups of 4)
    with pytest.raises(AssertionError, match="dq"):
        _check_grads("cpu", (bad, *grads[1:]), q, k, v, dout, True)


def test_tuner_exp2_splits_checks_then_times_each_build(monkeypatch):
    """bench.tune.exp2_splits (``--exp2-poly``) at a tiny shape (without a GPU the kernels under the interpreter,
    fp16): each exp2_poly build is checked, then timed in every round with its ratio to the first; a build that
    fails its check is reported and left out."""
    from tileattn.bench import tune

    check = tune.check_backend

    def failing_eight(name, *args, **kwargs):
        if name == "exp2_poly=8":
            raise AssertionError("out of tolerance")
        return check(name, *args, **kwargs)

    monkeypatch.setattr(tune, "check_backend", failing_eight)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = tune.exp2_splits(
        headdims=(64,),
        seqlens=(40,),
        polys=(0, 3, 8),
        rounds=2,
        tokens=40,
        hidden=128,
        device=device,
        dtype=torch.float16,
    )
    assert {(r["causal"], r["poly"]) for r in rows if "error" in r} == {(False, 8), (True, 8)}
    timed = [r for r in rows if "ms" in r]
    assert sorted((r["causal"], r["round"], r["poly"]) for r in timed) == sorted(
        (c, r, p) for c in (False, True) for r in (0, 1) for p in (0, 3)
    )
    assert all(r["vs_first"] == 1.0 for r in timed if r["poly"] == 0) and all(r["tflops"] > 0 for r in timed)


@pytest.mark.parametrize(
    "argv, words",
    [(["--fp8"], "--fp8 goes with --exp2-poly"), (["--exp2-poly", "--causal"], "drop --causal"),
     (["--exp2-poly", "--dropout", "0.1"], "drop --causal / --dropout")],
)  # fmt: skip
def test_tuner_refuses_options_exp2_poly_cannot_apply(argv, words, capsys):
    from tileattn.bench import tune

    with pytest.raises(SystemExit) as exc:
        tune.main(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("order", ["shuffled", "in order", "lockstep", 2])
def test_decode_pool_reference_follows_the_table(order):
    """The decode benchmark's paged rows check each backend against ``_pool``'s reference keys: the
    first sequence's keys in the order its block table gives them. tileattn's paged call (CPU path)
    must match attention over them; each order must place the pages where its docstring says."""
    from tileattn.bench.decode import _pool, _tileattn

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    k = torch.randn(2, 128, 2, 16, generator=gen)
    v = torch.randn(2, 128, 2, 16, generator=gen)
    _, _, table, _, _ = _pool(q, k, v, 16, order)
    pages = table.flatten().tolist()
    assert sorted(pages) == list(range(16))
    if order == "in order":
        assert pages == list(range(16))
    elif order == "lockstep":
        assert table.tolist() == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    elif order == 2:
        assert pages != list(range(16)) and [p // 2 for p in pages] == [i // 2 for i in range(16)]
    else:
        assert pages != list(range(16)) and any(p // 2 != i // 2 for i, p in enumerate(pages))
    run, ref_k, ref_v = _tileattn(page=16, order=order)(q, k, v, torch.full((2,), 128, dtype=torch.int32))
    out = run()
    # the pool is the caches cut into pages of 16 keys; sequence 0 reads them in its table's order
    first = table[0].long()
    assert torch.equal(ref_k, k.reshape(16, 16, 2, 16)[first].reshape(1, 128, 2, 16))
    assert torch.equal(ref_v, v.reshape(16, 16, 2, 16)[first].reshape(1, 128, 2, 16))
    ref, lowp = (oracle.attention(q[:1], ref_k, ref_v, precision=p).out for p in (torch.float64, None))
    check_close(f"paged decode, pages {order}", out[:1], ref, lowp)
    with pytest.raises(ValueError, match="order"):
        _pool(q, k, v, 16, 3)


def test_decode_fa4_rows_need_flash_attn_cute():
    """Without FlashAttention-4 installed its decode rows raise Unavailable (run_decode then leaves them
    out of the table instead of printing error rows)."""
    import importlib.util

    from tileattn.bench.backends import Unavailable
    from tileattn.bench.decode import DECODE_BACKENDS

    try:
        installed = importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        installed = False
    if installed:
        pytest.skip("flash_attn.cute is installed here")
    q, k = torch.zeros(1, 1, 4, 16), torch.zeros(1, 32, 2, 16)
    for name in ("fa4", "fa4 paged16"):
        with pytest.raises(Unavailable, match="not installed"):
            DECODE_BACKENDS[name](q, k, k, torch.full((1,), 32, dtype=torch.int32))


def test_cli_keeps_its_options_and_defaults():
    """The grid's, --decode's, --features' and --varlen's options parse as before; the grid's settings not
    given are the device's (the papers' grid on a GPU, a small one on CPU), those given are noted; the
    new modes are off unless asked for."""
    from tileattn.bench.__main__ import grid_defaults, parse_args

    gpu = grid_defaults("cuda", quick=False)
    assert gpu["headdim"] == [64, 128, 256] and gpu["seqlen"] == [512, 1024, 2048, 4096, 8192, 16384]
    assert (gpu["tokens"], gpu["hidden"], gpu["causal"], gpu["mode"]) == (16384, 2048, "both", "fwd+bwd")
    assert grid_defaults("cuda", quick=True) | dict(headdim=None, seqlen=None) == gpu | dict(headdim=None, seqlen=None)
    cpu = grid_defaults("cpu", quick=False)
    assert (cpu["headdim"], cpu["seqlen"], cpu["tokens"], cpu["hidden"]) == ([64], [512, 2048], 2048, 256)
    assert grid_defaults("cpu", quick=True) == cpu | dict(causal="yes", mode="fwd")
    args = parse_args(["--device", "cpu"])
    assert all(getattr(args, key) == value for key, value in cpu.items()) and args.given == set()
    args = parse_args(["--device", "cpu", "--quick", "--seqlen", "64", "--causal", "no"])
    assert (args.seqlen, args.causal, args.mode, args.given) == ([64], "no", "fwd", {"seqlen", "causal"})
    args = parse_args([])
    assert str(args.out) == "bench_results/results.jsonl" and args.backends is None and args.dtype is None
    assert not any((args.quick, args.plot, args.varlen, args.decode, args.features))
    assert not any((args.decode_ab, args.host, args.dropout, args.masks, args.cp)) and args.world is None
    args = parse_args(["--decode-ab", "--rows", "64x4096", "--layouts", "tileattn append", "--anchors", "fa4"])
    assert args.decode_ab and args.rows == ["64x4096"] and args.layouts == ["tileattn append"]
    assert args.anchors == ["fa4"] and (args.rounds, args.replays) == (5, 5)
    assert parse_args(["--dropout", "--dropout-p", "0.2"]).dropout_p == 0.2


def _tiny_ab(layouts, anchors, calls, **kwargs):
    """run_decode_ab on the CPU path: 2 sequences of 64 keys, GQA 4/2, head dim 16, two input copies; the
    timer returns a fixed ms per replayed graph (by the order of the graphs' first use) and logs each
    replay's outputs' owner."""
    from tileattn.bench.decode import run_decode_ab

    order = []

    def timer(replay, n, replays, device):
        assert device.type == "cpu" and n == 2 and replays == 3
        outs = replay()
        order.append(id(replay))
        assert len(outs) == n
        return calls.setdefault(id(replay), 0.25 * (len(calls) + 1))

    rows = run_decode_ab(
        [(2, 64)],
        layouts,
        anchors,
        rounds=2,
        replays=3,
        dtype=torch.float32,
        nheads=4,
        nheads_k=2,
        headdim=16,
        device="cpu",
        progress=lambda line: None,
        time_replay=timer,
        touch_bytes=2 * 2 * 64 * 2 * 16 * 4 * 2,  # two copies of the K+V bytes
        **kwargs,
    )
    return rows, order


def test_decode_ab_on_the_cpu_path():
    """--decode-ab's harness: every layout (paged, pages in table order, a kernel ahead, the append step)
    passes its reference check; each layout's graphs and its anchor's take turns in every round; GB/s is
    the K+V bytes over the timer's ms, with the rounds' median and range; the table prints each layout's
    ratio to the anchor."""
    from tileattn.bench.decode import format_decode_ab

    layouts = ["tileattn paged16", "tileattn paged16 lockstep", "tileattn after a kernel", "tileattn paged16 append"]
    calls = {}
    rows, order = _tiny_ab(layouts, ("tileattn",), calls)
    assert all("error" not in r for r in rows), rows
    assert [(r["case"], r["backend"]) for r in rows] == [(lay, name) for lay in layouts for name in (lay, "tileattn")]
    # per layout: two graphs (layout, anchor), taking turns over two rounds
    assert len(order) == 2 * 2 * len(layouts)
    for i in range(len(layouts)):
        a, b = order[4 * i], order[4 * i + 1]
        assert a != b and order[4 * i : 4 * i + 4] == [a, b, a, b]
    kv_bytes = 2 * 2 * 64 * 2 * 16 * 4
    for r in rows:
        assert r["gbps"] == pytest.approx(kv_bytes / r["ms"] / 1e6) and r["gbps_min"] == r["gbps_max"] == r["gbps"]
        assert len(r["gbps_rounds"]) == 2
    first = {(r["case"], r["backend"]): r["gbps"] for r in rows}
    table = format_decode_ab(rows)
    ratio = (
        first[("tileattn paged16 append", "tileattn paged16 append")] / first[("tileattn paged16 append", "tileattn")]
    )
    assert f"{ratio:.3f}" in table and "tileattn paged16 lockstep" in table


def test_decode_ab_reports_a_wrong_layout(monkeypatch):
    """A layout whose output is wrong is an error row and is not timed, its anchor neither; an append
    step's check refuses a cache the step did not write."""
    from tileattn.bench import decode

    def wrong(q, k_cache, v_cache, seqlens):
        run, expected = decode.AB_LAYOUTS["tileattn"](q, k_cache, v_cache, seqlens)
        return (lambda: run() * 1.01), expected

    monkeypatch.setitem(decode.AB_LAYOUTS, "wrong", wrong)
    rows, order = _tiny_ab(["wrong", "tileattn"], ("tileattn paged16",), {})
    assert [r["backend"] for r in rows if r["case"] == "wrong"] == ["wrong"] and "error" in rows[0]
    assert [r["backend"] for r in rows if r["case"] == "tileattn"] == ["tileattn", "tileattn paged16"]
    assert len(order) == 4  # the second layout's two graphs only

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 16, generator=gen)
    k, v = (torch.randn(1, 64, 2, 16, generator=gen) for _ in range(2))
    run, expected = decode.AB_LAYOUTS["tileattn append"](q, k, v, torch.full((1,), 64, dtype=torch.int32))
    with pytest.raises(AssertionError):
        expected()  # the new token is not in the cache before the step runs
    run()
    expected()


def test_host_on_the_cpu_path():
    """--host's harness: every call it times, each output checked first (a wrong output fails the check),
    host time per call measured (no device time off CUDA)."""
    from tileattn.bench.host import decode_cases, format_host, run_host, training_cases

    cpu = torch.device("cpu")
    shape = (2, 64, 4, 2, 16)
    for call, check in [
        *training_cases(cpu, torch.float32, (2, 32, 4, 16)).values(),
        *decode_cases(cpu, torch.float32, shape).values(),
    ]:
        if check is None:
            continue
        out = call()
        check(out)
        with pytest.raises(AssertionError):
            check(out.detach() * 1.01)
    rows = run_host(
        cpu,
        torch.float32,
        calls=2,
        rounds=2,
        training_shape=(2, 32, 4, 16),
        decode_shape=shape,
        progress=lambda s: None,
    )
    assert [(r["case"], r["backend"]) for r in rows] == [
        ("training", "tileattn fwd"),
        ("training", "sdpa fwd"),
        ("training", "tileattn varlen fwd"),
        ("training", "tileattn fwd p=0.1"),
        ("training", "tileattn fwd+bwd"),
        ("training", "sdpa fwd+bwd"),
        ("training", "tileattn varlen fwd+bwd"),
        ("training", "tileattn fwd+bwd p=0.1"),
        ("decode", "tileattn"),
        ("decode", "tileattn, new cache_seqlens"),
        ("decode", "tileattn paged16"),
        ("decode", "tileattn append"),
        ("decode", "sdpa"),
    ]
    assert all(r["host_us"] > 0 and r["device_us"] is None for r in rows)
    # each tileattn training call over SDPA's of its kind (no dropout SDPA off CUDA: no ratio there)
    ratios = {r["backend"]: r.get("ratio") for r in rows if r["case"] == "training"}
    assert ratios["tileattn fwd"] > 0 and ratios["tileattn varlen fwd+bwd"] > 0
    assert ratios["tileattn fwd+bwd p=0.1"] is None
    assert "tileattn paged16" in format_host(rows)


def test_hf_decode_on_the_cpu_path(tmp_path):
    """--hf-decode's CPU form: a tiny Llama, static cache, each backend's first decode step checked against
    fp64 eager attention before it is timed, tokens/s per backend and batch, rows written by the CLI."""
    pytest.importorskip("transformers")
    from tileattn.bench.__main__ import main, parse_args
    from tileattn.bench.hf_decode import format_hf_decode, run_hf_decode

    rows = run_hf_decode("cpu", batches=(1, 3), prompt_len=6, new_tokens=3, progress=lambda line: None)
    assert [(r["backend"], r["batch"]) for r in rows] == [(b, n) for n in (1, 3) for b in ("tileattn", "sdpa")]
    assert all(r["tokens_per_s"] > 0 and r["compiled"] is None and r["kind"] == "hf_decode" for r in rows)
    assert "× sdpa" in format_hf_decode(rows)
    assert parse_args(["--hf-decode"]).hf_decode and not parse_args([]).hf_decode
    out = tmp_path / "r.jsonl"
    assert main(["--hf-decode", "--device", "cpu", "--out", str(out)]) == 0
    assert [json.loads(line)["batch"] for line in out.read_text().splitlines()] == [1, 1, 16, 16]
    assert main(["--hf-decode", "--device", "cpu", "--out", str(out), "--hf-batches", "3"]) == 0
    assert [json.loads(line)["batch"] for line in out.read_text().splitlines()][4:] == [3, 3]


def test_dropout_on_the_cpu_path(tmp_path):
    """--dropout's harness: tileattn with and without dropout (SDPA's FlashAttention-2 is CUDA only), the
    ratios over the dropout call's times, and the CLI writing its rows."""
    from tileattn.bench.__main__ import main
    from tileattn.bench.dropout import format_dropout, run_dropout

    times = itertools.cycle([2.0, 8.0, 0.5, 2.0])  # p=0.1 fwd, fwd+bwd; p=0 fwd, fwd+bwd

    def fake_time(fn, device):
        assert device == "cpu"
        fn()
        return next(times)

    rows = run_dropout(fake_time, 0.25, [(16, 32, True)], tokens=64, hidden=64, dtype=torch.float32, device="cpu")
    assert [r["backend"] for r in rows] == ["tileattn p=0.25", "tileattn p=0"]
    assert rows[1]["fwd_ratio"] == 0.25 and rows[1]["fwd_bwd_ratio"] == 0.25 and rows[0]["fwd_ratio"] == 1.0
    assert (rows[0]["batch"], rows[0]["nheads"], rows[0]["dropout_p"]) == (2, 4, 0.25)
    assert "0.25" in format_dropout(rows)

    out = tmp_path / "r.jsonl"
    argv = ["--dropout", "--device", "cpu", "--headdim", "16", "--seqlen", "32", "--causal", "no"]
    assert main([*argv, "--tokens", "64", "--hidden", "32", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and all('"kind": "dropout"' in line for line in lines)
    assert main(["--decode-ab", "--device", "cpu"]) == 1 and main(["--host", "--device", "cpu"]) == 1


def test_cp_on_cpu_processes(tmp_path, capfd):
    """--cp on CPU processes (the default without GPUs, ``--device cpu`` with them): 2 gloo processes, every
    scheme timed against the single-process anchor and matching the single-process output exactly enough
    (fp32: far below a bf16 ulp), a line as each is timed, and the table saying what CPU efficiencies
    measure."""
    from tileattn.bench.__main__ import main

    out = tmp_path / "r.jsonl"
    assert main(["--cp", "--device", "cpu", "--seqlen", "64", "128", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["scheme"], r["seqlen"]) for r in rows] == [
        (s, n) for n in (64, 128) for s in ("zigzag", "ring", "ulysses", "gather-kv")
    ]
    assert all(r["world"] == 2 and r["ms"] > 0 and r["ulps"] < 0.01 for r in rows)
    assert all(r["threads"] >= 1 and 0 < r["share"] and r["spread"] >= 0 and "noisy" in r for r in rows)
    text = capfd.readouterr().out  # (the ranks' lines come from the spawned processes)
    assert "On CPU the 2 ranks are processes" in text
    assert all(f"cp {r['scheme']} {r['seqlen']} tokens: " in text for r in rows)


def test_cp_noise_on_a_busy_machine():
    """flag_noise marks CPU rows whose repeats spread or whose ranks starved beside other work (not GPU
    rows, not a starved run on an otherwise idle machine); the note then says they measure the load."""
    from tileattn.bench.context import cpu_note, flag_noise, format_context

    def row(device="cpu", spread=0.02, share=0.95):
        return dict(case="cp", scheme="zigzag", world=2, seqlen=512, anchor_ms=10.0, ms=12.0, efficiency=1.7,
                    ulps=0.0, device=device, threads=1, spread=spread, share=share)  # fmt: skip

    steady, spread, starved, gpu = row(), row(spread=0.3), row(share=0.3), row("cuda", share=0.3)
    flag_noise([steady, spread, starved, gpu], load=0.1)
    assert (steady["noisy"], spread["noisy"], starved["noisy"], "noisy" in gpu) == (False, True, False, False)
    flag_noise([starved], load=3.0)
    assert starved["noisy"]
    assert "Rows marked noisy" not in cpu_note([steady]) and "not how GPUs scale" in cpu_note([steady])
    note = cpu_note([steady, starved])
    assert "measure the machine's load" in note and "30% of their time" in note
    assert "1.70 noisy" in format_context([steady, starved]) and cpu_note([gpu]) is None


def test_bench_uses_the_public_api_only():
    """The bench modules (the tuner aside, which sweeps the kernels' tables) import tileattn's public
    modules only, so they measure what users call."""
    public = {"tileattn", "tileattn.reference", "tileattn.testing", "tileattn.cache", "tileattn.rotary"}
    public.add("tileattn.integrations.transformers")  # (--hf-decode: attn_implementation="tileattn")
    bench = pathlib.Path(__file__).parents[2] / "src" / "tileattn" / "bench"
    for path in sorted(bench.glob("*.py")):
        if path.name == "tune.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("tileattn") and not name.startswith("tileattn.bench"):
                    assert name in public, f"{path.name} imports {name}"


def test_cpu_rounds_take_turns_and_stop_on_budget():
    """time_in_turns: every round runs each callable once, the order reversed every other round; it stops
    at max_rounds, or after min_rounds once the budget is spent."""
    from tileattn.bench import cpu_grid

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = cpu_grid.time_in_turns(fns, budget_s=60.0, min_rounds=2, max_rounds=4)
    assert calls == ["a", "b", "c", "c", "b", "a"] * 2
    assert all(len(t["wall_ms"]) == len(t["cpu_ms"]) == 4 for t in times.values())
    calls.clear()
    cpu_grid.time_in_turns(fns, budget_s=0.0, min_rounds=3, max_rounds=10)
    assert len(calls) == 3 * 3


def _times(wall_a, wall_b, share=1.0, threads=2):
    return {
        "tileattn": {"wall_ms": wall_a, "cpu_ms": [w * share * threads for w in wall_a]},
        "eager": {"wall_ms": wall_b, "cpu_ms": [w * share * threads for w in wall_b]},
    }


def test_cpu_summary_ratios_and_noise():
    """summarize: medians, the median of the rounds' ratios with its quartiles, the threads' share of time;
    one slow round moves neither; noisy when the quartiles differ by more than NOISY, or when the run got
    little of its threads' time while other work loaded the machine (not when the load is its own), and
    then, with more than one thread, starved: no ratio means anything."""
    from tileattn.bench.cpu_grid import NOISY, noise_note, summarize

    steady = summarize(_times([10, 11, 10, 12, 10], [20, 22, 20, 24, 20]), "tileattn", threads=2)
    assert steady["tileattn"]["ms"] == 10 and steady["eager"]["ms"] == 20
    assert steady["eager"]["ratio"] == steady["eager"]["ratio_lo"] == steady["eager"]["ratio_hi"] == 2.0
    assert steady["eager"]["share"] == pytest.approx(1.0) and steady["eager"]["rounds"] == 5
    assert not any(s["noisy"] for s in steady.values())

    # one round in which the machine slowed only the first backend: the median and quartiles hold
    outlier = summarize(_times([10, 30, 10, 10, 10], [20, 20, 21, 20, 20]), "tileattn", threads=2)
    assert outlier["eager"]["ratio"] == 2.0 and not outlier["eager"]["noisy"]

    # slowed in three rounds of six: the quartiles part (ratios 0.67, 0.8, 1.43, 2, 2, 2)
    spread = summarize(_times([10, 30, 10, 25, 10, 14], [20] * 6), "tileattn", threads=2)
    s = spread["eager"]
    assert s["ratio"] == pytest.approx((20 / 14 + 2) / 2) and s["ratio_hi"] == 2.0
    assert s["ratio_lo"] == pytest.approx(0.8 + 0.25 * (20 / 14 - 0.8))
    assert s["noisy"] and s["ratio_hi"] / s["ratio_lo"] - 1 > NOISY

    starved = _times([10] * 3, [20] * 3, share=0.2)
    assert not summarize(starved, "tileattn", threads=2, load=0.1)["eager"]["noisy"]
    busy = summarize(starved, "tileattn", threads=2, load=6.0)
    assert busy["eager"]["noisy"] and busy["tileattn"]["noisy"] and busy["eager"]["starved"]
    alone = summarize(_times([10] * 3, [20] * 3, share=0.2, threads=1), "tileattn", threads=1, load=6.0)
    assert alone["eager"]["noisy"] and not alone["eager"]["starved"]

    def rows(stats):
        return [
            {f"fwd_{key}": value for key, value in s.items()} | {"backend": name, "threads": 2}
            for name, s in stats.items()
        ]

    assert noise_note(rows(steady), ["fwd"], threads=2) is None
    note = noise_note(rows(spread), ["fwd"], threads=2)
    width = 1 - s["ratio_lo"] / s["ratio"]
    assert note.startswith("noisy: the machine is busy") and f"±{width:.0%}" in note and "--threads 1" in note
    note = noise_note(rows(busy), ["fwd"], threads=2)
    assert note.startswith("not meaningful: the machine is busy") and "20% of their time" in note
    assert noise_note(rows(alone), ["fwd"], threads=1).startswith("noisy: the machine is busy")


def test_cpu_threads_follow_the_idle_cores(monkeypatch):
    """pick_threads: PyTorch's default on an idle machine, capped by the cores a busy one leaves idle (at
    least one), and what --threads asks."""
    from tileattn.bench import cpu_grid

    monkeypatch.setattr(cpu_grid, "cores", lambda: 4)
    monkeypatch.setattr(cpu_grid.torch, "get_num_threads", lambda: 4)
    for load, threads in [(0.2, 4), (0.6, 4), (1.1, 3), (2.6, 2), (2.8, 1), (9.0, 1)]:
        monkeypatch.setattr(cpu_grid.os, "getloadavg", lambda load=load: (load, load, load))
        assert cpu_grid.pick_threads()[0] == threads, load
    assert "leaves 1 idle" in cpu_grid.pick_threads()[1]
    assert cpu_grid.pick_threads(3) == (3, "as asked")
    with pytest.raises(ValueError, match="--threads"):
        cpu_grid.pick_threads(0)


def test_cpu_peak_memory_sees_the_score_matrix():
    """peak_mib, measured in one child process one call after another: eager holds (batch, nheads, S, S)
    fp32 scores, so its peak is at least that; the CPU path's blocks stay far below it, also when it runs
    after eager (whose freed memory must not hide the next call's)."""
    from tileattn.bench.cpu_grid import peak_mib

    if not pathlib.Path("/proc/self/clear_refs").exists():
        pytest.skip("peak memory needs Linux's /proc")
    cases = [(2, 1024, 4, 32, False), (2, 1024, 4, 32, True)]
    peak = peak_mib(cases, ["eager", "tileattn"], torch.float32, threads=1)
    scores = 2 * 4 * 1024 * 1024 * 4 / 2**20  # MiB
    for case in cases:
        assert peak[(*case, "eager")] >= scores, peak
        assert peak[(*case, "tileattn")] < scores / 2, peak


def test_cpu_grid_end_to_end(tmp_path, capsys):
    """The grid on CPU through the CLI at tiny sizes: each backend checked and timed in turns, the table
    with the rounds' ratio ranges, rows with their threads and peak memory, PyTorch's threads restored."""
    import json

    from tileattn.bench.__main__ import main

    threads = torch.get_num_threads()
    out = tmp_path / "r.jsonl"
    argv = ["--device", "cpu", "--headdim", "16", "--seqlen", "64", "128", "--tokens", "128", "--hidden", "32"]
    assert main([*argv, "--causal", "yes", "--threads", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    text = capsys.readouterr().out
    assert "CPU: 1 thread(s), as asked" in text and "tileattn speed-up (bwd)" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["backend"], r["seqlen"]) for r in rows] == [
        ("tileattn", 64),
        ("eager", 64),
        ("tileattn", 128),
        ("eager", 128),
    ]
    for r in rows:
        assert r["threads"] == 1 and r["fwd_rounds"] >= 3 and r["bwd_ms"] > 0 and r["peak_mem_mib"] >= 0
        assert r["fwd_ratio_lo"] <= r["fwd_ratio"] <= r["fwd_ratio_hi"]
        assert f"{r['fwd_ratio']:.2f}x ({r['fwd_ratio_lo']:.2f}-{r['fwd_ratio_hi']:.2f})" in text or (
            r["backend"] == "tileattn"
        )


def test_cli_quick_and_device_choices():
    """--quick on CPU times the forward unless --mode says otherwise; --device cuda without a GPU and
    --threads below 1 end in argparse's usage line and a sentence, not a traceback."""
    from tileattn.bench.__main__ import parse_args

    assert parse_args(["--quick", "--device", "cpu"]).mode == "fwd"
    assert parse_args(["--quick", "--device", "cpu", "--mode", "fwd+bwd"]).mode == "fwd+bwd"
    assert parse_args(["--device", "cpu"]).mode == "fwd+bwd"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--threads", "0"])
    assert exc.value.code == 2
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            parse_args(["--device", "cuda"])
        assert exc.value.code == 2


def test_table_of_gpu_rows_is_unchanged():
    """The GPU grid's rows (timed alone, no rounds) keep their table: ms, TFLOP/s, the plain ms ratio to
    tileattn, peak GB; CPU rows add the rounds' range and the noisy mark."""
    from tileattn.bench.__main__ import format_table

    case = dict(headdim=128, causal=True, seqlen=4096, batch=4)
    gpu = [
        dict(case, backend="tileattn", fwd_ms=1.0, fwd_tflops=100.0, peak_mem_gb=1.5),
        dict(case, backend="sdpa-cudnn", fwd_ms=0.8, fwd_tflops=125.0, peak_mem_gb=1.25),
    ]
    table = format_table(gpu, ["fwd"], "cuda")
    assert "| 0.80x " in table and "1.25 GB" in table and "noisy" not in table
    cpu = [
        dict(case, backend="tileattn", fwd_ms=10.0, fwd_tflops=1.0, peak_mem_mib=5.0),
        dict(
            case,
            backend="eager",
            fwd_ms=20.0,
            fwd_tflops=0.5,
            peak_mem_mib=137.0,
            fwd_ratio=2.0,
            fwd_ratio_lo=1.5,
            fwd_ratio_hi=2.5,
            fwd_noisy=True,
        ),
    ]
    table = format_table(cpu, ["fwd"], "cpu")
    assert "2.00x (1.50-2.50) noisy" in table and "137 MiB" in table


def test_grid_is_tileattn_over_the_best_anchor_per_cell():
    """The Hopper bar's grid: per cell tileattn ÷ the faster of FA4 and cuDNN in the same case (another backend,
    however fast, is not an anchor), the minimum and median over the cells and those under 0.95."""
    from tileattn.bench.__main__ import format_grid

    def case(seqlen, causal, **tflops):
        return [
            dict(headdim=128, causal=causal, seqlen=seqlen, batch=16384 // seqlen, backend=name, fwd_tflops=tf)
            for name, tf in tflops.items()
        ]

    rows = case(1024, True, tileattn=300.0, fa4=400.0, **{"sdpa-cudnn": 500.0, "sdpa-flash": 900.0})
    rows += case(2048, True, tileattn=480.0, fa4=500.0, **{"sdpa-cudnn": 450.0})
    rows += case(2048, False, tileattn=660.0, fa4=600.0)
    rows += case(4096, False, tileattn=700.0)  # (no anchor: not a cell)
    grid = format_grid(rows, ["fwd"])
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in grid.splitlines() if line.startswith("| hd")]
    assert cells == [["hd128", "fwd", "-", "1.10"], ["hd128 causal", "fwd", "0.60", "0.96"]], grid
    assert "3 cells, min 0.60, median 0.96; under 0.95: hd128 causal fwd 1024: 0.60" in grid, grid
    assert format_grid(case(1024, False, tileattn=1.0, eager=2.0), ["fwd"]) is None


def test_masks_cases_are_their_builders():
    """--masks compares backends on one mask each: FlexAttention's mask_mod and the FlashMask builder's indices
    must describe the same mask (here at 4k tokens, several documents)."""
    import oracle
    from tileattn.bench.masks import dense_visible, mask_cases

    n = 4096
    for name, idx, causal, mask_mod in mask_cases(n, "cpu"):
        seen = oracle.flashmask_visible(idx, causal, n)[0, 0]
        if causal:
            seen &= torch.ones(n, n, dtype=torch.bool).tril()
        assert torch.equal(seen, dense_visible(mask_mod, n, "cpu")), name


def test_masks_harness_on_the_cpu_path():
    """The --masks harness's backends and step on CPU tensors (FlexAttention stood in for by SDPA with the
    dense mask), and its table's ratios."""
    from tileattn.bench.masks import _backends, _step, dense_visible, format_masks, mask_cases

    n = 256
    name, idx, causal, mask_mod = mask_cases(n, "cpu")[2]  # a shared question
    q, k, v = (torch.randn(1, n, 2, 16, requires_grad=True) for _ in range(3))
    dense = dense_visible(mask_mod, n, "cpu")[None, None]

    def flex(qt, kt, vt, block_mask):
        assert block_mask == "block mask"
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense)

    calls = _backends(q, k, v, idx, causal, flex, "block mask", dense)
    assert set(calls) == {"tileattn", "flex", "sdpa dense mask"}
    outs = {backend: call() for backend, call in calls.items()}
    torch.testing.assert_close(outs["tileattn"], outs["flex"], atol=1e-5, rtol=0)
    _step(calls["tileattn"], (q, k, v), torch.ones_like(q))
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))
    row = dict(kind="masks", mask=name, seqlen=n, density=0.5, fwd_tflops=300.0, bwd_tflops=200.0)
    rows = [dict(row, backend="tileattn"), dict(row, backend="flex", fwd_tflops=200.0, bwd_tflops=200.0)]
    table = format_masks(rows)
    assert "1.50x" in table and "1.00x" in table


def test_new_masks_harness_on_the_cpu_path():
    """--new-masks on CPU tensors (no schedules there: the CPU path reads the mask as it is): a row per
    builder with both times and their ratio, and the table."""
    from tileattn.bench.masks import format_new_masks, mask_cases, run_new_masks

    rows = run_new_masks(seqlens=(256,), headdim=16, hidden=32, dtype=torch.float32, rounds=1, calls=1, device="cpu")
    assert [r["mask"] for r in rows] == [name for name, *_ in mask_cases(256, "cpu")]
    assert all(r["same_ms"] > 0 and r["new_ms"] > 0 and r["ratio"] == r["new_ms"] / r["same_ms"] for r in rows)
    rows[0].update(same_ms=2.0, new_ms=2.5, ratio=1.25)
    table = format_new_masks(rows[:1])
    assert "| 1.25 " in table and "2.500" in table


def test_progress_lines_off_a_terminal(monkeypatch):
    """Off a terminal a run prints a line as each step starts: its number of the total, its name, the time
    elapsed and, once a step is done, the estimate (mean step time times the steps left)."""
    import io

    from tileattn.bench import progress

    clock = iter([0.0, 0.0, 10.0, 30.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    with progress.Progress(4, "timing", stream=out) as bar:
        bar.step("hd64 4x512")
        bar.step("hd64 1x2048")
        bar.log("a message")
        bar.step("hd64 causal 4x512")
    assert out.getvalue().splitlines() == [
        "[1/4] timing: hd64 4x512 (0:00 elapsed)",
        "[2/4] timing: hd64 1x2048 (0:10 elapsed, about 0:30 left)",
        "a message",
        "[3/4] timing: hd64 causal 4x512 (0:30 elapsed, about 0:30 left)",
    ]


def test_the_grid_shows_progress(tmp_path, capsys):
    """A grid run on CPU off a terminal prints a line per peak-memory measurement and per case before it
    runs, so a long run is never silent."""
    from tileattn.bench.__main__ import main

    argv = ["--device", "cpu", "--headdim", "16", "--seqlen", "32", "64", "--tokens", "64", "--hidden", "32"]
    assert main([*argv, "--causal", "yes", "--mode", "fwd", "--threads", "1", "--out", str(tmp_path / "r.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "[1/4] peak memory: hd16 causal 2x32 tileattn" in text
    assert "[4/4] peak memory: hd16 causal 1x64 eager" in text
    assert "[1/2] timing: hd16 causal 2x32" in text and "[2/2] timing: hd16 causal 1x64" in text
    assert text.index("[2/2] timing") < text.index("| case")


def test_tuner_levers_change_what_they_name():
    """``--levers``' options (bench.tune.LEVERS), on the H200's settings: each changes its own entries only, and
    none applies where it would change nothing."""
    from tileattn.bench.tune import LEVERS
    from tileattn.kernels import configs

    s = configs.HOPPER
    lever = {name: change for name, (_, change) in LEVERS.items()}
    assert {name: mode for name, (mode, _) in LEVERS.items()}["dq-first"] == "bwd"
    everywhere = lever["gluon"](s, 64)
    assert everywhere.gluon_min_seqlen_k == {} and everywhere.fwd_gluon == s.fwd_gluon
    assert lever["gluon"](s, 32) is None and lever["portable"](s, 32) is None
    portable = lever["portable"](s, 128)
    assert 128 not in portable.fwd_gluon and 128 not in portable.fwd_gluon_short and 96 in portable.fwd_gluon
    short = lever["gluon-short"](s, 64)
    assert short.fwd_gluon_short[64] == replace(s.fwd_gluon[64], num_stages=3) and short.gluon_min_seqlen_k == {}
    assert lever["gluon-short"](s, 128) is None  # (it has one)
    three = lever["three-warpgroups"](s, 64).fwd_gluon[64]
    assert (three.block_m, three.block_n, three.num_stages) == (192, 64, 4) and lever["three-warpgroups"](
        s, 128
    ) is None
    pingpong = lever["pingpong"](s, 128)
    assert pingpong.fwd_gluon[128].pingpong and pingpong.fwd_gluon_short[128].pingpong
    assert not pingpong.fwd_gluon[256].pingpong
    assert lever["dq-first"](s, 64).bwd_gluon[64].dq_first and not lever["dq-first"](s, 64).bwd_gluon[128].dq_first
    assert lever["dq-first"](s, 256) is None  # (the split build's entry has it already)
    assert lever["all-heads"](s, 256).gluon_l2_bytes == 0 and lever["all-heads"](s, 32) is None
    assert lever["snake"](s, 128).gluon_snake and lever["snake"](s, 64) is None  # (64: no persistent grid)


def test_tuner_time_builds_backward_checks_then_times(monkeypatch):
    """bench.tune.time_builds of the backward at a tiny shape (without a GPU the kernels under the interpreter):
    each build's dq, dk and dv are checked first, a build that fails is reported and left out, the others
    timed in every round with the ratio to the first; an anchor that cannot run here is left out."""
    from tileattn.bench import tune
    from tileattn.kernels import configs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    s = configs.current(torch.device(device))
    check = tune._check_grads
    checked = []

    def failing_bad(name, *args, **kwargs):
        checked.append(name)
        if name == "bad":
            raise AssertionError("dq out of tolerance")
        return check(name, *args, **kwargs)

    monkeypatch.setattr(tune, "_check_grads", failing_bad)
    rows = tune.time_builds(
        lambda headdim: {"table": s, "bad": s, "same": s}, "bwd", headdims=(64,), seqlens=(40,), rounds=2,
        tokens=40, hidden=128, device=device, dtype=torch.float16, anchor=None if device == "cuda" else "sdpa-cudnn",
    )  # fmt: skip
    assert sorted(checked) == sorted(["table", "bad", "same"] * 2)
    assert {(r["causal"], r["name"]) for r in rows if "error" in r} == {(False, "bad"), (True, "bad")}
    timed = [r for r in rows if "ms" in r]
    assert sorted((r["causal"], r["round"], r["name"]) for r in timed) == sorted(
        (c, r, n) for c in (False, True) for r in (0, 1) for n in ("table", "same")
    )
    assert all(r["mode"] == "bwd" and r["tflops"] > 0 for r in timed)
    assert all(r["vs_first"] == 1.0 for r in timed if r["name"] == "table")


@pytest.mark.parametrize(
    "argv, words",
    [(["--levers", "gluon", "--causal"], "drop --causal"), (["--levers", "pingpong", "--exp2-poly"], "name one"),
     (["--levers", "nonsense"], "invalid choice")],
)  # fmt: skip
def test_tuner_refuses_what_levers_cannot_apply(argv, words, capsys):
    from tileattn.bench import tune

    with pytest.raises(SystemExit) as exc:
        tune.main(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err
