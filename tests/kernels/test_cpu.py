"""The CPU path (tileattn/cpu.py) beyond the cases every backend runs: float32 inputs, sequences of several
row and key blocks (its online softmax across blocks), and memory that grows linearly with the sequence
(no seqlen x seqlen matrix)."""

import pytest
import torch

import tileattn
from helpers import check_attention, on, randn
from tileattn import cpu


def test_cpu_path_float32():
    """The CPU path also takes float32 (compared against float64)."""
    ctx, device = on("torch")
    q, k, v = (randn(2, 77, 4, 48, dtype=torch.float32, device="cpu") for _ in range(3))
    dout = torch.randn_like(q)
    with ctx:
        out = tileattn.flash_attn_func(q, k, v, causal=True, softcap=3.0)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_attention("fp32", out, grads, q, k, v, dout, {"causal": True, "softcap": 3.0})


@pytest.mark.parametrize(
    "feats",
    [{}, {"causal": True}, {"window_size": (300, 20)}, {"softcap": 4.0, "causal": True}, {"dropout_p": 0.2}],
    ids=["full", "causal", "window", "softcap", "dropout"],
)
def test_cpu_path_across_blocks(feats):
    """Queries over two row blocks and keys over three key blocks (cpu.BLOCK_M, cpu.BLOCK_N): the online
    softmax carried across key blocks, forward and backward, against the oracle (GQA, fp16)."""
    ctx, _ = on("torch")
    sq, sk = cpu.BLOCK_M + 61, 2 * cpu.BLOCK_N + 77
    q = randn(1, sq, 4, 32, dtype=torch.float16, device="cpu")
    k, v = (randn(1, sk, 2, 32, dtype=torch.float16, device="cpu") for _ in range(2))
    dout = torch.randn_like(q)
    with ctx:
        out, _, s_dmask = tileattn.flash_attn_func(q, k, v, return_attn_probs=True, **feats)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    if feats.get("dropout_p"):
        feats = dict(feats, dropout_mask=s_dmask >= 0)
    check_attention(f"across blocks {feats}", out, grads, q, k, v, dout, feats)


def test_cpu_path_memory_is_linear():
    """The CPU path never allocates a seqlen x seqlen matrix: forward and backward over one
    16k-token sequence (whose fp32 score matrix alone is 1 GiB) raise the peak RSS by far less."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import resource, torch, tileattn
        from tileattn.api import cpu_backend
        q = torch.randn(1, 16384, 1, 16, requires_grad=True)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with cpu_backend("torch"):
            out = tileattn.flash_attn_func(q, q, q, causal=True)
            out.sum().backward()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    grown_mib = int(
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
        ).stdout.split()[-1]
    )
    assert grown_mib < 256, f"peak RSS grew by {grown_mib} MiB"
