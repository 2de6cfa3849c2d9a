"""Index values checked on the device, errors reported by a later call.

``flash_attn_with_kvcache``, the paged ``flash_attn_varlen_func`` and ``flash_mla_with_kvcache`` read
index tensors (cache_seqlens, cache_leftpad, cache_batch_idx, block tables) whose values a CUDA call
cannot see without a device sync. By default their kernels check those values where they load them:
the first value out of range a kernel finds goes into its device's *error record*, eight int64 words
(``params.RECORD_WORDS``; a compare-and-swap on the code word claims it, the code is written last) on
the device, which each checked call brings into pinned host memory behind its kernels (its last kernel
stores the words there, or an asynchronous copy: ``mirror_target``), where the host reads it as plain
memory, without a sync. Every call that could record one first
looks at its device's record: an error found in an earlier call is cleared and raised, as
``InvalidArgument`` with the words of the host-side check (``checks.index_message``), before the call
does anything. ``check_errors`` synchronises the device and raises a pending error: call it where you
want errors surfaced (after a generation step).

``Settings.sync_checks`` (``TILEATTN_SYNC_CHECKS=1``) checks the values on the host before every call
instead, as CPU tensors always are (a read costs them no sync); ``sync_checks=False`` defers CPU
tensors' checks too, where the kernels run under Triton's interpreter (what the tests exercise).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from tileattn import checks, cpu, params

_CALLS = {
    params.CALL_KVCACHE: ("flash_attn_with_kvcache", "cache_seqlens"),
    params.CALL_PAGED_VARLEN: ("flash_attn_varlen_func (block_table)", "key lengths (cu_seqlens_k)"),
    params.CALL_MLA: ("flash_mla_with_kvcache", "cache_seqlens"),
}


# Whether CUDA kernels write the record in pinned host memory directly (zero-copy) instead of a device
# tensor copied into pinned memory after each call (``mirror``). Off by default: the claim is a
# system-scope atomic, which on host memory needs PCIe atomics (the H200 host has them, but
# compute-sanitizer refuses such an atomic, and hosts without them would fault); the copy measured no
# slower (docs/perf.md). Set before a device's first checked call; it also needs the driver to map pinned
# memory for the device.
ZERO_COPY = False
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


def _device_addressable(host: torch.Tensor) -> bool:
    """Whether the CUDA driver maps this pinned host memory into the devices' address space (what
    Triton's launcher asks before passing a pointer: ``cuPointerGetAttribute``)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # (not the CUDA driver: ROCm maps pinned memory alike)
        return True
    pointer = ctypes.c_uint64()
    status = cuda.cuPointerGetAttribute(
        ctypes.byref(pointer), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER, ctypes.c_uint64(host.data_ptr())
    )
    return status == 0


class _Record:
    """One device's error record: the tensor the kernels write, and its words as host memory (the same
    memory, or a pinned copy of it)."""

    __slots__ = ("tensor", "host", "words", "copied")

    def __init__(self, device: torch.device):
        # pinned host memory, which every GPU of the process addresses directly (unified addressing);
        # a plain CPU tensor for the interpreter's kernels
        cuda = device.type == "cuda"
        self.host = torch.zeros(params.RECORD_WORDS, dtype=torch.int64, pin_memory=cuda)
        self.copied = cuda and not (ZERO_COPY and _device_addressable(self.host))
        self.tensor = torch.zeros_like(self.host, device=device) if self.copied else self.host
        self.words = (ctypes.c_int64 * params.RECORD_WORDS).from_address(self.host.data_ptr())

    def clear(self, device: torch.device) -> None:
        if self.copied:  # (copies still in flight would bring the error back)
            _settle(device)
            self.tensor.zero_()
        self.words[0] = 0


