"""Padding helpers for packed (varlen) batches: ``flash_attn.bert_padding`` 2.8.3's functions, with its
signatures and returns.

A padded batch ``(batch, seqlen, ...)`` and a 0/1 ``attention_mask (batch, seqlen)`` become a packed
tensor ``(total, ...)`` of the real tokens, their ``indices`` into the flattened ``batch * seqlen`` axis
and int32 ``cu_seqlens (batch + 1,)`` for ``flash_attn_varlen_func``; ``pad_input`` goes back. The
index functions are autograd Functions whose backward scatters (or gathers) the gradient instead of
building a dense index grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "IndexFirstAxis",
    "IndexFirstAxisResidual",
    "IndexPutFirstAxis",
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


class IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` over the first axis: input ``(first_axis_dim, ...)``, indices int64 ``(n,)``
    → ``(n, ...)``. The backward adds the gradient rows into zeros at ``indices`` (repeated indices
    accumulate)."""

    @staticmethod
    def forward(ctx, input, indices):  # type: ignore[override]
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input[indices]

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        grad_input = grad_output.new_zeros((ctx.first_axis_dim, *grad_output.shape[1:]))
        return grad_input.index_add_(0, indices, grad_output), None


class IndexPutFirstAxis(torch.autograd.Function):
    """Scatters ``values (n, ...)`` into zeros ``(first_axis_dim, ...)`` at rows ``indices`` (int64
    ``(n,)``, distinct). The backward gathers the gradient at ``indices``."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):  # type: ignore[override]
        ctx.save_for_backward(indices)
        output = values.new_zeros((first_axis_dim, *values.shape[1:]))
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


class IndexFirstAxisResidual(torch.autograd.Function):
    """``(input[indices], input.detach())``: the selected rows and the whole input as a residual that
    flows on (flash_attn's BERT uses it to run the last layer on a few tokens only). Gradients of both
    outputs reach ``input``: the residual's, plus the selected rows' added at ``indices``."""

    @staticmethod
    def forward(ctx, input, indices):  # type: ignore[override]
        ctx.save_for_backward(indices)
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        # out of place: grad_residual may be a buffer autograd shares or an expanded view
        return grad_residual.index_add(0, indices, grad_output.to(grad_residual.dtype)), None


index_first_axis = IndexFirstAxis.apply
index_put_first_axis = IndexPutFirstAxis.apply
index_first_axis_residual = IndexFirstAxisResidual.apply


def _check_mask(name: str, mask: torch.Tensor, hidden_states: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"{name} must be (batch, seqlen) = {tuple(hidden_states.shape[:2])} like hidden_states, got {got}"
        )


def _cu_seqlens(seqlens: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Removes padding.

    Args:
        hidden_states: ``(batch, seqlen, ...)``, any dtype.
        attention_mask: ``(batch, seqlen)``, bool or int, 1/True for real tokens.
        unused_mask: optional ``(batch, seqlen)``, bool or int, 1 for tokens that are allocated but unused
            (kept in the packed tensor and in cu_seqlens, but not counted in seqused).

    Returns:
        ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch, seqused)``: hidden_states ``(total,
        ...)`` (the tokens of attention_mask + unused_mask, in order); indices int64 ``(total,)`` into the
        flattened ``batch * seqlen`` axis; cu_seqlens int32 ``(batch + 1,)``; max_seqlen_in_batch a Python
        int (0 for an empty batch); seqused int32 ``(batch,)``, the tokens of attention_mask per sequence.
    """
    _check_mask("attention_mask", attention_mask, hidden_states)
    if unused_mask is not None:
        _check_mask("unused_mask", unused_mask, hidden_states)
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, _cu_seqlens(seqlens), max_seqlen, seqused


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Removes padding from rows that each hold several sequences back to back (packed SFT samples).

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask_in_length: int ``(batch, seqlen)``: row b's nonzero entries, in order, are the
            lengths of the sequences concatenated at the start of row b (e.g. ``[2, 3, 0, 0, 0, 0]``: a
            sequence of 2 tokens, then one of 3, then one padding token). Their sum is at most seqlen.

    Returns:
        ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch)``: hidden_states ``(total, ...)``, the
        tokens of all sequences in order; indices int64 ``(total,)`` into the flattened ``batch * seqlen``
        axis; cu_seqlens int32 ``(num_sequences + 1,)``, one entry per sequence (not per row);
        max_seqlen_in_batch a Python int (0 when there is none).
    """
    _check_mask("attention_mask_in_length", attention_mask_in_length, hidden_states)
    seqlen = attention_mask_in_length.shape[-1]
    lengths = attention_mask_in_length.sum(dim=-1)  # (batch,) tokens used in each row
    if bool(((attention_mask_in_length < 0).any(dim=-1) | (lengths > seqlen)).any()):
        raise ValueError(
            f"attention_mask_in_length must hold non-negative sequence lengths summing to at most seqlen ({seqlen}) "
            f"per row, got row sums {lengths.tolist()}"
        )
    positions = torch.arange(seqlen, device=lengths.device)
    indices = torch.nonzero((positions < lengths[:, None]).flatten(), as_tuple=False).flatten()
    flat_lengths = attention_mask_in_length.flatten()
    seqlens = flat_lengths[flat_lengths != 0]
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, _cu_seqlens(seqlens), max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of ``unpad_input``: hidden_states ``(total, ...)`` and indices int64 ``(total,)`` (as
    unpad_input returned them) → ``(batch, seqlen, ...)`` with zeros at the padding positions."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *hidden_states.shape[1:])
