"""Plain-file import: every edge format, masks as bools or indices, and the reader's errors."""
from __future__ import annotations

import numpy as np
import pytest

from hpcgnn.data.plain import load_files, read_edges, read_text_matrix
from hpcgnn.errors import InputError


@pytest.fixture
def raw(tmp_path):
    rng = np.random.default_rng(3)
    n, m = 50, 200
    edges = rng.integers(0, n, (m, 2))
    feats = rng.standard_normal((n, 4)).astype(np.float32)
    labels = rng.integers(0, 3, n)
    labels[[40, 45]] = -1
    np.save(tmp_path / "x.npy", feats)
    np.save(tmp_path / "y.npy", labels)
    train = np.zeros(n, dtype=bool)
    train[:10] = True
    np.save(tmp_path / "train.npy", train)
    np.save(tmp_path / "val.npy", np.array([10, 11, 12]))
    np.save(tmp_path / "test.npy", np.arange(20, 30))
    return tmp_path, edges, feats, labels


def edge_set(g):
    rows = np.repeat(np.arange(g.num_nodes), g.degree())
    return {(int(a), int(b)) for a, b in zip(rows, g.indices) if a < b}


def write_edge_files(d, edges):
    lines = "".join(f"{a},{b}\n" if i % 7 else f"# comment\n{a},{b} # trailing\n\n" for i, (a, b) in enumerate(edges))
    (d / "e.csv").write_text(lines)
    (d / "e.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in edges))
    np.save(d / "e.npy", edges)
    np.save(d / "et.npy", edges.T.astype(np.int32))
    np.savez(d / "e1.npz", src=edges[:, 0], dst=edges[:, 1])
    np.savez(d / "e2.npz", edges=edges)
    return ["e.csv", "e.tsv", "e.npy", "et.npy", "e1.npz", "e2.npz"]


def test_plain_files_round_trip(raw):
    d, edges, feats, labels = raw
    want = {(min(a, b), max(a, b)) for a, b in edges.tolist() if a != b}
    for name in write_edge_files(d, edges):
        src, dst = read_edges(d / name)
        np.testing.assert_array_equal(np.stack([src, dst], 1), edges)
        g = load_files(d / name, d / "x.npy", d / "y.npy", d / "train.npy", d / "val.npy", d / "test.npy")
        g.validate()
        assert edge_set(g) == want
        np.testing.assert_array_equal(g.features, feats)
        np.testing.assert_array_equal(g.labels, labels)
        assert g.num_classes == 3
        np.testing.assert_array_equal(np.nonzero(g.train_mask)[0], np.arange(10))
        np.testing.assert_array_equal(np.nonzero(g.val_mask)[0], [10, 11, 12])
        np.testing.assert_array_equal(np.nonzero(g.test_mask)[0], np.arange(20, 30))
    g = load_files(d / "e.npy", d / "x.npy", d / "y.npy", num_classes=5)
    assert g.num_classes == 5 and not (g.train_mask.any() or g.val_mask.any() or g.test_mask.any())


def test_text_reader_chunks_and_gzip(tmp_path, monkeypatch):
    import gzip

    import hpcgnn.data.plain as plain

    rng = np.random.default_rng(0)
    a = rng.integers(-10**12, 10**12, (5000, 3))
    text = "".join(f"{x} {y}\t{z}\n" for x, y, z in a).encode()
    (tmp_path / "a.txt").write_bytes(text[:-1])  # no final newline
    with gzip.open(tmp_path / "a.txt.gz", "wb") as fh:
        fh.write(text)
    monkeypatch.setattr(plain, "TEXT_CHUNK_BYTES", 1000)  # many chunks, lines split across reads
    for name in ("a.txt", "a.txt.gz"):
        np.testing.assert_array_equal(read_text_matrix(tmp_path / name, np.int64), a)


def test_corrupt_gzip(tmp_path):
    (tmp_path / "e.csv.gz").write_bytes(b"0,1\n1,2\n")
    with pytest.raises(InputError, match=r"e\.csv\.gz: cannot read the edge list file \(BadGzipFile"):
        read_edges(tmp_path / "e.csv.gz")
    import gzip

    (tmp_path / "t.csv.gz").write_bytes(gzip.compress(b"0,1\n1,2\n" * 1000)[:-20])
    with pytest.raises(InputError, match=r"t\.csv\.gz: cannot read the edge list file \(EOFError"):
        read_edges(tmp_path / "t.csv.gz")


@pytest.mark.parametrize("content,msg", [
    ("0,1\n1,2,3\n", "line 2 has 3 columns, expected 2"),
    ("src,dst\n0,1\n", "line 1 is not integers: 'src,dst'"),
    ("0,1\n2.5,3\n", "line 2 is not integers: '2.5,3'"),
    ("0,1\n\n7\n", "line 3 has 1 columns, expected 2"),
])
def test_malformed_edge_text(tmp_path, content, msg):
    (tmp_path / "e.csv").write_text(content)
    with pytest.raises(InputError, match="e.csv: " + msg.replace(".", r"\.")):
        read_edges(tmp_path / "e.csv")


def test_bad_plain_inputs(raw):
    d, edges, feats, labels = raw
    np.save(d / "e.npy", edges)
    base = dict(edges=d / "e.npy", features=d / "x.npy", labels=d / "y.npy")

    def fails(match, **kw):
        with pytest.raises(InputError, match=match):
            load_files(**{**base, **kw})

    (d / "fake.npy").write_text("0,1\n")
    fails(r"fake\.npy: not a readable \.npy array", features=d / "fake.npy")
    fails(r"missing\.npy: features file not found", features=d / "missing.npy")
    fails(r"e\.xyz: edge list file not found", edges=d / "e.xyz")
    (d / "e.xyz").write_text("0 1\n")
    fails(r"e\.xyz: unknown edge-list format", edges=d / "e.xyz")
    np.savez(d / "bad.npz", a=edges)
    fails(r"bad\.npz: archive has arrays \['a'\], expected 'src' and 'dst', or 'edges'", edges=d / "bad.npz")
    np.save(d / "neg.npy", np.array([[0, 1], [-2, 3]]))
    fails(r"neg\.npy: source vertex ID -2 is out of range, expected \[0, 50\)", edges=d / "neg.npy")
    np.save(d / "big.npy", np.array([[0, 1], [2, 50]]))
    fails(r"big\.npy: destination vertex ID 50 is out of range", edges=d / "big.npy")
    bad = feats.copy()
    bad[7, 2] = np.nan
    np.save(d / "nan.npy", bad)
    fails(r"nan\.npy: features hold NaN or inf \(first at row 7\)", features=d / "nan.npy")
    bad[7, 2] = np.inf
    np.save(d / "inf.npy", bad)
    fails(r"inf\.npy: features hold NaN or inf", features=d / "inf.npy")
    np.save(d / "y_bad.npy", np.where(np.arange(50) == 3, -2, labels))
    fails(r"y_bad\.npy: label -2 is out of range", labels=d / "y_bad.npy")
    fails(r"y\.npy: label 2 is out of range, expected -1 or a class in \[0, 2\)", num_classes=2)
    np.save(d / "short.npy", np.zeros(49, dtype=bool))
    fails(r"short\.npy: train mask has length 49, expected 50", train=d / "short.npy")
    np.save(d / "oob.npy", np.array([3, 60]))
    fails(r"oob\.npy: val index 60 is out of range", val=d / "oob.npy")
    fails(r"test\.npy: test split overlaps the train split", train=d / "test.npy", test=d / "test.npy")
    np.save(d / "unl.npy", np.array([40]))
    fails(r"unl\.npy: train split selects unlabelled vertex 40", train=d / "unl.npy")
    fails(r"x\.npy: features have 50 rows, expected 60", num_nodes=60)