def _settle(device: torch.device) -> None:
    """Waits for the kernels queued on ``device`` (nothing to wait for off CUDA: the interpreter's ran)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_RECORDS: dict[torch.device, _Record] = {}
_LOCK = threading.Lock()


def deferred(q: torch.Tensor, settings: params.Settings, implementation) -> bool:
    """Whether this call's index values are checked by its kernels (not on the host first): as
    ``settings.sync_checks`` says, where the kernels run (``implementation``, not the PyTorch path)."""
    sync = settings.sync_checks
    if sync is None:
        return q.is_cuda
    return not sync and implementation is not cpu


def record(device: torch.device) -> torch.Tensor:
    """The error record of ``device``, made on first use."""
    rec = _RECORDS.get(device)
    if rec is None:
        with _LOCK:
            rec = _RECORDS.get(device)
            if rec is None:
                rec = _RECORDS[device] = _Record(device)
    return rec.tensor


def mirror_target(device: torch.device) -> torch.Tensor | None:
    """Where a checked call's kernels copy the error record of ``device`` behind their work (``record``
    first): its pinned host words, which the last kernel of the call may write with plain stores, or None
    where the kernels write host memory directly (nothing to copy)."""
    rec = _RECORDS.get(device)
    return rec.host if rec is not None and rec.copied else None


def mirror(device: torch.device) -> None:
    """After a checked call: where the kernels write a device tensor (not ``ZERO_COPY``), its copy into
    pinned memory, queued behind them."""
    rec = _RECORDS.get(device)
    if rec is not None and rec.copied:
        rec.host.copy_(rec.tensor, non_blocking=True)


def raise_pending(device: torch.device, when: str = "this call did not run") -> None:
    """Raises the error an earlier call recorded on ``device``, if any (a host read, no sync), clearing
    the record first."""
    rec = _RECORDS.get(device)
    if rec is not None and rec.words[0] > 0:
        raise _take(rec, device, when)


def _take(rec: _Record, device: torch.device, when: str) -> checks.InvalidArgument:
    if rec.copied:  # (the host copy may hold the code before the other words: read the device's words)
        _settle(device)
        code, call, b, j, value, bound, extra, _ = rec.tensor.tolist()
    else:
        code, call, b, j, value, bound, extra, _ = rec.words[:]
    rec.clear(device)  # (a kernel still running may record another error: raised by a later call)
    name, seqlens_name = _CALLS.get(call, ("a KV-cache call", "cache_seqlens"))
    message = checks.index_message(code, b, j, value, bound, extra, seqlens_name)
    return checks.InvalidArgument(
        f"{message}. Found on {device} by the kernels of an earlier {name} call, after it had returned: its "
        f"outputs for batch entry {b} are unspecified and it appended nothing there (a bad block-table entry of "
        f"older keys only excepted); {when}. Index values of CUDA tensors are checked on the device, without "
        "a host sync: tileattn.check_errors() raises such errors where you call it, TILEATTN_SYNC_CHECKS=1 "
        "checks them before each call instead"
    )


def check_errors(device: torch.device | str | int | None = None) -> None:
    """Raises the first invalid index value that tileattn's kernels have found since the last error was
    raised, as ``tileattn.InvalidArgument``.

    KV-cache calls on CUDA tensors (``flash_attn_with_kvcache``, ``flash_attn_varlen_func`` with a
    block_table, ``flash_mla_with_kvcache``) check cache_seqlens, cache_leftpad, cache_batch_idx, block
    tables and the rotary tables' length in their kernels, without a device sync, and the next such call
    on the device raises what an earlier one found (once the GPU has run it). This function synchronises
    the device first, so it raises every error of the calls made before it: call it where you want errors
    surfaced, e.g. after each generation step or before trusting a step's outputs.

    Args:
        device: the device to check (a ``torch.device``, ``"cuda:1"``, an index); None: every device a
            call has checked values on.
    """
    if device is None:
        devices = list(_RECORDS)
    else:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        devices = [device]
    for d in devices:
        if d not in _RECORDS:
            continue
        _settle(d)
        raise_pending(d, "raised by tileattn.check_errors()")
