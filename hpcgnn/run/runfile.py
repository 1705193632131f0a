"""The run file's layout and its one reader (:func:`read_run`, :func:`timing_parents`); rank 0
writes it (:class:`hpcgnn.run.output.RunOutput`).

``RUN/run.h5`` (``format = "hpcgnn-run"``, version 1) holds

* attributes: ``config`` (resolved configuration, JSON), ``engine``, ``num_ranks``,
  ``partition_hash`` (the store's content hash), ``partition_dir``, ``hpcgnn_version``,
  ``created``, ``status`` (``running`` / ``finished`` / ``stopped`` / ``failed``), ``ended``
  (when it became one of the last three), ``error`` (``failed`` only: the one-line reason),
  ``stopped_by`` (``stopped`` only: which stop signal on which ranks, :mod:`hpcgnn.run.stop`;
  its last epoch is checkpointed and ``--resume`` continues it), plus any set with
  :meth:`RunOutput.set_attrs`;
* ``metrics/epoch`` int64 [E] and ``metrics/<name>`` float64 [E] (loss, accuracies; NaN when an
  epoch was not evaluated);
* ``timings/<name>`` float64 [E, P] seconds per rank, ``counters/<name>`` float64 [E, P]
  (bytes, rows, hits ... per rank);
* the attribute ``parents`` of the group ``timings``: a JSON object mapping each timing to its
  parent, the timing whose seconds include it, in the order the phases first started. ``""``
  marks a root: ``epoch`` (the epoch's training, the engine's ``train_epoch``) and ``eval``
  (the evaluation after it, not part of ``epoch``). The engine's phases have parent ``epoch``
  (the top-level phases: they are disjoint, their sum is at most ``epoch``); a phase that ran
  inside another has that one (``cache`` -> ``forward``); ``"a+b"`` is a part of ``a`` and
  ``b`` together (the full-graph ``halo`` -> ``forward+backward+eval``, the tensor engine's
  ``compute`` -> ``nn+aggregate``). A timing with a parent other than ``""`` is never added to
  a total. Files written before the nesting was recorded lack the attribute (or a name):
  :func:`timing_parents` is the one reader, with the fallback by name for those;
* ``per_layer/<name>`` float64 [E, P, L] (per GNN layer statistics, e.g. HEC hit rate);
* ``labels/<name>`` bytes [E, P] (per-rank words, e.g. ``peak_rss_phase``: the phase in which
  the epoch's peak resident memory, ``counters/peak_rss_bytes``, was reached), and
  ``labels/device``: the compute device each rank ran the epoch on (``cpu``, ``cuda:1``; the
  index counts the devices the rank sees, see ``hpcgnn.runtime.choose_cuda_device``), written
  when the engine resolved one (``Runtime.device``); ``labels/comm_backend``: the backend that
  carried the data plane (``mpi4py``, ``gloo``, ``nccl``, ``ccl``: ``Runtime.data_plane``, the
  engine's :func:`hpcgnn.comm.data_plane.make_communicator` for ``runtime.backend``), written
  when the engine made one; ``labels/mpi_library``: the MPI library of the job
  (:func:`hpcgnn.runtime.mpi_library`). Per epoch, because a resumed run may continue on other
  devices, another backend or another MPI.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpcgnn.fileio import open_h5

RUN_FILE = "run.h5"
RUN_FORMAT = "hpcgnn-run"
RUN_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
DEBUG_DIR = "debug"
# What a run directory may contain that --force removes (nothing else is touched).
RUN_ENTRIES = (RUN_FILE, CHECKPOINT_DIR, DEBUG_DIR)
METRIC_ORDER = ("loss", "train_acc", "val_acc", "test_acc")


def _decode(v):
    return v.decode() if isinstance(v, bytes) else v


def read_run(run_dir: str | Path) -> dict:
    """Read ``RUN/run.h5`` into plain Python/numpy: attrs, metrics, timings, counters, per_layer,
    labels (str arrays), timing_parents (the recorded parents, ``{}`` in files from before;
    readers use :func:`timing_parents`)."""
    path = Path(run_dir)
    path = path / RUN_FILE if path.is_dir() else path
    with open_h5(path, RUN_FORMAT) as f:
        out = {"path": str(path), "attrs": {k: _decode(v) for k, v in f.attrs.items()}}
        for group in ("metrics", "timings", "counters", "per_layer"):
            out[group] = {k: np.asarray(f[group][k][()]) for k in f[group]} if group in f else {}
        out["labels"] = ({k: np.char.decode(np.asarray(f["labels"][k][()]), "utf-8") for k in f["labels"]}
                         if "labels" in f else {})
        recorded = f["timings"].attrs.get("parents") if "timings" in f else None
        out["timing_parents"] = {str(k): str(v) for k, v in json.loads(_decode(recorded)).items()} \
            if recorded is not None else {}
    return out


# Files from before the nesting was recorded: the nested timings by name (the minibatch engine's
# AEP and HEC inside forward, the full-graph halo in forward, backward and the evaluation, the
# tensor engine's compute = nn + aggregate); roots epoch and eval; every other one top-level.
_LEGACY_PARENTS = {"epoch": "", "eval": "", "comm_wait": "forward", "push": "forward", "cache": "forward",
                   "halo": "forward+backward+eval", "halo_wait": "forward", "halo_adjoint": "backward",
                   "compute": "nn+aggregate"}
_LEGACY_ORDER = ("sample", "fetch", "store_wait", "forward", "nn", "split", "aggregate", "attention",
                 "gather", "backward", "allreduce", "optimizer", "update")


def timing_parents(run: dict) -> dict[str, str]:
    """The parent of every timing of ``run`` (a :func:`read_run` dict; ``""`` for a root, see
    the module docstring), in display order: the recorded ones in the file's order, then any
    the file does not record by the names of files from before the nesting was recorded
    (``epoch``, ``eval`` roots; ``comm_wait``, ``push``, ``cache``, ``halo_wait`` in
    ``forward``; ``halo_adjoint`` in ``backward``; ``halo`` in ``forward+backward+eval``;
    ``compute`` in ``nn+aggregate``; every other one in ``epoch``)."""
    recorded = run.get("timing_parents") or {}
    names = list(run.get("timings", {}))
    out = {k: v for k, v in recorded.items() if k in names}
    rest = [k for k in _LEGACY_ORDER if k in names] + sorted(k for k in names if k not in _LEGACY_ORDER)
    for k in rest:
        out.setdefault(k, _LEGACY_PARENTS.get(k, "epoch"))
    return out
