"""`hpcgnn inspect`: JSON and text summaries of graph files and partition stores."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.data.graph import read_graph
from hpcgnn.partition import balance as bal
from hpcgnn.partition.store import META_FILE, load_partition, read_meta


def inspect_json(path, capsys) -> dict:
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_graph_json(graph_files, capsys):
    path = graph_files["isolated"]
    g = read_graph(path)
    s = inspect_json(path, capsys)
    assert s["kind"] == "graph" and s["name"] == "community"
    assert (s["num_nodes"], s["num_edges"], s["num_undirected_edges"]) == (g.num_nodes, g.num_edges,
                                                                         g.num_edges // 2)
    assert (s["num_features"], s["num_classes"]) == (g.num_features, g.num_classes)
    assert s["split"] == {"train": int(g.train_mask.sum()), "val": int(g.val_mask.sum()),
                          "test": int(g.test_mask.sum())}
    assert s["labelled"] == int((g.labels >= 0).sum())
    deg = g.degree()
    assert s["degree"] == {"mean": pytest.approx(deg.mean()), "max": int(deg.max()), "isolated": 25}


def test_inspect_partitions_json(graph_files, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["partition", str(graph_files["plain"]), "--parts", "3", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    s = inspect_json(out, capsys)
    assert s == inspect_json(out / META_FILE, capsys)  # meta.h5 names its store
    meta = read_meta(out)
    g = read_graph(graph_files["plain"])
    part_of = np.empty(g.num_nodes, dtype=np.int64)
    part_of[meta.new_to_orig()] = np.searchsorted(meta.part_offsets, np.arange(g.num_nodes), side="right") - 1
    assert s["kind"] == "partitions" and s["num_parts"] == 3 and s["method"] == "metis"
    assert s["edge_cut"] == bal.edge_cut(g.indptr, g.indices, part_of)
    assert s["edge_cut_fraction"] == pytest.approx(s["edge_cut"] / (g.num_edges // 2))
    assert set(s["balance"]) == {"vertices", "train", "edges"}
    expect = bal.balance(part_of, 3, g.degree(), g.train_mask)
    for key in expect:
        assert s["balance"][key] == pytest.approx(expect[key])
    assert s["constraints"] == ["vertices", "train", "edges"]
    parts = [load_partition(out, p) for p in range(3)]
    assert [p["num_halo"] for p in s["parts"]] == [pt.num_halo for pt in parts]
    assert [p["num_solid"] for p in s["parts"]] == [pt.num_solid for pt in parts]
    assert [p["num_edges"] for p in s["parts"]] == [int(pt.indptr[-1]) for pt in parts]
    assert [p["num_train"] for p in s["parts"]] == [int(pt.train_mask.sum()) for pt in parts]
    assert [p["num_send"] for p in s["parts"]] == [pt.send_ids.size for pt in parts]
    assert s["halo_total"] == sum(pt.num_halo for pt in parts)
    assert s["replication_factor"] == pytest.approx((g.num_nodes + s["halo_total"]) / g.num_nodes)
    assert s["content_hash"] == meta.content_hash


def test_inspect_text(graph_files, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["partition", str(graph_files["plain"]), "--parts", "2", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "edge cut" in text and "replication factor" in text and "balance (max/mean): vertices" in text
    assert main(["inspect", str(graph_files["plain"])]) == 0
    assert "split train" in capsys.readouterr().out


def test_inspect_bad_paths_exit_2(tmp_path, capsys):
    junk = tmp_path / "junk.h5"
    junk.write_text("no")
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "other"
    empty = tmp_path / "emptydir"
    empty.mkdir()
    for path, message in [(tmp_path / "missing", "file not found"), (junk, "not a readable HDF5 file"),
                          (other, "attribute 'format' is 'other'"), (empty, "has no meta.h5")]:
        assert main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and message in err, err


def test_inspect_cora(cora_graph, cora_parts, capsys):
    store = cora_parts(2)
    capsys.readouterr()
    s = inspect_json(cora_graph, capsys)
    assert (s["num_nodes"], s["num_edges"], s["num_features"], s["num_classes"]) == (2708, 10556, 1433, 7)
    assert s["split"] == {"train": 140, "val": 500, "test": 1000}
    p = inspect_json(store, capsys)
    assert p["num_parts"] == 2 and p["num_nodes"] == 2708
    assert sum(part["num_solid"] for part in p["parts"]) == 2708
    assert sum(part["num_train"] for part in p["parts"]) == 140
    assert 1.0 < p["replication_factor"] < 1.5
    assert max(p["balance"].values()) <= 1.05
