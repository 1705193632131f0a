"""train.precision = "bf16": the minibatch and full-graph engines train with bfloat16 products
of their linear layers (a loss curve near, but not equal to, float32's); the tensor engine's
bf16 is tested in test_tensor_precision.py. Three layers on a graph of mean degree 12, so
that the full graph's middle layer (32 -> 32, aggregated before its product, about 7 edges per
source row with the halo) takes the bfloat16-row mean (hpcgnn.nn.aggregate.aggregate_mean_bf16)
on two ranks. The four runs share one launch (tests/jobs_driver.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from mpiutil import run_jobs, train_job  # noqa: E402
from toygraph import toy_graph, toy_store  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

CONFIG = """
[model]
arch = "sage"
hidden = 32
layers = 3
dropout = 0.0
[train]
epochs = 6
lr = 0.02
seed = 3
eval_every = 6
[minibatch]
batch_size = 64
fanouts = [5, 5, 5]
"""
ENV = {"HPCGNN_THREADS": "1"}
ENGINES = ("fullgraph", "minibatch")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("precision")
    cfg = d / "p.toml"
    cfg.write_text(CONFIG)
    store = toy_store(d / "p2", toy_graph(300, 12.0, num_features=8, num_classes=4, seed=5), 2, seed=2)
    jobs = [train_job(cfg, d / f"{engine}-{precision}", f"data.partitions={store}", f"train.engine={engine}",
                      f"train.precision={precision}")
            for engine in ENGINES for precision in ("fp32", "bf16")]
    proc = run_jobs(2, jobs, d, timeout=400, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return d


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_trains_close_to_fp32_but_not_equal(setup, engine):
    runs = {precision: np.asarray(read_run(setup / f"{engine}-{precision}")["metrics"]["loss"], dtype=float)
            for precision in ("fp32", "bf16")}
    a, b = runs["fp32"], runs["bf16"]
    assert np.all(np.isfinite(b)) and not np.array_equal(a, b)
    np.testing.assert_allclose(b, a, rtol=2e-2)
    assert b[-1] < b[0]
