"""Planetoid import: Cora's published statistics, Kipf/PyG assembly on a CiteSeer-style layout, bad files."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planetoid_files import write_planetoid  # noqa: E402

from hpcgnn.data.graph import read_graph  # noqa: E402
from hpcgnn.data.planetoid import load_planetoid  # noqa: E402
from hpcgnn.errors import InputError  # noqa: E402

CORA = Path(__file__).resolve().parents[2] / "inputs" / "data" / "cora"


def test_cora_reproduces_published_statistics(cora_graph):
    g = read_graph(cora_graph)
    assert g.num_nodes == 2708
    assert g.num_edges == 10556 and g.num_edges // 2 == 5278
    assert g.num_features == 1433 and g.num_classes == 7
    assert (int(g.train_mask.sum()), int(g.val_mask.sum()), int(g.test_mask.sum())) == (140, 500, 1000)
    assert np.bincount(g.labels, minlength=7).tolist() == [351, 217, 418, 818, 426, 298, 180]
    assert np.bincount(g.labels[g.train_mask], minlength=7).tolist() == [20] * 7
    assert set(np.unique(g.features).tolist()) == {0.0, 1.0}
    assert int(np.count_nonzero(g.features)) == 49216
    # the public split: train = first 140, val = next 500, test = sorted test.index
    np.testing.assert_array_equal(np.nonzero(g.train_mask)[0], np.arange(140))
    np.testing.assert_array_equal(np.nonzero(g.val_mask)[0], np.arange(140, 640))
    test_ids = np.loadtxt(CORA / "ind.cora.test.index", dtype=np.int64)
    np.testing.assert_array_equal(np.nonzero(g.test_mask)[0], np.sort(test_ids))
    assert g.meta["source"]["importer"] == "planetoid" and g.meta["name"] == "cora"
    # symmetric, loop-free, sorted rows
    rows = np.repeat(np.arange(g.num_nodes), g.degree())
    key = rows * g.num_nodes + g.indices
    assert np.all(np.diff(key) > 0) and not np.any(rows == g.indices)
    np.testing.assert_array_equal(np.sort(g.indices * g.num_nodes + rows), key)


def kipf_reference(allx, ally, tx, ty, test_index):
    """Kipf's gcn/utils.py load_data (dense numpy), CiteSeer branch included."""
    test_range = np.sort(test_index)
    lo, hi = test_range.min(), test_range.max()
    tx_ext = np.zeros((hi - lo + 1, tx.shape[1]))
    tx_ext[test_range - lo] = tx
    ty_ext = np.zeros((hi - lo + 1, ty.shape[1]))
    ty_ext[test_range - lo] = ty
    features = np.vstack([allx, tx_ext])
    features[test_index] = features[test_range]
    labels = np.vstack([ally, ty_ext])
    labels[test_index] = labels[test_range]
    return features, labels


def make_citeseer_like(tmp_path, gaps=(3, 11, 12)):
    rng = np.random.default_rng(0)
    n_all, span, f, c, n_train = 520, 20, 6, 4, 16
    allx = (rng.random((n_all, f)) < 0.3).astype(np.float32) * rng.integers(1, 4, (n_all, f))
    ally = np.eye(c)[rng.integers(0, c, n_all)]
    test_index = np.array([n_all + i for i in range(span) if i not in gaps])
    rng.shuffle(test_index)
    tx = (rng.random((test_index.size, f)) < 0.5).astype(np.float32)
    ty = np.eye(c)[rng.integers(0, c, test_index.size)]
    n = n_all + span
    graph = {v: list(rng.integers(0, n, rng.integers(0, 4))) for v in range(n)}
    graph[5] = [5, 7, 7]  # a self-loop and a duplicate
    graph[7] = [5]
    d = write_planetoid(tmp_path / "tiny", "tiny", allx, ally, n_train, tx, ty, test_index, graph)
    return d, (allx, ally, tx, ty, test_index, graph, n_train, gaps, n_all)


def test_citeseer_style_layout_matches_kipf_loader(tmp_path):
    d, (allx, ally, tx, ty, test_index, graph, n_train, gaps, n_all) = make_citeseer_like(tmp_path)
    g = load_planetoid(d, "tiny")
    g.validate()
    want_x, want_onehot = kipf_reference(allx, ally, tx, ty, test_index)
    np.testing.assert_array_equal(g.features, want_x.astype(np.float32))
    want_labels = np.where(want_onehot.any(axis=1), want_onehot.argmax(axis=1), -1)
    np.testing.assert_array_equal(g.labels, want_labels)
    padded = n_all + np.array(gaps)
    assert np.all(g.labels[padded] == -1) and not g.features[padded].any()
    np.testing.assert_array_equal(np.nonzero(g.train_mask)[0], np.arange(n_train))
    np.testing.assert_array_equal(np.nonzero(g.val_mask)[0], np.arange(n_train, n_train + 500))
    np.testing.assert_array_equal(np.nonzero(g.test_mask)[0], np.sort(test_index))
    assert g.meta["source"]["padded_test_ids"] == len(gaps)
    pairs = {(min(u, v), max(u, v)) for u, vs in graph.items() for v in vs if u != v}
    rows = np.repeat(np.arange(g.num_nodes), g.degree())
    got = {(int(a), int(b)) for a, b in zip(rows, g.indices) if a < b}
    assert got == pairs and g.num_edges == 2 * len(pairs)
    assert g.meta["self_loops_removed"] == 2


def test_missing_and_malformed_files(tmp_path):
    d, _ = make_citeseer_like(tmp_path)
    with pytest.raises(InputError, match=r"ind\.other\.x: file not found"):
        load_planetoid(d, "other")
    (d / "ind.tiny.tx").write_text("this is not a pickle\n")
    with pytest.raises(InputError, match=r"ind\.tiny\.tx: not a Planetoid pickle"):
        load_planetoid(d, "tiny")
    (d / "ind.tiny.tx").write_bytes(pickle.dumps(Path("/etc/passwd"), protocol=2))
    with pytest.raises(InputError, match=r"ind\.tiny\.tx: not a Planetoid pickle .*unexpected class pathlib"):
        load_planetoid(d, "tiny")
    (d / "ind.tiny.tx").write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    with pytest.raises(InputError, match=r"ind\.tiny\.tx: holds list, expected a sparse feature matrix"):
        load_planetoid(d, "tiny")


def test_graph_ids_out_of_range_and_bad_test_index(tmp_path):
    d, _ = make_citeseer_like(tmp_path)
    (d / "ind.tiny.graph").write_bytes(pickle.dumps({0: [1], 1: [540]}, protocol=2))
    with pytest.raises(InputError, match=r"ind\.tiny\.graph: .*vertex ID 540 is out of range, expected \[0, 540\)"):
        load_planetoid(d, "tiny")
    d, _ = make_citeseer_like(tmp_path / "b")
    (d / "ind.tiny.test.index").write_text("520\nabc\n")
    with pytest.raises(InputError, match=r"ind\.tiny\.test\.index: 'abc' is not an integer"):
        load_planetoid(d, "tiny")
