"""The command line of ``python -m tileattn.bench`` (``tileattn.bench.__main__`` runs it): its options, their
help and the grid's defaults on each device."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tileattn.bench.backends import BACKENDS
from tileattn.bench.decode import AB_DEFAULT_LAYOUTS, AB_LAYOUTS, DECODE_BACKENDS

DESCRIPTION = "``python -m tileattn.bench``: times tileattn against the other attention backends."
GPU_DEFAULT_BACKENDS = ["tileattn", "fa4", "flash_attn", "sdpa-cudnn", "sdpa-flash", "flex"]

# The grid's settings when not given: the papers' grid on a GPU; on CPU one that ends in about a minute on
# two cores (the CPU path against eager at 2k tokens); --quick: a shorter preset on each.
GRID_DEFAULTS = {
    "cuda": dict(headdim=[64, 128, 256], seqlen=[512, 1024, 2048, 4096, 8192, 16384], tokens=16384, hidden=2048,
                 causal="both", mode="fwd+bwd"),
    "cpu": dict(headdim=[64], seqlen=[512, 2048], tokens=2048, hidden=256, causal="both", mode="fwd+bwd"),
}  # fmt: skip
QUICK = {"cuda": dict(headdim=[128], seqlen=[1024, 4096]), "cpu": dict(causal="yes", mode="fwd")}


def grid_defaults(device: str, quick: bool) -> dict:
    """The grid's settings on ``device`` ("cuda" or "cpu") where the command line gives none."""
    return GRID_DEFAULTS[device] | (QUICK[device] if quick else {})


def _default(option: str) -> str:
    """The help's words for a grid setting's default on each device."""
    words = [GRID_DEFAULTS[device][option] for device in ("cuda", "cpu")]
    gpu, cpu = (" ".join(map(str, w)) if isinstance(w, list) else str(w) for w in words)
    return f"default: {gpu}" if gpu == cpu else f"default: {gpu} on a GPU, {cpu} on CPU"


