"""Observers of training, kept out of the engines' hot paths.

:class:`TrainHooks` does nothing; the engines call it at a few points (before and after each
iteration, with each layer's input when :attr:`TrainHooks.wants_layer_inputs`, after each epoch).
:class:`DebugHooks` is the test instrumentation behind ``train.debug_record`` and
``train.debug_kill``; :func:`make_hooks` picks one from the configuration.
"""
from __future__ import annotations

import os
import signal

import numpy as np


class TrainHooks:
    """No-op observer. ``wants_layer_inputs`` / ``wants_exchanges``: whether the engine should
    call :meth:`layer_input` and keep a record of its embedding pushes (costly; tests only)."""

    wants_layer_inputs = False
    wants_exchanges = False

    def before_step(self, epoch: int, step: int) -> None:
        """Before iteration ``step`` (0-based) of ``epoch``."""

    def after_step(self, epoch: int, step: int, loss: float, seeds: int, model) -> None:
        """After the optimizer step of iteration ``step``: its local loss (NaN when the rank had
        no seeds) and seed count."""

    def layer_input(self, engine, epoch: int, step: int, layer: int, frontier: np.ndarray, h) -> None:
        """Layer ``layer``'s input rows ``h`` of the local vertices ``frontier`` (as the model sees
        them, after any cache replacement)."""

    def after_epoch(self, epoch: int, engine) -> None:
        """After the epoch has been logged (before its checkpoint)."""


class DebugHooks(TrainHooks):
    """``train.debug_kill = [rank, epoch, step]``: that rank SIGKILLs itself before that step;
    ``[rank, epoch, step, name]`` sends itself the signal ``name`` there instead (e.g. ``SIGUSR1``,
    a stop signal: :mod:`hpcgnn.run.stop`), once.
    ``train.debug_record``: one HDF5 file per rank (``RUN/debug/rank-NNNNN.h5``) with per-step
    losses and parameter checksums, AEP pushes/receives, and the layer inputs of the frontier's
    boundary and halo vertices.

    Layout: ``steps`` (epoch, step, loss, seeds, checksum); for each of ``pushes``, ``receives``,
    ``inputs`` a group with ``index`` [n, 6] int64 rows (epoch, iteration, layer, offset, count,
    width) into the concatenated ``ids``, ``ranks`` (destination / source rank; -1 for inputs)
    and ``rows`` (float32, zero-padded to the widest record).
    """

    def __init__(self, rank: int, kill: list, record_path=None):
        self.rank = int(rank)
        self.kill = list(kill)
        self.path = record_path
        self.wants_layer_inputs = self.wants_exchanges = record_path is not None
        self.steps: list[tuple] = []
        self.inputs: list[tuple] = []
        self._mask = None

    def before_step(self, epoch: int, step: int) -> None:
        if self.kill and self.kill[:3] == [self.rank, epoch, step]:
            name = self.kill[3] if len(self.kill) > 3 else "SIGKILL"
            self.kill = []            # once per process
            os.kill(os.getpid(), getattr(signal, name))

    def after_step(self, epoch: int, step: int, loss: float, seeds: int, model) -> None:
        if self.path is not None:
            from hpcgnn.engine.model import parameter_checksum

            self.steps.append((epoch, step, float(loss), int(seeds), parameter_checksum(model).encode()))

    def layer_input(self, engine, epoch: int, step: int, layer: int, frontier: np.ndarray, h) -> None:
        if self.path is None or not frontier.size:
            return
        part = engine.part
        if self._mask is None:
            # boundary solid vertices (halo elsewhere) and halo vertices
            self._mask = np.zeros(part.num_local, dtype=bool)
            self._mask[part.send_ids - part.solid_begin] = True
            self._mask[part.num_solid:] = True
        import torch

        sel = np.flatnonzero(self._mask[frontier])
        self.inputs.append((epoch, step, layer, part.to_global(frontier[sel]),
                            h.detach()[torch.from_numpy(sel).to(h.device)].cpu().numpy()))

    def after_epoch(self, epoch: int, engine) -> None:
        if self.path is not None:
            self.write(getattr(engine, "aep", None))

    @staticmethod
    def _write_group(f, name: str, records: list[tuple]) -> None:
        g = f.create_group(name)
        index = np.zeros((len(records), 6), dtype=np.int64)
        width = max((r[5].shape[1] for r in records), default=0)
        off = 0
        for i, (epoch, it, layer, ids, _, rows) in enumerate(records):
            index[i] = (epoch, it, layer, off, ids.shape[0], rows.shape[1])
            off += ids.shape[0]
        g.create_dataset("index", data=index)
        g.create_dataset("ids", data=np.concatenate([r[3] for r in records] or [np.zeros(0)]).astype(np.int64))
        g.create_dataset("ranks", data=np.concatenate([r[4] for r in records] or [np.zeros(0)]).astype(np.int32))
        rows = np.zeros((off, width), dtype=np.float32)
        for (_, _, _, o, n, w), r in zip(index, records):
            rows[o:o + n, :w] = r[5]
        g.create_dataset("rows", data=rows)

    def write(self, aep) -> None:
        """Rewrite the rank's record file (atomic)."""
        import h5py

        from hpcgnn.fileio import atomic_file

        self.path.parent.mkdir(parents=True, exist_ok=True)
        as_tuple = (lambda r: (r.epoch, r.iteration, r.layer, r.ids, r.dest, r.rows))
        with atomic_file(self.path) as tmp, h5py.File(tmp, "w") as f:
            s = np.array(self.steps, dtype=[("epoch", "i8"), ("step", "i8"), ("loss", "f8"),
                                            ("seeds", "i8"), ("checksum", "S64")])
            f.create_dataset("steps", data=s)
            self._write_group(f, "pushes", [as_tuple(r) for r in (aep.pushes if aep else [])])
            self._write_group(f, "receives", [as_tuple(r) for r in (aep.receives if aep else [])])
            self._write_group(f, "inputs", [(e, k, l, ids, np.full(ids.shape[0], -1, np.int32), rows)
                                            for e, k, l, ids, rows in self.inputs])


def make_hooks(cfg, rt, out) -> TrainHooks:
    """:class:`DebugHooks` when ``train.debug_record`` or ``train.debug_kill`` is set, else the
    no-op :class:`TrainHooks`."""
    t = cfg.train
    if not t.debug_record and not t.debug_kill:
        return TrainHooks()
    path = out.debug_dir / f"rank-{rt.rank:05d}.h5" if t.debug_record else None
    return DebugHooks(rt.rank, list(t.debug_kill), path)
