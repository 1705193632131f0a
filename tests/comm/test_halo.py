"""Halo exchange: forward delivers the owners' rows, backward is the exact adjoint (real MPI)."""
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
from hpcgnn.partition.store import read_meta, load_partition
from hpcgnn.comm.halo import HaloPlan, halo_exchange

store, out = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
r = comm.Get_rank()
meta = read_meta(store)
part = load_partition(store, r, meta)
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
y = halo_exchange(x, comm, plan)
y.backward(g)
lhs = comm.allreduce(float((y.detach() * g).sum()))
rhs = comm.allreduce(float((x.detach() * x.grad).sum()))
pieces = comm.allgather((local_gid, g.numpy()))
expect = np.zeros((meta.num_nodes, d))
for gid, rows in pieces:
    np.add.at(expect, gid, rows)
grad_err = float(np.abs(x.grad.numpy() - expect[solid_gid]).max()) if part.num_solid else 0.0
res = comm.gather(dict(forward_ok=forward_ok, lhs=lhs, rhs=rhs, grad_err=grad_err,
                       halo=part.num_halo, sent=plan.rows_sent), root=0)
if r == 0:
    json.dump(res, open(out, "w"))
'''


@pytest.mark.parametrize("ranks", [2, 3])
def test_halo_exchange_forward_and_adjoint(tmp_path, ranks):
    store = toy_store(tmp_path / "store", toy_graph(120, 5.0, seed=ranks), ranks, seed=ranks)
    script = tmp_path / "halo.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    proc = run_mpi(ranks, [script, store, out], timeout=90)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert len(res) == ranks
    assert all(r["halo"] > 0 and r["sent"] > 0 for r in res)  # the test graph really has halos
    for r in res:
        assert r["forward_ok"]
        assert r["grad_err"] < 1e-12
    # <exchange(x), g> == <x, adjoint(g)> summed over ranks
    assert abs(res[0]["lhs"] - res[0]["rhs"]) < 1e-9 * max(1.0, abs(res[0]["lhs"]))


class _Comm:
    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size


def test_halo_plan_rejects_wrong_rank_count(tmp_path):
    store = toy_store(tmp_path / "store", toy_graph(60, 4.0), 2)
    part = load_partition(store, 0)
    plan = HaloPlan.from_partition(part)
    assert plan.recv_counts.sum() == part.num_halo and plan.recv_counts[0] == 0
    assert np.array_equal(plan.send_index + part.solid_begin, part.send_ids)
    with pytest.raises(InputError, match="2 partitions but the job has 3 ranks"):
        HaloPlan.from_partition(part, _Comm(3))
