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
