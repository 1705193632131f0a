"""HistoricalEmbeddingCache: exact storage, FIFO replacement, ageing, statistics, and a
large random run against a plain-Python model of the documented semantics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcgnn.cache.hec import HistoricalEmbeddingCache
from hpcgnn.errors import InputError
from hpcgnn.native import cache as native_cache


class ReferenceHEC:
    """Sequential model: dict directory, list ring, explicit clock (obviously correct, slow)."""

    def __init__(self, capacity, life_span, never_expire):
        self.cs, self.ls, self.never = capacity, life_span, never_expire
        self.clear()

    def clear(self):
        self.slots = [None] * self.cs          # (tag, clock, row) or None
        self.dir = {}
        self.ptr = 0
        self.clock = 0

    def store(self, tags, rows):
        self.clock += 1
        last = {}
        for i, t in enumerate(tags):
            last[int(t)] = i
        for i in sorted(last.values())[-self.cs:]:
            t = int(tags[i])
            if t in self.dir:
                self.slots[self.dir.pop(t)] = None
            s = self.ptr
            if self.slots[s] is not None:
                del self.dir[self.slots[s][0]]
            self.slots[s] = (t, self.clock, rows[i].clone())
            self.dir[t] = s
            self.ptr = (self.ptr + 1) % self.cs

    def lookup(self, tags):
        hits, rows, ages = [], [], []
        for t in tags:
            s = self.dir.get(int(t))
            age = None if s is None else self.clock - self.slots[s][1]
            ok = s is not None and (self.never or age <= self.ls)
            hits.append(ok)
            if ok:
                rows.append(self.slots[s][2])
                ages.append(age)
        return hits, rows, ages

    def resident_tags(self):
        out = []
        for j in range(self.cs):
            line = self.slots[(self.ptr + j) % self.cs]
            if line is not None:
                out.append(line[0])
        return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def random_rows(n, dim, seed):
    """float32 rows from random bit patterns: NaNs with payloads, infinities, -0, subnormals."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (n, dim), generator=g, dtype=torch.int32).view(torch.float32)


def test_rows_read_back_bitwise_and_restore_returns_newer():
    hec = HistoricalEmbeddingCache(capacity=64, dim=5, life_span=2)
    tags = torch.tensor([7, 2**40 + 3, 0, 123456789012])
    rows = random_rows(4, 5, 0)
    hec.store(tags, rows)
    hit, slots = hec.lookup(tags)
    assert hit.all() and hit.dtype == torch.bool and slots.dtype == torch.int64
    assert torch.equal(bits(hec.load(slots)), bits(rows))
    newer = random_rows(1, 5, 1)
    hec.store(torch.tensor([0]), newer)
    hit, slots = hec.lookup(torch.tensor([0, 7]))
    assert hit.all()
    assert torch.equal(bits(hec.load(slots[:1])), bits(newer))
    assert torch.equal(bits(hec.load(slots[1:])), bits(rows[:1]))
    assert hec.occupancy == 4
    assert hec.stats()["replaced"] == 1
    fhit, frows = hec.fetch(torch.tensor([5, 7]))
    assert fhit.tolist() == [False, True] and torch.equal(bits(frows), bits(rows[:1]))


def test_fifo_eviction_and_occupancy_bound():
    hec = HistoricalEmbeddingCache(capacity=4, dim=2, life_span=100)
    val = lambda ts: torch.tensor([[t, -t] for t in ts], dtype=torch.float32)  # noqa: E731
    hec.store([1, 2], val([1, 2]))
    hec.store([3], val([3]))
    hec.store([4, 5], val([4, 5]))                      # 5 overwrites the oldest line (1)
    assert hec.resident()[0].tolist() == [2, 3, 4, 5]
    assert hec.lookup([1, 2, 5])[0].tolist() == [False, True, True]
    hec.store([3], val([30]))                          # re-store: new slot (evicts 2), old 3 invalid
    assert hec.resident()[0].tolist() == [4, 5, 3]
    assert hec.occupancy == 3
    hit, slots = hec.lookup([3])
    assert hit.item() and hec.load(slots).tolist() == [[30.0, -30.0]]
    s = hec.stats()
    assert (s["evictions"], s["replaced"], s["lines_stored"], s["stores"]) == (2, 1, 6, 4)
    for step in range(10):
        hec.store(torch.arange(step * 3, step * 3 + 3) + 100, val(range(3)))
        assert hec.occupancy <= 4
    assert hec.resident()[0].tolist() == [126, 127, 128, 129]


