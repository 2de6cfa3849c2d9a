"""The benchmark's own arithmetic: the work a masked problem does (``--features`` divides by it), and
the feature harness on the CPU path."""

import importlib.util
import itertools
import os
import pathlib
import sys

import pytest
import torch

from tileattn.bench.features import visible_pairs
from tileattn.reference import local_mask


@pytest.mark.parametrize(
    "causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 5)), (False, (7, 0)), (True, (3, 9))]
)
@pytest.mark.parametrize("seqlen", [1, 13, 64])
def test_visible_pairs_counts_the_mask(seqlen, causal, window):
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    mask = local_mask(i, j, seqlen, seqlen, (window[0], 0) if causal else window)
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


def _script(name):
    """scripts/<name>.py as a module (the scripts import their neighbours, so scripts/ is on the path
    while it loads)."""
    scripts = pathlib.Path(__file__).parents[1] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location(name, scripts / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(scripts))
    return module


def test_features_variant_changes_the_tables(monkeypatch):
    """scripts/features_variant.py (table variants for GPU runs): a field per head dim, and the forward's
    TMA off takes the pointer-load tiles where the table reads through TMA."""
    import dataclasses

    from tileattn.kernels import configs

    for name in (
        "_FWD",
        "_FWD_LONG",
        "_FWD_CAUSAL",
        "_FWD_WINDOW",
        "_BWD_DKDV",
        "_BWD_DKDV_CAUSAL",
        "_BWD_DKDV_VARLEN",
        "_BWD_DQ",
    ):
        monkeypatch.setattr(configs, name, dict(getattr(configs, name)))
    variant = _script("features_variant")
    before, before_dq = dict(configs._FWD), dict(configs._BWD_DQ)
    variant.apply("fwd@64:maxnreg=96")
    variant.apply("dq@16,32:maxnreg=120")
    variant.apply("fwd:tma=0")
    assert configs._FWD[64] == dataclasses.replace(before[64], maxnreg=96)
    assert configs._BWD_DQ[32].maxnreg == 120 and configs._BWD_DQ[64] == before_dq[64]
    assert configs._FWD[256] == configs._FWD_POINTER[256]
    assert configs._FWD[128] == dataclasses.replace(before[128], tma=False)
    variant.apply("fwdcausal@64:block_m=64")
    assert configs._FWD_CAUSAL[64] == dataclasses.replace(configs._FWD[64], block_m=64)
    variant.apply("fwdlong:maxnreg=0")  # no head dims named: every forward head dim
    assert set(configs._FWD_LONG) == set(configs._FWD) and all(c.maxnreg is None for c in configs._FWD_LONG.values())
    variant.apply("fwdcausal@256:tma=1")
    variant.apply("fwdcausal@256:tma=0")  # the pointer-load tiles, not head dim 256's miscompiled build
    assert configs._FWD_CAUSAL[256] == configs._FWD_POINTER[256]
    variant.apply("dkdvcausal@64:dq_atomic=2")
    assert configs._BWD_DKDV_CAUSAL[64] == dataclasses.replace(configs._BWD_DKDV[64], dq_atomic=2)
    variant.apply("fwdwindow@128:block_m=64")
    assert configs._FWD_WINDOW[128] == dataclasses.replace(configs._FWD[128], block_m=64)
    variant.apply("dkdvvarlen@128:block_n=32")
    assert configs._BWD_DKDV_VARLEN[128] == dataclasses.replace(configs._BWD_DKDV[128], block_n=32)
    with pytest.raises(SystemExit):
        variant.apply("fwd:colour=1")


@pytest.mark.parametrize("order", ["shuffled", "in order", "lockstep", 2])
def test_decode_pool_reference_follows_the_table(order):
    """The decode benchmark's paged rows check each backend against ``_pool``'s reference keys: the
    first sequence's keys in the order its block table gives them. tileattn's paged call (CPU path)
    must match attention over them; each order must place the pages where its docstring says."""
    from tileattn.bench.decode import _pool, _tileattn
    from tileattn.reference import attention_ref

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
    torch.testing.assert_close(out[:1], attention_ref(q[:1], ref_k, ref_v)[0], atol=1e-5, rtol=1e-5)
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


def test_decode_variant_settings_restore_the_sm_count():
    """decode_variants_settings.apply: ``sms=N`` plans the splits for N SMs inside the block only, and
    the module's settings come back after it, also when the block raises."""
    from tileattn.kernels import decode

    settings = _script("decode_variants_settings")
    before, stages = decode._sm_count, decode.DECODE_STAGES
    with pytest.raises(RuntimeError), settings.apply("sms=120,stages=4"):
        assert decode._sm_count(torch.device("cuda")) == 120 and decode.DECODE_STAGES == 4
        assert decode.choose_splits(8, 131072, 128, decode._sm_count(None)) == 15
        raise RuntimeError
    assert decode._sm_count is before and decode.DECODE_STAGES == stages


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the probe's check runs in the interpreter")
def test_decode_tail_probe_matches_torch():
    """scripts/decode_tail.py's probe kernel (a K/V stream shaped like the split kernel) computes what its
    torch reference does, for 1-3 splits of five tiles, in runs or dealt in turn, with and without the
    online softmax."""
    _script("decode_tail")._check()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the probes' check runs in the interpreter")
def test_decode_pages_probes_match_torch():
    """scripts/decode_pages_probe.py's probes (a shuffled pool read a kv head at a time, or a whole page
    for all kv heads at a time) compute what their torch reference does, for one to three splits."""
    _script("decode_pages_probe")._check()
