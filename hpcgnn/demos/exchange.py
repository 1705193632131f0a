"""Variable all-to-all exchanges with uneven and zero counts, through every path hpcgnn uses.

    mpiexec -n 4 python -m hpcgnn.demos.exchange [--seed 0] [--backend gloo] [--out DIR]

Rank r sends ``counts[q]`` rows to rank q, with counts in 1..5 drawn from the
seed except ``counts[(r + 2) % size] = 0``, and (above 2 ranks) nothing at all
from the last rank. It exchanges

1. int64 rows (``r * 10**6 + q * 10**3 + i``) with the blocking ``alltoallv``;
2. float32 rows of width 3 with ``start_alltoallv(...).wait()`` (counts given);
3. the same rows with ``start_alltoallv`` exchanging the counts itself, completed
   by polling ``test()``;
4. the same rows with torch.distributed ``all_to_all_single(..., async_op=True)``
   (``--backend none`` skips it);
5. the int64 and float32 rows to the other ranks (not to itself) as two capped
   point-to-point exchanges posted back to back on the same tags (``PendingCappedExchange``,
   no count exchange; the second sends the float rows plus one), the first completed by
   polling ``test()``.

Rank 0 prints the ``hello`` line of every rank (see :mod:`hpcgnn.demos.hello`),
then one exchange summary line per rank. With ``--out DIR`` every rank writes what
it sent and received to ``DIR/rank-<r>.npz`` (send_counts, recv_counts, send_int,
send_float, recv_int, recv_float_given, recv_float_counted, recv_float_torch, capped_int,
capped_float, capped_sources, capped_float2) for
checking against a reference.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcgnn.demos.exchange", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="gloo", help="torch.distributed backend: auto, gloo, nccl, ccl, none")
    p.add_argument("--out", default=None, help="directory for the per-rank .npz dumps")
    args = p.parse_args(argv)

    rt = Runtime.start()
    with rt.guard():
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
            import torch
            import torch.distributed as dist

            used = rt.init_torch_distributed(args.backend)
            out = torch.empty((int(recv_counts.sum()), WIDTH), dtype=torch.float32)
            work = dist.all_to_all_single(out, torch.from_numpy(rows_float),
                                          output_split_sizes=recv_counts.tolist(),
                                          input_split_sizes=counts.tolist(), async_op=True)
            work.wait()
            result["recv_float_torch"] = out.numpy()
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            np.savez(os.path.join(args.out, f"rank-{rt.rank}.npz"), **result)
        line = (f"exchange rank {rt.rank}/{rt.size}: sent {counts.tolist()} rows, received "
                f"{recv_counts.tolist()} rows, {pending.bytes_sent} B float out, "
                f"{pending.bytes_received} B float in, torch backend {used}")
        lines = rt.comm.gather((describe(rt), line), root=0)
        if rt.is_root:
            print("\n".join(hello for hello, _ in lines))
            print("\n".join(summary for _, summary in lines), flush=True)
        rt.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
