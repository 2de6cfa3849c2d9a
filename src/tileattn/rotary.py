"""Rotary position embedding (RoPE): ``flash_attn.layers.rotary`` and ``flash_attn.ops.triton.rotary``
(flash_attn 2.8.3's names, argument order, defaults and returns).

``cos``/``sin`` are tables ``(seqlen_ro, rotary_dim / 2)``: entry ``[t, f]`` is the angle of frequency f
at position t. The first ``rotary_dim`` channels of each head rotate, the rest pass through. Interleaved
(GPT-J) style pairs channels (0, 1), (2, 3), ...; non-interleaved (GPT-NeoX) style pairs channel f with
f + rotary_dim / 2. A pair (x0, x1) becomes ``(x0·cos - x1·sin, x0·sin + x1·cos)``, computed in fp32 and
rounded once to x's dtype. CUDA tensors run a Triton kernel (``tileattn.kernels.rotary``), CPU tensors
the PyTorch path (``tileattn.rotary_torch``), or the kernel under Triton's interpreter (fp16, with
``TRITON_INTERPRET=1``); both give the same bits. The backward is the conjugate rotation (by -sin); no
gradient flows to cos/sin (as in flash_attn).

Beyond flash_attn: bad arguments raise ``tileattn.checks.InvalidArgument`` (a ValueError;
``InvalidArgumentType``, also a TypeError, for types and dtypes) naming them where flash_attn asserts or
reads out of bounds; positions outside the tables are refused (tensor ``seqlen_offsets`` and
``cu_seqlens`` are read on the host once per unmodified tensor for that, not under CUDA graph capture,
where such positions are left unrotated as flash_attn's kernel leaves them); ``apply_rotary`` is
differentiable; in-place calls tell autograd (``mark_dirty``), so a later use of a saved pre-rotation
value raises instead of computing a wrong gradient.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from tileattn.checks import InvalidArgument, InvalidArgumentType
from tileattn.ops import rotary as ops
from tileattn.rotary_torch import rotary_at

__all__ = [
    "ApplyRotaryEmb",
    "ApplyRotaryEmbKV_",
    "ApplyRotaryEmbQKV_",
    "RotaryEmbedding",
    "apply_rotary",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_torch",
    "rotary_at",
    "rotate_half",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(
    x: object,
    cos: object,
    sin: object,
    seqlen_offsets: object,
    cu_seqlens: object,
    max_seqlen: object,
    name: str = "x",
) -> tuple[Tensor | None, int, int]:
    """Validates one rotation's arguments (metadata only: values are the ops' to check); returns
    ``(offsets tensor or None, int offset, max_seqlen as an int, 0 when dense)``."""
    varlen = cu_seqlens is not None
    layout = "(total, nheads, headdim) with cu_seqlens" if varlen else "(batch, seqlen, nheads, headdim)"
    if not isinstance(x, Tensor):
        raise InvalidArgumentType(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != (3 if varlen else 4):
        raise InvalidArgument(f"{name} must be {layout}, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise InvalidArgumentType(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    for tname, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor) or t.dim() != 2:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise InvalidArgument(f"{tname} must be a 2-D tensor (seqlen_ro, rotary_dim / 2), got {got}")
        if t.dtype not in _DTYPES:
            raise InvalidArgumentType(f"{tname} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.device != x.device:
            raise InvalidArgument(f"{tname} is on {t.device} but {name} is on {x.device}")
    if cos.shape != sin.shape:
        raise InvalidArgument(
            f"cos and sin must share a shape (seqlen_ro, rotary_dim / 2), got {cos.shape}, {sin.shape}"
        )
    rotary_dim = 2 * cos.shape[1]
    if not 2 <= rotary_dim <= x.shape[-1]:
        raise InvalidArgument(
            f"rotary_dim = 2 * cos.shape[1] = {rotary_dim} must be between 2 and the head dim ({x.shape[-1]})"
        )
    if varlen:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            got = f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, Tensor) else cu_seqlens
            raise InvalidArgumentType(f"cu_seqlens must be an int32 tensor (batch + 1,), got {got}")
        if cu_seqlens.numel() < 1:
            raise InvalidArgument("cu_seqlens must hold at least one entry (batch + 1,)")
        if cu_seqlens.device != x.device:
            raise InvalidArgument(f"cu_seqlens is on {cu_seqlens.device} but {name} is on {x.device}")
        if not isinstance(max_seqlen, numbers.Integral) or isinstance(max_seqlen, bool):
            raise InvalidArgumentType(
                f"max_seqlen must be an int with cu_seqlens (the longest sequence), got {max_seqlen!r}"
            )
        batch, seqlen = cu_seqlens.numel() - 1, int(max_seqlen)
    else:
        batch, seqlen = x.shape[:2]
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.shape not in ((batch,), ()) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument(
                f"seqlen_offsets must be an int or an int32/int64 tensor (batch,) = ({batch},), got "
                f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}"
            )
        if seqlen_offsets.device != x.device:
            raise InvalidArgument(f"seqlen_offsets is on {seqlen_offsets.device} but {name} is on {x.device}")
        return seqlen_offsets.expand(batch), 0, seqlen if varlen else 0
    if not isinstance(seqlen_offsets, numbers.Integral) or isinstance(seqlen_offsets, bool):
        raise InvalidArgumentType(
            f"seqlen_offsets must be an int or an integer tensor (batch,), got {seqlen_offsets!r}"
        )
    offset = int(seqlen_offsets)
    if seqlen and (offset < 0 or offset + seqlen > cos.shape[0]):
        raise InvalidArgument(
            f"cos/sin have {cos.shape[0]} positions but positions {offset}...{offset + seqlen - 1} are needed "
            f"(seqlen_offsets {offset} + {'max_seqlen' if varlen else 'seqlen'} {seqlen})"
        )
    return None, offset, seqlen if varlen else 0


def _rotate(x, cos, sin, offsets, offset, cu_seqlens, max_seqlen, interleaved, conjugate, inplace) -> Tensor:
    """x rotated by the ops (arguments checked): a new tensor, or x itself if ``inplace``."""
    return ops.run(
        x, cos, sin, offsets, offset, cu_seqlens, max_seqlen, bool(interleaved), bool(conjugate), inplace=inplace
    )


def _writable(name: str, t: object) -> None:
    """An in-place call may not write a leaf that requires grad (PyTorch's rule for its own in-place ops,
    checked here before anything is written)."""
    if isinstance(t, Tensor) and t.is_leaf and t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{name}: a leaf Variable that requires grad is being used in an in-place operation")


class ApplyRotaryEmb(torch.autograd.Function):
    """``apply_rotary_emb`` (and, with ``conjugate``, ``apply_rotary``) with its backward, the rotation by
    the conjugate angle."""

    @staticmethod
    def forward(
        ctx,
        x,
        cos,
        sin,
        interleaved=False,
        inplace=False,
        seqlen_offsets=0,
        cu_seqlens=None,
        max_seqlen=None,
        conjugate=False,
    ):
        offsets, offset, max_len = _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
        out = _rotate(x, cos, sin, offsets, offset, cu_seqlens, max_len, interleaved, conjugate, inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin, cu_seqlens, offsets)
        ctx.options = (offset, max_len, interleaved, conjugate)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        cos, sin, cu_seqlens, offsets = ctx.saved_tensors
        offset, max_len, interleaved, conjugate = ctx.options
        dx = _rotate(dout, cos, sin, offsets, offset, cu_seqlens, max_len, interleaved, not conjugate, False)
        return dx, None, None, None, None, None, None, None, None


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> Tensor:
    """Rotary embedding of the first ``rotary_dim`` channels of x (differentiable in x).

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or packed ``(total, nheads, headdim)`` with cu_seqlens;
            float16, bfloat16 or float32, any strides.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)`` on x's device (float16, bfloat16 or float32), with
            ``2 <= rotary_dim <= headdim``.
        interleaved: rotate pairs of even and odd channels (GPT-J) instead of the first and second
            halves (GPT-NeoX).
        inplace: rotate x in place and return x.
        seqlen_offsets: int, or an int32/int64 tensor ``(batch,)``: token t of sequence b sits at position
            ``seqlen_offsets (+ [b]) + t`` (decoding with a KV cache); every position must be a row of
            the tables.
        cu_seqlens: int32 ``(batch + 1,)``, the sequences of a packed x; None for a dense x.
        max_seqlen: the longest sequence of a packed x (needed with cu_seqlens).

    Returns:
        ``out`` of x's shape and dtype (x itself with ``inplace``).
    """
    if inplace:
        _writable("x", x)
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


# flash_attn's older name
apply_rotary_emb_func = apply_rotary_emb


def apply_rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
) -> Tensor:
    """``flash_attn.ops.triton.rotary.apply_rotary``: the rotation of ``apply_rotary_emb`` with the
    arguments in that function's order, and ``conjugate`` (rotate by -angle, i.e. sin negated). x, cos,
    sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved and inplace as in ``apply_rotary_emb``.
    Returns the rotated ``(batch, seqlen, nheads, headdim)`` (or packed) tensor, x itself with
    ``inplace``. (Differentiable, which flash_attn's kernel call is not.)"""
    if inplace:
        _writable("x", x)
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen, conjugate)


