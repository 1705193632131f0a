"""RAPA (CaPGNN's resource-aware partitioning): parts sized to the ranks' speed, then halo trimming.

Three pieces, used by ``hpcgnn partition --rank-speed`` and ``hpcgnn inspect`` (docs/rapa.md):

* :func:`read_rank_speed`: relative rank throughputs from a comma list, a text/JSON file or a
  finished run (directory or run file). From a run, rank r's speed is
  ``s_r = W_r / T_r``: ``W_r`` the work of the partition it trained on (:func:`part_work`, when
  the run's store is still there and has the run's content hash; else ``W_r = 1``) and ``T_r``
  its mean compute seconds per epoch (``compute`` timing if the engine records one, else
  ``forward + backward - halo - comm_wait``; epochs after the first, and without an evaluation
  when there are such).
* :func:`target_fractions`: ``s_r / sum(s)``, the METIS target part weights (``tpwgts``) of
  every balanced constraint.
* :func:`trim_halos`: the note's halo-trimming loop (capgnn.md section 4.2): while the modelled
  per-rank cost ``lambda_i = W_i / s_i`` varies by ``threshold`` x mean or more, every partition
  above the mean, weakest rank first, drops its lowest-score halo vertices (and their in-edges)
  until the next drop would bring ``lambda_i`` to ``(lambda_i + mean) / 2``. Score of halo u on
  partition i (GCN form, global degrees): ``2 * sum_{v in i, u->v} deg(u)^-1/2 deg(v)^-1/2 *
  dup(u)``, dup(u) = partitions holding u as halo; ties by vertex ID. Inner vertices never move.

Work model (unitless, one unit per edge aggregated, per vertex updated, per halo row received):
``W_i = E_i + V_i + H_i`` with E_i the in-edges of partition i's solid vertices, V_i its solid
vertices and H_i its halo vertices. Predicted epoch time of rank i: ``W_i / s_i``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError

DEFAULT_TRIM_THRESHOLD = 0.01     # the note's stop rule: std(lambda) < 1 % of mean(lambda)


# ---- speeds ---------------------------------------------------------------------------------
def _check_speeds(values, where: str, parts: int | None) -> np.ndarray:
    s = np.asarray(values, dtype=np.float64).reshape(-1)
    if parts is not None and s.shape[0] != parts:
        raise InputError(f"{where}: {s.shape[0]} rank speeds for --parts {parts}, expected {parts}")
    if s.size == 0:
        raise InputError(f"{where}: no rank speeds, expected {parts or 'one per rank'} positive numbers")
    bad = np.flatnonzero(~np.isfinite(s) | (s <= 0))
    if bad.size:
        raise InputError(f"{where}: rank {int(bad[0])} has speed {s[bad[0]]!r}, expected a positive number")
    return s


def _parse_numbers(text: str, where: str) -> list[float]:
    tokens = [t for t in text.replace(",", " ").split() if t]
    try:
        return [float(t) for t in tokens]
    except ValueError:
        bad = next(t for t in tokens if not _is_float(t))
        raise InputError(f"{where}: {bad!r} is not a number, expected positive relative speeds "
                         "(e.g. 1,2)") from None


def _is_float(t: str) -> bool:
    try:
        float(t)
        return True
    except ValueError:
        return False


def read_rank_speed(spec: str, parts: int | None = None) -> tuple[np.ndarray, str]:
    """(speeds float64 [K], description of the source) from ``--rank-speed SPEC``.

    SPEC: a comma list ("1,2"); a text file of numbers (commas or whitespace); a JSON file
    (a list, or an object with a list under "speeds"); a run directory or run file (see the
    module docstring). Raises InputError (one line) on a wrong count against ``parts``, a
    non-positive or non-numeric value, or an unreadable file.
    """
    spec = str(spec).strip()
    path = Path(spec)
    if spec and path.exists():
        if path.is_dir() or _is_hdf5(path):
            s, how = speeds_from_run(path)
            return _check_speeds(s, f"--rank-speed {spec}", parts), how
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--rank-speed {spec}: cannot read the file ({exc})") from None
        if text.lstrip().startswith(("[", "{")):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputError(f"--rank-speed {spec}: not valid JSON ({exc})") from None
            if isinstance(obj, dict):
                obj = obj.get("speeds")
            if not isinstance(obj, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in obj):
                raise InputError(f"--rank-speed {spec}: expected a JSON list of numbers or "
                                 '{"speeds": [...]}')
            return _check_speeds(obj, f"--rank-speed {spec}", parts), f"file {path}"
        return _check_speeds(_parse_numbers(text, f"--rank-speed {spec}"), f"--rank-speed {spec}",
                             parts), f"file {path}"
    if "/" in spec or spec.endswith((".h5", ".json", ".txt")):
        raise InputError(f"--rank-speed {spec}: file not found")
    return _check_speeds(_parse_numbers(spec, f"--rank-speed {spec!r}"), f"--rank-speed {spec!r}",
                         parts), "list"


def _is_hdf5(path: Path) -> bool:
    import h5py

    try:
        return bool(h5py.is_hdf5(path))
    except OSError:
        return False


def compute_seconds(timings: dict) -> np.ndarray:
    """Per epoch and rank compute seconds [E, P] of a run's timings (see the module docstring)."""
    if "compute" in timings:
        return np.asarray(timings["compute"], dtype=np.float64)
    if "forward" not in timings or "backward" not in timings:
        raise KeyError("forward/backward")
    t = np.asarray(timings["forward"], dtype=np.float64) + np.asarray(timings["backward"], dtype=np.float64)
    for name in ("halo", "comm_wait"):
        if name in timings:
            t = t - np.asarray(timings[name], dtype=np.float64)
    return t


