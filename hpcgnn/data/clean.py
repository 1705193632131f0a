"""Turn raw edge lists into the canonical symmetric CSR (no self-loops, no duplicates).

This is the one place that cleans edges; every importer and generator calls
:func:`build_symmetric_csr`.
"""
from __future__ import annotations

import numpy as np

from hpcgnn.errors import InputError


def build_symmetric_csr(src: np.ndarray, dst: np.ndarray, num_nodes: int, where: str = "edges"):
    """Symmetrise edges ``src[i] - dst[i]`` into an in-edge CSR.

    Returns ``(indptr int64 [N+1], indices int64 [E], stats)`` where rows are
    sorted, self-loops and duplicate edges removed, and ``stats`` counts
    ``self_loops_removed`` and ``duplicates_removed`` (directed edges, after
    symmetrisation). Raises InputError naming ``where`` on IDs outside [0, N).
    """
    src = np.asarray(src, dtype=np.int64).ravel()
    dst = np.asarray(dst, dtype=np.int64).ravel()
    if src.shape != dst.shape:
        raise InputError(f"{where}: {src.size} sources but {dst.size} destinations")
    for name, a in (("source", src), ("destination", dst)):
        if a.size and (a.min() < 0 or a.max() >= num_nodes):
            bad = int(a.min()) if a.min() < 0 else int(a.max())
            raise InputError(f"{where}: {name} vertex ID {bad} is out of range, expected [0, {num_nodes})")
    loops = src == dst
    n_loops = int(loops.sum())
    s, d = src[~loops], dst[~loops]
    keys = np.concatenate([d * num_nodes + s, s * num_nodes + d])
    n_directed = keys.size
    keys = np.unique(keys)
    dup = n_directed - keys.size
    rows = keys // num_nodes
    indices = keys - rows * num_nodes
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num_nodes), out=indptr[1:])
    return indptr, indices, {"self_loops_removed": 2 * n_loops, "duplicates_removed": int(dup)}
