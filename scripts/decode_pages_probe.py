"""Whether a paged cache reads faster a page at a time for all kv heads than a kv head at a time.

The split kernel's program owns one kv head: with pages of 16 its 128-key tile gathers 128 rows of
``head dim`` values, 256 bytes each at the row stride of all kv heads, from eight pages. A page of 16
holds those rows for every kv head in one contiguous run (16 · nheads_k · head dim values: 32 KiB at 8
heads of 128 in bf16). Two probe kernels stream the same shuffled pool (``tileattn.bench.decode._pool``,
as the benchmark lays it out) with the same tiles (128 rows of head dim), stages and program count, one
table entry read ahead, q·Kᵀ and P·V on the tensor cores and no softmax:

- ``per head``: grid (batch · kv heads, splits), a tile is 128 keys of one kv head (the split kernel's
  pattern);
- ``packed``: grid (batch, splits · kv heads), a tile is one whole page read as 128 contiguous rows.

Their GB/s of K+V in CUDA graphs print next to tileattn's (contiguous and paged) and cuDNN's. If the
packed stream reads clearly faster, a decode build whose programs take whole pages for all kv heads
(block-diagonal scores) is worth writing; if not, the pages' cost is not their gather.

    python scripts/decode_pages_probe.py [--rows 64x4096 64x16384] [--page 16]

Under ``TRITON_INTERPRET=1`` (no GPU: ``--check``) it checks both probes against torch on a tiny pool.
"""

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from decode_ab import gbps_rounds, median_range
from tabulate import tabulate

from tileattn.bench.decode import DECODE_BACKENDS, _pool, capture_graph, decode_inputs


