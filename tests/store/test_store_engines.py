"""Every engine reads its vertex rows through the feature store (docs/store.md): on Cora at 2
real MPI ranks, a tiered store (store.device_memory = 0.2) gives the host-only store's loss
curve bit for bit for the full-graph engine (in memory and offloaded), the tensor engine and
the exact minibatch fetch, and its device tier serves rows (counters/store_feature_device_hits
> 0; == 0 host-only)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from mpiutil import ROOT, run_mpi  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

CONFIG = ROOT / "inputs" / "cora-sage.toml"
DRIVER = Path(__file__).parent / "store_engines_driver.py"
ENGINES = ("fullgraph", "offload", "tensor", "exact")


@pytest.fixture(scope="module")
def runs(cora_parts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store-engines")
    proc = run_mpi(2, [DRIVER, cora_parts(2), tmp, CONFIG], timeout=300, cwd=ROOT,
                   env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {(e, b): read_run(tmp / f"{e}-{b}") for e in ENGINES for b in ("0", "0.2")}


@pytest.mark.parametrize("engine", ENGINES)
def test_tiered_store_gives_the_host_only_loss_curve_bitwise(runs, engine):
    host, tiered = runs[engine, "0"], runs[engine, "0.2"]
    ref = host["metrics"]["loss"]
    assert ref.shape == (3,) and np.isfinite(ref).all()
    assert np.array_equal(tiered["metrics"]["loss"], ref)
    assert tiered["metrics"]["test_acc"][-1] == host["metrics"]["test_acc"][-1]


@pytest.mark.parametrize("engine", ENGINES)
def test_device_tier_serves_rows_only_with_a_budget(runs, engine):
    host, tiered = runs[engine, "0"]["counters"], runs[engine, "0.2"]["counters"]
    assert runs[engine, "0"]["attrs"]["store_mode"] == "host"
    assert runs[engine, "0.2"]["attrs"]["store_mode"] == "tiered"
    looks = host["store_feature_lookups"]
    assert (looks > 0).all() and np.array_equal(tiered["store_feature_lookups"], looks)
    assert (host["store_feature_device_hits"] == 0).all()
    hits = tiered["store_feature_device_hits"]
    assert (hits > 0).all() and (hits < looks).all()
    assert np.array_equal(tiered["store_feature_h2d_bytes"], (looks - hits) * 1433 * 4)
