"""OGB's binary layout (raw/data.npz, raw/node-label.npz, split csv.gz or split_dict.pt) read in
blocks: the same graph file as the CSV layout of the same data, whether the archive members are
deflated (np.savez_compressed, as OGB writes them) or stored; a truncated or corrupt archive is
one line naming the file, exit 2."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.data.graph import read_graph
from hpcgnn.data.npz import NpzArchive
from hpcgnn.errors import InputError

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_ogb import make_ogb  # noqa: E402

DATASETS = ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask")


def make_binary(root, edges, feats, labels, csv_root, compressed=True, fortran=False, split_dict=False):
    (root / "raw").mkdir(parents=True)
    save = np.savez_compressed if compressed else np.savez
    edge_index = edges.T.astype(np.int64)
    save(root / "raw" / "data.npz", edge_index=np.asfortranarray(edge_index) if fortran else edge_index,
         node_feat=feats, node_year=np.full((feats.shape[0], 1), 2020, np.int64),
         num_nodes_list=np.array([feats.shape[0]], np.int64), num_edges_list=np.array([edges.shape[0]], np.int64))
    save(root / "raw" / "node-label.npz", node_label=labels.reshape(-1, 1))
    if split_dict:
        import gzip

        import torch

        d = root / "split" / "random"
        d.mkdir(parents=True)
        split = {}
        for name in ("train", "valid", "test"):
            with gzip.open(csv_root / "split" / "random" / f"{name}.csv.gz", "rt") as fh:
                split[name] = np.array([int(x) for x in fh.read().split()], dtype=np.int64)
        torch.save(split, d / "split_dict.pt")
    else:
        shutil.copytree(csv_root / "split", root / "split")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ogb")
    edges, feats, labels, _ = make_ogb(d / "csv")
    roots = {"csv": d / "csv"}
    for key, kw in {"compressed": {}, "stored": {"compressed": False},
                    "fortran": {"compressed": False, "fortran": True},
                    "split_dict": {"split_dict": True}}.items():
        roots[key] = d / key
        make_binary(roots[key], edges, feats, labels, d / "csv", **kw)
    return roots


@pytest.mark.parametrize("layout", ["compressed", "stored", "fortran", "split_dict"])
def test_binary_layout_equals_csv_layout(layouts, layout, tmp_path):
    ref, out = tmp_path / "csv.h5", tmp_path / "bin.h5"
    assert main(["prepare", "--dataset", "ogb", "--root", str(layouts["csv"]), "--out", str(ref)]) == 0
    # 100 kB: the edges are sorted in several runs
    assert main(["prepare", "--dataset", "ogb", "--root", str(layouts[layout]), "--memory-budget", "100KB",
                 "--out", str(out)]) == 0
    a, b = read_graph(ref), read_graph(out)
    for name in DATASETS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert (a.num_classes, a.meta["self_loops_removed"], a.meta["duplicates_removed"]) == \
        (b.num_classes, b.meta["self_loops_removed"], b.meta["duplicates_removed"])
    assert b.meta["source"]["layout"] == "binary" and b.meta["source"]["input_edges"] == 1500


def test_npz_members_are_read_in_blocks(layouts):
    for key in ("compressed", "stored"):
        with NpzArchive(layouts[key] / "raw" / "data.npz") as a:
            m = a.member("node_feat", 2)
            assert m.stored == (key == "stored") and m.shape == (300, 5) and m.dtype == np.float32
            whole = np.load(layouts[key] / "raw" / "data.npz")["node_feat"].ravel()
            blocks = list(m.blocks(7, 1000, block=64))
            assert max(b.shape[0] for b in blocks) == 64
            assert np.array_equal(np.concatenate(blocks), whole[7:1007])
            if key == "stored":
                assert m.data_offset is not None


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpcgnn: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("damage", ["truncated", "corrupt member", "truncated stored"])
def test_damaged_archive_is_one_line_naming_the_file(layouts, damage, tmp_path, capsys):
    root = tmp_path / "ogb"
    shutil.copytree(layouts["stored" if damage == "truncated stored" else "compressed"], root)
    path = root / "raw" / "data.npz"
    raw = bytearray(path.read_bytes())
    if damage == "corrupt member":
        with NpzArchive(path) as a:
            info = a.member("edge_index").info
        at = info.header_offset + 30 + len(info.filename) + 200   # inside the deflated edge_index
        raw[at:at + 16] = bytes(16)
        path.write_bytes(bytes(raw))
    else:
        path.write_bytes(bytes(raw[:len(raw) // 2]))
    out = tmp_path / "g.h5"
    assert main(["prepare", "--dataset", "ogb", "--root", str(root), "--out", str(out)]) == 2
    line = one_error_line(capsys)
    if damage == "corrupt member":
        assert line.startswith(f"hpcgnn: error: {path}: member 'edge_index' cannot be read ("), line
    else:
        assert line.startswith(f"hpcgnn: error: {path}: not a readable .npz archive ("), line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ogb"]


def test_binary_layout_errors(layouts, tmp_path):
    from hpcgnn.data.ogb import ogb_binary_source

    root = tmp_path / "ogb"
    shutil.copytree(layouts["stored"], root)
    np.savez(root / "raw" / "node-label.npz", node_label=np.zeros((299, 1)))
    with pytest.raises(InputError, match=r"node-label\.npz: 'node_label' has shape \(299, 1\), expected \(300, 1\)"):
        ogb_binary_source(root)
    np.savez(root / "raw" / "data.npz", edge_index=np.zeros((3, 4), np.int64))
    with pytest.raises(InputError, match=r"data\.npz: array 'num_nodes_list' not found"):
        ogb_binary_source(root)
