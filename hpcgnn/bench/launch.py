"""Starting ``hpcgnn`` under this interpreter's MPI launcher from a bench driver (gpu_check, scale).

:func:`find_mpiexec` picks the launcher that matches the interpreter's mpi4py; :func:`run_logged`
runs a child with its output in a log file and a timeout; :func:`child_env`
is the environment of such a child: a fresh MPI world (no variables of a surrounding job or SLURM
step), this checkout on ``PYTHONPATH``, no progress bars; for Open MPI in a container: as root,
told that root is meant (its ``mpiexec`` refuses to start otherwise), and with neither ``ssh`` nor
``rsh`` installed, given ``false`` as its remote agent (it aborts at start-up looking for one even
when every rank runs on this node; a user's own ``OMPI_MCA_plm_rsh_agent`` is kept).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# launcher variables of a surrounding MPI job or SLURM step: a child must start a fresh world
STRIP_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCALNRANKS", "SLURM_")


def find_mpiexec() -> str | None:
    """The launcher of this interpreter's MPI: beside the interpreter (a venv with the MPICH
    wheel), the MPICH wheel's own, then ``mpiexec`` on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    try:
        from importlib import metadata
        for f in metadata.distribution("mpich").files or ():
            if f.name == "mpiexec":
                return str(f.locate())
    except Exception:  # noqa: BLE001 - no MPICH wheel: PATH decides
        pass
    return shutil.which("mpiexec")


def child_env(**extra: str) -> dict:
    """The children's environment (module docstring), with ``extra`` variables set on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIP_PREFIXES)}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["HPCGNN_PROGRESS"] = "0"
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    agent = os.environ.get("OMPI_MCA_plm_rsh_agent")
    if agent is not None:
        env["OMPI_MCA_plm_rsh_agent"] = agent
    elif not (shutil.which("ssh") or shutil.which("rsh")):
        env["OMPI_MCA_plm_rsh_agent"] = "false"
    env.update(extra)
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` from the repository root in a session of its own, its command line and output
    in ``log``: (exit code, wall seconds); exit code None when it outlived ``timeout`` seconds
    and was killed with its whole process group (an ``mpiexec`` and its ranks)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=child_env() if env is None else env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    return rc, time.perf_counter() - t0
