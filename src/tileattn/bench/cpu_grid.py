"""The grid on CPU: tileattn's CPU path against eager attention, time and peak memory, on a machine that
other work may be loading.

A CPU run is timed so that its ratios survive a busy machine, and says so when they may not:

- **Threads.** PyTorch's CPU ops split their work over ``torch.get_num_threads()`` threads that wait
  for each other at the end of every op. When other processes hold the cores, each wait lasts until a
  descheduled thread runs again, which costs a path of many small ops (tileattn's, block by block) far
  more than eager's few large ones, and reverses the comparison. So the run takes as many threads as
  the load average leaves idle cores (at least one), unless ``--threads`` says otherwise.
- **Turns.** The backends of a case run in rounds, each round every backend once, the order reversed
  every other round, so a change in the machine's load reaches them alike. Each backend's time is the
  median of its rounds; each ratio is the median of the rounds' ratios, with their quartiles.
- **A flag.** When the rounds' ratios spread by more than ``NOISY`` (upper over lower quartile), or the
  run got less than ``BUSY_SHARE`` of its threads' time (CPU time over wall time) while the load average
  shows other work, the row is marked noisy and ``noise_note`` says how far from 1 a ratio must be to
  mean something; with more than one thread starved like that, that none does.
- **Peak memory** is measured in one child process (``peak_mib``) with glibc's mmap threshold lowered,
  so every freed block goes back to the system and the resident high-water mark of each call is that
  call's own, not hidden by memory an earlier call left behind.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

NOISY = 0.10  # rounds' ratios whose quartiles differ by more than this (q3 / q1 - 1) make the row noisy
BUSY_SHARE = 0.6  # a run that got less than this share of its threads' time ran on a busy machine


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pick_threads(requested: int | None = None) -> tuple[int, str]:
    """(threads to time with, why): ``requested`` if given, else PyTorch's default capped by the cores the
    1-minute load average leaves idle (at least one; a core counts as busy from a load of 0.75, so what a
    run just before left in the average does not take a thread)."""
    default = torch.get_num_threads()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, got {requested}")
        return requested, "as asked"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    idle = max(1, min(default, cores() - int(load + 0.25)))
    if idle < default:
        return idle, f"load average {load:.1f} on {cores()} cores leaves {idle} idle (PyTorch's default: {default})"
    return default, "PyTorch's default"


def time_in_turns(
    fns: dict[str, Callable[[], object]],
    budget_s: float = 5.0,
    min_rounds: int = 3,
    max_rounds: int = 25,
) -> dict[str, dict[str, list[float]]]:
    """Times the callables in rounds, each round every callable once (the order reversed every other
    round), until ``max_rounds`` or, after ``min_rounds``, until ``budget_s`` seconds have passed.

    Returns ``{name: {"wall_ms": [...], "cpu_ms": [...]}}``, one entry a round; ``cpu_ms`` is the
    process's CPU time (every thread's) over the call."""
    names = list(fns)
    out = {name: {"wall_ms": [], "cpu_ms": []} for name in names}
    start = time.perf_counter()
    for r in range(max_rounds):
        if r >= min_rounds and time.perf_counter() - start > budget_s:
            break
        for name in names if r % 2 == 0 else names[::-1]:
            c0, t0 = time.process_time(), time.perf_counter()
            fns[name]()
            t1, c1 = time.perf_counter(), time.process_time()
            out[name]["wall_ms"].append((t1 - t0) * 1e3)
            out[name]["cpu_ms"].append((c1 - c0) * 1e3)
    return out


def others_load(threads: int) -> float:
    """The 1-minute load average less this run's own ``threads`` (0 where there is no load average)."""
    return max(0.0, os.getloadavg()[0] - threads) if hasattr(os, "getloadavg") else 0.0