def timed_epochs(timings: dict) -> np.ndarray:
    """bool [E]: the epochs whose compute seconds count: after the first (warm-up) and, where
    there are such, without an evaluation (an epoch's halo seconds also count the evaluation's
    exchanges, which lie outside forward/backward)."""
    e = np.asarray(timings["epoch"] if "epoch" in timings else next(iter(timings.values()))).shape[0]
    keep = np.ones(e, dtype=bool)
    if e > 1:
        keep[0] = False
    if "eval" in timings:
        no_eval = ~np.isfinite(np.asarray(timings["eval"], dtype=np.float64)).any(axis=1)
        if (keep & no_eval).any():
            keep &= no_eval
    return keep


def speeds_from_run(path: Path) -> tuple[np.ndarray, str]:
    """(speed per rank, description) of a finished or stopped run: ``W_r / T_r`` (module docstring)."""
    from hpcgnn.run.runfile import read_run

    try:
        run = read_run(path)
    except InputError as exc:
        raise InputError(f"--rank-speed {path}: {exc}") from None
    where = run["path"]
    if run["attrs"].get("status") not in ("finished", "stopped"):    # stopped: its epochs all ran
        raise InputError(f"--rank-speed {path}: {where} has status {run['attrs'].get('status')!r}, "
                         "expected a finished (or stopped) run")
    try:
        comp = compute_seconds(run["timings"])
    except KeyError:
        raise InputError(f"--rank-speed {path}: {where} records no forward/backward or compute "
                         "timings per rank") from None
    if comp.ndim != 2 or comp.shape[0] == 0:
        raise InputError(f"--rank-speed {path}: {where} has no epochs")
    keep = timed_epochs(run["timings"])
    comp = comp[keep]
    t = comp.mean(axis=0)
    if not np.all(np.isfinite(t) & (t > 0)):
        raise InputError(f"--rank-speed {path}: {where} has a non-positive mean compute time per rank "
                         f"({t.tolist()})")
    work, how = None, "1 / compute seconds (the run's partition store is not available)"
    store = run["attrs"].get("partition_dir")
    if store:
        try:
            from hpcgnn.partition.store import read_meta

            meta = read_meta(store)
            if meta.content_hash == run["attrs"].get("partition_hash") and meta.num_parts == t.shape[0]:
                work = part_work_of_store(meta)
                how = f"part work / compute seconds (store {store})"
        except (InputError, OSError, KeyError):
            pass
    speeds = (work if work is not None else np.ones_like(t)) / t
    return speeds, f"run {where}: speed = {how}, mean over {comp.shape[0]} epochs"


def target_fractions(speeds: np.ndarray) -> np.ndarray:
    """Each part's share of every constraint's weight: ``s_r / sum(s)`` (float64 [K])."""
    s = np.asarray(speeds, dtype=np.float64)
    return s / s.sum()


