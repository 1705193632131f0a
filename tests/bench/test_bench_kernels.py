"""benchmarks/kernels.py: the SpMM bandwidth measurement and the sampler throughput on small graphs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mpiutil import ROOT, clean_env

from benchmarks.kernels import measure_bandwidth, random_csr, sampler_throughput


def test_measure_bandwidth_small_graph():
    r = measure_bandwidth(num_nodes=20_000, num_edges=100_000, dim=32, threads=1, repeats=1)
    assert r["max_abs_diff"] < 1e-4                 # the two SpMMs computed the same thing
    assert r["bytes"] == 100_000 * 32 * 4 + 20_000 * 32 * 4 + (100_000 + 20_001) * 8
    for key in ("native_gbs", "torch_csr_gbs", "copy_gbs"):
        assert r[key] > 0
    assert r["native_frac_copy"] == pytest.approx(r["native_gbs"] / r["copy_gbs"])
    local = measure_bandwidth(num_nodes=20_000, num_edges=100_000, dim=32, threads=1, locality=50, repeats=1,
                              hugepages=True)
    assert local["locality"] == 50 and local["hugepages"] and local["max_abs_diff"] < 1e-4


def test_sampler_throughput_counts_the_batches_it_sampled():
    r = sampler_throughput(num_nodes=3_000, avg_degree=6.0, fanouts=(2, 3), batch_size=100, num_batches=4, threads=1)
    indptr, _ = random_csr(3_000, 6.0, 0)
    assert r["num_edges"] == int(indptr[-1]) and r["num_batches"] == 4 and r["threads"] == 1
    # at most 3 in-edges per vertex of a block, at most 100 + 100 * 3 vertices in the wider block
    assert 0 < r["mean_edges_per_batch"] <= 100 * 3 + (100 + 100 * 3) * 3
    assert r["mean_input_nodes"] >= 100 and r["edges_per_s"] > 0


def test_cli_prints_the_result_as_json():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "sampler", "--nodes", "2000", "--degree", "4",
                           "--fanouts", "2,2", "--batch-size", "50", "--batches", "2", "--threads", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["fanouts"] == [2, 2] and r["batch_size"] == 50 and r["num_nodes"] == 2000