@triton.jit
def _pages_stream(
    Q,
    K,
    V,
    Table,
    Out,
    tiles,
    stride_tb,
    stride_page,
    stride_row,
    nheads_k,
    PAGE: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Per head: program (batch · kv head, split) over key tiles [split · per, ...), the tile's rows
    ``t · BLOCK_N + n`` at page ``Table[b, row // PAGE]``. Packed (PAGE · nheads_k == BLOCK_N): program
    (batch, split) over pages, a tile is the page's BLOCK_N rows of HEAD_DIM in a row."""
    prog = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    if PACKED:
        b = prog
        h = 0
    else:
        b = prog // nheads_k
        h = prog % nheads_k
    offs_m = tl.arange(0, 16)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (prog * 16 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :])
    per_split = tl.cdiv(tiles, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, tiles)
    table = Table + b.to(tl.int64) * stride_tb
    if PACKED:  # one entry per tile; the page's rows in a row
        rows = offs_n * HEAD_DIM
        page = tl.load(table + lo, mask=lo < hi, other=0)
    else:  # a tile's entries; each row's slot in its page, its kv head's values
        rows = (offs_n % PAGE) * stride_row + h * HEAD_DIM
        page = tl.load(table + (lo * BLOCK_N + offs_n) // PAGE, mask=lo < hi, other=0)
    acc = tl.zeros([16, HEAD_DIM], dtype=tl.float32)
    for t in tl.range(lo, hi, num_stages=STAGES):
        here = page.to(tl.int64) * stride_page + rows
        if PACKED:  # the next tile's entry, read ahead
            page = tl.load(table + t + 1, mask=t + 1 < hi, other=0)
        else:
            page = tl.load(table + ((t + 1) * BLOCK_N + offs_n) // PAGE, mask=t + 1 < hi, other=0)
        ptrs = here[:, None] + offs_d[None, :]
        k = tl.load(K + ptrs)
        s = tl.dot(q, tl.trans(k))
        v = tl.load(V + ptrs)
        acc = tl.dot(s.to(v.dtype), v, acc)
    tl.store(Out + ((prog * num_splits + split) * 16 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], acc)


class PagesProbe:
    """One input copy's probe launch over a pool ``(pages, PAGE, nheads_k, d)`` and its table."""

    def __init__(self, kp, vp, table, programs, packed, block_n=128, stages=3):
        pages, page, nheads_k, d = kp.shape
        batch = table.shape[0]
        if packed and page * nheads_k != block_n:
            raise ValueError(f"packed tiles need page · nheads_k == {block_n}, got {page} · {nheads_k}")
        self.kp, self.vp, self.table, self.packed = kp, vp, table, packed
        tiles = table.shape[1] if packed else table.shape[1] * page // block_n
        rows = batch if packed else batch * nheads_k
        splits = max(1, programs // rows)
        self.grid = (rows, splits)
        gen = torch.Generator(device=kp.device).manual_seed(2)
        self.q = torch.randn(rows, 16, d, device=kp.device, generator=gen).to(kp.dtype)
        self.out = torch.empty(rows * splits, 16, d, device=kp.device, dtype=torch.float32)
        self.meta = dict(
            tiles=tiles,
            stride_tb=table.stride(0),
            stride_page=kp.stride(0),
            stride_row=kp.stride(1),
            nheads_k=nheads_k,
            PAGE=page,
            PACKED=packed,
            BLOCK_N=block_n,
            HEAD_DIM=d,
            STAGES=stages,
            num_warps=4,
            num_stages=stages,
        )

    def __call__(self):
        _pages_stream[self.grid](self.q, self.kp, self.vp, self.table, self.out, **self.meta)
        return self.out

    def reference(self):
        """The probe's outputs by torch (fp32): per program and split, the sum over its tiles of (q·Kᵀ in
        the cache's dtype) · V, the tiles' rows gathered as the kernel gathers them."""
        kp, vp, table = self.kp, self.vp, self.table
        pages, page, nheads_k, d = kp.shape
        rows, splits = self.grid
        tiles, block_n = self.meta["tiles"], self.meta["BLOCK_N"]
        per = -(-tiles // splits)
        out = torch.zeros_like(self.out).view(rows, splits, 16, d)
        for r in range(rows):
            b, h = (r, None) if self.packed else divmod(r, nheads_k)
            if self.packed:  # tile t: page table[b, t] as [page · nheads_k, d]
                k_rows, v_rows = kp[table[b].long()].reshape(-1, d), vp[table[b].long()].reshape(-1, d)
            else:  # the sequence's keys of kv head h, in table order
                k_rows, v_rows = kp[table[b].long(), :, h].reshape(-1, d), vp[table[b].long(), :, h].reshape(-1, d)
            for s in range(splits):
                keys = slice(s * per * block_n, min((s + 1) * per, tiles) * block_n)
                scores = (self.q[r].float() @ k_rows[keys].float().T).to(kp.dtype).float()
                out[r, s] = scores @ v_rows[keys].float()
        return out.view_as(self.out)


def _check():
    """Interpreter check of both probes against torch on a tiny shuffled pool (fp16: the interpreter
    multiplies bf16 operands as raw bits, docs/design.md)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 16, generator=gen).half()
    k, v = (torch.randn(2, 64, 4, 16, generator=gen).half() for _ in range(2))
    kp, vp, table, _, _ = _pool(q, k, v, 4)  # pages of 4 keys of 4 kv heads: a packed tile of 16 rows
    for packed in (False, True):
        for programs in (1, 16, 24):
            probe = PagesProbe(kp, vp, table, programs, packed, block_n=16, stages=1)
            torch.testing.assert_close(probe(), probe.reference(), atol=2e-2, rtol=2e-2)
    print("page probes match torch")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["64x4096", "64x16384"])
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--orders",
        nargs="+",
        default=["shuffled"],
        help="where the pool's pages lie (tileattn.bench.decode._pool): shuffled, 'in order', lockstep, or a "
        "number of pages within whose runs they are shuffled",
    )
    ap.add_argument("--packed", nargs="+", type=int, default=[0, 1], help="1: whole pages, 0: a kv head at a time")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--check", action="store_true", help="check the probes under the interpreter and stop")
    args = ap.parse_args()
    if args.check:
        return _check()
    table = []
    for row in args.rows:
        batch, cache_len = (int(n) for n in row.split("x"))
        inputs, seqlens, kv_bytes = decode_inputs(batch, cache_len)
        nheads_k = inputs[0][1].shape[2]
        programs = batch * nheads_k * max(1, 132 // (batch * nheads_k))  # (one program per kv head, or a wave)
        graphs, probes = {}, []  # (a graph replays its probes' tables, q and outputs: they live as long)
        for name in ("tileattn", f"tileattn paged{args.page}", "sdpa-cudnn"):
            calls = [DECODE_BACKENDS[name](q, kc, vc, seqlens)[0] for q, kc, vc in inputs]
            graphs[name], _ = capture_graph(calls)
            probes.append(calls)  # (the paged calls' tables)
        for order in (int(o) if o.isdigit() else o for o in args.orders):
            pools = [_pool(q, kc, vc, args.page, order)[:3] for q, kc, vc in inputs]
            for stages in args.stages:
                for packed in args.packed:
                    made = [PagesProbe(kp, vp, tb, programs, packed, stages=stages) for kp, vp, tb in pools]
                    made[0]()
                    out, ref = made[0].out, made[0].reference()
                    torch.testing.assert_close(out, ref, atol=1e-2 * ref.abs().amax().item(), rtol=2e-2)
                    kind = "packed" if packed else "per head"
                    where = f", pages {order}" if len(args.orders) > 1 else ""
                    graphs[f"probe {kind}, {stages} stages, grid {made[0].grid}{where}"], _ = capture_graph(made)
                    probes.append(made)
        rounds = gbps_rounds(graphs, len(inputs), kv_bytes, args.rounds)
        for name, vals in rounds.items():
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(dict(row=row, variant=name, gbps=vals)) + "\n")
            table.append([row, name, median_range(vals)])
        del graphs, probes, inputs
        torch.cuda.empty_cache()
    print(tabulate(table, headers=["row", "kernel", "GB/s"], tablefmt="github"))


if __name__ == "__main__":
    main()
