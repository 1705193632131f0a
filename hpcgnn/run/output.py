"""The run directory and its HDF5 run file, written by rank 0 (:class:`RunOutput`); the file's
layout and its reader are :mod:`hpcgnn.run.runfile`'s, the checks of ``--resume``
:mod:`hpcgnn.run.resume`'s.

``status`` is ``running`` while the job runs. Rank 0 writes ``failed`` (with ``error``) when it
leaves through the runtime's failure policy after the run file exists: an input error (raised on
every rank), an exception on rank 0, Ctrl-C, a non-zero ``SystemExit``. A run whose rank 0 is
killed (SIGKILL, out of memory), or ended by the launcher because another rank was killed or
aborted, keeps ``running``: no process is left that could write. ``running`` in a run file of a
job that is no longer running therefore means "ended from outside".

``--resume`` (:class:`RunOutput` with ``resume=True``) continues a run after
:mod:`hpcgnn.run.resume`'s checks. A directory without a run starts a new one (one line says so).

The file is small and rewritten atomically (a temporary, then a rename), so it is always
readable, also while the job runs or after it was killed. It is rewritten after an epoch once
the last rewrite is ``output.flush_seconds`` old (default 1 s; 0 = after every epoch: a
rewrite costs about 20 ms of rank 0's time on a small run, more than a whole epoch of a small
graph), and always after the first epoch of the job (also of a resumed one) and the last, before each checkpoint
(:meth:`RunOutput.flush`: a run file never holds fewer epochs than the newest checkpoint), on
failure and at the end. A rank 0 killed from outside therefore loses at most the epochs of the
last ``flush_seconds`` from the file, never one a checkpoint holds. The file is written through
:func:`hpcgnn.fileio.atomic_h5`: a full disk is one line naming ``run.h5`` and the OS reason. What the run prints is :mod:`hpcgnn.run.console`'s.
"""
from __future__ import annotations

import datetime
import json
import math
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from hpcgnn import __version__
from hpcgnn.errors import InputError
from hpcgnn.fileio import atomic_h5, check_writable_dir, write_error, write_failure
from hpcgnn.run.console import warn
from hpcgnn.run.resume import check_run, check_settings
from hpcgnn.run.runfile import (CHECKPOINT_DIR, DEBUG_DIR, METRIC_ORDER, RUN_ENTRIES, RUN_FILE, RUN_FORMAT,
                                RUN_VERSION, read_run)

# commands/infer.py imports these from here
__all__ = ["RunOutput", "holds_run", "RUN_FILE", "read_run", "warn"]

# Attributes of the old run file that describe its end, not the run: not carried into a resume.
_END_ATTRS = ("format", "version", "created", "status", "ended", "error", "stopped_by")


