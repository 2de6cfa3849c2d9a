"""Host time per call (``--host``): what the Python side of a call costs where the GPU's work is short.

Training calls at 1 × 128 tokens, 16 heads of 64, causal (the GPU's work a few µs: the clock reads the
host): tileattn dense, packed (one sequence through ``flash_attn_varlen_func``) and with dropout 0.1, the
forward alone and forward + backward (``.backward()`` included), against SDPA's cuDNN backend (and its
FlashAttention-2 backend with dropout, which cuDNN's SDPA does not take). Each case is ``calls`` calls
issued right after a synchronize, so the launch queue never fills and the clock stops when the host is done
issuing; ``rounds`` rounds in which every case takes its turn (tileattn and SDPA alternate, so the host's
drift falls on both), the median round per case. Device time: CUDA events around the same calls. A decode
step at 1 × 8k (GQA 32/8, head dim 128) is timed the same way: the plain call, a new cache_seqlens tensor
every call as serving loops pass it, pages of 16, the append of a new token with rotary. Each call's
output passes the tolerance rule first (dropout calls excepted).
"""

from __future__ import annotations

import statistics
import time

import torch

import tileattn
from tileattn.bench.backends import check_backend
from tileattn.bench.decode import AB_LAYOUTS
from tileattn.reference import attention_ref
from tileattn.testing import check_close

TRAINING_SHAPE = (1, 128, 16, 64)  # batch, seqlen, nheads, headdim: a launch-bound training call
DECODE_SHAPE = (1, 8192, 32, 8, 128)  # batch, cache length, nheads, nheads_k, headdim


def _time_rounds(cases: dict, device: torch.device, calls: int, rounds: int) -> dict:
    """``{name: (host µs per call, device µs per call or None)}``: the median of ``rounds`` rounds, each
    case's ``calls`` calls issued after a synchronize (five warm-up calls first), the cases in turn."""
    cuda = device.type == "cuda"
    for fn in cases.values():
        for _ in range(5):
            fn()
    host = {name: [] for name in cases}
    dev = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host[name].append((time.perf_counter() - t0) / calls * 1e6)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                dev[name].append(start.elapsed_time(end) * 1e3 / calls)
    return {name: (statistics.median(host[name]), statistics.median(dev[name]) if cuda else None) for name in cases}


def _sdpa(q, k, v, causal=False, dropout_p=0.0, backend=None):
    """SDPA in tileattn's layout; ``backend``: one of SDPA's backends forced (CUDA only)."""
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kwargs = dict(is_causal=causal, dropout_p=dropout_p, enable_gqa=q.shape[2] != k.shape[2])
    if backend is not None:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)


def training_cases(device: torch.device, dtype: torch.dtype, shape=TRAINING_SHAPE):
    """``{name: (call, check)}``: ``check(out)`` raises when the forward is wrong; None where no check
    applies (dropout, and the calls whose forward another case checks)."""
    from torch.nn.attention import SDPBackend

    batch, seqlen, nheads, headdim = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen)
    cu = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * seqlen
    packed = [t.detach().view(batch * seqlen, nheads, headdim).requires_grad_() for t in (q, k, v)]
    cuda = device.type == "cuda"
    cudnn = SDPBackend.CUDNN_ATTENTION if cuda else None
    flash = SDPBackend.FLASH_ATTENTION if cuda else None

    def dense(p=0.0):
        return tileattn.flash_attn_func(q, k, v, dropout_p=p, causal=True)

    def varlen():
        return tileattn.flash_attn_varlen_func(*packed, cu, cu, seqlen, seqlen, causal=True)

    def both(fwd):
        def call():
            out = fwd()
            out.backward(dout.view(out.shape))

        return call

    def check(name, out):
        check_backend(name, out.detach().view(q.shape), q.detach(), k.detach(), v.detach(), causal=True)

    sdpa = "sdpa-cudnn" if cuda else "sdpa"
    cases = {
        "tileattn fwd": (dense, lambda out: check("tileattn fwd", out)),
        f"{sdpa} fwd": (lambda: _sdpa(q, k, v, True, backend=cudnn), lambda out: check(sdpa, out)),
        "tileattn varlen fwd": (varlen, lambda out: check("tileattn varlen fwd", out)),
        "tileattn fwd p=0.1": (lambda: dense(0.1), None),
        "tileattn fwd+bwd": (both(dense), None),
        f"{sdpa} fwd+bwd": (both(lambda: _sdpa(q, k, v, True, backend=cudnn)), None),
        "tileattn varlen fwd+bwd": (both(varlen), None),
        "tileattn fwd+bwd p=0.1": (both(lambda: dense(0.1)), None),
    }
    if cuda:
        cases["sdpa-flash fwd+bwd p=0.1"] = (both(lambda: _sdpa(q, k, v, True, 0.1, backend=flash)), None)
    return cases


