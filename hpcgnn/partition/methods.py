"""Vertex-to-partition assignment: METIS (multi-constraint), KaMinPar (one weight plus a repair
pass for the other constraints, :mod:`hpcgnn.partition.kaminpar`), random, contiguous; and the
automatic choice between METIS and KaMinPar by memory (:func:`choose_method`).

Every method returns ``part``: int64 [N] with values in [0, K). The seed fixes the result.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from hpcgnn.errors import InputError
from hpcgnn.partition.balance import CONSTRAINTS, vertex_weights
from hpcgnn.partition.metis import DEFAULT_NITER

METHODS = ("auto", "metis", "kaminpar", "random", "contiguous")
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
    ``library`` and ``ondisk`` are METIS' (see :func:`metis_parts`). KaMinPar runs with one
    thread (reproducible) and its ``eps`` is ``ufactor`` / 1000.
    """
    n = indptr.shape[0] - 1
    if method == "metis":
        return metis_parts(indptr, indices, train_mask, num_parts, seed, constraints, ufactor, niter,
                           library=library, ondisk=ondisk)
    if method == "kaminpar":
        from hpcgnn.partition.kaminpar import kaminpar_parts

        result = kaminpar_parts(indptr, indices, train_mask, num_parts, seed, constraints, ufactor / 1000.0)
        return result.part, result.constraints
    if method == "random":
        return random_parts(n, num_parts, seed), ()
    if method == "contiguous":
        return contiguous_parts(n, num_parts), ()
    raise InputError(f"--method {method!r}: expected one of {', '.join(METHODS)}")


@dataclass
class MethodChoice:
    """What ``--method auto`` chose and why (the models' figures, in bytes)."""

    method: str                  # "metis" or "kaminpar"
    metis_bytes: int | None      # modelled METIS peak (None: no METIS build can index the graph)
    kaminpar_bytes: int          # modelled KaMinPar peak
    budget: int
    budget_source: str           # "--memory-budget", "MemAvailable", ...
    metis_library: str | None    # the METIS build the model is for

    def line(self) -> str:
        """One line saying the choice and its reason."""
        from hpcgnn.units import fmt_bytes

        metis = ("METIS cannot index the graph" if self.metis_bytes is None else
                 f"METIS needs ~{fmt_bytes(self.metis_bytes)}, "
                 f"{'within' if self.metis_bytes <= self.budget else 'over'} the budget "
                 f"{fmt_bytes(self.budget)} ({self.budget_source})")
        return f"method auto: {self.method}: {metis}; KaMinPar ~{fmt_bytes(self.kaminpar_bytes)}"

    def attrs(self) -> dict:
        """meta.h5 attributes recording the choice."""
        return {"method_choice": self.line(), "memory_budget": int(self.budget),
                "memory_budget_source": self.budget_source,
                "modelled_bytes": {"metis": self.metis_bytes, "kaminpar": self.kaminpar_bytes}}


def choose_method(where: str, num_nodes: int, num_edges: int, num_parts: int, ncon: int, budget: int,
                  budget_source: str, metis_library: str = "auto", metis_ondisk: bool | None = None) -> MethodChoice:
    """METIS when its modelled peak memory (:func:`hpcgnn.partition.metis.memory_bytes`, for the
    build ``metis_library`` would pick, coarse levels on disk where it can unless
    ``metis_ondisk`` is False) fits ``budget``, else KaMinPar
    (:func:`hpcgnn.partition.kaminpar.memory_bytes`). InputError naming ``where`` and the memory
    needed when even KaMinPar's does not fit."""
    from hpcgnn.partition import kaminpar
    from hpcgnn.partition.metis import choose_library, memory_bytes
    from hpcgnn.units import fmt_bytes

    metis_bytes, described = None, None
    try:
        library = choose_library(metis_library, num_nodes, num_edges, ncon)
    except RuntimeError:
        library = None
    if library is not None and library.fits(num_nodes, num_edges, ncon, num_edges):
        ondisk = library.supports_ondisk if metis_ondisk is None else bool(metis_ondisk) and library.supports_ondisk
        metis_bytes = memory_bytes(num_nodes, num_edges, np.dtype(library.idx_dtype).itemsize, ondisk)
        described = library.describe()
    kaminpar_bytes = kaminpar.memory_bytes(num_nodes, num_edges, num_parts)
    choice = MethodChoice("metis" if metis_bytes is not None and metis_bytes <= budget else "kaminpar",
                          metis_bytes, kaminpar_bytes, int(budget), budget_source, described)
    if choice.method == "kaminpar" and kaminpar_bytes > budget:
        raise InputError(f"{where}: partitioning {num_nodes} vertices and {num_edges} directed edges into "
                         f"{num_parts} parts needs about "
                         f"{fmt_bytes(kaminpar_bytes)} (KaMinPar, the leanest method), more than the memory "
                         f"budget {fmt_bytes(budget)} ({budget_source})")
    return choice
