"""Chunking, HongTu cost-model scheduling and the deduplicated transfer plan (pure numpy)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from toygraph import toy_graph  # noqa: E402

from hpcgnn.engine.chunk_schedule import (build_transfer_plan, chunk_bounds, choose_schedule,  # noqa: E402
                                          greedy_schedule, make_chunks, natural_schedule,
                                          schedule_volumes)


def local_csr(seed=0, n=400, window=30):
    """A graph's CSR treated as one partition: solid = first 300 rows, sources anywhere (< n)."""
    g = toy_graph(n, 8.0, seed=seed, window=window)
    n_solid = 300
    return g.indptr[:n_solid + 1].copy(), g.indices[:g.indptr[n_solid]].copy(), n_solid, n


@pytest.mark.parametrize("num_chunks", [1, 3, 8, 64])
def test_chunks_partition_vertices_and_edges(num_chunks):
    indptr, indices, n_solid, n = local_csr()
    chunks = make_chunks(indptr, indices, num_chunks)
    assert len(chunks) == num_chunks
    assert chunks[0].dst_begin == 0 and chunks[-1].dst_end == n_solid
    for a, b in zip(chunks, chunks[1:]):
        assert a.dst_end == b.dst_begin  # disjoint cover of the destinations
    weight = np.diff(indptr) + 1
    w = [weight[c.dst_begin:c.dst_end].sum() for c in chunks]
    assert max(w) <= weight.sum() / num_chunks + weight.max()  # edge balanced
    for c in chunks:
        assert np.array_equal(c.src[:c.num_dst], np.arange(c.dst_begin, c.dst_end))
        assert len(np.unique(c.src)) == c.num_src
        # all in-edges of every destination, in order: the full-neighbour property
        assert np.array_equal(np.diff(c.indptr), np.diff(indptr)[c.dst_begin:c.dst_end])
        assert np.array_equal(c.src[c.indices], indices[indptr[c.dst_begin]:indptr[c.dst_end]])
    assert sum(c.num_edges for c in chunks) == indices.shape[0]


def test_more_chunks_than_vertices_gives_one_per_vertex():
    indptr = np.array([0, 1, 3, 3])
    b = chunk_bounds(indptr, 10)
    assert np.array_equal(b, [0, 1, 2, 3])


def simulate(plan, chunks, num_vertices):
    """Replay the plan on a buffer of vertex IDs, forward then backward; check residency."""
    buf = np.full(plan.capacity, -1)
    for u in plan.units:
        assert len(np.unique(u.slots)) == u.slots.shape[0] and u.slots.max() < plan.capacity
        buf[u.slots[u.enter]] = u.vertices[u.enter]          # host -> device, only new rows
        assert np.array_equal(buf[u.slots], u.vertices)     # slot(v) holds v
        for c, cs in zip(u.chunks, u.chunk_slots):
            assert np.array_equal(buf[cs], chunks[c].src)
    grads = np.zeros(num_vertices)
    gbuf = np.zeros(plan.capacity)
    for u in reversed(plan.units):
        gbuf[u.slots[u.leave]] = 0.0                        # rows entering in reverse: zeroed
        buf[u.slots[u.leave]] = u.vertices[u.leave]         # (recompute: reloaded)
        assert np.array_equal(buf[u.slots], u.vertices)
        for c, cs in zip(u.chunks, u.chunk_slots):
            np.add.at(gbuf, cs, 1.0)                         # each chunk adds 1 per source
        grads[u.vertices[u.enter]] += gbuf[u.slots[u.enter]]  # flush rows leaving in reverse
    return grads


@pytest.mark.parametrize("batch_chunks", [1, 2, 3])
@pytest.mark.parametrize("dedup", [True, False])
def test_transfer_plan_slots_and_volumes(batch_chunks, dedup):
    indptr, indices, n_solid, n = local_csr(seed=1)
    chunks = make_chunks(indptr, indices, 12)
    for sched in (natural_schedule(len(chunks), batch_chunks), greedy_schedule(chunks, batch_chunks, n)):
        assert sorted(sched.order()) == list(range(len(chunks)))
        assert all(len(b) <= batch_chunks for b in sched.batches)
        vol = schedule_volumes(chunks, sched)
        assert vol.v_reuse <= vol.v_batch <= vol.v_ori == sum(c.num_src for c in chunks)
        plan = build_transfer_plan(chunks, sched, n, dedup=dedup)
        assert plan.rows_loaded() == (vol.v_reuse if dedup else vol.v_ori)
        # every source gradient arrives exactly once per chunk that reads it
        expect = np.zeros(n)
        for c in chunks:
            expect[c.src] += 1
        assert np.array_equal(simulate(plan, chunks, n), expect)
        # flush volume (backward device->host) equals the load volume
        assert sum(u.enter.shape[0] for u in plan.units) == plan.rows_loaded()
        if dedup:
            sizes = [u.vertices.shape[0] for u in plan.units]
            assert plan.capacity == max(sizes)
            for a, b in zip(plan.units, plan.units[1:]):  # shared rows keep their slot
                common, ia, ib = np.intersect1d(a.vertices, b.vertices, return_indices=True)
                assert np.array_equal(a.slots[ia], b.slots[ib])
                assert b.enter.shape[0] == b.vertices.shape[0] - common.shape[0]


