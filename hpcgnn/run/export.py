"""A run's per-epoch figures for standard tools: a CSV file and TensorBoard scalars
(``hpcgnn report RUN --csv FILE --tensorboard DIR``).

:func:`epoch_scalars` is the one table both write: one row per logged epoch, one column per
scalar, named as TensorBoard tags (``group/name``):

* ``loss``; ``accuracy/train``, ``accuracy/val``, ``accuracy/test`` (fractions; empty / not
  written for an epoch that was not evaluated);
* ``time/epoch_s``: the epoch's training time of the slowest rank; ``time/<phase>_s``: every
  other timing of the run file (the evaluation ``eval`` included, nested phases too), mean over
  ranks, seconds;
* ``counters/<name>``: every counter of the run file summed over ranks (bytes sent, rows ...),
  except the memory peaks: ``memory/<name>`` (``peak_rss_bytes`` ...), the largest rank's.

The CSV (written atomically) has a header row with these names, then one row per epoch
(``epoch`` first); TensorBoard gets each finite value as a scalar at step = the epoch, written
with torch's ``torch.utils.tensorboard.SummaryWriter``.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError

ACCURACIES = (("train_acc", "accuracy/train"), ("val_acc", "accuracy/val"), ("test_acc", "accuracy/test"))


def _over_ranks(fn, values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(fn(v[np.isfinite(v)])) if np.isfinite(v).any() else math.nan


def epoch_scalars(run: dict) -> tuple[list[int], dict[str, list[float]]]:
    """(epochs, {tag: one value per epoch}) of a :func:`~hpcgnn.run.runfile.read_run` dict (see
    the module docstring; NaN where an epoch has no value)."""
    from hpcgnn.run.runfile import timing_parents

    m, t, c = run["metrics"], run["timings"], run["counters"]
    epochs = [int(e) for e in m.get("epoch", [])]
    n = len(epochs)
    out: dict[str, list[float]] = {}
    if "loss" in m:
        out["loss"] = [float(x) for x in m["loss"]]
    for key, tag in ACCURACIES:
        if key in m:
            out[tag] = [float(x) for x in m[key]]
    for key in m:
        if key not in ("epoch", "loss") and key not in dict(ACCURACIES):
            out[f"metrics/{key}"] = [float(x) for x in m[key]]
    if "epoch" in t:
        out["time/epoch_s"] = [_over_ranks(np.max, t["epoch"][i]) for i in range(n)]
    for name in timing_parents(run):
        if name != "epoch" and name in t:
            out[f"time/{name}_s"] = [_over_ranks(np.mean, t[name][i]) for i in range(n)]
    for name in sorted(c):
        if name.startswith("peak_"):
            out[f"memory/{name}"] = [_over_ranks(np.max, c[name][i]) for i in range(n)]
        else:
            out[f"counters/{name}"] = [_over_ranks(np.sum, c[name][i]) for i in range(n)]
    return epochs, out


def write_csv(run: dict, path: str | Path) -> Path:
    """Write :func:`epoch_scalars` as CSV to ``path`` (atomically; NaN as an empty cell)."""
    from hpcgnn.fileio import atomic_file, write_error

    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: --csv is a directory, expected a file name")
    if not path.parent.is_dir():
        raise InputError(f"{path}: parent directory {path.parent} does not exist")
    epochs, cols = epoch_scalars(run)
    names = list(cols)
    try:
        with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["epoch", *names])
            for i, e in enumerate(epochs):
                w.writerow([e, *("" if not math.isfinite(cols[k][i]) else repr(cols[k][i]) for k in names)])
    except OSError as exc:
        raise write_error(path, exc) from None
    return path


def write_tensorboard(run: dict, directory: str | Path) -> Path:
    """Write :func:`epoch_scalars` as TensorBoard scalars (step = epoch) into ``directory``
    (created; refused when it holds TensorBoard event files already: two runs' events in one
    directory would be drawn as one run)."""
    from hpcgnn.fileio import write_error

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise InputError(f"{directory}: --tensorboard exists and is not a directory")
    if directory.is_dir() and any(p.name.startswith("events.out.tfevents") for p in directory.iterdir()):
        raise InputError(f"{directory}: holds TensorBoard event files already (give each run its own "
                         "directory, e.g. DIR/RUN_NAME)")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise InputError(f"--tensorboard needs the tensorboard package ({exc}); install it with "
                         "pip install tensorboard (make install does)") from None
    epochs, cols = epoch_scalars(run)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(log_dir=str(directory))
        try:
            for i, e in enumerate(epochs):
                for tag, values in cols.items():
                    if math.isfinite(values[i]):
                        writer.add_scalar(tag, values[i], global_step=e)
        finally:
            writer.close()
    except OSError as exc:
        raise write_error(directory, exc) from None
    return directory
