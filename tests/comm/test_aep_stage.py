"""Staged AEP pushes: a push whose rows' copy has not run yet starts its exchange later, in
posting order, and delivers exactly what an unstaged push does.

:class:`~hpcgnn.comm.aep.AsyncEmbeddingPush` takes a ``copy_event`` factory; a push with an
event is staged until it completes. In one process (a recording channel, stand-in events the
test completes): push starts nothing; ``progress()`` starts the leading staged pushes whose events
completed and stops at the first that has not; ``receive`` forces every staged push up to the one
it consumes (``synchronize``); staged pushes count as outstanding; the starts, their arguments
and the debug records are those of the unstaged run, in the same order. On 2 MPI ranks (this
file is also the driver: ``python test_aep_stage.py STORE OUT DELAY``): the schedule of
tests/comm/test_aep_wire.py with events that complete at random, rank-dependent moments and an
allreduce on the data plane after every iteration (the gradient allreduce's place) receives bit
for bit what the unstaged run receives: on mpi4py with pushes deferred, on gloo (collectives
of the group the allreduce shares, which must start in one order) with each push waiting for
its copy. On a CUDA GPU (skipped
without one): a push from a busy device returns without waiting for it, staged, into page-locked
rows, and delivers the CPU path's rows.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
L = 3


class StandInEvent:
    """A copy's event that is complete once the test (``done = True``), a query (``chance``, from
    ``rng``) or ``synchronize()`` says so; counts how it completed in ``log``."""

    def __init__(self, log: dict, rng=None, chance: float = 0.0):
        self.done, self.log, self.rng, self.chance = False, log, rng, chance
        self.synchronized = False

    def query(self) -> bool:
        if not self.done and self.rng is not None and self.rng.random() < self.chance:
            self.done = True
            self.log["by_query"] += 1
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log["forced"] += 1
        self.done = self.synchronized = True


# ---- one process: a recording channel ----------------------------------------------------

class _Started:
    def __init__(self, ids, rows):
        self.result = ((ids, rows), torch.zeros(ids.shape[0], dtype=torch.int32))

    def test(self) -> bool:
        return True

    def wait(self):
        return self.result


class _Channel:
    """Records every start (tag, IDs, rows, counts, as passed); each exchange 'receives' the
    rows it sent."""

    independent = True              # as mpi4py's: pushes may be staged

    def __init__(self):
        self.starts = []

    def start(self, arrays, send_counts, tag, recv_buffers=None):
        ids, rows = (a.clone() for a in arrays)
        self.starts.append((tag, ids.numpy(), rows.numpy(), np.asarray(send_counts).copy()))
        return _Started(ids, rows)

    def close(self):
        pass


def _plane(rank: int, size: int):
    from hpcgnn.comm.communicator import Communicator

    class Plane(Communicator):
        name = "recording"

        def open_capped(self, recv_caps):
            return _Channel()

        def _unused(self, *args, **kwargs):
            raise AssertionError("the AEP exchanges through its channel only")

        exchange_counts = start_alltoallv = start_allreduce_ = allgatherv = broadcast_ = duplicate = _unused

    return Plane(rank, size)


def _aep(tmp_path, copy_event=None, delay=1):
    sys.path.insert(0, str(HERE.parent / "engine"))
    import mb_support as mb

    from hpcgnn.comm.aep import AsyncEmbeddingPush
    from hpcgnn.partition.store import load_partition

    store = tmp_path / "s"
    if not store.exists():
        mb.tiny_store(store, mb.tiny_graph(num_nodes=400, window=60), 4)
    part = load_partition(store, 1)
    kw = {} if copy_event is None else {"copy_event": copy_event}
    return AsyncEmbeddingPush(_plane(part.part_id, part.num_parts), part, num_layers=L, nc=5, delay=delay,
                              max_degree=int(part.degree.max()), record=True, **kw), part


def _inputs(part, k: int, layer: int):
    """(frontier, h, rng key) of push (k, layer): solid and halo vertices; none at (1, 1)."""
    rng = np.random.default_rng([k, layer])
    n_local = part.num_solid + part.num_halo
    f = np.zeros(0, np.int64) if (k, layer) == (1, 1) else rng.permutation(n_local)[:60]
    h = torch.from_numpy(rng.standard_normal((f.shape[0], 4 + layer)).astype(np.float32))
    return f, h, int(rng.integers(1 << 62))


def _starts_equal(a, b) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and all(np.array_equal(u, v) for u, v in zip(x[1:], y[1:]))
                                    for x, y in zip(a, b))


def _records(aep):
    return [(p.epoch, p.iteration, p.layer, p.ids, p.dest, p.rows.view(np.uint32)) for p in aep.pushes], \
           [(p.epoch, p.iteration, p.layer, p.ids, p.dest, p.rows.view(np.uint32)) for p in aep.receives]


def _same_records(a, b) -> bool:
    return all(len(x) == len(y) and all(u[:3] == v[:3] and all(np.array_equal(s, t) for s, t in zip(u[3:], v[3:]))
                                        for u, v in zip(x, y)) for x, y in zip(a, b))


def _stand_ins():
    """(events made so far, a ``copy_event`` factory of StandInEvents the test completes)."""
    log, events = {"by_query": 0, "forced": 0}, []

    def stand_in(device):
        events.append(StandInEvent(log))
        return events[-1]

    return events, stand_in


def _push(aep, part, k, layer):
    f, h, key = _inputs(part, k, layer)
    aep.push(layer, k, f, h, key)


def test_staged_pushes_start_in_posting_order(tmp_path):
    events, stand_in = _stand_ins()
    aep, part = _aep(tmp_path, stand_in)
    ch = aep.channel
    for layer in range(L):                          # iteration 0: three staged pushes
        _push(aep, part, 0, layer)
    assert ch.starts == [] and aep.pushes == []     # push starts nothing (records come with starts)
    assert aep.staged() == aep.outstanding() == 3 and len(events) == 3
    aep.progress()
    assert ch.starts == []                          # nothing complete: nothing started
    events[1].done = True
    aep.progress()
    assert ch.starts == []                          # the first is not complete: it holds the rest
    events[0].done = True
    aep.progress()
    assert [s[0] for s in ch.starts] == [0, 2] and aep.staged() == 1 and len(aep.pushes) == 2
    for layer in (0, 1):                            # iteration 1: layer 1's frontier is empty (no event)
        _push(aep, part, 1, layer)
    assert len(events) == 4 and aep.staged() == 3   # the empty push waits behind the staged ones
    with pytest.raises(RuntimeError, match="staged"):
        aep.assert_drained()
    aep.receive(0, 1)                               # started already: forces nothing
    assert len(ch.starts) == 2 and not any(e.synchronized for e in events)
    aep.receive(2, 1)                               # forces iteration 0's layer 2, not iteration 1's
    assert [s[0] for s in ch.starts] == [0, 2, 4] and events[2].synchronized and not events[3].synchronized
    aep.receive(1, 1)
    _push(aep, part, 1, 2)                          # behind iteration 1's layer 0: staged
    assert aep.staged() == 3 and len(ch.starts) == 3
    aep.receive(1, 2)                               # iteration 1's layer 1 (empty): forces layer 0 first
    assert [s[0] for s in ch.starts] == [0, 2, 4, 0, 2] and events[3].synchronized and aep.staged() == 1
    events[4].done = True
    aep.progress()
    assert aep.staged() == 0 and len(ch.starts) == 6
    for layer in (0, 2):
        aep.receive(layer, 2)
    aep.assert_drained()

    ref, _ = _aep(tmp_path)                         # the same pushes, unstaged (the CPU default)
    for k, layer in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]:
        _push(ref, part, k, layer)
        assert ref.staged() == 0
    assert _starts_equal(ch.starts, ref.channel.starts)
    assert _same_records((_records(aep)[0], []), (_records(ref)[0], []))
    sent = lambda a: {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(a.counters).items()
                      if not k.endswith("seconds") and "received" not in k}     # ref received nothing
    assert sent(aep) == sent(ref) and sum(aep.counters.rows_received) == sum(aep.counters.rows_sent) > 0


def test_close_drops_staged_pushes(tmp_path):
    events, stand_in = _stand_ins()
    aep, part = _aep(tmp_path, stand_in)
    _push(aep, part, 0, 0)
    _push(aep, part, 0, 1)
    events[0].done = True
    aep.progress()
    assert aep.staged() == 1 and aep.outstanding() == 2
    aep.close()                                     # the staged one never reaches the wire
    assert aep.staged() == 0 and aep.outstanding() == 1 and events[1].synchronized
    assert len(aep.pushes) == 1


# ---- 2 MPI ranks ---------------------------------------------------------------------------

def driver(store: str, out: str, delay: int) -> None:
    """One rank: the wire test's schedule, unstaged and staged (events complete at random,
    rank-dependent moments), each followed per iteration by an allreduce on the plane; on
    mpi4py and on gloo. Pickles the records and the staging statistics."""
    from mpi4py import MPI

    sys.path.insert(0, str(HERE))
    from planes import close_planes, data_plane
    from test_aep_wire import run_schedule

    rank = MPI.COMM_WORLD.Get_rank()
    recs = {}
    for backend in ("mpi4py", "gloo"):
        plane = data_plane(backend)
        for staged in (False, True):
            log = {"by_query": 0, "forced": 0, "most_staged": 0, "allreduce_ok": True}
            rng = np.random.default_rng([11, rank])

            def after_step(aep):
                log["most_staged"] = max(log["most_staged"], aep.staged())
                buf = torch.ones(3)         # another collective on the plane, as the gradients'
                plane.allreduce_(buf)
                log["allreduce_ok"] &= bool(torch.equal(buf, torch.full((3,), float(plane.size))))

            made = []

            def event(device):          # every 4th completes only when waited for (a receive)
                made.append(StandInEvent(log, rng, 0.0 if len(made) % 4 == 3 else 0.2 + 0.3 * rank))
                return made[-1]

            rec = run_schedule(store, plane, delay, copy_event=event if staged else None, after_step=after_step)
            recs[(backend, staged)] = {"pushes": rec["pushes"], "receives": rec["receives"], "end": rec["end"],
                                       "log": log}
    close_planes()
    with open(Path(out) / f"rank-{rank}.pkl", "wb") as fh:
        pickle.dump(recs, fh)


@pytest.mark.parametrize("delay", [1, 2])
def test_staged_receives_equal_unstaged_on_two_ranks(tmp_path, delay):
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from mpiutil import run_mpi
    from toygraph import toy_graph, toy_store

    store = toy_store(tmp_path / "store", toy_graph(num_nodes=240, avg_degree=5.0, seed=3), 2)
    proc = run_mpi(2, [__file__, store, tmp_path, delay], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        with open(tmp_path / f"rank-{r}.pkl", "rb") as fh:
            recs = pickle.load(fh)
        for backend in ("mpi4py", "gloo"):
            plain, staged = recs[(backend, False)], recs[(backend, True)]
            log = staged["log"]
            assert plain["log"]["allreduce_ok"] and log["allreduce_ok"]
            assert plain["log"]["most_staged"] == 0
            if backend == "mpi4py":     # deferred, started by progress and by receive
                assert log["most_staged"] >= 2 and log["by_query"] > 0 and log["forced"] > 0, log
            else:                       # collectives of a shared group: started at the push
                assert log["most_staged"] == 0 and log["forced"] > 0, log
            for what in ("pushes", "receives"):                         # records in start order
                a, b = plain[what], staged[what]
                assert len(a) == len(b) > 0
                for x, y in zip(a, b):
                    assert (x["epoch"], x["iteration"], x["layer"]) == (y["epoch"], y["iteration"], y["layer"])
                    assert np.array_equal(x["ids"], y["ids"]) and np.array_equal(x["dest"], y["dest"])
                    assert np.array_equal(x["rows"].view(np.uint32), y["rows"].view(np.uint32))
            for x, y in zip(plain["end"], staged["end"]):
                assert y["outstanding"] == 0 and not y["probe"] and x["buffer_sets"] == y["buffer_sets"]
                assert {k: v for k, v in x["counters"].items() if not k.endswith("seconds")} == \
                    {k: v for k, v in y["counters"].items() if not k.endswith("seconds")}


# ---- CUDA --------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_push_does_not_wait_for_the_device(tmp_path, dtype):
    from hpcgnn.comm.aep import device_event

    aep, part = _aep(tmp_path)
    ref, _ = _aep(tmp_path)
    dev = torch.device("cuda")
    warm, _ = _aep(tmp_path)            # the first launch of a kernel loads it (CUDA's lazy
    for layer in range(L):              # loading), which can wait for the device: load them all
        f, h, key = _inputs(part, 0, layer)
        warm.push(layer, 0, f, h.to(dtype).to(dev), key)
        torch.cuda.synchronize()
        warm.progress()
    for k in range(2):
        for layer in range(L):
            f, h, key = _inputs(part, k, layer)
            h = h.to(dtype)
            hd = h.to(dev)
            torch.cuda.synchronize()
            if k >= 1:                              # the engine's order: receive, then push
                aep.receive(layer, k)
                ref.receive(layer, k)
            torch.cuda._sleep(1_000_000_000)        # keep the device busy well past the push
            torch.cuda.set_sync_debug_mode("error")
            try:
                aep.push(layer, k, f, hd, key)      # raises on any synchronising call
            finally:
                torch.cuda.set_sync_debug_mode("default")
            p = aep._queues[layer][-1]
            if f.size:
                assert isinstance(p.event, torch.cuda.Event) and p.buffers.pinned and p.buffers.rows.is_pinned()
                assert p.exchange is None and aep.staged() >= 1      # the device is still asleep
            ref.push(layer, k, f, h, key)
    aep.progress()
    torch.cuda.synchronize()
    aep.progress()
    assert aep.staged() == 0
    assert _starts_equal(aep.channel.starts, ref.channel.starts)
    assert _same_records(_records(aep), _records(ref))
    assert device_event(torch.device("cpu")) is None


if __name__ == "__main__":
    driver(sys.argv[1], sys.argv[2], int(sys.argv[3]))
