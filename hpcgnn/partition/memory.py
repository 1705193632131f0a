"""Wall time and peak resident memory of the consecutive steps of one command.

The process high-water mark (VmHWM in /proc/self/status, the figure ``/usr/bin/time``,
``wait4`` and batch systems report) is never reset: writing "5" to /proc/self/clear_refs
would give exact per-step peaks but would also make every outside tool under-report the
command's peak. Instead a step's peak is

* exact when the step raised the process high-water mark: it is then the new mark;
* otherwise the largest resident size (VmRSS) a sampling thread saw during the step (every
  ``interval`` seconds; a lower bound of the true step peak, off by at most what the process
  allocates and frees between two samples).

A step that runs a child process (KaMinPar's) takes the child's own peak instead when larger
(:meth:`StepMeter.child_peak`, the child's VmHWM: wait4's ru_maxrss would also count this
process's resident size at the fork).

The ``total`` row is the largest step peak: the command's peak, exact whenever the command
raised the process high-water mark at all (always, in a fresh ``hpcgnn partition`` process).
Without /proc (not Linux) the figures are ``ru_maxrss`` at each step's end: cumulative peaks.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

from hpcgnn.run.memory import peak_rss_bytes as high_water_mark
from hpcgnn.run.memory import rss_bytes


@dataclass
class StepRecord:
    name: str
    seconds: float
    peak_rss: int       # bytes
    exact: bool         # the step raised the process high-water mark (else: sampled lower bound)


class StepMeter:
    """Measure consecutive steps: ``with meter.step("read"): ...``; then :meth:`records`.

    A daemon thread samples the resident size every ``interval`` seconds while a step runs.
    Use as a context manager (or call :meth:`close`) to stop it.
    """

    def __init__(self, interval: float = 0.01):
        self.interval = float(interval)
        self._steps: list[StepRecord] = []
        self._lock = threading.Lock()
        self._seen = 0
        self._stop = threading.Event()
        self._has_proc = os.path.exists("/proc/self/status")
        self._thread = None
        self._child = 0
        if self._has_proc:
            self._thread = threading.Thread(target=self._sample, name="hpcgnn-step-meter", daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            rss = rss_bytes()
            if rss is not None:
                with self._lock:
                    if rss > self._seen:
                        self._seen = rss

    @contextlib.contextmanager
    def step(self, name: str):
        """Time the enclosed block and record its peak resident memory as step ``name`` (or a
        child process's peak given to :meth:`child_peak` inside it, when larger)."""
        self._child = 0
        hwm0 = high_water_mark()
        with self._lock:
            self._seen = rss_bytes()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            hwm1 = high_water_mark()
            now = rss_bytes()
            with self._lock:
                seen = max(self._seen, now)
            child, self._child = self._child, 0
            if child > max(hwm1, seen):
                self._steps.append(StepRecord(name, seconds, child, True))
            elif not self._has_proc:
                self._steps.append(StepRecord(name, seconds, hwm1, False))
            elif hwm1 > hwm0:
                self._steps.append(StepRecord(name, seconds, hwm1, True))
            else:
                self._steps.append(StepRecord(name, seconds, min(seen, hwm1), False))

    def child_peak(self, nbytes: int) -> None:
        """The peak resident memory of a child process the current step ran (its own VmHWM,
        as it reported it): the step's peak when larger than this process's."""
        self._child = max(self._child, int(nbytes))

    def records(self) -> list[StepRecord]:
        """The finished steps, then ``total``: their summed time and largest peak."""
        steps = list(self._steps)
        if not steps:
            return [StepRecord("total", 0.0, 0, False)]
        top = max(steps, key=lambda r: r.peak_rss)
        return steps + [StepRecord("total", sum(r.seconds for r in steps), top.peak_rss, top.exact)]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def format_table(records: list[StepRecord]) -> str:
    """A short table of the step records (``~`` marks a sampled, not exact, peak)."""
    lines = [f"{'step':<10} {'wall s':>8} {'peak GiB':>9}"]
    for r in records:
        mark = "" if r.exact else "~"
        lines.append(f"{r.name:<10} {r.seconds:>8.1f} {mark + format(r.peak_rss / 2**30, '.2f'):>9}")
    if not all(r.exact for r in records):
        lines.append("(~: sampled, a lower bound: the step did not raise the process peak)")
    return "\n".join(lines)
