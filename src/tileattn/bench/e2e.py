"""Training steps of Hugging Face models end to end (``--e2e``): tokens per second of real tokens,
``attn_implementation="tileattn"`` against ``"sdpa"``, in one process, the implementations alternating.

Models are made from their configs (random weights; the speed does not depend on them), trained in bf16
autocast with AdamW on random tokens. Cases:
- BERT-large (24 layers, hidden 1024, 16 heads of 64), masked-LM loss, seqlen 512, batch 32, dropout 0.1:
  ``full`` rows (every token real), ``padded`` rows (lengths uniform in 128..512, an ``attention_mask``;
  tileattn attends to the real tokens only, SDPA to the padded rows), and ``packed`` rows (the same real
  tokens concatenated into one row, ``position_ids`` restarting and the flash kwargs of transformers'
  ``DataCollatorWithFlattening``; tileattn only, against SDPA's padded rows);
- GPT-2 small (12 layers, hidden 768), causal LM, seqlen 1024, batch 16, dropout 0 and 0.1;
- a Llama-style model with GQA (4 layers, hidden 2048, 16 query heads on 4 kv heads of 128), causal LM,
  16k tokens per batch at seqlens 1k, 4k and 8k.
Each case runs ``warmup`` steps, then ``steps`` steps timed (a synchronize at each end), per implementation
in ``rounds`` alternating rounds; the median round. Before timing, both implementations' first-step losses
are compared (the same weights and data: they must agree to a bf16 model's noise).
"""

from __future__ import annotations

import statistics
import time

import torch

BERT = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
GPT2 = dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024)
LLAMA = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
    max_position_embeddings=8192,
)  # fmt: skip


