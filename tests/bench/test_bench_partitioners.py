"""`python -m benchmarks.partitioners` end to end on a tiny graph: table printed, figures written."""
from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np

from hpcgnn.cli import main


def test_partitioners_benchmark_writes_its_figures(tmp_path):
    graph = tmp_path / "g.h5"
    assert main(["prepare", "--dataset", "sbm", "--nodes", "3000", "--edges", "30000", "--features", "8",
                 "--out", str(graph)]) == 0
    out = tmp_path / "bench" / "partitioners.h5"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.partitioners", str(graph), "--out", str(out),
                           "--parts", "2", "4", "--budget", "1MiB"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "auto->kaminpar" in proc.stdout and "method auto: kaminpar: " in proc.stdout and "wrote" in proc.stdout
    with h5py.File(out, "r") as f:
        assert [s.decode() for s in f["requested"][()]] == ["metis", "kaminpar", "metis", "kaminpar", "auto"]
        assert [s.decode() for s in f["method"][()]] == ["metis", "kaminpar", "metis", "kaminpar", "kaminpar"]
        assert f["parts"][()].tolist() == [2, 2, 4, 4, 2]
        for c in ("vertices", "train", "edges"):
            assert np.all(f[f"balance_{c}"][()] <= 1.05)
        assert np.all((f["edge_cut_ratio"][()] > 0) & (f["edge_cut_ratio"][()] < 1))
        assert np.all(f["wall_seconds"][()] > 0) and np.all(f["peak_rss_bytes"][()] > 0)
        assert f["method_choice"][-1].decode().startswith("method auto: kaminpar")
    assert sorted(p.name for p in (tmp_path / "bench").iterdir()) == ["partitioners.h5"]
