"""`python -m benchmarks.minibatch` end to end on a tiny products-like graph (real mpiexec runs)."""
from __future__ import annotations

import subprocess

import h5py
from mpiutil import clean_env, python


def test_minibatch_benchmark_writes_its_figures(tmp_path):
    out = tmp_path / "mb.h5"
    # Batch 100: each rank holds about 195 training vertices, so every epoch has >= 2 iterations
    # and AEP pushes (it pushes at iterations k < M - d, d = 1) whatever the partition's balance.
    cmd = [*python(), "-m", "benchmarks.minibatch", "--out", str(out), "--work", str(tmp_path / "work"),
           "--scale", "0.002", "--epochs", "2", "--runs", "hec-1,hec-2,exact-2",
           "--set", "minibatch.batch_size=100", "--set", "minibatch.cache_lines=10000", "--timeout", "240",
           "--store-budgets", "0.2", "--store-sync", ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "exact / AEP bytes per epoch" in proc.stdout
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == "hpcgnn-bench-minibatch" and f.attrs["epochs"] == 2
        assert f["hec-1"].attrs["bytes_sent_per_epoch"] == 0  # one rank sends nothing
        aep = f["hec-2"].attrs["aep_bytes_per_epoch"]
        exact = f["exact-2"].attrs["bytes_sent_per_epoch"]
        assert aep > 0 and exact > 0
        assert abs(f.attrs["exact_over_aep_bytes"] - exact / aep) < 1e-9
        for run in ("hec-1", "hec-2", "exact-2"):
            assert f[run].attrs["epoch_time_s"] > 0
        # the store section: host-only vs tiered at 20 % of the rank's features
        host, tiered = f["store-host"].attrs, f["store-0.2"].attrs
        assert host["store_mode"] == "host" and tiered["store_mode"] == "tiered"
        assert host["feature_hit_rate"] == 0 and 0.2 < tiered["feature_hit_rate"] < 1
        assert tiered["feature_h2d_bytes_per_epoch"] < host["feature_h2d_bytes_per_epoch"]
        assert host["test_acc"] == tiered["test_acc"]          # the same training in every layout
        assert 0 <= tiered["store_wait_share"] < 1
        assert f.attrs["store_prediction_error_points_max"] == abs(
            tiered["feature_hit_rate"] - tiered["predicted_feature_hit_rate"]) * 100
    assert "store run" in proc.stdout


def test_minibatch_benchmark_runs_on_a_given_store_and_refuses_a_wrong_one(cora_parts, tmp_path):
    store = cora_parts(2)
    work = tmp_path / "work"
    base = [*python(), "-m", "benchmarks.minibatch", "--out", str(tmp_path / "mb.h5"), "--work", str(work),
            "--epochs", "1", "--runs", "hec-2", "--store-budgets", "", "--peer-rounds", "0", "--timeout", "240"]
    for bad, says in ((f"3={store}", "has 2 parts, not 3"), (str(store), "expected K=DIR")):
        proc = subprocess.run(base + ["--store", bad], capture_output=True, text=True, timeout=120, env=clean_env())
        assert proc.returncode == 2 and says in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
        assert not (tmp_path / "mb.h5").exists()
    proc = subprocess.run(base + ["--store", f"2={store}"], capture_output=True, text=True, timeout=600,
                          env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the given store trained the run; no products-like graph or store was built
    assert not list(work.glob("products-like*"))
    with h5py.File(tmp_path / "mb.h5", "r") as f:
        assert f.attrs["num_nodes"] == 2708 and f.attrs["edge_cut_parts"] == 2
        assert f["hec-2"].attrs["epochs"] == 1