def parse_args(argv=None):
    """The command line; the grid's settings not given are ``grid_defaults``' for the device, and
    ``args.given`` names those given."""
    ap = argparse.ArgumentParser(prog="python -m tileattn.bench", description=DESCRIPTION)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short preset: on a GPU head dim 128 at 1k and 4k tokens; on CPU the CPU grid's forward, causal "
        "only, in under a minute (default: off)",
    )
    ap.add_argument("--headdim", type=int, nargs="+", help=f"head dims of the grid ({_default('headdim')})")
    ap.add_argument("--seqlen", type=int, nargs="+", help=f"tokens per sequence ({_default('seqlen')})")
    ap.add_argument("--tokens", type=int, help=f"batch * seqlen, the tokens of each case ({_default('tokens')})")
    ap.add_argument("--hidden", type=int, help=f"nheads * headdim ({_default('hidden')})")
    ap.add_argument("--causal", choices=["both", "yes", "no"], help=f"causal cases ({_default('causal')})")
    ap.add_argument(
        "--mode",
        choices=["fwd", "bwd", "fwd+bwd"],
        help="what the table shows; the backward is timed alone, over a retained graph (default: fwd+bwd; fwd "
        "for --quick on CPU)",
    )
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on a GPU, fp32 on CPU")
    ap.add_argument(
        "--backends",
        nargs="+",
        choices=list(BACKENDS),
        metavar="NAME",
        help=f"of {', '.join(BACKENDS)} (default: {' '.join(GPU_DEFAULT_BACKENDS)} on a GPU, those installed; "
        "tileattn eager on CPU)",
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if there is a GPU, else cpu")
    ap.add_argument(
        "--threads",
        type=int,
        help="CPU only: PyTorch threads to time with (default: PyTorch's, capped by the cores the load average "
        "leaves idle)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("bench_results/results.jsonl"),
        help="JSON-lines file the rows are appended to, with a CSV beside it (default: %(default)s)",
    )
    ap.add_argument("--plot", action="store_true", help="draw PNG charts from --out into its folder (default: off)")
    ap.add_argument(
        "--varlen",
        action="store_true",
        help="time a packed batch of mixed lengths (64..4096) against padded batches instead (default: off)",
    )
    ap.add_argument(
        "--decode",
        action="store_true",
        help="GPU: one query token against long KV caches (contiguous and paged), GB/s of K+V read (default: off)",
    )
    ap.add_argument(
        "--features",
        action="store_true",
        help="GPU: tileattn with causal, GQA, windows, varlen and padded head dims against its dense speed "
        "(default: off)",
    )
    ab = ap.add_argument_group("--decode-ab: the decode rows timed in turn with their anchors, over rounds")
    ab.add_argument(
        "--decode-ab", action="store_true", help="GPU: interleaved CUDA-graph A/B of decode layouts (default: off)"
    )
    ab.add_argument(
        "--rounds", type=int, default=5, help="rounds in which the graphs take turns (default: %(default)s)"
    )
    ab.add_argument(
        "--replays", type=int, default=5, help="graph replays per graph and round, their median (default: %(default)s)"
    )
    ab.add_argument(
        "--layouts",
        nargs="+",
        default=list(AB_DEFAULT_LAYOUTS),
        choices=list(AB_LAYOUTS),
        metavar="LAYOUT",
        help=f"the layouts timed, of {', '.join(map(repr, AB_LAYOUTS))} (default: "
        f"{' '.join(map(repr, AB_DEFAULT_LAYOUTS))})",
    )
    ab.add_argument(
        "--anchors",
        nargs="+",
        default=["sdpa-cudnn"],
        choices=list(DECODE_BACKENDS),
        metavar="NAME",
        help=f"timed in every layout's rounds, of {', '.join(map(repr, DECODE_BACKENDS))} (default: sdpa-cudnn)",
    )
    ab.add_argument(
        "--rows", nargs="+", metavar="BxN", help="batch x cache length rows, as 64x4096 (default: --decode's)"
    )
    ap.add_argument(
        "--masks",
        action="store_true",
        help="GPU, FlashMask: each mask builder against FlexAttention and SDPA with the dense mask (8k and 32k "
        "tokens; default: off)",
    )
    ap.add_argument(
        "--new-masks",
        action="store_true",
        help="GPU, FlashMask: forward + backward with a new mask tensor every call against the same tensor, "
        "every builder (8k and 32k tokens; default: off)",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="GPU: FP8 forward against bf16 and the FP8 matmul ceiling (1k-16k tokens), FP8 accuracy, FP8-cache "
        "decoding (default: off)",
    )
    ap.add_argument(
        "--mla",
        action="store_true",
        help="GPU: MLA decoding (FlashMLA's memory- and compute-bound cases) beside GQA decoding of the same "
        "caches (default: off)",
    )
    ap.add_argument(
        "--cp",
        action="store_true",
        help="context parallelism over every GPU of the host (or 2 CPU processes): scaling, exactness, longest "
        "(default: off)",
    )
    ap.add_argument("--world", type=int, help="the ranks of --cp (default: every GPU, or 2 CPU processes)")
    ap.add_argument(
        "--dropout",
        action="store_true",
        help="attention dropout: tileattn with and without it against SDPA's FlashAttention-2 with it (default: off)",
    )
    ap.add_argument(
        "--dropout-p", type=float, default=0.1, help="the dropout probability of --dropout (default: %(default)s)"
    )
    ap.add_argument(
        "--e2e",
        action="store_true",
        help="training steps of Hugging Face models (BERT-large full/padded/packed, GPT-2, a Llama-style GQA model): "
        "real tokens/s on tileattn against SDPA; tiny models on CPU (default: off)",
    )
    ap.add_argument(
        "--sinks",
        action="store_true",
        help="attention sinks: the same calls with and without one, forward, forward + backward and decode (A/B; "
        "default: off)",
    )
    ap.add_argument(
        "--host",
        action="store_true",
        help="GPU: host time per call at launch-bound sizes (1 x 128 x 16 x 64 causal training calls, decode at 1 x 8k) "
        "against SDPA (default: off)",
    )
    ap.add_argument(
        "--hf-decode",
        action="store_true",
        help="Hugging Face greedy decoding, static cache, compiled decode step: tokens/s of a 1B Llama at batch 1 "
        "and 16, attn_implementation='tileattn' against 'sdpa' (on CPU: a tiny model, eager) (default: off)",
    )
    ap.add_argument(
        "--hf-batches",
        type=int,
        nargs="+",
        default=[1, 16],
        metavar="B",
        help="--hf-decode's batch sizes, each one's rows written to --out as it ends (default: 1 16)",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: PyTorch sees no CUDA GPU here; leave --device out to run on the CPU")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.given = set()
    for option, value in grid_defaults(device, args.quick).items():
        if getattr(args, option) is None:
            setattr(args, option, value)
        else:
            args.given.add(option)
    return args
