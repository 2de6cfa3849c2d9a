"""A paged KV cache manager for serving: one preallocated pool of pages per layer, a block allocator,
per-sequence block tables with reference-counted prefix sharing, and the tensors that
``tileattn.flash_attn_with_kvcache`` takes.

A decoding step for a batch of sequences::

    step = cache.append(seq_ids, num_new)           # room for num_new more tokens per sequence
    for layer in range(num_layers):
        out = flash_attn_with_kvcache(q, k=k_new, v=v_new, causal=True, **step.kwargs(layer))

A latent pool (``values=False``: MLA, whose values are the first dims of the cached rows) takes the new
rows through ``CacheStep.write`` and attends with ``tileattn.mla.flash_mla_with_kvcache``::

    step = cache.append(seq_ids, num_new)
    for layer in range(num_layers):
        step.write(layer, rows)                      # (batch, num_new, 1, 576)
        out, lse = flash_mla_with_kvcache(q, head_dim_v=512, causal=True, **step.mla_kwargs(layer))

``append`` grows each sequence by whole pages as needed and returns the lengths *before* the step
(where the kernel writes the new keys and values) with the block table. Sequences made by ``fork``
share their parent's pages; the first write into a shared, partially filled last page copies it first
(copy-on-write), so a fork never changes what its parent sees. Failed calls (pool exhausted, unknown
sequence) raise before any state changes.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

import torch


class CacheFullError(RuntimeError):
    """The page pool cannot hold what was asked; nothing was allocated."""


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


@dataclass
class CacheStep:
    """The cache arguments of one step for a batch of sequences (from ``PagedKVCache.append``)."""

    cache: PagedKVCache
    seq_ids: list[int]
    cache_seqlens: torch.Tensor  # int32 (batch,), lengths before the step
    block_table: torch.Tensor  # int32 (batch, max_pages)
    # FP8 pools: fp32 (num_layers, batch, nheads_k), each layer's descales for the step's sequences
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    # int32 (batch,): the tokens the step added to each sequence
    num_new: torch.Tensor | None = None

    def kwargs(self, layer: int) -> dict:
        """``k_cache``, ``v_cache``, ``cache_seqlens`` and ``block_table`` for ``layer`` (and the layer's
        ``k_descale`` and ``v_descale`` with an FP8 pool)."""
        if self.cache.v is None:
            raise ValueError(
                "a latent pool (values=False) has no v_cache: pass mla_kwargs(layer) to flash_mla_with_kvcache"
            )
        args = dict(
            k_cache=self.cache.k[layer],
            v_cache=self.cache.v[layer],
            cache_seqlens=self.cache_seqlens,
            block_table=self.block_table,
        )
        if self.k_descale is not None:
            args.update(k_descale=self.k_descale[layer], v_descale=self.v_descale[layer])
        return args

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Writes the step's new rows of ``layer`` into the pool: ``k`` (and ``v``, which a pool with
        values needs) ``(batch, n, nheads_k, headdim)`` with n at least the most tokens the step added to
        a sequence; row i of sequence b goes to position ``cache_seqlens[b] + i``, for i below the
        tokens the step added to it (rows past them are ignored)."""
        cache = self.cache
        if (v is None) != (cache.v is None):
            raise ValueError("write takes v exactly when the pool has values (PagedKVCache(values=True))")
        if k.dim() != 4 or k.shape[0] != len(self.seq_ids) or tuple(k.shape[2:]) != tuple(cache.k.shape[3:]):
            raise ValueError(
                f"k must have shape (batch, n, nheads_k, headdim) = ({len(self.seq_ids)}, n, "
                f"{', '.join(map(str, cache.k.shape[3:]))}), got {tuple(k.shape)}"
            )
        n = k.shape[1]
        if max(self.num_new.tolist(), default=0) > n:
            raise ValueError(f"k has {n} rows per sequence but the step added up to {int(self.num_new.max())}")
        i = torch.arange(n, device=k.device)
        keep = i[None, :] < self.num_new[:, None]  # (batch, n)
        pos = self.cache_seqlens[:, None].long() + i[None, :]
        pages = self.block_table.long().gather(1, (pos // cache.page_size).clamp_max(self.block_table.shape[1] - 1))
        slots = pos % cache.page_size
        cache.k[layer][pages[keep], slots[keep]] = k[keep].to(cache.k.dtype)
        if v is not None:
            cache.v[layer][pages[keep], slots[keep]] = v[keep].to(cache.v.dtype)

    def mla_kwargs(self, layer: int) -> dict:
        """``k_cache``, ``block_table`` and ``cache_seqlens`` of ``tileattn.mla.flash_mla_with_kvcache``
        for ``layer``: the lengths *after* the step, whose rows ``write`` has put in the pool."""
        return dict(
            k_cache=self.cache.k[layer], block_table=self.block_table, cache_seqlens=self.cache_seqlens + self.num_new
        )


def _descales(name: str, value: object, num_layers: int, nheads_k: int, device) -> torch.Tensor:
    """An FP8 pool's descale argument as fp32 ``(num_layers, nheads_k)``."""
    value = 1.0 if value is None else value
    try:
        d = torch.as_tensor(value, dtype=torch.float32, device=device).expand(num_layers, nheads_k).clone()
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"{name} must be a float or a tensor broadcastable to (num_layers, nheads_k) = ({num_layers}, "
            f"{nheads_k}), got {value!r}"
        ) from None
    if not bool((d > 0).all()):
        raise ValueError(f"{name} must be positive, got {value!r}")
    return d


class PagedKVCache:
    """Pages of ``page_size`` tokens for ``num_layers`` layers, allocated from one pool.

    Args:
        num_layers, num_pages, page_size, nheads_k, headdim: pool geometry; ``k[layer]`` and
            ``v[layer]`` are ``(num_pages, page_size, nheads_k, headdim)``, so the pool holds
            ``2 * num_layers * num_pages * page_size * nheads_k * headdim`` elements (half without values).
        dtype: of the pool, which must be the dtype of the queries and new keys passed with it, or
            ``torch.float8_e4m3fn`` (an FP8 pool, half the bytes: queries and new keys in float16 or
            bfloat16, the new keys and values quantized as they are written). Default ``None``: bfloat16
            on a CUDA device, ``torch.get_default_dtype()`` (float32 unless changed) elsewhere, the
            dtypes a model runs in there.
        device: of the pool; default ``None``, PyTorch's default device.
        k_descale, v_descale: FP8 pools only: the scales of the keys and values, a float or a tensor
            broadcastable to ``(num_layers, nheads_k)`` (default 1.0): the pool holds ``x / descale``
            rounded to e4m3 (saturated at ±448), so a descale near ``max|x| / 448`` keeps the most
            precision. Every step passes them to ``flash_attn_with_kvcache`` (``CacheStep.kwargs``).
        values: False for a latent pool (MLA): ``k[layer]`` holds rows whose first dims are also the
            values, ``v`` is None; steps write rows with ``CacheStep.write`` and pass
            ``CacheStep.mla_kwargs`` to ``tileattn.mla.flash_mla_with_kvcache``.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        nheads_k: int,
        headdim: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        k_descale: float | torch.Tensor | None = None,
        v_descale: float | torch.Tensor | None = None,
        values: bool = True,
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("nheads_k", nheads_k),
            ("headdim", headdim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        if dtype is None:
            where = torch.device(device) if device is not None else torch.get_default_device()
            dtype = torch.bfloat16 if where.type == "cuda" else torch.get_default_dtype()
        shape = (num_layers, num_pages, page_size, nheads_k, headdim)
        if not isinstance(values, bool):
            raise TypeError(f"values must be a bool, got {values!r}")
        if not values and dtype == torch.float8_e4m3fn:
            raise ValueError("a latent pool (values=False) holds float16, bfloat16 or float32 rows, not float8_e4m3fn")
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device) if values else None
        self.k_descale = self.v_descale = None
        if dtype == torch.float8_e4m3fn:
            self.k_descale, self.v_descale = (
                _descales(name, d, num_layers, nheads_k, self.k.device)
                for name, d in (("k_descale", k_descale), ("v_descale", v_descale))
            )
        elif k_descale is not None or v_descale is not None:
            raise ValueError(f"k_descale and v_descale are for a torch.float8_e4m3fn pool; this one is {dtype}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out low pages first
        self._refs = [0] * num_pages
        self._seqs: dict[int, _Sequence] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ sequences

    def _get(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"unknown sequence {seq_id!r}; known: {sorted(self._seqs)}") from None

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        seq_id = next(self._ids)
        self._seqs[seq_id] = _Sequence()
        return seq_id

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every page of ``seq_id`` (reference counted); returns its id."""
        parent = self._get(seq_id)
        child_id = next(self._ids)
        for page in parent.pages:
            self._refs[page] += 1
        self._seqs[child_id] = _Sequence(list(parent.pages), parent.length)
        return child_id

    def free(self, seq_id: int) -> None:
        """Drops the sequence; pages no other sequence holds return to the pool."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for page in reversed(seq.pages):
            self._release(page)

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def length(self, seq_id: int) -> int:
        return self._get(seq_id).length

    def pages(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).pages)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------ growth

    def _plan(self, seq: _Sequence, num_new: int) -> tuple[int, bool]:
        """(new pages needed, whether the last page must be copied first) to add num_new tokens."""
        needed = -(-(seq.length + num_new) // self.page_size) - len(seq.pages)
        partial = seq.length % self.page_size != 0
        cow = num_new > 0 and partial and self._refs[seq.pages[-1]] > 1
        return max(needed, 0), cow

    def append(self, seq_ids: int | list[int], num_new: int | list[int] = 1) -> CacheStep:
        """Makes room for ``num_new`` more tokens in each sequence and advances their lengths.

        Returns the step's ``CacheStep``: ``cache_seqlens`` are the lengths before the step, where
        ``flash_attn_with_kvcache`` writes the new keys and values (every layer uses the same step).
        Raises ``CacheFullError`` (nothing allocated) if the pool cannot hold them, ``KeyError`` for
        an unknown sequence."""
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        counts = [num_new] * len(ids) if isinstance(num_new, int) else list(num_new)
        if len(counts) != len(ids):
            raise ValueError(f"num_new has {len(counts)} entries for {len(ids)} sequences")
        if any(not isinstance(n, int) or n < 0 for n in counts):
            raise ValueError(f"num_new must be ints >= 0, got {counts}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be distinct, got {ids}")
        seqs = [self._get(i) for i in ids]
        plans = [self._plan(s, n) for s, n in zip(seqs, counts)]
        # a shared partial last page is copied by each sharer in the step, except the last one when the
        # step holds every sharer (that one then owns the page alone)
        sharers = collections.Counter(s.pages[-1] for s, (_, cow) in zip(seqs, plans) if cow)
        copies = sum(min(k, self._refs[page] - 1) for page, k in sharers.items())
        wanted = sum(n for n, _ in plans) + copies
        if wanted > len(self._free):
            raise CacheFullError(
                f"the step needs {wanted} free pages of {self.page_size} tokens but the pool has {len(self._free)} "
                f"(of {self.num_pages}); free finished sequences or allocate a larger pool"
            )
        before = [s.length for s in seqs]
        for seq, n, (new_pages, cow) in zip(seqs, counts, plans):
            if cow and self._refs[seq.pages[-1]] > 1:  # (an earlier sharer in the step may have copied it)
                self._copy_last_page(seq)
            for _ in range(new_pages):
                page = self._free.pop()
                self._refs[page] = 1
                seq.pages.append(page)
            seq.length += n
        return self._step(ids, before, counts)

    def _copy_last_page(self, seq: _Sequence) -> None:
        shared = seq.pages[-1]
        page = self._free.pop()
        self._refs[page] = 1
        self.k[:, page] = self.k[:, shared]
        if self.v is not None:
            self.v[:, page] = self.v[:, shared]
        self._release(shared)
        seq.pages[-1] = page

    def _step(self, ids: list[int], before: list[int], counts: list[int]) -> CacheStep:
        width = max((len(self._seqs[i].pages) for i in ids), default=0)
        # rows shorter than the widest are padded with -1, no page: flash_attn_with_kvcache rejects a
        # step whose new tokens reach past a sequence's pages instead of writing another sequence's page
        table = torch.full((len(ids), max(width, 1)), -1, dtype=torch.int32)
        for row, i in enumerate(ids):
            pages = self._seqs[i].pages
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        device = self.k.device
        step = CacheStep(
            cache=self,
            seq_ids=ids,
            cache_seqlens=torch.tensor(before, dtype=torch.int32).to(device),
            block_table=table.to(device),
            num_new=torch.tensor(counts, dtype=torch.int32).to(device),
        )
        if self.k_descale is not None:  # (contiguous (batch, nheads_k) per layer, as the kernels read them)
            layers, nheads_k = self.k_descale.shape
            step.k_descale, step.v_descale = (
                d[:, None].expand(layers, len(ids), nheads_k).contiguous() for d in (self.k_descale, self.v_descale)
            )
        return step
