"""`python -m benchmarks.fullgraph` end to end on a tiny products-like graph (PyG skipped)."""
from __future__ import annotations

import subprocess

import h5py
from mpiutil import clean_env, python


def test_fullgraph_benchmark_writes_its_figures(tmp_path):
    out = tmp_path / "fg.h5"
    cmd = [*python(), "-m", "benchmarks.fullgraph", "--out", str(out), "--work", str(tmp_path / "work"),
           "--scale", "0.002", "--epochs", "2", "--rounds", "1", "--skip-pyg", "--offload-chunks", "1,4",
           "--bw-nodes", "20000", "--bw-edges", "100000", "--bw-repeats", "1", "--parts", "2", "--chunks", "4",
           "--batch-chunks", "1,2", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "aggregation bandwidth (uniform_4k_pages)" in proc.stdout
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == "hpcgnn-bench-fullgraph"
        assert f["epoch_time/hpcgnn_in_memory"].attrs["epoch_s"] > 0
        peaks = [f[f"offload/chunks_{n:02d}"].attrs["peak_device_bytes"] for n in (1, 4)]
        assert peaks[1] < peaks[0]
        for n in (1, 4):
            assert f[f"offload/chunks_{n:02d}"].attrs["grad_rel_err_vs_in_memory"] < 1e-4
        cases = f["dedup/cases"]
        for key in cases:
            c = cases[key].attrs
            assert c["measured"] <= c["nodedup"]
            if c["dedup"]:
                assert abs(c["reduction"] - c["predicted_reduction"]) < 1e-9
        for key in ("uniform", "uniform_4k_pages", "local500"):
            b = f[f"bandwidth/{key}"].attrs
            assert b["max_abs_diff"] < 1e-3 and b["native_gbs"] > 0
        assert bool(f["bandwidth/uniform"].attrs["hugepages"]) and not bool(f["bandwidth/uniform_4k_pages"].attrs["hugepages"])