def two_community_chunks():
    """8 destinations in 4 chunks; chunks 0, 2 read halo set A, chunks 1, 3 read halo set B."""
    a, b = np.arange(8, 18), np.arange(18, 28)
    rows = [a if (v // 2) % 2 == 0 else b for v in range(8)]
    indptr = np.concatenate([[0], np.cumsum([r.size for r in rows])])
    return make_chunks(indptr, np.concatenate(rows), 4)


def test_cost_model_order_beats_natural_on_known_overlap():
    chunks = two_community_chunks()
    assert [c.dst_begin for c in chunks] == [0, 2, 4, 6]
    sched, vols = choose_schedule(chunks, 1, "cost", 28)
    assert sched.method == "greedy" and sched.order() == [0, 2, 1, 3]
    assert vols["natural"].v_reuse == 48 and vols["greedy"].v_reuse == 28
    sched, vols = choose_schedule(chunks, 2, "cost", 28)
    assert sched.batches == [[0, 2], [1, 3]]
    assert vols["greedy"].v_batch == 28 < vols["natural"].v_batch == 48
    assert vols["greedy"].v_reuse <= vols["natural"].v_reuse
    sched, vols = choose_schedule(chunks, 1, "natural", 28)
    assert sched.method == "natural" and "greedy" not in vols


def test_cost_model_never_worse_than_natural():
    indptr, indices, n_solid, n = local_csr(seed=2, window=None)
    chunks = make_chunks(indptr, indices, 16)
    for b in (1, 2, 4):
        sched, vols = choose_schedule(chunks, b, "cost", n)
        chosen = schedule_volumes(chunks, sched)
        assert chosen.cost(4) <= vols["natural"].cost(4)


# ---- against an independently computed optimum -----------------------------------------------

def _sources(indptr, indices, begin, end) -> frozenset:
    """A chunk's source rows straight from the CSR: its destinations and their in-neighbours."""
    return frozenset(range(begin, end)) | frozenset(indices[indptr[begin]:indptr[end]].tolist())


def _brute_force_reuse(src_sets, batch_chunks) -> int:
    """Least host->device rows per layer pass (V_reuse of Eq. 4) over every ordering of the
    chunks into consecutive batches of ``batch_chunks``: rows of a batch not in the previous
    batch's union are loaded. Plain Python sets, no code from hpcgnn.engine.chunk_schedule."""
    import itertools

    best = None
    for perm in itertools.permutations(range(len(src_sets))):
        batches = [perm[i:i + batch_chunks] for i in range(0, len(perm), batch_chunks)]
        unions = [frozenset().union(*(src_sets[c] for c in b)) for b in batches]
        rows = len(unions[0]) + sum(len(cur - prev) for prev, cur in zip(unions, unions[1:]))
        best = rows if best is None else min(best, rows)
    return best


def _community_csr(seed: int, communities: int, chunks_per: int, rows_per: int, halo_per: int,
                   cross: float):
    """Destinations in chunk-sized runs that belong to communities in turn (0, 1, .., 0, 1, ..);
    each destination reads ``halo_per`` random rows of its community's halo block and, with
    probability ``cross``, one row of another community's block."""
    rng = np.random.default_rng(seed)
    n_dst = communities * chunks_per * rows_per
    halo0 = n_dst
    rows = []
    for v in range(n_dst):
        c = (v // rows_per) % communities
        block = halo0 + c * 3 * halo_per + rng.choice(3 * halo_per, size=halo_per, replace=False)
        if rng.random() < cross:
            other = (c + 1 + rng.integers(communities - 1)) % communities
            block = np.append(block, halo0 + other * 3 * halo_per + rng.integers(3 * halo_per))
        rows.append(np.sort(block))
    indptr = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int64)
    return indptr, np.concatenate(rows).astype(np.int64), n_dst, halo0 + communities * 3 * halo_per


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch_chunks", [1, 2])
def test_cost_schedule_near_the_brute_force_optimum(seed, batch_chunks):
    """6 chunks of 3 interleaved communities: the cost-model schedule loads at most 10 % more
    rows than the best of all 720 orders, and the volumes it reports are the rows an
    independent recount finds; the natural order is not optimal here."""
    indptr, indices, n_dst, n = _community_csr(seed, 3, 2, 4, 6, cross=0.2)
    chunks = make_chunks(indptr, indices, 6)
    sets = [_sources(indptr, indices, c.dst_begin, c.dst_end) for c in chunks]
    assert [frozenset(c.src.tolist()) for c in chunks] == sets
    optimum = _brute_force_reuse(sets, batch_chunks)
    sched, vols = choose_schedule(chunks, batch_chunks, "cost", n)
    batches = [frozenset().union(*(sets[c] for c in b)) for b in sched.batches]
    recount = len(batches[0]) + sum(len(cur - prev) for prev, cur in zip(batches, batches[1:]))
    assert recount == schedule_volumes(chunks, sched).v_reuse
    assert sorted(sched.order()) == list(range(6))
    assert recount <= 1.10 * optimum, (recount, optimum)
    assert vols["natural"].v_reuse > optimum
