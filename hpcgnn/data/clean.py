"""Turn raw edge lists into the canonical symmetric CSR (no self-loops, no duplicates).

This is the one place that cleans edges; every importer and generator calls
:func:`build_symmetric_csr` (all edges at once) or :class:`SymmetricCsrBuilder`
(edges streamed in chunks). Both run the native kernel in
``native/graph.cpp``; the inputs are validated here so errors name ``where``.
"""
from __future__ import annotations

import numpy as np

from hpcgnn.errors import InputError


def check_ids(src: np.ndarray, dst: np.ndarray, num_nodes: int, where: str) -> None:
    if src.shape != dst.shape:
        raise InputError(f"{where}: {src.size} sources but {dst.size} destinations")
    for name, a in (("source", src), ("destination", dst)):
        if a.size:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= num_nodes:
                bad = lo if lo < 0 else hi
                raise InputError(f"{where}: {name} vertex ID {bad} is out of range, expected [0, {num_nodes})")


def as_ids(a, where: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind not in "iu" and a.size:
        raise InputError(f"{where}: vertex IDs have dtype {a.dtype}, expected integers")
    return np.ascontiguousarray(a.ravel(), dtype=np.int64)


def _stats(loops: int, dups: int) -> dict:
    return {"self_loops_removed": int(loops), "duplicates_removed": int(dups)}


def build_symmetric_csr(src: np.ndarray, dst: np.ndarray, num_nodes: int, where: str = "edges"):
    """Symmetrise edges ``src[i] - dst[i]`` into an in-edge CSR.

    Returns ``(indptr int64 [N+1], indices int64 [E], stats)`` where rows are
    sorted, self-loops and duplicate edges removed, and ``stats`` counts
    ``self_loops_removed`` and ``duplicates_removed`` (directed edges, after
    symmetrisation). Raises InputError naming ``where`` on IDs outside [0, N).
    """
    from hpcgnn.native import graph as native_graph

    src, dst = as_ids(src, where), as_ids(dst, where)
    num_nodes = int(num_nodes)
    check_ids(src, dst, num_nodes, where)
    try:
        indptr, indices, loops, dups = native_graph.symmetric_csr(src, dst, num_nodes)
    except ValueError as exc:  # the kernel re-checks; same message shape
        raise InputError(f"{where}: {exc}") from None
    return indptr, indices, _stats(loops, dups)


class SymmetricCsrBuilder:
    """Streaming form of :func:`build_symmetric_csr`: ``add`` chunks, then ``finish`` once.

    Raw edges are kept natively as uint32 pairs while ``num_nodes`` < 2^32
    (8 bytes per added non-loop edge; pass ``reserve`` = expected edge count
    to avoid regrowth) and freed by :meth:`finish` before rows are sorted.
    """

    def __init__(self, num_nodes: int, reserve: int = 0, where: str = "edges"):
        from hpcgnn.native import graph as native_graph

        self.num_nodes = int(num_nodes)
        self.where = where
        self._acc = native_graph.EdgeAccumulator(self.num_nodes, int(reserve))

    @property
    def num_added(self) -> int:
        """Edges passed to :meth:`add` so far (self-loops included)."""
        return int(self._acc.num_added)

    def add(self, src: np.ndarray, dst: np.ndarray) -> None:
        src, dst = as_ids(src, self.where), as_ids(dst, self.where)
        check_ids(src, dst, self.num_nodes, self.where)
        try:
            self._acc.add(src, dst)
        except ValueError as exc:
            raise InputError(f"{self.where}: {exc}") from None

    def finish(self):
        """``(indptr, indices, stats)`` exactly as :func:`build_symmetric_csr` of all added edges."""
        indptr, indices, loops, dups = self._acc.finish()
        return indptr, indices, _stats(loops, dups)
