"""The mask of ``attn_implementation="tileattn"`` (see ``tileattn.integrations.transformers``).

transformers calls ``tileattn_mask`` (its mask interface) once per forward and layer type; it returns a
``TileattnMask``, which records what the attention needs (padding, offsets, the recognised causal,
bidirectional or sliding-window mask, packed documents) without materialising the mask, and which
refuses to be used as a tensor by a model's own attention code. A mask function that is none of those is
evaluated block by block into a FlashMask (``_mask_function_flashmask``), as is a 4-D mask a model built
itself (``_mask_4d_flashmask``): per key column, the runs of query rows it hides.
"""

from __future__ import annotations

import torch
from transformers import masking_utils as mu


class Unsupported(NotImplementedError):
    """A model, mask or keyword that tileattn cannot run exactly: raised when the model is created or
    first called, rather than giving an answer that differs from ``attn_implementation="eager"``."""


_USE_INSTEAD = "use attn_implementation='sdpa' or 'eager' for this model"

# --------------------------------------------------------------------------------------------------
# The mask
# --------------------------------------------------------------------------------------------------


def _foreign(what: str) -> Unsupported:
    return Unsupported(
        f"tileattn: the attention mask of attn_implementation='tileattn' was used outside tileattn's attention "
        f"function ({what}): this model computes (some of) its attention with its own code, or reshapes the mask, "
        f"which tileattn cannot run; {_USE_INSTEAD}"
    )


def _refuse_use(self, *args, **kwargs):
    raise _foreign("an operator")


class TileattnMask:
    """The mask transformers builds for ``attn_implementation="tileattn"``: one per forward and layer type,
    shared by the layers (what is derived from it is computed once, in ``derived``).

    ``padding``: bool ``(batch, kv_length)``, which key slots hold tokens (None: all); ``q_offset`` /
    ``kv_offset``: the positions of the first query and key slot (``q_offset`` a 0-d tensor with a static
    cache); ``causal`` / ``window``: the recognised mask (``window``: transformers' sliding window), or
    ``general`` when the mask function is anything else (evaluated into a FlashMask); ``documents``: the
    packed-sequence ids ``(batch, seq_len)`` when ``position_ids`` restart inside rows.

    Used as a tensor by code other than tileattn's attention function (a model's own attention code),
    it raises ``Unsupported``. ``ndim`` is 4, as of the prepared masks that transformers passes through
    unchanged (``generate`` builds the masks ahead of the forward with a static cache)."""

    ndim = 4

    def __init__(
        self,
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        padding,
        use_vmap,
        causal,
        window,
        general,
        documents,
    ):
        self.batch_size = batch_size
        self.q_length = q_length
        self.kv_length = kv_length
        self.q_offset = q_offset
        self.kv_offset = kv_offset
        self.mask_function = mask_function
        self.attention_mask = attention_mask
        self.padding = padding
        self.use_vmap = use_vmap
        self.causal = causal
        self.window = window
        self.general = general
        self.documents = documents
        self.derived = {}

    @property
    def aligned(self) -> bool:
        """Whether the last query and the last key slot are the same position (no cache, or a dynamic
        one), as bottom-right causal masks assume."""
        return isinstance(self.q_offset, int) and self.q_offset + self.q_length == self.kv_offset + self.kv_length

    def window_size(self) -> tuple[int, int]:
        if self.window is None:
            return (-1, -1)
        # causal: key j visible from query i if i - j < window; bidirectional: if |i - j| <= window
        return (self.window - 1, 0) if self.causal else (self.window, self.window)

    def __repr__(self) -> str:
        kind = "general" if self.general else ("causal" if self.causal else "bidirectional")
        return f"TileattnMask({kind}, window={self.window}, q={self.q_length}, kv={self.kv_length})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _foreign(getattr(func, "__name__", str(func)))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise _foreign(f"attribute {name!r}")

    __getitem__ = __bool__ = __len__ = __iter__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse_use
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse_use
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __invert__ = __neg__ = _refuse_use
    __hash__ = object.__hash__


def _cells(fn) -> dict:
    closure = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in closure)))


def _made_by(fn, factory: str) -> bool:
    """Whether ``fn`` is the inner function of the transformers mask factory named ``factory`` (False
    where the installed transformers has no such factory)."""
    made = getattr(mu, factory, None)
    return (
        made is not None
        and getattr(fn, "__module__", None) == mu.__name__
        and getattr(fn, "__qualname__", "").startswith(made.__qualname__ + ".<locals>.")
    )


