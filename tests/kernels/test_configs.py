"""Which builds a call launches: the tile tables of kernels/configs.py (fwd_config and bwd_dkdv_config:
causal, varlen, windowed, long-key and pointer-load entries), the register cap and the dQ mode reaching
the launches, the backward launched with its call's settings, and the host's copies of Triton's size
helpers. Launches are recorded, nothing is compiled (helpers.record_launches)."""

import pytest
import torch

import tileattn
from attention_cases import _unaligned
from helpers import builds, on, randn, record_launches
from tileattn.params import AttnParams, KernelConfig


def _bwd_launches(monkeypatch, dq_atomic: int, deterministic: bool = False, headdim: int = 64):
    """The backward's launches, (kernel, DQ_ATOMIC), with the H200's settings and the dK/dV config asking
    for ``dq_atomic`` (recorded, nothing compiled)."""
    from tileattn.kernels import backward, configs

    launches = record_launches(monkeypatch, "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")
    s = configs.with_builds(configs.HOPPER, dkdv=dict(dq_atomic=dq_atomic))
    q = torch.zeros(1, 128, 2, headdim, dtype=torch.float16)
    p = AttnParams(batch=1, seqlen_q=128, seqlen_k=128, headdim=headdim, softmax_scale=1.0, deterministic=deterministic)
    backward.attn_bwd(q, q, q, q, q, torch.zeros(1, 2, 128), p, s)
    return [(name, kw.get("DQ_ATOMIC")) for name, _, kw in launches]


def test_dq_atomic_not_deterministic(monkeypatch):
    """deterministic=True takes the dQ pass even where the config asks for atomic dQ (launches recorded)."""
    runs = {deterministic: _bwd_launches(monkeypatch, 1, deterministic) for deterministic in (False, True)}
    assert runs[False] == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", 1)]
    assert runs[True] == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", 0), ("_attn_bwd_dq", None)]


@pytest.mark.parametrize("tma_ok", [True, False], ids=["tma", "no-tma"])
def test_dq_reduce_add_falls_back_to_the_dq_pass(tma_ok, monkeypatch):
    """dq_atomic=2 (TMA reduce-adds) launches the dK/dV pass alone where TMA can write dQ's fp32 buffer,
    and the two passes where it cannot (head dim 62: rows of 248 bytes, not a multiple of 16): the atomic
    adds are slower than the dQ pass (launches recorded)."""
    runs = _bwd_launches(monkeypatch, 2, headdim=64 if tma_ok else 62)
    if tma_ok:
        assert runs == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", 2)]
    else:
        assert runs == [("_bwd_preprocess", None), ("_attn_bwd_dkdv", 0), ("_attn_bwd_dq", None)]


def test_dq_reduce_add_runs_as_atomic_adds_under_the_interpreter(monkeypatch):
    """The interpreter does not emulate TMA reduce-adds: settings for it (Settings.interpret) launch
    dq_atomic=2 as fp32 atomic adds (launches recorded)."""
    import dataclasses

    from tileattn.kernels import backward, configs

    launches = record_launches(monkeypatch, "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")
    s = configs.with_builds(dataclasses.replace(configs.HOPPER, interpret=True), dkdv=dict(dq_atomic=2))
    q = torch.zeros(1, 128, 2, 64, dtype=torch.float16)
    p = AttnParams(batch=1, seqlen_q=128, seqlen_k=128, headdim=64, softmax_scale=1.0)
    backward.attn_bwd(q, q, q, q, q, torch.zeros(1, 2, 128), p, s)
    assert [(name, kw.get("DQ_ATOMIC")) for name, _, kw in launches] == [
        ("_bwd_preprocess", None),
        ("_attn_bwd_dkdv", 1),
    ]


