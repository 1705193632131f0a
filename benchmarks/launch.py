"""Starting ``hpcgnn`` under this interpreter's MPI launcher from a bench driver (gpu_check, scale).

:func:`find_mpiexec` (:func:`hpcgnn.runtime.find_mpiexec`) picks the launcher that matches the
interpreter's mpi4py; :func:`rank_command` is the command line of a launched run
(``HPCGNN_BENCH_PYTHON``, :func:`python_command`, puts a wrapper in front of every rank's
interpreter); :func:`run_logged` runs a child with its output in a log file and a timeout,
:func:`run_checked` too and stops the bench when the child fails; :func:`child_env` is the
environment of such a child: a fresh MPI world as :func:`hpcgnn.runtime.fresh_world_env` makes
it (Open MPI in a container included), this checkout on ``PYTHONPATH``, no progress bars.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hpcgnn.runtime import find_mpiexec, fresh_world_env

ROOT = Path(__file__).resolve().parents[1]
PYTHON_VAR = "HPCGNN_BENCH_PYTHON"
__all__ = ["ROOT", "PYTHON_VAR", "find_mpiexec", "python_command", "rank_command", "checkout_first", "child_env",
           "run_logged", "run_checked", "kill_tree"]


def python_command() -> list[str]:
    """The command that runs Python in the runs a bench driver launches: ``HPCGNN_BENCH_PYTHON``
    split as a shell would, to put a wrapper in front of each rank's interpreter (``numactl
    --interleave=all .venv/bin/python``, a profiler, the test suite's fork server), else this
    interpreter. Drivers that read a child's peak RSS from ``wait4`` (scale, partition) start
    this interpreter itself: a wrapper would be the process they measure."""
    custom = os.environ.get(PYTHON_VAR, "").strip()
    return shlex.split(custom) if custom else [sys.executable]


def rank_command(ranks: int, args: list[str], mpiexec: str | None = None) -> list[str]:
    """``MPIEXEC -n RANKS PYTHON ARGS...``: ``mpiexec`` or :func:`find_mpiexec`'s (``mpiexec`` on
    PATH when it finds none), PYTHON from :func:`python_command`."""
    launcher = mpiexec or find_mpiexec() or "mpiexec"
    return [launcher, "-n", str(ranks), *python_command(), *map(str, args)]


def checkout_first(env: dict) -> dict:
    """``env`` with this checkout first on ``PYTHONPATH`` (once), so that a child finds
    ``benchmarks`` and ``tools``, which are not installed, from any working directory."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT)] + (paths[1:] if paths[:1] == [str(ROOT)] else paths))}


def child_env(**extra: str) -> dict:
    """The children's environment (module docstring), with ``extra`` variables set on top."""
    env = checkout_first(fresh_world_env())
    env["HPCGNN_PROGRESS"] = "0"
    env.update(extra)
    return env


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), read from ``/proc``; [] where
    there is none (or no ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue                       # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, every process below it and their process groups: a child that starts
    its own ``mpiexec`` in a session of its own (a bench driver) takes that launcher and its
    ranks along, which killing the child's process group alone would leave running."""
    below = descendants(pid)
    own = os.getpgid(0)
    for p in [pid, *below]:
        try:
            group = os.getpgid(p)
            if group != own:           # a child left in this process's group dies by pid below
                os.killpg(group, 9)
        except (ProcessLookupError, PermissionError):
            pass
    for p in [pid, *below]:
        try:
            os.kill(p, 9)
        except (ProcessLookupError, PermissionError):
            pass


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` from the repository root in a session of its own, its command line and output
    in ``log``: (exit code, wall seconds); exit code None when it outlived ``timeout`` seconds
    and was killed with every process below it (:func:`kill_tree`: an ``mpiexec`` and its ranks,
    and what a bench driver started in sessions of their own)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=child_env() if env is None else env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            rc = None
    return rc, time.perf_counter() - t0


def run_checked(cmd: list[str], log: Path, timeout: float, who: str, env: dict | None = None) -> float:
    """:func:`run_logged`, for a step the bench cannot go on without: its wall seconds; a child
    that failed or outlived ``timeout`` seconds stops the bench (SystemExit naming ``who``, the
    command and the log's tail)."""
    rc, wall = run_logged(cmd, log, timeout, env)
    if rc != 0:
        why = f"timed out after {timeout:g} s" if rc is None else f"failed (exit {rc})"
        raise SystemExit(f"{who}: {' '.join(cmd)} {why}\n{Path(log).read_text()[-3000:]}")
    return wall
