"""Placement solver: split a rank's device budget between topology, feature rows and HEC lines
by expected saved host -> device bytes per byte of device memory.

Items and their value (bytes that stop crossing the link per epoch when the item is on the
device), from a pre-sampling pass (:mod:`hpcgnn.store.hotness`):

* a feature row v: ``row_bytes`` of device memory, saves ``accesses(v) * row_bytes``, so its
  density is its expected accesses per epoch. With ``hotness = "degree"`` the rows go in degree
  order and the value of a row is the mean measured access count of the rows of its degree
  (made non-increasing along the order), so the solver compares it with the other types but
  keeps the degree ranking; with ``"presample"`` the value is the row's own count.
* HEC_l (one block per layer: ``lines * width * 4`` bytes): saves the layer's halo lookups per
  epoch times the row width (every lookup counted as a hit: an upper bound);
* a topology row v (``(degree + 1) * 8`` bytes): saves the topology bytes a *device-side*
  sampler reads for it. hpcgnn's sampler is a host kernel (native OpenMP), whose reads never
  cross the link, so the engine gives topology zero value (``sampler_on_device = False``) and
  the whole budget goes to features and HEC lines; the term is kept for a device sampler.

Greedy by density (the optimum of the fractional knapsack; items here are small against the
budget except HEC blocks, which are skipped when they do not fit). The predicted feature hit
rate is measured on a second, independent pre-sampling pass (``eval_counts``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_FEATURE, _HEC, _TOPOLOGY = 0, 1, 2


@dataclass
class Placement:
    """The solver's decision for one rank (all bytes are device bytes)."""

    budget_bytes: int
    feature_rows: np.ndarray            # int64 row ids on the device, hottest first
    hec_on_device: list                 # bool per layer
    topology_rows: np.ndarray           # int64 solid ids whose in-edges are on the device
    bytes: dict = field(default_factory=dict)            # kind -> device bytes used
    predicted: dict = field(default_factory=dict)        # feature_hit_rate, h2d bytes per epoch ...

    def summary(self) -> dict:
        """JSON-able decision (run file attribute ``store_placement``)."""
        return {"budget_bytes": int(self.budget_bytes), "feature_rows": int(self.feature_rows.size),
                "hec_on_device": [bool(x) for x in self.hec_on_device],
                "topology_rows": int(self.topology_rows.size),
                "bytes": {k: int(v) for k, v in self.bytes.items()},
                "predicted": {k: float(v) for k, v in self.predicted.items()}}


def degree_values(order: np.ndarray, degree: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Value of each row along a degree ``order``: mean count of its degree's rows, made
    non-increasing along the order (see the module docstring). Returned in ``order``'s order."""
    deg = np.asarray(degree, dtype=np.int64)
    if deg.size == 0:
        return np.zeros(0)
    top = int(deg.max()) + 1
    n = np.bincount(deg, minlength=top)
    s = np.bincount(deg, weights=counts, minlength=top)
    mean = np.divide(s, n, out=np.zeros(top), where=n > 0)
    return np.minimum.accumulate(mean[deg[order]])


def solve(budget_bytes: int, row_bytes: int, feature_order: np.ndarray, feature_values: np.ndarray,
          eval_counts: np.ndarray, hec_bytes=(), hec_saved=(), topology_bytes=None,
          topology_saved=None, sampler_on_device: bool = False) -> Placement:
    """Choose the device-resident items (see the module docstring).

    ``feature_order``: row ids, hottest first; ``feature_values``: their accesses per epoch in
    that order; ``eval_counts`` [num_rows]: accesses per epoch from an independent pass (the
    prediction); ``hec_bytes`` / ``hec_saved``: per layer; ``topology_bytes`` /
    ``topology_saved``: per solid row (ignored unless ``sampler_on_device``).
    """
    budget = max(int(budget_bytes), 0)
    nf = int(feature_order.size)
    dens = [np.asarray(feature_values, dtype=np.float64)]
    size = [np.full(nf, float(row_bytes))]
    kind = [np.full(nf, _FEATURE, np.int8)]
    idx = [np.asarray(feature_order, dtype=np.int64)]
    rank = [np.arange(nf, dtype=np.int64)]            # tie-break: hotness order
    for l, (b, s) in enumerate(zip(hec_bytes, hec_saved)):
        if b > 0:
            dens.append(np.array([s / b]))
            size.append(np.array([float(b)]))
            kind.append(np.array([_HEC], np.int8))
            idx.append(np.array([l], np.int64))
            rank.append(np.array([l], np.int64))
    if sampler_on_device and topology_bytes is not None and len(topology_bytes):
        tb = np.asarray(topology_bytes, dtype=np.float64)
        dens.append(np.asarray(topology_saved, dtype=np.float64) / np.maximum(tb, 1.0))
        size.append(tb)
        kind.append(np.full(tb.size, _TOPOLOGY, np.int8))
        idx.append(np.arange(tb.size, dtype=np.int64))
        rank.append(np.arange(tb.size, dtype=np.int64))
    dens, size, kind = np.concatenate(dens), np.concatenate(size), np.concatenate(kind)
    idx, rank = np.concatenate(idx), np.concatenate(rank)
    useful = (dens > 0) | (kind == _FEATURE)     # unseen rows still fill a spare budget
    order = np.lexsort((rank, kind, -dens))
    order = order[useful[order]]
    take = np.zeros(order.size, dtype=bool)
    left = float(budget)
    start = 0
    while start < order.size and left > 0:
        csum = np.cumsum(size[order[start:]])
        fit = int(np.searchsorted(csum, left, side="right"))     # items start..start+fit-1 fit
        take[start:start + fit] = True
        left -= float(csum[fit - 1]) if fit else 0.0
        nxt = start + fit
        if nxt >= order.size or kind[order[nxt]] == _FEATURE or size[order[nxt]] <= 8:
            break          # a row does not fit: the budget is spent (rows are ~equal in size)
        start = nxt + 1    # a large block (HEC / a big topology row) did not fit: skip it
    chosen = order[take]
    feat = idx[chosen[kind[chosen] == _FEATURE]]
    feat = feature_order[np.sort(rank[chosen[kind[chosen] == _FEATURE]])] if feat.size else feat
    hec_on = [False] * len(hec_bytes)
    for l in idx[chosen[kind[chosen] == _HEC]]:
        hec_on[int(l)] = True
    topo = np.sort(idx[chosen[kind[chosen] == _TOPOLOGY]])
    used = {"feature": int(feat.size) * int(row_bytes),
            "hec": int(sum(b for b, on in zip(hec_bytes, hec_on) if on)),
            "topology": int(np.sum(np.asarray(topology_bytes)[topo])) if topo.size else 0}
    ev = np.asarray(eval_counts, dtype=np.float64)
    total = float(ev.sum())
    hits = float(ev[feat].sum()) if feat.size else 0.0
    predicted = {"feature_hit_rate": hits / total if total > 0 else 0.0,
                 "feature_accesses_per_epoch": total,
                 "feature_h2d_bytes_per_epoch": (total - hits) * row_bytes,
                 "hec_h2d_bytes_per_epoch": float(sum(s for s, on in zip(hec_saved, hec_on) if not on))}
    return Placement(budget, feat.astype(np.int64), hec_on, topo.astype(np.int64), used, predicted)
