"""``bench --e2e`` at tiny sizes on the CPU path: each case trains its model on tileattn and on SDPA, the
packed case on tileattn only, and reports real tokens per second and the ratio to SDPA."""

import pytest

from tileattn.bench.e2e import CASES, format_e2e, run_e2e

pytest.importorskip("transformers")


def test_e2e_rows():
    cases = [c for c in CASES if c[0] in ("bert-large padded", "bert-large packed", "llama-gqa 1k")]
    rows = run_e2e("cpu", cases=cases, steps=1, warmup=1, rounds=1, small=True, progress=lambda _: None)
    assert [(r["case"], r["impl"]) for r in rows] == [
        ("bert-large padded", "tileattn"),
        ("bert-large padded", "sdpa"),
        ("bert-large packed", "tileattn"),
        ("llama-gqa 1k", "tileattn"),
        ("llama-gqa 1k", "sdpa"),
    ]
    assert all(r["tokens_per_s"] > 0 and r["device_ms"] is None for r in rows)
    # tileattn's rows carry their ratio to SDPA; the packed one to SDPA's padded rows
    ratios = {r["case"]: r["ratio"] for r in rows if r["impl"] == "tileattn"}
    padded = {r["impl"]: r["tokens_per_s"] for r in rows if r["case"] == "bert-large padded"}
    assert ratios["bert-large packed"] == rows[2]["tokens_per_s"] / padded["sdpa"]
    assert "bert-large packed" in format_e2e(rows)
