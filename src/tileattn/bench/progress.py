"""Progress of a long benchmark run: which case runs now, how many are done and about how long the rest
will take. On a terminal with ``rich`` installed (the ``bench`` extra) it is a bar that the table replaces
when the run ends; elsewhere (a pipe, a log file, no rich) one line as each case starts."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """``with Progress(total, title) as p:`` then ``p.step(name)`` as each of the ``total`` steps starts
    (the one before it counts as done), and ``p.log(line)`` for messages. The estimate of the time left is
    the mean time of the steps done so far times the steps left. ``plain``: force the line-per-step form."""

    def __init__(self, total: int, title: str, stream=None, plain: bool | None = None):
        self.total, self.title, self.stream = total, title, stream or sys.stdout
        self.done, self.start = -1, time.perf_counter()
        self.bar = None
        if plain is None:
            plain = not self.stream.isatty()
        if not plain:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as Bar
            except ImportError:
                return
            columns = (
                TextColumn("{task.description}"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[left]}"),
            )
            self.bar = Bar(*columns, console=Console(file=self.stream), transient=True)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.__enter__()
            self.task = self.bar.add_task(self.title, total=self.total, left="")
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def step(self, name: str) -> None:
        """Step ``name`` starts (the previous one is done)."""
        self.done += 1
        elapsed = time.perf_counter() - self.start
        left = f"about {_clock(elapsed / self.done * (self.total - self.done))} left" if self.done else ""
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, description=f"{self.title}: {name}", left=left)
            return
        times = ", ".join(filter(None, (f"{_clock(elapsed)} elapsed", left)))
        print(f"[{self.done + 1}/{self.total}] {self.title}: {name} ({times})", file=self.stream, flush=True)

    def log(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line)
        else:
            print(line, file=self.stream, flush=True)