def test_batch_larger_than_capacity_and_duplicates_keep_last():
    hec = HistoricalEmbeddingCache(capacity=3, dim=1, life_span=1)
    hec.store([10, 11, 12, 13, 14], torch.arange(5.0).unsqueeze(1))
    assert hec.resident()[0].tolist() == [12, 13, 14]
    hec.clear()
    hec.store([10, 11, 10, 12, 13], torch.arange(5.0).unsqueeze(1))      # last occurrences: 11,10,12,13
    assert hec.resident()[0].tolist() == [10, 12, 13]
    hit, slots = hec.lookup([10])
    assert hec.load(slots).item() == 2.0
    big = HistoricalEmbeddingCache(capacity=10, dim=1, life_span=1)
    big.store([5, 5, 5], torch.tensor([[1.0], [2.0], [3.0]]))
    assert big.occupancy == 1 and big.fetch([5])[1].item() == 3.0


@pytest.mark.parametrize("life_span", [0, 2, 5])
def test_ageing_and_life_span(life_span):
    hec = HistoricalEmbeddingCache(capacity=100, dim=1, life_span=life_span)
    layer0 = HistoricalEmbeddingCache(capacity=100, dim=1, life_span=life_span, never_expire=True)
    for c in (hec, layer0):
        c.store([9], torch.ones(1, 1))                 # store step j
    for after in range(life_span + 4):                 # lookups after store steps j .. j+ls+3
        assert hec.lookup([9])[0].item() == (after <= life_span)
        assert layer0.lookup([9])[0].item()
        assert layer0.resident()[2].item() == after
        for c in (hec, layer0):
            c.store([], torch.empty(0, 1))             # an empty message still ages the lines
    assert hec.clock == layer0.clock == life_span + 5
    hec.store([9], torch.ones(1, 1))                   # re-store refreshes the age
    assert hec.lookup([9])[0].item()
    assert hec.occupancy == 1                          # expired lines stay until overwritten


def test_statistics():
    hec = HistoricalEmbeddingCache(capacity=8, dim=1, life_span=3, hist_bins=4)
    hec.store([1, 2, 3], torch.zeros(3, 1))            # clock 1
    hec.store([4], torch.zeros(1, 1))                  # clock 2
    hec.store([], torch.zeros(0, 1))                   # clock 3
    hit, _ = hec.lookup([1, 4, 5, 1])                  # ages 2, 1, miss, 2
    assert hit.tolist() == [True, True, False, True]
    hec.store([], torch.zeros(0, 1))                   # clock 4
    hec.store([], torch.zeros(0, 1))                   # clock 5: line 4 age 3, lines 1-3 age 4
    hit, _ = hec.lookup([1, 4])
    assert hit.tolist() == [False, True]
    s = hec.stats()
    assert (s["lookups"], s["hits"], s["age_sum"], s["age_max"]) == (6, 4, 2 + 1 + 2 + 3, 3)
    assert s["age_hist"] == [0, 1, 2, 1]
    assert s["hit_rate"] == pytest.approx(4 / 6) and s["age_mean"] == pytest.approx(8 / 4)
    assert (s["occupancy"], s["capacity"], s["clock"], s["stores"], s["received"]) == (4, 8, 5, 5, 4)
    assert s["live"] == 1                              # only line 4 (age 3 <= ls) would still hit
    hec.reset_stats()
    s = hec.stats()
    assert (s["lookups"], s["hits"], s["age_sum"], s["age_max"], sum(s["age_hist"])) == (0, 0, 0, 0, 0)
    assert s["occupancy"] == 4                         # state is not statistics
    hec.clear()
    assert hec.occupancy == 0 and hec.clock == 0 and not hec.lookup([1, 4])[0].any()
    hec.store([7], torch.ones(1, 1))
    assert hec.resident()[1].tolist() == [0]           # write pointer reset


