"""The public API: a drop-in superset of the ``flash_attn`` 2.x Python functions.

Every argument is validated here, once, before anything runs or is written (one place for every error
message). The call is then normalised into a ``kernels.configs.AttnParams`` and routed: CUDA tensors run
the Triton kernels; CPU tensors run the blockwise PyTorch path (``tileattn.cpu``), or the Triton kernels
through Triton's interpreter when ``TRITON_INTERPRET=1`` is set (fp16/bf16 only).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import weakref
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import torch

from tileattn import cpu, reference, rng
from tileattn.kernels.configs import AttnParams, interpreting, remember

MAX_HEADDIM = 256
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# None: CPU tensors take the Triton interpreter when TRITON_INTERPRET=1 is set, else the PyTorch path.
_cpu_backend: str | None = None


@contextlib.contextmanager
def cpu_backend(name: str) -> Iterator[None]:
    """Forces the implementation used for CPU tensors inside the block: ``"torch"`` (the blockwise
    PyTorch path) or ``"triton"`` (the kernels under Triton's interpreter, float16 only; needs
    TRITON_INTERPRET=1)."""
    global _cpu_backend
    if name not in ("torch", "triton"):
        raise ValueError(f"cpu_backend: name must be 'torch' or 'triton', got {name!r}")
    if name == "triton" and not interpreting():
        raise RuntimeError("cpu_backend('triton') needs TRITON_INTERPRET=1 set before triton is imported")
    previous, _cpu_backend = _cpu_backend, name
    try:
        yield
    finally:
        _cpu_backend = previous


def _implementation(q: torch.Tensor) -> ModuleType | SimpleNamespace:
    """The module whose ``attn_fwd`` / ``attn_bwd`` run this call.

    Under the interpreter only float16 takes the kernels: Triton 3.6's interpreter multiplies bfloat16
    ``tl.dot`` operands as raw 16-bit integers, so bfloat16 CPU tensors stay on the PyTorch path."""
    if not q.is_cuda:
        wants_triton = _cpu_backend == "triton" or (_cpu_backend is None and interpreting())
        if not (wants_triton and q.dtype == torch.float16):
            return cpu
    return _triton_implementation()


@functools.cache
def _triton_implementation() -> SimpleNamespace:
    """The Triton launchers behind the same interface as ``tileattn.cpu``, imported on first use."""
    from tileattn.kernels import backward, decode, forward

    return SimpleNamespace(
        attn_fwd=forward.attn_fwd,
        attn_bwd=backward.attn_bwd,
        attn_fwd_kvcache=decode.attn_fwd_kvcache,
        kvcache_append=decode.kvcache_append,
    )


# --------------------------------------------------------------------------------------------------
# Validation: every message names the argument and what is allowed.
# --------------------------------------------------------------------------------------------------


def _check_tensor(name: str, t: object, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    rank = layout.count(",") + 1
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(t.shape)}")
    return t


def _check_inputs(named: dict[str, torch.Tensor]) -> tuple[torch.dtype, torch.device]:
    """Dtype, device and stride checks shared by q, k, v (and their packed forms)."""
    (first_name, first), *rest = named.items()
    for name, t in named.items():
        if t.dtype not in _CPU_DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16 (or float32 on CPU), got {t.dtype}")
        if t.dtype not in _GPU_DTYPES and t.is_cuda:
            raise TypeError(
                f"{name} is a CUDA tensor of dtype {t.dtype}; on CUDA only float16 and bfloat16 are supported"
            )
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last (head) dimension, got strides {tuple(t.stride())}; "
                f"call .contiguous() first"
            )
    for name, t in rest:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; all inputs must share one dtype"
            )
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; all inputs must share one device"
            )
    return first.dtype, first.device


def _check_heads(nheads: int, nheads_k: int, headdim: int, headdim_k: int, headdim_v: int) -> None:
    if nheads < 1 or nheads_k < 1:
        raise ValueError(f"nheads and nheads_k must be at least 1, got nheads={nheads}, nheads_k={nheads_k}")
    if nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be divisible by nheads_k ({nheads_k}) for MQA/GQA")
    if headdim_k != headdim or headdim_v != headdim:
        raise ValueError(f"q, k and v must share the head dim, got {headdim}, {headdim_k}, {headdim_v}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")


_INT32_LIMIT = 2**31
# CUDA grids hold at most 65,535 programs along y and z (dense batches run along z); the varlen scheduler
# keeps one cu_seqlens entry per sequence in registers, a vector of next_pow2(batch) entries, run on the
# GPU at 2,048 entries.
MAX_DENSE_BATCH = 65535
MAX_VARLEN_BATCH = 2048


def _check_extent(seqlen: int, named: dict[str, torch.Tensor]) -> None:
    """The kernels address rows within one sequence with 32-bit offsets (batch and sequence starts are
    64-bit), so one sequence's span of a tensor must stay below 2**31 elements."""
    for name, t in named.items():
        span = seqlen * t.stride(-3)
        if span >= _INT32_LIMIT:
            raise NotImplementedError(
                f"{name}: one sequence spans {span} elements (seqlen {seqlen} x row stride {t.stride(-3)}); "
                f"the kernels support fewer than 2**31 per sequence"
            )


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Checks shared by the dense and varlen layouts: dtypes, devices and strides, k and v alike, head
    counts and head dims (the last two dims of every layout)."""
    _check_inputs({"q": q, "k": k, "v": v})
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_heads(q.shape[-2], k.shape[-2], q.shape[-1], k.shape[-1], v.shape[-1])


def _is_real(x: object) -> bool:
    t = type(x)  # float and int first: the ABC check costs a microsecond on every call
    return t is float or t is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _is_int(x: object) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _check_options(
    dropout_p: object,
    softmax_scale: object,
    causal: object,
    window_size: object,
    softcap: object,
    deterministic: object,
    return_attn_probs: object,
    *,
    seqlen_k: int,
) -> tuple[float, float | None, int, int, float]:
    """Scalar options; returns (dropout_p, softmax_scale, window_left, window_right, softcap). The window
    as ``reference.causal_window`` resolves it against the call's key length ``seqlen_k``."""
    if not _is_real(dropout_p) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is not None and (not _is_real(softmax_scale) or not math.isfinite(float(softmax_scale))):
        raise TypeError(f"softmax_scale must be None or a finite real number, got {softmax_scale!r}")
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(_is_int(w) for w in window_size):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if not _is_real(softcap) or not math.isfinite(float(softcap)) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap!r}")
    left, right = reference.causal_window(causal, (left, right), seqlen_k)
    scale = None if softmax_scale is None else float(softmax_scale)
    quantized = rng.quantize_dropout_p(float(dropout_p))
    if dropout_p > 0 and quantized == 0:
        raise ValueError(
            f"dropout_p={dropout_p!r} rounds to 0 at the dropout draws' resolution of 2**-8 (p is rounded to a "
            "multiple of 1/256); pass 0, or more than 1/512 for a rate of at least 1/256"
        )
    return quantized, scale, left, right, float(softcap)


