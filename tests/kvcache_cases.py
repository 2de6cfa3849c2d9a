"""Inputs and checks for attention against a KV cache, shared by the API's tests (tests/api/test_kvcache.py)
and the decode kernels' (tests/decode): the cases and cache layouts, a call's inputs, its check against the
per-sequence reference (kvcache_ref.py, through the tests' oracle), the decode kernels' settings, and the
launch plans that flash_attn_with_kvcache keeps."""

import dataclasses
import os

import pytest
import torch

import tileattn
from helpers import check_lse, on
from kvcache_ref import dense_view, kvcache_ref
from tileattn.kernels import configs
from tileattn.params import Settings
from tileattn.testing import check_close

F16 = torch.float16


# (seqlen_q, seqlen_new, options) per case; caches hold 3 sequences of capacity 37.
CASES = {
    "decode-rotary": (1, 1, {"causal": True, "rotary": "interleaved"}),
    "decode-no-append": (1, 0, {}),
    "chunk-causal-neox": (5, 5, {"causal": True, "rotary": "neox-partial"}),
    "window-softcap": (3, 3, {"window_size": (6, 0), "softcap": 3.0}),
    "alibi-leftpad": (2, 2, {"causal": True, "alibi": True, "leftpad": True}),
    "batch-idx": (2, 1, {"batch_idx": True, "causal": True}),
    "q-longer-than-new": (4, 2, {"rotary": "interleaved"}),
    # window sides at least the capacity (37, or 40 / 48 paged) are no window: q rotates at cache_seqlens
    "wide-window-rotary": (4, 2, {"window_size": (48, 60), "rotary": "neox-partial"}),
}


LAYOUTS = {"dense": None, "page4": 4, "page16": 16}


