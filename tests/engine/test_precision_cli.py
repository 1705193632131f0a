"""train.precision = "bf16": the minibatch and full-graph engines train with bfloat16 products
of their linear layers (a loss curve near, but not equal to, float32's); the tensor engine's
bf16 is tested in test_tensor_precision.py. Three layers on a graph of mean degree 12, so
that the full graph's middle layer (32 -> 32, aggregated before its product, about 7 edges per
source row with the halo) takes the bfloat16-row mean (hpcgnn.nn.aggregate.aggregate_mean_bf16)
on two ranks."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from mpiutil import run_mpi  # noqa: E402
from toygraph import toy_graph, toy_store  # noqa: E402

from hpcgnn.run.output import read_run  # noqa: E402

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


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("precision")
    cfg = d / "p.toml"
    cfg.write_text(CONFIG)
    return d, cfg, toy_store(d / "p2", toy_graph(300, 12.0, num_features=8, num_classes=4, seed=5), 2, seed=2)


def _train(d, cfg, store, engine, precision):
    run = d / f"{engine}-{precision}"
    r = run_mpi(2, ["-m", "hpcgnn", "train", "--config", cfg, "--set", f"data.partitions={store}",
                    "--set", f"output.dir={run}", "--set", f"train.engine={engine}",
                    "--set", f"train.precision={precision}"], timeout=240, env=ENV)
    return r, run


@pytest.mark.parametrize("engine", ["fullgraph", "minibatch"])
def test_bf16_trains_close_to_fp32_but_not_equal(setup, engine):
    d, cfg, store = setup
    runs = {}
    for precision in ("fp32", "bf16"):
        r, run = _train(d, cfg, store, engine, precision)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[precision] = np.asarray(read_run(run)["metrics"]["loss"], dtype=float)
    a, b = runs["fp32"], runs["bf16"]
    assert np.all(np.isfinite(b)) and not np.array_equal(a, b)
    np.testing.assert_allclose(b, a, rtol=2e-2)
    assert b[-1] < b[0]