def _qk_heads(qkv: Tensor, num_heads_q: int | None) -> tuple[int, int]:
    """(query heads, key heads) of a packed qkv: ``(batch, seqlen, 3, nheads, headdim)`` or ``(batch,
    seqlen, num_heads_q + 2 * num_heads_k, headdim)``."""
    if not isinstance(qkv, Tensor) or qkv.dim() not in (4, 5):
        got = tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__
        raise InvalidArgument(
            "qkv must be (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, num_heads_q + 2 * num_heads_k, "
            f"headdim), got {got}"
        )
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise InvalidArgument(
                f"qkv (batch, seqlen, 3, nheads, headdim) must have 3 in dim 2, got {tuple(qkv.shape)}"
            )
        return qkv.shape[3], qkv.shape[3]
    if num_heads_q is None:
        raise InvalidArgument(
            "num_heads_q is needed with qkv of shape (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)"
        )
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q < 1 or num_heads_k < 1 or qkv.shape[2] != num_heads_q + 2 * num_heads_k:
        raise InvalidArgument(
            f"qkv has {qkv.shape[2]} heads in dim 2, which is not num_heads_q ({num_heads_q}) + 2 * num_heads_k"
        )
    return num_heads_q, num_heads_k


def _q_and_k(qkv: Tensor, heads_q: int, heads_k: int) -> tuple[Tensor, Tensor]:
    """Views of the queries and keys of a packed qkv, ``(batch, seqlen, heads, headdim)`` each."""
    if qkv.dim() == 5:
        return qkv[:, :, 0], qkv[:, :, 1]
    return qkv[:, :, :heads_q], qkv[:, :, heads_q : heads_q + heads_k]


