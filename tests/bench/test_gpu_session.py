"""`make check-gpu-all` (tools/gpu_session.py): its steps' commands, and the budget: a step
that outlives what is left is killed as TIMED OUT, a step with too little time left is skipped,
and the whole session ends within its budget. (Without a GPU the command itself is one line:
tests/bench/test_gpu_check.py.)"""
from __future__ import annotations

import argparse
import sys
import time

from tools import gpu_session as gs


def test_steps_run_in_order_within_the_budget(tmp_path, monkeypatch):
    sleeps = {"check": 0.1, "units": 30.0, "aggregate": 0.1, "scale": 0.1}
    monkeypatch.setattr(gs, "step_command",
                        lambda step, args, out, work, deadline: [sys.executable, "-c",
                                                       f"import time; print('{step} ran'); time.sleep({sleeps[step]})"])
    monkeypatch.setattr(gs, "MIN_S", {"check": 1.0, "units": 1.0, "aggregate": 1.0, "scale": 1.0})
    args = argparse.Namespace(out=str(tmp_path), work=None, budget=6.0, deadline=0.0, steps=list(gs.STEPS), scale=0.25)
    t0 = time.monotonic()
    rows = gs.session(args)
    wall = time.monotonic() - t0
    status = {r["step"]: r["status"] for r in rows}
    assert status == {"check": "ok", "units": "TIMED OUT", "aggregate": "skipped (no time left)",
                      "scale": "skipped (no time left)"}, status
    assert wall < 6.0 + 3.0, wall
    assert "check ran" in (tmp_path / "check.log").read_text()
    assert [r["step"] for r in rows] == list(gs.STEPS) and rows[1]["rc"] == 124


def test_a_deadline_before_the_budget_ends_the_session_and_is_passed_to_the_check(tmp_path, monkeypatch):
    """--deadline (set before make's set-up) ends the session before its budget would; the
    check step is told that deadline less its wrap-up time."""
    seen = {}

    def command(step, args, out, work, deadline):
        seen[step] = deadline
        return [sys.executable, "-c", "import time; time.sleep(30)"]

    monkeypatch.setattr(gs, "step_command", command)
    monkeypatch.setattr(gs, "MIN_S", {"check": 1.0, "units": 1.0, "aggregate": 1.0, "scale": 1.0})
    until = time.time() + 3.0
    args = argparse.Namespace(out=str(tmp_path), work=None, budget=600.0, deadline=until, steps=["check", "units"],
                              scale=0.25)
    t0 = time.monotonic()
    rows = gs.session(args)
    assert time.monotonic() - t0 < 3.0 + 3.0
    assert [r["status"] for r in rows] == ["TIMED OUT", "skipped (no time left)"]
    assert seen == {"check": until}


def test_archive_holds_the_results_but_no_work_folders(tmp_path):
    import tarfile

    out = tmp_path / "gpu-session"
    (out / "gpu-check" / "work" / "run").mkdir(parents=True)
    (out / "gpu-check" / "gpu-check.h5").write_bytes(b"h5")
    (out / "gpu-check" / "work" / "run" / "big.h5").write_bytes(b"x" * 1000)
    (out / "check.log").write_text("log")
    path = gs.write_archive(out, out / "results.tar.gz")
    with tarfile.open(path) as tar:
        names = sorted(tar.getnames())
    assert names == ["gpu-session/check.log", "gpu-session/gpu-check", "gpu-session/gpu-check/gpu-check.h5"]
    assert not list(out.glob("*.tmp*"))


def test_step_commands_name_the_drivers(tmp_path):
    args = argparse.Namespace(scale=0.25)
    cmds = {s: " ".join(gs.step_command(s, args, tmp_path / "o", tmp_path / "w")) for s in gs.STEPS}
    assert "-m tools.gpu_check --out" in cmds["check"] and "--deadline" not in cmds["check"]
    assert gs.step_command("check", args, tmp_path / "o", tmp_path / "w", 1000.0)[-2:] == [
        "--deadline", f"{1000 - gs.WRAP_UP_S:.0f}"]
    assert "-m pytest -q -m cuda tests -k not test_cuda_mode_matches_the_cpu" in cmds["units"]
    assert "-m benchmarks.aggregate --device cuda" in cmds["aggregate"]
    assert ("--scale 0.25 --ranks 2 --epochs 1 --engines minibatch,fullgraph,tensor,offload,cached "
            "--device cuda") in cmds["scale"]
    assert f"--work {tmp_path / 'w' / 'scale-s0.25'}" in cmds["scale"] and "--deadline" not in cmds["scale"]
    assert gs.step_command("scale", args, tmp_path / "o", tmp_path / "w", 1000.0)[-2:] == [
        "--deadline", f"{1000 - gs.WRAP_UP_S:.0f}"]
    assert gs.status_of(0) == "ok" and gs.status_of(3) == "FAILED (exit 3)" and gs.status_of(None).startswith("skipped")
