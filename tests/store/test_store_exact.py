"""Training through the store is exact: on Cora (inputs/cora-sage.toml, dropout off, fixed seed)
host-only, tiered (with and without store.overlap) and device-only stores give the same loss
curve (<= 1e-6 relative) on 1 and 2 real MPI ranks, and their counters say where rows came from."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from mpiutil import ROOT, run_mpi  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

CONFIG = ROOT / "inputs" / "cora-sage.toml"
DRIVER = Path(__file__).parent / "store_exact_driver.py"


@pytest.fixture(scope="module", params=[1, 2])
def runs(request, cora_parts, tmp_path_factory):
    p = request.param
    tmp = tmp_path_factory.mktemp(f"store{p}")
    proc = run_mpi(p, [DRIVER, cora_parts(p), tmp, CONFIG], timeout=240, cwd=ROOT,
                   env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return p, {name: read_run(tmp / name) for name in ("host", "tiered", "tiered-sync", "device")}


def test_same_loss_curve_in_every_store_layout(runs):
    p, r = runs
    ref = r["host"]["metrics"]["loss"]
    assert ref.shape == (3,) and np.isfinite(ref).all()
    for name in ("tiered", "tiered-sync", "device"):
        loss = r[name]["metrics"]["loss"]
        assert np.all(np.abs(loss - ref) <= 1e-6 * np.abs(ref)), (name, loss, ref)
        assert r[name]["metrics"]["test_acc"][-1] == r["host"]["metrics"]["test_acc"][-1]


def test_counters_say_where_the_rows_came_from(runs):
    p, r = runs
    modes = {k: v["attrs"]["store_mode"] for k, v in r.items()}
    assert modes == {"host": "host", "tiered": "tiered", "tiered-sync": "tiered", "device": "device"}
    c = {k: v["counters"] for k, v in r.items()}
    looks = c["host"]["store_feature_lookups"]
    assert (looks > 0).all()
    for name in ("tiered", "tiered-sync", "device"):        # the same minibatches everywhere
        assert np.array_equal(c[name]["store_feature_lookups"], looks)
        assert np.array_equal(c[name]["store_blocks_h2d_bytes"], c["host"]["store_blocks_h2d_bytes"])
    assert (c["host"]["store_feature_device_hits"] == 0).all()
    assert np.array_equal(c["host"]["store_feature_h2d_bytes"], looks * 1433 * 4)
    assert np.array_equal(c["device"]["store_feature_device_hits"], looks)
    assert (c["device"]["store_feature_h2d_bytes"] == 0).all()
    hits = c["tiered"]["store_feature_device_hits"]
    assert (hits > 0).all() and (hits < looks).all()
    assert np.array_equal(c["tiered"]["store_feature_h2d_bytes"], (looks - hits) * 1433 * 4)
    assert np.array_equal(hits, c["tiered-sync"]["store_feature_device_hits"])
    # the solver's prediction (a pre-sampled estimate on a tiny graph: within 10 points here)
    measured = hits.sum(axis=0) / looks.sum(axis=0)
    pred = np.asarray(json.loads(r["tiered"]["attrs"]["store_predicted_hit_rate"]))
    assert pred.shape == (p,) and np.all(np.abs(measured - pred) <= 0.10), (measured, pred)
    placement = json.loads(r["tiered"]["attrs"]["store_placement"])
    assert len(placement) == p and all(0 < q["device_rows"] < q["rows"] for q in placement)
    assert all(q["device_bytes"] <= q["budget_bytes"] + q["rows"] * 8 for q in placement)
    for name in r:
        assert (r[name]["timings"]["store_wait"] >= 0).all()
    if p > 1:   # HEC_l hits: from host memory when host-only, from the device tier when device-only
        assert (c["host"]["store_hec_lookups"].sum(axis=0) > 0).all()
        assert np.array_equal(c["device"]["store_hec_lookups"], c["host"]["store_hec_lookups"])
        assert (c["host"]["store_hec_device_hits"] == 0).all() and c["host"]["store_hec_h2d_bytes"].sum() > 0
        assert (c["device"]["store_hec_h2d_bytes"] == 0).all() and c["device"]["store_hec_device_hits"].sum() > 0


def test_report_shows_the_store_columns(runs):
    from hpcgnn.commands.report import format_table, summarise

    p, r = runs
    s = summarise(r["tiered"])
    st = s["epochs"][-1]["store"]
    c = r["tiered"]["counters"]
    assert st["feature_hit_rate"] == pytest.approx(c["store_feature_device_hits"][-1].sum()
                                                   / c["store_feature_lookups"][-1].sum())
    assert st["h2d_bytes"] == c["store_h2d_bytes"][-1].sum() and 0 < st["predicted_feature_hit_rate"] < 1
    text = format_table(s)
    assert "dev_feat%" in text and "store_wait" in text
    assert summarise(r["host"])["epochs"][-1]["store"]["feature_hit_rate"] == 0


def test_memory_estimate_counts_the_cpu_device_tier(cora_parts):
    from hpcgnn.engine.estimate import estimate_rank_memory, part_shapes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    parts = cora_parts(2)
    meta = read_meta(parts)
    est = {dm: estimate_rank_memory(load_config(CONFIG, [f"data.partitions={parts}", f"store.device_memory={dm}"]),
                                    meta, 0, 0) for dm in ("0", "0.2", "1.0")}
    assert "store" not in est["0"].terms and "store" not in est["1.0"].terms   # the partition's array in place
    solid = part_shapes(parts, 0)["num_solid"]       # budget + one int64 slot per solid row
    assert est["0.2"].terms["store"] == int(0.2 * solid * meta.num_features * 4) + solid * 8
