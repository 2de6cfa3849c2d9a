"""FP8 (e4m3) inputs: quantizing to them with per-(batch, kv head) descales, and the checks and dequantization
of FP8 calls to the attention functions (FlashAttention-3's ``q_descale``, ``k_descale``, ``v_descale``).

A tensor ``x`` in FP8 stands for ``x_fp8 * descale``: ``descale`` is fp32 ``(batch, nheads_k)``, one positive
factor per sequence and kv head, shared by the query heads of its GQA group (FlashAttention-3's layout).
The attention functions take q, k, v in ``torch.float8_e4m3fn`` with their descales (None: 1.0) and return
bf16. On GPUs with FP8 tensor cores (sm89+) the forward kernel reads FP8 and multiplies in FP8
(``tileattn.kernels.forward``); the CPU path descales in fp32; older GPUs run the bf16 kernels on
dequantized inputs. A backward through FP8 inputs raises ``NotImplementedError``.
"""

from __future__ import annotations

import torch

from tileattn import checks
from tileattn.ops import attention

__all__ = ["E4M3", "dequantize", "quantize"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _sequence_of_rows(
    rows: int, batch: int, cu_seqlens: torch.Tensor | None, seqlen: int | None, device
) -> torch.Tensor:
    """The sequence of each of ``rows`` token rows: ``cu_seqlens`` (packed; rows past the last sequence are
    given to it, they are padding) or ``seqlen`` rows each (dense, flattened)."""
    row = torch.arange(rows, device=device)
    if cu_seqlens is None:
        return row // seqlen
    return torch.searchsorted(cu_seqlens[1:].long(), row, right=True).clamp(max=batch - 1)


def quantize(
    x: torch.Tensor, nheads_k: int | None = None, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, descale)`` with ``x ≈ x_fp8 * descale``: each (sequence, kv head group) scaled so that its
    largest magnitude maps to e4m3's largest, 448.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or packed ``(total, nheads, headdim)`` with ``cu_seqlens``;
            any float dtype.
        nheads_k: the kv heads the descales follow (q's heads are grouped ``nheads // nheads_k`` to a
            factor, as the attention functions read them); default x's own heads (for k and v).
        cu_seqlens: int32 ``(batch + 1,)`` of a packed x: one descale per sequence.

    Returns:
        ``x_fp8`` (``torch.float8_e4m3fn``, x's shape) and ``descale`` fp32 ``(batch, nheads_k)`` (1.0 for
        groups that are all zeros)."""
    layout = "(total, nheads, headdim)" if cu_seqlens is not None else "(batch, seqlen, nheads, headdim)"
    x = checks.check_tensor("x", x, layout)
    if not x.is_floating_point() or x.dtype in _FP8:
        raise checks.InvalidArgumentType(f"quantize: x must be a float16/bfloat16/float32 tensor, got {x.dtype}")
    nheads = x.shape[-2]
    nheads_k = nheads if nheads_k is None else nheads_k
    if not checks.is_int(nheads_k) or nheads_k < 1 or nheads % nheads_k:
        raise checks.InvalidArgument(f"quantize: nheads_k must divide x's {nheads} heads, got {nheads_k!r}")
    rows = x.reshape(-1, nheads_k, nheads // nheads_k * x.shape[-1])  # (tokens, nheads_k, group * headdim)
    if cu_seqlens is None:
        batch = x.shape[0]
        seq = _sequence_of_rows(rows.shape[0], batch, None, x.shape[1], x.device)
    else:
        checks.check_cu_seqlens("cu_seqlens", cu_seqlens, "max_seqlen", 0, x.device)
        batch = cu_seqlens.numel() - 1
        seq = _sequence_of_rows(rows.shape[0], batch, cu_seqlens, None, x.device)
    amax = rows.abs().amax(-1).float()  # (tokens, nheads_k)
    group_max = torch.zeros(batch, nheads_k, device=x.device).scatter_reduce_(
        0, seq[:, None].expand_as(amax), amax, "amax"
    )
    descale = torch.where(group_max > 0, group_max / E4M3_MAX, torch.ones_like(group_max))
    scaled = rows.float() / descale[seq].unsqueeze(-1)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(x.shape), descale


def dequantize(
    x_fp8: torch.Tensor,
    descale: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x_fp8 * descale`` in ``dtype``: x_fp8 ``(batch, seqlen, nheads, headdim)`` (or packed with
    ``cu_seqlens``), descale fp32 ``(batch, nheads_k)`` or None (1.0), nheads a multiple of nheads_k."""
    if descale is None:
        return x_fp8.to(dtype)
    nheads, nheads_k = x_fp8.shape[-2], descale.shape[1]
    rows = x_fp8.reshape(-1, nheads_k, nheads // nheads_k * x_fp8.shape[-1])
    batch = descale.shape[0]
    seqlen = None if cu_seqlens is not None else x_fp8.shape[1]
    seq = _sequence_of_rows(rows.shape[0], batch, cu_seqlens, seqlen, x_fp8.device)
    return (rows.float() * descale[seq].unsqueeze(-1)).to(dtype).view(x_fp8.shape)


class _Dequantized(torch.autograd.Function):
    """Dequantization of the attention's FP8 inputs (GPUs without FP8 tensor cores), with a backward that
    refuses (no FP8 backward)."""

    @staticmethod
    def forward(ctx, x, descale, cu_seqlens):
        return dequantize(x, descale, cu_seqlens)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(attention.FP8_BACKWARD)


def _check_descale(name: str, d: object, batch: int, nheads_k: int, device: torch.device) -> None:
    """A descale argument: None, or fp32 ``(batch, nheads_k)`` on ``device``."""
    if d is None:
        return
    if not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
        got = d.dtype if isinstance(d, torch.Tensor) else type(d).__name__
        raise checks.InvalidArgumentType(f"{name} must be a float32 tensor of shape (batch, nheads_k), got {got}")
    if tuple(d.shape) != (batch, nheads_k):
        raise checks.InvalidArgument(
            f"{name} must have shape (batch, nheads_k) = ({batch}, {nheads_k}), got {tuple(d.shape)}"
        )
    if d.device != device:
        raise checks.InvalidArgument(f"{name} is on {d.device} but q is on {device}")


def _native(device: torch.device) -> bool:
    """Whether attention on ``device`` reads FP8 itself: CPU (the PyTorch path descales block by block) and
    GPUs with FP8 tensor cores (sm89+); older GPUs take dequantized bf16 inputs."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def inputs(
    q: object,
    k: object,
    v: object,
    q_descale: object,
    k_descale: object,
    v_descale: object,
    batch: int,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[object, object, object, torch.Tensor | None]:
    """``(q, k, v, descales)`` of an attention call: FP8 q, k, v (after checking them and their
    descales) with ``descales`` fp32 ``(3, batch, nheads_k)`` (``AttnParams.descales``; 1.0 where a
    descale is None), which the kernels read; on GPUs without FP8 tensor cores q, k, v dequantized to
    bf16 and None. Other calls unchanged, with None (and refused if they pass a descale). ``batch``: the
    call's."""
    tensors = {"q": q, "k": k, "v": v}
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    fp8 = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.dtype in _FP8]
    if not fp8:
        given = [name for name, d in descales.items() if d is not None]
        if given:
            raise checks.InvalidArgument(f"{given[0]} is for float8_e4m3fn q, k and v; these are not FP8")
        return q, k, v, None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != E4M3:
            got = type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype
            raise checks.InvalidArgumentType(
                f"{name} must be torch.float8_e4m3fn like {fp8[0]} (FP8 attention takes q, k and v all in e4m3, "
                f"e5m2 is not supported), got {got}"
            )
    nheads_k = k.shape[-2] if k.dim() >= 2 else 0
    for name, d in descales.items():
        _check_descale(name, d, batch, nheads_k, q.device)
    if q.shape[-2] % max(nheads_k, 1):
        raise checks.InvalidArgument(f"nheads ({q.shape[-2]}) must be divisible by nheads_k ({nheads_k}) for MQA/GQA")
    if not _native(q.device):
        return (
            _Dequantized.apply(q, q_descale, cu_seqlens_q),
            _Dequantized.apply(k, k_descale, cu_seqlens_k),
            _Dequantized.apply(v, v_descale, cu_seqlens_k),
            None,
        )
    ones = None
    stacked = []
    for d in descales.values():
        if d is None:
            ones = torch.ones(batch, nheads_k, device=q.device) if ones is None else ones
            d = ones
        stacked.append(d)
    return q, k, v, torch.stack(stacked)


def checked_options(descales: torch.Tensor | None, p) -> torch.Tensor | None:
    """``descales`` after refusing what FP8 calls do not take (dropout: FP8 attention is forward only)."""
    if descales is not None and p.dropout_p > 0:
        raise checks.InvalidArgument(
            f"dropout_p must be 0.0 with float8_e4m3fn inputs (FP8 attention is forward only), got {p.dropout_p}"
        )
    return descales


def is_fp8(t: object) -> bool:
    """Whether ``t`` is a tensor of an 8-bit float dtype (e4m3, e5m2 and their fnuz forms)."""
    return isinstance(t, torch.Tensor) and t.dtype in _FP8


def cache_descales(named: dict, k_descale: object, v_descale: object, batch: int, nheads_k: int) -> torch.Tensor | None:
    """Checks the FP8 arguments of ``flash_attn_with_kvcache`` (``named``: q, k_cache, v_cache and any new
    k, v, already checked by ``checks.check_inputs`` with FP8 allowed): e4m3 caches both, q, k, v in
    float16/bfloat16, descales fp32 ``(batch, nheads_k)``. Returns the ones a None descale stands for, or
    None when the caches are not FP8 (and no descale is given)."""
    caches = {name: named[name] for name in ("k_cache", "v_cache")}
    descales = {"k_descale": k_descale, "v_descale": v_descale}
    if not any(t.dtype in _FP8 for t in caches.values()):
        given = [name for name, d in descales.items() if d is not None]
        if given:
            raise checks.InvalidArgument(f"{given[0]} is for float8_e4m3fn k_cache and v_cache; these are not FP8")
        return None
    for name, t in caches.items():
        if t.dtype != E4M3:
            raise checks.InvalidArgumentType(
                f"{name} must be torch.float8_e4m3fn like the other cache (FP8 caches are e4m3 both; e5m2 is not "
                f"supported), got {t.dtype}"
            )
    for name, t in named.items():
        if name not in caches and t.dtype not in (torch.float16, torch.bfloat16):
            raise checks.InvalidArgumentType(
                f"{name} must be float16 or bfloat16 with FP8 caches (the new keys and values are quantized as "
                f"they are written), got {t.dtype}"
            )
    device = named["q"].device
    for name, d in descales.items():
        _check_descale(name, d, batch, nheads_k, device)
    return torch.ones(batch, nheads_k, device=device)
