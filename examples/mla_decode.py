"""Generating with a multi-head latent attention (MLA) layer, DeepSeek-V2 style, over a paged latent
cache, checked step by step against the same layer computed without absorption and without a cache.

The layer (random weights) projects each token to a 512-wide latent ``c_kv`` (normalised) and a 64-wide
rotary key ``k_pe`` shared by all heads; per head, keys are ``[W_uk c_kv, k_pe]`` and values ``W_uv
c_kv``. Only ``[c_kv, k_pe]`` (576 values a token) is cached, in a ``PagedKVCache(values=False)``.
Decoding absorbs ``W_uk`` into the query and ``W_uv`` into the output, so attention runs on the cache
rows themselves (``tileattn.mla.flash_mla_with_kvcache``: keys the 576-wide rows, values their first 512
dims). The reference expands every head's keys and values from the latents of the whole history and
runs plain causal attention, at every step.

    python examples/mla_decode.py            # GPU (bf16) if present, else CPU (fp32)
    python examples/mla_decode.py --device cpu --steps 4
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from tileattn.cache import PagedKVCache
from tileattn.mla import flash_mla_with_kvcache, get_mla_metadata
from tileattn.rotary import apply_rotary_emb

KV_RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128  # DeepSeek-V2's latent, rotary, per-head key and value dims


class MLADecoder(nn.Module):
    """Embedding, one MLA layer with a residual and an MLP, and the logits."""

    def __init__(self, vocab=101, d_model=256, nheads=16, max_len=512):
        super().__init__()
        self.nheads = nheads
        self.embed = nn.Embedding(vocab, d_model)
        self.norm, self.norm_kv, self.norm_out = nn.LayerNorm(d_model), nn.LayerNorm(KV_RANK), nn.LayerNorm(d_model)
        self.w_q = nn.Linear(d_model, nheads * (NOPE + ROPE), bias=False)
        self.w_dkv = nn.Linear(d_model, KV_RANK + ROPE, bias=False)
        self.w_uk = nn.Parameter(torch.randn(nheads, NOPE, KV_RANK) / math.sqrt(KV_RANK))
        self.w_uv = nn.Parameter(torch.randn(nheads, V_DIM, KV_RANK) / math.sqrt(KV_RANK))
        self.w_o = nn.Linear(nheads * V_DIM, d_model, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.scale = (NOPE + ROPE) ** -0.5
        inv_freq = 1.0 / 10000 ** (torch.arange(0, ROPE, 2).float() / ROPE)
        angles = torch.outer(torch.arange(max_len).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _project(self, x, positions):
        """Per-head query parts ``(b, n, h, NOPE)``, ``(b, n, h, ROPE)`` and the cached parts ``c_kv (b, n,
        KV_RANK)``, ``k_pe (b, n, ROPE)``, rotary applied at ``positions`` (b, n)."""
        b, n, _ = x.shape
        q = self.w_q(x).view(b, n, self.nheads, NOPE + ROPE)
        q_nope, q_pe = q.split([NOPE, ROPE], -1)
        c_kv, k_pe = self.w_dkv(x).split([KV_RANK, ROPE], -1)
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)  # (b, n, ROPE / 2)

        def rotate(t):  # GPT-NeoX halves, each token at its own position
            return torch.stack(
                [apply_rotary_emb(t[i : i + 1], cos[i], sin[i], interleaved=False) for i in range(b)]
            ).squeeze(1)

        return q_nope, rotate(q_pe), self.norm_kv(c_kv), rotate(k_pe.unsqueeze(2)).squeeze(2)

    def _block(self, x, attend):
        x = x + self.w_o(attend(self.norm(x)).flatten(2))
        return x + self.mlp(self.norm_out(x))

    def forward_full(self, tokens):
        """Logits of every position of ``tokens (1, n)``: every head's keys and values expanded from the
        latents, plain causal attention in fp32, no cache."""

        def attend(h):
            positions = torch.arange(h.shape[1], device=h.device)[None]
            q_nope, q_pe, c_kv, k_pe = self._project(h, positions)
            k_nope = torch.einsum("bsc,hdc->bshd", c_kv, self.w_uk)
            v = torch.einsum("bsc,hdc->bshd", c_kv, self.w_uv)
            q = torch.cat([q_nope, q_pe], -1).float()
            k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, self.nheads, -1)], -1).float()
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
            n = scores.shape[-1]
            hidden = torch.ones(n, n, dtype=torch.bool, device=h.device).triu(1)
            probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
            return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(h.dtype)

        return self.head(self._block(self.embed(tokens), attend))

    def forward_cached(self, tokens, step, layer=0):
        """Logits of the new tokens ``(batch, n)`` given the ``CacheStep`` that made room for them: the
        latents are written into the pool, and attention runs on the cache with the projections absorbed."""

        def attend(h):
            positions = step.cache_seqlens[:, None].long() + torch.arange(h.shape[1], device=h.device)
            q_nope, q_pe, c_kv, k_pe = self._project(h, positions)
            step.write(layer, torch.cat([c_kv, k_pe], -1).unsqueeze(2))  # (b, n, 1, 576)
            q_latent = torch.einsum("bnhd,hdc->bnhc", q_nope, self.w_uk)  # W_uk absorbed into the query
            q = torch.cat([q_latent, q_pe], -1)  # (b, n, h, 576)
            kw = step.mla_kwargs(layer)
            metadata, num_splits = get_mla_metadata(kw["cache_seqlens"], q.shape[1] * self.nheads, 1)
            out, _ = flash_mla_with_kvcache(
                q, head_dim_v=KV_RANK, tile_scheduler_metadata=metadata, num_splits=num_splits,
                softmax_scale=self.scale, causal=True, **kw,
            )  # fmt: skip
            return torch.einsum("bnhc,hdc->bnhd", out, self.w_uv)  # W_uv absorbed into the output

        return self.head(self._block(self.embed(tokens), attend))


def run(device, dtype: torch.dtype, steps: int = 12, page_size: int = 16, seed: int = 0, verbose: bool = True):
    """Generates greedily for prompts of different lengths, decoding them together; returns the largest
    logit difference between the cached and the uncached model relative to the logits' magnitude."""
    torch.manual_seed(seed)
    model = MLADecoder().to(device=device, dtype=dtype).eval()
    cache = PagedKVCache(1, 64, page_size, 1, KV_RANK + ROPE, dtype=dtype, device=device, values=False)
    prompts = [torch.randint(0, 101, (n,)).tolist() for n in (7, 20, 2)]
    history: dict[int, list[int]] = {}
    worst = 0.0

    def check(seq_id, logits):
        nonlocal worst
        full = model.forward_full(torch.tensor([history[seq_id]], device=device))[0, -1]
        err = (logits.float() - full.float()).abs().max().item() / full.float().abs().max().item()
        worst = max(worst, err)

    with torch.no_grad():
        next_token: dict[int, int] = {}
        for prompt in prompts:  # prefill, one sequence at a time (causal among the prompt's tokens)
            seq = cache.add_sequence()
            history[seq] = list(prompt)
            logits = model.forward_cached(torch.tensor([prompt], device=device), cache.append(seq, len(prompt)))
            check(seq, logits[0, -1])
            next_token[seq] = int(logits[0, -1].argmax())
        for _ in range(steps):
            ids = sorted(next_token)
            for seq in ids:
                history[seq].append(next_token[seq])
            tokens = torch.tensor([[next_token[s]] for s in ids], device=device)
            logits = model.forward_cached(tokens, cache.append(ids, 1))[:, -1]
            for row, seq in enumerate(ids):
                check(seq, logits[row])
                next_token[seq] = int(logits[row].argmax())
    if verbose:
        for seq in sorted(history):
            print(f"sequence {seq}: {len(history[seq])} tokens, pages {cache.pages(seq)}: {history[seq]}")
        print(f"max |cached - uncached| / max |logits| over all steps: {worst:.2e}")
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if PyTorch sees a GPU, else cpu)",
    )
    ap.add_argument("--steps", type=int, default=12, help="decoding steps after the prompts, 0 to 400 (default: 12)")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r} is not a device PyTorch knows; use cuda or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: PyTorch sees no CUDA GPU here; use --device cpu (the default here)")
    if device.type not in ("cuda", "cpu"):
        ap.error(f"--device {args.device}: tileattn runs on cuda or cpu")
    if not 0 <= args.steps <= 400:  # the rotary tables hold 512 positions, the longest prompt 20
        ap.error(f"--steps must be between 0 and 400, got {args.steps}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    worst = run(device, dtype, args.steps)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not math.isfinite(worst) or worst > tol:
        raise SystemExit(f"cached and uncached logits differ by {worst:.2e} (tolerance {tol:.0e})")
    print("absorbed MLA decoding over the paged latent cache matches the uncached layer")


if __name__ == "__main__":
    main()
