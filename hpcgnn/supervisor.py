"""A rank's watcher: say which rank a signal killed, and why it probably died.

A rank killed by SIGKILL (the kernel's OOM killer, a batch system's memory limit) cannot
report anything itself, and MPICH's launcher then prints only "BAD TERMINATION". So
``hpcgnn train`` forks before it imports torch or MPI: the child is the rank and does all the
work; the parent is a small process that waits for it, forwards the signals a batch system
sends (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT) and, when the child dies of a
signal, prints one line to stderr::

    hpcgnn: error: rank 2 was killed by SIGKILL (out of memory? its peak resident memory was 6.52 GiB)

and then dies of the same signal: the launcher sees a rank killed by a signal, as before, and
ends the other ranks at once (a shell reports exit status 128 + the signal number). The child gets SIGKILL if the parent dies
(``PR_SET_PDEATHSIG``), so no rank outlives its watcher. ``HPCGNN_SUPERVISE=0`` turns the
watcher off (the command then runs in the launched process itself).

The parent touches no MPI state: the child inherits the launcher's environment and file
descriptors (PMI) and initialises MPI itself. A process that started MPI before calling
:func:`run_watched` (a script of its own that imports ``mpi4py.MPI`` and then calls
``hpcgnn.cli.main``) runs the work itself, unwatched: a fork would finalise, in the child, an
MPI whose progress threads stayed in the parent (UCX then joins a thread that is not its own,
and the rank hangs at exit).

Launchers: a rank killed by a signal must end the job with a non-zero exit status, or a batch
script reads success. MPICH's Hydra (``mpiexec``, ``mpiexec.hydra``, ``mpirun``), SLURM's
``srun`` and Open MPI's ``mpiexec`` do; MPICH's forking launcher ``mpiexec.gforker`` reports a
rank killed by a signal as exit status 0, so :func:`run_watched` refuses it
(:func:`unsupported_launcher`, one line, exit 2 on every rank, before any work).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

from hpcgnn.errors import EXIT_INPUT

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCONT")
SUPPORTED_LAUNCHERS = ("MPICH's mpiexec (Hydra: mpiexec, mpiexec.hydra, mpirun), srun --mpi=pmi2, "
                       "Open MPI's mpiexec")
# Launchers whose exit status is 0 when a rank dies of a signal (names of their executables).
UNSUPPORTED_LAUNCHERS = ("mpiexec.gforker", "gforker")

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
PR_SET_PDEATHSIG = 1


def launcher_rank() -> int | None:
    """This process's rank as its launcher announced it (None outside a launcher)."""
    for var in RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def _process_names(pid: int) -> list[str]:
    """The names process ``pid`` goes by (Linux /proc): its executable's file name, the name of
    the program it was started as, its command name; ``[]`` where /proc cannot tell."""
    names = []
    try:
        names.append(os.path.basename(os.readlink(f"/proc/{pid}/exe")))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
        if argv0:
            names.append(os.path.basename(argv0))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/comm") as f:
            names.append(f.read().strip())
    except OSError:
        pass
    return names


def unsupported_launcher(parent: int | None = None) -> str | None:
    """The one-line error for a launcher whose exit status hides a rank killed by a signal
    (:data:`UNSUPPORTED_LAUNCHERS`: the process that started this one, ``parent``, default
    ``os.getppid()``, under a launcher's rank variables), None for every other start."""
    if launcher_rank() is None:
        return None
    pid = os.getppid() if parent is None else parent
    for name in _process_names(pid):
        if name in UNSUPPORTED_LAUNCHERS:
            return (f"this job was started by {name} (pid {pid}), whose exit status is 0 even when a "
                    "rank is killed, so a batch script would read success: launch with one of "
                    f"{SUPPORTED_LAUNCHERS}")
    return None


def enabled() -> bool:
    """Whether :func:`run_watched` forks (Linux, HPCGNN_SUPERVISE is not 0, and this process
    has not started MPI)."""
    return (hasattr(os, "fork") and sys.platform.startswith("linux")
            and os.environ.get("HPCGNN_SUPERVISE", "1").strip() not in ("0", "false", "no")
            and not mpi_started())


def mpi_started() -> bool:
    """Whether this process has initialised MPI through mpi4py (and not finalised it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Is_initialized()) and not mpi.Is_finalized()


def death_message(rank: int | None, signum: int, peak_rss_bytes: int) -> str:
    """The line printed for a child killed by ``signum``."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    who = f"rank {rank}" if rank is not None else "hpcgnn"
    peak = f"its peak resident memory was {peak_rss_bytes / 2**30:.2f} GiB"
    if signum == signal.SIGKILL:
        return f"{who} was killed by {name} (out of memory? {peak})"
    return f"{who} was killed by {name} ({peak})"


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """Get ``signum`` when ``parent`` (this process's parent now) dies; exit at once if it has
    died already (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - prctl is Linux-only, checked by enabled()
        return
    if os.getppid() != parent:          # the parent died before prctl took effect
        os._exit(1)


def run_watched(work: Callable[[], int]) -> int:
    """Run ``work()`` in a forked child and return its exit code (in the child: ``work()``'s own
    return value, so the child leaves through the normal interpreter exit, atexit handlers and
    MPI finalisation included). The parent never returns: it exits with the child's code.
    Under an unsupported launcher (:func:`unsupported_launcher`) nothing runs: one line (rank 0's)
    and :data:`EXIT_INPUT` on every rank."""
    refused = unsupported_launcher()
    if refused is not None:
        if launcher_rank() in (None, 0):
            print(f"hpcgnn: error: {refused}", file=sys.stderr, flush=True)
        return EXIT_INPUT
    if not enabled():
        return work()
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    # The watcher takes signals synchronously (sigtimedwait) with them blocked from before the
    # fork: a Python-level handler could miss one that arrives just before a blocking wait4
    # (the handler runs only when the wait returns), and the rank would never get it.
    forwarded = {getattr(signal, name) for name in FORWARDED}
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, forwarded | {signal.SIGCHLD})
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        die_with_parent(parent)
        return work()
    while True:
        try:
            pid, status, usage = os.wait4(child, os.WNOHANG)
        except ChildProcessError:       # pragma: no cover - reaped elsewhere
            os._exit(1)
        if pid == child:
            break
        info = signal.sigtimedwait(forwarded | {signal.SIGCHLD}, 1.0)
        if info is not None and info.si_signo in forwarded:
            _forward(child, info.si_signo)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        print(f"hpcgnn: error: {death_message(launcher_rank(), signum, usage.ru_maxrss * 1024)}",
              file=sys.stderr, flush=True)
        _die_by(signum)
    os._exit(os.waitstatus_to_exitcode(status))


def _die_by(signum: int) -> None:
    """End this process by ``signum`` itself, as the child ended: a launcher treats a rank that
    died of a signal as a failed job at once (MPICH's mpiexec kills the other ranks), where a
    plain non-zero exit may only be noticed when the others next communicate."""
    for name in FORWARDED:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError):   # SIGKILL/SIGSTOP cannot be caught: their default is death
        pass
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})   # the watcher blocks what it forwards
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)          # a signal whose default is not death (e.g. SIGCHLD)


def _forward(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass
