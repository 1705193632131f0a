"""Test driver (run under ``mpiexec -n 4``): the cached, pipelined halo (S = 2) of the real
full-graph runner, with and without injected delays, checked against a reference built from the
rows sent and the rows cached.

    python cached_delay_driver.py STORE OUT.json EPOCHS HIDDEN LAYERS

Delays are injected from here only (no hook in the library): inside each rank's process the
driver wraps :class:`hpcgnn.comm.alltoall.PendingCappedExchange` (the point-to-point messages
of :class:`~hpcgnn.comm.halo_cached.CachedHalo`) so that, depending on the rank, the epoch and
the call, posting a message (the sends and receives), driving its progress (``test``) and
completing its receives (``wait``) sleep first, and ``test`` sometimes returns "not done"
without driving progress at all. Every call of
:meth:`~hpcgnn.cache.halo.ReceiverCache.assemble` is checked against an independent reference:
the halo block is the rows received at their positions and, for every other row, the last value
received for it (which must be a cached row), with the ages that follow from the epochs the
rows were sent. Writes, from rank 0, per run: the losses, a digest of every halo block in call
order, the per-layer figures, the number of waits that blocked and the seconds slept.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from hpcgnn.cache.halo import NEVER, TIER_NONE, ReceiverCache
from hpcgnn.comm import alltoall
from hpcgnn.comm.halo_cached import CacheSettings, CachedHalo
from hpcgnn.nn.optim import Adam
from hpcgnn.run.timer import PhaseTimer
from hpcgnn.engine.fullgraph import InMemoryFullGraph, build_local_graph, halo_layers
from hpcgnn.nn.models import build_model
from hpcgnn.partition.store import load_partition, read_meta

STALENESS = 2


class Injector:
    """The delay schedule and what it did; ``active`` False: no delays (the reference run)."""

    def __init__(self, rank: int):
        self.rank, self.active, self.epoch, self.calls = rank, False, 0, 0
        self.slept, self.blocked, self.skipped = 0.0, 0, 0

    def pause(self, where: int) -> None:
        """Sleep 0-40 ms, by rank, epoch, call and place (0 post, 1 test, 2 wait)."""
        if not self.active:
            return
        self.calls += 1
        k = (7 * self.rank + 5 * self.epoch + 3 * self.calls + where) % 9
        if k < 4:
            s = 0.01 * k
            time.sleep(s)
            self.slept += s

    def skip_progress(self) -> bool:
        """Whether this ``test`` call returns 'not done' without driving MPI (a rank that is
        busy elsewhere): every other epoch on odd ranks, on even ranks when epoch % 3 == 0."""
        if not self.active:
            return False
        skip = (self.epoch % 2 == 0) if self.rank % 2 else (self.epoch % 3 == 0)
        self.skipped += int(skip)
        return skip


def install(inj: Injector) -> None:
    """Wrap PendingCappedExchange's constructor, test and wait in this process."""
    cls = alltoall.PendingCappedExchange
    init, test, wait = cls.__init__, cls.test, cls.wait

    def init_(self, *args, **kwargs):
        inj.pause(0)
        init(self, *args, **kwargs)

    def test_(self):
        inj.pause(1)
        if inj.skip_progress():
            return False
        return test(self)

    def wait_(self):
        inj.pause(2)
        t0 = time.perf_counter()
        out = wait(self)
        inj.blocked += int(time.perf_counter() - t0 > 0.005)
        return out

    cls.__init__, cls.test, cls.wait = init_, test_, wait_


