"""OGB raw-layout import on a tiny generated ogbn-style directory."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from hpcgnn.data.ogb import load_ogb
from hpcgnn.errors import InputError


def write_csv_gz(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        for row in rows:
            fh.write(",".join(str(v) for v in np.atleast_1d(row)) + "\n")


def make_ogb(root: Path, n=300, m=1500, f=5, c=6, seed=0):
    rng = np.random.default_rng(seed)
    edges = rng.integers(0, n, (m, 2))
    feats = rng.standard_normal((n, f)).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.float64)
    labels[rng.random(n) < 0.1] = np.nan
    labelled = np.nonzero(~np.isnan(labels))[0]
    perm = rng.permutation(labelled)
    train, val, test = perm[:100], perm[100:150], perm[150:]
    write_csv_gz(root / "raw" / "edge.csv.gz", edges)
    write_csv_gz(root / "raw" / "node-feat.csv.gz", [[repr(float(v)) for v in row] for row in feats])
    write_csv_gz(root / "raw" / "node-label.csv.gz", ["nan" if np.isnan(v) else int(v) for v in labels])
    write_csv_gz(root / "raw" / "num-node-list.csv.gz", [n])
    for name, idx in (("train", train), ("valid", val), ("test", test)):
        write_csv_gz(root / "split" / "random" / f"{name}.csv.gz", idx)
    return edges, feats, labels, (train, val, test)


def test_ogb_round_trip(tmp_path):
    root = tmp_path / "ogbn_tiny"
    edges, feats, labels, splits = make_ogb(root)
    g = load_ogb(root)
    g.validate()
    np.testing.assert_array_equal(g.features, feats)
    np.testing.assert_array_equal(g.labels, np.where(np.isnan(labels), -1, labels).astype(np.int64))
    assert g.num_classes == int(np.nanmax(labels)) + 1
    for mask, idx in zip((g.train_mask, g.val_mask, g.test_mask), splits):
        np.testing.assert_array_equal(np.nonzero(mask)[0], np.sort(idx))
    pairs = {(min(a, b), max(a, b)) for a, b in edges.tolist() if a != b}
    rows = np.repeat(np.arange(g.num_nodes), g.degree())
    assert {(int(a), int(b)) for a, b in zip(rows, g.indices) if a < b} == pairs
    assert g.num_edges == 2 * len(pairs)
    assert g.meta["source"] == {"importer": "ogb", "root": str(root), "split": "random", "input_edges": 1500}


def test_ogb_split_selection_and_errors(tmp_path):
    root = tmp_path / "ogbn_tiny"
    make_ogb(root)
    (root / "split" / "other").mkdir()
    with pytest.raises(InputError, match=r"2 split directories \(other, random\), pass --split NAME"):
        load_ogb(root)
    assert load_ogb(root, split="random").num_nodes == 300
    with pytest.raises(InputError, match=r"split 'nope' not found, available: other, random"):
        load_ogb(root, split="nope")
    write_csv_gz(root / "raw" / "node-label.csv.gz", [[1, 2]] * 300)
    with pytest.raises(InputError, match=r"node-label\.csv\.gz: 2 label columns, expected 1"):
        load_ogb(root, split="random")
    write_csv_gz(root / "raw" / "node-label.csv.gz", [1.5] + [1] * 299)
    with pytest.raises(InputError, match=r"node-label\.csv\.gz: label 1\.5 is out of range"):
        load_ogb(root, split="random")
    make_ogb(root)
    write_csv_gz(root / "raw" / "edge.csv.gz", [[0, 1], [2, 300]])
    with pytest.raises(InputError, match=r"edge\.csv\.gz: destination vertex ID 300 is out of range"):
        load_ogb(root, split="random")
    write_csv_gz(root / "raw" / "edge.csv.gz", [[0, 1], [2, "x"]])
    with pytest.raises(InputError, match=r"edge\.csv\.gz: line 2 is not integers: '2,x'"):
        load_ogb(root, split="random")
    (root / "raw" / "node-feat.csv.gz").unlink()
    with pytest.raises(InputError, match=r"node-feat\.csv\.gz: file not found"):
        load_ogb(root, split="random")
