"""Variable all-to-all exchanges with uneven and zero counts, through every path hpcgnn uses.

    mpiexec -n 4 python tests/demos/exchange.py [--seed 0] [--backend gloo] [--out DIR]

Rank r sends ``counts[q]`` rows to rank q, with counts in 1..5 drawn from the
seed except ``counts[(r + 2) % size] = 0``, and (above 2 ranks) nothing at all
from the last rank. It exchanges

1. int64 rows (``r * 10**6 + q * 10**3 + i``) with the blocking ``alltoallv``;
2. float32 rows of width 3 with ``start_alltoallv(...).wait()`` (counts given);
3. the same rows with ``start_alltoallv`` exchanging the counts itself, completed
   by polling ``test()``;
4. through the data plane's seam (:func:`hpcgnn.comm.data_plane.make_communicator` for
   ``--backend``: mpi4py, gloo, nccl, ccl or auto, as ``runtime.backend``; ``none`` skips it):
   the int64 rows with the blocking ``alltoallv`` (counts exchanged by the seam), the float32
   rows with ``start_alltoallv`` (counts given) completed by polling ``test()``, an
   ``allreduce_`` of the send counts, an ``allgatherv`` of the int64 rows and a ``broadcast_``
   of rank 0's float rows;
5. the int64 and float32 rows to the other ranks (not to itself) as two capped
   point-to-point exchanges posted back to back on the same tags (``PendingCappedExchange``,
   no count exchange; the second sends the float rows plus one), the first completed by
   polling ``test()``.

A backend that cannot run here (nccl without a GPU or without NCCL in torch, ccl without
oneccl_bindings_for_pytorch) is one line on rank 0 and exit 2 on every rank, before any exchange.
On a GPU (nccl, or auto with CUDA) the seam's tensors live on the rank's GPU.

Rank 0 prints the ``hello`` line of every rank (see :mod:`hpcgnn.demos.hello`),
then one exchange summary line per rank. With ``--out DIR`` every rank writes what
it sent and received to ``DIR/rank-<r>.npz`` (send_counts, recv_counts, send_int,
send_float, recv_int, recv_float_given, recv_float_counted, capped_int, capped_float,
capped_sources, capped_float2 and, through the seam, plane_int, plane_float, plane_counts_sum,
plane_gather, plane_bcast) for checking against a reference.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from hpcgnn.comm.alltoall import PendingCappedExchange, alltoallv, exchange_counts, start_alltoallv
from hpcgnn.demos.hello import describe
from hpcgnn.runtime import Runtime

WIDTH = 3
BACKEND_CHOICES = ("mpi4py", "gloo", "nccl", "ccl", "auto", "none")


def send_plan(rank: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts [size], int64 rows, float32 rows [sum(counts), WIDTH]) that ``rank`` sends."""
    rng = np.random.default_rng([seed, rank])
    counts = rng.integers(1, 6, size=size).astype(np.int64)
    counts[(rank + 2) % size] = 0
    if size > 2 and rank == size - 1:
        counts[:] = 0
    dest = np.repeat(np.arange(size, dtype=np.int64), counts)
    within = np.arange(dest.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    rows_int = rank * 10**6 + dest * 10**3 + within
    rows_float = rng.standard_normal((dest.size, WIDTH)).astype(np.float32)
    return counts, rows_int, rows_float


def _check_backend(backend: str, device: str) -> str:
    """The data plane ``--backend`` gives on ``device``; InputError (one line) when it cannot run."""
    from hpcgnn.comm.communicator import choose_backend
    from hpcgnn.errors import InputError

    try:
        return choose_backend(backend, device)
    except InputError as exc:
        raise InputError(f"--backend {backend}: {exc}") from None


def _through_plane(rt, backend: str, device: str, counts, recv_counts, rows_int, rows_float) -> dict:
    """Collective: the rows through the seam (``make_communicator``), results as host arrays."""
    import torch

    from hpcgnn.comm.data_plane import make_communicator

    plane = make_communicator(rt, backend, device)
    on = plane.device
    x_int, x_float = torch.from_numpy(rows_int).to(on), torch.from_numpy(rows_float).to(on)
    got_int = plane.alltoallv(x_int, counts)
    pending = plane.start_alltoallv(x_float, counts, recv_counts)
    while not pending.test():   # drive progress as an engine overlapping compute would
        pass
    got_float = pending.wait()
    total = plane.allreduce_(torch.from_numpy(counts.copy()).to(on))
    sizes = np.asarray(rt.comm.allgather(int(rows_int.shape[0])), dtype=np.int64)
    gathered = plane.allgatherv(x_int, sizes)
    root_rows = int(rt.comm.bcast(rows_float.shape[0], root=0))
    bcast = x_float.clone() if rt.rank == 0 else torch.zeros((root_rows, WIDTH), dtype=torch.float32, device=on)
    plane.broadcast_(bcast, root=0)
    host = {"plane_int": got_int, "plane_float": got_float, "plane_counts_sum": total,
            "plane_gather": gathered, "plane_bcast": bcast}
    return {k: v.cpu().numpy() for k, v in host.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tests/demos/exchange.py", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="gloo", choices=BACKEND_CHOICES,
                   help="the data plane (runtime.backend): mpi4py, gloo, nccl, ccl, auto, or none")
    p.add_argument("--out", default=None, help="directory for the per-rank .npz dumps")
    args = p.parse_args(argv)

    rt = Runtime.start()
    with rt.guard():
        device = "cpu"
        if args.backend != "none":
            import torch

            device = "cuda" if args.backend in ("nccl", "auto") and torch.cuda.is_available() else "cpu"
            rt.agree_on(lambda: _check_backend(args.backend, device))   # one line, exit 2 everywhere
        counts, rows_int, rows_float = send_plan(rt.rank, rt.size, args.seed)
        recv_int = alltoallv(rt.comm, rows_int, counts)
        recv_counts = exchange_counts(rt.comm, counts)
        pending = start_alltoallv(rt.comm, rows_float, counts, recv_counts)
        recv_float_given = pending.wait()
        pending_counted = start_alltoallv(rt.comm, rows_float, counts)
        while not pending_counted.test():  # drive progress as an engine overlapping compute would
            pass
        recv_float_counted = pending_counted.wait()
        others = np.repeat(np.arange(rt.size), counts) != rt.rank
        counts_other = np.where(np.arange(rt.size) == rt.rank, 0, counts)
        caps = np.where(np.arange(rt.size) == rt.rank, 0, 5)           # counts are at most 5
        first = PendingCappedExchange(rt.comm, [rows_int[others], rows_float[others]], counts_other, caps, tag=0)
        second = PendingCappedExchange(rt.comm, [rows_int[others], rows_float[others] + 1], counts_other, caps,
                                       tag=0)
        while not first.test():
            pass
        (capped_int, capped_float), capped_sources = first.wait()
        (_, capped_float2), _ = second.wait()
        result = dict(send_counts=counts, recv_counts=recv_counts, send_int=rows_int,
                      send_float=rows_float, recv_int=recv_int, recv_float_given=recv_float_given,
                      recv_float_counted=recv_float_counted, capped_int=capped_int, capped_float=capped_float,
                      capped_sources=capped_sources, capped_float2=capped_float2)
        used = "none"
        if args.backend != "none":
            result.update(_through_plane(rt, args.backend, device, counts, recv_counts, rows_int, rows_float))
            used = rt.data_plane.name
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            np.savez(os.path.join(args.out, f"rank-{rt.rank}.npz"), **result)
        line = (f"exchange rank {rt.rank}/{rt.size}: sent {counts.tolist()} rows, received "
                f"{recv_counts.tolist()} rows, {pending.bytes_sent} B float out, "
                f"{pending.bytes_received} B float in, data plane {used}")
        lines = rt.comm.gather((describe(rt), line), root=0)
        if rt.is_root:
            print("\n".join(hello for hello, _ in lines))
            print("\n".join(summary for _, summary in lines), flush=True)
        rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
