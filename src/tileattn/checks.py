"""Every check of the public functions' arguments, in one place: each message names the argument and
what is allowed. Metadata checks (shapes, dtypes, devices, options) run in the API layer, where tracing
sees them; checks of index *values* (cu_seqlens, cache_seqlens, block tables), which read the device,
run in the ops layer before any kernel, once per unmodified tensor (``checked_once``).
"""

from __future__ import annotations

import math
import numbers
import weakref

import torch

from tileattn import reference, rng
from tileattn.params import remember

MAX_HEADDIM = 256
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t: object, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    rank = layout.count(",") + 1
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(t.shape)}")
    return t


def check_inputs(named: dict[str, torch.Tensor]) -> tuple[torch.dtype, torch.device]:
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


def check_heads(nheads: int, nheads_k: int, headdim: int, headdim_k: int, headdim_v: int) -> None:
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


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Checks shared by the dense and varlen layouts: dtypes, devices and strides, k and v alike, head
    counts and head dims (the last two dims of every layout)."""
    check_inputs({"q": q, "k": k, "v": v})
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_heads(q.shape[-2], k.shape[-2], q.shape[-1], k.shape[-1], v.shape[-1])


def is_real(x: object) -> bool:
    t = type(x)  # float and int first: the ABC check costs a microsecond on every call
    return t is float or t is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def is_int(x: object) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


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
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is not None and (not is_real(softmax_scale) or not math.isfinite(float(softmax_scale))):
        raise TypeError(f"softmax_scale must be None or a finite real number, got {softmax_scale!r}")
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(is_int(w) for w in window_size):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if not is_real(softcap) or not math.isfinite(float(softcap)) or softcap < 0:
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


def check_alibi(alibi_slopes: object, batch: int, nheads: int, device: torch.device) -> torch.Tensor | None:
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


def check_cu_seqlens(name: str, cu: object, max_name: str, max_seqlen: object, device: torch.device) -> None:
    """cu_seqlens must be an int32 (batch + 1,) tensor on q's device and max_seqlen an int. Their values
    are checked by ``cu_values`` where the kernels run (tracing sees no values)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape (batch + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of shape (batch + 1,), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if not is_int(max_seqlen):
        raise TypeError(f"{max_name} must be an int, got {max_seqlen!r}")


class CheckedOnce:
    """Results of host-side value checks (each one a device sync), remembered per set of tensors.

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
    """cu_seqlens must start at 0, never decrease and end at the token count (``total``, if given);
    max_seqlen must cover every sequence. Returns the lengths (read on the host once per unmodified
    tensor: ``checked_once``)."""
    return checked_once(
        (cu,), ("cu_seqlens", total, max_seqlen), lambda: cu_lengths(name, cu, total, max_name, max_seqlen)
    )


def cu_lengths(name: str, cu: torch.Tensor, total: int | None, max_name: str, max_seqlen: int) -> list[int]:
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


def resolve_scale(softmax_scale: float | None, headdim: int) -> float:
    """The softmax scale a call uses: ``softmax_scale``, or ``1 / sqrt(headdim)`` when it is None."""
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def check_int32(name: str, t: object, shape: tuple[int, ...], layout: str, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape {layout}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t.contiguous()


def check_table(block_table: object, batch: int, num_pages: int, device: torch.device) -> torch.Tensor:
    if isinstance(block_table, torch.Tensor) and block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D (batch, max_pages), got shape {tuple(block_table.shape)}")
    max_pages = block_table.shape[1] if isinstance(block_table, torch.Tensor) else 0
    table = check_int32("block_table", block_table, (batch, max_pages), "(batch, max_pages)", device)
    if num_pages == 0 and table.numel() > 0:  # (no entry could be valid; the kernels clamp to the pool)
        raise ValueError(f"k_cache holds no pages (shape[0] == 0) for a block_table of {max_pages} columns")
    return table


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_rotary(cos: object, sin: object, q: torch.Tensor, has_new: bool) -> None:
    if cos is None and sin is None:
        return
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if not has_new:
        raise ValueError(
            "rotary_cos/rotary_sin rotate the new tokens at their cache positions: pass k and v with them "
            "(rotate q yourself with tileattn.rotary.apply_rotary_emb when nothing is appended)"
        )
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2)")
        if t.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must have q's dtype ({q.dtype}) or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if cos.shape[0] == 0:
        raise ValueError("rotary_cos and rotary_sin have no rows (seqlen_ro = 0): they need a row per position")
    rotary_dim = 2 * cos.shape[1]
    if not 2 <= rotary_dim <= q.shape[-1]:
        raise ValueError(
            f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be between 2 and the head dim ({q.shape[-1]})"
        )


def first_bad(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


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
    """Device-side index values against their bounds, read back in one transfer; returns the longest
    key range (seqlens + seqlen_new). Messages name the first offending batch entry."""
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
    if lowest < 0:
        b = first_bad(seqlens < 0)
        raise ValueError(f"{seqlens_name} must be >= 0, got {int(seqlens[b])} at batch entry {b}")
    if longest > capacity:
        b = first_bad(ends > capacity)
        raise ValueError(
            f"{seqlens_name}[{b}] + seqlen_new = {int(seqlens[b])} + {seqlen_new} exceeds the cache capacity "
            f"{capacity} (seqlen of k_cache, or block_table.shape[1] * page_block_size)"
        )
    if leftpad is not None and next(flags):
        b = first_bad((leftpad < 0) | (leftpad > seqlens))
        raise ValueError(
            f"cache_leftpad must be in [0, cache_seqlens], got {int(leftpad[b])} with cache_seqlens "
            f"{int(seqlens[b])} at batch entry {b}"
        )
    if batch_idx is not None and next(flags):
        b = first_bad((batch_idx < 0) | (batch_idx >= batch_cache))
        raise ValueError(f"cache_batch_idx must be in [0, {batch_cache}), got {int(batch_idx[b])} at batch entry {b}")
    if batch_idx is not None and seqlen_new and next(flags):
        rows = batch_idx.tolist()
        b = next(i for i, row in enumerate(rows) if row in rows[:i])
        raise ValueError(
            f"cache_batch_idx[{b}] = {rows[b]} repeats an earlier entry: with new k and v each batch entry "
            "must append into a cache row of its own"
        )
    if block_table is not None and next(flags):
        b, j = (int(x) for x in bad_pages.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache: entries covering "
            f"a sequence's keys must be in [0, {num_pages})"
        )
    if rotary_len is not None and lowest >= 0 and longest - seqlen_new + rotary_span > rotary_len:
        raise ValueError(
            f"rotary_cos/rotary_sin have {rotary_len} positions but position "
            f"{longest - seqlen_new + rotary_span - 1} is needed (cache_seqlens + the new tokens, or + the "
            "query tokens when q rotates per token and is longer)"
        )
    return longest
