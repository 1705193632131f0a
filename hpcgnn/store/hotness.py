"""Hotness of a rank's rows: in-degree (XGNN's default, PaGraph) or access frequency measured by
a pre-sampling pass of k minibatches (GNNLab).

:func:`presample` runs the engine's own sampler on k minibatches drawn like the training ones
(``batch_size`` seeds chosen without replacement from the rank's training vertices) on random
streams of their own (sampler epochs ``PRESAMPLE_EPOCH + stream``), so a pass never reuses a
training minibatch. It counts, scaled to one epoch of ``batches_per_epoch`` minibatches:

* ``feature[v]``: how often solid vertex v is in the input frontier S_0 (one feature row read);
* ``topology[v]``: topology bytes read when v is expanded (indptr pair plus the sampled
  neighbour ids, int64), summed over the blocks;
* ``halo[l]``: halo vertices in the input frontier of layer l (HEC_l lookups).

Two independent passes are used by the placement: one ranks the rows, the other predicts the
hit rate of the chosen rows (an estimate on the ranking pass itself would be optimistic).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRESAMPLE_EPOCH = 1 << 40    # sampler epoch of pre-sampling stream 0 (training epochs are small)
_PRESAMPLE_SEEDS = 5         # rng stream tag of the seed draws


@dataclass
class AccessCounts:
    """Expected accesses per epoch measured by one pre-sampling pass (see the module docstring)."""

    feature: np.ndarray      # float64 [num_solid]
    topology: np.ndarray     # float64 [num_solid], bytes per epoch
    halo: np.ndarray         # float64 [layers]
    batches: int

    @property
    def feature_total(self) -> float:
        return float(self.feature.sum())


def degree_order(degree: np.ndarray) -> np.ndarray:
    """Row ids by decreasing degree (ties: lower id first)."""
    return np.argsort(-np.asarray(degree, dtype=np.int64), kind="stable").astype(np.int64)


def frequency_order(counts: np.ndarray, degree: np.ndarray) -> np.ndarray:
    """Row ids by decreasing measured frequency (ties: higher degree, then lower id)."""
    n = counts.shape[0]
    return np.lexsort((np.arange(n), -np.asarray(degree, dtype=np.int64), -counts)).astype(np.int64)


def presample(sampler, train_ids: np.ndarray, batch_size: int, batches: int, batches_per_epoch: int,
              seed: int, rank: int, stream: int) -> AccessCounts:
    """One pre-sampling pass of ``batches`` minibatches (see the module docstring)."""
    from hpcgnn.seeding import numpy_rng

    ns = sampler.num_solid
    layers = sampler.num_layers
    feat = np.zeros(ns, dtype=np.float64)
    topo = np.zeros(ns, dtype=np.float64)
    halo = np.zeros(layers, dtype=np.float64)
    train_ids = np.asarray(train_ids, dtype=np.int64)
    size = min(int(batch_size), train_ids.size)
    if size == 0 or batches <= 0:
        return AccessCounts(feat, topo, halo, 0)
    rng = numpy_rng(seed, _PRESAMPLE_SEEDS, stream, rank)
    for i in range(batches):
        seeds = np.sort(rng.choice(train_ids, size=size, replace=False))
        batch = sampler.sample(seeds, epoch=PRESAMPLE_EPOCH + stream, step=i)
        fr = [f.numpy() for f in batch.frontiers]
        f0 = fr[0]
        feat += np.bincount(f0[f0 < ns], minlength=ns)
        for l, blk in enumerate(batch.blocks):
            halo[l] += float((fr[l] >= ns).sum())
            dst = fr[l + 1]
            reads = (np.diff(blk.indptr.numpy()) + 2) * 8.0       # indptr pair + sampled ids
            solid = dst < ns
            topo += np.bincount(dst[solid], weights=reads[solid], minlength=ns)
    scale = batches_per_epoch / batches
    return AccessCounts(feat * scale, topo * scale, halo * scale, batches)
