"""tileattn.bert_padding (flash_attn.bert_padding's surface) against references written here with plain
boolean indexing and PyTorch's own autograd; values are exact (indexing moves data, it computes none)."""

import pytest
import torch

from tileattn import bert_padding
from tileattn.bert_padding import (
    IndexFirstAxis,
    IndexFirstAxisResidual,
    IndexPutFirstAxis,
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def _mask(kind: str, batch: int, seqlen: int) -> torch.Tensor:
    """int64 (batch, seqlen), 1 for real tokens."""
    if kind == "full":
        return torch.ones(batch, seqlen, dtype=torch.long)
    lengths = torch.randint(0, seqlen + 1, (batch,))
    lengths[0] = seqlen  # one full row
    if batch > 2:
        lengths[1] = 0  # one empty row
    pos = torch.arange(seqlen)
    if kind == "right":
        return (pos < lengths[:, None]).long()
    if kind == "left":
        return (pos >= seqlen - lengths[:, None]).long()
    return (torch.rand(batch, seqlen) < 0.6).long()  # holes anywhere


SHAPES = [(1, 1, (3,)), (3, 7, (5,)), (4, 13, (3, 8)), (2, 33, ())]


def _id(shape):
    batch, seqlen, rest = shape
    return f"B{batch}-S{seqlen}-rest{'x'.join(map(str, rest)) or 'none'}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["full", "right", "left", "holes"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_unpad_then_pad(shape, kind, dtype):
    batch, seqlen, rest = shape
    mask = _mask(kind, batch, seqlen)
    real = mask.bool()
    x = torch.randn(batch, seqlen, *rest, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)

    counts = [int(r.sum()) for r in real]
    assert torch.equal(packed, x_ref[real].detach())
    assert indices.dtype == torch.int64
    assert indices.tolist() == torch.arange(batch * seqlen).view(batch, seqlen)[real].tolist()
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [sum(counts[:b]) for b in range(batch + 1)]
    assert type(max_seqlen) is int and max_seqlen == max(counts)
    assert seqused.dtype == torch.int32 and seqused.tolist() == counts

    padded = pad_input(packed, indices, batch, seqlen)
    expected = torch.zeros_like(x_ref)
    expected[real] = x_ref[real]  # the reference: boolean assignment into zeros
    assert padded.shape == x.shape and torch.equal(padded, expected.detach())

    grad = torch.randn_like(padded)
    (gx,) = torch.autograd.grad(padded, x, grad)
    (gx_ref,) = torch.autograd.grad(expected, x_ref, grad)
    assert torch.equal(gx, gx_ref)
    assert torch.equal(gx[~real], torch.zeros_like(gx[~real]))


def test_unpad_with_unused_mask():
    """Allocated-but-unused tokens are packed and counted in cu_seqlens, but not in seqused."""
    batch, seqlen = 3, 9
    lengths, unused = [4, 9, 0], [3, 0, 2]
    pos = torch.arange(seqlen)
    used_mask = (pos < torch.tensor(lengths)[:, None]).int()
    unused_mask = (
        (pos >= torch.tensor(lengths)[:, None]) & (pos < torch.tensor(lengths)[:, None] + torch.tensor(unused)[:, None])
    ).int()
    x = torch.randn(batch, seqlen, 2, 4, requires_grad=True)
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, used_mask, unused_mask)
    both = (used_mask + unused_mask).bool()
    assert torch.equal(packed, x[both])
    assert cu_seqlens.tolist() == [0, 7, 16, 18] and max_seqlen == 9
    assert seqused.tolist() == lengths
    assert indices.tolist() == [b * seqlen + s for b in range(batch) for s in range(seqlen) if both[b, s]]


def test_unpad_bool_mask_and_float_mask():
    x = torch.randn(2, 5, 3)
    mask = torch.tensor([[True, True, False, False, False], [True, True, True, True, False]])
    for m in (mask, mask.float(), mask.int()):
        packed, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, m)
        assert torch.equal(packed, x[mask]) and cu_seqlens.tolist() == [0, 2, 6] and max_seqlen == 4


@pytest.mark.parametrize("name", ["attention_mask", "unused_mask"])
def test_unpad_refuses_a_mask_of_another_shape(name):
    x = torch.randn(2, 5, 3)
    good, bad = torch.ones(2, 5), torch.ones(2, 4)
    args = (bad, None) if name == "attention_mask" else (good, bad)
    with pytest.raises(ValueError, match=rf"{name} must be \(batch, seqlen\) = \(2, 5\)"):
        unpad_input(x, *args)


def test_index_first_axis_accumulates_repeated_rows():
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([4, 0, 4, 5, 4, 1])
    out = index_first_axis(x, indices)
    assert torch.equal(out, x[indices])
    grad = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, grad)
    expected = torch.zeros_like(x)
    for row, i in enumerate(indices.tolist()):
        expected[i] += grad[row]
    torch.testing.assert_close(gx, expected, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: IndexFirstAxis.apply(t, indices), (x,))


