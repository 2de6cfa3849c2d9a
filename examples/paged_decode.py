"""Serving a small decoder with a paged KV cache: prefill, batched decoding of sequences of different
lengths, and a fork that shares its parent's prefix, checked step by step against the same model run
without a cache.

The model is randomly initialised (2 layers, GQA with 8 query / 2 kv heads, rotary embeddings in GPT-NeoX
style). Each sequence is prefilled on its own, then all of them decode together, one token per step,
through ``PagedKVCache`` + ``flash_attn_with_kvcache`` (which rotates and appends the new keys in
place). At every step each sequence's logits are compared with a full causal forward over its whole
history (``flash_attn_func``, no cache).

    python examples/paged_decode.py            # GPU (bf16) if present, else CPU (fp32)
    python examples/paged_decode.py --device cpu --steps 4
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

import tileattn
from tileattn.cache import PagedKVCache
from tileattn.rotary import apply_rotary_emb


class TinyDecoder(nn.Module):
    def __init__(self, vocab=101, d_model=128, nheads=8, nheads_k=2, layers=2, max_len=256):
        super().__init__()
        self.nheads, self.nheads_k, self.headdim = nheads, nheads_k, d_model // nheads
        self.embed = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(2 * layers))
        self.qkv = nn.ModuleList(
            nn.Linear(d_model, (nheads + 2 * nheads_k) * self.headdim, bias=False) for _ in range(layers)
        )
        self.proj = nn.ModuleList(nn.Linear(d_model, d_model, bias=False) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, vocab, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, self.headdim, 2).float() / self.headdim)
        angles = torch.outer(torch.arange(max_len).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _split(self, x, layer):
        b, n, _ = x.shape
        q, k, v = self.qkv[layer](x).split(
            [self.nheads * self.headdim, self.nheads_k * self.headdim, self.nheads_k * self.headdim], -1
        )
        return (
            q.view(b, n, self.nheads, self.headdim),
            k.view(b, n, self.nheads_k, self.headdim),
            v.view(b, n, self.nheads_k, self.headdim),
        )

    def _block(self, x, layer, attend):
        h = self.norms[2 * layer](x)
        q, k, v = self._split(h, layer)
        a = attend(q, k, v).flatten(2)
        x = x + self.proj[layer](a)
        return x + self.mlp[layer](self.norms[2 * layer + 1](x))

    def forward_full(self, tokens):
        """Logits of every position, no cache: rotary at positions 0.. and causal attention."""
        cos, sin = self.cos.to(self.embed.weight.dtype), self.sin.to(self.embed.weight.dtype)

        def attend(q, k, v):
            q = apply_rotary_emb(q, cos, sin, interleaved=False)
            k = apply_rotary_emb(k, cos, sin, interleaved=False)
            return tileattn.flash_attn_func(q, k, v, causal=True)

        x = self.embed(tokens)
        for layer in range(len(self.qkv)):
            x = self._block(x, layer, attend)
        return self.head(x)

    def forward_cached(self, tokens, step):
        """Logits of the new tokens ``(batch, n)`` given a ``CacheStep`` that made room for them."""
        cos, sin = self.cos.to(self.embed.weight.dtype), self.sin.to(self.embed.weight.dtype)
        x = self.embed(tokens)
        for layer in range(len(self.qkv)):

            def attend(q, k, v, layer=layer):
                return tileattn.flash_attn_with_kvcache(
                    q,
                    k=k,
                    v=v,
                    rotary_cos=cos,
                    rotary_sin=sin,
                    rotary_interleaved=False,
                    causal=True,
                    **step.kwargs(layer),
                )

            x = self._block(x, layer, attend)
        return self.head(x)


def run(device: str, dtype: torch.dtype, steps: int = 12, page_size: int = 4, seed: int = 0, verbose: bool = True):
    """Generates greedily for prompts of different lengths (and a fork); returns the largest logit
    difference between the cached and the uncached model relative to the logits' magnitude."""
    torch.manual_seed(seed)
    model = TinyDecoder().to(device=device, dtype=dtype).eval()
    cache = PagedKVCache(
        num_layers=2, num_pages=64, page_size=page_size, nheads_k=2, headdim=16, dtype=dtype, device=device
    )
    prompts = [torch.randint(0, 101, (n,)).tolist() for n in (5, 11, 3)]
    history: dict[int, list[int]] = {}
    worst = 0.0

    def check(seq_id, logits):
        nonlocal worst
        full = model.forward_full(torch.tensor([history[seq_id]], device=device))[0, -1]
        err = (logits.float() - full.float()).abs().max().item() / full.float().abs().max().item()
        worst = max(worst, err)

    with torch.no_grad():
        next_token: dict[int, int] = {}
        second_choice: dict[int, int] = {}
        for prompt in prompts:  # prefill, one sequence at a time
            seq = cache.add_sequence()
            history[seq] = list(prompt)
            step = cache.append(seq, len(prompt))
            logits = model.forward_cached(torch.tensor([prompt], device=device), step)[0, -1]
            check(seq, logits)
            next_token[seq] = int(logits.argmax())
            second_choice[seq] = int(logits.topk(2).indices[1])
        for t in range(steps):
            if t == 4:  # fork the first sequence; the fork takes its second choice from here
                child = cache.fork(0)
                history[child] = list(history[0])
                next_token[child] = second_choice[0]
            ids = sorted(next_token)
            for seq in ids:
                history[seq].append(next_token[seq])
            step = cache.append(ids, 1)
            tokens = torch.tensor([[next_token[s]] for s in ids], device=device)
            logits = model.forward_cached(tokens, step)[:, -1]
            for row, seq in enumerate(ids):
                check(seq, logits[row])
                next_token[seq] = int(logits[row].argmax())
                second_choice[seq] = int(logits[row].topk(2).indices[1])
    if verbose:
        for seq in sorted(history):
            print(f"sequence {seq}: {len(history[seq])} tokens, pages {cache.pages(seq)}: {history[seq]}")
        print(f"pool: {cache.num_free_pages} of {cache.num_pages} pages free")
        print(f"max |cached - uncached| / max |logits| over all steps: {worst:.2e}")
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if PyTorch sees a GPU, else cpu)",
    )
    ap.add_argument("--steps", type=int, default=12, help="decoding steps after the prompts, 0 to 200 (default: 12)")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r} is not a device PyTorch knows; use cuda or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: PyTorch sees no CUDA GPU here; use --device cpu (the default here)")
    if device.type not in ("cuda", "cpu"):
        ap.error(f"--device {args.device}: tileattn runs on cuda or cpu")
    if not 0 <= args.steps <= 200:  # the model's rotary tables hold 256 positions, the longest prompt 11
        ap.error(f"--steps must be between 0 and 200, got {args.steps}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    worst = run(device, dtype, args.steps)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not math.isfinite(worst) or worst > tol:
        raise SystemExit(f"cached and uncached logits differ by {worst:.2e} (tolerance {tol:.0e})")
    print("cached decoding matches the uncached model")


if __name__ == "__main__":
    main()
