"""`hpcgnn prepare` end to end: written files and metadata, and one-line exit-2 errors for bad input."""
from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpiutil import ROOT, run_cli  # noqa: E402

from hpcgnn.cli import main  # noqa: E402
from hpcgnn.data.graph import read_graph  # noqa: E402

SBM_ARGS = ["--dataset", "sbm", "--nodes", "20000", "--edges", "200000", "--features", "64",
            "--classes", "8", "--seed", "0"]


def test_makefile_sbm_invocation_and_metadata(tmp_path, capsys):
    out = tmp_path / "synthetic-small.h5"
    assert main(["prepare", *SBM_ARGS, "--out", str(out), "--force"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    g = read_graph(out)
    assert (g.num_nodes, g.num_features, g.num_classes) == (20000, 64, 8)
    with h5py.File(out, "r") as f:
        source = json.loads(f.attrs["source"])
        assert f.attrs["format"] == "hpcgnn-graph" and f.attrs["name"] == "sbm"
        assert int(f.attrs["num_edges"]) == g.num_edges and bool(f.attrs["symmetrized"])
        removed = int(f.attrs["self_loops_removed"]) + int(f.attrs["duplicates_removed"])
    assert source["generator"] == "sbm" and source["seed"] == 0 and source["edges"] == 200000
    assert source["p_in"] == 0.7 and source["train"] == 0.1
    assert g.num_edges + removed == 2 * 200000
    # same command again: refused without --force, identical with it
    before = out.read_bytes()
    assert main(["prepare", *SBM_ARGS, "--out", str(out)]) == 2
    assert out.read_bytes() == before
    assert main(["prepare", *SBM_ARGS, "--out", str(out), "--force"]) == 0
    g2 = read_graph(out)
    assert np.array_equal(g.indices, g2.indices) and np.array_equal(g.features, g2.features)


def test_files_dataset_through_the_cli(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((20, 3)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 2, 20))
    np.save(tmp_path / "tr.npy", np.arange(5))
    (tmp_path / "e.tsv").write_text("# u v\n0\t1\n1\t2\n2\t0\n19\t3\n")
    out = tmp_path / "g.h5"
    assert main(["prepare", "--dataset", "files", "--edges", str(tmp_path / "e.tsv"), "--features",
                 str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"), "--train", str(tmp_path / "tr.npy"),
                 "--out", str(out)]) == 0
    g = read_graph(out)
    assert g.num_edges == 8 and int(g.train_mask.sum()) == 5 and g.meta["source"]["importer"] == "files"


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """A directory of broken inputs for the error cases."""
    d = tmp_path_factory.mktemp("bad")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, 3)).astype(np.float32)
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", rng.integers(0, 3, 10))
    np.save(d / "e.npy", np.array([[0, 1], [1, 2]]))
    np.save(d / "neg.npy", np.array([[0, 1], [-1, 2]]))
    np.save(d / "oob.npy", np.array([[0, 10], [1, 2]]))
    (d / "text.npy").write_text("0 1\n1 2\n")
    np.savez(d / "keys.npz", u=np.array([0]), v=np.array([1]))
    x[3, 1] = np.nan
    np.save(d / "nan.npy", x)
    np.save(d / "ybad.npy", np.array([0, 1, 2, 7, 0, 1, 2, 0, 1, 2]))
    np.save(d / "mask9.npy", np.zeros(9, dtype=bool))
    (d / "adir").mkdir()
    (d / "fake" / "cora").mkdir(parents=True)
    for part in ("x", "y", "tx", "ty", "allx", "ally", "graph"):
        (d / "fake" / "cora" / f"ind.cora.{part}").write_bytes(pickle.dumps({"not": "planetoid"}, protocol=2))
    (d / "fake" / "cora" / "ind.cora.test.index").write_text("1\n")
    return d


def files_args(d, **over):
    base = {"edges": "e.npy", "features": "x.npy", "labels": "y.npy", **over}
    args = ["--dataset", "files"]
    for k, v in base.items():
        args += [f"--{k.replace('_', '-')}", str(d / v) if isinstance(v, str) and v.endswith((".npy", ".npz", "adir"))
                 else str(v)]
    return args