def test_index_put_first_axis():
    values = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([6, 1, 3, 0])
    out = index_put_first_axis(values, indices, 8)
    assert out.shape == (8, 3)
    for row in range(8):
        where = (indices == row).nonzero()
        want = values[where[0, 0]] if where.numel() else torch.zeros(3, dtype=torch.float64)
        assert torch.equal(out[row], want.detach())
    grad = torch.randn_like(out)
    (gv,) = torch.autograd.grad(out, values, grad)
    assert torch.equal(gv, torch.stack([grad[i] for i in indices.tolist()]))
    assert torch.autograd.gradcheck(lambda v: IndexPutFirstAxis.apply(v, indices, 8), (values,))


@pytest.mark.parametrize("use_residual", [True, False], ids=["residual-used", "residual-unused"])
def test_index_first_axis_residual(use_residual):
    """Both outputs' gradients reach the input: the residual's, plus the rows' at their indices."""
    x = torch.randn(7, 2, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([5, 2, 6])
    out, residual = index_first_axis_residual(x, indices)
    assert torch.equal(out, x[indices]) and torch.equal(residual, x)
    g_out, g_res = torch.randn_like(out), torch.randn_like(residual)
    loss = (out * g_out).sum() + ((residual * g_res).sum() if use_residual else 0.0)
    (gx,) = torch.autograd.grad(loss, x)
    x_ref = x.detach().clone().requires_grad_(True)
    loss_ref = (x_ref[indices] * g_out).sum() + ((x_ref * g_res).sum() if use_residual else 0.0)
    (gx_ref,) = torch.autograd.grad(loss_ref, x_ref)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: IndexFirstAxisResidual.apply(t, indices), (x,))


def test_unpad_for_concatenated_sequences_docstring_example():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.randn(3, 6, 4, requires_grad=True)
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    used = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]).bool()
    assert torch.equal(packed, x[used])
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16]
    assert max_seqlen == 6
    grad = torch.randn_like(packed)
    (gx,) = torch.autograd.grad(packed, x, grad)
    expected = torch.zeros_like(x)
    expected[used] = grad
    assert torch.equal(gx, expected)


@pytest.mark.parametrize("seed", range(4))
def test_unpad_for_concatenated_sequences_random(seed):
    """Random packings: each sequence of cu_seqlens is the slice of its row where it was placed."""
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen = 4, 11
    lengths = torch.zeros(batch, seqlen, dtype=torch.int32)
    pieces = []  # (row, start, length) of every sequence, in order
    for b in range(batch):
        start, slot = 0, 0
        while start < seqlen and torch.rand((), generator=gen) < 0.8:
            n = int(torch.randint(1, seqlen - start + 1, (), generator=gen))
            lengths[b, slot] = n
            pieces.append((b, start, n))
            start, slot = start + n, slot + 1
    x = torch.randn(batch, seqlen, 2, 3, generator=gen)
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu_seqlens.tolist() == [0] + torch.tensor([n for _, _, n in pieces]).cumsum(0).tolist()
    assert max_seqlen == max((n for _, _, n in pieces), default=0)
    for i, (b, start, n) in enumerate(pieces):
        assert torch.equal(packed[cu_seqlens[i] : cu_seqlens[i + 1]], x[b, start : start + n])
    assert packed.shape[0] == indices.numel() == sum(n for _, _, n in pieces)


def test_unpad_for_concatenated_sequences_refuses_bad_lengths():
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="at most seqlen"):
        unpad_input_for_concatenated_sequences(x, torch.tensor([[3, 2, 0, 0], [1, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"attention_mask_in_length must be \(batch, seqlen\)"):
        unpad_input_for_concatenated_sequences(x, torch.tensor([[3, 0, 0], [1, 0, 0]]))


def test_surface_matches_flash_attn():
    """Every public name of flash_attn 2.8.3's bert_padding, with its parameter names."""
    import inspect

    names = {
        "IndexFirstAxis",
        "IndexPutFirstAxis",
        "IndexFirstAxisResidual",
        "index_first_axis",
        "index_put_first_axis",
        "index_first_axis_residual",
        "unpad_input",
        "pad_input",
        "unpad_input_for_concatenated_sequences",
    }
    assert names <= set(bert_padding.__all__)
    params = {
        unpad_input: ["hidden_states", "attention_mask", "unused_mask"],
        pad_input: ["hidden_states", "indices", "batch", "seqlen"],
        unpad_input_for_concatenated_sequences: ["hidden_states", "attention_mask_in_length"],
    }
    for fn, expected in params.items():
        assert list(inspect.signature(fn).parameters) == expected
