"""Uniform neighbour sampling without replacement inside one partition (DistGNN-MB MBC).

The sampler works on a partition's local in-edge CSR (:meth:`Partition.local_csr`): rows
are the solid vertices ``0..num_solid-1``; sources ``>= num_solid`` are halo vertices,
which have no row and are never expanded (they can only be leaves).

Frontiers: ``S_L`` = seeds; block ``l`` (``l = L-1 .. 0``) samples up to ``fanouts[l]``
in-neighbours of every vertex of ``S_{l+1}`` and ``S_l`` = ``S_{l+1}`` followed by the
sampled sources not already in it, **in order of first appearance** when the block's edges
are read destination by destination (within a destination in CSR row order). The sampled
neighbours of one destination are listed in CSR row order.

Randomness: the neighbours of vertex ``v`` in block ``l`` are drawn from a splitmix64
stream keyed by ``(seed, epoch, step, l, v)`` (Floyd's algorithm, unbiased bounded
draws). Results are identical for any OpenMP thread count and between calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.errors import InputError
from hpcgnn.native import sampler as _native
from hpcgnn.sampling.block import Block
from hpcgnn.sampling.choice import _as_int64_numpy, sample_key


@dataclass(eq=False)
class SampledBatch:
    """A sampled minibatch: ``blocks[l]`` maps ``frontiers[l]`` -> ``frontiers[l+1]``."""

    seeds: torch.Tensor             # int64 local IDs of the output vertices (= frontiers[-1])
    frontiers: list[torch.Tensor]   # frontiers[l]: local IDs of S_l, l = 0..L; prefix-nested
    blocks: list[Block]             # len L

    @property
    def input_nodes(self) -> torch.Tensor:
        """Local IDs of the input-most frontier S_0 (rows of the input features)."""
        return self.frontiers[0]

    @property
    def num_sampled_edges(self) -> int:
        return sum(b.num_edges for b in self.blocks)

    def to(self, device) -> "SampledBatch":
        return SampledBatch(self.seeds.to(device), [f.to(device) for f in self.frontiers],
                            [b.to(device) for b in self.blocks])

    def halo_last(self, num_solid: int) -> "SampledBatch":
        """The batch without the work no halo row needs (CPU tensors; local IDs ``>= num_solid``
        are halo vertices, which the sampler never expands: leaves with no in-edges).

        A halo row of a layer's input is always replaced (HEC hit) or dropped (miss) before
        that layer, so the layer below need not compute it, and a halo vertex that sends no
        edge in block ``l`` needs no row of ``h_l`` at all. Here frontier ``l`` is reordered to
        ``[its solid vertices, its halo vertices with an edge in block l]`` (each part in the
        sampler's order; the seeds' frontier is unchanged) and block ``l`` keeps only its solid
        destinations: ``num_dst`` = solid vertices of frontier ``l + 1``, which are the prefix
        of the new frontier ``l``. So layer ``l`` outputs the solid rows of ``h_{l+1}`` and the
        caller appends the halo rows (``h_{l+1}`` = [layer output, halo rows]). Every solid
        destination keeps its edges in the same order, so its sums are unchanged.
        """
        fr = [f.numpy() for f in self.frontiers]
        if (fr[-1] >= num_solid).any():
            raise ValueError("halo_last: the seeds must be solid vertices (training seeds are)")
        layers = len(self.blocks)
        frontiers: list = [None] * (layers + 1)
        blocks: list = [None] * layers
        frontiers[layers] = self.frontiers[layers]
        for l in range(layers):
            f, blk = fr[l], self.blocks[l]
            indptr, indices = blk.indptr.numpy(), blk.indices.numpy()
            solid = f < num_solid
            used = np.zeros(f.shape[0], dtype=bool)
            used[indices] = True
            order = np.concatenate([np.flatnonzero(solid), np.flatnonzero(used & ~solid)])
            new_pos = np.full(f.shape[0], -1, dtype=np.int64)
            new_pos[order] = np.arange(order.shape[0], dtype=np.int64)
            dst = np.flatnonzero(fr[l + 1] < num_solid)
            if int(np.diff(indptr)[dst].sum()) != indices.shape[0]:
                raise ValueError(f"halo_last: block {l} has edges into halo destinations "
                                 "(halo vertices must be leaves)")
            new_indptr = np.append(indptr[dst], indptr[-1])   # halo rows are empty
            blocks[l] = Block(int(order.shape[0]), int(dst.shape[0]), torch.from_numpy(new_indptr),
                              torch.from_numpy(new_pos[indices]))
            frontiers[l] = torch.from_numpy(f[order])
        return SampledBatch(self.seeds, frontiers, blocks)


def _as_index_numpy(x) -> np.ndarray:
    """Contiguous source ids: int32 kept as they are, anything else as int64."""
    if isinstance(x, np.ndarray) and x.dtype == np.int32:
        return np.ascontiguousarray(x)
    return _as_int64_numpy(x)


def check_fanouts(fanouts, where: str = "fanouts") -> list[int]:
    """Validated fanout list: each an integer >= 1 or -1 (all neighbours); InputError otherwise."""
    out = []
    for f in fanouts:
        if isinstance(f, bool) or int(f) != f or (int(f) < 1 and int(f) != -1):
            raise InputError(f"{where}: fanout {f!r} is invalid, expected an integer >= 1 or -1 (all)")
        out.append(int(f))
    if not out:
        raise InputError(f"{where}: expected at least one fanout (one per GNN layer)")
    return out


class NeighborSampler:
    """Synchronous OpenMP neighbour sampler over one partition's local CSR.

    ``fanouts`` are given input side first (DGL order): ``[5, 10, 15]`` samples 15
    neighbours for the seeds (last block) and 5 in the input-most block; ``-1`` takes all
    neighbours. ``num_local`` (solid + halo count) defaults to
    ``max(num_solid, max(indices) + 1)``; pass it when seeds may be unreferenced halo IDs.
    The CSR arrays are used in place (no copy when ``indptr`` is contiguous int64 and
    ``indices`` contiguous int64 or int32); the draws do not depend on the indices' dtype.
    """

    def __init__(self, indptr, indices, num_solid: int, fanouts, seed: int = 0,
                 num_local: int | None = None):
        self.fanouts = check_fanouts(fanouts)
        self.seed = int(seed)
        self._indptr = _as_int64_numpy(indptr)
        self._indices = _as_index_numpy(indices)
        if num_local is None:
            top = int(self._indices.max()) + 1 if self._indices.size else 0
            num_local = max(int(num_solid), top)
        native = _native.Sampler32 if self._indices.dtype == np.int32 else _native.Sampler
        self._native = native(self._indptr, self._indices, int(num_solid), int(num_local))

    @property
    def num_layers(self) -> int:
        return len(self.fanouts)

    @property
    def num_solid(self) -> int:
        return int(self._native.num_solid)

    @property
    def num_local(self) -> int:
        return int(self._native.num_local)

    def sample(self, seeds, epoch: int = 0, step: int = 0) -> SampledBatch:
        """Sample the blocks of one minibatch; ``seeds`` are distinct local vertex IDs."""
        return self._run(seeds, self.fanouts, sample_key(self.seed, epoch, step))

    def sample_hop(self, seeds, fanout: int, seed: int, epoch: int = 0, step: int = 0) -> SampledBatch:
        """One block of ``fanout`` neighbours per seed, drawn from the stream of ``seed`` instead
        of the sampler's own: what ``NeighborSampler(..., [fanout], seed=seed).sample(seeds,
        epoch, step)`` draws, without a second sampler (each holds a [num_local] scratch)."""
        return self._run(seeds, [int(fanout)], sample_key(int(seed), epoch, step))

    def full_neighbor_blocks(self, seeds, num_layers: int | None = None) -> SampledBatch:
        """All in-neighbours at every layer (layer-wise inference / evaluation); no randomness."""
        n = self.num_layers if num_layers is None else int(num_layers)
        return self._run(seeds, [-1] * n, 0)

    def _run(self, seeds, fanouts, key: int) -> SampledBatch:
        seeds_np = _as_int64_numpy(seeds)
        if seeds_np.ndim != 1:
            raise ValueError(f"sample: seeds must be 1-D, got shape {seeds_np.shape}")
        layers = self._native.sample(seeds_np, fanouts, key)   # seeds' block first
        seeds_t = torch.from_numpy(seeds_np.copy())
        frontiers = [seeds_t]
        blocks = []
        num_dst = seeds_np.shape[0]
        for indptr, indices, frontier in layers:
            blocks.append(Block(int(frontier.shape[0]), num_dst, torch.from_numpy(indptr),
                                torch.from_numpy(indices)))
            frontiers.append(torch.from_numpy(frontier))
            num_dst = int(frontier.shape[0])
        return SampledBatch(seeds_t, frontiers[::-1], blocks[::-1])


def full_neighbor_blocks(indptr, indices, num_solid: int, seeds, num_layers: int,
                         num_local: int | None = None) -> SampledBatch:
    """All-neighbour blocks of ``seeds`` over ``num_layers`` layers (see :class:`NeighborSampler`)."""
    return NeighborSampler(indptr, indices, num_solid, [-1] * int(num_layers),
                           num_local=num_local).full_neighbor_blocks(seeds)
