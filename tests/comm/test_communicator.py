"""The data plane's seam (hpcgnn.comm.communicator) on real ranks: mpiexec -n 4 runs every
operation on the mpi4py and the gloo plane and checks each against values built independently;
both planes must give bit-identical results. A capped exchange never waits for a peer at start."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent

SCRIPT = r'''
import json, sys, time
import numpy as np, torch
from mpi4py import MPI
sys.path.insert(0, sys.argv[2])
from planes import close_planes, data_plane

world = MPI.COMM_WORLD
r, P = world.Get_rank(), world.Get_size()
out = {}
for backend in ("mpi4py", "gloo"):
    c = data_plane(backend)
    res = {}
    # alltoallv: rank s sends (s + q) % 3 rows to q, row i for q = [s, q, i] (+ a bf16 copy)
    sc = np.array([(r + q) % 3 for q in range(P)])
    rows = torch.tensor([[r, q, i] for q in range(P) for i in range(sc[q])], dtype=torch.float64)
    rows = rows.reshape(-1, 3)
    want = torch.tensor([[s, r, i] for s in range(P) for i in range((s + r) % 3)], dtype=torch.float64)
    want = want.reshape(-1, 3)
    res["counts"] = c.exchange_counts(sc).tolist() == [(s + r) % 3 for s in range(P)]
    res["blocking"] = torch.equal(c.alltoallv(rows, sc), want)
    p = c.start_alltoallv(rows.to(torch.bfloat16), sc, c.exchange_counts(sc))
    while not p.test():
        pass
    res["started_bf16"] = torch.equal(p.wait(), want.to(torch.bfloat16))
    # reductions, allgatherv, broadcast
    x = torch.arange(5, dtype=torch.float32) + r
    res["sum"] = c.allreduce_(x.clone()).tolist() == (np.arange(5) * P + P * (P - 1) / 2).tolist()
    top = c.allreduce_(torch.tensor([r * 7 % 5], dtype=torch.int64), op="max")
    res["max"] = top.tolist() == [max(q * 7 % 5 for q in range(P))]
    y = x.clone()
    pend = c.start_allreduce_(y)
    pend.wait()
    res["started_sum"] = torch.equal(y, c.allreduce_(x.clone()))
    counts = np.array([q % 2 + 1 for q in range(P)])
    g = c.allgatherv(torch.full((counts[r], 2), r, dtype=torch.int16), counts)
    res["allgatherv"] = g.tolist() == [[q, q] for q in range(P) for _ in range(counts[q])]
    b = torch.full((4,), float(r))
    res["broadcast"] = c.broadcast_(b, root=P - 1).tolist() == [P - 1.0] * 4
    # capped: rank q accepts at most q + 2 rows from each peer; s sends (s + q) % (q + 3) rows
    caps = np.array([0 if q == r else r + 2 for q in range(P)])
    ch = c.open_capped(caps)
    sc = np.array([0 if q == r else min((r + q) % (q + 3), q + 2) for q in range(P)])
    ids = torch.tensor([100 * r + q for q in range(P) for _ in range(sc[q])], dtype=torch.int64)
    vals = torch.stack([(ids % 64).to(torch.float32), -ids.to(torch.float32)], 1).to(torch.bfloat16)   # exact
    world.Barrier()
    if r == 0:
        time.sleep(1.0)                  # a slow peer: the others' starts must not wait for it
    t0 = time.perf_counter()
    first = ch.start([ids, vals], sc, tag=0)
    second = ch.start([ids + 1, vals], sc, tag=0)
    start_s = time.perf_counter() - t0
    (gi, gv), src = first.wait()
    (gi2, _), src2 = second.wait()
    exp = [100 * s + r for s in range(P) if s != r for _ in range(min((s + r) % (r + 3), r + 2))]
    res["capped"] = gi.tolist() == exp and (gi2 - 1).tolist() == exp and torch.equal(src, src2)
    res["capped_rows"] = gv.dtype == torch.bfloat16 and gv[:, 0].float().tolist() == [float(e % 64) for e in exp]
    res["sources"] = src.tolist() == [e // 100 for e in exp]
    res["start_fast"] = r == 0 or start_s < 0.5
    ch.close()
    # tensor-parallel split / gather (chunks started together, finished in reverse) and GAT's
    # allgather of attention scalars with its adjoint
    from hpcgnn.comm.tensor_parallel import AllgatherRows, TPComm, TPLayout, column_bounds
    V, C = 40, 7
    nbr = np.sort(np.stack([(np.arange(V) - 1) % V, (np.arange(V) + 7) % V], 1), 1).reshape(-1)
    lay = TPLayout.build(np.arange(V + 1) * 2, nbr, np.array([0, 13, 27, V]), P, r)
    tp = TPComm(c, lay)
    X = torch.arange(V * C, dtype=torch.float32).reshape(V, C) * 0.25
    cb = column_bounds(C, P)
    z = torch.zeros((V, int(cb[r + 1] - cb[r])))
    handles = [tp.start_to_cols(lay.split_transfer(j), X[lay.own_ids], z) for j in range(lay.num_chunks)]
    for h in reversed(handles):
        h.finish()
    res["split"] = torch.equal(z, X[:, cb[r]:cb[r + 1]])
    res["gather"] = torch.equal(tp.gather(z, C), X[lay.own_ids])
    a = (X[lay.own_ids][:, :2] + 1).requires_grad_(True)
    full = AllgatherRows.apply(a, tp)
    res["allgather"] = torch.equal(full.detach(), X[:, :2] + 1)
    full.backward(torch.ones_like(full) * (r + 1))
    res["allgather_adjoint"] = torch.equal(a.grad, torch.full_like(a, P * (P + 1) / 2))
    out[backend] = dict(res=res, data=[g.numpy().tobytes().hex(), gv.view(torch.int16).numpy().tobytes().hex()],
                        tp_bytes=tp.stats.bytes)
close_planes()
out = world.gather(out, root=0)
if r == 0:
    json.dump(out, open(sys.argv[1], "w"))
'''


@pytest.mark.parametrize("ranks", [4])
def test_every_operation_on_both_planes(tmp_path, ranks):
    sys.path.insert(0, str(HERE.parent))
    from mpiutil import run_mpi

    script = tmp_path / "seam.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    proc = run_mpi(ranks, [script, out, HERE], timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    for rank, per in enumerate(res):
        for backend, got in per.items():
            failed = [k for k, ok in got["res"].items() if not ok]
            assert not failed, (rank, backend, failed)
        assert per["mpi4py"]["data"] == per["gloo"]["data"]
        assert per["mpi4py"]["tp_bytes"] == per["gloo"]["tp_bytes"] and per["gloo"]["tp_bytes"]["split"] > 0


def test_choose_backend_refuses_impossible_pairs():
    from hpcgnn.comm.communicator import ccl_available, choose_backend
    from hpcgnn.errors import InputError

    assert choose_backend("mpi4py", "cpu") == "mpi4py"
    assert choose_backend("gloo", "cpu") == "gloo"
    assert choose_backend("auto", "cpu") == ("ccl" if ccl_available() else "mpi4py")
    with pytest.raises(InputError, match="runtime.backend = 'nccl' needs train.device = 'cuda'"):
        choose_backend("nccl", "cpu")
    with pytest.raises(InputError, match="runtime.backend = 'ccl' cannot move CUDA tensors"):
        choose_backend("ccl", "cuda")
    with pytest.raises(InputError, match="runtime.backend = 'mpi', expected one of"):
        choose_backend("mpi", "cpu")


def test_single_rank_planes_move_nothing():
    from hpcgnn.comm.communicator_torch import TorchCommunicator

    c = TorchCommunicator("gloo", 0, 1, "cpu")      # size 1: no process group is touched
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    got = c.alltoallv(x, [3], [3])
    assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()
    (ids,), src = c.open_capped([0]).start([torch.zeros(0, dtype=torch.int64)], [0], tag=0).wait()
    assert ids.shape == (0,) and src.shape == (0,)
    assert np.array_equal(c.exchange_counts([3]), [3])


def test_single_rank_results_stay_on_the_senders_device():
    """A one-rank torch communicator whose device is not the sender's (nccl on a GPU, host
    buffers from the exact fetch) returns the rows on the sender's device, never on its own;
    ``meta`` stands in for the GPU (nothing can be copied out of it)."""
    from hpcgnn.comm.communicator_torch import TorchCommunicator

    c = TorchCommunicator("nccl", 0, 1, torch.device("meta"))
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    for got in (c.alltoallv(x, [3], [3]), c.allgatherv(x, [3])):
        assert got.device == x.device and torch.equal(got, x) and got.data_ptr() != x.data_ptr()


def test_reduced_copy_goes_back_into_the_callers_buffer():
    """An allreduce of a buffer that is not on the communicator's device reduces a copy there
    and, on wait(), copies the sum back into the caller's buffer (any size) and returns None."""
    from hpcgnn.comm.communicator_torch import _TorchWork, copy_back_into

    buf = torch.zeros(4, 3)
    reduced = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert _TorchWork(None, reduced, copy_back_into(buf)).wait() is None
    assert torch.equal(buf, reduced)


