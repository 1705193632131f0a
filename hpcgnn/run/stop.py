"""Stopping a run on a batch system's signal: the epoch in progress ends, is checkpointed, and
the job exits :data:`EXIT_STOPPED` so that ``--resume`` (or a requeued job) continues it.

A batch system ends a job at its time limit with SIGTERM and, ``KillWait`` seconds later
(SLURM's default: 30 s), SIGKILL; ``sbatch --signal=USR1@LEAD`` sends SIGUSR1 LEAD seconds
before the limit; ``scancel --signal=USR1 JOB`` and a preemption do the same at any time.
Without a handler such a signal ends a rank at once and the run keeps only its last
checkpoint (``train.checkpoint_every = 0``, the default: none before the end).

:class:`StopRequest` installs a handler for each of ``train.stop_signals`` (default
``SIGTERM`` and ``SIGUSR1``) in a rank's main thread. The handler only records the signal: it
runs between two Python bytecodes of the main thread, so it prints nothing (a print from
within a print is an error) and touches no MPI or device state. The training loop
(:func:`hpcgnn.engine.loop.fit`) asks every rank with :meth:`StopRequest.agreed`, a collective
of one small object, after each epoch's training and after each evaluation; when any rank
holds a signal, every rank finishes the epoch (its evaluation skipped unless it is the last),
writes its checkpoint and leaves with :data:`EXIT_STOPPED`; ``run.h5`` says
``status = "stopped"`` with ``stopped_by`` (which signal, on which ranks). A signal during the
last epoch changes nothing: that run finishes. A second signal is no escalation (SLURM signals
a task's whole process group, so a rank may get one from its watcher and one directly); the
batch system's SIGKILL is what ends a stop that takes too long.

The handlers are installed with ``SA_RESTART`` (``signal.siginterrupt(s, False)``), so a system
call that MPI, gloo or HDF5 is waiting in resumes after the handler instead of failing with
``EINTR``.
"""
from __future__ import annotations

import signal
import time

# EX_TEMPFAIL of sysexits.h: "a temporary failure, the user is invited to retry"
EXIT_STOPPED = 75
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
DEFAULT_STOP_SIGNALS = ["SIGTERM", "SIGUSR1"]


def valid_stop_signals(names) -> bool:
    """``train.stop_signals``: a list of distinct names of :data:`STOP_SIGNALS`."""
    return (isinstance(names, list) and all(isinstance(n, str) and n in STOP_SIGNALS for n in names)
            and len(set(names)) == len(names))


def describe_ranks(ranks: list[int], size: int) -> str:
    """``rank 3``, ``ranks 0, 1``, ``every rank``, or the first eight ranks and how many more."""
    if len(ranks) == size and size > 1:
        return "every rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


class StopRequest:
    """The stop signals of one rank: which one came first (``signal``), and when (``received``,
    ``time.monotonic()`` seconds). ``names``: the signals handled; ``[]`` handles none (each then
    keeps its default action: death)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.signal: str | None = None
        self.received: float | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequest":
        """Handle :attr:`names` from now on (the main thread only, as Python requires)."""
        for name in self.names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)
            signal.siginterrupt(signum, False)
        return self

    def restore(self) -> None:
        """Put back the handlers that :meth:`install` replaced."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            self.received = time.monotonic()

    def agreed(self, rt) -> str | None:
        """Collective: None when no rank has received a stop signal, else the reason, the same on
        every rank, e.g. ``SIGUSR1 on every rank`` or ``SIGTERM on rank 1``."""
        if not self.names:
            return None
        ranks: dict[str, list[int]] = {}
        for r, name in enumerate(rt.comm.allgather(self.signal)):
            if name is not None:
                ranks.setdefault(name, []).append(r)
        if not ranks:
            return None
        return "; ".join(f"{name} on {describe_ranks(rs, rt.size)}" for name, rs in ranks.items())
