"""The one host <-> device staging component (hpcgnn.store.mover) with the CPU as the device:
byte counts by kind, the copy semantics every engine relies on, and the staging pool's reuse
(buffers come back only once their copy's event has completed)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcgnn.engine.transfer import TransferCounter
from hpcgnn.store.mover import DeviceMover, StagingPool


class FakeEvent:
    """A copy's completion event: done once ``finished`` is set."""

    def __init__(self):
        self.finished = False
        self.waited = 0

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.waited += 1
        self.finished = True


def test_pool_reuses_a_buffer_only_after_its_copy_completed():
    pool = StagingPool(pin=False)
    a = pool.take(100, torch.float32)
    assert a.numel() == 128 and pool.allocated == 1           # power-of-two size classes
    ev = FakeEvent()
    pool.give(a, ev)
    b = pool.take(120, torch.float32)                          # a's copy still in flight
    assert b.data_ptr() != a.data_ptr() and pool.allocated == 2
    ev.finished = True
    c = pool.take(70, torch.float32)                           # same class, a is free again
    assert c.data_ptr() == a.data_ptr() and pool.allocated == 2
    d = pool.take(70, torch.float64)                           # another dtype: its own list
    assert d.dtype == torch.float64 and pool.allocated == 3
    ev2 = FakeEvent()
    pool.give(b, ev2)
    pool.wait_all()
    assert ev2.waited == 1 and pool.take(128, torch.float32).data_ptr() == b.data_ptr()
    assert pool.allocated == 3                                  # steady state: no new buffers


def test_cpu_mover_copies_and_counts_by_kind():
    counter = TransferCounter()
    m = DeviceMover("cpu", counter)
    host = torch.arange(40, dtype=torch.float32).view(10, 4)
    rows = np.array([7, 2, 2, 9])
    got = m.load_rows(host, rows, "rows").get()
    assert torch.equal(got, host[torch.from_numpy(rows)])
    rng = m.load_range(host, 3, 6, "grad").get()
    assert torch.equal(rng, host[3:6]) and rng.data_ptr() != host[3:6].data_ptr()   # a copy
    out = torch.zeros(10, 4)
    m.store_range(torch.ones(2, 4), out, 5, "out")
    m.add_rows(torch.full((2, 4), 2.0), out, np.array([5, 0]), "grad")
    m.store_rows(torch.full((1, 4), 7.0), out, np.array([9]), "grad")
    m.synchronize()
    want = torch.zeros(10, 4)
    want[5:7] = 1.0
    want[5] += 2.0
    want[0] += 2.0
    want[9] = 7.0
    assert torch.equal(out, want)
    row = 4 * 4
    assert counter.h2d == {"rows": 4 * row, "grad": 3 * row}
    assert counter.d2h == {"out": 2 * row, "grad": 3 * row}
    # the stores' interface: fill a host view; receive returns it (the identity on the CPU)
    moved = m.move(lambda t: t.copy_(host[:3]), 3, 4, torch.float32)
    assert torch.equal(m.receive(moved), host[:3]) and m.receive(None) is None


def _add_range_matches_add_rows(device):
    m = DeviceMover(device, TransferCounter())
    g = torch.Generator().manual_seed(0)
    host = torch.randn(50, generator=g)
    parts = [(0, torch.randn(7, generator=g)), (30, torch.randn(20, generator=g)), (3, torch.randn(5, generator=g))]
    by_range, by_rows = host.clone(), host.clone()
    if device != "cpu":
        by_range, by_rows = by_range.pin_memory(), by_rows.pin_memory()
    for begin, dev in parts:            # overlapping ranges: accumulated in issue order
        m.add_range(dev.to(device), by_range, begin, "edge_grad")
        m.add_rows(dev.to(device), by_rows, np.arange(begin, begin + dev.shape[0]), "edge_grad")
    m.synchronize()
    assert torch.equal(by_range, by_rows)
    assert m.counter.d2h == {"edge_grad": 2 * 32 * 4}


def test_add_range_is_add_rows_on_a_contiguous_range():
    _add_range_matches_add_rows("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_add_range_is_add_rows_on_a_contiguous_range():
    _add_range_matches_add_rows("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_mover_round_trip_reuses_staging():
    dev = torch.device("cuda")
    m = DeviceMover(dev, TransferCounter())
    host = torch.randn(1000, 8)
    for _ in range(3):
        got = m.load_rows(host, np.arange(0, 1000, 3), "rows").get()
        assert torch.equal(got.cpu(), host[::3])
        acc = torch.zeros(1000, 8).pin_memory()
        m.add_rows(got, acc, np.arange(0, 1000, 3), "grad")
        m.synchronize()
        assert torch.equal(acc[::3], host[::3])
    assert m.pool.allocated <= 3


class FakeFlush:
    """A gradient flush in flight; ``finish`` records its order."""

    def __init__(self, name, done):
        self.name, self.done = name, done

    def finish(self, pool):
        self.done.append(self.name)


def test_settle_finishes_only_the_flushes_before_its_mark():
    m = DeviceMover("cpu")
    done = []
    m._flushes += [FakeFlush("a", done), FakeFlush("b", done)]
    first = m.mark()
    m._flushes.append(FakeFlush("c", done))
    second = m.mark()
    m.settle(first)
    assert done == ["a", "b"]
    m.settle(first)                                   # settled already: nothing more
    assert done == ["a", "b"]
    m._flushes.append(FakeFlush("d", done))
    m.drain()                                         # c and d
    assert done == ["a", "b", "c", "d"]
    m.settle(second)                                  # drained since: nothing more
    m._flushes.append(FakeFlush("e", done))
    third = m.mark()
    m._flushes.append(FakeFlush("f", done))
    m.settle(third)
    assert done == ["a", "b", "c", "d", "e"] and len(m._flushes) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_settle_completes_the_copies_before_its_mark():
    dev = torch.device("cuda")
    m = DeviceMover(dev)
    src = torch.randn(4096, 64, device=dev)
    out = torch.zeros(4096, 64).pin_memory()
    acc = torch.zeros(4096, 64).pin_memory()
    m.store_range(src[:2048] * 2, out, 0, "out")
    m.add_rows(src[:100], acc, np.arange(100), "grad")
    mark = m.mark()
    m.store_range(src[2048:] * 2, out, 2048, "out")
    m.settle(mark)
    assert torch.equal(out[:2048], (src[:2048] * 2).cpu()) and torch.equal(acc[:100], src[:100].cpu())
    m.synchronize()
    assert torch.equal(out, (src * 2).cpu())
