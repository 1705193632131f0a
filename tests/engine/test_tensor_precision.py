"""train.precision = "bf16" with the tensor engine (real mpiexec, 2 ranks, a 300-vertex graph):
every matrix product of a training epoch (the linear maps' forward and both backward GEMMs)
runs on bfloat16 operands, and none with fp32; the loss curve is near float32's but not equal
(decoupled SAGE with 3 linear maps, coupled GCN with 2)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from mpiutil import run_mpi  # noqa: E402
from toygraph import toy_graph, toy_store  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

DRIVER = Path(__file__).resolve().parent / "tensor_precision_driver.py"
CONFIG = """
[model]
arch = "sage"
hidden = 32
layers = 3
dropout = 0.0
[train]
engine = "tensor"
epochs = 8
lr = 0.02
seed = 3
eval_every = 8
"""
ENV = {"HPCGNN_THREADS": "1"}
VARIANTS = {   # name: (extra settings, linear maps)
    "decoupled": ([], 3),
    "coupled": (["tensor.mode=coupled", "model.arch=gcn", "model.layers=2"], 2),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tprec")
    cfg = d / "t.toml"
    cfg.write_text(CONFIG)
    return d, cfg, toy_store(d / "p2", toy_graph(300, 12.0, num_features=8, num_classes=4, seed=5), 2, seed=2)


def _sets(extra):
    return [a for s in extra for a in ("--set", s)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_epoch_products_are_bf16(setup, variant):
    """Forward ``L`` products plus backward ``L`` weight gradients and ``L - 1`` input gradients
    (the features need none): ``3 L - 1`` per rank, all on bfloat16 operands."""
    d, cfg, store = setup
    extra, lins = VARIANTS[variant]
    for precision, dtype in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16")):
        out = d / f"products-{variant}-{precision}.json"
        r = run_mpi(2, [DRIVER, store, cfg, d / f"drv-{variant}-{precision}", out, *extra,
                        f"train.precision={precision}"], timeout=120, env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        for rank_calls in json.loads(out.read_text()):
            assert len(rank_calls) == 3 * lins - 1, rank_calls
            assert {t for _, ts in rank_calls for t in ts} == {dtype}, rank_calls


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_trains_close_to_fp32_but_not_equal(setup, variant):
    d, cfg, store = setup
    extra, _ = VARIANTS[variant]
    loss = {}
    for precision in ("fp32", "bf16"):
        run = d / f"{variant}-{precision}"
        r = run_mpi(2, ["-m", "hpcgnn", "train", "--config", cfg, "--set", f"data.partitions={store}",
                        "--set", f"output.dir={run}", *_sets(extra), "--set", f"train.precision={precision}"],
                    timeout=120, env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        loss[precision] = np.asarray(read_run(run)["metrics"]["loss"], dtype=float)
    a, b = loss["fp32"], loss["bf16"]
    assert b.shape == a.shape == (8,) and np.all(np.isfinite(b)) and not np.array_equal(a, b)
    np.testing.assert_allclose(b, a, rtol=2e-2)
    assert b[-1] < b[0]
