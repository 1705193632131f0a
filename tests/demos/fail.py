"""Fail on one rank while the others wait in a collective: the job must end, never hang.

    mpiexec -n 4 python tests/demos/fail.py --rank 2 --mode raise

Modes (the other ranks wait in ``MPI_Barrier`` meanwhile):

``raise``        rank R raises RuntimeError: message naming rank R, MPI_Abort, exit 1.
``input``        every rank checks "am I rank R?" and passes the result to
                 ``Runtime.agree``: one ``hpcgnn: error:`` line, every rank exits 2.
``input-alone``  rank R raises InputError without ``agree``: the job is aborted with
                 code 2 after HPCGNN_ERROR_WAIT seconds, the message names rank R.
``input-each``   every rank raises InputError without ``agree``, rank R with its own
                 message, the others with a shared one: rank 0 prints each distinct
                 message once (in rank order), every rank exits 2.
``kill``         rank R sends itself SIGKILL: the launcher ends the job.
``peer-lost``    rank R's collective fails as a survivor's does when another rank has died
                 (mpi4py's ``MPI.Exception``): one line saying it stopped because another rank
                 ended, no traceback, MPI_Abort.
``none``         nobody fails (a control): every rank prints "rank i finished".

The failing rank prints ``rank R fails (MODE) at T`` (T = Unix time, seconds) just
before failing; each rank prints ``rank i finished`` only when it gets past the
failure point, and ``rank i exits C`` when it leaves through ``SystemExit(C)``
(an aborted or killed rank prints nothing more). Arguments it does not know are
ignored, so it can stand in for ``-m hpcgnn train`` in slurm/train.sh
(HPCGNN_ENTRY="tests/demos/fail.py --mode kill" sbatch slurm/train.sh).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from hpcgnn.errors import InputError
from hpcgnn.runtime import Runtime

MODES = ("raise", "input", "input-alone", "input-each", "kill", "peer-lost", "none")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tests/demos/fail.py", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=1, help="the failing rank (default 1)")
    p.add_argument("--mode", choices=MODES, default="raise")
    p.add_argument("--report", default=None,
                   help="directory where each rank leaving through SystemExit writes rank-<r> "
                        "with its exit code (stdout of ranks that mpiexec ends may be lost)")
    p.add_argument("--delay", type=float, default=0.5,
                   help="seconds the failing rank waits first, so the others are in the barrier")
    args, _ignored = p.parse_known_args(argv)  # stands in for `-m hpcgnn train` in slurm/train.sh
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rt = Runtime.start()
    try:
        body(rt, args)
    except SystemExit as exc:
        print(f"rank {rt.rank} exits {exc.code}", flush=True)
        if args.report:
            with open(os.path.join(args.report, f"rank-{rt.rank}"), "w") as f:
                f.write(f"{exc.code}\n")
        raise
    return 0


def body(rt: Runtime, args: argparse.Namespace) -> None:
    """The failing (or not) work, under the failure policy."""
    with rt.guard():
        failing = rt.rank == args.rank
        if args.mode == "input":
            rt.agree(f"--rank {args.rank}: rank {rt.rank} refuses to go on (demo check)" if failing else None)
        elif args.mode == "input-each":
            raise InputError(f"--rank {args.rank}: rank {rt.rank} refuses to go on" if failing
                             else "every rank refuses to go on (demo check)")
        elif failing and args.mode != "none":
            time.sleep(args.delay)
            print(f"rank {rt.rank} fails ({args.mode}) at {time.time():.3f}", flush=True)
            if args.mode == "raise":
                raise RuntimeError(f"demo failure on rank {rt.rank}")
            if args.mode == "input-alone":
                raise InputError(f"--rank {args.rank}: rank {rt.rank} refuses to go on "
                                 "(demo check, no agree)")
            if args.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.mode == "peer-lost":
                from mpi4py import MPI

                raise MPI.Exception(MPI.ERR_OTHER)
        rt.comm.Barrier()
        print(f"rank {rt.rank} finished", flush=True)


if __name__ == "__main__":
    sys.exit(main())
