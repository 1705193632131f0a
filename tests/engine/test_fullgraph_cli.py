"""`hpcgnn train` with train.engine = "fullgraph": the same loss curve at 1 rank in memory and
2 ranks offloaded; run file, counters and checkpoints through the shared run output; exact resume."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from mpiutil import ROOT, run_cli, run_mpi  # noqa: E402
from toygraph import toy_graph, toy_store  # noqa: E402

from hpcgnn.run.config import load_config  # noqa: E402
from hpcgnn.run.runfile import read_run  # noqa: E402

CONFIG = """
[model]
arch = "sage"
hidden = 16
layers = 2
dropout = 0.0
[train]
engine = "fullgraph"
epochs = 4
lr = 0.02
seed = 3
eval_every = 1
checkpoint_every = 2
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("fgcli")
    g = toy_graph(300, 6.0, num_features=8, num_classes=4, seed=5)
    cfg = d / "fg.toml"
    cfg.write_text(CONFIG)
    return d, cfg, toy_store(d / "p1", g, 1), toy_store(d / "p2", g, 2, seed=2)


ENV = {"HPCGNN_THREADS": "1"}  # tiny graph: one thread per rank


def args(cfg, store, run, *extra):
    return ["-m", "hpcgnn", "train", "--config", cfg, "--set", f"data.partitions={store}",
            "--set", f"output.dir={run}", *extra]


def test_one_rank_in_memory_equals_two_ranks_offloaded_and_resume(setup):
    d, cfg, p1, p2 = setup
    r1 = run_mpi(1, args(cfg, p1, d / "r1"), timeout=120, env=ENV)
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run_mpi(2, args(cfg, p2, d / "r2", "--set", "fullgraph.offload=true", "--set", "fullgraph.chunks=3",
                         "--set", "fullgraph.batch_chunks=2"), timeout=120, env=ENV)
    assert r2.returncode == 0, r2.stderr[-3000:]
    a, b = read_run(d / "r1"), read_run(d / "r2")
    assert a["attrs"]["fullgraph_mode"] == "in-memory" and b["attrs"]["fullgraph_mode"] == "offload"
    assert a["attrs"]["status"] == "finished"
    loss_a, loss_b = a["metrics"]["loss"], b["metrics"]["loss"]
    assert loss_a.shape == (4,) and loss_a[-1] < loss_a[0]  # it learns
    assert np.allclose(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for split in ("train_acc", "val_acc", "test_acc"):  # at most one near-tied argmax may flip
        assert np.allclose(a["metrics"][split], b["metrics"][split], atol=0.015)
    c = b["counters"]
    assert c["halo_bytes"].shape == (4, 2) and np.all(c["halo_bytes"] > 0)
    assert np.all(c["h2d_rows_bytes"] > 0) and np.all(c["h2d_rows_bytes"] <= c["h2d_rows_nodedup_bytes"])
    assert np.all(c["peak_device_bytes"] > 0)
    assert "fullgraph_plans" in b["attrs"]
    assert sorted(p.name for p in (d / "r2" / "checkpoints").iterdir()) == ["ckpt-000002.pt", "ckpt-000004.pt"]
    # resume: 2 epochs, then continue to 4 from the checkpoint = the uninterrupted run
    r3 = run_cli(args(cfg, p1, d / "r3", "--set", "train.epochs=2")[2:], timeout=120, env=ENV)
    assert r3.returncode == 0, r3.stderr[-3000:]
    r4 = run_cli(args(cfg, p1, d / "r3", "--resume")[2:], timeout=120, env=ENV)
    assert r4.returncode == 0, r4.stderr[-3000:]
    assert np.allclose(read_run(d / "r3")["metrics"]["loss"], loss_a, rtol=1e-6, atol=1e-7)


def test_shipped_config_is_valid():
    cfg = load_config(ROOT / "inputs" / "cora-gcn-fullgraph.toml")
    assert cfg.train.engine == "fullgraph" and cfg.model.arch == "gcn"


def test_wrong_rank_count_is_an_input_error(setup):
    d, cfg, p1, p2 = setup
    r = run_mpi(1, args(cfg, p2, d / "bad"), timeout=60, env=ENV)
    assert r.returncode == 2 and "2 partitions but the job has 1 ranks" in r.stderr
