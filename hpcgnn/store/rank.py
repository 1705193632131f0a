"""One rank's vertex data store (feature store + graph store) as every engine uses it: the
graph store, the feature store chosen by the budget and the placement solver, the HEC
placement, the prefetcher and the counters.

The minibatch engine places rows by pre-sampled hotness (:func:`place`); the full-pass engines
(full-graph in memory and offloaded, tensor; ``sampler=None``) read every row in every layer-0
pass, so their placement is static: the highest-degree rows fill the budget
(:func:`full_pass_features`).

``store.device_memory`` (see :func:`resolve_budget`): ``0`` host-only; a fraction in (0, 1] of
the rank's feature bytes or a size such as ``"6GiB"``: the placement solver fills that budget
(tiered store; device-only when every row fits); ``"auto"`` (default): everything on the
device on a GPU (what the engine did before the store existed) and host-only on the CPU.
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.store.budget import resolve_budget
from hpcgnn.store.base import StoreCounters
from hpcgnn.store.graph import HostGraphStore

F32 = 4


class RankStore:
    """See the module docstring. Attributes: ``graph`` (:class:`HostGraphStore`), ``features``
    (a :class:`~hpcgnn.store.base.FeatureStore`), ``placement`` (or None), ``hec_devices``
    (per layer), ``prefetch`` (:class:`~hpcgnn.store.prefetch.Prefetcher`)."""

    def __init__(self, graph: HostGraphStore, features, placement, hec_on_device, device: torch.device,
                 overlap: bool, budget_bytes, threads: int | None = None):
        from hpcgnn.store.prefetch import Prefetcher

        self.graph = graph
        self.features = features
        self.placement = placement
        self.hec_on_device = [bool(x) for x in hec_on_device]
        self.hec_devices = [torch.device(device) if on else torch.device("cpu") for on in self.hec_on_device]
        self.budget_bytes = budget_bytes
        self.prefetch = Prefetcher(features, overlap, threads)

    @property
    def counters(self) -> StoreCounters:
        return self.features.counters

    def reset_counters(self) -> None:
        self.features.reset_counters()

    def count_hec(self, layer: int, lookups: int, hits: int, width: int) -> None:
        """HEC_layer served ``hits`` of ``lookups`` halo rows; rows of a host-placed cache cross."""
        c = self.counters["hec"]
        c.lookups += int(lookups)
        if self.hec_on_device[layer]:
            c.device_hits += int(hits)
        else:
            c.h2d_bytes += int(hits) * int(width) * F32

    def summary(self) -> dict:
        """JSON-able description for the run file (``store_placement``)."""
        out = {"mode": self.features.name, "budget_bytes": -1 if self.budget_bytes is None else int(self.budget_bytes),
               "device_rows": int(self.features.device_rows), "rows": int(self.features.num_rows),
               "device_bytes": int(self.features.device_bytes), "overlap": self.prefetch.overlap,
               "gather_threads": self.prefetch.gather_threads, "compute_threads": self.prefetch.compute_threads,
               "hec_on_device": self.hec_on_device}
        if self.placement is not None:
            out["placement"] = self.placement.summary()
        return out

    @property
    def predicted_hit_rate(self) -> float:
        """Expected fraction of feature lookups served by the device tier (full passes: the
        fraction of rows held there, since every row is read equally often)."""
        if self.placement is not None:
            return float(self.placement.predicted["feature_hit_rate"])
        n = int(self.features.num_rows)
        return float(self.features.device_rows) / n if n else 0.0

    def close(self) -> None:
        self.prefetch.close()


def full_pass_features(device_memory, features, degree: np.ndarray, device: torch.device,
                       available: int | None = None):
    """Feature store of ``features`` [n, F] for an engine that reads every row in every pass
    (no hotness to measure): host-only for a zero budget, device-only when every row fits,
    else tiered with the highest-degree rows (ties: lower id) on the device.
    ``device_memory``: a ``store.device_memory`` value; ``available``: the device bytes
    ``'auto'`` may use (:func:`resolve_budget`)."""
    from hpcgnn.store.device import DeviceFeatureStore
    from hpcgnn.store.host import HostFeatureStore
    from hpcgnn.store.hotness import degree_order
    from hpcgnn.store.tiered import TieredFeatureStore

    row_bytes = int(features.shape[1]) * features.dtype.itemsize
    budget = resolve_budget(device_memory, int(features.shape[0]) * row_bytes, device.type, available)
    if budget == 0:
        return HostFeatureStore(features, device)
    rows = int(features.shape[0]) if budget is None else min(int(features.shape[0]), budget // max(1, row_bytes))
    if rows == int(features.shape[0]):
        return DeviceFeatureStore(features, device)
    return TieredFeatureStore(features, np.sort(degree_order(np.asarray(degree))[:rows]), device)


def build_rank_store(cfg, part, graph: HostGraphStore, sampler, device: torch.device, train_ids: np.ndarray,
                     batch_size: int, batches_per_epoch: int, dims: list[int], hec_lines: int,
                     rank: int, threads: int | None = None, available: int | None = None) -> RankStore:
    """The rank's store for ``cfg.store`` (not collective; an InputError is the rank's);
    ``threads``: the rank's thread count, split between the gather thread and compute while
    a gather is in flight (:class:`~hpcgnn.store.prefetch.Prefetcher`); ``available``: the device
    bytes ``store.device_memory = 'auto'`` may use (:func:`resolve_budget`). ``sampler`` None: a
    full-pass engine (every row read every pass; no HEC, no gather thread): the static
    placement of :func:`full_pass_features` (``train_ids``, ``batch_size``,
    ``batches_per_epoch`` unused)."""
    from hpcgnn.store.device import DeviceFeatureStore
    from hpcgnn.store.host import HostFeatureStore
    from hpcgnn.store.tiered import TieredFeatureStore

    st = cfg.store
    feats = part.features
    row_bytes = int(feats.shape[1]) * feats.dtype.itemsize
    feature_bytes = int(feats.shape[0]) * row_bytes
    layers = len(dims)
    hec_bytes = [hec_lines * int(d) * F32 for d in dims] if hec_lines and sampler is not None else [0] * layers
    budget = resolve_budget(st.device_memory, feature_bytes, device.type, available, sum(hec_bytes))
    if sampler is None:
        return RankStore(graph, full_pass_features(st.device_memory, feats, part.degree, device, available), None,
                         [False] * layers, device, False, budget, threads)
    if budget == 0:
        return RankStore(graph, HostFeatureStore(feats, device), None, [False] * layers, device,
                         st.overlap, 0, threads)
    if budget is None or budget >= feature_bytes + sum(hec_bytes):
        return RankStore(graph, DeviceFeatureStore(feats, device), None, [True] * layers, device,
                         st.overlap, budget, threads)
    placement = place(cfg, part, sampler, train_ids, batch_size, batches_per_epoch, dims, hec_bytes,
                      budget, rank)
    if placement.feature_rows.size == feats.shape[0]:
        fs = DeviceFeatureStore(feats, device)
    else:
        fs = TieredFeatureStore(feats, placement.feature_rows, device)
    return RankStore(graph, fs, placement, placement.hec_on_device, device, st.overlap, budget, threads)


def place(cfg, part, sampler, train_ids, batch_size, batches_per_epoch, dims, hec_bytes, budget,
          rank):
    """Pre-sample, rank the rows and run the solver (:mod:`hpcgnn.store.placement`)."""
    from hpcgnn.store.hotness import degree_order, frequency_order, presample
    from hpcgnn.store.placement import degree_values, solve

    st = cfg.store
    seed = cfg.train.seed
    k = st.presample
    rank_pass = presample(sampler, train_ids, batch_size, k, batches_per_epoch, seed, rank, 0)
    eval_pass = presample(sampler, train_ids, batch_size, k, batches_per_epoch, seed, rank, 1)
    degree = part.degree
    if st.hotness == "degree":
        order = degree_order(degree)
        values = degree_values(order, degree, rank_pass.feature)
    else:
        order = frequency_order(rank_pass.feature, degree)
        values = rank_pass.feature[order]
    row_bytes = int(part.features.shape[1]) * part.features.dtype.itemsize
    hec_saved = [float(h) * d * F32 for h, d in zip(eval_pass.halo, dims)]
    topo_bytes = (degree + 1) * 8
    return solve(budget, row_bytes, order, values, eval_pass.feature, hec_bytes, hec_saved,
                 topo_bytes, rank_pass.topology, sampler_on_device=False)
