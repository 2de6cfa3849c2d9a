"""Reproduces the FlashAttention papers' end-to-end results on one GPU with tileattn.

1. GPT-2 small (124M, random init) training steps at seqlen 1k / 2k / 4k / 8k, batch · seqlen = 16k
   tokens, bf16 autocast, AdamW: tokens/s and peak memory with eager attention, SDPA and tileattn
   (Hugging Face transformers, attn_implementation = "eager" / "sdpa" / "tileattn").
2. A Llama-style model (grouped-query attention, no dropout) the same way, SDPA and tileattn.
3. BERT-large training step (masked LM) at seqlen 512.
4. Attention alone (forward + backward): peak memory against seqlen up to the longest each
   implementation fits.
5. The longest single sequence one GPT-2-small training step fits on the GPU, eager vs tileattn.

Writes ``results.json``, ``paper.md`` (tables) and PNG plots into --out.

    python scripts/reproduce_paper.py --out paper_results            # GPU
    python scripts/reproduce_paper.py --smoke --out /tmp/smoke       # tiny settings, any machine
    python scripts/reproduce_paper.py --parts gpt2 --attn-dropout 0  # GPT-2 without attention dropout
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import tileattn
import tileattn.integrations.transformers  # noqa: F401  (registers attn_implementation="tileattn")

IMPLS = ["eager", "sdpa", "tileattn"]


def _device_sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_memory():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb():
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")


def train_steps(make_model, make_batch, steps: int, warmup: int, device: str):
    """Median seconds per training step (forward, backward, AdamW) and peak GB; None on OOM."""
    _reset_memory()
    try:
        model = make_model().to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
        times = []
        for i in range(warmup + steps):
            batch = make_batch()
            _device_sync()
            t0 = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _device_sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"non-finite loss {loss.item()}")
        return sorted(times)[len(times) // 2], _peak_gb()
    except torch.OutOfMemoryError:
        return None, None
    finally:
        model = opt = batch = loss = None  # noqa: F841
        _reset_memory()


def gpt2(impl: str, n_positions: int, smoke: bool, attn_pdrop: float | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel

    extra = {} if attn_pdrop is None else {"attn_pdrop": attn_pdrop}  # None: GPT-2's own 0.1
    if smoke:
        cfg = GPT2Config(vocab_size=512, n_positions=n_positions, n_embd=64, n_layer=2, n_head=4, **extra)
    else:
        cfg = GPT2Config(n_positions=n_positions, **extra)  # GPT-2 small: 12 layers, 12 heads, 768 wide
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(dtype=torch.float32), cfg, impl


def llama(smoke: bool):
    """A Llama-style decoder (rotary, RMSNorm, SwiGLU, no dropout) with grouped-query attention, 4 query
    heads per KV head at head dim 128: 8 layers 2048 wide (about 0.5B parameters with the embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if smoke:
        cfg = LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192,
        )  # fmt: skip
    else:
        cfg = LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=4, max_position_embeddings=8192,
        )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype=torch.float32)


