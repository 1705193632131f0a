"""Progress: one clean final line per step in logs, redrawn lines on a terminal."""
from __future__ import annotations

import io

from hpcgnn.progress import Progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_log_gets_one_final_line_per_step(monkeypatch):
    monkeypatch.delenv("HPCGNN_PROGRESS", raising=False)
    log = io.StringIO()
    with Progress("partition: writing", total=4, stream=log, interval=0.0) as bar:
        for _ in range(4):
            bar.update(1)
    with Progress("features", unit="rows", stream=log, interval=0.0) as bar:
        bar.update(1234)
    lines = log.getvalue().split("\n")
    assert "\r" not in log.getvalue() and lines[-1] == "" and len(lines) == 3
    assert lines[0].startswith("partition: writing: [" + "#" * 30 + "] 100.0%")
    assert lines[1].startswith("features: 1,234 rows")


def test_terminal_redraws_and_switches_off(monkeypatch):
    monkeypatch.delenv("HPCGNN_PROGRESS", raising=False)
    tty = _Tty()
    with Progress("step", total=2, stream=tty, interval=0.0) as bar:
        bar.update(1)
        bar.update(1)
    out = tty.getvalue()
    assert out.count("\r") == 3 and out.endswith("\n") and " 50.0%" in out
    monkeypatch.setenv("HPCGNN_PROGRESS", "0")
    quiet = _Tty()
    with Progress("step", total=2, stream=quiet) as bar:
        bar.update(2)
    assert quiet.getvalue() == ""


def test_heartbeat_says_a_long_step_still_runs(monkeypatch):
    """In a log: nothing for a step shorter than the interval, a plain line per interval for a
    longer one; on a terminal: redrawn lines, erased when the step ends."""
    import time

    from hpcgnn.progress import Heartbeat, fmt_seconds

    monkeypatch.delenv("HPCGNN_PROGRESS", raising=False)
    monkeypatch.setenv("HPCGNN_HEARTBEAT", "0.05")
    log = io.StringIO()
    with Heartbeat("quick", stream=log):
        pass
    assert log.getvalue() == ""
    with Heartbeat(lambda: "epoch 3/30", stream=log) as beat:
        time.sleep(0.4)
    lines = log.getvalue().splitlines()
    assert beat.beats == len(lines) >= 2 and "\r" not in log.getvalue()
    assert all(line.startswith("epoch 3/30: still running, 0.") and line.endswith(" s") for line in lines)
    tty = _Tty()
    with Heartbeat("set-up", stream=tty, interval=0.05) as beat:
        time.sleep(0.3)
    assert beat.beats >= 2 and tty.getvalue().count("\r\033[K") == beat.beats + 1
    assert tty.getvalue().endswith("\r\033[K") and "set-up: still running" in tty.getvalue()
    off = io.StringIO()
    with Heartbeat("rank 1", stream=off, enabled=False):
        time.sleep(0.15)
    assert off.getvalue() == ""
    assert [fmt_seconds(s) for s in (0.0321, 12.345, 123.45, 3723.0)] == ["0.032 s", "12.35 s", "123.5 s", "1h02m03s"]
