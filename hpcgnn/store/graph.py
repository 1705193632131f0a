"""Host graph store: a partition's in-edge CSR (local source ids, int64 or int32) in host memory.

The native sampler (:class:`~hpcgnn.sampling.neighbor.NeighborSampler`) reads these arrays in
place (``csr()``); layer-wise evaluation and the exact mode's distributed sampler use the same
arrays, so the rank holds one copy of its local topology. ``account(batch)`` counts what a
sampled minibatch read (rows expanded, bytes of indptr pairs and sampled ids) and what its
blocks cost to move to the device (their CSR arrays), into the store's counters.
"""
from __future__ import annotations

import numpy as np

from hpcgnn.store.base import GraphStore


class HostGraphStore(GraphStore):
    """See the module docstring."""

    name = "host"

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, num_solid: int, num_local: int):
        self._indptr = np.ascontiguousarray(indptr, dtype=np.int64)
        # int32 local ids stay int32 (the sampler reads either)
        self._indices = np.ascontiguousarray(indices, dtype=np.int32 if indices.dtype == np.int32 else np.int64)
        self._num_solid, self._num_local = int(num_solid), int(num_local)

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        return self._indptr, self._indices

    @property
    def num_solid(self) -> int:
        return self._num_solid

    @property
    def num_local(self) -> int:
        return self._num_local

    @property
    def nbytes(self) -> int:
        return self._indptr.nbytes + self._indices.nbytes

    @staticmethod
    def account(counters, batch, to_device: bool) -> None:
        """Add one sampled minibatch's topology reads (host tier) and, when the model runs on
        another device, its blocks' bytes host -> device to ``counters``."""
        t, b = counters["topology"], counters["blocks"]
        nbytes = 0
        for blk in batch.blocks:
            t.lookups += int(blk.num_dst)
            t.h2d_bytes += 0            # read by a host kernel: nothing crosses the link
            nbytes += blk.indptr.numel() * 8 + blk.indices.numel() * 8
        b.lookups += len(batch.blocks)
        if to_device:
            b.h2d_bytes += nbytes
