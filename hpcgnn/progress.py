"""A small progress bar for long preprocessing steps (stderr, rank 0 only).

On a terminal it redraws one line at most every ``interval`` seconds; into a file
or pipe (batch logs) it writes just the final line of each step. Silent when
``enabled`` is false or when HPCGNN_PROGRESS=0. Use as a context manager::

    with Progress("partition", total=n) as bar:
        bar.update(k)
"""
from __future__ import annotations

import os
import sys
import time


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "",
                 enabled: bool = True, interval: float = 0.5, stream=None):
        self.label = label
        self.total = total
        self.unit = unit
        self.enabled = enabled and os.environ.get("HPCGNN_PROGRESS", "1") != "0"
        self.interval = interval
        self.stream = stream or sys.stderr
        self.done = 0
        self._start = time.perf_counter()
        self._last = 0.0
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())

    def __enter__(self) -> "Progress":
        return self

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and self.tty and now - self._last >= self.interval:
            self._last = now
            self._draw(now, final=False)

    def _draw(self, now: float, final: bool) -> None:
        elapsed = now - self._start
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            text = f"{self.label}: [{bar:<30}] {100 * frac:5.1f}% {elapsed:6.1f}s"
        else:
            text = f"{self.label}: {self.done:,} {self.unit} {elapsed:6.1f}s"
        self.stream.write(("\r" if self.tty else "") + text + ("\n" if final else ""))
        self.stream.flush()

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.enabled and exc_type is None:
            self._draw(time.perf_counter(), final=True)
