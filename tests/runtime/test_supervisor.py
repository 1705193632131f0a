"""The watcher process of `hpcgnn train` (hpcgnn.supervisor): exit codes pass through, a death
by signal is named with the rank, signals reach the rank, the rank dies with its watcher."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from mpiutil import run_mpi

from hpcgnn.supervisor import death_message

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watcher is Linux-only")


def _watched(body: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """A python process whose work (``body``, run in the watched child) is wrapped by run_watched."""
    code = ("import os, signal, sys, time\n"
            "from hpcgnn.supervisor import run_watched\n"
            "def work():\n" + "".join(f"    {line}\n" for line in body.splitlines()) +
            "raise SystemExit(run_watched(work))\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})}, **kw)


def test_exit_code_and_output_pass_through():
    proc = _watched("print('child', os.getpid(), flush=True)\nreturn 3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    child_pid = int(out.split()[1])
    assert child_pid != proc.pid and err == ""


def test_a_process_that_started_mpi_runs_the_work_itself():
    """A script that initialised MPI before calling the command is not forked (its work runs in
    the process itself): a forked child would finalise an MPI whose progress threads stayed in
    the parent."""
    code = ("from mpi4py import MPI\n"
            "from hpcgnn.supervisor import enabled, run_watched\n"
            "print(enabled(), flush=True)\n"
            "def work():\n"
            "    import os\n"
            "    print(os.getpid(), MPI.COMM_WORLD.size, flush=True)\n"
            "    return 4\n"
            "raise SystemExit(run_watched(work))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err
    assert out.split() == ["False", str(proc.pid), "1"]


def test_sigkill_is_named_with_the_rank_and_the_watcher_dies_of_it():
    proc = _watched("x = bytearray(64 << 20)\nos.kill(os.getpid(), signal.SIGKILL)\nreturn 0",
                    env={"PMI_RANK": "3"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL         # a shell reports 137
    line = err.strip()
    assert line.startswith("hpcgnn: error: rank 3 was killed by SIGKILL (out of memory? its peak resident "
                           "memory was "), err
    peak_gib = float(line.rsplit(" ", 2)[-2])
    assert peak_gib >= 64 / 1024          # the child's own peak, the 64 MiB it touched included
    assert "\n" not in line


# A Python-level handler runs only between bytecodes: a signal that arrives after print() and
# before time.sleep() enters its system call waits for that sleep to end (CPython checks for
# pending signals only when the sleep is interrupted, and the interruption came before it). The
# watched programs below sleep in short steps, so such a signal is handled within 0.1 s; one
# 60 s sleep lost it about once in 400 runs, a test timeout, not a lost signal.
SLEEP_60_S = "for _ in range(600):\n    time.sleep(0.1)"


def test_sigterm_reaches_the_rank():
    proc = _watched("signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
                    f"print('ready', flush=True)\n{SLEEP_60_S}\nreturn 0")
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)           # to the watcher only, as mpiexec's proxy does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err


def test_the_rank_dies_with_its_watcher():
    proc = _watched("print(os.getpid(), flush=True)\ntime.sleep(60)\nreturn 0")
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                break                      # a zombie waiting for init: dead
        time.sleep(0.05)
    else:
        pytest.fail(f"child {child} outlived its watcher")


def test_supervise_off_runs_in_process():
    proc = _watched("print(os.getpid(), flush=True)\nreturn 0", env={"HPCGNN_SUPERVISE": "0"})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and int(out) == proc.pid


def test_death_message_forms():
    assert death_message(None, signal.SIGSEGV, 2**30) == "hpcgnn was killed by SIGSEGV (its peak resident memory was 1.00 GiB)"
    assert death_message(0, 200, 0).startswith("rank 0 was killed by signal 200")


def test_the_job_ends_at_once_while_the_other_ranks_compute(tmp_path):
    """Rank 1 is SIGKILLed while rank 0 is busy outside MPI: the launcher must end the job at
    once (it does for a rank that died of a signal), not when rank 0 next communicates."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from hpcgnn.supervisor import run_watched\n"
        "def work():\n"
        "    from mpi4py import MPI\n"
        "    comm = MPI.COMM_WORLD\n"
        "    comm.Barrier()\n"
        "    if comm.Get_rank() == 1:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    t = time.time()\n"
        "    while time.time() - t < 90:\n"
        "        sum(range(10000))\n"
        "    comm.Barrier()\n"
        "    return 0\n"
        "raise SystemExit(run_watched(work))\n")
    t0 = time.time()
    proc = run_mpi(2, [script], timeout=80)
    assert time.time() - t0 < 45, "the job outlived the killed rank"
    assert proc.returncode != 0
    assert "hpcgnn: error: rank 1 was killed by SIGKILL (out of memory?" in proc.stderr, proc.stderr
