"""The compiled kernels, one extension module per family (built from native/).

``from hpcgnn.native import graph, partition, sampler, cache, spmm, dropout``. A missing
module means the build did not run or failed: the error says how to build,
there is no pure-Python fallback.
"""
from __future__ import annotations

import importlib

FAMILIES = ("graph", "partition", "sampler", "cache", "spmm", "dropout")


def _load(family: str):
    try:
        return importlib.import_module(f"hpcgnn._native_{family}")
    except ImportError as exc:  # pragma: no cover - only on a broken install
        raise ImportError(f"hpcgnn native module '_native_{family}' is not built ({exc}); "
                          "run 'make native' (or 'pip install .') with a C++17 compiler") from None


graph = _load("graph")
partition = _load("partition")
sampler = _load("sampler")
cache = _load("cache")
spmm = _load("spmm")
dropout = _load("dropout")


def set_threads(n: int) -> None:
    """Set the OpenMP thread count of every native module's kernels started from the calling
    thread. OpenMP's nthreads-var is per thread: other threads keep theirs, and a thread that
    never set it starts from the process default (OMP_NUM_THREADS, else the CPU count). With
    torch's OpenMP backend torch shares the runtime, so this also sizes torch's intra-op team
    on the calling thread once torch has initialised it there (``torch.get_num_threads()``)."""
    for family in FAMILIES:
        _load(family).set_threads(int(n))


def team_size() -> int:
    """Threads of an OpenMP parallel region started from the calling thread now: the team a
    native kernel called from this thread runs with."""
    return int(spmm.team_size())