@pytest.mark.parametrize("never_expire", [False, True])
def test_random_operations_match_reference(never_expire):
    rng = np.random.default_rng(17 + never_expire)
    cs, ls, dim = 300, 2, 3
    hec = HistoricalEmbeddingCache(capacity=cs, dim=dim, life_span=ls, never_expire=never_expire)
    ref = ReferenceHEC(cs, ls, never_expire)
    universe = np.concatenate([np.arange(1500), 2**45 + rng.choice(10**12, 500, replace=False)])
    ref_hits = ref_lookups = ref_age_sum = ref_age_max = 0
    for op in range(400):
        kind = rng.random()
        if kind < 0.5:
            n = int(rng.integers(0, 250)) if op % 50 else 420          # sometimes > cs
            tags = torch.from_numpy(rng.choice(universe, n, replace=True))
            rows = torch.from_numpy(rng.standard_normal((n, dim)).astype(np.float32))
            hec.store(tags, rows)
            ref.store(tags, rows)
        elif kind < 0.98:
            tags = rng.choice(universe, int(rng.integers(0, 400)), replace=True)
            hit, slots = hec.lookup(torch.from_numpy(tags))
            rhits, rrows, rages = ref.lookup(tags)
            assert hit.tolist() == rhits
            assert torch.equal(slots[~hit], torch.full(((~hit).sum().item(),), -1))
            got = hec.load(slots[hit])
            if rrows:
                assert torch.equal(bits(got), bits(torch.stack(rrows)))
            ref_hits += sum(rhits)
            ref_lookups += len(tags)
            ref_age_sum += sum(rages)
            ref_age_max = max([ref_age_max] + rages)
        else:
            hec.clear()
            ref.clear()
        assert hec.occupancy == len(ref.dir) <= cs
        assert hec.clock == ref.clock
        if op % 20 == 0:
            assert hec.resident()[0].tolist() == ref.resident_tags()
            live = sum(1 for line in ref.slots if line is not None
                       and (never_expire or ref.clock - line[1] <= ls))
            assert hec.stats()["live"] == live
    s = hec.stats()
    assert ref_hits > 100 and ref_lookups - ref_hits > 100             # both outcomes exercised
    assert (s["hits"], s["lookups"], s["age_sum"], s["age_max"]) == (ref_hits, ref_lookups,
                                                                       ref_age_sum, ref_age_max)


def test_lookup_parallel_path_and_thread_independence():
    hec = HistoricalEmbeddingCache(capacity=50_000, dim=2, life_span=1)
    tags = torch.randperm(200_000)[:50_000] * 7919
    hec.store(tags, torch.randn(50_000, 2))
    probe = torch.cat([tags[::2], tags[1::2] + 1])
    before = native_cache.max_threads()
    try:
        native_cache.set_threads(1)
        h1, s1 = hec.lookup(probe)
        native_cache.set_threads(2)
        h2, s2 = hec.lookup(probe)
    finally:
        native_cache.set_threads(before)
    assert torch.equal(h1, h2) and torch.equal(s1, s2)
    assert h1[:25_000].all() and not h1[25_000:].any()
    assert hec.stats()["hits"] == 50_000