def equal_speeds(speeds: np.ndarray) -> bool:
    """Whether all speeds are equal (then METIS gets no target weights: today's partition)."""
    s = np.asarray(speeds, dtype=np.float64)
    return bool(np.all(s == s[0]))


def tpwgts_matrix(fractions: np.ndarray, ncon: int) -> np.ndarray:
    """METIS ``tpwgts`` [K, ncon]: every constraint gets the same target fractions."""
    f = np.asarray(fractions, dtype=np.float64)
    return np.ascontiguousarray(np.repeat(f[:, None], max(ncon, 1), axis=1))


# ---- work model and prediction ------------------------------------------------------------
def part_work(edges, vertices, halo) -> np.ndarray:
    """``W_i = E_i + V_i + H_i`` per part (float64), the units of the module docstring."""
    return (np.asarray(edges, dtype=np.float64) + np.asarray(vertices, dtype=np.float64)
            + np.asarray(halo, dtype=np.float64))


def part_work_of_store(meta) -> np.ndarray:
    """W_i of every part of a store (reads only dataset shapes and meta.h5)."""
    from hpcgnn.fileio import open_h5
    from hpcgnn.partition.store import PART_FORMAT, part_file_name

    edges = np.zeros(meta.num_parts, dtype=np.int64)
    for p in range(meta.num_parts):
        with open_h5(Path(meta.path) / part_file_name(p), PART_FORMAT) as f:
            edges[p] = int(f["indices"].shape[0])
    return part_work(edges, np.diff(meta.part_offsets), meta.halo_counts)


def predict(work: np.ndarray, speeds: np.ndarray) -> dict:
    """Expected per-rank epoch time ``W_i / s_i`` relative to the mean, and the straggler."""
    t = np.asarray(work, dtype=np.float64) / np.asarray(speeds, dtype=np.float64)
    rel = t / t.mean() if t.size and t.mean() > 0 else np.ones_like(t)
    straggler = int(np.argmax(rel)) if rel.size else 0
    return {"relative_time": rel.tolist(), "straggler": straggler,
            "max_over_mean": float(rel.max()) if rel.size else 1.0}


def store_speeds(meta) -> tuple[np.ndarray, bool]:
    """(speed per part recorded by ``--rank-speed``, whether recorded) of a store (else ones)."""
    raw = meta.attrs.get("rank_speed")
    if raw:
        try:
            s = np.asarray(json.loads(raw), dtype=np.float64)
            if s.shape == (meta.num_parts,) and np.all(s > 0):
                return s, True
        except (json.JSONDecodeError, ValueError, TypeError):
            pass
    return np.ones(meta.num_parts, dtype=np.float64), False


# ---- halo trimming ---------------------------------------------------------------------------
@dataclass
class TrimResult:
    """What :func:`trim_halos` removed: per partition, the original IDs of dropped halo vertices."""

    dropped: list                      # [K] int64 arrays, sorted original vertex IDs
    removed_edges: np.ndarray          # int64 [K] in-edges dropped per partition
    cost_before: np.ndarray            # float64 [K] lambda before
    cost_after: np.ndarray             # float64 [K] lambda after
    passes: int
    threshold: float
    halo_before: np.ndarray = field(default=None)   # int64 [K]

    def summary(self) -> dict:
        cv = lambda c: float(np.std(c) / np.mean(c)) if np.mean(c) > 0 else 0.0  # noqa: E731
        return {"threshold": self.threshold, "passes": self.passes,
                "removed_halos": [int(d.shape[0]) for d in self.dropped],
                "removed_edges": self.removed_edges.tolist(),
                "halo_before": self.halo_before.tolist() if self.halo_before is not None else None,
                "cost_before": self.cost_before.tolist(), "cost_after": self.cost_after.tolist(),
                "cv_before": cv(self.cost_before), "cv_after": cv(self.cost_after)}


