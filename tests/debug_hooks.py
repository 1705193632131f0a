"""The test suite's training instrumentation, installed in `hpcgnn train` through the seam of
:func:`hpcgnn.engine.hooks.make_hooks`: ``HPCGNN_TRAIN_HOOKS`` names this file and
``HPCGNN_DEBUG_HOOKS`` holds its settings as JSON, ``{"kill": [...], "record": true}``
(:func:`mpiutil.debug_env` makes both):

``kill``    ``[rank, epoch, step]``: that rank SIGKILLs itself before that step (failure
            handling); ``[rank, epoch, step, "SIGUSR1"]`` sends it that signal instead (stopping).
``record``  per-step losses, parameter checksums, AEP pushes/receives and layer inputs in
            ``RUN/debug/rank-NNNNN.h5`` (:func:`mb_support.read_debug` reads them).
"""
from __future__ import annotations

import json
import os
import signal

import numpy as np

from hpcgnn.engine.hooks import TrainHooks
from hpcgnn.errors import InputError

SETTINGS_VAR = "HPCGNN_DEBUG_HOOKS"


def parse(text: str) -> tuple[list, bool]:
    """``(kill, record)`` from the JSON settings ``text``; InputError naming the variable and the
    value where it is not the documented form."""
    try:
        spec = json.loads(text or "{}")
    except json.JSONDecodeError:
        raise InputError(f"{SETTINGS_VAR} = {text!r}: expected a JSON object") from None
    if not isinstance(spec, dict) or set(spec) - {"kill", "record"}:
        raise InputError(f"{SETTINGS_VAR} = {text!r}: expected a JSON object with keys kill and record")
    kill, record = spec.get("kill", []), spec.get("record", False)

    def is_count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    ok = isinstance(kill, list) and (
        not kill or (len(kill) in (3, 4) and all(is_count(v) for v in kill[:3])
                     and (len(kill) == 3 or kill[3] in signal.Signals.__members__)))
    if not ok:
        raise InputError(f"{SETTINGS_VAR}: kill = {kill!r}, expected [] or [rank, epoch, step] (integers >= 0), "
                         "optionally with a signal name (e.g. 'SIGTERM') fourth")
    if not isinstance(record, bool):
        raise InputError(f"{SETTINGS_VAR}: record = {record!r}, expected true or false")
    return list(kill), record


def make_hooks(cfg, rt, out) -> TrainHooks:
    """:class:`DebugHooks` with the settings of ``HPCGNN_DEBUG_HOOKS`` (the no-op hooks when it
    asks for nothing)."""
    kill, record = parse(os.environ.get(SETTINGS_VAR, ""))
    if not kill and not record:
        return TrainHooks()
    return DebugHooks(rt.rank, kill, out.debug_dir / f"rank-{rt.rank:05d}.h5" if record else None)


class DebugHooks(TrainHooks):
    """``kill = [rank, epoch, step]``: that rank SIGKILLs itself before that step;
    ``[rank, epoch, step, name]`` sends itself the signal ``name`` there instead (e.g. ``SIGUSR1``,
    a stop signal: :mod:`hpcgnn.run.stop`), once.
    ``record_path``: one HDF5 file per rank (``RUN/debug/rank-NNNNN.h5``) with per-step
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
