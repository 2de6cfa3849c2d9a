"""Padding helpers for packed (varlen) batches, compatible with ``flash_attn.bert_padding``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _IndexFirstAxis(torch.autograd.Function):
    """``x[indices]`` over the first axis, with a scatter backward (no dense index_select grad)."""

    @staticmethod
    def forward(ctx, x, indices):  # type: ignore[override]
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = x.shape[0]
        return x[indices]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.first_axis_dim, *grad.shape[1:]))
        out[indices] = grad
        return out, None


class _IndexPutFirstAxis(torch.autograd.Function):
    """Scatters ``values`` into a zero tensor of ``first_axis_dim`` rows at ``indices``."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):  # type: ignore[override]
        ctx.save_for_backward(indices)
        out = values.new_zeros((first_axis_dim, *values.shape[1:]))
        out[indices] = values
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        return grad[indices], None, None


index_first_axis = _IndexFirstAxis.apply
index_put_first_axis = _IndexPutFirstAxis.apply


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Removes padding.

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)``, bool or int, 1/True for real tokens.
        unused_mask: optional ``(batch, seqlen)``, 1 for tokens that are allocated but unused (kept in
            the packed tensor and in cu_seqlens, but not counted in seqused).

    Returns:
        ``(hidden_unpad, indices, cu_seqlens, max_seqlen, seqused)``: hidden_unpad ``(total, ...)``;
        indices int64 ``(total,)`` into the flattened ``batch * seqlen`` axis; cu_seqlens int32
        ``(batch + 1,)``; max_seqlen int; seqused int32 ``(batch,)``, the real tokens per sequence.
    """
    for name, mask in (("attention_mask", attention_mask), ("unused_mask", unused_mask)):
        if mask is not None and tuple(mask.shape) != tuple(hidden_states.shape[:2]):
            raise ValueError(
                f"{name} must be (batch, seqlen) = {tuple(hidden_states.shape[:2])} like hidden_states, "
                f"got {tuple(mask.shape)}"
            )
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of ``unpad_input``: ``(total, ...)`` back to ``(batch, seqlen, ...)`` with zeros."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