CASES = {
    "missing file": (lambda d: files_args(d, edges="nope.npy"), r"nope\.npy: edge list file not found"),
    "directory as file": (lambda d: files_args(d, features="adir"), r"adir: is a directory, expected the features"),
    "text as npy": (lambda d: files_args(d, features="text.npy"), r"text\.npy: not a readable \.npy array"),
    "npz keys": (lambda d: files_args(d, edges="keys.npz"), r"keys\.npz: archive has arrays \['u', 'v'\]"),
    "negative id": (lambda d: files_args(d, edges="neg.npy"), r"neg\.npy: source vertex ID -1 is out of range"),
    "id too large": (lambda d: files_args(d, edges="oob.npy"), r"oob\.npy: destination vertex ID 10 is out of range"),
    "nan features": (lambda d: files_args(d, features="nan.npy"),
                     r"nan\.npy: features hold NaN or inf \(first at row 3\)"),
    "labels range": (lambda d: files_args(d, labels="ybad.npy", num_classes=3), r"ybad\.npy: label 7 is out of range"),
    "mask length": (lambda d: files_args(d, val="mask9.npy"), r"mask9\.npy: val mask has length 9, expected 10"),
    "not planetoid": (lambda d: ["--dataset", "cora", "--root", str(d / "fake")],
                      r"ind\.cora\.x: holds dict, expected a sparse feature matrix"),
    "missing dataset": (lambda d: ["--dataset", "citeseer", "--root", str(ROOT / "inputs" / "data")],
                        r"citeseer: Planetoid directory not found"),
    "unknown dataset": (lambda d: ["--dataset", "imagenet"], r"--dataset 'imagenet' is unknown"),
    "ogb missing raw": (lambda d: ["--dataset", "ogb", "--root", str(d)], r"raw: directory not found \(OGB layout"),
    "no root": (lambda d: ["--dataset", "ogb"], r"--dataset ogb needs --root DIR"),
    "foreign option": (lambda d: [*SBM_ARGS, "--root", str(d)], r"--root does not apply to --dataset sbm"),
    "bad number": (lambda d: ["--dataset", "sbm", "--nodes", "many"], r"--nodes is 'many', expected an integer"),
    "bad fraction": (lambda d: ["--dataset", "rmat", "--nodes", "100", "--train", "0.9", "--val", "0.5"],
                     r"select 220 vertices, more than --nodes \(100\)"),
    "no files": (lambda d: ["--dataset", "files", "--edges", str(d / "e.npy")], r"--dataset files needs --features"),
    "bad flip": (lambda d: ["--dataset", "products-like", "--scale", "0.001", "--edge-flip", "1.5"],
                 r"--edge-flip is 1\.5, expected a fraction in \[0, 1\]$"),
    "flip on rmat": (lambda d: ["--dataset", "rmat", "--feature-flip", "0.1"],
                     r"--feature-flip does not apply to --dataset rmat"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, bad, tmp_path, capsys):
    make_args, pattern = CASES[case]
    out = tmp_path / "out.h5"
    rc = main(["prepare", *make_args(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpcgnn: error: "), err
    assert "Traceback" not in err
    import re

    assert re.search(pattern, lines[0]), lines[0]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_existing_output_refused_in_a_real_process(tmp_path):
    out = tmp_path / "cora.h5"
    out.write_bytes(b"keep me")
    proc = run_cli(["prepare", "--dataset", "cora", "--root", ROOT / "inputs" / "data", "--out", out])
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"hpcgnn: error: {out}: output already exists (pass --force to replace it)"
    assert out.read_bytes() == b"keep me"
    proc = run_cli(["prepare", "--dataset", "cora", "--root", ROOT / "inputs" / "data", "--out",
                    tmp_path / "missing" / "x.h5"])
    assert proc.returncode == 2 and "parent directory" in proc.stderr and "Traceback" not in proc.stderr
    assert main(["prepare", "--dataset", "cora", "--root", str(ROOT / "inputs" / "data"), "--out", str(tmp_path),
                 "--force"]) == 2