class Reference:
    """The halo blocks a receiver must assemble, from (rows received) U (rows cached)."""

    def __init__(self):
        self.vals, self.written, self.digests, self.checked = {}, {}, [], 0

    def check(self, cache: ReceiverCache, layer, epoch_used, epoch_sent, positions, rows, staleness,
              constant, result) -> None:
        block, ages = result[0], result[1]
        key = (id(cache), layer)
        if key not in self.vals:
            self.vals[key] = np.full((cache.num_halo, cache.widths[layer]), np.nan, np.float32)
            self.written[key] = np.full(cache.num_halo, NEVER, np.int64)
        vals, written = self.vals[key], self.written[key]
        positions = np.asarray(positions, np.int64)
        got = np.zeros(cache.num_halo, bool)
        got[positions] = True
        miss = ~got
        assert (cache.tier[miss] != TIER_NONE).all(), "a row neither received nor cached was used"
        assert (written[miss] != NEVER).all(), "a cached row used before it was ever received"
        ref = vals.copy()
        ref[positions] = rows
        ref_age = np.where(got, epoch_used - epoch_sent, epoch_used - written)
        if constant:
            ref_age[:] = 0
        assert np.array_equal(block, ref), f"layer {layer} epoch {epoch_used}: block != sent U cached"
        assert np.array_equal(ages, ref_age), f"layer {layer} epoch {epoch_used}: ages differ"
        if staleness is not None:
            assert ages.size == 0 or ages.max() <= staleness
        cached = cache.tier[positions] != TIER_NONE      # received rows of cached vertices are kept
        vals[positions[cached]] = np.asarray(rows)[cached]
        written[positions[cached]] = epoch_sent
        self.digests.append(hashlib.sha256(block.tobytes() + ages.tobytes()).hexdigest()[:16])
        self.checked += int(block.shape[0])


def main() -> int:
    store, out, epochs, hidden, layers = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    meta = read_meta(store)
    part = load_partition(store, rank, meta)
    widths = [w for _, w in halo_layers(build_model("gcn", meta.num_features, hidden, meta.num_classes, layers))]
    row_bytes = 4 * sum(widths)
    inj = Injector(rank)
    install(inj)
    ref = Reference()
    assemble = ReceiverCache.assemble

    def assemble_(self, layer, epoch_used, epoch_sent, positions, rows, staleness, constant=False):
        result = assemble(self, layer, epoch_used, epoch_sent, positions, rows, staleness, constant)
        ref.check(self, layer, epoch_used, epoch_sent, positions, rows, staleness, constant, result)
        return result

    ReceiverCache.assemble = assemble_
    report = {}
    for name, delayed, precision in (("plain", False, "fp32"), ("delayed", True, "fp32"),
                                     ("plain-bf16", False, "bf16"), ("delayed-bf16", True, "bf16")):
        inj.active, inj.slept, inj.blocked, inj.skipped, inj.calls = delayed, 0.0, 0, 0, 0
        ref.digests, ref.checked = [], 0
        from hpcgnn.comm.communicator_mpi import MpiCommunicator

        plane = MpiCommunicator(comm)     # the data plane (halo exchanges)
        lg = build_local_graph(part, plane, fetch_halo=False)
        n_train = float(comm.allreduce(int(lg.masks["train"].sum())))
        model = build_model("gcn", meta.num_features, hidden, meta.num_classes, layers, dropout=0.0, seed=5)
        opt = Adam(model.parameters(), lr=0.02)
        # about 60 % of the halo rows fit (a few on the device tier): cached and uncached rows
        settings = CacheSettings(cache=True, staleness=STALENESS, pipeline=True,
                                 budget_bytes=int(0.6 * part.num_halo) * row_bytes,
                                 device_bytes=3 * row_bytes, precision=precision)
        runner = InMemoryFullGraph(model, lg, plane, "cpu", halo=CachedHalo(plane, lg.halo, settings, widths))
        losses, per_layer = [], []
        for t in range(1, epochs + 1):
            inj.epoch = t
            runner.reset_stats()
            runner.begin_epoch(t)
            opt.zero_grad(set_to_none=True)
            loss = comm.allreduce(runner.train_step(PhaseTimer(), n_train)) / n_train
            for p in model.parameters():
                comm.Allreduce(MPI.IN_PLACE, p.grad.numpy())
            opt.step()
            losses.append(loss)
            if t == 3:
                model.eval()
                runner.predict()
                model.train()
            per_layer.append({k: v.tolist() for k, v in runner.per_layer().items()})
        runner.close()
        report[name] = {"loss": losses, "digests": comm.gather(ref.digests, root=0),
                        "per_layer": comm.gather(per_layer, root=0),
                        "checked_rows": comm.gather(ref.checked, root=0),
                        "blocked": comm.gather(inj.blocked, root=0), "slept": comm.gather(inj.slept, root=0),
                        "skipped": comm.gather(inj.skipped, root=0)}
    report["num_halo"] = comm.gather(part.num_halo, root=0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
