"""`hpcgnn train` with train.engine = "tensor": the shipped Cora config reaches >= 79 % test
accuracy on 2 ranks, bad settings stop every rank with one line naming the key (exit 2),
--resume continues exactly (dropout on, chunked), the memory estimate has the engine's terms."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mb_support as mb  # noqa: E402
from mpiutil import ROOT, run_cli, run_mpi  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

ENV = {"HPCGNN_THREADS": "1"}


@pytest.fixture(scope="module")
def cora_rownorm(tmp_path_factory):
    """Cora with row-normalised features, METIS-partitioned into 2 parts."""
    from hpcgnn.cli import main

    d = tmp_path_factory.mktemp("tensorcli")
    graph = d / "cora-rownorm.h5"
    assert main(["prepare", "--dataset", "cora", "--root", str(ROOT / "inputs" / "data"),
                 "--normalize-features", "row", "--out", str(graph)]) == 0
    assert main(["partition", str(graph), "--parts", "2", "--out", str(d / "p2")]) == 0
    return d, d / "p2"


def _train(ranks, store, run, *extra, timeout=120):
    return run_mpi(ranks, ["-m", "hpcgnn", "train", "--config", ROOT / "inputs" / "cora-tensor.toml",
                           "--set", f"data.partitions={store}", "--set", f"output.dir={run}", "--force",
                           *extra], timeout=timeout, env=ENV)


def test_shipped_cora_config_reaches_79_percent(cora_rownorm):
    d, store = cora_rownorm
    proc = _train(2, store, d / "acc")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = read_run(d / "acc")
    assert r["attrs"]["status"] == "finished" and r["attrs"]["engine"] == "tensor"
    test_acc = r["metrics"]["test_acc"][-1]
    assert test_acc >= 0.79, test_acc
    c, t = r["counters"], r["timings"]
    assert np.all(c["layout_alltoalls"] == 4) and np.all(c["bytes_sent"] > 0)
    for phase in ("nn", "split", "aggregate", "gather", "allreduce", "optimizer", "compute"):
        assert phase in t and np.all(np.isfinite(t[phase])), phase
    assert sorted(p.name for p in (d / "acc" / "checkpoints").iterdir()) == ["ckpt-000100.pt", "ckpt-000200.pt"]
    rep = run_cli(["report", str(d / "acc")], env=ENV)
    assert rep.returncode == 0 and "tensor on 2 ranks" in rep.stdout, rep.stdout + rep.stderr


@pytest.mark.parametrize("sets,text", [
    (["tensor.mode=coupled", "tensor.k=0", "tensor.alpha=0.1"], "tensor.alpha"),
    (["tensor.mode=coupled", "tensor.k=0", "tensor.alpha=0", "model.arch=gat"], "model.arch"),
    (["tensor.mode=coupled", "tensor.k=5"], "tensor.k"),
    (["tensor.chunks=0"], "tensor.chunks"),
    (["tensor.gamma=1.5"], "tensor.gamma"),
    (["tensor.mode=sideways"], "tensor.mode"),
])
def test_bad_settings_exit_2_on_every_rank_naming_the_key(cora_rownorm, sets, text):
    d, store = cora_rownorm
    args = ["train", "--config", str(ROOT / "inputs" / "cora-tensor.toml"), "--set", f"data.partitions={store}",
            "--set", f"output.dir={d / 'bad'}", "--force"]
    for s in sets:
        args += ["--set", s]
    proc, codes = mb.train_each_rank_exit(2, args)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hpcgnn: error:")]
    assert len(lines) == 1 and text in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_resume_continues_exactly_with_dropout_and_chunks(cora_rownorm):
    d, store = cora_rownorm
    common = ["--set", "tensor.chunks=3", "--set", "train.eval_every=2", "--set", "train.checkpoint_every=2",
              "--set", "tensor.k=3"]
    full = _train(2, store, d / "full", *common, "--set", "train.epochs=6")
    assert full.returncode == 0, full.stderr[-3000:]
    part = _train(2, store, d / "part", *common, "--set", "train.epochs=4")
    assert part.returncode == 0, part.stderr[-3000:]
    res = run_mpi(2, ["-m", "hpcgnn", "train", "--config", ROOT / "inputs" / "cora-tensor.toml",
                      "--set", f"data.partitions={store}", "--set", f"output.dir={d / 'part'}", "--resume",
                      *common, "--set", "train.epochs=6"], timeout=120, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = read_run(d / "full")["metrics"], read_run(d / "part")["metrics"]
    assert np.array_equal(a["loss"], b["loss"]), (a["loss"], b["loss"])
    assert np.array_equal(a["test_acc"], b["test_acc"], equal_nan=True)


def test_memory_estimate_has_the_tensor_terms(cora_rownorm):
    d, store = cora_rownorm
    proc = run_cli(["inspect", str(store), "--config", str(ROOT / "inputs" / "cora-tensor.toml")], env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert "tensor engine" in proc.stdout and "topology_GiB" in proc.stdout, proc.stdout
