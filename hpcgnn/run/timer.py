"""Per-phase wall-clock seconds of one epoch, their nesting, and the epoch's memory peaks
(:class:`PhaseTimer`)."""
from __future__ import annotations

import contextlib
import time

import torch


class PhaseTimer:
    """Accumulated wall-clock seconds per named phase (``with timer.phase('forward'): ...``),
    and the epoch's peak memory with the phase in which it was reached (``timer.memory``, a
    :class:`~hpcgnn.run.memory.PeakMonitor` read at the end of every phase; :meth:`reset` starts
    a new epoch for both).

    Nesting is recorded, not declared: ``parents[name]`` is the phase that was open when
    ``name`` first started (a stack of open phases; None at the top level), in the order the
    phases first started. A name has one parent: opened again under another parent (another
    depth, or inside itself), its seconds go to ``"<parent>/<name>"`` (``"top/<name>"`` at the
    top level) with that parent, so no second is ever inside two phases of one name. Seconds
    measured outside :meth:`phase` are added with :meth:`add`, which needs their parent.
    ``parents`` outlives :meth:`reset` (the nesting is the code's, not the epoch's)."""

    def __init__(self, sync_cuda: bool = False, cuda_device=None):
        from hpcgnn.run.memory import PeakMonitor

        self.seconds: dict[str, float] = {}
        self.parents: dict[str, str | None] = {}
        self._open: list[str] = []
        self.sync_cuda = sync_cuda and torch.cuda.is_available()
        self.memory = PeakMonitor(cuda_device if self.sync_cuda else None)

    @contextlib.contextmanager
    def phase(self, name: str):
        parent = self._open[-1] if self._open else None
        if self.parents.setdefault(name, parent) != parent:
            name = f"{parent or 'top'}/{name}"
            self.parents.setdefault(name, parent)
        self._open.append(name)
        if self.sync_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._open.pop()
            if self.sync_cuda:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + (time.perf_counter() - t0)
            self.memory.after(name)

    def add(self, name: str, seconds: float, *, parent: str | None) -> None:
        """Add ``seconds`` to timing ``name``, measured outside :meth:`phase`; ``parent``: the
        phase whose seconds include these (None: top level; ``"a+b"``: part of ``a`` and ``b``
        together). ValueError when ``name`` already has another parent."""
        if self.parents.setdefault(name, parent) != parent:
            raise ValueError(f"timing {name!r}: parent {parent!r} declared, {self.parents[name]!r} recorded")
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    def reset(self) -> None:
        self.seconds = {}
        self.memory.start()

    def memory_record(self) -> tuple[dict, dict]:
        """(counters, labels) of the epoch's memory peaks for :meth:`RunOutput.log_epoch`."""
        res = self.memory.result()
        counters = {k: v for k, v in res.items() if k.endswith("_bytes")}
        labels = {k: v for k, v in res.items() if k.endswith("_phase")}
        return counters, labels
