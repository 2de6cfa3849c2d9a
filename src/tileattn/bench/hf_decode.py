"""Greedy decoding of a Hugging Face model (``--hf-decode``): tokens/s of a Llama-style model with the
static cache and the decode step compiled, ``attn_implementation="tileattn"`` against ``"sdpa"``.

On a GPU: Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 heads over 8 KV heads of 64, MLP 8192,
vocabulary 128256), random bf16 weights, batch 1 and 16, a 512-token prompt, 128 new tokens. The
prompt's forward (prefill) runs eagerly; the one-token decode step runs ``torch.compile(mode=
"reduce-overhead")`` (CUDA graphs), as transformers' ``generate`` compiles it with a static cache. On a
CPU: a tiny shape, and the decode step eager (reduce-overhead's CUDA graphs do not exist there, and
inductor's C++ build of a whole model costs minutes), so the harness runs anywhere and in the tests.

Before timing, the first decode step's logits of each backend pass the tolerance rule against the same
model in fp32 with eager attention (the bf16 ``"sdpa"`` run is the plain-PyTorch baseline; on CPU, fp64
eager and fp32 ``"sdpa"``). Tokens/s: batch × steps over the wall time of the decode steps (compiled
steps warmed up first: the graphs are recorded before the clock starts).
"""

from __future__ import annotations

import inspect
import time

import torch

from tileattn.testing import check_close

GPU_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
)
CPU_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
)
BACKENDS = ("tileattn", "sdpa")


def _config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False)


def _model(shape, impl, dtype, device):
    from transformers import AutoModelForCausalLM

    import tileattn.integrations.transformers  # noqa: F401  (registers "tileattn")

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(shape), attn_implementation=impl, dtype=dtype)
    return model.to(device).eval()


class Decoder:
    """Greedy decoding with a static cache: ``prefill(prompt)`` then ``step()`` per token, the step
    optionally compiled (``mode``)."""

    def __init__(self, model, batch, max_len, device, mode=None):
        from transformers import StaticCache

        self.model, self.device = model, device
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.forward = torch.compile(model.forward, mode=mode, fullgraph=True) if mode else model.forward
        # (the cache's keyword: ``cache`` in newer transformers, ``past_key_values`` before)
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)

    @torch.no_grad()
    def prefill(self, prompt):
        self.cache.reset()
        positions = torch.arange(prompt.shape[1], device=self.device).expand(prompt.shape[0], -1)
        logits = self.model(prompt, position_ids=positions, use_cache=True, **{self.cache_kw: self.cache}).logits[:, -1]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.position.fill_(prompt.shape[1])
        return logits

    @torch.no_grad()
    def step(self):
        kwargs = {self.cache_kw: self.cache}
        logits = self.forward(self.token, position_ids=self.position, use_cache=True, **kwargs).logits[:, -1]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.position.add_(1)
        return logits


def _first_step_logits(shape, impl, dtype, device, prompt, max_len):
    decoder = Decoder(_model(shape, impl, dtype, device), prompt.shape[0], max_len, device)
    decoder.prefill(prompt)
    return decoder.step().float()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_hf_decode(
    device="cuda",
    batches=(1, 16),
    prompt_len=None,
    new_tokens=None,
    shape=None,
    compile_mode="default",
    dtype=None,
    progress=print,
):
    """Rows of ``kind='hf_decode'`` (``backend`` tileattn or sdpa, ``batch``): ``tokens_per_s`` and
    ``ms_per_step`` of the decode steps, ``compiled`` (the mode, or None). ``compile_mode="default"``:
    reduce-overhead on CUDA, none on CPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    shape = shape or (GPU_SHAPE if cuda else CPU_SHAPE)
    prompt_len = prompt_len or (512 if cuda else 16)
    new_tokens = new_tokens or (128 if cuda else 8)
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    mode = ("reduce-overhead" if cuda else None) if compile_mode == "default" else compile_mode
    ref_dtype, ref_impl = (torch.float32, "eager") if cuda else (torch.float64, "eager")
    max_len = prompt_len + new_tokens + 1
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, shape["vocab_size"], (batch, prompt_len), generator=gen).to(device)
        ref = _first_step_logits(shape, ref_impl, ref_dtype, device, prompt, max_len)
        lowp = _first_step_logits(shape, "sdpa", dtype, device, prompt, max_len)
        for impl in BACKENDS:
            decoder = Decoder(_model(shape, impl, dtype, device), batch, max_len, device, mode)
            decoder.prefill(prompt)
            check_close(f"{impl} first decode step, batch {batch}", decoder.step().float(), ref, lowp)
            for _ in range(3 if mode else 1):  # (compiled: the graphs are recorded in these)
                decoder.prefill(prompt)
                for _ in range(min(3, new_tokens)):
                    decoder.step()
            decoder.prefill(prompt)
            _sync(device)
            start = time.perf_counter()
            for _ in range(new_tokens):
                decoder.step()
            _sync(device)
            seconds = time.perf_counter() - start
            row = dict(
                kind="hf_decode",
                backend=impl,
                batch=batch,
                prompt_len=prompt_len,
                new_tokens=new_tokens,
                hidden=shape["hidden_size"],
                layers=shape["num_hidden_layers"],
                dtype=str(dtype).replace("torch.", ""),
                device=device.type,
                compiled=mode,
                ms_per_step=seconds / new_tokens * 1e3,
                tokens_per_s=batch * new_tokens / seconds,
            )
            rows.append(row)
            progress(f"{impl} batch {batch}: {row['tokens_per_s']:.1f} tokens/s")
            del decoder
    return rows


def format_hf_decode(rows) -> str:
    from tabulate import tabulate

    sdpa = {r["batch"]: r["tokens_per_s"] for r in rows if r["backend"] == "sdpa"}
    table = [
        [
            r["backend"],
            r["batch"],
            r["compiled"] or "no",
            f"{r['ms_per_step']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_per_s'] / sdpa[r['batch']]:.2f}" if r["batch"] in sdpa else "-",
        ]
        for r in rows
    ]
    headers = ["attn_implementation", "batch", "compiled", "ms / step", "tokens/s", "× sdpa"]
    return tabulate(table, headers=headers, tablefmt="github")