def _model(kind: str, impl: str, device, dropout: float, small: bool):
    """A model of ``kind`` made from its config with the attention implementation ``impl``."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, BertConfig, GPT2Config, LlamaConfig

    import tileattn.integrations.transformers  # noqa: F401  (registers "tileattn")

    torch.manual_seed(0)
    if kind == "bert":
        sizes = (
            dict(BERT, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
            if small
            else BERT
        )
        cfg = BertConfig(vocab_size=30522, attention_probs_dropout_prob=dropout, hidden_dropout_prob=dropout, **sizes)
        model = AutoModelForMaskedLM.from_config(cfg, attn_implementation=impl)
    elif kind == "gpt2":
        sizes = dict(GPT2, n_layer=2, n_embd=64, n_head=4) if small else GPT2
        cfg = GPT2Config(vocab_size=50257, attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout, **sizes)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    else:
        sizes = (
            dict(LLAMA, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
            if small
            else LLAMA
        )
        cfg = LlamaConfig(vocab_size=32000, attention_dropout=dropout, **sizes)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    return model.to(device).train()


def _batches(kind: str, layout: str, batch: int, seqlen: int, vocab: int, device, gen) -> tuple[dict, int]:
    """The model inputs of one step and its real tokens."""
    if layout == "full":
        ids = torch.randint(0, vocab, (batch, seqlen), device=device, generator=gen)
        return dict(input_ids=ids, labels=ids), batch * seqlen
    lengths = torch.randint(seqlen // 4, seqlen + 1, (batch,), device="cpu", generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, vocab, (batch, seqlen), device=device, generator=gen)
    real = int(lengths.sum())
    if layout == "padded":
        mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).to(device)
        labels = ids.masked_fill(~mask, -100)
        return dict(input_ids=ids, attention_mask=mask.long(), labels=labels), real
    # packed: the real tokens in one row, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them
    rows = [ids[b, : int(n)] for b, n in enumerate(lengths)]
    flat = torch.cat(rows)[None]
    position_ids = torch.cat([torch.arange(int(n), device=device) for n in lengths])[None]
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)]).to(device)
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lengths.max()), max_length_k=int(lengths.max()))
    return dict(input_ids=flat, position_ids=position_ids, labels=flat, **kwargs), real


def _step(model, opt, inputs: dict) -> torch.Tensor:
    """One training step, in bf16 autocast on CUDA (fp32 on the CPU path, the test suite's)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
        loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


CASES = [
    # (name, kind, layout, batch, seqlen, dropout, implementations)
    ("bert-large full", "bert", "full", 32, 512, 0.1, ("tileattn", "sdpa")),
    ("bert-large padded", "bert", "padded", 32, 512, 0.1, ("tileattn", "sdpa")),
    ("bert-large packed", "bert", "packed", 32, 512, 0.1, ("tileattn",)),
    ("gpt2 p=0", "gpt2", "full", 16, 1024, 0.0, ("tileattn", "sdpa")),
    ("gpt2 p=0.1", "gpt2", "full", 16, 1024, 0.1, ("tileattn", "sdpa")),
    ("llama-gqa 1k", "llama", "full", 16, 1024, 0.0, ("tileattn", "sdpa")),
    ("llama-gqa 4k", "llama", "full", 4, 4096, 0.0, ("tileattn", "sdpa")),
    ("llama-gqa 8k", "llama", "full", 2, 8192, 0.0, ("tileattn", "sdpa")),
]


def run_e2e(device="cuda", cases=None, steps=10, warmup=3, rounds=3, small=False, progress=print):
    """Rows of ``kind='e2e'``: ``case``, ``impl``, ``tokens_per_s`` (real tokens) and ``step_ms`` (the median
    round), and for tileattn ``ratio`` over SDPA's tokens/s in the same case (the packed case: over SDPA's
    padded rows). ``small``: tiny models and batches, for the test suite on CPU."""
    device = torch.device(device)
    rows = []
    for name, kind, layout, batch, seqlen, dropout, impls in CASES if cases is None else cases:
        if small:
            batch, seqlen = 2, 32
        vocab = 30522 if kind == "bert" else 50257 if kind == "gpt2" else 32000
        gen = torch.Generator(device=device).manual_seed(0)
        inputs, real = _batches(kind, layout, batch, seqlen, vocab, device, gen)
        runs, first = {}, {}
        for impl in impls:
            model = _model(kind, impl, device, dropout, small)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
            first[impl] = float(_step(model, opt, inputs))
            for _ in range(warmup - 1):
                _step(model, opt, inputs)
            runs[impl] = (model, opt)
        if len(first) == 2 and dropout == 0 and abs(first["tileattn"] - first["sdpa"]) > 0.05 * abs(first["sdpa"]):
            raise AssertionError(f"{name}: first-step losses differ, tileattn {first['tileattn']} sdpa {first['sdpa']}")
        times = {impl: [] for impl in impls}
        for _ in range(rounds):
            for impl, (model, opt) in runs.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    _step(model, opt, inputs)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[impl].append((time.perf_counter() - t0) / steps)
        busy = {impl: _device_ms(model, opt, inputs) for impl, (model, opt) in runs.items()}
        del runs
        for impl in impls:
            step = statistics.median(times[impl])
            rows.append(
                dict(
                    kind="e2e", case=name, impl=impl, step_ms=step * 1e3, tokens_per_s=real / step, device_ms=busy[impl]
                )
            )
            progress(f"{name} {impl}: {real / step / 1e3:.1f}k tokens/s")
    by_case = {(r["case"], r["impl"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        if r["impl"] == "tileattn":
            base = by_case.get((r["case"].replace("packed", "padded"), "sdpa"))
            r["ratio"] = r["tokens_per_s"] / base if base else None
    return rows


def _device_ms(model, opt, inputs: dict) -> float | None:
    """The GPU's busy time in one step (its kernels' durations summed, from the profiler), to set beside the
    step's wall time: a step whose wall time is well above it waits on the host. None off CUDA."""
    if model.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(model, opt, inputs)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def format_e2e(rows) -> str:
    from tabulate import tabulate

    table = [
        [r["case"], r["impl"], f"{r['tokens_per_s'] / 1e3:.1f}k", f"{r['step_ms']:.1f}",
         f"{r['device_ms']:.1f}" if r.get("device_ms") is not None else "-",
         f"{r['ratio']:.2f}" if r.get("ratio") else "-"]
        for r in rows
    ]  # fmt: skip
    headers = ["case", "impl", "real tokens/s", "step ms", "GPU busy ms", "÷ SDPA"]
    return tabulate(table, headers=headers, tablefmt="github")
