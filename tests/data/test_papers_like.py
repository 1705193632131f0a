"""papers-like: ogbn-papers100M's shape times --scale, generated to disk through the external
sort; a seed fixes it, and its degrees are skewed (measured here at scale 0.0005, 55.5k
vertices: the top 1 % of vertices hold 9.1 % of the edge endpoints and the largest degree is
14x the mean, against 1.5 % and 1.8x for uniform random edges)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.data.graph import read_graph
from hpcgnn.data.synthetic import PAPERS_SHAPE, papers_like_params
from hpcgnn.errors import InputError

SCALE = "0.0005"


def digest(path) -> str:
    import h5py

    with h5py.File(path) as f:
        return hashlib.sha256(f.attrs["dataset_hashes"].encode()).hexdigest()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("papers")
    paths = {}
    for key, extra in {"a": [], "again": ["--memory-budget", "6MB"], "seed1": ["--seed", "1"]}.items():
        paths[key] = d / f"{key}.h5"
        assert main(["prepare", "--dataset", "papers-like", "--scale", SCALE, *extra, "--out", str(paths[key])]) == 0
    return paths


def test_shape_is_papers100m_times_the_scale(prepared):
    g = read_graph(prepared["a"])
    s = float(SCALE)
    assert g.num_nodes == round(PAPERS_SHAPE["nodes"] * s) and g.num_features == 128 and g.num_classes == 172
    assert [int(m.sum()) for m in (g.train_mask, g.val_mask, g.test_mask)] == \
        [round(PAPERS_SHAPE[k] * s) for k in ("train", "val", "test")]
    # undirected draws before cleaning; a few percent are self-loops or repeats
    draws = round(PAPERS_SHAPE["edges"] * s)
    assert g.num_edges + g.meta["self_loops_removed"] + g.meta["duplicates_removed"] == 2 * draws
    assert g.num_edges > 1.8 * draws
    labelled = g.labels >= 0   # as in ogbn-papers100M, only the split vertices have labels
    assert np.array_equal(labelled, g.train_mask | g.val_mask | g.test_mask)


def test_a_seed_fixes_the_graph_whatever_the_budget(prepared):
    assert digest(prepared["a"]) == digest(prepared["again"])     # in memory vs sorted on disk
    assert digest(prepared["a"]) != digest(prepared["seed1"])


def test_degrees_are_skewed(prepared):
    g = read_graph(prepared["a"])
    deg = np.sort(g.degree())[::-1]
    top = deg[:deg.shape[0] // 100].sum() / deg.sum()
    assert top >= 0.07, top                      # uniform random edges: 0.015
    assert deg.max() >= 10 * deg.mean(), (deg.max(), deg.mean())


def test_scale_is_checked():
    with pytest.raises(InputError, match=r"--scale is 1\.5, expected 0 < scale <= 1"):
        papers_like_params(1.5)
