"""Every check of the public functions' arguments, in one place: each message names the argument and
what is allowed. Metadata checks (shapes, dtypes, devices, options) run in the API layer, where tracing
sees them; checks of index *values* (cu_seqlens, cache_seqlens, block tables), which read the device,
run in the ops layer before any kernel, once per unmodified tensor (``checked_once``). Refusals raise
``InvalidArgument`` (a ValueError and a RuntimeError) or ``InvalidArgumentType`` (also a TypeError).
"""

from __future__ import annotations

import math
import numbers
import weakref

import torch

from tileattn import params, reference
from tileattn.params import remember


class InvalidArgument(ValueError, RuntimeError):
    """An argument tileattn refuses. A ``ValueError``, and a ``RuntimeError`` as flash_attn raises for the
    same calls (its C++ checks surface as RuntimeError): code that catches either keeps working."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of the wrong type or dtype: an ``InvalidArgument`` that is also a ``TypeError``."""


MAX_HEADDIM = 256
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t: object, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentType(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    rank = layout.count(",") + 1
    if t.dim() != rank:
        raise InvalidArgument(f"{name} must have {rank} dims {layout}, got shape {tuple(t.shape)}")
    return t


def contiguous_last(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy contiguous in its last (head) dimension when it is not (flash_attn's
    ``maybe_contiguous``): for tensors that are only read. Autograd carries gradients through the copy."""
    return t.contiguous() if t.shape[-1] > 1 and t.stride(-1) != 1 else t


def check_inputs(
    named: dict[str, torch.Tensor], in_place: tuple[str, ...] = (), fp8: bool = False
) -> tuple[torch.dtype, torch.device]:
    """Dtype and device checks shared by q, k, v (and their packed forms, and the caches). Tensors only
    read may have any strides (the caller copies them with ``contiguous_last``); those named in
    ``in_place`` are written and must be contiguous in their last dimension, as flash_attn requires
    (a copy would hide the write from the caller). ``fp8``: float8_e4m3fn is allowed too (its caller
    has checked the descales, ``tileattn.fp8``)."""
    (first_name, first), *rest = named.items()
    for name in in_place:
        t = named[name]
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise InvalidArgument(
                f"{name} is written in place and must be contiguous in its last (head) dimension, got strides "
                f"{tuple(t.stride())} (flash_attn requires this too)"
            )
    for name, t in named.items():
        if fp8 and t.dtype == torch.float8_e4m3fn:
            continue
        if t.dtype not in _CPU_DTYPES:
            raise InvalidArgumentType(f"{name} must be float16 or bfloat16 (or float32 on CPU), got {t.dtype}")
        if t.dtype not in _GPU_DTYPES and t.is_cuda:
            raise InvalidArgumentType(
                f"{name} is a CUDA tensor of dtype {t.dtype}; on CUDA only float16 and bfloat16 are supported"
            )
    for name, t in rest:
        if t.dtype != first.dtype and not (fp8 and torch.float8_e4m3fn in (t.dtype, first.dtype)):
            raise InvalidArgumentType(
                f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; all inputs must share one dtype"
            )
        if t.device != first.device:
            raise InvalidArgument(
                f"{name} is on {t.device} but {first_name} is on {first.device}; all inputs must share one device"
            )
    return first.dtype, first.device


def check_heads(
    nheads: int, nheads_k: int, headdim: int, headdim_k: int, headdim_v: int, names: tuple[str, ...] = ("q", "k", "v")
) -> None:
    """Head counts and head dims of the caller's arguments ``names`` (query, key, value: e.g. k_cache)."""
    q, k, v = names
    if nheads < 1 or nheads_k < 1:
        raise InvalidArgument(
            f"nheads ({q}'s heads) and nheads_k ({k}'s) must be at least 1, got nheads={nheads}, nheads_k={nheads_k}"
        )
    if nheads % nheads_k != 0:
        raise InvalidArgument(
            f"nheads ({nheads}, {q}'s heads) must be divisible by nheads_k ({nheads_k}, {k}'s) for MQA/GQA"
        )
    if headdim_k != headdim or headdim_v != headdim:
        raise InvalidArgument(f"{q}, {k} and {v} must share the head dim, got {headdim}, {headdim_k}, {headdim_v}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise InvalidArgument(f"headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")


_INT32_LIMIT = 2**31
# CUDA grids hold at most 65,535 programs along y and z: the decode kernels run batches along z
# (attention's forward and backward run larger batches as packed ones, ``kernels.forward``).
MAX_DENSE_BATCH = 65535


def check_extent(seqlen: int, named: dict[str, torch.Tensor]) -> None:
    """The kernels address rows within one sequence with 32-bit offsets (batch and sequence starts are
    64-bit), so one sequence's span of a tensor must stay below 2**31 elements."""
    for name, t in named.items():
        span = seqlen * t.stride(-3)
        if span >= _INT32_LIMIT:
            raise NotImplementedError(
                f"{name}: one sequence spans {span} elements (seqlen {seqlen} x row stride {t.stride(-3)}); "
                f"the kernels support fewer than 2**31 per sequence"
            )


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks shared by the dense and varlen layouts: dtypes and devices (float8_e4m3fn too with ``fp8``),
    k and v alike, head counts and head dims (the last two dims of every layout). Returns q, k, v
    contiguous in their last dimension (copied where they are not, as flash_attn does)."""
    check_inputs({"q": q, "k": k, "v": v}, fp8=fp8)
    if k.shape != v.shape:
        raise InvalidArgument(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_heads(q.shape[-2], k.shape[-2], q.shape[-1], k.shape[-1], v.shape[-1])
    return contiguous_last(q), contiguous_last(k), contiguous_last(v)


def is_real(x: object) -> bool:
    t = type(x)  # float and int first: the ABC check costs a microsecond on every call
    return t is float or t is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def is_int(x: object) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _integer_dtype(t: object) -> bool:
    """A torch tensor or NumPy array of integers (not bools)."""
    if isinstance(t, torch.Tensor):
        return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
    kind = getattr(getattr(t, "dtype", None), "kind", None)  # NumPy, without importing it
    return type(t).__module__ == "numpy" and kind in ("i", "u")


def check_window(window_size: object) -> tuple[int, int]:
    """``window_size`` as two Python ints ``(left, right)``, each >= -1. Any pair of integers is taken, as
    flash_attn takes it: a tuple or list of two ints, NumPy integers or 0-d integer tensors, or a 1-D
    integer tensor or array of two (flash_attn's own tests draw it with ``torch.randint``); bools, floats
    and anything else are refused."""
    pair = window_size
    if type(pair) is not tuple or len(pair) != 2 or type(pair[0]) is not int or type(pair[1]) is not int:
        if _integer_dtype(pair) and pair.ndim == 1 and pair.shape[0] == 2:
            pair = pair.tolist()  # (a CUDA tensor: a device read)
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidArgument(f"window_size must be a pair of ints (left, right), got {window_size!r}")
        ints = []
        for w in pair:
            if _integer_dtype(w) and w.ndim == 0:
                w = w.item()
            if not is_int(w):
                raise InvalidArgument(f"window_size must be a pair of ints (left, right), got {window_size!r}")
            ints.append(int(w))
        pair = tuple(ints)
    left, right = pair
    if left < -1 or right < -1:
        raise InvalidArgument(f"window_size entries must be >= -1 (-1 = unbounded), got {pair}")
    return left, right


def check_options(
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
    if not is_real(dropout_p) or not 0.0 <= float(dropout_p) < 1.0:
        raise InvalidArgument(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is not None and (not is_real(softmax_scale) or not math.isfinite(float(softmax_scale))):
        raise InvalidArgumentType(f"softmax_scale must be None or a finite real number, got {softmax_scale!r}")
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise InvalidArgumentType(f"{name} must be a bool, got {flag!r}")
    left, right = check_window(window_size)
    if not is_real(softcap) or not math.isfinite(float(softcap)) or softcap < 0:
        raise InvalidArgument(f"softcap must be a finite float >= 0 (0 disables it), got {softcap!r}")
    left, right = reference.causal_window(causal, (left, right), seqlen_k)
    scale = None if softmax_scale is None else float(softmax_scale)
    return float(dropout_p), scale, left, right, float(softcap)


def check_alibi(alibi_slopes: object, batch: int, nheads: int, device: torch.device) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise InvalidArgumentType(f"alibi_slopes must be None or a float32 tensor, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise InvalidArgumentType(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise InvalidArgument(
            f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device != device:
        raise InvalidArgument(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    return alibi_slopes.contiguous()


def check_sink(learnable_sink: object, s_aux: object, nheads: int, device: torch.device) -> torch.Tensor | None:
    """The attention sinks of a call: ``learnable_sink`` or its other name ``s_aux`` (vLLM's FlashAttention-3,
    Hugging Face's models), a floating ``(nheads,)`` tensor on q's device, as fp32 contiguous (a gradient
    flows back through the conversion), or None."""
    if learnable_sink is not None and s_aux is not None:
        raise InvalidArgument("pass learnable_sink or s_aux (two names of the same attention sinks), not both")
    name, sink = ("s_aux", s_aux) if s_aux is not None else ("learnable_sink", learnable_sink)
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        raise InvalidArgumentType(
            f"{name} must be None or a float32 tensor of shape (nheads,), got {type(sink).__name__}"
        )
    if not sink.dtype.is_floating_point or sink.dtype.itemsize == 1:
        raise InvalidArgumentType(
            f"{name} must be float32 (or float16, bfloat16, float64: converted), got {sink.dtype}"
        )
    if tuple(sink.shape) != (nheads,):
        raise InvalidArgument(f"{name} must have shape (nheads,) = ({nheads},), got {tuple(sink.shape)}")
    if sink.device != device:
        raise InvalidArgument(f"{name} is on {sink.device} but q is on {device}")
    return sink.float().contiguous()


def check_cu_seqlens(name: str, cu: object, max_name: str, max_seqlen: object, device: torch.device) -> None:
    """cu_seqlens must be an int32 (batch + 1,) tensor on q's device and max_seqlen an int. Their values
    are checked by ``cu_values`` where the kernels run (tracing sees no values)."""
    if not isinstance(cu, torch.Tensor):
        raise InvalidArgumentType(f"{name} must be an int32 tensor of shape (batch + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise InvalidArgumentType(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise InvalidArgument(f"{name} must be 1-D of shape (batch + 1,), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise InvalidArgument(f"{name} is on {cu.device} but q is on {device}")
    # flash_attn takes a 0-dim integer tensor too (transformers passes ``cu_seqlens.diff().max()``)
    scalar_tensor = isinstance(max_seqlen, torch.Tensor) and max_seqlen.dim() == 0 and _integer_dtype(max_seqlen)
    if not (is_int(max_seqlen) or scalar_tensor):
        raise InvalidArgumentType(f"{max_name} must be an int or a 0-dim integer tensor, got {max_seqlen!r}")


class CheckedOnce:
    """Results of host-side value checks (each one a device sync), or of other work derived from tensors
    (FlashMask schedules), remembered per set of tensors.

    A model passes the same cu_seqlens, cache_seqlens and block_table to every layer: reading them on
    the host once per tensor instead of once per call keeps the launches queued ahead of the GPU. An
    entry is keyed by the tensors' identities and the check's other arguments, and holds while every
    tensor is alive and unmodified (PyTorch's version counter): changes through torch ops are checked
    again. Inference tensors have no version counter and are checked on every call; writes that bypass
    the counter (``.data``, ``.numpy()``, DLPack aliases, a custom kernel, a CUDA graph's replay) are not
    seen, as documented on flash_attn_varlen_func and flash_attn_with_kvcache. ``runs`` counts the
    checks actually run (the host reads)."""

    def __init__(self, limit: int = 256) -> None:
        self._seen: dict[tuple, tuple] = {}
        self._limit = limit
        self.runs = 0

    def __len__(self) -> int:
        return len(self._seen)

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
        self.runs += 1
        if any(t.is_inference() for t in present):
            return check()
        result = check()
        self._seen.pop(key, None)
        entry = ([weakref.ref(t) for t in present], [t._version for t in present], result)
        remember(self._seen, key, entry, self._limit)  # the oldest go (never the one just checked)
        return result


checked_once = CheckedOnce()


def cu_values(name: str, cu: torch.Tensor, total: int | None, max_name: str, max_seqlen: int) -> list[int]:
    """cu_seqlens must start at 0, never decrease and end at most at the token count (``total``, if given;
    rows past the end are padding, as flash_attn allows); max_seqlen must cover every sequence. Returns the lengths (read on the host once per unmodified
    tensor: ``checked_once``)."""
    return checked_once(
        (cu,), ("cu_seqlens", total, max_seqlen), lambda: cu_lengths(name, cu, total, max_name, max_seqlen)
    )


def cu_tokens(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> tuple[int, int]:
    """``cu_values`` of a packed call's two cu_seqlens at once (one lookup for both), as the query and key
    rows their sequences use: ``(cu_seqlens_q[-1], cu_seqlens_k[-1])``."""

    def check() -> tuple[int, int]:
        lengths_q = cu_lengths("cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q)
        lengths_k = cu_lengths("cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k)
        return sum(lengths_q), sum(lengths_k)

    args = ("cu_tokens", total_q, total_k, max_seqlen_q, max_seqlen_k)
    return checked_once((cu_seqlens_q, cu_seqlens_k), args, check)


def cu_lengths(name: str, cu: torch.Tensor, total: int | None, max_name: str, max_seqlen: int) -> list[int]:
    values = cu.tolist()
    if values[0] != 0:
        raise InvalidArgument(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise InvalidArgument(f"{name} must be non-decreasing, got {values}")
    if total is not None and values[-1] > total:
        raise InvalidArgument(f"{name}[-1] must be at most the number of tokens ({total}), got {values[-1]}")
    if lengths and max(lengths) > max_seqlen:
        raise InvalidArgument(f"{max_name} ({max_seqlen}) is smaller than the longest sequence ({max(lengths)})")
    return lengths


def resolve_scale(softmax_scale: float | None, headdim: int) -> float:
    """The softmax scale a call uses: ``softmax_scale``, or ``1 / sqrt(headdim)`` when it is None."""
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def check_int32(name: str, t: object, shape: tuple[int, ...], layout: str, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentType(f"{name} must be an int32 tensor of shape {layout}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InvalidArgumentType(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise InvalidArgument(f"{name} must have shape {layout} = {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgument(f"{name} is on {t.device} but q is on {device}")
    return t.contiguous()


def check_table(block_table: object, batch: int, num_pages: int, device: torch.device) -> torch.Tensor:
    if isinstance(block_table, torch.Tensor) and block_table.dim() != 2:
        raise InvalidArgument(f"block_table must be 2-D (batch, max_pages), got shape {tuple(block_table.shape)}")
    max_pages = block_table.shape[1] if isinstance(block_table, torch.Tensor) else 0
    table = check_int32("block_table", block_table, (batch, max_pages), "(batch, max_pages)", device)
    if num_pages == 0 and table.numel() > 0:  # (no entry could be valid; the kernels clamp to the pool)
        raise InvalidArgument(f"k_cache holds no pages (shape[0] == 0) for a block_table of {max_pages} columns")
    return table


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentType(f"{name} must be a bool, got {value!r}")


def check_grad_inputs(
    dout: object, out: object, softmax_lse: object, q: torch.Tensor, lse_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's results handed to a backward (flash_attn's ``_flash_attn_backward``): dout and out
    shaped and typed as q, softmax_lse fp32 of ``lse_shape``. Returns dout and out contiguous in their
    last dimension and softmax_lse contiguous (each copied if need be)."""
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentType(f"{name} must be a torch.Tensor shaped like q, got {type(t).__name__}")
        _check_like(name, t, "q", q)
    lse = softmax_lse
    if not isinstance(lse, torch.Tensor):
        raise InvalidArgumentType(
            f"softmax_lse must be a float32 tensor of shape {lse_shape}, got {type(lse).__name__}"
        )
    if tuple(lse.shape) != tuple(lse_shape):
        raise InvalidArgument(f"softmax_lse must have shape {tuple(lse_shape)}, got {tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise InvalidArgumentType(f"softmax_lse must be float32 (as the forward returns it), got {lse.dtype}")
    if lse.device != q.device:
        raise InvalidArgument(f"softmax_lse is on {lse.device} but q is on {q.device}")
    return contiguous_last(dout), contiguous_last(out), lse.contiguous()


def check_grad_buffer(name: str, buf: object, like_name: str, like: torch.Tensor) -> None:
    """A caller's gradient buffer (dq, dk, dv) that the backward writes in place: None (nothing written)
    or a tensor of ``like``'s shape, dtype and device, any strides."""
    if buf is None:
        return
    if not isinstance(buf, torch.Tensor):
        raise InvalidArgumentType(f"{name} must be None or a tensor shaped like {like_name}, got {type(buf).__name__}")
    _check_like(name, buf, like_name, like)


def _check_like(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """``t`` has ``like``'s shape, dtype and device."""
    if t.shape != like.shape:
        raise InvalidArgument(f"{name} must have {like_name}'s shape {tuple(like.shape)}, got {tuple(t.shape)}")
    if t.dtype != like.dtype:
        raise InvalidArgumentType(f"{name} must have {like_name}'s dtype {like.dtype}, got {t.dtype}")
    if t.device != like.device:
        raise InvalidArgument(f"{name} is on {t.device} but {like_name} is on {like.device}")


def check_rng_state(rng_state: object, dropout_p: float) -> torch.Tensor | None:
    """The ``rng_state`` a forward returned (int64 ``(2,)``: the dropout seed and offset), needed by a
    backward with dropout to regenerate the forward's mask. None is allowed without dropout."""
    if rng_state is None:
        if dropout_p > 0:
            raise InvalidArgument(
                "rng_state is required with dropout_p > 0: pass the rng_state the forward returned, from which "
                "the backward regenerates the forward's dropout mask"
            )
        return None
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,):
        got = (
            f"{rng_state.dtype} of shape {tuple(rng_state.shape)}"
            if isinstance(rng_state, torch.Tensor)
            else type(rng_state).__name__
        )
        raise InvalidArgumentType(f"rng_state must be the int64 tensor of shape (2,) the forward returned, got {got}")
    return rng_state


def key_spans(
    lengths: list[int], leftpad_k: object, seqused_k: object, batch: int, device: torch.device
) -> list[tuple[int, int]]:
    """The keys a packed call reads of each sequence with ``leftpad_k`` / ``seqused_k`` (int32
    ``(batch,)``, as flash_attn's varlen forward takes them): positions ``[leftpad_k[b], seqused_k[b])``
    of sequence b's ``lengths[b]`` keys (seqused_k defaults to the length, leftpad_k to 0). Returns
    ``(start, length)`` within each sequence; reads the values on the host."""
    pads = [0] * batch
    used = list(lengths)
    if leftpad_k is not None:
        pads = check_int32("leftpad_k", leftpad_k, (batch,), "(batch,)", device).tolist()
    if seqused_k is not None:
        used = check_int32("seqused_k", seqused_k, (batch,), "(batch,)", device).tolist()
    for b, (pad, end, n) in enumerate(zip(pads, used, lengths)):
        if not 0 <= end <= n:
            raise InvalidArgument(
                f"seqused_k[{b}] = {end} must be in [0, {n}], the length of sequence {b} in cu_seqlens_k"
            )
        if not 0 <= pad <= end:
            raise InvalidArgument(f"leftpad_k[{b}] = {pad} must be in [0, {end}] (the keys sequence {b} uses)")
    return [(pad, end - pad) for pad, end in zip(pads, used)]


def check_rotary(cos: object, sin: object, q: torch.Tensor, has_new: bool) -> None:
    if cos is None and sin is None:
        return
    if cos is None or sin is None:
        raise InvalidArgument("rotary_cos and rotary_sin must be given together")
    if not has_new:
        raise InvalidArgument(
            "rotary_cos/rotary_sin rotate the new tokens at their cache positions: pass k and v with them "
            "(rotate q yourself with tileattn.rotary.apply_rotary_emb when nothing is appended)"
        )
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise InvalidArgument(f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2)")
        if t.dtype not in (q.dtype, torch.float32):
            raise InvalidArgumentType(f"{name} must have q's dtype ({q.dtype}) or float32, got {t.dtype}")
        if t.device != q.device:
            raise InvalidArgument(f"{name} is on {t.device} but q is on {q.device}")
    if cos.shape != sin.shape:
        raise InvalidArgument(
            f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if cos.shape[0] == 0:
        raise InvalidArgument("rotary_cos and rotary_sin have no rows (seqlen_ro = 0): they need a row per position")
    rotary_dim = 2 * cos.shape[1]
    if not 2 <= rotary_dim <= q.shape[-1]:
        raise InvalidArgument(
            f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be between 2 and the head dim ({q.shape[-1]})"
        )


def first_bad(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


_CAPACITY = "(seqlen of k_cache, or block_table.shape[1] * page_block_size)"
_ROTARY_SPAN = "(cache_seqlens + the new tokens, or + the query tokens when q rotates per token and is longer)"


def index_message(
    code: int, b: int, j: int, value: int, bound: int, extra: int, seqlens_name: str = "cache_seqlens"
) -> str:
    """What is wrong with an index value, in the same words whether the host found it (``cache_values``)
    or a kernel (``tileattn.errors``): ``code`` one of ``params.ERR_*``, ``b`` the batch entry and the
    other fields as the error record's words say."""
    if code == params.ERR_SEQLENS_NEGATIVE:
        return f"{seqlens_name} must be >= 0, got {value} at batch entry {b}"
    if code == params.ERR_SEQLENS_CAPACITY:
        return f"{seqlens_name}[{b}] + seqlen_new = {value} + {extra} exceeds the cache capacity {bound} {_CAPACITY}"
    if code == params.ERR_LEFTPAD:
        return f"cache_leftpad must be in [0, cache_seqlens], got {value} with cache_seqlens {extra} at batch entry {b}"
    if code == params.ERR_BATCH_IDX:
        return f"cache_batch_idx must be in [0, {bound}), got {value} at batch entry {b}"
    if code == params.ERR_BATCH_IDX_REPEATED:
        return (
            f"cache_batch_idx[{b}] = {value} repeats an earlier entry (batch entry {j}): with new k and v each "
            "batch entry must append into a cache row of its own"
        )
    if code == params.ERR_BLOCK_TABLE:
        return (
            f"block_table[{b}, {j}] = {value} is not a page of the cache: entries covering a sequence's keys must "
            f"be in [0, {bound})"
        )
    if code == params.ERR_ROTARY:
        return (
            f"rotary_cos/rotary_sin have {bound} positions but position {value} is needed at batch entry {b} "
            + _ROTARY_SPAN
        )
    return f"unknown check {code} failed at batch entry {b} (j {j}, value {value}, bound {bound}, extra {extra})"


def cache_values(
    seqlens: torch.Tensor,
    seqlen_new: int,
    capacity: int,
    leftpad: torch.Tensor | None,
    batch_idx: torch.Tensor | None,
    batch_cache: int,
    block_table: torch.Tensor | None,
    num_pages: int,
    page_size: int,
    rotary_len: int | None,
    rotary_span: int,
    seqlens_name: str = "cache_seqlens",
) -> int:
    """Device-side index values against their bounds, read back in one transfer (a device sync); returns
    the longest key range (seqlens + seqlen_new). Messages name the first offending batch entry. The
    kernels make the same checks where they read the values when the call defers them (``tileattn.errors``)."""
    ends = seqlens.long() + seqlen_new
    checks = [seqlens.min(), ends.max()]
    if leftpad is not None:
        checks.append(((leftpad < 0) | (leftpad > seqlens)).any())
    if batch_idx is not None:
        checks.append(((batch_idx < 0) | (batch_idx >= batch_cache)).any())
        if seqlen_new:  # two entries appending into one cache row would race for it
            rows = batch_idx.sort().values
            checks.append((rows[1:] == rows[:-1]).any())
    if block_table is not None:
        used = torch.arange(block_table.shape[1], device=seqlens.device) < (ends + page_size - 1).div(
            page_size, rounding_mode="floor"
        ).unsqueeze(1)
        bad_pages = used & ((block_table < 0) | (block_table >= num_pages))
        checks.append(bad_pages.any())
    values = torch.stack([c.long() for c in checks]).tolist()
    lowest, longest = values[0], values[1]
    flags = iter(values[2:])

    def refuse(code, b, j=0, value=0, bound=0, extra=0):
        return InvalidArgument(index_message(code, b, j, value, bound, extra, seqlens_name))

    if lowest < 0:
        b = first_bad(seqlens < 0)
        raise refuse(params.ERR_SEQLENS_NEGATIVE, b, value=int(seqlens[b]))
    if longest > capacity:
        b = first_bad(ends > capacity)
        raise refuse(params.ERR_SEQLENS_CAPACITY, b, value=int(seqlens[b]), bound=capacity, extra=seqlen_new)
    if leftpad is not None and next(flags):
        b = first_bad((leftpad < 0) | (leftpad > seqlens))
        raise refuse(params.ERR_LEFTPAD, b, value=int(leftpad[b]), extra=int(seqlens[b]))
    if batch_idx is not None and next(flags):
        b = first_bad((batch_idx < 0) | (batch_idx >= batch_cache))
        raise refuse(params.ERR_BATCH_IDX, b, value=int(batch_idx[b]), bound=batch_cache)
    if batch_idx is not None and seqlen_new and next(flags):
        rows = batch_idx.tolist()
        b = next(i for i, row in enumerate(rows) if row in rows[:i])
        raise refuse(params.ERR_BATCH_IDX_REPEATED, b, j=rows.index(rows[b]), value=rows[b])
    if block_table is not None and next(flags):
        b, j = (int(x) for x in bad_pages.nonzero()[0])
        raise refuse(params.ERR_BLOCK_TABLE, b, j=j, value=int(block_table[b, j]), bound=num_pages)
    if rotary_len is not None and lowest >= 0 and longest - seqlen_new + rotary_span > rotary_len:
        b = first_bad(seqlens.long() + rotary_span > rotary_len)
        raise refuse(params.ERR_ROTARY, b, value=int(seqlens[b]) + rotary_span - 1, bound=rotary_len)
    return longest


def known_cache_values(
    seqlens: list[int], seqlen_new: int, capacity: int, rotary_len: int | None, rotary_span: int, seqlens_name: str
) -> int:
    """``cache_values``' checks of lengths known on the host (an int cache_seqlens, the lengths of
    cu_seqlens_k): no device read. Returns the longest key range."""
    longest = max(seqlens, default=0)
    reach = longest + max(seqlen_new, rotary_span if rotary_len is not None else 0)
    if min(seqlens, default=0) >= 0 and reach <= min(capacity, rotary_len if rotary_len is not None else capacity):
        return longest + seqlen_new
    for b, n in enumerate(seqlens):
        if n < 0:
            raise InvalidArgument(index_message(params.ERR_SEQLENS_NEGATIVE, b, 0, n, 0, 0, seqlens_name))
        if n + seqlen_new > capacity:
            message = index_message(params.ERR_SEQLENS_CAPACITY, b, 0, n, capacity, seqlen_new, seqlens_name)
            raise InvalidArgument(message)
        if rotary_len is not None and n + rotary_span > rotary_len:
            message = index_message(params.ERR_ROTARY, b, 0, n + rotary_span - 1, rotary_len, 0, seqlens_name)
            raise InvalidArgument(message)
    return max(seqlens, default=0) + seqlen_new


def check_startend_row_indices(
    idx: object, causal: bool, lead: tuple[int, ...], seqlen_k: int, nheads: int, layout: str, device: torch.device
) -> torch.Tensor:
    """FlashMask's ``startend_row_indices`` (metadata only; values: ``flashmask_values``): int32 of shape
    ``(*lead, 1 or nheads, seqlen_k, C)`` (``layout``) on q's device, with C = 1 (causal only), 2 or 4
    (not causal: causal already hides the upper triangle)."""
    if not isinstance(idx, torch.Tensor):
        raise InvalidArgumentType(
            f"startend_row_indices must be an int32 tensor of shape {layout}, got {type(idx).__name__}"
        )
    if idx.dtype != torch.int32:
        raise InvalidArgumentType(f"startend_row_indices must be int32, got {idx.dtype}")
    rank = len(lead) + 3
    if idx.dim() != rank or idx.shape[-1] not in (1, 2, 4):
        raise InvalidArgument(
            f"startend_row_indices must have shape {layout} with C in (1, 2, 4), got {tuple(idx.shape)}"
        )
    if tuple(idx.shape[:-3]) != lead or idx.shape[-3] not in (1, nheads) or idx.shape[-2] != seqlen_k:
        want = ", ".join([*map(str, lead), f"1 or {nheads}", str(seqlen_k), "C"])
        raise InvalidArgument(f"startend_row_indices must have shape {layout} = ({want}), got {tuple(idx.shape)}")
    columns = idx.shape[-1]
    if columns == 1 and not causal:
        raise InvalidArgument(
            "startend_row_indices with C = 1 (rows i >= LTS hidden) needs causal=True; use C = 2 or 4"
        )
    if columns == 4 and causal:
        raise InvalidArgument(
            "startend_row_indices with C = 4 needs causal=False (causal already hides the upper triangle: use C = 2)"
        )
    if idx.device != device:
        raise InvalidArgument(f"startend_row_indices is on {idx.device} but q is on {device}")
    return idx


def flashmask_pairs(columns: int, causal: bool) -> list[tuple[int, int, str, str]]:
    """The ``[start, end)`` pairs of mode (``columns``, ``causal``) whose start must not pass the end."""
    pairs = [(0, 1, "LTS", "LTE")] if columns == 4 or (columns == 2 and causal) else []
    return pairs + ([(2, 3, "UTS", "UTE")] if columns == 4 else [])


def flashmask_summary(idx: torch.Tensor, causal: bool) -> list[int]:
    """``[low, high, bad_lower, bad_upper]`` of ``startend_row_indices`` in one host read: its least and
    greatest value and, per pair of ``flashmask_pairs`` (lower, upper), the first flat column (row of
    ``idx.reshape(-1, C)``) whose start passes its end, or -1 (also for a pair the mode has not)."""
    flat = idx.reshape(-1, idx.shape[-1])
    found = [flat.min(), flat.max()]
    for start, end, _, _ in flashmask_pairs(idx.shape[-1], causal):
        bad = flat[:, start] > flat[:, end]
        found.append(torch.where(bad.any(), bad.int().argmax(), -1))
    found += [flat.new_tensor(-1)] * (4 - len(found))
    return torch.stack([f.long() for f in found]).tolist()


def flashmask_values(idx: torch.Tensor, causal: bool, seqlen_q: int, summary: list[int] | None = None) -> None:
    """Every bound of ``startend_row_indices`` in [0, seqlen_q] (``seqlen_q``: max_seqlen_q in varlen
    calls), and each interval's start at most its end (LTS <= LTE for C = 2 causal and C = 4, UTS <= UTE for
    C = 4), from ``summary`` (``flashmask_summary``'s numbers, which the kernels' conversion also gives:
    ``kernels.flashmask.canonical``) or, without one, read on the host (one read)."""
    if idx.numel() == 0:
        return
    low, high, *bad = flashmask_summary(idx, causal) if summary is None else summary
    if low < 0 or high > seqlen_q:
        raise InvalidArgument(
            f"startend_row_indices must hold query rows in [0, seqlen_q] = [0, {seqlen_q}], got values from "
            f"{low} to {high}"
        )
    flat = idx.reshape(-1, idx.shape[-1])
    for (start, end, start_name, end_name), at in zip(flashmask_pairs(idx.shape[-1], causal), bad):
        if at >= 0:
            raise InvalidArgument(
                f"startend_row_indices: {start_name} must be at most {end_name} in every key column, got "
                f"{int(flat[at, start])} > {int(flat[at, end])} at flat column {at}"
            )
