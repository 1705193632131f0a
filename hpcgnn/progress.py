"""Progress of long steps on stderr: a bar for steps that count their work, a heartbeat for
steps that cannot (a training epoch, a set-up step).

:class:`Progress`: on a terminal it redraws one line at most every ``interval`` seconds; into a
file or pipe (batch logs) it writes just the final line of each step. Use as a context manager::

    with Progress("partition", total=n) as bar:
        bar.update(k)

:class:`Heartbeat`: while the block runs longer than ``after`` seconds, says that it still runs
and for how long: on a terminal one line redrawn every ``interval`` seconds and erased when the
block ends (the caller's own line follows); into a file or pipe a plain line every ``every``
seconds (default 60, ``HPCGNN_HEARTBEAT`` seconds overrides it), nothing for a block that ends
sooner. The line comes from a background thread that only formats and writes text.

Both are silent when ``enabled`` is false or when HPCGNN_PROGRESS=0; the caller passes
``enabled`` false on every rank but 0.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable


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


def fmt_seconds(seconds: float) -> str:
    """``0.032 s``, ``12.35 s``, ``123.4 s``, ``1h02m03s``: at most 9 characters below 100 hours."""
    s = float(seconds)
    if s != s:
        return "- s"
    if s < 10:
        return f"{s:.3f} s"
    if s < 100:
        return f"{s:.2f} s"
    if s < 1000:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def _heartbeat_every(default: float) -> float:
    value = os.environ.get("HPCGNN_HEARTBEAT", "").strip()
    try:
        return max(0.01, float(value)) if value else default
    except ValueError:
        return default


class Heartbeat:
    """``with Heartbeat(text):`` the block, saying ``TEXT: still running, 2m05s`` while it runs
    (module docstring). ``text``: a string or a function returning one (called on each beat)."""

    def __init__(self, text: str | Callable[[], str], enabled: bool = True, every: float = 60.0,
                 interval: float = 1.0, after: float | None = None, stream=None):
        self.text = text
        self.enabled = enabled and os.environ.get("HPCGNN_PROGRESS", "1") != "0"
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.every = interval if self.tty else _heartbeat_every(every)
        self.after = self.every if after is None else after
        self.beats = 0                # lines written (redraws on a terminal)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0

    def line(self, elapsed: float) -> str:
        text = self.text() if callable(self.text) else self.text
        return f"{text}: still running, {fmt_seconds(elapsed)}"

    def _run(self) -> None:
        wait = self.after
        while not self._stop.wait(wait):
            text = self.line(time.perf_counter() - self._start)
            try:
                self.stream.write(("\r\033[K" + text) if self.tty else text + "\n")
                self.stream.flush()
            except (OSError, ValueError):   # a closed stream: nothing more to say
                return
            self.beats += 1
            wait = self.every

    def __enter__(self) -> "Heartbeat":
        self._start = time.perf_counter()
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="hpcgnn-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.tty and self.beats:
            try:
                self.stream.write("\r\033[K")
                self.stream.flush()
            except (OSError, ValueError):
                pass
