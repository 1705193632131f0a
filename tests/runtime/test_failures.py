"""The failure policy under real mpiexec: no failure on one rank may leave the others waiting.

Each test runs tests/demos/fail.py, where one rank fails while the others wait in
MPI_Barrier, and measures how long the job takes to end after the failure (the
failing rank prints the Unix time just before it fails).
"""
from __future__ import annotations

import re
import time

from mpiutil import ROOT, run_mpi

FAIL = [ROOT / "tests" / "demos" / "fail.py"]


def failed_at(stdout: str, rank: int, mode: str) -> float:
    m = re.search(rf"^rank {rank} fails \({re.escape(mode)}\) at ([0-9.]+)$", stdout, re.MULTILINE)
    assert m, stdout
    return float(m.group(1))


def test_exception_on_one_rank_aborts_every_rank_and_names_it():
    proc = run_mpi(4, FAIL + ["--rank", "2", "--mode", "raise"], timeout=90)
    ended = time.time()
    assert proc.returncode != 0
    assert "hpcgnn: rank 2/4 on " in proc.stderr and "RuntimeError: demo failure on rank 2" in proc.stderr
    assert "finished" not in proc.stdout and " exits " not in proc.stdout
    assert ended - failed_at(proc.stdout, 2, "raise") < 10.0


def _exit_codes(report) -> dict:
    return {p.name: p.read_text().strip() for p in sorted(report.iterdir())}


def test_input_error_agreed_from_one_rank_exits_2_everywhere_with_one_line(tmp_path):
    proc = run_mpi(4, FAIL + ["--rank", "1", "--mode", "input", "--report", tmp_path], timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _exit_codes(tmp_path) == {f"rank-{r}": "2" for r in range(4)}
    assert "finished" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "hpcgnn: error: --rank 1: rank 1 refuses to go on (demo check)"]


def test_input_errors_raised_on_every_rank_print_each_distinct_message_once(tmp_path):
    proc = run_mpi(3, FAIL + ["--rank", "1", "--mode", "input-each", "--report", tmp_path], timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _exit_codes(tmp_path) == {f"rank-{r}": "2" for r in range(3)}
    assert proc.stderr.strip().splitlines() == [
        "hpcgnn: error: every rank refuses to go on (demo check)",
        "hpcgnn: error: --rank 1: rank 1 refuses to go on"]


def test_input_error_on_one_rank_without_agree_ends_the_job_with_exit_2():
    wait = 1.0
    proc = run_mpi(2, FAIL + ["--rank", "1", "--mode", "input-alone"], timeout=90,
                   env={"HPCGNN_ERROR_WAIT": str(wait)})
    ended = time.time()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "hpcgnn: error: --rank 1: rank 1 refuses to go on (demo check, no agree) [rank 1/2 on " \
        in proc.stderr
    assert "Traceback" not in proc.stderr and "finished" not in proc.stdout
    assert wait <= ended - failed_at(proc.stdout, 1, "input-alone") < wait + 10.0


def test_killed_rank_ends_the_job_within_30_s():
    proc = run_mpi(4, FAIL + ["--rank", "3", "--mode", "kill"], timeout=90)
    ended = time.time()
    assert proc.returncode != 0
    assert "finished" not in proc.stdout
    elapsed = ended - failed_at(proc.stdout, 3, "kill")
    print(f"killed rank: job ended {elapsed:.2f} s after the SIGKILL")
    assert elapsed < 30.0


def test_a_survivors_failed_collective_is_one_line_not_a_cause():
    """What a rank sees when another rank died in a collective (mpi4py's MPI.Exception) is a
    consequence: one line saying so, after the dead rank's own line had time to come first, and
    no traceback; the job still ends."""
    proc = run_mpi(2, FAIL + ["--rank", "1", "--mode", "peer-lost"], timeout=90)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcgnn:")]
    assert lines == ["hpcgnn: rank 1/2: stopped because another rank ended during communication "
                     "(Exception: Other MPI error)"], proc.stderr
    assert "Traceback" not in proc.stderr and "failed:" not in proc.stderr
