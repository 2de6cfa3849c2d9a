"""Host time per call (``--host``): what the Python side of a call costs where the GPU's work is short.

Two launch-bound shapes: one layer of BERT-large's attention (8 × 512 tokens, 16 heads of 64; forward,
forward + backward, with dropout 0.1) and a decode step at 1 × 8k (GQA 32/8, head dim 128: the plain
call, the same with a new cache_seqlens tensor every call as serving loops pass it, pages of 16, the
append of a new token with rotary), each against SDPA on the same inputs (its cuDNN backend for
decode). Host time: ``calls`` calls issued right after a synchronize, so the launch
queue never fills and the clock stops when the host is done issuing; the best of ``rounds`` rounds.
Device time: CUDA events around the same calls. On CUDA each call is also timed by
``triton.testing.do_bench`` (L2 flushed between calls, no graph), which measures the host whenever the
host takes longer than the GPU. Each call's output passes the tolerance rule first (dropout calls
excepted).
"""

from __future__ import annotations

import time

import torch

import tileattn
from tileattn.bench.backends import check_backend
from tileattn.bench.decode import AB_LAYOUTS
from tileattn.reference import attention_ref
from tileattn.testing import check_close

TRAINING_SHAPE = (8, 512, 16, 64)  # batch, seqlen, nheads, headdim: BERT-large's attention
DECODE_SHAPE = (1, 8192, 32, 8, 128)  # batch, cache length, nheads, nheads_k, headdim


def host_and_device_us(fn, device: torch.device, calls: int = 20, rounds: int = 10) -> tuple[float, float | None]:
    """(host µs per call, device µs per call or None off CUDA): the best of ``rounds`` rounds of
    ``calls`` calls, each round started after a synchronize (after five warm-up calls)."""
    cuda = device.type == "cuda"
    for _ in range(5):
        fn()
    host, dev = [], []
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            dev.append(start.elapsed_time(end) * 1e3 / calls)
    return min(host), (min(dev) if dev else None)


def _sdpa(q, k, v, causal=False, dropout_p=0.0, cudnn=False):
    """SDPA in tileattn's layout; ``cudnn``: forced to its cuDNN backend (CUDA only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kwargs = dict(is_causal=causal, dropout_p=dropout_p, enable_gqa=q.shape[2] != k.shape[2])
    if cudnn:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)


def training_cases(device: torch.device, dtype: torch.dtype, shape=TRAINING_SHAPE):
    """``{name: (call, check)}``: ``check(out)`` raises when the forward is wrong; None for dropout."""
    batch, seqlen, nheads, headdim = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen)

    def grad(out):
        return torch.autograd.grad(out, (q, k, v), dout)

    def check(name):
        return lambda out: check_backend(name, out.detach(), q.detach(), k.detach(), v.detach())

    return {
        "tileattn fwd": (lambda: tileattn.flash_attn_func(q, k, v), check("tileattn fwd")),
        "tileattn fwd+bwd": (lambda: grad(tileattn.flash_attn_func(q, k, v)), None),
        "tileattn fwd+bwd p=0.1": (lambda: grad(tileattn.flash_attn_func(q, k, v, dropout_p=0.1)), None),
        "sdpa fwd": (lambda: _sdpa(q, k, v), check("sdpa fwd")),
        "sdpa fwd+bwd": (lambda: grad(_sdpa(q, k, v)), None),
        "sdpa fwd+bwd p=0.1": (lambda: grad(_sdpa(q, k, v, dropout_p=0.1)), None),
    }


def decode_cases(device: torch.device, dtype: torch.dtype, shape=DECODE_SHAPE):
    """``{name: (call, check)}`` of one decode step: the ``--decode-ab`` layouts over one cache."""
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
    sdpa = "sdpa cudnn" if device.type == "cuda" else "sdpa"
    cases[sdpa] = (
        lambda: _sdpa(q, kc, vc, cudnn=device.type == "cuda"),
        lambda out: check_backend(sdpa, out, q, kc, vc),
    )
    return cases


def run_host(
    device="cuda",
    dtype=torch.bfloat16,
    calls=20,
    rounds=10,
    training_shape=TRAINING_SHAPE,
    decode_shape=DECODE_SHAPE,
    progress=print,
):
    """Rows of ``kind='host'`` (``case`` training or decode, ``backend`` the call): ``host_us``,
    ``device_us`` and on CUDA ``do_bench_us`` per call."""
    device = torch.device(device)
    rows = []
    for case, cases in (
        ("training", training_cases(device, dtype, training_shape)),
        ("decode", decode_cases(device, dtype, decode_shape)),
    ):
        for name, (call, check) in cases.items():
            if check is not None:
                check(call())
            host, dev = host_and_device_us(call, device, calls, rounds)
            row = dict(kind="host", case=case, backend=name, device=device.type, host_us=host, device_us=dev)
            if device.type == "cuda":
                import triton

                row["do_bench_us"] = triton.testing.do_bench(call, return_mode="median") * 1e3
            rows.append(row)
            progress(f"{case} {name}: host {host:.1f} µs/call")
    return rows


def format_host(rows) -> str:
    from tabulate import tabulate

    def us(value):
        return f"{value:.1f}" if value is not None else "-"

    table = [[r["case"], r["backend"], us(r["host_us"]), us(r["device_us"]), us(r.get("do_bench_us"))] for r in rows]
    headers = ["case", "call", "host µs", "device µs", "do_bench µs"]
    return tabulate(table, headers=headers, tablefmt="github")
