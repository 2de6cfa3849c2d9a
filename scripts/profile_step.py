"""Where does a Hugging Face training step spend its time? Profiles a few BERT-large (or GPT-2 small) steps
with torch.profiler for each attention implementation and prints, per implementation: step time, GPU
busy time, the top CUDA kernels, the attention kernels' share, and host-device synchronisations
(``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / device-to-host copies), which stall the CPU
that should be queueing the next kernels.

    python scripts/profile_step.py --model bert --impls sdpa tileattn --out /tmp/prof
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import tileattn.integrations.transformers  # noqa: F401  (registers attn_implementation="tileattn")

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "Memcpy DtoH")


def make(model_name: str, impl: str, device: str, smoke: bool = False):
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if smoke:  # tiny, to check the script on any machine
        bert = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
        gpt2 = dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64)
        shape = (2, 64, 512)
    else:
        bert = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
        gpt2 = dict(n_positions=2048)
        shape = (16, 512, 30522) if model_name == "bert" else (8, 2048, 50257)
    if model_name == "bert":
        model = BertForMaskedLM(BertConfig(**bert))
    else:
        model = GPT2LMHeadModel(GPT2Config(**gpt2))
    batch, seqlen, vocab = shape
    model.set_attn_implementation(impl)
    model = model.to(device).train()
    ids = torch.randint(0, vocab, (batch, seqlen), device=device)
    labels = torch.where(torch.rand(batch, seqlen, device=device) < 0.15, ids, -100) if model_name == "bert" else ids
    return model, {"input_ids": ids, "labels": labels}


def step(model, batch, opt, device):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def profile_impl(model_name: str, impl: str, device: str, steps: int, out: Path | None, smoke: bool = False):
    model, batch = make(model_name, impl, device, smoke)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    for _ in range(3):
        step(model, batch, opt, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(model, batch, opt, device)
    sync()
    step_ms = (time.perf_counter() - t0) * 1e3 / steps  # without the profiler's overhead
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(model, batch, opt, device)
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sorted(
        (e for e in events if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"),
        key=lambda e: -e.device_time_total,
    )
    gpu_ms = sum(e.device_time_total for e in gpu) / 1e3 / steps
    attn = [e for e in gpu if "attn" in e.key.lower() or "flash" in e.key.lower() or "fmha" in e.key.lower()]
    syncs = {name: sum(e.count for e in events if name in e.key) / steps for name in SYNC_EVENTS}
    summary = dict(
        model=model_name,
        impl=impl,
        gpu_ms_per_step=gpu_ms,
        attention_gpu_ms_per_step=sum(e.device_time_total for e in attn) / 1e3 / steps,
        syncs_per_step=syncs,
        top_kernels=[(e.key[:90], e.device_time_total / 1e3 / steps, e.count // steps) for e in gpu[:12]],
        step_ms=step_ms,
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"{model_name}_{impl}.json"))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["bert", "gpt2"], default="bert")
    ap.add_argument("--impls", nargs="+", default=["sdpa", "tileattn"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny models (checks the script, any machine)")
    ap.add_argument("--out", type=Path, default=None, help="folder for Chrome traces and summary.json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for impl in args.impls:
        s = profile_impl(args.model, impl, device, args.steps, args.out, args.smoke)
        rows.append(s)
        print(
            f"{args.model} {impl}: step {s['step_ms']:.1f} ms, GPU busy {s['gpu_ms_per_step']:.1f} ms/step, attention kernels "
            f"{s['attention_gpu_ms_per_step']:.1f} ms, syncs/step {s['syncs_per_step']}",
            flush=True,
        )
        for name, ms, count in s["top_kernels"]:
            print(f"    {ms:8.2f} ms  x{count:<4} {name}")
    if args.out is not None:
        (args.out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
