"""Print one line per rank (gathered, in rank order, by rank 0) and the arguments given.

    mpiexec -n 2 python -m hpcgnn.demos.hello
    srun --mpi=pmi2 -n 2 .venv/bin/python -m hpcgnn.demos.hello

Line format (one per rank)::

    hello rank R size N local_rank L local_size M threads T torch_threads T2 native_threads T3 omp O mpi_yield Y host H

``threads`` is what :meth:`hpcgnn.runtime.Runtime.start` chose, ``torch_threads``
and ``native_threads`` what torch and the OpenMP kernels report afterwards, ``omp``
the OMP_NUM_THREADS environment variable, ``mpi_yield`` MPICH's
``MPIR_CVAR_ENABLE_HEAVY_YIELD`` (1: waiting ranks sleep, set when the node has more ranks
than CPUs, :func:`hpcgnn.runtime.yield_when_oversubscribed`) ('-' when unset). A world started by a
foreign launcher shows N lines of ``size 1`` or stops with the launcher error.
Arguments are not interpreted: rank 0 echoes them as ``argv: ...``, so a launch
script can be checked with this program in place of ``-m hpcgnn train``.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import sys

from hpcgnn.runtime import HEAVY_YIELD_VAR, Runtime

LINE = re.compile(r"^hello rank (?P<rank>\d+) size (?P<size>\d+) local_rank (?P<local_rank>\d+) "
                  r"local_size (?P<local_size>\d+) threads (?P<threads>\d+) "
                  r"torch_threads (?P<torch_threads>\d+) native_threads (?P<native_threads>\S+) "
                  r"omp (?P<omp>\S+) mpi_yield (?P<mpi_yield>\S+) host (?P<host>\S+)$", re.MULTILINE)


def parse(text: str) -> list[dict]:
    """The hello lines found in ``text`` as dicts (numeric fields as int, others str)."""
    return [{k: int(v) if v.isdigit() else v for k, v in m.groupdict().items()}
            for m in LINE.finditer(text)]


def describe(rt: Runtime) -> str:
    """This rank's line (see the module docstring)."""
    import torch

    try:
        from hpcgnn import native
        native_threads = str(native.graph.max_threads())
    except ImportError:
        native_threads = "-"
    return (f"hello rank {rt.rank} size {rt.size} local_rank {rt.local_rank} "
            f"local_size {rt.local_size} threads {rt.threads} torch_threads {torch.get_num_threads()} "
            f"native_threads {native_threads} omp {os.environ.get('OMP_NUM_THREADS', '-')} "
            f"mpi_yield {os.environ.get(HEAVY_YIELD_VAR, '-') or '-'} host {socket.gethostname()}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    rt = Runtime.start()
    with rt.guard():
        lines = rt.comm.gather(describe(rt), root=0)
        if rt.is_root:
            print("\n".join(lines))
            print("argv:", shlex.join(argv), flush=True)
        rt.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