def decode_cases(device: torch.device, dtype: torch.dtype, shape=DECODE_SHAPE):
    """``{name: (call, check)}`` of one decode step: the ``--decode-ab`` layouts over one cache."""
    from torch.nn.attention import SDPBackend

    batch, cache_len, nheads, nheads_k, headdim = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, 1, nheads, headdim, device=device, dtype=dtype, generator=gen)
    kc, vc = (
        torch.randn(batch, cache_len, nheads_k, headdim, device=device, dtype=dtype, generator=gen) for _ in range(2)
    )
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
    cases = {}
    for name in ("tileattn", "tileattn paged16", "tileattn append"):
        call, expected = AB_LAYOUTS[name](q, kc.clone(), vc.clone(), seqlens)

        def check(out, name=name, expected=expected):
            qr, kr, vr = expected()
            ref = attention_ref(qr, kr, vr, upcast=torch.float64)[0]
            check_close(name, out[:1], ref, attention_ref(qr, kr, vr, upcast=False)[0])

        cases[name] = (call, check)
        if name == "tileattn":  # a serving loop's step: a new cache_seqlens every call, its making included

            def fresh():
                return tileattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens + 0)

            cases["tileattn, new cache_seqlens"] = (fresh, check)
    cuda = device.type == "cuda"
    sdpa = "sdpa-cudnn" if cuda else "sdpa"
    cases[sdpa] = (
        lambda: _sdpa(q, kc, vc, backend=SDPBackend.CUDNN_ATTENTION if cuda else None),
        lambda out: check_backend(sdpa, out, q, kc, vc),
    )
    return cases


def run_host(
    device="cuda",
    dtype=torch.bfloat16,
    calls=200,
    rounds=9,
    training_shape=TRAINING_SHAPE,
    decode_shape=DECODE_SHAPE,
    progress=print,
):
    """Rows of ``kind='host'`` (``case`` training or decode, ``backend`` the call): ``host_us`` and
    ``device_us`` per call (the median round), and for training calls ``ratio``, the host time over
    SDPA's of the same kind (forward, forward + backward; with dropout its FlashAttention-2 backend)."""
    device = torch.device(device)
    rows = []
    for case, cases in (
        ("training", training_cases(device, dtype, training_shape)),
        ("decode", decode_cases(device, dtype, decode_shape)),
    ):
        for call, check in cases.values():
            if check is not None:
                check(call())
        times = _time_rounds({name: call for name, (call, _) in cases.items()}, device, calls, rounds)
        for name, (host, dev) in times.items():
            rows.append(dict(kind="host", case=case, backend=name, device=device.type, host_us=host, device_us=dev))
            progress(f"{case} {name}: host {host:.1f} µs/call")
    sdpa = {
        r["backend"].split(" ", 1)[1]: r["host_us"]
        for r in rows
        if r["case"] == "training" and r["backend"].startswith("sdpa")
    }
    for r in rows:
        if r["case"] == "training" and r["backend"].startswith("tileattn"):
            kind = "fwd+bwd" if "fwd+bwd" in r["backend"] else "fwd"
            base = sdpa.get(f"{kind} p=0.1") if "p=0.1" in r["backend"] and kind == "fwd+bwd" else sdpa.get(kind)
            r["ratio"] = r["host_us"] / base if base else None
    return rows


def format_host(rows) -> str:
    from tabulate import tabulate

    def us(value):
        return f"{value:.1f}" if value is not None else "-"

    def ratio(value):
        return f"{value:.2f}" if value is not None else "-"

    table = [[r["case"], r["backend"], us(r["host_us"]), us(r["device_us"]), ratio(r.get("ratio"))] for r in rows]
    headers = ["case", "call", "host µs", "device µs", "host ÷ SDPA's"]
    return tabulate(table, headers=headers, tablefmt="github")