def test_backward_runs_with_the_settings_of_its_call(backend, monkeypatch):
    """The backward launches the builds of the settings its call ran under (here dQ added by the dK/dV
    pass), also where autograd runs it on a worker thread (CUDA tensors), so that the tests of build
    variants test those variants (launches recorded, nothing computed)."""
    if backend == "torch":
        pytest.skip("a kernel variant")
    launches = record_launches(monkeypatch, "_attn_fwd", "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")
    ctx, device = on(backend)
    q = randn(1, 64, 2, 32, dtype=torch.float16, device=device)
    with ctx:
        with builds(backend, dkdv=dict(dq_atomic=1)):
            out = tileattn.flash_attn_func(q, q, q)
        torch.autograd.grad(out, q, torch.ones_like(out))  # outside the override, as on a worker thread
    assert [(name, kw.get("DQ_ATOMIC")) for name, _, kw in launches] == [
        ("_attn_fwd", None),
        ("_bwd_preprocess", None),
        ("_attn_bwd_dkdv", 1),
    ]


def test_bwd_dkdv_config_takes_the_causal_table():
    """Causal calls without a left window take Settings.bwd_dkdv_causal's entry where one is given; other
    masks, and head dims without an entry, the plain table."""
    import dataclasses

    from tileattn.kernels import configs

    causal_cfg = KernelConfig(32, 32, 2, 2, dq_atomic=2)
    s = dataclasses.replace(configs.HOPPER, bwd_dkdv_causal={64: causal_cfg})
    for headdim, cfg in s.bwd_dkdv.items():
        p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=headdim, softmax_scale=1.0)
        causal = dataclasses.replace(p, window_right=0)
        assert configs.bwd_dkdv_config(p, s) is cfg
        assert configs.bwd_dkdv_config(causal, s) is (causal_cfg if headdim == 64 else cfg)
        assert configs.bwd_dkdv_config(dataclasses.replace(causal, window_left=64), s) is cfg
        assert configs.bwd_dkdv_config(dataclasses.replace(p, window_right=4), s) is cfg
        assert configs.bwd_dkdv_config(dataclasses.replace(causal, deterministic=True), s) is cfg
    # the H200's tables: head dim 128's causal entry adds dQ by TMA reduce-adds
    p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=128, softmax_scale=1.0, window_right=0)
    assert configs.bwd_dkdv_config(p, configs.HOPPER).dq_atomic == 2
    assert configs.bwd_dkdv_config(dataclasses.replace(p, deterministic=True), configs.HOPPER).dq_atomic == 0


