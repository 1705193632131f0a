"""Small graphs for the partition tests, built with numpy + build_symmetric_csr."""
from __future__ import annotations

import numpy as np
import pytest

from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.data.graph import Graph, write_graph


def community_graph(n: int = 2000, communities: int = 4, intra: int = 20000, inter: int = 400,
                    features: int = 8, classes: int = 5, seed: int = 0,
                    train_in_first: bool = False, isolated: int = 0) -> Graph:
    """Dense communities of consecutive IDs joined by a few random edges.

    With ``train_in_first`` every training vertex lies in community 0, so a partition that
    follows the communities (what unit-weight METIS finds) puts them all in one part.
    The last ``isolated`` vertices get no edges.
    """
    rng = np.random.default_rng(seed)
    m = n - isolated
    comm = np.arange(m) * communities // m
    size = m // communities
    s = rng.integers(0, m, intra)
    d = np.minimum(comm[s] * size + rng.integers(0, size, intra), m - 1)
    s2, d2 = rng.integers(0, m, inter), rng.integers(0, m, inter)
    indptr, indices, stats = build_symmetric_csr(np.r_[s, s2], np.r_[d, d2], n)
    r = rng.random(n)
    labels = rng.integers(0, classes, n)
    labels[rng.random(n) < 0.05] = -1
    if train_in_first:
        first = np.zeros(n, dtype=bool)
        first[:size] = True
        train = first & (r < 0.6)
    else:
        train = r < 0.3
    val = ~train & (r >= 0.6) & (r < 0.8)
    test = ~train & (r >= 0.8)
    train, val, test = (mask & (labels >= 0) for mask in (train, val, test))
    return Graph(indptr, indices, rng.standard_normal((n, features)).astype(np.float32), labels,
                 train, val, test, num_classes=classes,
                 meta={"name": "community", "source": {"generator": "test community_graph", "seed": seed},
                       **stats})


@pytest.fixture
def make_graph_file(tmp_path):
    """``make_graph_file(name, **community_graph kwargs)`` -> path of a written graph file."""

    def make(name: str = "g.h5", **kwargs):
        path = tmp_path / name
        write_graph(path, community_graph(**kwargs))
        return path

    return make


@pytest.fixture(scope="module")
def graph_files(tmp_path_factory):
    """Module-wide graph files: 'plain' (train spread) and 'skewed' (train in one community)."""
    d = tmp_path_factory.mktemp("graphs")
    paths = {
        "plain": d / "plain.h5",
        "skewed": d / "skewed.h5",
        "isolated": d / "isolated.h5",
    }
    write_graph(paths["plain"], community_graph(seed=1))
    write_graph(paths["skewed"], community_graph(n=4000, intra=40000, inter=800, seed=2, train_in_first=True))
    write_graph(paths["isolated"], community_graph(n=600, intra=3000, inter=50, seed=3, isolated=25))
    return paths
