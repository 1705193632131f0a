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
    """Set the OpenMP thread count of every native module."""
    for family in FAMILIES:
        _load(family).set_threads(int(n))
