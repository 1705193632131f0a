"""`python -m benchmarks.partition` end to end on a tiny graph: table printed, figures written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np


def test_partition_benchmark_writes_its_figures(tmp_path):
    out = tmp_path / "bench" / "partition.h5"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.partition", "--out", str(out), "--nodes", "3000",
                           "--edges", "30000", "--features", "8", "--parts", "2", "4", "--niter", "3", "10",
                           "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "partition-4-niter10" in proc.stdout and "wrote" in proc.stdout
    with h5py.File(out, "r") as f:
        steps = [s.decode() for s in f["step"][()]]
        assert steps == ["prepare", "partition-2", "partition-4", "partition-2-niter10", "partition-4-niter10"]
        assert f["parts"][()].tolist() == [0, 2, 4, 2, 4]
        assert f["niter"][()].tolist() == [0, 3, 3, 10, 10]
        assert np.all(f["wall_seconds"][()] > 0) and np.all(f["peak_rss_bytes"][()] > 0)
        report = json.loads(f["partition-4"].attrs["report"])
        assert set(report["balance"]) == {"vertices", "train", "edges"}
        assert all(v <= 1.05 for v in report["balance"].values())
    assert not list(tmp_path.glob("hpcgnn-bench-partition.*")), "work directory left behind"
