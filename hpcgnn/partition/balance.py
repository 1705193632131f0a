"""Per-partition weights, balance and edge cut of a vertex-to-partition assignment.

Constraint weights per vertex (the METIS vertex-weight columns, DistDGL/DistGNN-MB style):
``vertices`` = 1, ``train`` = 1 if a training vertex, ``edges`` = degree (in-edges, which for a
symmetric graph is also out-edges). Balance of a constraint = max part weight / mean part weight
(1.0 = perfect; 1.0 also when the total weight is zero).
"""
from __future__ import annotations

import numpy as np

CONSTRAINTS = ("vertices", "train", "edges")


def vertex_weights(name: str, degree: np.ndarray, train_mask: np.ndarray) -> np.ndarray:
    """int64 [N] weight of every vertex under constraint ``name``."""
    if name == "vertices":
        return np.ones(degree.shape[0], dtype=np.int64)
    if name == "train":
        return train_mask.astype(np.int64)
    if name == "edges":
        return degree.astype(np.int64, copy=False)
    raise ValueError(f"unknown constraint {name!r}, expected one of {', '.join(CONSTRAINTS)}")


def part_weights(part: np.ndarray, num_parts: int, degree: np.ndarray,
                 train_mask: np.ndarray) -> dict[str, np.ndarray]:
    """{constraint: int64 [K] total weight of each partition}."""
    return {name: np.bincount(part, weights=vertex_weights(name, degree, train_mask),
                              minlength=num_parts).astype(np.int64)
            for name in CONSTRAINTS}


def imbalance(weights: np.ndarray) -> float:
    """max / mean of per-partition weights (1.0 if all are zero)."""
    mean = float(weights.mean()) if weights.size else 0.0
    return float(weights.max()) / mean if mean > 0 else 1.0


def balance(part: np.ndarray, num_parts: int, degree: np.ndarray, train_mask: np.ndarray) -> dict[str, float]:
    """{vertices, train, edges: max/mean part weight}."""
    return {name: imbalance(w) for name, w in part_weights(part, num_parts, degree, train_mask).items()}


def edge_cut(indptr: np.ndarray, indices: np.ndarray, part: np.ndarray) -> int:
    """Undirected edges of a symmetric CSR whose endpoints lie in different partitions."""
    dst = np.repeat(part, np.diff(indptr))
    return int(np.count_nonzero(part[indices] != dst)) // 2