def _check_alibi(alibi_slopes: object, batch: int, nheads: int, device: torch.device) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be None or a float32 tensor, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    return alibi_slopes.contiguous()


def _check_cu_seqlens(name: str, cu: object, max_name: str, max_seqlen: object, device: torch.device) -> None:
    """cu_seqlens must be an int32 (batch + 1,) tensor on q's device and max_seqlen an int. Their values
    are checked by ``_check_cu_values`` where the kernels run (tracing sees no values)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape (batch + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of shape (batch + 1,), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if not _is_int(max_seqlen):
        raise TypeError(f"{max_name} must be an int, got {max_seqlen!r}")


class _CheckedOnce:
    """Results of host-side value checks (each one a device sync), remembered per set of tensors.

    A model passes the same cu_seqlens, cache_seqlens and block_table to every layer: reading them on
    the host once per tensor instead of once per call keeps the launches queued ahead of the GPU. An
    entry is keyed by the tensors' identities and the check's other arguments, and holds while every
    tensor is alive and unmodified (PyTorch's version counter): changes through torch ops are checked
    again. Inference tensors have no version counter and are checked on every call; writes that bypass
    the counter (``.data``, ``.numpy()``, DLPack aliases, a custom kernel, a CUDA graph's replay) are not
    seen, as documented on flash_attn_varlen_func and flash_attn_with_kvcache."""

    def __init__(self, limit: int = 256) -> None:
        self._seen: dict[tuple, tuple] = {}
        self._limit = limit

    def __call__(self, tensors: tuple[torch.Tensor | None, ...], args: tuple, check):
        present = [t for t in tensors if t is not None]
        key = (tuple(map(id, tensors)), args)  # (None has one id)
        seen = self._seen.get(key)
        if seen is not None:  # the very tensors of the entry (so not inference tensors), unmodified?
            for ref, version, t in zip(seen[0], seen[1], present):
                if ref() is not t or t._version != version:
                    break
            else:
                return seen[2]
        if any(t.is_inference() for t in present):
            return check()
        result = check()
        self._seen.pop(key, None)
        entry = ([weakref.ref(t) for t in present], [t._version for t in present], result)
        remember(self._seen, key, entry, self._limit)  # the oldest go (never the one just checked)
        return result


checked_once = _CheckedOnce()


def _check_cu_values(name: str, cu: torch.Tensor, total: int | None, max_name: str, max_seqlen: int) -> list[int]:
    """cu_seqlens must start at 0, never decrease and end at the token count (``total``, if given);
    max_seqlen must cover every sequence. Returns the lengths (read on the host once per unmodified
    tensor: ``checked_once``)."""
    return checked_once(
        (cu,), ("cu_seqlens", total, max_seqlen), lambda: _cu_lengths(name, cu, total, max_name, max_seqlen)
    )


def _cu_lengths(name: str, cu: torch.Tensor, total: int | None, max_name: str, max_seqlen: int) -> list[int]:
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of tokens ({total}), got {values[-1]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} ({max_seqlen}) is smaller than the longest sequence ({max(lengths)})")
    return lengths


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


class _DeviceGuard:
    """``torch.cuda.device(index)`` without its argument parsing (on every call of the API)."""

    __slots__ = ("index", "previous")

    def __init__(self, index: int):
        self.index = index

    def __enter__(self) -> None:
        self.previous = torch.cuda._exchange_device(self.index)

    def __exit__(self, *exc) -> bool:
        torch.cuda._maybe_exchange_device(self.previous)
        return False


_NO_GUARD = contextlib.nullcontext()
_GUARD = _DeviceGuard if hasattr(torch.cuda, "_maybe_exchange_device") else torch.cuda.device


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device and its current stream: make the tensors' device
    current (its current stream is the caller's), so inputs on ``cuda:1`` never run on ``cuda:0``."""
    return _GUARD(t.device.index) if t.is_cuda else _NO_GUARD


def direct(*tensors: torch.Tensor | None) -> bool:
    """Whether a call may run its custom op's implementation directly, skipping the dispatcher: not
    while torch.compile / export / torch.jit trace, not under a dispatch or function mode (fake tensors, flop
    counters, ...), and only for plain tensors (not subclasses)."""
    if (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
    ):
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


def _nothing_to_attend(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No query rows, or no keys at all: every output row is 0 (LSE +inf) and every gradient 0."""
    return q.numel() == 0 or k.shape[-3] == 0


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: AttnParams,
    return_attn_probs: bool,
):
    """Calls the ``tileattn::fwd`` custom op (``tileattn.ops``), which carries the autograd, or in eager
    mode on plain tensors the same implementation without the op's dispatch (``direct``)."""
    from tileattn import ops

    op = ops.EagerAttention.apply if direct(q, k, v) else torch.ops.tileattn.fwd
    out, lse, rng_state = op(
        q,
        k,
        v,
        p.alibi_slopes,
        p.cu_seqlens_q,
        p.cu_seqlens_k,
        p.seqlen_q,
        p.seqlen_k,
        p.softmax_scale,
        p.window_left,
        p.window_right,
        p.softcap,
        p.dropout_p,
        p.deterministic,
    )
    if not return_attn_probs:
        return out
    return out, lse, ops.attn_probs(q, k, lse, rng_state, p)


def resolve_scale(softmax_scale: float | None, headdim: int) -> float:
    """The softmax scale a call uses: ``softmax_scale``, or ``1 / sqrt(headdim)`` when it is None."""
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _params(
    q: torch.Tensor,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> AttnParams:
    dropout_p, softmax_scale, left, right, softcap = _check_options(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, seqlen_k=seqlen_k
    )
    headdim = q.shape[-1]
    return AttnParams(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        headdim=headdim,
        softmax_scale=resolve_scale(softmax_scale, headdim),
        window_left=left,
        window_right=right,
        softcap=softcap,
        alibi_slopes=_check_alibi(alibi_slopes, batch, q.shape[-2], q.device),
        dropout_p=dropout_p,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        deterministic=deterministic,
    )


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------

_DENSE_DOC_ARGS = """
        dropout_p: probability of dropping an attention weight (training only; pass 0.0 at eval),
            rounded to a multiple of 2**-8 (each decision uses 8 random bits, as in flash_attn). Decisions come from a
            counter-based RNG (Philox) seeded from PyTorch's default generator, so ``torch.manual_seed``
            makes them reproducible; the backward pass regenerates them.
        softmax_scale: scale of QKᵀ before the softmax; default ``1 / sqrt(headdim)``.
        causal: causal mask aligned to the bottom-right corner: with ``seqlen_q != seqlen_k``, query i
            sees keys ``j <= i + seqlen_k - seqlen_q``.
        window_size: ``(left, right)`` sliding window around that diagonal; query i sees keys in
            ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``; -1 = unbounded, and
            as in flash_attn a side at least ``seqlen_k`` wide (``max_seqlen_k`` in varlen calls, the cache
            capacity in ``flash_attn_with_kvcache``) is unbounded too.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (before ALiBi and masking).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``; adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores.
        deterministic: the backward's dQ by a separate pass, bitwise reproducible run to run. Without it
            the tables may add dQ from the dK/dV pass by fp32 reduce-adds, whose order varies (causal
            calls at head dim 128, which are faster that way); dK and dV are reproducible either way.
        return_attn_probs: also return ``softmax_lse`` and ``S_dmask`` (for testing).
"""

_RETURNS_DOC = """
    Returns:
        out ``{out_shape}``, the inputs' dtype. If ``return_attn_probs``: ``(out, softmax_lse,
        S_dmask)`` where softmax_lse is fp32 ``{lse_shape}``, the natural-log sum of exp of each row's
        scores (``+inf`` for a row that sees no key, whose output is 0), and S_dmask is fp32
        ``(batch, nheads, {sq}, {sk})`` holding the attention probabilities the forward pass used
        (before dropout scaling), negated where dropout removed them and 0 where masked. S_dmask is
        materialised N×N from softmax_lse: use it for tests only.
"""


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    q = _check_tensor("q", q, "(batch, seqlen_q, nheads, headdim)")
    k = _check_tensor("k", k, "(batch, seqlen_k, nheads_k, headdim)")
    v = _check_tensor("v", v, "(batch, seqlen_k, nheads_k, headdim)")
    _check_qkv(q, k, v)
    batch, seqlen_q, nheads, headdim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {k.shape[0]}")
    if batch > MAX_DENSE_BATCH:
        raise NotImplementedError(f"batch {batch} is above {MAX_DENSE_BATCH}; split it into several calls")
    _check_extent(seqlen_q, {"q": q})
    _check_extent(k.shape[1], {"k": k, "v": v})
    p = _params(
        q,
        batch,
        seqlen_q,
        k.shape[1],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
    return _run(q, k, v, p, return_attn_probs)


flash_attn_func.__doc__ = (
    """Exact attention softmax(QKᵀ·scale)·V, fused and O(N) in memory, forward and backward.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16 or bfloat16 (float32 too on CPU).
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (MQA/GQA: query head
            i uses kv head ``i // (nheads // nheads_k)``). headdim may be anything from 1 to 256. The last
            dimension must be contiguous; other strides are free."""
    + _DENSE_DOC_ARGS
    + _RETURNS_DOC.format(
        out_shape="(batch, seqlen_q, nheads, headdim)",
        lse_shape="(batch, nheads, seqlen_q)",
        sq="seqlen_q",
        sk="seqlen_k",
    )
)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_func`` on ``qkv`` of shape ``(batch, seqlen, 3, nheads, headdim)`` (self-attention);
    the gradient flows back into ``qkv``. Other arguments and returns as in ``flash_attn_func``."""
    qkv = _check_tensor("qkv", qkv, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_func`` with ``kv`` of shape ``(batch, seqlen_k, 2, nheads_k, headdim)``; the gradient
    flows back into ``kv``. Other arguments and returns as in ``flash_attn_func``."""
    kv = _check_tensor("kv", kv, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
):
    q = _check_tensor("q", q, "(total_q, nheads, headdim)")
    if block_table is not None:
        from tileattn import kvcache

        k = _check_tensor("k", k, "paged (num_pages, page_block_size, nheads_k, headdim)")
        v = _check_tensor("v", v, "paged (num_pages, page_block_size, nheads_k, headdim)")
        _check_qkv(q, k, v)
        options = dict(
            dropout_p=dropout_p,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            deterministic=deterministic,
            return_attn_probs=return_attn_probs,
        )
        return kvcache.paged_varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, options
        )
    k = _check_tensor("k", k, "(total_k, nheads_k, headdim)")
    v = _check_tensor("v", v, "(total_k, nheads_k, headdim)")
    _check_qkv(q, k, v)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got {cu_seqlens_q.numel() - 1} and "
            f"{cu_seqlens_k.numel() - 1} sequences"
        )
    batch = cu_seqlens_q.numel() - 1
    if batch > MAX_VARLEN_BATCH:
        raise NotImplementedError(
            f"cu_seqlens_q describes {batch} sequences; at most {MAX_VARLEN_BATCH} per call are supported, "
            "split the batch into several calls"
        )
    _check_extent(int(max_seqlen_q), {"q": q})
    _check_extent(int(max_seqlen_k), {"k": k, "v": v})
    p = _params(
        q,
        batch,
        int(max_seqlen_q),
        int(max_seqlen_k),
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        cu_seqlens_q=cu_seqlens_q.contiguous(),
        cu_seqlens_k=cu_seqlens_k.contiguous(),
    )
    return _run(q, k, v, p, return_attn_probs)


flash_attn_varlen_func.__doc__ = (
    """Attention over a packed batch of sequences of different lengths (no padding computed).

    Args:
        q: ``(total_q, nheads, headdim)``, the batch's query tokens concatenated.
        k, v: ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, cumulative sequence lengths starting at 0:
            sequence b holds query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``. Empty sequences are
            allowed. Their values are read on the host to validate them before the kernels run, once
            per tensor: later calls with the same tensor (every layer of a model) reuse the check until
            a torch op changes it. Writes that bypass PyTorch's version counter (``.data``,
            ``.numpy()``, DLPack, your own kernels, a CUDA graph's replay) are not seen: pass a new
            tensor instead. Inference tensors have no version counter and are read on every call.
        max_seqlen_q, max_seqlen_k: ints at least the longest query / key sequence.
        Masks are aligned to the bottom-right corner of each sequence."""
    + _DENSE_DOC_ARGS
    + """        block_table: int32 ``(batch, max_pages)``: paged prefill. k and v are then page pools
            ``(num_pages, page_block_size, nheads_k, headdim)`` and sequence b's keys are the first
            ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` positions of its pages. Forward only (no dropout,
            no return_attn_probs, no gradient).
"""
    + _RETURNS_DOC.format(
        out_shape="(total_q, nheads, headdim)", lse_shape="(nheads, total_q)", sq="max_seqlen_q", sk="max_seqlen_k"
    )
)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_varlen_func`` on ``qkv`` of shape ``(total, 3, nheads, headdim)`` with one
    ``cu_seqlens``/``max_seqlen`` for queries and keys."""
    qkv = _check_tensor("qkv", qkv, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_varlen_func`` with ``kv`` of shape ``(total_k, 2, nheads_k, headdim)``."""
    kv = _check_tensor("kv", kv, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