def test_dtype_conversion_and_errors():
    hec = HistoricalEmbeddingCache(capacity=4, dim=2, life_span=1, dtype=torch.bfloat16)
    rows = torch.tensor([[1.5, -2.25]], dtype=torch.float32)
    hec.store([3], rows)
    assert hec.fetch([3])[1].dtype == torch.bfloat16
    assert hec.fetch([3])[1].float().tolist() == [[1.5, -2.25]]
    with pytest.raises(ValueError, match="tags must be >= 0"):
        hec.store([-1], rows)
    with pytest.raises(ValueError, match="tags must be >= 0"):
        hec.lookup([-5])
    with pytest.raises(ValueError, match="rows must be"):
        hec.store([1, 2], rows)
    assert hec.stats()["lookups"] == 2 and hec.clock == 1        # failed calls change nothing
    for bad in (dict(capacity=0, dim=2, life_span=1), dict(capacity=2, dim=0, life_span=1),
                dict(capacity=2, dim=2, life_span=-1)):
        with pytest.raises(InputError):
            HistoricalEmbeddingCache(**bad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_with_host_directory():
    hec = HistoricalEmbeddingCache(capacity=16, dim=4, life_span=1, device="cuda")
    rows = random_rows(5, 4, 3).cuda()
    tags = torch.tensor([4, 8, 15, 16, 23], device="cuda")
    hec.store(tags, rows)
    hit, slots = hec.lookup(tags)
    assert hit.device.type == "cpu" and hit.all()
    got = hec.load(slots)
    assert got.device.type == "cuda" and torch.equal(bits(got.cpu()), bits(rows.cpu()))


def test_row_bound_gives_the_same_cache_as_an_unbounded_one():
    """max_rows = the number of distinct tags: same hits, same rows, same statistics as a cache
    with a row for every ring slot, over random re-stores, evictions and expiries; the rows
    allocated never exceed the bound and grow from a small start."""
    universe = 40
    rng = np.random.default_rng(5)
    ref = HistoricalEmbeddingCache(capacity=5000, dim=3, life_span=3, max_rows=None)
    lean = HistoricalEmbeddingCache(capacity=5000, dim=3, life_span=3, max_rows=universe)
    small_ring = [HistoricalEmbeddingCache(capacity=16, dim=3, life_span=3, max_rows=m) for m in (None, 16)]
    assert ref.rows_allocated == 1024 and lean.rows_allocated == universe
    for step in range(300):
        tags = rng.integers(0, universe, size=int(rng.integers(0, 12)))
        rows = torch.from_numpy(rng.standard_normal((tags.size, 3)).astype(np.float32))
        for c in (ref, lean, *small_ring):
            c.store(tags, rows)
        query = rng.integers(0, universe, size=20)
        (h1, r1), (h2, r2) = ref.fetch(query), lean.fetch(query)
        assert torch.equal(h1, h2) and torch.equal(bits(r1), bits(r2))
        (h3, r3), (h4, r4) = small_ring[0].fetch(query), small_ring[1].fetch(query)
        assert torch.equal(h3, h4) and torch.equal(bits(r3), bits(r4))
        assert lean.rows_allocated == universe and small_ring[1].rows_allocated <= 16
        if step % 97 == 96:
            for c in (ref, lean, *small_ring):
                c.clear()
    s1, s2 = ref.stats(), lean.stats()
    for key in ("lookups", "hits", "evictions", "replaced", "lines_stored", "age_sum", "age_hist"):
        assert s1[key] == s2[key], key
    assert s2["rows_used"] <= universe and s2["max_rows"] == universe


def test_rows_grow_lazily_by_doubling_up_to_the_bound():
    hec = HistoricalEmbeddingCache(capacity=1_000_000, dim=2, life_span=5, max_rows=5000)
    assert hec.rows_allocated == 1024 and hec.max_rows == 5000
    hec.store(np.arange(1000), torch.zeros(1000, 2))
    assert hec.rows_allocated == 1024
    hec.store(np.arange(1000, 1100), torch.ones(100, 2))
    assert hec.rows_allocated == 2048
    hec.store(np.arange(1100, 5000), torch.full((3900, 2), 2.0))
    assert hec.rows_allocated == 5000
    hit, rows = hec.fetch([0, 1050, 4999])
    assert hit.all() and rows[:, 0].tolist() == [0.0, 1.0, 2.0]


def test_more_distinct_tags_than_the_row_bound_is_refused():
    hec = HistoricalEmbeddingCache(capacity=100, dim=1, life_span=1, max_rows=4)
    hec.store([1, 2, 3], torch.zeros(3, 1))
    hec.store([3, 2], torch.zeros(2, 1))              # re-stores need no new row
    with pytest.raises(ValueError, match="max_rows = 4"):
        hec.store([7, 8], torch.zeros(2, 1))
    with pytest.raises(InputError, match="max_rows"):
        HistoricalEmbeddingCache(capacity=10, dim=1, life_span=1, max_rows=0)