def _run_lm(kind: str, make, vocab: int, args, device, impls=IMPLS):
    """Training steps of a causal LM at each of ``args.gpt2_seqlens`` (batch · seqlen = ``args.tokens``);
    ``make(seqlen)`` returns the model, ``vocab`` is its vocabulary size."""
    rows = []
    tokens = args.tokens
    for seqlen in args.gpt2_seqlens:
        batch = max(1, tokens // seqlen)
        for impl in impls:

            def make_model(impl=impl, seqlen=seqlen):
                model = make(seqlen)
                model.config._attn_implementation = impl
                model.set_attn_implementation(impl)
                return model

            def make_batch(batch=batch, seqlen=seqlen):
                ids = torch.randint(0, vocab, (batch, seqlen), device=device)
                return {"input_ids": ids, "labels": ids}

            t, peak = train_steps(make_model, make_batch, args.steps, args.warmup, device)
            row = dict(kind=kind, impl=impl, seqlen=seqlen, batch=batch, step_s=t, peak_gb=peak)
            row["tokens_per_s"] = batch * seqlen / t if t else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run_gpt2(args, device):
    def make(seqlen):
        return gpt2("", seqlen, args.smoke, args.attn_dropout)[0]

    return _run_lm("gpt2", make, 512 if args.smoke else 50257, args, device, impls=args.impls)


def run_llama(args, device):
    def make(seqlen):
        return llama(args.smoke)

    impls = [i for i in args.impls if i != "eager"]  # (eager attention at 16 heads runs out of memory from 4k)
    return _run_lm("llama", make, 512 if args.smoke else 32000, args, device, impls=impls)


def run_bert(args, device):
    from transformers import BertConfig, BertForMaskedLM

    rows = []
    seqlen, batch = (512, args.bert_batch) if not args.smoke else (64, 2)
    for impl in args.impls:

        def make_model(impl=impl):
            extra = {} if args.attn_dropout is None else {"attention_probs_dropout_prob": args.attn_dropout}
            if args.smoke:
                cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **extra)
            else:
                cfg = BertConfig(
                    hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, **extra
                )
            torch.manual_seed(0)
            model = BertForMaskedLM(cfg)
            model.set_attn_implementation(impl)
            return model

        def make_batch():
            vocab = 512 if args.smoke else 30522
            ids = torch.randint(0, vocab, (batch, seqlen), device=device)
            labels = torch.where(torch.rand(batch, seqlen, device=device) < 0.15, ids, -100)
            return {"input_ids": ids, "labels": labels}

        t, peak = train_steps(make_model, make_batch, args.steps, args.warmup, device)
        row = dict(kind="bert", impl=impl, seqlen=seqlen, batch=batch, step_s=t, peak_gb=peak)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def attention_only(impl: str, q, k, v):
    if impl == "tileattn":
        return tileattn.flash_attn_func(q, k, v, causal=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if impl == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
    s = (qt @ kt.transpose(-1, -2)) * q.shape[-1] ** -0.5
    n = q.shape[1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return (torch.softmax(s.float(), -1).to(q.dtype) @ vt).transpose(1, 2)


def run_memory(args, device):
    """Peak memory of attention forward + backward beyond its inputs, batch 1, 12 heads, head dim 64."""
    rows = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for impl in IMPLS:
        for seqlen in args.mem_seqlens:
            _reset_memory()
            try:
                q, k, v = (
                    torch.randn(1, seqlen, 12, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
                )
                base = torch.cuda.memory_allocated() if device == "cuda" else 0
                torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
                out = attention_only(impl, q, k, v)
                out.backward(torch.ones_like(out))
                _device_sync()
                extra = (torch.cuda.max_memory_allocated() - base) / 1e9 if device == "cuda" else float("nan")
                rows.append(dict(kind="memory", impl=impl, seqlen=seqlen, extra_gb=extra))
            except torch.OutOfMemoryError:
                rows.append(dict(kind="memory", impl=impl, seqlen=seqlen, extra_gb=None))
                break
            finally:
                q = k = v = out = None
                _reset_memory()
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_longest(args, device):
    """Doubles one sequence's length until a GPT-2-small training step no longer fits."""
    rows = []
    for impl in ("eager", "tileattn"):
        for seqlen in args.long_seqlens:

            def make_model(impl=impl, seqlen=seqlen):
                model, _, _ = gpt2(impl, seqlen, args.smoke, args.attn_dropout)
                model.set_attn_implementation(impl)
                return model

            def make_batch(seqlen=seqlen):
                ids = torch.randint(0, 512 if args.smoke else 50257, (1, seqlen), device=device)
                return {"input_ids": ids, "labels": ids}

            t, peak = train_steps(make_model, make_batch, 1, 0, device)
            rows.append(dict(kind="longest", impl=impl, seqlen=seqlen, step_s=t, peak_gb=peak))
            print(json.dumps(rows[-1]), flush=True)
            if t is None:
                break
    return rows


def _fmt(x, spec):
    return "OOM" if x is None else format(x, spec)


def write_report(rows, out: Path) -> str:
    lines = []
    titles = {"gpt2": "GPT-2 small", "llama": "Llama-style, GQA 16:4, head dim 128, 8 layers × 2048"}
    for kind, title in titles.items():
        lm = [r for r in rows if r["kind"] == kind]
        if not lm:
            continue
        impls = list(dict.fromkeys(r["impl"] for r in lm))
        lines += [f"## {title} training step (16k tokens/step, bf16 autocast, AdamW)", ""]
        lines += ["| seqlen × batch | " + " | ".join(f"{i} tok/s (peak GB)" for i in impls) + " | tileattn ÷ SDPA |"]
        lines += ["|---" * (len(impls) + 2) + "|"]
        for seqlen in dict.fromkeys(r["seqlen"] for r in lm):
            by = {r["impl"]: r for r in lm if r["seqlen"] == seqlen}
            cells = [f"{_fmt(by[i]['tokens_per_s'], ',.0f')} ({_fmt(by[i]['peak_gb'], '.1f')})" for i in impls]
            ratio = ""
            if by.get("tileattn", {}).get("tokens_per_s") and by.get("sdpa", {}).get("tokens_per_s"):
                ratio = f"{by['tileattn']['tokens_per_s'] / by['sdpa']['tokens_per_s']:.2f}×"
            batch = next(iter(by.values()))["batch"]
            lines.append(f"| {seqlen} × {batch} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    bert = {r["impl"]: r for r in rows if r["kind"] == "bert"}
    if bert:
        first = next(iter(bert.values()))
        lines += ["", f"## BERT-large training step (seqlen {first['seqlen']}, batch {first['batch']})", ""]
        lines += ["| impl | step ms | peak GB | speed-up vs SDPA |", "|---|---|---|---|"]
        base = bert.get("sdpa", {}).get("step_s")
        for i, r in bert.items():
            speed = f"{base / r['step_s']:.2f}×" if r["step_s"] and base else ""
            lines.append(
                f"| {i} | {_fmt(r['step_s'] and r['step_s'] * 1e3, '.1f')} | {_fmt(r['peak_gb'], '.1f')} | {speed} |"
            )
    mem = [r for r in rows if r["kind"] == "memory"]
    if mem:
        seqlens = sorted({r["seqlen"] for r in mem})
        lines += [
            "",
            "## Attention alone, forward + backward: memory beyond the inputs (GB), causal, 12 heads × 64",
            "",
        ]
        lines += ["| impl | " + " | ".join(str(s) for s in seqlens) + " |", "|---" * (len(seqlens) + 1) + "|"]
        for i in IMPLS:
            by = {r["seqlen"]: r["extra_gb"] for r in mem if r["impl"] == i}
            lines.append(f"| {i} | " + " | ".join(_fmt(by[s], ".3f") if s in by else "–" for s in seqlens) + " |")
    longest = [r for r in rows if r["kind"] == "longest"]
    if longest:
        lines += ["", "## Longest single sequence in one GPT-2-small training step", ""]
        lines += ["| impl | longest that fits | step s | peak GB | first that does not |", "|---|---|---|---|---|"]
        for i in ("eager", "tileattn"):
            ok = [r for r in longest if r["impl"] == i and r["step_s"]]
            bad = [r for r in longest if r["impl"] == i and not r["step_s"]]
            if ok:
                r = ok[-1]
                first_bad = bad[0]["seqlen"] if bad else "not reached"
                lines.append(f"| {i} | {r['seqlen']} | {r['step_s']:.2f} | {r['peak_gb']:.1f} | {first_bad} |")
    text = "\n".join(lines) + "\n"
    (out / "paper.md").write_text(text)
    return text


def plot(rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpt = [r for r in rows if r["kind"] == "gpt2"]
    if gpt:
        fig, ax = plt.subplots(figsize=(6, 4))
        for i in IMPLS:
            pts = [(r["seqlen"], r["tokens_per_s"]) for r in gpt if r["impl"] == i and r["tokens_per_s"]]
            ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=i)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen (batch × seqlen = 16k)")
        ax.set_ylabel("k tokens/s")
        ax.set_title("GPT-2 small training throughput")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "gpt2_throughput.png", dpi=110)
        plt.close(fig)
    mem = [r for r in rows if r["kind"] == "memory" and r["extra_gb"] is not None and r["extra_gb"] > 0]
    if mem:
        fig, ax = plt.subplots(figsize=(6, 4))
        for i in IMPLS:
            pts = [(r["seqlen"], r["extra_gb"]) for r in mem if r["impl"] == i]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=i)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("GB beyond inputs (fwd + bwd)")
        ax.set_title("Attention memory")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "attention_memory.png", dpi=110)
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("paper_results"))
    ap.add_argument("--smoke", action="store_true", help="tiny models and lengths (checks the script, any machine)")
    ap.add_argument("--parts", nargs="+", default=["gpt2", "llama", "bert", "memory", "longest"])
    ap.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS, help="the attentions to train with")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--bert-batch", type=int, default=16)
    ap.add_argument(
        "--attn-dropout",
        type=float,
        default=None,
        help="the models' attention dropout (default: their own, 0.1); 0 times the kernels without it",
    )
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.tokens, args.steps, args.warmup = 512, 1, 0
        args.gpt2_seqlens, args.mem_seqlens, args.long_seqlens = [64, 128], [64, 128], [64, 128]
    else:
        args.gpt2_seqlens = [1024, 2048, 4096, 8192]
        args.mem_seqlens = [2**i for i in range(10, 19)]
        args.long_seqlens = [2**i for i in range(12, 19)]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    parts = {"gpt2": run_gpt2, "llama": run_llama, "bert": run_bert, "memory": run_memory, "longest": run_longest}
    for name in args.parts:
        rows += parts[name](args, device)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(write_report(rows, args.out))
    plot(rows, args.out)


if __name__ == "__main__":
    main()
