"""The AEP's wire format on real MPI ranks (mpiexec -n 2 and 4): what arrives is what was selected.

:class:`~hpcgnn.comm.aep.AsyncEmbeddingPush` posts its pushes point-to-point with no count
exchange (counts travel as the messages' lengths) from send and receive buffers it reuses across
iterations. This file is both the test (pytest) and the MPI driver (``python test_aep_wire.py
STORE OUT DELAY``): each rank runs two epochs of the engine's schedule (receive at ``k >= d``, push
at ``k < M - d``, every layer) on random frontiers of a toy partition (some empty, some without
solid vertices), with layer widths 5, 7, 3 and one float64 layer input, and records every push's
frontier, layer input and selection, every receive, and what is in flight at each epoch's end.
The test checks: each receive equals, source by source in rank order, what the senders selected
for this rank ``d`` iterations earlier (IDs and row bits, counts from the message lengths); every
selection is the frontier's solid vertices that are halo on the destination, capped at ``nc``
(all of them when there are no more); rows are the layer input's rows; every push is received
exactly once; nothing is outstanding or probe-able at an epoch's end; the buffers are reused
(``d`` sets per layer). The driver runs the schedule on the mpi4py data plane (point-to-point)
and again on gloo (async collectives padded to the caps): both must deliver the same rows and
count the same bytes.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
L, NC, WIDTHS, EPOCH_ITERS = 3, 6, (5, 7, 3), (6, 4)


def driver(store: str, out: str, delay: int) -> None:
    """One rank of the MPI job: the engine's AEP schedule on random frontiers, on each data plane;
    pickles a record per plane."""
    from mpi4py import MPI

    sys.path.insert(0, str(HERE))
    from planes import close_planes, data_plane

    recs = {backend: run_schedule(store, data_plane(backend), delay) for backend in ("mpi4py", "gloo")}
    close_planes()
    with open(Path(out) / f"rank-{MPI.COMM_WORLD.Get_rank()}.pkl", "wb") as fh:
        pickle.dump(recs, fh)


def run_schedule(store: str, plane, delay: int, copy_event=None, after_step=None) -> dict:
    """The engine's AEP schedule over ``plane`` (a Communicator); the record of this rank.
    ``copy_event``: the AEP's (its default when None); ``after_step(aep)``: called after each
    iteration's ``progress()`` (tests/comm/test_aep_stage.py)."""
    import torch
    from mpi4py import MPI

    from hpcgnn.comm.aep import AsyncEmbeddingPush
    from hpcgnn.partition.store import load_partition

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    part = load_partition(store, rank)
    aep = AsyncEmbeddingPush(plane, part, num_layers=L, nc=NC, delay=delay,
                             max_degree=int(comm.allreduce(int(part.degree.max()), op=MPI.MAX)), record=True,
                             **({} if copy_event is None else {"copy_event": copy_event}))
    n_local = part.num_solid + part.num_halo
    rec = {"rank": rank, "epochs": [], "inputs": {}, "end": []}
    for epoch, m in enumerate(EPOCH_ITERS):
        aep.reset_counters(epoch)
        for k in range(m):
            for layer in range(L):
                if k >= delay:
                    aep.receive(layer, k)
                if k < m - delay:
                    rng = np.random.default_rng([7, rank, epoch, k, layer])
                    kind = (epoch + k + layer + rank) % 5
                    if kind == 0:                      # empty frontier
                        f = np.zeros(0, np.int64)
                    elif kind == 1:                    # halo vertices only: nothing to push
                        f = part.num_solid + rng.permutation(part.num_halo)[:10]
                    else:
                        f = rng.permutation(n_local)[:int(rng.integers(5, n_local + 1))]
                    dtype = torch.float64 if layer == 2 else torch.float32
                    h = torch.from_numpy(rng.standard_normal((f.shape[0], WIDTHS[layer]))).to(dtype)
                    aep.push(layer, k, f, h, rng_key=int(rng.integers(1 << 62)))
                    rec["inputs"][(epoch, k, layer)] = (f.copy(), h.numpy().copy())
            aep.progress()
            if after_step is not None:
                after_step(aep)
        outstanding = aep.outstanding()
        aep.assert_drained()
        probe = False
        if plane.name == "mpi4py":             # the point-to-point channel: nothing left to match
            ch = aep.channel.comm
            ch.Barrier()                       # every rank's sends of this epoch are posted
            probe = ch.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
            ch.Barrier()                       # before any rank posts the next epoch's pushes
        rec["end"].append({"outstanding": outstanding, "probe": bool(probe), "buffer_sets": aep.buffer_sets(),
                           "counters": {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                                        for k, v in vars(aep.counters).items()}})
    rec["pushes"] = [vars(p) for p in aep.pushes]
    rec["receives"] = [vars(p) for p in aep.receives]
    aep.close()
    return rec


