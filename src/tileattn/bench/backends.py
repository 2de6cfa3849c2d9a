"""One registry of attention backends to time side by side.

Each backend is a function ``make(q, k, v, causal) -> fn`` returning a zero-argument callable that runs
the attention forward and returns the output in tileattn's layout ``(batch, seqlen, nheads, headdim)``,
or raises ``Unavailable`` when it cannot run here (missing package, unsupported shape or device).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import tileattn
from tileattn.reference import attention_ref
from tileattn.testing import check_close


class Unavailable(Exception):
    """The backend cannot run this case on this machine."""


def _tileattn(q, k, v, causal):
    return lambda: tileattn.flash_attn_func(q, k, v, causal=causal)


def _sdpa(backend_name: str):
    def make(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not q.is_cuda:
            raise Unavailable("SDPA backends are timed on CUDA only")
        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[2] != k.shape[2]

        def run():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
            return out.transpose(1, 2)

        try:
            run()
        except RuntimeError as exc:
            raise Unavailable(f"{backend_name}: {str(exc).splitlines()[0]}") from exc
        return run

    return make


_FLEX_CACHE: dict = {}


def _flex(q, k, v, causal):
    if not q.is_cuda:
        raise Unavailable("FlexAttention is timed on CUDA only")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX_CACHE:
        # One compile per shape and mask; past dynamo's default limit (8) it would silently fall back
        # to the unfused path and time that instead.
        import torch._dynamo

        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 256)
        _FLEX_CACHE["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX_CACHE["fn"]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    block_mask = None
    if causal:
        diag = k.shape[1] - q.shape[1]

        def causal_mask(b, h, i, j):
            return j <= i + diag

        block_mask = create_block_mask(causal_mask, None, None, q.shape[1], k.shape[1], device=q.device)
    gqa = q.shape[2] != k.shape[2]
    return lambda: flex(qt, kt, vt, block_mask=block_mask, enable_gqa=gqa).transpose(1, 2)


def _eager(q, k, v, causal):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5
    sq, sk = q.shape[1], k.shape[1]

    def run():
        s = (qt @ kt.transpose(-1, -2)) * scale
        if causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            s = s.masked_fill(~mask, float("-inf"))
        return (torch.softmax(s.float(), -1).to(q.dtype) @ vt).transpose(1, 2)

    return run


def _flash_attn(q, k, v, causal):
    try:
        from flash_attn import flash_attn_func
    except ImportError as exc:
        raise Unavailable("flash_attn is not installed") from exc
    if not q.is_cuda:
        raise Unavailable("flash_attn needs CUDA")
    return lambda: flash_attn_func(q, k, v, causal=causal)


def _fa4(q, k, v, causal):
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as exc:
        raise Unavailable("flash_attn.cute (FA4) is not installed") from exc
    if not q.is_cuda:
        raise Unavailable("FA4 needs CUDA")

    def run():
        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return run


BACKENDS: dict[str, Callable] = {
    "tileattn": _tileattn,
    "fa4": _fa4,
    "flash_attn": _flash_attn,
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flex": _flex,
    "eager": _eager,
}


def slice_refs(q, k, v, causal=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp64 oracle, same computation in the inputs' precision) of the first batch entry's first head,
    ``(1, seqlen_q, 1, headdim)`` each: what ``check_backend`` compares with."""
    assert q.shape[2] // k.shape[2] >= 1
    qs, ks, vs = q[:1, :, :1], k[:1, :, :1], v[:1, :, :1]
    ref = attention_ref(qs, ks, vs, causal=causal, upcast=torch.float64)[0]
    lowp = attention_ref(qs, ks, vs, causal=causal, upcast=False)[0]
    return ref, lowp


def check_backend(name, out, q, k, v, causal=False, refs=None):
    """Tolerance rule on one (batch, head) slice, so the reference fits in memory at long seqlens.
    ``refs``: ``slice_refs(q, k, v, causal)`` when several backends are checked on the same inputs."""
    ref, lowp = refs if refs is not None else slice_refs(q, k, v, causal)
    check_close(name, out[:1, :, :1], ref, lowp)