def _inputs(seqlen_q, seqlen_new, opts, page, device, h=8, hk=2, d=40, capacity=37, batch=3, dtype=F16):
    q = torch.randn(batch, seqlen_q, h, d, dtype=dtype, device=device)
    batch_cache = batch + 2 if opts.get("batch_idx") else batch
    args = {}
    if page:
        max_pages = -(-capacity // page)
        num_pages = batch * max_pages + 3
        kc = torch.randn(num_pages, page, hk, d, dtype=dtype, device=device)
        args["block_table"] = torch.randperm(num_pages, device=device)[: batch * max_pages].view(batch, -1).int()
    else:
        kc = torch.randn(batch_cache, capacity, hk, d, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    if seqlen_new:
        args["k"] = torch.randn(batch, seqlen_new, hk, d, dtype=dtype, device=device)
        args["v"] = torch.randn(batch, seqlen_new, hk, d, dtype=dtype, device=device)
    # One empty cache (with nothing appended it sees no key), one mid-size, one filled to capacity.
    full = capacity - seqlen_new
    args["cache_seqlens"] = torch.tensor([0, 17, full], dtype=torch.int32, device=device)
    if opts.get("leftpad"):
        args["cache_leftpad"] = torch.tensor([0, 5, 30], dtype=torch.int32, device=device)
    if opts.get("batch_idx"):
        args["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    if opts.get("alibi"):
        args["alibi_slopes"] = torch.rand(batch, h, device=device) * 0.3
    if "rotary" in opts:
        rotary_dim = 16 if opts["rotary"] == "neox-partial" else d
        angle = torch.rand(capacity + 4, rotary_dim // 2, device=device) * 6.283
        args["rotary_cos"], args["rotary_sin"] = angle.cos().to(dtype), angle.sin().to(dtype)
        args["rotary_interleaved"] = opts["rotary"] == "interleaved"
    for key in ("causal", "window_size", "softcap"):
        if key in opts:
            args[key] = opts[key]
    return q, kc, vc, args


def _kernel_device() -> str:
    """Where the Triton kernels run when a test calls them directly: the GPU, or the CPU under the
    interpreter (skipped on a CPU without it)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0":
        pytest.skip("needs the Triton kernels (GPU or interpreter)")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _settings(device: str, **changes) -> Settings:
    """The settings of ``device``'s kernels (the interpreter's on the CPU) with these ``DecodeSettings``
    fields changed: for ``configs.override`` around the calls of a test."""
    s = configs.for_device(torch.device(device))
    return dataclasses.replace(s, decode=dataclasses.replace(s.decode, **changes))


def _ref_args(args):
    ref = {key: val for key, val in args.items() if not key.startswith("rotary_")}
    if "rotary_cos" in args:
        ref["rotary"] = (args["rotary_cos"], args["rotary_sin"])
        ref["rotary_interleaved"] = args["rotary_interleaved"]
    return ref


def _check_case(backend, case, layout, num_splits, d=40, dtype=F16):
    seqlen_q, seqlen_new, opts = CASES[case]
    page = LAYOUTS[layout]
    ctx, device = on(backend)
    q, kc, vc, args = _inputs(seqlen_q, seqlen_new, opts, page, device, d=d, dtype=dtype)
    ref = kvcache_ref(q, kc, vc, **_ref_args(args))
    ref_lowp = kvcache_ref(q, kc, vc, precision=None, **_ref_args(args))
    k_ref, v_ref = ref.k_cache, ref.v_cache
    untouched = kc.clone()
    with ctx:
        out, lse = tileattn.flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits, return_softmax_lse=True, **args)
    check_close(f"{case} {layout} out", out, ref.out, ref_lowp.out)
    assert lse.shape == (q.shape[0], q.shape[2], seqlen_q) and lse.dtype == torch.float32
    check_lse(f"{case} {layout} lse", lse, ref.lse, ref_lowp.lse)
    capacity = k_ref.shape[1]
    got_k = dense_view(kc, args.get("block_table"), capacity)
    got_v = dense_view(vc, args.get("block_table"), capacity)
    if "cache_batch_idx" in args:
        rows = args["cache_batch_idx"].long()
        got_k, got_v = got_k[rows], got_v[rows]
        spare = [r for r in range(kc.shape[0]) if r not in rows.tolist()]
        assert torch.equal(kc[spare], untouched[spare]), "rows no sequence maps to were written"
    assert torch.equal(got_k, k_ref.to(dtype)), "k_cache after the append differs from the reference"
    assert torch.equal(got_v, v_ref.to(dtype)), "v_cache after the append differs from the reference"
    # Rows that see no key (the empty cache, nothing appended) are 0 with LSE +inf.
    if seqlen_new == 0:
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


def _check_kvcache_problem(backend, pb):
    ctx, device = on(backend)
    b, h, hk, d, cap = pb["batch"], pb["nheads"], pb["nheads_k"], pb["headdim"], pb["capacity"]
    dtype = pb.get("dtype", F16)
    q = torch.randn(b, pb["seqlen_q"], h, d, dtype=dtype, device=device)
    args = dict(causal=pb["causal"], window_size=pb["window"], softcap=pb["softcap"], num_splits=pb["num_splits"])
    if pb["page"]:
        pages = -(-cap // pb["page"])
        kc = torch.randn(b * pages + 2, pb["page"], hk, d, dtype=dtype, device=device)
        args["block_table"] = torch.randperm(b * pages + 2, device=device)[: b * pages].view(b, pages).int()
    else:
        kc = torch.randn(b, cap, hk, d, dtype=dtype, device=device)
    pad = 8 if pb["v_padded"] else 0
    vc = torch.randn(*kc.shape[:-1], d + pad, dtype=dtype, device=device)[..., :d]
    args["cache_seqlens"] = torch.tensor(pb["seqlens"], dtype=torch.int32, device=device)
    if pb["seqlen_new"]:
        args["k"] = torch.randn(b, pb["seqlen_new"], hk, d, dtype=dtype, device=device)
        args["v"] = torch.randn(b, pb["seqlen_new"], hk, d + pad, dtype=dtype, device=device)[..., :d]
    if pb["leftpad"] is not None:
        args["cache_leftpad"] = torch.tensor(pb["leftpad"], dtype=torch.int32, device=device)
    if pb["alibi"]:
        args["alibi_slopes"] = torch.rand(b, h, device=device) * 0.5
    if pb["rotary"]:
        angle = torch.rand(cap + pb["seqlen_q"], d // 4, device=device) * 6.283
        args.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype))
        args["rotary_interleaved"] = pb["rotary"] == "interleaved"
    ref_args = {key: val for key, val in args.items() if key != "num_splits"}
    ref = kvcache_ref(q, kc, vc, **_ref_args(ref_args))
    lowp = kvcache_ref(q, kc, vc, precision=None, **_ref_args(ref_args))
    k_ref, v_ref = ref.k_cache, ref.v_cache
    with ctx:
        out = tileattn.flash_attn_with_kvcache(q, kc, vc, **args)
    check_close(f"{pb} out", out, ref.out, lowp.out)
    got = dense_view(kc, args.get("block_table"), k_ref.shape[1])
    assert torch.equal(got, k_ref.to(dtype)), f"{pb}: k_cache after append"
    got = dense_view(vc, args.get("block_table"), v_ref.shape[1])
    assert torch.equal(got, v_ref.to(dtype)), f"{pb}: v_cache after append"


def _api_plans(s: Settings | None = None) -> list:
    """The launch plans (each a (split kernel, combine) pair of ``decode.plan.Launch``) that
    flash_attn_with_kvcache keeps in its tables per call signature, for calls under settings ``s``
    (None: any)."""
    from tileattn import kvcache
    from tileattn.kernels.decode import plan

    return [launches for call in list(kvcache.calls.values()) for launches in plan.plans_in(call.plans, s)]


class _plans_made:
    """The launch plans ``_api_plans(s)`` holds that it did not when this was made: those planned since
    (a live list: ``len``, iteration and indexing read the tables again)."""

    def __init__(self, s: Settings | None = None):
        self.s = s
        self.before = _api_plans(s)  # (kept: their ids stay unique)
        self.seen = {id(launches) for launches in self.before}

    def _now(self) -> list:
        return [launches for launches in _api_plans(self.s) if id(launches) not in self.seen]

    def __len__(self):
        return len(self._now())

    def __iter__(self):
        return iter(self._now())

    def __getitem__(self, i):
        return self._now()[i]
