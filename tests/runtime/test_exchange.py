"""alltoallv / start_alltoallv / the capped point-to-point exchange / the data plane's seam
(every backend that runs here: mpi4py, gloo, auto) at 2 and 4 ranks against a numpy reference;
the backends that cannot run here (nccl without a GPU, ccl without oneCCL) refused in one line.

Each run also checks Runtime.start on that world: rank/size/local_size, and threads
per rank (default at 4 ranks, HPCGNN_THREADS override at 2), as torch and the
OpenMP kernels report them in the child.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpiutil import ROOT, run_mpi

from hpcgnn.demos.hello import parse

EXCHANGE = ROOT / "tests" / "demos" / "exchange.py"

CORES = len(os.sched_getaffinity(0))


def reference_receive(sent: list[dict], rank: int, key: str) -> np.ndarray:
    """Rows rank ``rank`` must receive: from every source in rank order, its segment for ``rank``."""
    pieces = []
    for s in sent:
        offsets = np.concatenate([[0], np.cumsum(s["send_counts"])])
        pieces.append(s[key][offsets[rank]:offsets[rank + 1]])
    return np.concatenate(pieces)


def _auto_on_cpu() -> str:
    from hpcgnn.comm.communicator import choose_backend

    return choose_backend("auto", "cpu")


@pytest.mark.parametrize("backend", ["gloo", "mpi4py", "auto"])
@pytest.mark.parametrize("ranks,threads_env", [(2, "3"), (4, None)])
def test_exchanges_match_reference(tmp_path, ranks, threads_env, backend):
    env = {"HPCGNN_THREADS": threads_env} if threads_env else {}
    proc = run_mpi(ranks, [EXCHANGE, "--seed", "7", "--backend", backend,
                           "--out", tmp_path], timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    hello = parse(proc.stdout)
    assert [h["rank"] for h in hello] == list(range(ranks))
    assert {h["size"] for h in hello} == {ranks}
    assert sorted(h["local_rank"] for h in hello) == list(range(ranks))
    assert {h["local_size"] for h in hello} == {ranks}
    expected_threads = int(threads_env) if threads_env else max(1, CORES // ranks)
    for h in hello:
        assert h["threads"] == h["torch_threads"] == h["native_threads"] == expected_threads, h

    dumps = [dict(np.load(tmp_path / f"rank-{r}.npz")) for r in range(ranks)]
    counts = np.stack([d["send_counts"] for d in dumps])
    assert (counts == 0).any() and len(set(counts[counts > 0].tolist())) > 1  # zero and uneven counts
    assert (counts[~np.eye(ranks, dtype=bool)] > 0).any()                        # rows cross ranks
    if ranks > 2:
        assert counts[-1].sum() == 0                                             # a rank sending nothing
    for r, d in enumerate(dumps):
        assert d["send_int"].dtype == np.int64 and d["send_float"].dtype == np.float32
        assert d["send_float"].ndim == 2
        np.testing.assert_array_equal(d["recv_counts"], counts[:, r])
        expect_int = reference_receive(dumps, r, "send_int")
        expect_float = reference_receive(dumps, r, "send_float")
        assert d["recv_int"].dtype == np.int64 and d["recv_int"].shape == expect_int.shape
        np.testing.assert_array_equal(d["recv_int"], expect_int)
        # the capped point-to-point exchange: the same rows without the rank's own
        own = np.repeat(np.arange(ranks), counts[:, r]) == r
        np.testing.assert_array_equal(d["capped_int"], expect_int[~own])
        np.testing.assert_array_equal(d["capped_float"], expect_float[~own])
        np.testing.assert_array_equal(d["capped_float2"], expect_float[~own] + 1)
        np.testing.assert_array_equal(d["capped_sources"], np.repeat(np.arange(ranks), counts[:, r])[~own])
        for key in ("recv_float_given", "recv_float_counted", "plane_float"):
            assert d[key].dtype == np.float32 and d[key].shape == expect_float.shape, key
            np.testing.assert_array_equal(d[key], expect_float, err_msg=key)
        # the seam's other collectives
        assert d["plane_int"].dtype == np.int64
        np.testing.assert_array_equal(d["plane_int"], expect_int)
        np.testing.assert_array_equal(d["plane_counts_sum"], counts.sum(axis=0))
        np.testing.assert_array_equal(d["plane_gather"], np.concatenate([s["send_int"] for s in dumps]))
        np.testing.assert_array_equal(d["plane_bcast"], dumps[0]["send_float"])
    # bytes_sent / bytes_received of the non-blocking exchange, read after wait()
    for r, d in enumerate(dumps):
        sent_b, recv_b = 4 * 3 * int(d["send_counts"].sum()), 4 * 3 * int(d["recv_counts"].sum())
        assert f"exchange rank {r}/{ranks}:" in proc.stdout
        used = _auto_on_cpu() if backend == "auto" else backend
        assert f"{sent_b} B float out, {recv_b} B float in, data plane {used}" in \
            proc.stdout.split(f"exchange rank {r}/{ranks}:")[1].splitlines()[0]


@pytest.mark.parametrize("backend", ["nccl", "ccl"])
def test_backends_that_cannot_run_here_are_one_line(backend):
    """nccl without a GPU (or without NCCL in torch), ccl without oneCCL's bindings: one line on
    rank 0, exit 2 on every rank, nothing exchanged (no summary line)."""
    import torch

    from hpcgnn.comm.communicator import ccl_available

    if backend == "nccl" and torch.cuda.is_available() and torch.distributed.is_nccl_available():
        pytest.skip("a GPU with NCCL is here: nccl runs")
    if backend == "ccl" and ccl_available():
        pytest.skip("oneccl_bindings_for_pytorch imports here: ccl runs")
    proc = run_mpi(2, [EXCHANGE, "--backend", backend], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"hpcgnn: error: --backend {backend}: runtime.backend = "
                                                     f"'{backend}'"), proc.stderr
    assert "exchange rank" not in proc.stdout


def test_counts_that_do_not_match_the_rows_are_refused_before_mpi():
    from hpcgnn.comm.alltoall import alltoallv, start_alltoallv

    class TwoRanks:
        def Get_size(self):
            return 2

        def __getattr__(self, name):  # any MPI call would be a bug: the check comes first
            raise AssertionError(f"MPI called: {name}")

    rows = np.zeros((5, 2), np.float32)
    with pytest.raises(ValueError, match="sum to 4 but send has 5 rows"):
        alltoallv(TwoRanks(), rows, np.array([1, 3]), np.array([2, 2]))
    with pytest.raises(ValueError, match="send_counts must be 2"):
        start_alltoallv(TwoRanks(), rows, np.array([5]), np.array([2, 2]))
    with pytest.raises(ValueError, match="recv_counts must be 2 non-negative"):
        alltoallv(TwoRanks(), rows, np.array([2, 3]), np.array([-1, 2]))