def _plain(fn) -> tuple[bool, int | None] | None:
    """``(causal, window)`` for transformers' causal, bidirectional and sliding-window mask functions;
    None for anything else."""
    if fn is mu.causal_mask_function:
        return True, None
    if fn is mu.bidirectional_mask_function:
        return False, None
    if _made_by(fn, "and_masks"):
        parts = _cells(fn).get("mask_functions", ())
        if len(parts) == 2:
            overlay, base = parts
            if _made_by(overlay, "sliding_window_overlay") and base is mu.causal_mask_function:
                return True, int(_cells(overlay)["sliding_window"])
            if _made_by(overlay, "sliding_window_bidirectional_overlay") and base is mu.bidirectional_mask_function:
                return False, int(_cells(overlay)["sliding_window"])
    return None


def _packed(fn) -> tuple[tuple[bool, int | None], torch.Tensor] | None:
    """The base mask and the sequence ids of transformers' packed-sequence mask (``position_ids``
    restarting inside rows): ``and_masks(remap_positions(base, position_ids), same_sequence(ids))``, or in
    older transformers (no ``remap_positions_for_packed_sequence``) ``and_masks(base, same_sequence(ids))``."""
    if not _made_by(fn, "and_masks"):
        return None
    parts = _cells(fn).get("mask_functions", ())
    if len(parts) != 2 or not _made_by(parts[1], "packed_sequence_mask_function"):
        return None
    first, same = parts
    # (within one sequence the positions grow by exactly 1, so the base mask on positions is the base
    # mask on indices)
    base = _plain(_cells(first)["mask_function"] if _made_by(first, "remap_positions_for_packed_sequence") else first)
    if base is None:
        return None
    return base, _cells(same)["packed_sequence_mask"]


def _compiling(device: torch.device) -> bool:
    """Under torch.compile or CUDA graph capture: no host reads, no data-dependent shapes."""
    return torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _require(ok: torch.Tensor, message: str) -> None:
    """Refuses when ``ok`` (a bool tensor) is False: read on the host, or asserted on the device where the
    host may not read (the kernel's assertion stops the program)."""
    if _compiling(ok.device):
        torch._assert_async(ok, "tileattn: " + message)
    elif not bool(ok):
        raise Unsupported("tileattn: " + message)


def tileattn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=mu.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs,
) -> TileattnMask:
    """transformers' mask interface (``AttentionMaskInterface``): what the attention needs of the mask,
    without materialising it (see ``TileattnMask``)."""
    if isinstance(attention_mask, TileattnMask):  # built ahead (generate with a static cache)
        return attention_mask
    if isinstance(q_offset, torch.Tensor):  # (a static cache's length, which its update increments in place)
        q_offset = q_offset.clone()
    padding = None
    if attention_mask is not None:
        full = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        padding = full[:, kv_offset : kv_offset + kv_length].to(torch.bool)
        if not _compiling(padding.device) and bool(padding.all()):
            padding = None
    plain, documents = _plain(mask_function), None
    if plain is None:
        packed = _packed(mask_function)
        if packed is not None:
            plain, documents = packed
    causal, window = plain if plain is not None else (False, None)
    return TileattnMask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        padding,
        use_vmap,
        causal,
        window,
        plain is None,
        documents,
    )


# --------------------------------------------------------------------------------------------------
# Masks as FlashMasks: per key column, the runs of query rows it hides
# --------------------------------------------------------------------------------------------------

_BLOCK_ELEMENTS = 1 << 22  # elements of one block of rows evaluated at a time


