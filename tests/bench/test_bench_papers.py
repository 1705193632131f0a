"""`make bench-papers` end to end on a tiny papers-like graph (4 ranks, 2 epochs of small batches):
every stage runs, the table is printed, the HDF5 file holds each stage's wall time and peaks (per
rank and summed for the MPI stages), and infer wrote exactly the test vertices' predictions
(sampled inference, the default), equal to those of the same rows written for every vertex. Then the fit of two result files."""
from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from benchmarks.launch import child_env, find_mpiexec


def test_bench_papers_end_to_end(tmp_path, monkeypatch, capsys):
    from benchmarks import papers

    monkeypatch.setenv("HPCGNN_THREADS", "1")
    out = tmp_path / "papers.h5"
    rc = papers.main(["--scale", "0.0002", "--ranks", "4", "--epochs", "2", "--out", str(out), "--timeout", "120",
                      "--set", "minibatch.batch_size=16", "--set", "model.hidden=32", "--keep-data"])
    assert rc == 0
    text = capsys.readouterr().out
    table = {ln.split()[0]: ln.split() for ln in text.splitlines()[text.splitlines().index(
        next(ln for ln in text.splitlines() if ln.startswith("stage "))) + 1:] if ln.split()}
    assert {"prepare", "partition", "train", "infer"} <= set(table)
    work = tmp_path / "papers-work"
    with h5py.File(work / "papers-like.h5", "r") as g:
        n, e = g["indptr"].shape[0] - 1, g["indices"].shape[0]
        test_ids = np.flatnonzero(g["test_mask"][()])
    assert n == round(papers.PAPERS_VERTICES * 0.0002)
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == papers.FORMAT and set(f) == {"prepare", "partition", "train", "infer"}
        assert (f.attrs["num_vertices"], f.attrs["num_edges"]) == (n, e) and f.attrs["ranks"] == 4
        for name in f:
            assert f[name].attrs["rc"] == 0 and f[name].attrs["wall_s"] > 0
            assert f[name].attrs["peak_rss_bytes"] > 30e6          # a Python process at least
            # the printed row is the file's
            assert float(table[name][1]) == pytest.approx(f[name].attrs["wall_s"], abs=0.051)
            assert float(table[name][2]) == pytest.approx(f[name].attrs["cpu_s"], abs=0.051) and f[name].attrs["cpu_s"] > 0
            assert float(table[name][3]) == pytest.approx(f[name].attrs["peak_rss_bytes"] / 2**30, abs=0.0051)
        assert f["partition"].attrs["method_choice"].startswith("method auto: ")
        assert f["partition"].attrs["method"] in ("metis", "kaminpar")
        assert "papers-like" in f["prepare"].attrs["summary"] and "memory budget" in f["prepare"].attrs["summary"]
        for name in papers.MPI_STAGES:
            per = f[name]["peak_rss_bytes_per_rank"][()]
            assert per.shape == (4,) and np.all(per > 100e6)
            assert f[name].attrs["peak_rss_bytes_sum"] == pytest.approx(per.sum())
            assert float(table[name][4]) == pytest.approx(per.sum() / 2**30, abs=0.0051)
            # the largest process of the stage (wait4) is at least every rank's own peak
            assert f[name].attrs["peak_rss_bytes"] >= 0.99 * per.max()
        tr = f["train"].attrs
        assert tr["epochs"] == 2 and tr["epoch_s"] > 0 and tr["eval_s"] > 0 and 0 <= tr["test_acc"] <= 1
        assert len(tr["peak_rss_phase"].split()) == 4
        assert f["infer"].attrs["rows"] == test_ids.size > 0
    # infer wrote the test vertices only, in graph order, with the predictions of the full output
    preds = work / "test-predictions.h5"
    full = tmp_path / "all.h5"
    proc = subprocess.run([find_mpiexec() or "mpiexec", "-n", "4", sys.executable, "-m", "hpcgnn", "infer",
                           str(work / "run"), "--what", "predictions", "--method", "sampled", "--out", str(full)],
                          env=child_env(HPCGNN_THREADS="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with h5py.File(preds, "r") as t, h5py.File(full, "r") as a:
        assert t.attrs["vertices"] == "test" and a.attrs["vertices"] == "all"
        assert t.attrs["method"] == a.attrs["method"] == "sampled"
        assert np.array_equal(t["vertex_ids"][()], test_ids)
        assert np.array_equal(t["predictions"][()], a["predictions"][()][test_ids])
    # --reuse: the kept graph and store, prepare and partition's figures kept, train and infer again
    with h5py.File(out, "r") as f:
        before = {name: dict(f[name].attrs) for name in ("prepare", "partition", "train")}
    assert papers.main(["--scale", "0.0002", "--ranks", "4", "--epochs", "1", "--out", str(out), "--timeout", "120",
                        "--set", "minibatch.batch_size=16", "--set", "model.hidden=32", "--keep-data",
                        "--reuse"]) == 0
    with h5py.File(out, "r") as f:
        for name in ("prepare", "partition"):
            assert dict(f[name].attrs) == before[name]
        assert f["train"].attrs["epochs"] == 1 and before["train"]["epochs"] == 2
        assert f["infer"].attrs["rc"] == 0
    capsys.readouterr()
    # the fit of two scales: a line through both points, projected to papers100M
    second = tmp_path / "papers-2.h5"
    with h5py.File(out, "r") as f, h5py.File(second, "w") as g:
        for k, v in f.attrs.items():
            g.attrs[k] = v
        g.attrs["num_edges"] = 2 * e
        g.attrs["num_vertices"] = 2 * n
        for name in f:
            f.copy(name, g)
            for k in ("wall_s", "peak_rss_bytes"):
                g[name].attrs[k] = 3 * f[name].attrs[k]
    points = papers.read_points([str(out), str(second)])
    rows = {r["quantity"]: r for r in papers.fit_and_project(points, [4, 16])}
    w = points[0]["prepare.wall_s"]
    # y = w at E, 3w at 2E: c = 2w / E, a = -w; S = 1: a + c * E1
    assert rows["prepare wall"]["c_per_edge"] == pytest.approx(2 * w / e)
    assert rows["prepare wall"]["s1"] == pytest.approx(-w + 2 * w / e * papers.PAPERS_EDGES)
    assert set(rows["train peak/rank"]["at_ranks"]) == {4, 16}
    assert papers.main(["--fit", str(out), str(second)]) == 0
    assert "projection to papers100M" in capsys.readouterr().out


def test_bench_papers_needs_a_scale(capsys):
    from benchmarks import papers

    with pytest.raises(SystemExit) as exc:
        papers.main(["--scale", "0"])
    assert exc.value.code == 2 and "--scale: expected 0 < S <= 1" in capsys.readouterr().err
