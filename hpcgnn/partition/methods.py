"""Vertex-to-partition assignment: METIS (multi-constraint), random, contiguous.

Every method returns ``part``: int64 [N] with values in [0, K). The seed fixes the result.
"""
from __future__ import annotations

import sys

import numpy as np

from hpcgnn.errors import InputError
from hpcgnn.partition.balance import CONSTRAINTS, vertex_weights
from hpcgnn.partition.metis import DEFAULT_NITER

METHODS = ("metis", "random", "contiguous")
DEFAULT_CONSTRAINTS = CONSTRAINTS


def parse_constraints(text: str) -> tuple[str, ...]:
    """``"vertices,train,edges"`` -> a tuple of distinct known constraint names."""
    names = tuple(t.strip() for t in str(text).split(",") if t.strip())
    if not names:
        raise InputError(f"--constraints {text!r}: expected a comma-separated subset of {','.join(CONSTRAINTS)}")
    for name in names:
        if name not in CONSTRAINTS:
            raise InputError(f"--constraints: unknown constraint {name!r}, expected a subset of "
                             f"{','.join(CONSTRAINTS)}")
    if len(set(names)) != len(names):
        raise InputError(f"--constraints {text!r}: a constraint is listed twice")
    return names


def random_parts(num_nodes: int, num_parts: int, seed: int) -> np.ndarray:
    """Seeded uniform random assignment."""
    return np.random.default_rng(seed).integers(0, num_parts, size=num_nodes, dtype=np.int64)


def contiguous_parts(num_nodes: int, num_parts: int) -> np.ndarray:
    """Equal-size ranges of original IDs (sizes differ by at most one)."""
    return (np.arange(num_nodes, dtype=np.int64) * num_parts) // max(num_nodes, 1)


def metis_parts(indptr: np.ndarray, indices: np.ndarray, train_mask: np.ndarray, num_parts: int,
                seed: int, constraints=DEFAULT_CONSTRAINTS, ufactor: int = 30,
                niter: int = DEFAULT_NITER, log=None, *, library=None,
                ondisk=None) -> tuple[np.ndarray, tuple[str, ...]]:
    """METIS k-way min-edge-cut balancing each named constraint within ``ufactor``/1000
    (``niter`` refinement passes per level).

    Constraints whose total weight is zero (e.g. ``train`` on a graph with no training
    vertices) cannot be balanced and are dropped with a note on ``log``. ``library``: the
    METIS build (:func:`hpcgnn.partition.metis.choose_library`; default: the leanest that fits);
    ``indices`` should already be of its ``idx_t`` dtype, or METIS gets a copy. ``ondisk``: a
    directory for METIS' coarsened graphs (see :func:`~hpcgnn.partition.metis.part_graph_kway`).
    The vertex weights are built directly in ``idx_t``. Returns (part, constraints actually balanced).
    """
    from hpcgnn.partition.metis import choose_library, part_graph_kway

    n = indptr.shape[0] - 1
    if num_parts == 1:
        return np.zeros(n, dtype=np.int64), tuple(constraints)
    if library is None:
        library = choose_library("auto", n, int(indices.shape[0]), len(constraints))
    vwgt, used = metis_weights(indptr, train_mask, constraints, library.idx_dtype, log)
    part, _ = part_graph_kway(indptr, indices, num_parts, vwgt, seed=seed, ufactor=ufactor, niter=niter,
                              library=library, ondisk=ondisk)
    return part, used


def metis_weights(indptr: np.ndarray, train_mask: np.ndarray, constraints, dtype,
                  log=None) -> tuple[np.ndarray | None, tuple[str, ...]]:
    """(vertex weights [N, ncon] of ``dtype``, constraints they balance) for METIS.

    Constraints of zero total weight are dropped with a note on ``log``; when none is left the
    weights are None (unit weights: METIS balances the vertex count, reported as "vertices").
    The array is filled column by column, without an int64 copy of the whole.
    """
    n = indptr.shape[0] - 1
    degree = np.diff(indptr)
    used = []
    for name in constraints:
        if not vertex_weights(name, degree, train_mask).any():
            print(f"hpcgnn partition: note: constraint '{name}' has zero total weight; not balanced",
                  file=log or sys.stderr)
            continue
        used.append(name)
    if not used:
        return None, ("vertices",)
    vwgt = np.empty((n, len(used)), dtype=dtype)
    for j, name in enumerate(used):
        vwgt[:, j] = vertex_weights(name, degree, train_mask)
    return vwgt, tuple(used)


def assign_parts(method: str, indptr: np.ndarray, indices: np.ndarray, train_mask: np.ndarray,
                 num_parts: int, seed: int, constraints=DEFAULT_CONSTRAINTS,
                 ufactor: int = 30, niter: int = DEFAULT_NITER, *, library=None,
                 ondisk=None) -> tuple[np.ndarray, tuple[str, ...]]:
    """(part int64 [N], constraints balanced by construction) for ``method``.

    Random and contiguous assignments balance no weighted constraint: they return ``()``.
    ``library`` and ``ondisk`` are METIS' (see :func:`metis_parts`).
    """
    n = indptr.shape[0] - 1
    if method == "metis":
        return metis_parts(indptr, indices, train_mask, num_parts, seed, constraints, ufactor, niter,
                           library=library, ondisk=ondisk)
    if method == "random":
        return random_parts(n, num_parts, seed), ()
    if method == "contiguous":
        return contiguous_parts(n, num_parts), ()
    raise InputError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