def halo_pairs(indptr: np.ndarray, indices: np.ndarray, part: np.ndarray, num_parts: int):
    """(pair_part, pair_vertex, edges, score) of every (partition, halo vertex) pair.

    From a symmetric CSR of in-edges (row = destination) and an assignment; ``edges`` counts
    u's in-edges into the partition, ``score`` is the module docstring's score. Sorted by
    partition, then score, then vertex ID.
    """
    n = indptr.shape[0] - 1
    part = np.asarray(part, dtype=np.int64)
    deg = np.diff(indptr).astype(np.int64)
    dst = np.repeat(np.arange(n, dtype=np.int64), deg)
    src = np.asarray(indices, dtype=np.int64)
    cut = part[src] != part[dst]
    src, dst = src[cut], dst[cut]
    key = part[dst] * n + src
    uniq, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
    inv_sqrt = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1)), 0.0)
    fp = np.bincount(inv, weights=inv_sqrt[src] * inv_sqrt[dst], minlength=uniq.shape[0])
    pair_part, pair_vertex = uniq // max(n, 1), uniq % max(n, 1)
    dup = np.bincount(pair_vertex, minlength=n)[pair_vertex]
    score = 2.0 * fp * dup          # fp + bp on a symmetric graph
    order = np.lexsort((pair_vertex, score, pair_part))
    return pair_part[order], pair_vertex[order], counts[order].astype(np.int64), score[order]


def trim_halos(indptr: np.ndarray, indices: np.ndarray, part: np.ndarray, num_parts: int,
               speeds: np.ndarray, threshold: float = DEFAULT_TRIM_THRESHOLD) -> TrimResult:
    """The note's halo-trimming loop (module docstring) on the assignment ``part``.

    Deterministic: same inputs, same result. Each pass removes at least one halo vertex or
    stops, so it terminates. Returns the dropped halo vertices per partition.
    """
    k = int(num_parts)
    s = np.asarray(speeds, dtype=np.float64)
    part = np.asarray(part, dtype=np.int64)
    pp, pv, pe, _ = halo_pairs(indptr, indices, part, k)
    starts = np.searchsorted(pp, np.arange(k + 1))
    deg = np.diff(indptr)
    E = np.bincount(part, weights=deg, minlength=k).astype(np.float64)
    V = np.bincount(part, minlength=k).astype(np.float64)
    H = np.diff(starts).astype(np.float64)
    halo_before = np.diff(starts).astype(np.int64)
    cost = lambda: (E + V + H) / s  # noqa: E731
    before = cost()
    taken = np.zeros(k, dtype=np.int64)           # removed prefix length per partition
    # cumulative work removed by dropping the first j candidates of a partition: edges + 1 row
    red = np.cumsum(pe + 1)
    order = np.lexsort((np.arange(k), s))          # weakest rank first, ties by rank
    passes = 0
    while True:
        lam = cost()
        if lam.mean() <= 0 or np.std(lam) < threshold * lam.mean():
            break
        passes += 1
        changed = False
        for i in order:
            lam = cost()
            mu = lam.mean()
            if lam[i] <= mu:
                continue
            b, e = starts[i] + taken[i], starts[i + 1]
            if b >= e:
                continue
            base = red[b - 1] if b > 0 else 0
            cum = red[b:e] - base                   # work removed after dropping 1..m more
            target = (lam[i] + mu) / 2
            # drop candidate j only while lam_i - cum[j]/s_i stays above the target (the note's
            # loop breaks on the first drop that would reach it, without taking it)
            m = int(np.searchsorted(cum, (lam[i] - target) * s[i], side="left"))
            if m == 0:
                continue
            E[i] -= float(pe[b:b + m].sum())
            H[i] -= m
            taken[i] += m
            changed = True
        if not changed:
            break
    dropped = [np.sort(pv[starts[i]:starts[i] + taken[i]]) for i in range(k)]
    removed_edges = np.array([int(pe[starts[i]:starts[i] + taken[i]].sum()) for i in range(k)], dtype=np.int64)
    return TrimResult(dropped=dropped, removed_edges=removed_edges, cost_before=before, cost_after=cost(),
                      passes=passes, threshold=float(threshold), halo_before=halo_before)


def describe_prediction(work: np.ndarray, speeds: np.ndarray) -> str:
    """One line: the predicted straggler and its expected time over the mean."""
    p = predict(work, speeds)
    return (f"predicted straggler: rank {p['straggler']} "
            f"({p['max_over_mean']:.3f} x the mean expected epoch time)")


def is_valid_threshold(x: float) -> bool:
    return math.isfinite(x) and 0 < x < 1
