"""``bench --sinks`` on the CPU path at tiny sizes: every case checks its sink call against the reference
and reports both timings and their ratio."""

import torch

from tileattn.bench.sinks import format_sinks, run_sinks


def test_sinks_rows_and_table():
    calls = []

    def time_ms(fn, device):
        calls.append(device)
        fn()
        return 1.0 + len(calls) % 2  # (plain and sink alternate: 2.0 then 1.0 ms)

    rows = run_sinks(
        time_ms, tokens=128, hidden=64, cases=[(32, 64, True)], decode_cases=[(2, 96, True)],
        dtype=torch.float32, device="cpu", rounds=3, progress=lambda _: None,
    )  # fmt: skip
    assert [r["case"] for r in rows] == ["fwd", "fwd+bwd", "decode"]
    assert all(r["plain_ms"] == 2.0 and r["sink_ms"] == 1.0 and r["ratio"] == 0.5 for r in rows)
    assert len(calls) == 3 * 2 * 3 and set(calls) == {"cpu"}
    table = format_sinks(rows)
    assert "decode 2x96 paged16" in table and "fwd+bwd hd32 2x64 causal" in table
