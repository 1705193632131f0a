"""Run real MPI jobs from tests: `.venv/bin/mpiexec -n N python ...` with a timeout.

The child's environment is the benches' (benchmarks/launch.py): stripped of the
launcher variables of any surrounding MPI job (PMI_*, HYDRA_*, OMPI_*, SLURM_*, ...)
so a test run inside mpiexec or srun still starts a fresh world. A job that outlives its
timeout is killed with its whole process group and the test fails: no test can
hang.

Under pytest, ranks and CLI runs start as forks of the session's fork server
(tests/zygote.py: torch is imported once, not once per process); ``HPCGNN_TEST_ZYGOTE=0``
starts each one as a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import zygote  # tests/zygote.py, next to this file

from hpcgnn.runtime import find_mpiexec

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(find_mpiexec() or "mpiexec")   # this interpreter's launcher (hpcgnn.runtime)
ZYGOTE_VAR = "HPCGNN_TEST_ZYGOTE"   # the fork server's socket (conftest.py), or 0: none


def python(fresh: bool = False) -> list[str]:
    """The interpreter command a launch runs: ``python``, or the client of the session's fork
    server (tests/zygote.py), which runs the same arguments as a fork of an interpreter that
    has imported torch, or execs ``python`` itself where that would differ. ``fresh``: always
    ``python`` (tests that compare a process's resident memory with an estimate made for a
    fresh interpreter: a fork's resident pages are the ones the server had touched)."""
    socket = os.environ.get(ZYGOTE_VAR, "")
    if fresh or socket in ("", "0") or not os.path.exists(socket):
        return [sys.executable]
    return zygote.client_command(socket)


def clean_env(extra: dict | None = None) -> dict:
    """The benches' child environment (:func:`benchmarks.launch.child_env`: a fresh MPI world,
    this checkout first on PYTHONPATH, no progress bars, Open MPI as root), one OpenMP thread
    unless set, then ``extra``."""
    from benchmarks.launch import child_env

    env = child_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


def run_mpi(n: int, args: list[str], timeout: float = 120, env: dict | None = None,
            cwd: str | os.PathLike | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``python args...`` on ``n`` ranks; return the completed process (text output).

    ``args`` starts with a script path or ``-m module``. Raises AssertionError
    with the captured output if the job exceeds ``timeout`` seconds.
    """
    cmd = [str(MPIEXEC), "-n", str(n), *python(fresh), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(env), cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"MPI job timed out after {timeout}s: {' '.join(cmd)}\n"
                             f"--- stdout\n{out}\n--- stderr\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m hpcgnn args...`` in one process (no MPI launcher); ``fresh``: as in
    :func:`python`."""
    cmd = [*python(fresh), "-m", "hpcgnn", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(env))


def debug_env(kill: list | None = None, record: bool = False) -> dict:
    """The environment that installs the test suite's instrumentation (tests/debug_hooks.py) in
    `hpcgnn train`: ``kill`` ``[rank, epoch, step]`` makes that rank SIGKILL itself before that
    step, ``[rank, epoch, step, "SIGUSR1"]`` send itself that signal; ``record`` writes per-step
    records to ``RUN/debug/rank-NNNNN.h5``."""
    return {"HPCGNN_TRAIN_HOOKS": str(ROOT / "tests" / "debug_hooks.py"),
            "HPCGNN_DEBUG_HOOKS": json.dumps({"kill": list(kill or []), "record": bool(record)})}


def train_job(config, run_dir, *sets: str, verbose: bool = False, resume: bool = False,
              expect: int = 0, env: dict | None = None) -> dict:
    """One `hpcgnn train --config CONFIG --force` job of :func:`run_jobs` (``resume``: ``--resume``
    instead of ``--force``): ``output.dir`` is ``run_dir``, ``sets`` are ``KEY=VALUE`` overrides;
    ``expect``: the exit code the job must end with for the launch to go on; ``env``: environment
    variables set for this job alone (:func:`debug_env`)."""
    return {"kind": "train", "config": str(config), "set": [f"output.dir={run_dir}", *map(str, sets)],
            "verbose": verbose, "resume": resume, "expect": expect, "env": dict(env or {})}


def run_jobs(n: int, jobs: list[dict], workdir: Path, timeout: float = 300,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``jobs`` (:func:`train_job`, or infer jobs: tests/jobs_driver.py) one after the other
    in ONE launch on ``n`` ranks; the completed process (exit code of the first failing job)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"jobs-{n}.json"
    spec.write_text(json.dumps(jobs))
    return run_mpi(n, [ROOT / "tests" / "jobs_driver.py", spec], timeout=timeout, env=env, cwd=ROOT)