class _TwoRanks:
    """Stands in for an MPI communicator of 2 ranks (make_communicator only asks its shape)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2


def _job(shared: dict):
    from types import SimpleNamespace

    return SimpleNamespace(rank=0, size=2, comm=_TwoRanks(), data_plane=None,
                           shared_gpus=lambda device: shared)


def test_ranks_sharing_a_gpu_get_no_nccl(monkeypatch):
    """NCCL takes one rank per GPU: where ranks share one, ``auto`` carries the data plane with
    mpi4py and ``nccl`` is refused with one line naming the GPU and the way out; ranks on GPUs
    of their own keep nccl (its set-up is not reached here: recorded instead). A torch without
    NCCL makes ``auto`` on CUDA mpi4py."""
    import torch.distributed as dist

    from hpcgnn.comm import communicator as c
    from hpcgnn.comm import data_plane
    from hpcgnn.errors import InputError
    from hpcgnn.runtime import shared_gpus

    assert shared_gpus(["n1:GPU-a", "n1:GPU-a", "n1:GPU-b", ""]) == {"n1:GPU-a": 2}
    assert shared_gpus(["n1:GPU-a", "n1:GPU-b", "", ""]) == {}
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert c.choose_backend("auto", "cuda") == "mpi4py"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    job = _job({"n1:GPU-a": 2})
    assert data_plane.make_communicator(job, "auto", "cuda:0").name == "mpi4py"
    with pytest.raises(InputError, match=r"runtime.backend = 'nccl' but 2 ranks share GPU n1:GPU-a .* "
                                         r"NCCL takes one rank per GPU; use 'auto' or 'mpi4py'"):
        data_plane.make_communicator(_job({"n1:GPU-a": 2}), "nccl", "cuda:0")
    started = []
    own = _job({})
    own.init_torch_distributed = lambda name, device: started.append(name) or "gloo"
    assert data_plane.make_communicator(own, "auto", "cuda:0").name == "gloo" and started == ["nccl"]