def _column_runs(blocks, shape, device) -> torch.Tensor:
    """The FlashMask (C = 4, not causal) of a visibility mask given as blocks of query rows: ``blocks``
    yields bool ``(batch, heads, rows, kv)`` blocks, in order, of a mask of ``shape`` ``(batch, heads,
    seq_q, kv)``. A column's hidden rows may form at most two runs: the first becomes the upper interval
    [UTS, UTE), the second the lower one [LTS, LTE); more is refused."""
    batch, heads, seq_q, kv = shape
    first = torch.full((4, batch, heads, kv), seq_q, dtype=torch.int64, device=device)  # s1, e1, s2, e2
    starts = torch.zeros(batch, heads, kv, dtype=torch.int64, device=device)
    ends = torch.zeros_like(starts)
    last = torch.zeros(batch, heads, kv, dtype=torch.bool, device=device)
    too_many = torch.zeros((), dtype=torch.bool, device=device)
    row0 = 0
    for visible in blocks:
        hidden = ~visible.expand(batch, heads, -1, kv)
        rows = hidden.shape[2]
        before = torch.cat([last[:, :, None], hidden[:, :, :-1]], 2)
        index = torch.arange(row0, row0 + rows, device=device).view(1, 1, rows, 1)
        for flags, count, slots in ((hidden & ~before, starts, (0, 2)), (~hidden & before, ends, (1, 3))):
            ordinal = count[:, :, None] + flags.cumsum(2)
            for k, slot in enumerate(slots, start=1):
                at = torch.where(flags & (ordinal == k), index, seq_q).amin(2)
                first[slot] = torch.minimum(first[slot], at)
            if slots[0] == 0:
                too_many = too_many | (flags & (ordinal > 2)).any()
            count += flags.sum(2)
        last = hidden[:, :, -1]
        row0 += rows
    # a run still open at the last row ends at seq_q (already the default)
    s1, e1, s2, e2 = first
    _require(
        ~too_many,
        "the attention mask hides more than two runs of query rows in some key column, which a FlashMask cannot hold",
    )
    empty_upper = torch.zeros_like(s1)
    upper = (torch.where(s1 < e1, s1, empty_upper), torch.where(s1 < e1, e1, empty_upper))
    lower = (torch.where(s2 < e2, s2, seq_q), torch.where(s2 < e2, e2, seq_q))
    return torch.stack([lower[0], lower[1], upper[0], upper[1]], -1).to(torch.int32)


def _mask_function_flashmask(m: TileattnMask, device) -> torch.Tensor:
    """The FlashMask ``(batch, 1, kv_length, 4)`` of the mask transformers' eager attention would build
    (``sdpa_mask``: the mask function at the offsets, the padding), evaluated a block of rows at a time."""
    if "flashmask" not in m.derived:
        rows = max(1, _BLOCK_ELEMENTS // max(1, m.batch_size * m.kv_length))

        def blocks():
            for start in range(0, m.q_length, rows):
                yield mu.sdpa_mask(
                    batch_size=m.batch_size,
                    q_length=min(rows, m.q_length - start),
                    kv_length=m.kv_length,
                    q_offset=m.q_offset + start,
                    kv_offset=m.kv_offset,
                    mask_function=m.mask_function,
                    attention_mask=m.attention_mask,
                    allow_is_causal_skip=False,
                    allow_is_bidirectional_skip=False,
                    use_vmap=m.use_vmap,
                    device=device,
                )

        m.derived["flashmask"] = _column_runs(blocks(), (m.batch_size, 1, m.q_length, m.kv_length), device)
    return m.derived["flashmask"]


# an additive mask value at or below this hides the key (its exponential is 0 in every float format)
_HIDDEN_BELOW = -1e4


def _mask_4d_flashmask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The FlashMask of a 4-D mask ``(batch or 1, heads or 1, seq_q, >= seq_k)`` that a model built itself:
    boolean (True: visible) or additive (0: visible, -inf or <= -1e4: hidden); any other additive value
    is a bias, refused."""
    batch, seq_q, nheads = q.shape[0], q.shape[1], q.shape[2]
    seq_k = k.shape[1]
    if (
        mask.shape[2] != seq_q
        or mask.shape[3] < seq_k
        or mask.shape[0] not in (1, batch)
        or mask.shape[1] not in (1, nheads)
    ):
        raise Unsupported(
            f"tileattn: a 4-D attention mask must be (batch or 1, heads or 1, seq_q, seq_k) = "
            f"({batch}, {nheads}, {seq_q}, {seq_k}); got {tuple(mask.shape)}"
        )
    mask = mask[..., :seq_k]
    if mask.dtype == torch.bool:
        visible = mask
    else:
        visible = mask == 0
        if not bool(((mask <= _HIDDEN_BELOW) | visible).all()):
            raise Unsupported(
                "tileattn: the model passes an additive attention bias (a 4-D float mask with values other than "
                f"0 and -inf), which tileattn does not add; {_USE_INSTEAD}"
            )
    heads = mask.shape[1]
    rows = max(1, _BLOCK_ELEMENTS // max(1, batch * heads * seq_k))
    blocks = (visible[:, :, s : s + rows] for s in range(0, seq_q, rows))
    return _column_runs(blocks, (batch, heads, seq_q, seq_k), q.device)