def test_bwd_dkdv_config_takes_the_varlen_table():
    """Varlen calls without dropout take Settings.bwd_dkdv_varlen's entry (head dim 256's 32-key tiles on
    the H200); dropout keeps 64-key tiles (its draws cover 64 key columns), and dense calls the plain
    table."""
    import dataclasses

    from tileattn.kernels import configs

    s = configs.HOPPER
    cu = torch.tensor([0, 8], dtype=torch.int32)
    for causal in (-1, 0):
        p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=256, softmax_scale=1.0, window_right=causal)
        varlen = dataclasses.replace(p, cu_seqlens_q=cu, cu_seqlens_k=cu)
        assert configs.bwd_dkdv_config(varlen, s) is s.bwd_dkdv_varlen[256]
        assert configs.bwd_dkdv_config(varlen, s).block_n == 32
        assert configs.bwd_dkdv_config(dataclasses.replace(varlen, dropout_p=0.1), s).block_n == 64
        assert configs.bwd_dkdv_config(p, s) is s.bwd_dkdv[256]
    p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=128, softmax_scale=1.0, window_right=0)
    varlen = dataclasses.replace(p, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert configs.bwd_dkdv_config(varlen, s) is s.bwd_dkdv_causal[128]  # no varlen entry at 128
    both = KernelConfig(32, 32, 2, 2)
    s = dataclasses.replace(s, bwd_dkdv_varlen={**s.bwd_dkdv_varlen, 128: both})
    assert configs.bwd_dkdv_config(varlen, s) is s.bwd_dkdv_causal[128]  # the causal entry comes first
    assert configs.bwd_dkdv_config(dataclasses.replace(varlen, window_right=-1), s) is both


def test_forward_launch_takes_the_fallback_tiles_without_tma(monkeypatch):
    """attn_fwd launches head dim 256 with the H200's TMA tiles when TMA can read the inputs, and with
    Settings.fwd_pointer's tiles (USE_TMA off) when it cannot: keys and values one element past a
    16-byte boundary (launches recorded, nothing compiled)."""
    from tileattn.kernels import configs, forward

    s = configs.HOPPER
    launches = record_launches(monkeypatch, "_attn_fwd")
    q = torch.zeros(1, 300, 2, 256, dtype=torch.float16)
    p = AttnParams(batch=1, seqlen_q=300, seqlen_k=300, headdim=256, softmax_scale=1.0)
    forward.attn_fwd(q, q, q, p, s)
    kv = _unaligned(q)
    forward.attn_fwd(q, kv, kv, p, s)
    (_, grid_tma, with_tma), (_, grid_ptr, without) = launches
    tma_cfg, ptr_cfg = s.fwd[256], s.fwd_pointer[256]
    assert with_tma["USE_TMA"] and (with_tma["BLOCK_M"], with_tma["num_warps"]) == (tma_cfg.block_m, tma_cfg.num_warps)
    assert not without["USE_TMA"] and without["maxnreg"] == ptr_cfg.maxnreg and with_tma["maxnreg"] == tma_cfg.maxnreg
    assert (without["BLOCK_M"], without["BLOCK_N"], without["num_warps"], without["num_stages"]) == (
        ptr_cfg.block_m,
        ptr_cfg.block_n,
        ptr_cfg.num_warps,
        ptr_cfg.num_stages,
    )
    assert grid_ptr[0] == -(-300 // ptr_cfg.block_m) and grid_tma[0] == -(-300 // tma_cfg.block_m)


def test_launches_pass_the_register_cap(monkeypatch):
    """KernelConfig.maxnreg reaches the forward, dK/dV and dQ launches (launches recorded, nothing
    compiled)."""
    import dataclasses

    from tileattn.kernels import backward, configs, forward

    launches = record_launches(monkeypatch, "_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_bwd_preprocess")
    s = configs.HOPPER
    capped = {
        name: {**table, 64: dataclasses.replace(table[64], maxnreg=cap)}
        for name, table, cap in (("fwd", s.fwd, 120), ("bwd_dkdv", s.bwd_dkdv, 168), ("bwd_dq", s.bwd_dq, 128))
    }
    s = dataclasses.replace(s, **capped)
    q = torch.zeros(1, 128, 2, 64, dtype=torch.float16)
    p = AttnParams(batch=1, seqlen_q=128, seqlen_k=128, headdim=64, softmax_scale=1.0)
    forward.attn_fwd(q, q, q, p, s)
    backward.attn_bwd(q, q, q, q, q, torch.zeros(1, 2, 128), p, s)
    assert {name: kw["maxnreg"] for name, _, kw in launches if "maxnreg" in kw} == {
        "_attn_fwd": 120,
        "_attn_bwd_dkdv": 168,
        "_attn_bwd_dq": 128,
    }


def test_forward_config_falls_back_without_tma():
    """A forward table entry that reads through TMA has pointer-load tiles for inputs TMA cannot read
    (Settings.fwd_pointer, else the same tiles without TMA); long key loops take Settings.fwd_long's
    tiles, causal calls Settings.fwd_causal's and calls with a left window (without dropout)
    Settings.fwd_window's where they have them (sentinel entries here, over the H200's tables)."""
    import dataclasses

    from tileattn.kernels import configs

    long_cfg = KernelConfig(16, 16, 1, 1, tma=True)
    causal_cfg = KernelConfig(32, 32, 2, 2, tma=True)
    window_cfg = KernelConfig(32, 16, 2, 2)
    s = configs.HOPPER
    s = dataclasses.replace(
        s,
        fwd_long={d: long_cfg for d in s.fwd},
        fwd_window={d: window_cfg for d in s.fwd},
        fwd_causal={d: causal_cfg for d in s.fwd},
    )
    for headdim, cfg in s.fwd.items():
        p = AttnParams(batch=1, seqlen_q=8, seqlen_k=8, headdim=headdim, softmax_scale=1.0)
        assert configs.fwd_config(p, s) is cfg
        long = dataclasses.replace(p, seqlen_k=s.long_seqlen_k)
        assert configs.fwd_config(long, s) is long_cfg
        pointer = s.fwd_pointer.get(headdim, dataclasses.replace(long_cfg, tma=False))
        assert configs.fwd_config(long, s, tma_ok=False) == pointer
        assert configs.fwd_config(dataclasses.replace(long, window_right=0), s) is long_cfg  # long causal
        assert configs.fwd_config(dataclasses.replace(long, window_left=512, window_right=0), s) is window_cfg
        causal = dataclasses.replace(p, window_right=0)
        assert configs.fwd_config(causal, s) is causal_cfg
        assert not configs.fwd_config(causal, s, tma_ok=False).tma
        assert configs.fwd_config(dataclasses.replace(causal, window_left=64), s) is window_cfg  # not causal
        assert configs.fwd_config(dataclasses.replace(causal, window_left=64, dropout_p=0.1), s) is cfg
        assert configs.fwd_config(dataclasses.replace(p, window_right=64), s) is cfg  # right window only
        fallback = configs.fwd_config(p, s, tma_ok=False)
        assert not fallback.tma
        if cfg.tma:
            assert fallback == s.fwd_pointer.get(headdim, dataclasses.replace(cfg, tma=False))
        else:
            assert fallback is cfg
    assert configs.HOPPER.fwd[256].tma and not configs.HOPPER.fwd_pointer[256].tma


def test_host_size_helpers_match_triton():
    """params.cdiv / next_power_of_2 (host copies of Triton's constexpr functions) give Triton's values."""
    import triton

    from tileattn import params

    assert all(params.next_power_of_2(n) == triton.next_power_of_2(n) for n in range(0, 3000))
    assert all(params.cdiv(a, b) == triton.cdiv(a, b) for a in range(-70, 3000) for b in (1, 3, 16, 64, 128))


def test_gluon_forward_by_head_dim_and_keys():
    """Which calls the H200's settings give the Gluon forward (``configs.gluon_fwd_config``): head dims 96, 128
    and 256 at every length (the persistent grid's entry under ``gluon_short_seqlen_k`` keys), head dim 64 from
    16k keys (``gluon_min_seqlen_k``), where a window bounded on both sides counts as its keys; FP8 inputs by
    their own table (empty: the portable forward); other head dims never."""
    from dataclasses import replace

    from tileattn.kernels import configs

    s = configs.HOPPER

    def entry(headdim, seqlen_k, settings=s, **kw):
        return configs.gluon_fwd_config(AttnParams(2, 512, seqlen_k, headdim, 1.0, **kw), settings, headdim)

    assert s.gluon_min_seqlen_k == {64: 16384}
    assert entry(64, 2048) is None and entry(64, 16383) is None and entry(64, 16383, window_right=0) is None
    assert entry(64, 16384) == (s.fwd_gluon[64], False) == entry(64, 65536, window_right=0)
    assert entry(64, 65536, window_left=4096, window_right=-1) == (s.fwd_gluon[64], False)  # (one side: all keys)
    assert entry(64, 65536, window_left=4096, window_right=0) is None  # (4096 + 0 + 128 keys)
    assert entry(64, 65536, window_left=16256, window_right=0) == (s.fwd_gluon[64], False)
    assert entry(64, 1024, replace(s, gluon_min_seqlen_k={})) == (s.fwd_gluon[64], False)
    for headdim in (96, 128, 256):
        assert entry(headdim, 1024) == (s.fwd_gluon_short[headdim], True)
        assert entry(headdim, 1024, window_left=100, window_right=100) == (s.fwd_gluon_short[headdim], True)
        assert entry(headdim, 4096) == entry(headdim, 65536) == (s.fwd_gluon[headdim], False)
    fp8 = dict(descales=torch.ones(3, 2, 1))
    assert all(entry(d, 65536, **fp8) is None for d in (64, 128, 256))
    with_fp8 = replace(s, fwd_gluon_fp8={64: KernelConfig(128, 128, 4, 2)})
    assert entry(64, 1024, with_fp8, **fp8) == (with_fp8.fwd_gluon_fp8[64], False)  # (the minimum is bf16's)
    assert entry(32, 65536) is None and entry(16, 65536) is None
