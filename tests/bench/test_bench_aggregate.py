"""`make bench-aggregate` (benchmarks/aggregate.py) on the CPU: every (op, width, path) row is
timed, the table is printed and the HDF5 file holds the same rows; the torch path's output equals
the native kernels' on the benchmark's own block (so the paths time the same computation)."""
from __future__ import annotations

import subprocess

import h5py
import torch
from mpiutil import ROOT, clean_env, python

from benchmarks import aggregate as ba


def test_bench_aggregate_writes_every_row(tmp_path):
    out = tmp_path / "agg.h5"
    proc = subprocess.run([*python(), "-m", "benchmarks.aggregate", "--nodes", "600", "--degree", "4",
                           "--widths", "8,12", "--repeats", "1", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = [ln.split() for ln in proc.stdout.splitlines()[3:]]
    assert [(r[0], int(r[1]), r[2]) for r in table] == [(op, w, p) for op in ba.OPS for w in (8, 12)
                                                         for p in ba.PATHS]
    assert all(float(r[3]) > 0 for r in table)                   # ms fwd+bwd, every row timed
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == "hpcgnn-bench-aggregate" and f.attrs["device"] == "cpu"
        rows = [f["rows"][k] for k in sorted(f["rows"])]
        assert len(rows) == len(table) and all(r.attrs["ms"] > 0 and r.attrs["error"] == "" for r in rows)


def test_the_paths_compute_the_same_sum():
    from hpcgnn.nn import aggregate as agg

    blk = ba.random_block(500, 6, seed=1, device="cpu")
    assert blk.num_edges == 3000 and int(blk.indices.max()) < 500
    x, w = torch.randn(500, 8), torch.rand(3000)
    torch.testing.assert_close(agg.aggregate_sum(blk, x, w, backend="torch"),
                               agg.aggregate_sum(blk, x, w, backend="native"), rtol=1e-5, atol=1e-5)
