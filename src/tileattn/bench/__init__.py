"""Benchmarks: ``python -m tileattn.bench`` (the CLI) and ``python -m tileattn.bench.tune`` (tile sweep)."""
