"""Feature stores (host-only, device-only, tiered), the prefetcher, the placement solver and the
hotness passes, in one process on the CPU (the device tier is a separately budgeted host buffer)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcgnn.errors import InputError
from hpcgnn.store.budget import resolve_budget
from hpcgnn.store.device import DeviceFeatureStore
from hpcgnn.store.graph import HostGraphStore
from hpcgnn.store.host import HostFeatureStore
from hpcgnn.store.hotness import degree_order, frequency_order, presample
from hpcgnn.store.placement import degree_values, solve
from hpcgnn.store.prefetch import Prefetcher
from hpcgnn.store.tiered import TieredFeatureStore


def _rows(n=500, d=7, seed=0):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def _expected(feats, ids):
    n = feats.shape[0]
    out = np.zeros((ids.size, feats.shape[1]), np.float32)
    ok = ids < n
    out[ok] = feats[ids[ok]]
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_every_store_gathers_the_same_rows_bit_for_bit(overlap):
    feats = _rows()
    rng = np.random.default_rng(1)
    hot = rng.choice(500, 120, replace=False)
    stores = [HostFeatureStore(feats), DeviceFeatureStore(feats), TieredFeatureStore(feats, hot)]
    for store in stores:
        pf = Prefetcher(store, overlap)
        # ids with duplicates and halo ids (>= num_rows: zero rows); submitted two ahead
        batches = [torch.from_numpy(rng.integers(0, 560, size=s)) for s in (0, 1, 64, 300, 64)]
        handles = [pf.submit(b) for b in batches]
        for b, h in zip(batches, handles):
            got = pf.get(h).numpy()
            assert got.dtype == np.float32 and np.array_equal(got, _expected(feats, b.numpy())), store.name
        pf.close()
        c = store.counters["feature"]
        valid = sum(int((b < 500).sum()) for b in batches)
        assert c.lookups == valid
        if store.name == "host":
            assert c.device_hits == 0 and c.h2d_bytes == valid * 7 * 4
        elif store.name == "device":
            assert c.device_hits == valid and c.h2d_bytes == 0
        else:
            hits = sum(int(np.isin(b.numpy(), hot).sum()) for b in batches)
            assert c.device_hits == hits and c.h2d_bytes == (valid - hits) * 7 * 4
        assert store.counters.wait_seconds > 0


def test_host_and_device_only_stores_use_the_partition_array_in_place():
    feats = _rows()
    for cls in (HostFeatureStore, DeviceFeatureStore):
        s = cls(feats)
        assert s.full_rows().data_ptr() == feats.ctypes.data
    t = TieredFeatureStore(feats, np.arange(50))
    assert t.full_rows().data_ptr() == feats.ctypes.data          # host tier: no copy
    assert t.device_rows == 50 and t.device_bytes == 50 * 7 * 4 + 500 * 8
    with pytest.raises(ValueError):
        TieredFeatureStore(feats, np.array([3, 3]))


def test_tiered_store_adds_only_its_device_tier_to_resident_memory():
    from hpcgnn.run.memory import rss_bytes

    feats = np.ones((200_000, 100), np.float32)               # 80 MB, touched
    before = rss_bytes()
    host = HostFeatureStore(feats)
    out = host.gather(torch.arange(0, 200_000, 7))
    # no second copy of the features: at most the gathered rows themselves
    assert rss_bytes() - before < 0.1 * feats.nbytes + out.numel() * 4
    hot = np.arange(0, 200_000, 5)                            # 20 % of the rows
    before = rss_bytes()
    tiered = TieredFeatureStore(feats, hot)
    grown = rss_bytes() - before
    assert grown <= tiered.device_bytes + 0.05 * feats.nbytes
    assert grown < 0.4 * feats.nbytes


def test_budget_forms_and_one_line_errors():
    assert resolve_budget("auto", 1000, "cpu") == 0 and resolve_budget("auto", 1000, "cuda") is None
    assert resolve_budget(0, 1000, "cpu") == 0 and resolve_budget(0.2, 1000, "cpu") == 200
    assert resolve_budget(1, 1000, "cpu") == 1000 and resolve_budget("2KiB", 1000, "cpu") == 2048
    for bad in (3, -0.5, "six", True):
        with pytest.raises(InputError, match="store.device_memory"):
            resolve_budget(bad, 1000, "cpu")
    from hpcgnn.run.config import load_config

    with pytest.raises(InputError, match=r"store\.device_memory = 7"):
        load_config(None, ["data.partitions=x", "store.device_memory=7"])
    with pytest.raises(InputError, match="store.hotness"):
        load_config(None, ["data.partitions=x", "store.hotness=random"])


def test_solver_fills_the_budget_by_saved_bytes_per_byte():
    order = np.array([4, 0, 3, 1, 2])
    values = np.array([9.0, 5.0, 3.0, 1.0, 0.0])
    evals = np.array([5.0, 1.0, 0.0, 3.0, 9.0])
    # rows of 10 bytes; HEC_0: 30 bytes saving 240 (density 8), HEC_1: 100 bytes saving 50
    p = solve(50, 10, order, values, evals, hec_bytes=[30, 100], hec_saved=[240.0, 50.0])
    assert p.hec_on_device == [True, False]
    assert list(p.feature_rows) == [4, 0]                     # density 9 row, HEC (8), density 5 row
    assert p.bytes == {"feature": 20, "hec": 30, "topology": 0}
    assert p.predicted["feature_hit_rate"] == pytest.approx(14 / 18)
    # a block that does not fit is skipped, smaller items after it still go in
    p = solve(45, 10, order, values, evals, hec_bytes=[100], hec_saved=[1e6])
    assert p.hec_on_device == [False] and list(p.feature_rows) == [4, 0, 3, 1]
    # a spare budget also takes rows never seen in the pre-sample, in hotness order
    assert list(solve(1000, 10, order, values, evals).feature_rows) == [4, 0, 3, 1, 2]
    assert solve(0, 10, order, values, evals).feature_rows.size == 0
    # topology counts only for a device-side sampler
    tb, ts = np.array([16, 16]), np.array([1e3, 0.0])
    assert solve(40, 10, order, values, evals, topology_bytes=tb, topology_saved=ts).topology_rows.size == 0
    p = solve(40, 10, order, values, evals, topology_bytes=tb, topology_saved=ts, sampler_on_device=True)
    assert list(p.topology_rows) == [0] and p.bytes["topology"] == 16 and list(p.feature_rows) == [4, 0]


def test_degree_values_keep_the_degree_order():
    deg = np.array([5, 1, 5, 3, 0, 3])
    counts = np.array([10.0, 4.0, 20.0, 1.0, 0.0, 9.0])
    order = degree_order(deg)
    assert list(order) == [0, 2, 3, 5, 1, 4]
    v = degree_values(order, deg, counts)
    assert np.allclose(v, [15, 15, 5, 5, 4, 0])               # per-degree means, non-increasing
    assert list(frequency_order(counts, deg)) == [2, 0, 5, 1, 3, 4]


def _skewed_graph(n=4000, avg=12, seed=0):
    """In-edge CSR whose sources follow a power law (a few very hot vertices)."""
    rng = np.random.default_rng(seed)
    deg = rng.poisson(avg, n)
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    w = 1.0 / np.arange(1, n + 1) ** 0.8
    src = rng.choice(n, size=int(indptr[-1]), p=w / w.sum()).astype(np.int64)
    return indptr, src


@pytest.mark.parametrize("hotness", ["degree", "presample"])
def test_predicted_hit_rate_matches_an_independent_epoch(hotness):
    """The cheap version of the benchmark's check (|predicted - measured| <= 5 points)."""
    from hpcgnn.sampling.neighbor import NeighborSampler

    indptr, indices = _skewed_graph()
    n = indptr.size - 1
    graph = HostGraphStore(indptr, indices, n, n)
    sampler = NeighborSampler(*graph.csr(), n, [5, 5], seed=3)
    train = np.arange(0, n, 4)
    m, batch = 10, 100
    a = presample(sampler, train, batch, 16, m, seed=0, rank=0, stream=0)
    b = presample(sampler, train, batch, 16, m, seed=0, rank=0, stream=1)
    degree = np.bincount(indices, minlength=n)             # edges out of v: its degree in a symmetric graph
    if hotness == "degree":
        order = degree_order(degree)
        values = degree_values(order, degree, a.feature)
    else:
        order = frequency_order(a.feature, degree)
        values = a.feature[order]
    feats = _rows(n, 4)
    rng = np.random.default_rng(9)
    for frac in (0.05, 0.2, 0.5):
        p = solve(int(frac * n) * 16, 16, order, values, b.feature)
        store = TieredFeatureStore(feats, p.feature_rows)
        for k in range(m):                                   # one "epoch" on the training streams
            seeds = np.sort(rng.choice(train, batch, replace=False))
            store.gather(sampler.sample(seeds, epoch=1, step=k).frontiers[0])
        measured = store.counters["feature"].hit_rate
        assert abs(measured - p.predicted["feature_hit_rate"]) <= 0.05, (frac, measured, p.predicted)
        assert measured > frac                               # hot rows are hot


def test_graph_store_neighbors_and_accounting():
    from hpcgnn.sampling.neighbor import NeighborSampler
    from hpcgnn.store.base import StoreCounters

    indptr = np.array([0, 2, 2, 5], np.int64)
    indices = np.array([1, 3, 0, 1, 4], np.int64)
    g = HostGraphStore(indptr, indices, 3, 5)
    counts, nbrs = g.neighbors(np.array([2, 0, 1]))
    assert list(counts) == [3, 2, 0] and list(nbrs) == [0, 1, 4, 1, 3]
    assert list(g.degree([0, 1, 2])) == [2, 0, 3]
    s = NeighborSampler(*g.csr(), 3, [-1], num_local=5)
    assert s._indices is g.csr()[1]                          # the sampler reads the store in place
    c = StoreCounters()
    batch = s.sample(np.array([0, 2]))
    g.account(c, batch, True)
    assert c["topology"].lookups == 2 and c["topology"].h2d_bytes == 0
    assert c["blocks"].h2d_bytes == (3 + 5) * 8
