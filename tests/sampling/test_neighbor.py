"""NeighborSampler against a plain-Python reference and its contracts.

Throughput (not asserted): ``.venv/bin/python -m benchmarks.kernels sampler`` (1M vertices,
~20M edges, fanouts 5,10,15, batch 1000).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampling_reference import sample_reference  # noqa: E402

from hpcgnn.errors import InputError  # noqa: E402
from hpcgnn.native import sampler as native_sampler  # noqa: E402
from benchmarks.kernels import random_csr  # noqa: E402
from hpcgnn.sampling.neighbor import NeighborSampler, SampledBatch, full_neighbor_blocks  # noqa: E402


def small_partition(num_solid=60, num_halo=20, seed=3):
    """Local CSR with halo sources, an empty row, a hub (all 79 others) and sorted rows."""
    rng = np.random.default_rng(seed)
    n_local = num_solid + num_halo
    rows = []
    for v in range(num_solid):
        if v == 0:
            deg = 0
        elif v == 1:
            deg = 150
        else:
            deg = int(rng.integers(0, 25))
        pool = np.setdiff1d(np.arange(n_local), [v])
        deg = min(deg, pool.size)
        rows.append(np.sort(rng.choice(pool, size=deg, replace=False)))
    indptr = np.zeros(num_solid + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([r.size for r in rows])
    indices = np.concatenate(rows).astype(np.int64)
    return indptr, indices, num_solid, n_local


def hub_partition(num_solid=40, num_halo=200):
    """Vertex 0 has 220 in-neighbours (exercises the k > 64 path of Floyd's algorithm)."""
    rng = np.random.default_rng(11)
    n_local = num_solid + num_halo
    rows = [np.arange(1, n_local - 19, dtype=np.int64)]
    for v in range(1, num_solid):
        rows.append(np.sort(rng.choice(np.setdiff1d(np.arange(n_local), [v]), size=8, replace=False)))
    indptr = np.zeros(num_solid + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([r.size for r in rows])
    return indptr, np.concatenate(rows).astype(np.int64), num_solid, n_local


def as_lists(batch: SampledBatch):
    fr = [f.tolist() for f in batch.frontiers]
    bl = [(b.indptr.tolist(), b.indices.tolist()) for b in batch.blocks]
    return fr, bl


@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("fanouts", [[3, 5], [2, 4, 6], [-1, 4], [1, -1, 2], [100, 70]])
def test_matches_python_reference(fanouts, index_dtype):
    """Also over int32 source ids (the minibatch engine's, when every local id fits): the same
    draws, the CSR used in place."""
    for graph in (small_partition(), hub_partition()):
        indptr, indices, ns, nl = graph
        indices = indices.astype(index_dtype)
        sampler = NeighborSampler(indptr, indices, ns, fanouts, seed=42, num_local=nl)
        assert sampler._indices is indices
        for epoch, step, seeds in [(0, 0, [1, 5, 7, 0]), (3, 17, [9, 2, 30, 1]), (1, 2, [0])]:
            got = as_lists(sampler.sample(torch.tensor(seeds), epoch=epoch, step=step))
            ref = sample_reference(indptr, indices, ns, fanouts, 42, epoch, step, seeds)
            assert got[0] == ref[0]
            assert got[1] == [(list(p), list(i)) for p, i in ref[1]]


def test_matches_python_reference_on_parallel_paths():
    # large enough that every OpenMP loop (relabel chunks, dynamic sampling) runs parallel
    indptr, indices = random_csr(3_000, 30, seed=2, num_halo=300)
    seeds = np.random.default_rng(1).choice(3_000, 400, replace=False)
    before = native_sampler.max_threads()
    try:
        native_sampler.set_threads(2)
        sampler = NeighborSampler(indptr, indices, 3_000, [8, 12], seed=5, num_local=3_300)
        got = as_lists(sampler.sample(seeds, epoch=4, step=1))
        narrow = NeighborSampler(indptr, indices.astype(np.int32), 3_000, [8, 12], seed=5, num_local=3_300)
        assert as_lists(narrow.sample(seeds, epoch=4, step=1)) == got
    finally:
        native_sampler.set_threads(before)
    assert len(got[1][0][1]) > 15_000
    ref = sample_reference(indptr, indices, 3_000, [8, 12], 5, 4, 1, seeds)
    assert got[0] == ref[0]
    assert got[1] == [(list(p), list(i)) for p, i in ref[1]]


def edge_set(indptr, indices):
    return {(int(u), v) for v in range(len(indptr) - 1) for u in indices[indptr[v]:indptr[v + 1]]}


def test_sampled_blocks_satisfy_contract():
    indptr, indices, ns, nl = small_partition()
    edges = edge_set(indptr, indices)
    deg = np.diff(indptr)
    fanouts = [4, 6, 3]
    sampler = NeighborSampler(indptr, indices, ns, fanouts, seed=7, num_local=nl)
    seeds = torch.tensor([3, 1, 0, 17, 44, 59])
    batch = sampler.sample(seeds, epoch=2, step=5)
    assert len(batch.blocks) == 3 and len(batch.frontiers) == 4
    assert torch.equal(batch.frontiers[-1], seeds) and torch.equal(batch.seeds, seeds)
    for layer, block in enumerate(batch.blocks):
        src_f, dst_f = batch.frontiers[layer], batch.frontiers[layer + 1]
        assert torch.equal(src_f[:dst_f.numel()], dst_f)                  # prefix property
        assert len(set(src_f.tolist())) == src_f.numel()                   # frontier unique
        assert block.num_src == src_f.numel() and block.num_dst == dst_f.numel()
        assert block.indptr.dtype == torch.int64 and block.indices.dtype == torch.int64
        assert block.indptr[0] == 0 and block.indptr[-1] == block.indices.numel()
        assert int(block.indices.min()) >= 0 and int(block.indices.max()) < block.num_src
        # every source position is used by some edge, except the destination prefix
        used = set(block.indices.tolist())
        assert set(range(block.num_dst, block.num_src)) <= used
        for i, v in enumerate(dst_f.tolist()):
            nbrs = src_f[block.indices[block.indptr[i]:block.indptr[i + 1]]].tolist()
            if v >= ns:
                assert nbrs == []                                             # halo never expanded
                continue
            assert len(nbrs) == min(fanouts[layer], deg[v])
            assert len(set(nbrs)) == len(nbrs)                                # without replacement
            assert all((u, v) in edges for u in nbrs)
            row = indices[indptr[v]:indptr[v + 1]].tolist()
            assert nbrs == [u for u in row if u in set(nbrs)]                 # CSR row order
    assert any(v >= ns for v in batch.frontiers[0].tolist())                  # halo vertices were reached


def test_all_neighbours_with_minus_one():
    indptr, indices, ns, nl = small_partition()
    seeds = torch.arange(0, ns, 7)
    batch = full_neighbor_blocks(indptr, indices, ns, seeds, num_layers=2, num_local=nl)
    for layer, block in enumerate(batch.blocks):
        src_f, dst_f = batch.frontiers[layer], batch.frontiers[layer + 1]
        for i, v in enumerate(dst_f.tolist()):
            nbrs = src_f[block.indices[block.indptr[i]:block.indptr[i + 1]]].tolist()
            expect = indices[indptr[v]:indptr[v + 1]].tolist() if v < ns else []
            assert nbrs == expect
    sampler = NeighborSampler(indptr, indices, ns, [-1, -1], seed=1, num_local=nl)
    assert as_lists(sampler.sample(seeds, 5, 9)) == as_lists(batch)          # no randomness at -1


def test_deterministic_across_threads_and_calls_and_varies_with_step():
    # big enough for the parallel prefix sum (>= 65536 destinations) and many chunks
    indptr, indices = random_csr(100_000, 20, seed=5, num_halo=5_000)
    sampler = NeighborSampler(indptr, indices, 100_000, [15, 15], seed=9, num_local=105_000)
    seeds = np.random.default_rng(0).choice(100_000, 7_000, replace=False)
    before = native_sampler.max_threads()
    try:
        native_sampler.set_threads(1)
        one = sampler.sample(seeds, epoch=1, step=3)
        native_sampler.set_threads(2)
        two = sampler.sample(seeds, epoch=1, step=3)
        again = sampler.sample(seeds, epoch=1, step=3)
    finally:
        native_sampler.set_threads(before)
    assert one.blocks[0].num_dst >= 65536
    for a, b in [(one, two), (two, again)]:
        for fa, fb in zip(a.frontiers, b.frontiers):
            assert torch.equal(fa, fb)
        for ba, bb in zip(a.blocks, b.blocks):
            assert torch.equal(ba.indptr, bb.indptr) and torch.equal(ba.indices, bb.indices)
    other_step = sampler.sample(seeds, epoch=1, step=4)
    other_epoch = sampler.sample(seeds, epoch=2, step=3)
    other_seed = NeighborSampler(indptr, indices, 100_000, [15, 15], seed=10, num_local=105_000).sample(
        seeds, epoch=1, step=3)
    for other in (other_step, other_epoch, other_seed):
        assert torch.equal(other.blocks[1].indptr, one.blocks[1].indptr)     # counts = min(f, deg)
        assert not torch.equal(other.frontiers[1], one.frontiers[1])


def test_roughly_uniform_on_stars():
    # 200 centres 0..199 share the same 50 in-neighbours 200..249; fanout 5; 20 steps
    # -> 4000 independent draws of 5 out of 50, 400 expected per neighbour
    centres, leaves = 200, 50
    n = centres + leaves
    indptr = np.arange(centres + 1, dtype=np.int64) * leaves
    indices = np.tile(np.arange(centres, n, dtype=np.int64), centres)
    sampler = NeighborSampler(indptr, indices, centres, [5], seed=123, num_local=n)
    counts = np.zeros(leaves, dtype=np.int64)
    pair = np.zeros((leaves, leaves), dtype=np.int64)
    for step in range(20):
        b = sampler.sample(np.arange(centres), epoch=0, step=step)
        picked = (b.frontiers[0][b.blocks[0].indices].numpy() - centres).reshape(centres, 5)
        assert all(np.unique(row).size == 5 for row in picked)
        np.add.at(counts, picked.ravel(), 1)
        for a_ in range(5):
            for b_ in range(5):
                if a_ != b_:
                    np.add.at(pair, (picked[:, a_], picked[:, b_]), 1)
    expected = 4000 * 5 / leaves
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 110, chi2            # 49 dof: P(chi2 > 110) < 1e-6
    # ordered pairs (i != j): probability 5*4/(50*49) per draw -> about 32.7 each
    off = pair[~np.eye(leaves, dtype=bool)]
    pexp = 4000 * 20 / (leaves * (leaves - 1))
    assert off.sum() == 4000 * 20
    chi2_pairs = float(((off - pexp) ** 2 / pexp).sum())
    assert chi2_pairs < 2 * off.size, chi2_pairs   # about off.size if independent and uniform


def test_errors_and_recovery():
    indptr, indices, ns, nl = small_partition()
    with pytest.raises(InputError, match="fanout"):
        NeighborSampler(indptr, indices, ns, [3, 0])
    with pytest.raises(InputError, match="fanout"):
        NeighborSampler(indptr, indices, ns, [2.5])
    with pytest.raises(InputError, match="at least one"):
        NeighborSampler(indptr, indices, ns, [])
    with pytest.raises(ValueError, match="indices"):
        NeighborSampler(indptr, indices, ns, [3], num_local=ns + 1)
    bad = indptr.copy()
    bad[5] = bad[6] + 1
    with pytest.raises(ValueError, match="non-decreasing"):
        NeighborSampler(bad, indices, ns, [3], num_local=nl)
    sampler = NeighborSampler(indptr, indices, ns, [3, 4], seed=1, num_local=nl)
    good = as_lists(sampler.sample([4, 8, 12], 0, 0))
    with pytest.raises(ValueError, match="repeated"):
        sampler.sample([4, 8, 4], 0, 0)
    with pytest.raises(ValueError, match="outside"):
        sampler.sample([4, nl], 0, 0)
    # the scratch state was restored: identical results after the failures
    assert as_lists(sampler.sample([4, 8, 12], 0, 0)) == good


def test_empty_seeds_and_halo_seeds():
    indptr, indices, ns, nl = small_partition()
    sampler = NeighborSampler(indptr, indices, ns, [3, 4], seed=1, num_local=nl)
    b = sampler.sample(np.array([], dtype=np.int64))
    assert [f.numel() for f in b.frontiers] == [0, 0, 0]
    assert [blk.num_edges for blk in b.blocks] == [0, 0]
    halo = sampler.sample([ns, ns + 3])                                        # halo seeds: leaves
    assert [f.tolist() for f in halo.frontiers] == [[ns, ns + 3]] * 3
    assert all(blk.num_edges == 0 for blk in halo.blocks)


def _layerwise_sums(batch: SampledBatch, num_solid: int, x: np.ndarray) -> list[dict]:
    """Per layer, {solid destination vertex: (its source vertices in edge order, their
    summed rows)}, with every halo row of a layer input > 0 set to a value of its own (the
    engine's cached row), so the sums are comparable between batch layouts."""
    out, h = [], {int(v): x[v] for v in batch.frontiers[0].tolist()}
    for l, blk in enumerate(batch.blocks):
        src, dst = batch.frontiers[l].numpy(), batch.frontiers[l + 1].numpy()
        ip, ix = blk.indptr.numpy(), blk.indices.numpy()
        layer, nxt = {}, {}
        for i in range(blk.num_dst):
            v = int(dst[i])
            if v >= num_solid:
                continue
            nbrs = src[ix[ip[i]:ip[i + 1]]]
            total = np.zeros_like(x[0])
            for u in nbrs:
                total = total + h[int(u)]
            layer[v] = (nbrs.tolist(), total)
            nxt[v] = total + h[v]
        for v in dst.tolist():
            if v >= num_solid:
                nxt[v] = x[v] * (l + 2)          # the "cached" row of a halo vertex
        out.append(layer)
        h = nxt
    return out


@pytest.mark.parametrize("fanouts", [[3, 5], [2, 4, 6], [-1, 4]])
def test_halo_last_keeps_every_solid_destination_and_its_sums(fanouts):
    indptr, indices, ns, nl = small_partition()
    sampler = NeighborSampler(indptr, indices, ns, fanouts, seed=5, num_local=nl)
    x = np.random.default_rng(0).standard_normal((nl, 3)).astype(np.float32)
    for step, seeds in enumerate([[2, 7, 11, 30], [1, 4, 5], [59]]):
        orig = sampler.sample(seeds, epoch=1, step=step)
        new = orig.halo_last(ns)
        assert new.seeds.tolist() == list(seeds) and new.frontiers[-1].tolist() == list(seeds)
        for l, blk in enumerate(new.blocks):
            f, up = new.frontiers[l].numpy(), new.frontiers[l + 1].numpy()
            solid = f < ns
            assert solid[:solid.sum()].all()                         # [solid..., halo...]
            assert blk.num_src == f.size and blk.num_dst == int((up < ns).sum())
            assert (f[:blk.num_dst] == up[up < ns]).all()            # solid dsts: the prefix
            halo_src = np.flatnonzero(~solid)
            assert np.isin(halo_src, blk.indices.numpy()).all()      # every halo row is used
            # the solid vertices are the original frontier's, in the same order
            assert (f[solid] == orig.frontiers[l].numpy()[orig.frontiers[l].numpy() < ns]).all()
        a, b = _layerwise_sums(orig, ns, x), _layerwise_sums(new, ns, x)
        for la, lb in zip(a, b):
            assert la.keys() == lb.keys()
            for v in la:
                assert la[v][0] == lb[v][0]                          # same sources, same order
                assert np.array_equal(la[v][1], lb[v][1])            # bitwise equal sums
        assert sum(blk.num_edges for blk in new.blocks) == orig.num_sampled_edges
        assert sum(blk.num_dst for blk in new.blocks) < sum(blk.num_dst for blk in orig.blocks) or \
            all((f.numpy() < ns).all() for f in orig.frontiers)


def test_halo_last_refuses_halo_seeds_and_edges_into_halo():
    indptr, indices, ns, nl = small_partition()
    sampler = NeighborSampler(indptr, indices, ns, [3, 4], seed=1, num_local=nl)
    with pytest.raises(ValueError, match="seeds must be solid"):
        sampler.sample([ns, 2]).halo_last(ns)
    batch = sampler.sample([2, 7])
    expanded = batch.frontiers[1].numpy()[batch.blocks[0].in_degree().numpy() > 0]
    assert (expanded > 7).any()
    with pytest.raises(ValueError, match="edges into halo destinations"):
        batch.halo_last(8)          # calls vertices >= 8 halo, though some were expanded


def test_sample_hop_draws_what_a_one_hop_sampler_of_that_seed_draws():
    """``sample_hop(seeds, f, seed, epoch, step)`` (one sampler shared by every hop of the exact
    fetch) equals ``NeighborSampler(..., [f], seed=seed).sample(seeds, epoch, step)``."""
    indptr, indices, ns, nl = hub_partition()
    shared = NeighborSampler(indptr, indices, ns, [2, 2], seed=1, num_local=nl)
    for f, seed, epoch, step in [(3, 11, 0, 0), (-1, 5, 2, 9), (1, 99, -1, 0)]:
        own = NeighborSampler(indptr, indices, ns, [f], seed=seed, num_local=nl)
        seeds = torch.tensor([0, 3, 1])
        assert as_lists(shared.sample_hop(seeds, f, seed, epoch, step)) == as_lists(own.sample(seeds, epoch, step))