@pytest.mark.parametrize("ranks,delay", [(2, 2), (4, 1)])
def test_received_rows_are_the_selected_rows(tmp_path, ranks, delay):
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from mpiutil import run_mpi
    from toygraph import toy_graph, toy_store

    from hpcgnn.partition.store import load_partition

    store = toy_store(tmp_path / "store", toy_graph(num_nodes=240, avg_degree=5.0, seed=3), ranks)
    proc = run_mpi(ranks, [__file__, store, tmp_path, delay], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    both = []
    for r in range(ranks):
        with open(tmp_path / f"rank-{r}.pkl", "rb") as fh:
            both.append(pickle.load(fh))
    recs = [b["mpi4py"] for b in both]
    for m, g in zip(recs, (b["gloo"] for b in both)):     # gloo: the same rows, the same bytes
        for what in ("pushes", "receives"):
            assert len(m[what]) == len(g[what])
            for a, b in zip(m[what], g[what]):
                assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        counts = lambda rec: [{k: v for k, v in e["counters"].items() if not k.endswith("seconds")}
                              for e in rec["end"]]
        assert counts(m) == counts(g)
        assert [e["outstanding"] for e in g["end"]] == [0] * len(EPOCH_ITERS)
    parts = [load_partition(store, r) for r in range(ranks)]
    halo = [set(p.halo_ids.tolist()) for p in parts]

    sent = {}                                   # (src, dst, epoch, iteration, layer) -> (ids, rows)
    capped = zero = uneven = 0
    for p, rec in enumerate(recs):
        part = parts[p]
        for push in rec["pushes"]:
            e, k, layer = push["epoch"], push["iteration"], push["layer"]
            assert k < EPOCH_ITERS[e] - delay
            f, h = rec["inputs"][(e, k, layer)]
            ids, dest, rows = push["ids"], push["dest"], push["rows"]
            assert ids.dtype == np.int64 and rows.dtype == np.float32 and rows.shape == (ids.size, WIDTHS[layer])
            assert np.all(np.diff(dest) >= 0), "rows not grouped by destination"
            gids = f + part.solid_begin
            solid = f < part.num_solid
            for q in range(ranks):
                sel = dest == q
                cand = gids[solid & np.isin(gids, list(halo[q]))] if q != p else gids[:0]
                got = ids[sel]
                assert np.isin(got, cand).all() and np.unique(got).size == got.size
                if cand.size <= NC:
                    assert got.size == cand.size                        # no cap: every candidate
                else:
                    assert got.size <= NC                               # capped (may accept fewer)
                capped += cand.size > NC
                zero += q != p and got.size == 0
                order = np.argsort(gids)
                at = order[np.searchsorted(gids, got, sorter=order)]   # positions in the frontier
                assert np.all(np.diff(at) > 0), "frontier order not kept"
                assert np.array_equal(rows[sel].view(np.uint32), h[at].astype(np.float32).view(np.uint32))
                sent[(p, q, e, k, layer)] = (got, rows[sel])
            uneven += len({int((dest == q).sum()) for q in range(ranks) if q != p}) > 1
    assert capped and zero and (uneven or ranks == 2), (capped, zero, uneven)

    received = set()
    for q, rec in enumerate(recs):
        for r in rec["receives"]:
            e, k, layer = r["epoch"], r["iteration"], r["layer"]
            assert k >= delay
            src = [p for p in range(ranks) if p != q]
            want = [sent[(p, q, e, k - delay, layer)] for p in src]
            assert np.array_equal(r["ids"], np.concatenate([w[0] for w in want]))
            assert np.array_equal(r["rows"].view(np.uint32), np.concatenate([w[1] for w in want]).view(np.uint32))
            assert np.array_equal(r["dest"], np.repeat(src, [w[0].size for w in want]))   # sources
            for p in src:
                received.add((p, q, e, k - delay, layer))
    assert received == {key for key in sent if key[0] != key[1]}, "a push was not received exactly once"
    for rec in recs:
        for e, end in enumerate(rec["end"]):
            assert end["outstanding"] == 0 and not end["probe"]
            assert end["buffer_sets"] == L * delay                      # reused, not reallocated
            c = end["counters"]
            n_push = sum(1 for x in rec["pushes"] if x["epoch"] == e)
            assert n_push == L * (EPOCH_ITERS[e] - delay)
            assert sum(c["rows_sent"]) == sum(x["ids"].size for x in rec["pushes"] if x["epoch"] == e)
            assert sum(c["rows_received"]) == sum(x["ids"].size for x in rec["receives"] if x["epoch"] == e)


if __name__ == "__main__":
    driver(sys.argv[1], sys.argv[2], int(sys.argv[3]))