def _union(dicts) -> list[str]:
    names: list[str] = []
    for d in dicts:
        for k in (d or {}):
            if k not in names:
                names.append(k)
    return names


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds (part of) a run: a run file, a checkpoint or debug records.
    Empty ``checkpoints/`` / ``debug/`` directories (a start that failed before anything was
    written) and the lock file are not a run."""
    from hpcgnn.run.checkpoint import list_checkpoints

    debug = run_dir / DEBUG_DIR
    return ((run_dir / RUN_FILE).exists() or bool(list_checkpoints(run_dir))
            or (debug.is_dir() and any(debug.iterdir())))


class RunOutput:
    """The run directory of one training job (collective constructor and ``log_epoch``).

    ``force`` replaces an existing run (only ``run.h5``, ``checkpoints/`` and ``debug/`` are
    removed); ``resume`` continues one (history after the resumed epoch is dropped by
    :meth:`rewind`). Without either, an existing run is refused with an InputError on every rank.
    """

    def __init__(self, run_dir, rt, cfg, meta, resume: bool, force: bool):
        self.run_dir = Path(run_dir)
        self.rt = rt
        self.cfg = cfg
        self.meta = meta
        self.resume = bool(resume)
        self.engine = cfg.train.engine
        self._history: list[dict] = []
        self._attrs: dict = {}
        self._timing_parents: dict[str, str] = {}
        self._lock = None
        self._flush_s = float(cfg.output.flush_seconds)
        self._last_write = -math.inf   # time.monotonic() of this job's last rewrite after an epoch
        self._unwritten = 0            # epochs logged since the last rewrite
        self.resume_state = None   # rank 0, --resume: the checkpoint resume.check_checkpoint accepted
        error = None
        if rt.is_root:
            try:
                self._prepare(force)
                self._write()
            except InputError as exc:
                error = str(exc)
            except OSError as exc:
                error = str(write_failure(self.run_dir / RUN_FILE, exc))
            if error is not None and self._lock is not None:
                self._lock.release()
        rt.agree(error)
        self._device_warned = False
        self._mpi_library: str | None = None   # hpcgnn.runtime.mpi_library(), asked once
        if hasattr(rt, "on_failure"):
            rt.on_failure(self._failed)

    # ---- set-up (rank 0) ------------------------------------------------
    def _prepare(self, force: bool) -> None:
        """Rank 0: lock the directory, check what it holds against --force/--resume, make sure
        it and ``checkpoints/`` are writable (before any work), load the history to resume."""
        from hpcgnn.run.lock import lock_run_dir

        d = self.run_dir
        if self.resume and force:
            raise InputError("--resume and --force exclude each other")
        if d.exists() and not d.is_dir():
            raise InputError(f"{d}: output.dir exists and is not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(d, exc, "cannot create the run directory") from None
        self._lock = lock_run_dir(d, "train --resume" if self.resume else "train")
        existing = holds_run(d)
        if existing and not (force or self.resume):
            raise InputError(f"{d}: run directory already holds a run (pass --force to replace it "
                             "or --resume to continue it)")
        if self.resume and not (d / RUN_FILE).exists():
            if existing:   # checkpoints/ or debug/ but no run file
                from hpcgnn.run.checkpoint import list_checkpoints

                if list_checkpoints(d):
                    raise InputError(f"{d}: --resume but the directory has checkpoints and no "
                                     f"{RUN_FILE}, so the run's settings cannot be checked (pass "
                                     "--force to start a new run there)")
        check_writable_dir(d, "run directory")
        if self.resume and (d / RUN_FILE).exists():
            self._load_history()
        elif self.resume:
            warn(f"--resume: {d} holds no run ({RUN_FILE} not found): starting a new run")
        self._attrs.setdefault("run_id", uuid.uuid4().hex)
        if force:
            for entry in RUN_ENTRIES:
                p = d / entry
                try:
                    if p.is_dir():
                        shutil.rmtree(p)
                    elif p.exists():
                        p.unlink()
                except OSError as exc:
                    raise write_error(p, exc, "cannot remove the old run's") from None
        try:
            (d / CHECKPOINT_DIR).mkdir(exist_ok=True)
        except OSError as exc:
            raise write_error(d / CHECKPOINT_DIR, exc, "cannot create") from None
        check_writable_dir(d / CHECKPOINT_DIR, "checkpoint directory")

    def _load_history(self) -> None:
        old = read_run(self.run_dir)
        a = old["attrs"]
        check_run(self.run_dir / RUN_FILE, a, self.meta.content_hash, self.rt.size, self.engine)
        epochs = old["metrics"].get("epoch", np.zeros(0, np.int64))
        for i, e in enumerate(epochs):
            row = {"epoch": int(e),
                   "metrics": {k: float(v[i]) for k, v in old["metrics"].items() if k != "epoch"},
                   "timings": [], "counters": [], "per_layer": [], "labels": []}
            for group in ("timings", "counters"):
                arrs = old[group]
                for r in range(self.rt.size):
                    if len(row[group]) <= r:
                        row[group].append({})
                    row[group][r].update({k: float(v[i, r]) for k, v in arrs.items()})
            for r in range(self.rt.size):
                row["per_layer"].append({k: np.asarray(v[i, r]) for k, v in old["per_layer"].items()})
                row["labels"].append({k: str(v[i, r]) for k, v in old["labels"].items()})
            self._history.append(row)
        self._timing_parents.update(old["timing_parents"])
        keep = {k: v for k, v in a.items() if k not in _END_ATTRS}
        self._attrs.update({k: v for k, v in keep.items() if k not in self._base_attrs()})
        self.resume_state = check_settings(self.run_dir, a, self.cfg, self.meta.content_hash,
                                           self._attrs.get("run_id"), self.engine)

    def _base_attrs(self) -> dict:
        return {
            "format": RUN_FORMAT, "version": RUN_VERSION, "config": self.cfg.to_json(),
            "engine": self.engine, "num_ranks": self.rt.size,
            "partition_hash": self.meta.content_hash, "partition_dir": str(self.meta.path),
            "num_parts": self.meta.num_parts, "hpcgnn_version": __version__,
        }

    # ---- public ---------------------------------------------------------
    @property
    def run_id(self) -> str:
        """The run's identity (rank 0; ``""`` elsewhere): a random hex string made when the run
        starts, kept by ``--resume`` and written into every checkpoint, so a checkpoint of
        another run in this directory is refused."""
        return str(self._attrs.get("run_id", ""))

    @property
    def history(self) -> list[dict]:
        """Rank 0: the logged epochs, oldest first (a resumed run's earlier ones included), each
        the row :meth:`log_epoch` returned; ``[]`` on the other ranks. Read only."""
        return self._history

    @property
    def attrs(self) -> dict:
        """Rank 0: the run file's attributes beyond the base ones (:meth:`set_attrs`'s, dicts
        and lists as JSON text); ``{}`` on the other ranks. Read only."""
        return self._attrs

    @property
    def timing_parents(self) -> dict[str, str]:
        """Rank 0: the parent of every timing logged so far (module docstring)."""
        return self._timing_parents

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / CHECKPOINT_DIR

    @property
    def debug_dir(self) -> Path:
        """``RUN/debug``, for instrumentation's files (tests/debug_hooks.py; created on first use by
        the caller's rank)."""
        return self.run_dir / DEBUG_DIR

    def set_attrs(self, **values) -> None:
        """Extra run-file attributes (str/int/float/bool; dicts/lists as JSON); any rank may call."""
        if not self.rt.is_root:
            return
        for k, v in values.items():
            self._attrs[k] = json.dumps(v) if isinstance(v, (dict, list, tuple)) else v
        self._write_or_raise()

    def rewind(self, last_epoch: int) -> None:
        """Collective: forget logged epochs after ``last_epoch`` (used on resume from a checkpoint)."""
        self._history = [h for h in self._history if h["epoch"] <= last_epoch]
        self.rt.agree(self._try_write() if self.rt.is_root else None)

    def log_epoch(self, epoch: int, metrics: dict[str, float], timings: dict[str, float],
                  counters: dict[str, float], per_layer: dict[str, np.ndarray] | None = None,
                  labels: dict[str, str] | None = None, timing_parents: dict[str, str] | None = None) -> dict | None:
        """Collective: gather every rank's timings/counters/per_layer/labels; rank 0 appends them
        and returns the epoch's row (``epoch``, ``metrics``, and per rank: ``timings``,
        ``counters``, ``per_layer``, ``labels``), the other ranks None.

        ``metrics`` are global values (identical on every rank; rank 0's are stored).
        ``timing_parents``: timing name -> parent (``""`` for a root; module docstring); the first
        parent given for a name, over ranks and epochs, is the run's.
        """
        labels = {k: str(v) for k, v in (labels or {}).items()}
        device = getattr(self.rt, "device", None)
        if device:
            labels.setdefault("device", str(device))
        plane = getattr(self.rt, "data_plane", None)
        if plane is not None:
            labels.setdefault("comm_backend", str(plane.name))
        if self._mpi_library is None:
            from hpcgnn.runtime import mpi_library

            self._mpi_library = mpi_library()
        labels.setdefault("mpi_library", self._mpi_library)
        choice = getattr(self.rt, "device_choice", None)
        local = ({k: float(v) for k, v in timings.items()},
                 {k: float(v) for k, v in counters.items()},
                 {k: np.asarray(v, dtype=np.float64) for k, v in (per_layer or {}).items()},
                 labels, choice.how if choice is not None and choice.shared else None,
                 {k: str(v) for k, v in (timing_parents or {}).items()})
        gathered = self.rt.comm.gather(local, root=0)
        if not self.rt.is_root:
            self.rt.agree(None)   # rank 0's write of the run file
            return None
        self._warn_shared_devices([g[4] for g in gathered])
        for g in gathered:
            for k, v in g[5].items():
                self._timing_parents.setdefault(k, v)
        row = {"epoch": int(epoch), "metrics": {k: float(v) for k, v in metrics.items()},
               "timings": [g[0] for g in gathered], "counters": [g[1] for g in gathered],
               "per_layer": [g[2] for g in gathered], "labels": [g[3] for g in gathered]}
        self._history = [h for h in self._history if h["epoch"] < epoch] + [row]
        self._unwritten += 1
        now = time.monotonic()     # the job's first epoch is due: the last rewrite is at -inf
        due = epoch >= int(self.cfg.train.epochs) or now - self._last_write >= self._flush_s
        if due:
            self._last_write = now
        self.rt.agree(self._try_write() if due else None)
        return row

    def flush(self) -> None:
        """Collective: rewrite the run file now if an epoch was logged since its last rewrite
        (before a checkpoint: module docstring)."""
        self.rt.agree(self._try_write() if self.rt.is_root and self._unwritten else None)

    def close(self, stopped_by: str | None = None) -> None:
        """Collective: mark the run finished, or ``stopped`` by the signals ``stopped_by``
        (:mod:`hpcgnn.run.stop`: its last epoch is checkpointed, ``--resume`` continues it), so
        that no rank exits before the file is final; then release the run directory's lock. A
        run file that cannot be written stops every rank with one line (:meth:`_try_write`)."""
        error = None
        if self.rt.is_root:
            self._attrs.pop("error", None)
            self._attrs.pop("stopped_by", None)
            if stopped_by is None:
                self._attrs.update(status="finished", ended=_now())
            else:
                self._attrs.update(status="stopped", ended=_now(), stopped_by=stopped_by)
            error = self._try_write()
        self.rt.agree(error)
        if hasattr(self.rt, "remove_failure_hook"):
            self.rt.remove_failure_hook(self._failed)
        self.release()

    def release(self) -> None:
        """Release the run directory's lock (rank 0; process exit does it too)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _failed(self, message: str) -> None:
        """Failure hook (``Runtime.on_failure``): rank 0 marks the run failed with ``message``.
        Where the run file cannot be written (the failure may be a full disk) the last good
        run file stays as it was, quietly: the failure's own line has said why."""
        if self.rt.is_root:
            self._attrs.update(status="failed", ended=_now(), error=message[:1000])
            self._try_write()

    def _try_write(self) -> str | None:
        """Rank 0: rewrite the run file; the one-line error (path and OS reason) if that failed.
        The previous run file stays intact (atomic write)."""
        try:
            self._write()
        except InputError as exc:  # atomic_h5: the path and the OS reason
            return str(exc)
        except Exception as exc:   # noqa: BLE001 - h5py raises OSError, RuntimeError, ValueError
            return str(write_failure(self.run_dir / RUN_FILE, exc))
        self._unwritten = 0
        return None

    def _write_or_raise(self) -> None:
        error = self._try_write()
        if error is not None:
            raise InputError(error)

    def _warn_shared_devices(self, shared: list) -> None:
        """Rank 0: one warning, once per run, when ranks share a GPU (resolve_device warns early
        for rank 0's own node; this covers the others)."""
        ranks = [r for r, how in enumerate(shared) if how]
        if shared and shared[0]:   # rank 0's own node: resolve_device has said so
            self._device_warned = True
        if ranks and not self._device_warned:
            self._device_warned = True
            warn(f"ranks {', '.join(map(str, ranks))} share GPUs ({shared[ranks[0]]}): "
                 "give each rank its own GPU for full speed")

    # ---- file -------------------------------------------------------------
    def _write(self) -> None:
        hist = self._history
        p = self.rt.size
        with atomic_h5(self.run_dir / RUN_FILE) as out:
            f = out.file
            attrs = self._base_attrs()
            attrs["created"] = self._attrs.get("created") or _now()
            attrs["status"] = "running"
            attrs.update(self._attrs)
            self._attrs["created"] = attrs["created"]
            for k, v in attrs.items():
                f.attrs[k] = v
            g = f.create_group("metrics")
            g.create_dataset("epoch", data=np.array([h["epoch"] for h in hist], dtype=np.int64))
            names = _union(h["metrics"] for h in hist)
            names = [n for n in METRIC_ORDER if n in names] + [n for n in names if n not in METRIC_ORDER]
            for n in names:
                g.create_dataset(n, data=np.array([h["metrics"].get(n, math.nan) for h in hist],
                                                  dtype=np.float64))
            for group in ("timings", "counters"):
                g = f.create_group(group)
                names = _union(r for h in hist for r in h[group])
                if group == "timings" and self._timing_parents:
                    g.attrs["parents"] = json.dumps({k: v for k, v in self._timing_parents.items()
                                                     if k in names})
                for n in names:
                    arr = np.full((len(hist), p), math.nan)
                    for i, h in enumerate(hist):
                        for r, d in enumerate(h[group][:p]):
                            arr[i, r] = d.get(n, math.nan)
                    g.create_dataset(n, data=arr)
            g = f.create_group("per_layer")
            names = _union(r for h in hist for r in h["per_layer"])
            for n in names:
                width = max((np.size(r[n]) for h in hist for r in h["per_layer"] if n in r), default=0)
                arr = np.full((len(hist), p, width), math.nan)
                for i, h in enumerate(hist):
                    for r, d in enumerate(h["per_layer"][:p]):
                        if n in d:
                            v = np.ravel(d[n])
                            arr[i, r, :v.size] = v
                g.create_dataset(n, data=arr)
            g = f.create_group("labels")
            names = _union(r for h in hist for r in h.get("labels", []))
            for n in names:
                arr = np.array([[(h["labels"][r].get(n, "") if r < len(h.get("labels", [])) else "")
                                 .encode() for r in range(p)] for h in hist], dtype=bytes)
                g.create_dataset(n, data=arr.reshape(len(hist), p))


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
