"""Per-phase wall-clock seconds of one epoch, their nesting, and the epoch's memory peaks
(:class:`PhaseTimer`).

On CUDA a phase is timed with a pair of CUDA events recorded on the current stream at its entry
and exit (no synchronisation in the hot loop); the events are resolved, with one
``synchronize()``, when the totals are read (:attr:`PhaseTimer.seconds`, once per epoch by the
training loop). Host phases (``phase(name, host=True)``: no device work) and every phase off
CUDA are timed with ``time.perf_counter``."""
from __future__ import annotations

import contextlib
import time

import torch


class PhaseTimer:
    """Accumulated wall-clock seconds per named phase (``with timer.phase('forward'): ...``),
    and the epoch's peak memory with the phase in which it was reached (``timer.memory``, a
    :class:`~hpcgnn.run.memory.DeviceMemoryMeter` read at the end of every phase, inside the
    phase's seconds, so that the phases of an epoch cover it; :meth:`reset` starts a new epoch
    for both).

    Nesting is recorded, not declared: ``parents[name]`` is the phase that was open when
    ``name`` first started (a stack of open phases; None at the top level), in the order the
    phases first started. A name has one parent: opened again under another parent (another
    depth, or inside itself), its seconds go to ``"<parent>/<name>"`` (``"top/<name>"`` at the
    top level) with that parent, so no second is ever inside two phases of one name. Seconds
    measured outside :meth:`phase` are added with :meth:`add`, which needs their parent.
    ``parents`` outlives :meth:`reset` (the nesting is the code's, not the epoch's).

    ``sync_cuda``: time phases on the CUDA device ``cuda_device`` with events (GPU time between
    the entry and exit of a phase on the current stream, which is the wall-clock time of the
    phase's work once the epoch's kernels have run). ``cuda``: the module providing
    ``synchronize()`` and ``Event(enable_timing=True)`` (``torch.cuda``; a stand-in in tests, which
    also makes event timing usable without a GPU)."""

    def __init__(self, sync_cuda: bool = False, cuda_device=None, cuda=None):
        from hpcgnn.run.memory import DeviceMemoryMeter

        self._seconds: dict[str, float] = {}
        self.parents: dict[str, str | None] = {}
        self._open: list[str] = []
        self._cuda = cuda if cuda is not None else torch.cuda
        self.events = bool(sync_cuda) and (cuda is not None or torch.cuda.is_available())
        self.sync_cuda = self.events       # kept for readers of the old name
        self._pending: list[tuple[str, object, object]] = []
        self.syncs = 0                     # synchronize() calls issued (tests, diagnostics)
        on_cuda = self.events and cuda is None
        self.memory = DeviceMemoryMeter(cuda_device if on_cuda else "cpu")

    @contextlib.contextmanager
    def phase(self, name: str, host: bool = False):
        """Time the block as phase ``name``; ``host``: it does no device work (perf_counter)."""
        parent = self._open[-1] if self._open else None
        if self.parents.setdefault(name, parent) != parent:
            name = f"{parent or 'top'}/{name}"
            self.parents.setdefault(name, parent)
        self._open.append(name)
        if self.events and not host:
            start = self._cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                self._open.pop()
                self.memory.after(name)
                end = self._cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((name, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._open.pop()
            self.memory.after(name)
            self._seconds[name] = self._seconds.get(name, 0.0) + (time.perf_counter() - t0)

    def resolve(self) -> None:
        """Wait for the device (one ``synchronize()``) and add the recorded event pairs' seconds."""
        if not self._pending:
            return
        self._cuda.synchronize()
        self.syncs += 1
        for name, start, end in self._pending:
            self._seconds[name] = self._seconds.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        self._pending.clear()

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per phase since :meth:`reset` (resolves pending device events first)."""
        self.resolve()
        return self._seconds

    def add(self, name: str, seconds: float, *, parent: str | None) -> None:
        """Add ``seconds`` to timing ``name``, measured outside :meth:`phase`; ``parent``: the
        phase whose seconds include these (None: top level; ``"a+b"``: part of ``a`` and ``b``
        together). ValueError when ``name`` already has another parent."""
        if self.parents.setdefault(name, parent) != parent:
            raise ValueError(f"timing {name!r}: parent {parent!r} declared, {self.parents[name]!r} recorded")
        self._seconds[name] = self._seconds.get(name, 0.0) + float(seconds)

    def reset(self) -> None:
        """Start a new epoch: drop the totals (events still pending are discarded unresolved)."""
        self._pending.clear()
        self._seconds = {}
        self.memory.start()

    def memory_record(self) -> tuple[dict, dict]:
        """(counters, labels) of the epoch's memory peaks for :meth:`RunOutput.log_epoch`."""
        res = self.memory.result()
        counters = {k: v for k, v in res.items() if k.endswith("_bytes")}
        labels = {k: v for k, v in res.items() if k.endswith("_phase")}
        return counters, labels