def _rotate_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, conjugate) -> None:
    """Rotates the queries and keys of ``qkv`` in place (q with cos/sin, k with cos_k/sin_k)."""
    heads_q, heads_k = _qk_heads(qkv, num_heads_q)
    q, k = _q_and_k(qkv, heads_q, heads_k)
    same_tables = cos_k is None and sin_k is None
    qk = None
    if same_tables:  # q and k side by side in memory: one launch over both
        if qkv.dim() == 4:
            qk = qkv[:, :, : heads_q + heads_k]
        elif qkv.stride(2) == qkv.shape[3] * qkv.stride(3):  # (the (2, nheads) dims merge into one view)
            qk = qkv[:, :, :2].flatten(2, 3)
    for x, c, s in ((qk, cos, sin),) if qk is not None else ((q, cos, sin), (k, cos_k, sin_k)):
        c = cos if c is None else c
        s = sin if s is None else s
        offsets, offset, _ = _check(x, c, s, seqlen_offsets, None, None, name="qkv")
        _rotate(x, c, s, offsets, offset, None, 0, interleaved, conjugate, True)


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    """``apply_rotary_emb_qkv_`` with its backward (the conjugate rotation of dq and dk)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None):
        _rotate_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, False)
        ctx.mark_dirty(qkv)
        offsets = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
        ctx.save_for_backward(cos, sin, cos_k, sin_k, offsets)
        ctx.options = (seqlen_offsets if offsets is None else None, interleaved, num_heads_q)
        return qkv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dqkv):
        cos, sin, cos_k, sin_k, offsets = ctx.saved_tensors
        offset, interleaved, num_heads_q = ctx.options
        dqkv = dqkv.clone(memory_format=torch.contiguous_format)  # (the incoming gradient is not ours to write)
        offsets = offset if offsets is None else offsets
        _rotate_qkv_(dqkv, cos, sin, cos_k, sin_k, interleaved, offsets, num_heads_q, True)
        return dqkv, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    cos_k: Tensor | None = None,
    sin_k: Tensor | None = None,
    interleaved: bool = False,
    seqlen_offsets: int | Tensor = 0,
    num_heads_q: int | None = None,
) -> Tensor:
    """Rotary embedding of the queries and keys of a packed qkv, *in place*.

    Args:
        qkv: ``(batch, seqlen, 3, nheads, headdim)``, or ``(batch, seqlen, num_heads_q + 2 * num_heads_k,
            headdim)`` (MQA/GQA, with ``num_heads_q``); the values pass through.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)`` for q (and k when cos_k/sin_k are None).
        cos_k, sin_k: optional tables of the same shape for k (xPos scales q and k differently).
        interleaved, seqlen_offsets: as in ``apply_rotary_emb``.
        num_heads_q: query heads of a 4-D qkv.

    Returns:
        qkv itself, rotated.
    """
    _writable("qkv", qkv)
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


def _key_view(kv: Tensor) -> Tensor:
    if not isinstance(kv, Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        got = tuple(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__
        raise InvalidArgument(f"kv must be (batch, seqlen, 2, nheads, headdim), got {got}")
    return kv[:, :, 0]


class ApplyRotaryEmbKV_(torch.autograd.Function):
    """``apply_rotary_emb_kv_`` with its backward (the conjugate rotation of dk)."""

    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets=0):
        k = _key_view(kv)
        offsets, offset, _ = _check(k, cos, sin, seqlen_offsets, None, None, name="kv")
        _rotate(k, cos, sin, offsets, offset, None, 0, interleaved, False, True)
        ctx.mark_dirty(kv)
        ctx.save_for_backward(cos, sin, offsets)
        ctx.options = (offset, interleaved)
        return kv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dkv):
        cos, sin, offsets = ctx.saved_tensors
        offset, interleaved = ctx.options
        dkv = dkv.clone(memory_format=torch.contiguous_format)  # (the incoming gradient is not ours to write)
        _rotate(dkv[:, :, 0], cos, sin, offsets, offset, None, 0, interleaved, True, True)
        return dkv, None, None, None, None


def apply_rotary_emb_kv_(
    kv: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, seqlen_offsets: int | Tensor = 0
) -> Tensor:
    """Rotary embedding of the keys of a packed ``kv (batch, seqlen, 2, nheads, headdim)``, *in place*
    (the values pass through). cos, sin ``(seqlen_ro, rotary_dim / 2)``; interleaved and seqlen_offsets
    as in ``apply_rotary_emb``. Returns kv itself, rotated."""
    _writable("kv", kv)
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """``(-x1, x0)`` of each pair of channels of x (flash_attn's helper of ``apply_rotary_emb_torch``)."""
    if not interleaved:
        x0, x1 = x.chunk(2, dim=-1)
        return torch.cat((-x1, x0), dim=-1)
    x0, x1 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x1, x0), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """flash_attn's plain-PyTorch rotary, in x's precision: ``x (batch, seqlen, nheads, headdim)``,
    ``cos``/``sin`` ``(seqlen, rotary_dim / 2)`` or ``(batch, seqlen, rotary_dim / 2)``. Returns a new
    tensor."""
    ro_dim = cos.shape[-1] * 2
    if ro_dim > x.shape[-1]:
        raise InvalidArgument(f"rotary_dim ({ro_dim}) must be at most the head dim ({x.shape[-1]})")

    def widen(t: Tensor) -> Tensor:  # (..., rotary_dim / 2) -> (..., 1, rotary_dim), one angle per channel
        return (t.repeat_interleave(2, dim=-1) if interleaved else torch.cat((t, t), dim=-1)).unsqueeze(-2)

    head = x[..., :ro_dim]
    return torch.cat([head * widen(cos) + rotate_half(head, interleaved) * widen(sin), x[..., ro_dim:]], dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """The rotary position embeddings of RoFormer (Su et al., https://arxiv.org/abs/2104.09864), with
    flash_attn's cos/sin cache; with ``scale_base`` set, xPos (Sun et al., https://arxiv.org/abs/2212.10554),
    which scales q by ``scale ** power`` and k by its inverse.

    Args:
        dim: rotary_dim, the channels of each head that rotate (even).
        base: frequency f of ``dim / 2`` rotates by ``base ** (-2f / dim)`` per position.
        interleaved: GPT-J style pairs (0, 1), (2, 3)... instead of GPT-NeoX halves.
        scale_base: xPos's scale base (512 is the recommended value), None for plain RoPE.
        device: where the buffers go.

    Buffers (not in the state dict): ``inv_freq`` ``(dim / 2,)`` fp32 and ``scale`` (xPos) ``(dim / 2,)``.
    The cache ``_cos_cached`` / ``_sin_cached`` (and ``_cos_k_cached`` / ``_sin_k_cached`` with xPos),
    ``(seqlen, dim / 2)`` in the inputs' dtype, computed in fp32, grows to the longest sequence seen and is
    rebuilt on a change of device or dtype (or leaving inference mode for training).
    """

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, device=None):
        super().__init__()
        if not isinstance(dim, numbers.Integral) or dim < 2 or dim % 2:
            raise InvalidArgument(
                f"RotaryEmbedding: dim (rotary_emb_dim) must be an even int of at least 2, got {dim!r}"
            )
        self.dim = dim
        self.base = float(base)
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        scale = (
            (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
            if scale_base is not None
            else None
        )
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self._cos_k_cached = None
        self._sin_k_cached = None

    def _compute_inv_freq(self, device=None) -> Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        """Builds the tables for positions ``0 .. seqlen - 1`` unless the cache already covers them on
        this device and dtype."""
        if (
            seqlen > self._seq_len_cached
            or self._cos_cached is None
            or self._cos_cached.device != device
            or self._cos_cached.dtype != dtype
            # (torch.compile cannot trace is_inference(); tables made under inference_mode are not traced)
            or (self.training and not torch.compiler.is_compiling() and self._cos_cached.is_inference())
        ):
            self._seq_len_cached = seqlen
            # fp32 positions and frequencies (a model loaded in bf16 would lose the angles' precision)
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
            freqs = torch.outer(t, inv_freq.to(device))  # (seqlen, dim / 2); not einsum, which autocast lowers
            if self.scale is None:
                self._cos_cached = torch.cos(freqs).to(dtype)
                self._sin_cached = torch.sin(freqs).to(dtype)
            else:
                power = (
                    torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device) - seqlen // 2
                ) / self.scale_base
                scale = self.scale.to(device=power.device) ** power.unsqueeze(1)  # (seqlen, dim / 2), fp32
                scale = scale.to(device)
                self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
                self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
                self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
                self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(
        self,
        qkv: Tensor,
        kv: Tensor | None = None,
        seqlen_offset: int | Tensor = 0,
        max_seqlen: int | None = None,
        num_heads_q: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Applies the embedding *in place* to qkv and / or kv.

        Args:
            qkv: ``(batch, seqlen, 3, nheads, headdim)`` or ``(batch, seqlen, num_heads_q + 2 * num_heads_k,
                headdim)`` (with ``num_heads_q``) when kv is None; else q ``(batch, seqlen, nheads, headdim)``.
            kv: optional ``(batch, seqlen, 2, nheads_k, headdim)``.
            seqlen_offset: int or int tensor ``(batch,)``: each sequence starts at this position (decoding
                with a KV cache). With a tensor, pass ``max_seqlen`` to size the cache.
            max_seqlen: build the cache for this many positions.
            num_heads_q: query heads of a 4-D qkv.

        Returns:
            qkv rotated, or ``(q, kv)`` rotated when kv is given (the same tensors).
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, numbers.Integral):
            self._update_cos_sin_cache(seqlen + int(seqlen_offset), device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise InvalidArgument(
                "RotaryEmbedding: with a tensor seqlen_offset pass max_seqlen (the cos/sin cache is empty)"
            )
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv,
                self._cos_cached,
                self._sin_cached,
                self._cos_k_cached if xpos else None,
                self._sin_k_cached if xpos else None,
                interleaved=self.interleaved,
                seqlen_offsets=seqlen_offset,
                num_heads_q=num_heads_q,
            )
        # q in place, as flash_attn, unless q and kv are views of one tensor (MHA's GQA projection): rotating
        # both in place would change the base of q's autograd view, which torch.compile refuses
        shared = qkv._base is not None and qkv._base is kv._base
        q = apply_rotary_emb_func(
            qkv,
            self._cos_cached,
            self._sin_cached,
            interleaved=self.interleaved,
            inplace=not shared,
            seqlen_offsets=seqlen_offset,
        )
        kv = apply_rotary_emb_kv_(
            kv,
            self._cos_k_cached if xpos else self._cos_cached,
            self._sin_k_cached if xpos else self._sin_cached,
            interleaved=self.interleaved,
            seqlen_offsets=seqlen_offset,
        )
        return q, kv
