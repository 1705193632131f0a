"""AEP candidate selection in one process: the destination map (db_halo inverted) against a
per-vertex Python reference, and the nc cap per destination (the degree bias itself is
degree_biased_choice's, tested with the sampler)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402

from hpcgnn.comm.aep import AsyncEmbeddingPush, DestinationMap  # noqa: E402
from hpcgnn.comm.communicator import Communicator  # noqa: E402
from hpcgnn.partition.store import load_partition  # noqa: E402


def _partition(tmp_path, parts=4, rank=1):
    store = mb.tiny_store(tmp_path / "s", mb.tiny_graph(num_nodes=400, window=60), parts)
    return load_partition(store, rank)


def test_destination_map_matches_reference(tmp_path):
    part = _partition(tmp_path)
    dmap = DestinationMap(part)
    rng = np.random.default_rng(3)
    frontier = rng.permutation(part.num_solid)[:70]
    pos, ranks = dmap.expand(frontier)
    want = [(i, q) for q in range(part.num_parts) for i, v in enumerate(frontier)
            if v + part.solid_begin in set(part.send_list(q).tolist())]
    assert list(zip(pos.tolist(), ranks.tolist())) == want
    assert len(want) > 0 and len({q for _, q in want}) >= 2
    assert dmap.expand(np.zeros(0, np.int64))[0].size == 0


class _FakeComm(Communicator):
    """A data plane of ``size`` ranks seen from ``rank``: selection exchanges nothing, so every
    operation but opening the (unused) channel fails."""

    name = "fake"

    def open_capped(self, recv_caps):
        return None

    def _unused(self, *args, **kwargs):
        raise AssertionError("the selection test must not exchange anything")

    exchange_counts = start_alltoallv = start_allreduce_ = allgatherv = broadcast_ = duplicate = _unused


def test_select_caps_each_destination(tmp_path):
    part = _partition(tmp_path)
    halo_sets = [set(part.send_list(q).tolist()) for q in range(part.num_parts)]
    frontier = np.concatenate([np.arange(part.num_solid), part.num_solid + np.arange(part.num_halo)])
    for nc in (1000, 7, 1):
        aep = AsyncEmbeddingPush(_FakeComm(part.part_id, part.num_parts), part, num_layers=1, nc=nc,
                                 delay=1, max_degree=int(part.degree.max()))
        pos, counts, candidates = aep.select(frontier, rng_key=11)
        assert candidates == sum(len(s) for s in halo_sets)
        assert counts.sum() == pos.size and counts[part.part_id] == 0
        bounds = np.concatenate([[0], np.cumsum(counts)])
        for q in range(part.num_parts):
            ids = frontier[pos[bounds[q]:bounds[q + 1]]] + part.solid_begin
            assert set(ids.tolist()) <= halo_sets[q]                   # only halo vertices of q
            assert np.all(np.diff(pos[bounds[q]:bounds[q + 1]]) > 0)  # frontier order kept
            if len(halo_sets[q]) <= nc:
                assert counts[q] == len(halo_sets[q])                 # no cap: every candidate
            else:
                assert counts[q] <= nc                                # capped (may accept fewer)
        assert counts.sum() > 0
        again = aep.select(frontier, rng_key=11)
        assert np.array_equal(again[0], pos)                          # deterministic in the key
