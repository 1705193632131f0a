"""Small random graphs and their partition stores for the full-graph and halo tests.

``toy_graph`` builds a connected-ish random undirected graph with features,
labels and split masks; ``toy_store`` writes it as a partition store with the
real writer (:func:`hpcgnn.partition.writer.write_store`) under a random or
contiguous assignment, so the tests exercise the same files ``hpcgnn
partition`` writes without running METIS.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.data.graph import Graph


def toy_graph(num_nodes: int = 300, avg_degree: float = 6.0, num_features: int = 12,
              num_classes: int = 5, seed: int = 0, window: int | None = None) -> Graph:
    """Random graph; ``window`` limits edges to ``|u - v| <= window`` (locality)."""
    rng = np.random.default_rng(seed)
    m = int(num_nodes * avg_degree / 2)
    src = rng.integers(0, num_nodes, m)
    if window:
        dst = np.clip(src + rng.integers(-window, window + 1, m), 0, num_nodes - 1)
    else:
        dst = rng.integers(0, num_nodes, m)
    ring = np.arange(num_nodes)
    src = np.concatenate([src, ring])
    dst = np.concatenate([dst, (ring + 1) % num_nodes])
    indptr, indices, _ = build_symmetric_csr(src, dst, num_nodes)
    labels = rng.integers(0, num_classes, num_nodes).astype(np.int64)
    features = rng.standard_normal((num_nodes, num_features)).astype(np.float32)
    split = rng.random(num_nodes)
    return Graph(indptr=indptr, indices=indices, features=features, labels=labels,
                 train_mask=split < 0.5, val_mask=(split >= 0.5) & (split < 0.75),
                 test_mask=split >= 0.75, num_classes=num_classes, meta={"name": "toy"})


def toy_store(out: Path, graph: Graph, num_parts: int, seed: int = 0, method: str = "random") -> Path:
    """Write ``graph`` partitioned into ``num_parts`` (random or contiguous) to directory ``out``."""
    from hpcgnn.partition.writer import write_store

    n = graph.num_nodes
    if method == "random":
        part = np.random.default_rng(seed + 1).integers(0, num_parts, n)
        part[:num_parts] = np.arange(num_parts)  # no empty partition
    else:
        part = (np.arange(n) * num_parts) // n
    write_store(out, graph, part, num_parts, method=method, seed=seed, constraints=(),
                source_graph="toy", source_hash="toy", force=True, progress=False)
    return Path(out)
