"""NeighborSampler on a real partition store (Cora, 2 METIS parts): halo leaves, real edges."""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.partition.store import load_partition
from hpcgnn.sampling.neighbor import NeighborSampler


def test_sampling_a_cora_partition(cora_parts):
    store = cora_parts(2)
    for part_id in range(2):
        part = load_partition(store, part_id)
        indptr, local_indices = part.local_csr()
        sampler = NeighborSampler(indptr, local_indices, part.num_solid, [5, 10, 15], seed=0,
                                  num_local=part.num_local)
        seeds = np.flatnonzero(part.train_mask)[:64]
        batch = sampler.sample(torch.from_numpy(seeds), epoch=0, step=0)
        global_edges = set(zip(part.indices.tolist(),
                               np.repeat(np.arange(part.num_solid) + part.solid_begin, np.diff(part.indptr)).tolist()))
        halo_seen = 0
        for layer, block in enumerate(batch.blocks):
            src_g = part.to_global(batch.frontiers[layer].numpy())
            dst_l = batch.frontiers[layer + 1].numpy()
            dst_g = part.to_global(dst_l)
            deg = block.in_degree().numpy()
            assert np.all(deg[dst_l >= part.num_solid] == 0)                    # halo never expanded
            solid = dst_l < part.num_solid
            full = np.diff(part.indptr)[dst_l[solid]]
            assert np.array_equal(deg[solid], np.minimum(full, [5, 10, 15][layer]))
            e_dst = np.repeat(dst_g, deg)
            e_src = src_g[block.indices.numpy()]
            assert all((int(s), int(d)) in global_edges for s, d in zip(e_src, e_dst))
            halo = batch.frontiers[layer].numpy() >= part.num_solid
            assert np.isin(src_g[halo], part.halo_ids).all()
            halo_seen += int(halo.sum())
        assert halo_seen > 0
