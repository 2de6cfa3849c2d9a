"""Training one attention layer on a sequence split across processes (context parallelism), checked
against the same layer on the whole sequence in one process.

Every rank holds a slice of the tokens (the zigzag layout: ``zigzag_shard``), projects them to q, k, v
(GQA, rotary positions of its own tokens), runs ``zigzag_ring_flash_attn_func`` (or ``ring`` /
``ulysses``), and backpropagates a loss on its tokens; the weight gradients are summed over the ranks
(``all_reduce``, as data-parallel training would). The reference runs the layer on the whole sequence
with ``flash_attn_func``: the output (gathered back with ``zigzag_unshard``) and the weight gradients must
agree within the rounding of the dtype.

    python examples/context_parallel.py                      # 2 GPUs (NCCL) if the host has them, else 2 CPU processes
    python examples/context_parallel.py --world 4 --scheme ulysses --seqlen 384   # 8 heads, 2 per rank

Ulysses splits the heads: its world size must divide the layer's 8 query heads and be a multiple or a
divisor of its 2 kv heads (1, 2, 4 or 8); ring and zigzag take any world size. Zigzag cuts the sequence
in 2 x world equal chunks, ring and Ulysses in world.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tileattn import distributed as cp
from tileattn import flash_attn_func
from tileattn.rotary import apply_rotary_emb

SCHEMES = {
    "zigzag": (cp.zigzag_ring_flash_attn_func, cp.zigzag_shard, cp.zigzag_unshard),
    "ring": (cp.ring_flash_attn_func, cp.ring_shard, cp.ring_unshard),
    "ulysses": (cp.ulysses_flash_attn_func, cp.ring_shard, cp.ring_unshard),
}


NHEADS, NHEADS_K = 8, 2  # the layer's query and kv heads (GQA)


def refusal(world: int, scheme: str, seqlen: int) -> str | None:
    """Why ``world`` ranks cannot run ``scheme`` on ``seqlen`` tokens with this layer, or None."""
    if world < 1:
        return f"--world must be at least 1, got {world}"
    chunks = 2 * world if scheme == "zigzag" else world
    if seqlen < 1 or seqlen % chunks:
        return f"--seqlen {seqlen}: {scheme} over {world} ranks cuts the sequence in {chunks} equal chunks"
    if scheme == "ulysses" and (NHEADS % world or (NHEADS_K % world and world % NHEADS_K)):
        return (
            f"--world {world}: Ulysses gives each rank nheads / world of the layer's {NHEADS} heads ({NHEADS_K} kv "
            f"heads), so the world size must divide {NHEADS} and be a multiple or a divisor of {NHEADS_K}: 1, 2, 4 "
            "or 8 (ring and zigzag take any)"
        )
    return None


class Attention(nn.Module):
    def __init__(self, d_model=256, nheads=NHEADS, nheads_k=NHEADS_K):
        super().__init__()
        self.nheads, self.nheads_k, self.headdim = nheads, nheads_k, d_model // nheads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wkv = nn.Linear(d_model, 2 * nheads_k * self.headdim, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, positions, attend):
        """``x (batch, tokens, d_model)`` at ``positions`` (the tokens' places in the whole sequence)."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.nheads, self.headdim)
        k, v = self.wkv(x).view(b, s, 2, self.nheads_k, self.headdim).unbind(2)
        freqs = 10000 ** (-torch.arange(0, self.headdim, 2, device=x.device) / self.headdim)
        angles = positions[:, None].to(freqs.dtype) * freqs
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        return self.wo(attend(q, k, v).reshape(b, s, -1))


def rank_main(rank: int, world: int, store: str, scheme: str, seqlen: int, queue) -> None:
    cuda = torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:  # the ranks share the cores: a thread each (more would wait on each other)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = torch.bfloat16 if cuda else torch.float32
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    fn, shard, unshard = SCHEMES[scheme]

    torch.manual_seed(0)  # the same weights and tokens on every rank
    layer = Attention().to(device, dtype)
    x = torch.randn(2, seqlen, 256, device=device, dtype=dtype)
    target = torch.randn_like(x)
    positions = torch.arange(seqlen, device=device)

    # the whole sequence in this process: the reference
    ref = layer(x, positions, lambda q, k, v: flash_attn_func(q, k, v, causal=True))
    ((ref - target) ** 2).mean().backward()
    ref_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()

    # this rank's tokens only
    out = layer(shard(x, 1), shard(positions, 0), lambda q, k, v: fn(q, k, v, causal=True))
    (((out - shard(target, 1)) ** 2).sum() / target.numel()).backward()  # this rank's share of the mean
    for p in layer.parameters():
        dist.all_reduce(p.grad)
    out = unshard(out.detach(), 1)
    if rank == 0:
        eps = torch.finfo(dtype).eps
        out_err = ((out - ref).abs().max() / ref.abs().max()).item()
        grad_err = max(((g - p.grad).abs().max() / g.abs().max()).item() for g, p in zip(ref_grads, layer.parameters()))
        queue.put((out_err / eps, grad_err / eps, str(device.type), str(dtype)))
    dist.barrier()  # every rank done before any tears the group down
    dist.destroy_process_group()


def run(world: int = 2, scheme: str = "zigzag", seqlen: int = 256) -> tuple[float, float]:
    """Spawns the ranks; returns the relative errors of the output and of the worst weight gradient, in
    units of the dtype's epsilon."""
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        args = (world, os.path.join(d, "store"), scheme, seqlen, queue)
        mp.start_processes(rank_main, args=args, nprocs=world, start_method="spawn")
    out_err, grad_err, device, dtype = queue.get()
    print(f"{scheme} over {world} ranks ({device}, {dtype}): output within {out_err:.1f} eps, weight gradients "
          f"within {grad_err:.1f} eps of the single-process layer")  # fmt: skip
    return out_err, grad_err


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--world", type=int, default=2, help="ranks: GPUs if the host has as many, else CPU processes (default: 2)"
    )
    ap.add_argument(
        "--scheme", choices=list(SCHEMES), default="zigzag", help="how the ranks split the work (default: zigzag)"
    )
    ap.add_argument("--seqlen", type=int, default=256, help="tokens of the whole sequence (default: 256)")
    args = ap.parse_args(argv)
    why = refusal(args.world, args.scheme, args.seqlen)
    if why:  # (before any process starts)
        ap.error(why)
    out_err, grad_err = run(args.world, args.scheme, args.seqlen)
    if out_err > 4 or grad_err > 16:
        raise SystemExit("context-parallel layer disagrees with the single-process layer")
    print("context-parallel attention matches the single-process layer")


if __name__ == "__main__":
    main()
