"""Halo exchange: forward delivers the owners' rows, backward is the exact adjoint (real MPI;
the same exchanges on the mpi4py and the gloo data plane give the same rows and bytes)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpiutil import run_mpi  # noqa: E402
from toygraph import toy_graph, toy_store  # noqa: E402

from hpcgnn.comm.halo import HaloPlan  # noqa: E402
from hpcgnn.errors import InputError  # noqa: E402
from hpcgnn.partition.store import load_partition  # noqa: E402

SCRIPT = r'''
import json, sys
import numpy as np, torch
from mpi4py import MPI
sys.path.insert(0, sys.argv[3])
from planes import close_planes, data_plane
from hpcgnn.partition.store import read_meta, load_partition
from hpcgnn.comm.halo import ExactHalo, HaloPlan, halo_exchange
from hpcgnn.comm.halo_cached import CacheSettings, CachedHalo

store, out = sys.argv[1], sys.argv[2]
world = MPI.COMM_WORLD
r = world.Get_rank()
meta = read_meta(store)
part = load_partition(store, r, meta)
res = {}
for backend in ("mpi4py", "gloo"):
    comm = data_plane(backend)
    plan = HaloPlan.from_partition(part, comm)
    d = 3
    local_gid = part.to_global(np.arange(part.num_local))
    solid_gid = local_gid[:part.num_solid]
    value = lambda g: (g[:, None] * 10.0 + np.arange(d)).astype(np.float64)
    y = halo_exchange(torch.tensor(value(solid_gid)), comm, plan)
    forward_ok = bool(torch.equal(y, torch.tensor(value(local_gid))))

    rng = np.random.default_rng(100 + r)
    x = torch.tensor(rng.standard_normal((part.num_solid, d)), requires_grad=True)
    g = torch.tensor(rng.standard_normal((part.num_local, d)))
    stats = {}
    y = halo_exchange(x, comm, plan, stats)
    y.backward(g)
    lhs = world.allreduce(float((y.detach() * g).sum()))
    rhs = world.allreduce(float((x.detach() * x.grad).sum()))
    pieces = world.allgather((local_gid, g.numpy()))
    expect = np.zeros((meta.num_nodes, d))
    for gid, rows in pieces:
        np.add.at(expect, gid, rows)
    grad_err = float(np.abs(x.grad.numpy() - expect[solid_gid]).max()) if part.num_solid else 0.0
    # bf16 wire (hidden layers) and the rounds of bounded-memory evaluation
    h = torch.from_numpy(rng.standard_normal((part.num_solid, 5)).astype(np.float32))
    bf = ExactHalo(comm, plan, precision="bf16")
    halo_bf = bf.fetch(1, h.numpy())
    rounds = ExactHalo(comm, plan).rounds(3)
    by_round = [rounds.round_rows(h.numpy(), k) for k in range(3)]
    exact = rounds.all_rows(h.numpy())
    rounds_ok = all(np.array_equal(by_round[k][rounds.row_in_round[rounds.round_of == k]],
                                   exact[rounds.round_of == k]) for k in range(3))
    # the cached, pipelined halo (capped exchanges) over 4 epochs, half the halo rows cached
    widths = [5, 4]
    st = CacheSettings(cache=True, staleness=2, pipeline=True, precision="bf16",
                       budget_bytes=(part.num_halo // 2) * 4 * sum(widths))
    cached = CachedHalo(comm, plan, st, widths)
    fetched, reports = [], []
    for epoch in range(1, 5):
        cached.begin_epoch(epoch)
        for layer, w in enumerate(widths):
            rows = (solid_gid[:, None] * 0.5 + epoch * 3 + layer + np.arange(w)).astype(np.float32)
            fetched.append(cached.fetch(layer, rows).tobytes().hex())
        cached.progress()
        counters, per_layer = cached.epoch_report()
        reports.append([counters, {k: v.tolist() for k, v in per_layer.items()}])
    cached.close()
    res[backend] = dict(cached=fetched, cached_reports=reports, forward_ok=forward_ok, lhs=lhs, rhs=rhs,
                        grad_err=grad_err, halo=part.num_halo,
                        sent=plan.rows_sent, halo_bytes=stats["halo_bytes"], bf16_bytes=bf.stats["halo_bytes"],
                        grad=x.grad.numpy().tobytes().hex(), bf16=halo_bf.tobytes().hex(),
                        rounds_ok=rounds_ok, exact=exact.tobytes().hex())
close_planes()
res = world.gather(res, root=0)
if r == 0:
    json.dump(res, open(out, "w"))
'''


@pytest.mark.parametrize("ranks", [2, 3])
def test_halo_exchange_forward_and_adjoint(tmp_path, ranks):
    store = toy_store(tmp_path / "store", toy_graph(120, 5.0, seed=ranks), ranks, seed=ranks)
    script = tmp_path / "halo.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    proc = run_mpi(ranks, [script, store, out, Path(__file__).resolve().parent], timeout=150)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert len(res) == ranks
    for per in res:
        for r in per.values():
            assert r["halo"] > 0 and r["sent"] > 0   # the test graph really has halos
            assert r["forward_ok"] and r["rounds_ok"]
            assert r["grad_err"] < 1e-12
        # mpi4py and gloo: the same rows received (bit for bit) and the same bytes counted
        m, g = per["mpi4py"], per["gloo"]
        assert m == g
        # forward + adjoint of float64 rows of width 3; the bf16 wire: 2 bytes a value
        assert m["halo_bytes"] == m["sent"] * 3 * 8 + m["halo"] * 3 * 8
        assert m["bf16_bytes"] == m["sent"] * 5 * 2
        # the cache worked: rows read from it, none older than the bound S = 2
        per_layer = m["cached_reports"][-1][1]
        assert sum(per_layer["halo_hits_device"]) + sum(per_layer["halo_hits_host"]) > 0
        assert sum(per_layer["halo_age_over_bound"]) == 0 and max(per_layer["halo_age_max"]) <= 2
        assert sum(per_layer["halo_rows_used"]) == 2 * m["halo"]
    # <exchange(x), g> == <x, adjoint(g)> summed over ranks
    lhs, rhs = res[0]["mpi4py"]["lhs"], res[0]["mpi4py"]["rhs"]
    assert abs(lhs - rhs) < 1e-9 * max(1.0, abs(lhs))


class _Comm:
    """A stand-in data plane of ``size`` ranks (the size check comes before any exchange)."""

    def __init__(self, size):
        self.size = size


def test_halo_plan_rejects_wrong_rank_count(tmp_path):
    store = toy_store(tmp_path / "store", toy_graph(60, 4.0), 2)
    part = load_partition(store, 0)
    plan = HaloPlan.from_partition(part)
    assert plan.recv_counts.sum() == part.num_halo and plan.recv_counts[0] == 0
    assert np.array_equal(plan.send_index + part.solid_begin, part.send_ids)
    with pytest.raises(InputError, match="2 partitions but the job has 3 ranks"):
        HaloPlan.from_partition(part, _Comm(3))