def summarize(
    times: dict[str, dict[str, list[float]]], baseline: str, threads: int, load: float = 0.0
) -> dict[str, dict]:
    """Per name: ``ms`` (median wall), ``rounds``, ``share`` (CPU time over wall time and ``threads``: 1 when
    every thread ran all the time); against ``baseline``, ``ratio`` (median of the rounds'
    ``ms / baseline ms``, i.e. the baseline's speed-up) with its lower and upper quartiles ``ratio_lo`` and
    ``ratio_hi``; ``starved``: more than one thread got less than ``BUSY_SHARE`` of their time while
    other work (``load``: others_load) held at least half a core, so their waits for each other skew the
    ratios; ``noisy``: starved, or the quartiles differ by more than ``NOISY``, or one thread got less
    than ``BUSY_SHARE`` of its time beside other work."""
    base = times[baseline]["wall_ms"]
    stats = {}
    for name, t in times.items():
        wall, cpu = t["wall_ms"], t["cpu_ms"]
        ratios = [w / b for w, b in zip(wall, base)]
        share = sum(cpu) / max(sum(wall), 1e-9) / threads
        lo, _, hi = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        busy = share < BUSY_SHARE and load >= 0.5
        stats[name] = dict(
            ms=statistics.median(wall),
            rounds=len(wall),
            share=share,
            ratio=statistics.median(ratios),
            ratio_lo=lo,
            ratio_hi=hi,
            starved=busy and threads > 1,
            noisy=busy or hi / lo - 1 > NOISY,
        )
    return stats


def noise_note(rows: list[dict], modes: list[str], threads: int) -> str | None:
    """A sentence for the end of the table when any row is noisy (``{mode}_noisy``, from ``summarize``):
    starved threads make every ratio meaningless; otherwise it says how far a ratio must be from 1 to
    mean something (the widest quartile's distance from its median). None when every row is steady."""
    noisy = [(r, m) for r in rows for m in modes if r.get(f"{m}_noisy")]
    if not noisy:
        return None
    width = max(
        max(r[f"{m}_ratio_hi"] / r[f"{m}_ratio"] - 1, 1 - r[f"{m}_ratio_lo"] / r[f"{m}_ratio"]) for r, m in noisy
    )
    load = f"load average {os.getloadavg()[0]:.1f} on {cores()} cores, " if hasattr(os, "getloadavg") else ""
    share = min(r[f"{m}_share"] for r, m in noisy)
    fewer = " or with --threads 1" if threads > 1 else ""
    if any(r.get(f"{m}_starved") for r, m in noisy):
        return (
            f"not meaningful: the machine is busy ({load}this run's {threads} threads got {share:.0%} of their "
            "time); threads that wait for descheduled ones slow a path of many small ops (tileattn's) far more "
            f"than one of few large ops (eager's), so these ratios say little about either. Rerun when the "
            f"machine is idle{fewer}."
        )
    return (
        f"noisy: the machine is busy ({load}this run's {threads} thread(s) got {share:.0%} of their time); "
        f"speed-ups within ±{max(width, NOISY):.0%} of 1 are not meaningful. For steadier numbers rerun when "
        f"the machine is idle{fewer}."
    )


_PEAK_SCRIPT = """
import json, sys
import torch
from tileattn.bench.backends import BACKENDS

def status(key):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) / 1024

torch.set_num_threads({threads})
for name in {names!r}:  # first calls load code and start thread pools: not the attention's memory
    x = torch.randn(1, 256, 1, 16, dtype={dtype})
    BACKENDS[name](x, x, x, True)()
for batch, seqlen, nheads, headdim, causal in {cases!r}:
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, dtype={dtype}) for _ in range(3))
    for name in {names!r}:
        fn = BACKENDS[name](q, k, v, causal)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the resident high-water mark VmHWM
        before = status("VmRSS")
        out = fn()
        del out
        print(json.dumps([batch, seqlen, nheads, headdim, causal, name, status("VmHWM") - before]), flush=True)
"""


def peak_mib(
    cases: list[tuple], names: list[str], dtype: torch.dtype, threads: int, measured: Callable | None = None
) -> dict[tuple, float]:
    """``{(batch, seqlen, nheads, headdim, causal, name): MiB}``: the resident memory one forward adds at
    its peak, each measured in turn in one child process (NaN where Linux's /proc is missing or the child
    fails). ``cases``: ``(batch, seqlen, nheads, headdim, causal)``; ``measured(key)`` is called as each
    measurement arrives."""
    script = _PEAK_SCRIPT.format(threads=threads, names=list(names), cases=[tuple(c) for c in cases], dtype=dtype)
    # glibc: blocks of 64 KiB and more are mapped on their own and unmapped when freed, so one call's
    # freed memory is not reused, unseen, by the next one
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    found = {}
    if os.path.exists("/proc/self/clear_refs"):
        cmd = [sys.executable, "-c", script]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) as child:
            for line in child.stdout:
                *key, mib = json.loads(line)
                found[tuple(key)] = mib
                if measured is not None:
                    measured(tuple(key))
    return {(*c, n): found.get((*c, n), float("nan")) for c in cases for n in names}
