"""Half-precision feature stores through every engine, and memory-mapped feature rows.

Cora with row-normalised features (values 1/k: about 1.2 % of the entries, all the non-zero
ones, change when rounded to float16 or bfloat16) is prepared three ways and partitioned
into the same 2 parts (the partitioning reads no features): features stored as float16 (or
bfloat16), as float32 copies of those rounded values ("as-f32"), and as plain float32. One
2-rank launch trains every engine on them (2 epochs, dropout off, one evaluation).

* float16 / bfloat16 store == its as-f32 store, loss and accuracy bit for bit: the store holds
  the half-precision rows and casts them exactly to float32 where they are computed on, and the
  rows that travel between ranks (exact fetch, exact halo, layer-wise evaluation) carry the
  same values; nothing else differs.
* float16 store vs the plain float32 store: losses within 1e-4 relative (the rounding of the
  features is the only difference; the measured differences are below 3e-6) and not all
  equal (the rounding reaches the computation).
* store.features = "mmap" gives the "memory" run's losses bit for bit.
* The run's counters: a float16 store's gathered rows cost 2 bytes a value (host -> device
  bytes of the tiered store), and the exact fetch ships feature rows at 2 bytes a value
  (half the float32 store's bytes, same rows).
"""
from __future__ import annotations

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from mpiutil import ROOT, run_jobs, train_job  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

CONFIG = ROOT / "inputs" / "cora-sage.toml"
CORA_ROOT = ROOT / "inputs" / "data"
F = 1433                      # Cora's feature width

ENGINES = {
    "mb-hec": [],
    "mb-exact": ["minibatch.halo=exact", "minibatch.eval=sampled"],
    "fg-exact": ["train.engine=fullgraph", "fullgraph.halo=exact"],
    "fg-cached": ["train.engine=fullgraph", "fullgraph.halo=cached"],
    "offload": ["train.engine=fullgraph", "fullgraph.offload=true", "fullgraph.chunks=3",
                "fullgraph.recompute=recompute"],
    "tensor": ["train.engine=tensor", "model.arch=gcn"],
}
BF16_ENGINES = ("mb-hec", "mb-exact", "fg-exact", "fg-cached")
MMAP_ENGINES = ("mb-hec", "fg-exact")
COMMON = ["model.dropout=0", "train.epochs=2", "train.eval_every=2", "train.checkpoint_every=0"]


def _stores(tmp: Path) -> dict[str, Path]:
    """{name: partition store} for float32, float16, bfloat16 and the as-f32 copies."""
    from hpcgnn.cli import main
    from hpcgnn.data.graph import read_graph, write_graph

    graphs = {}
    for dt in ("float32", "float16", "bfloat16"):
        graphs[dt] = tmp / f"cora-{dt}.h5"
        assert main(["prepare", "--dataset", "cora", "--root", str(CORA_ROOT), "--normalize-features", "row",
                     "--feature-dtype", dt, "--out", str(graphs[dt])]) == 0
        if dt != "float32":
            graphs[f"{dt}-as-f32"] = tmp / f"cora-{dt}-as-f32.h5"
            write_graph(graphs[f"{dt}-as-f32"], read_graph(graphs[dt]), feature_dtype="float32")
    stores = {}
    for name, graph in graphs.items():
        stores[name] = tmp / f"{name}-p2"
        assert main(["partition", str(graph), "--parts", "2", "--method", "metis", "--seed", "0",
                     "--out", str(stores[name])]) == 0
    return stores


def _jobs(stores: dict, tmp: Path) -> list[tuple[str, str, str, list]]:
    """(engine, store name, features load, extra sets) of every run."""
    runs = []
    for engine in ENGINES:
        for store in ("float16", "float16-as-f32", "float32"):
            runs.append((engine, store, "memory", []))
    for engine in BF16_ENGINES:
        for store in ("bfloat16", "bfloat16-as-f32"):
            runs.append((engine, store, "memory", []))
    for engine in MMAP_ENGINES:
        runs.append((engine, "float16", "mmap", []))
    # a tiered store (20 % of the rows on the "device"): its host -> device bytes are 2 a value
    runs.append(("fg-exact", "float16", "memory", ["store.device_memory=0.2"]))
    runs.append(("fg-exact", "float16-as-f32", "memory", ["store.device_memory=0.2"]))
    return runs


def _dir(tmp: Path, engine: str, store: str, load: str, extra: list) -> Path:
    return tmp / "runs" / f"{engine}-{store}-{load}{'-tiered' if extra else ''}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("feature-dtypes")
    stores = _stores(tmp)
    plan = _jobs(stores, tmp)
    jobs = [train_job(CONFIG, _dir(tmp, e, s, load, extra), f"data.partitions={stores[s]}",
                      f"store.features={load}", *COMMON, *ENGINES[e], *extra)
            for e, s, load, extra in plan]
    proc = run_jobs(2, jobs, tmp, timeout=300, env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {key[:3] + (bool(key[3]),): read_run(_dir(tmp, *key)) for key in plan}
    out["stores"] = stores
    return out


def test_half_precision_stores_keep_their_dtype_on_disk(runs):
    stores = runs["stores"]
    for name, dtype in (("float16", np.float16), ("bfloat16", np.uint16), ("float16-as-f32", np.float32)):
        with h5py.File(stores[name] / "part-00000.h5", "r") as f:
            assert f["features"].dtype == dtype
            assert f["features"].chunks is None and f["features"].compression is None   # mappable


@pytest.mark.parametrize("engine", list(ENGINES))
def test_float16_store_trains_as_its_float32_copy_bitwise(runs, engine):
    half = runs[engine, "float16", "memory", False]["metrics"]
    ref = runs[engine, "float16-as-f32", "memory", False]["metrics"]
    assert ref["loss"].shape == (2,) and np.isfinite(ref["loss"]).all()
    assert np.array_equal(half["loss"], ref["loss"])
    assert np.array_equal(half["val_acc"], ref["val_acc"], equal_nan=True)
    assert np.array_equal(half["test_acc"], ref["test_acc"], equal_nan=True)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_float16_store_is_within_rounding_of_the_float32_store(runs, engine):
    half = runs[engine, "float16", "memory", False]["metrics"]["loss"]
    full = runs[engine, "float32", "memory", False]["metrics"]["loss"]
    assert np.allclose(half, full, rtol=1e-4, atol=0)
    assert not np.array_equal(half, full)


@pytest.mark.parametrize("engine", BF16_ENGINES)
def test_bfloat16_store_trains_as_its_float32_copy_bitwise(runs, engine):
    half = runs[engine, "bfloat16", "memory", False]["metrics"]
    ref = runs[engine, "bfloat16-as-f32", "memory", False]["metrics"]
    assert np.isfinite(ref["loss"]).all()
    assert np.array_equal(half["loss"], ref["loss"])
    assert np.array_equal(half["test_acc"], ref["test_acc"], equal_nan=True)


@pytest.mark.parametrize("engine", MMAP_ENGINES)
def test_memory_mapped_features_give_the_same_losses(runs, engine):
    mapped = runs[engine, "float16", "mmap", False]
    held = runs[engine, "float16", "memory", False]
    assert np.array_equal(mapped["metrics"]["loss"], held["metrics"]["loss"])
    assert np.array_equal(mapped["metrics"]["test_acc"], held["metrics"]["test_acc"], equal_nan=True)


def test_half_precision_rows_cost_two_bytes_a_value(runs):
    half = runs["fg-exact", "float16", "memory", True]["counters"]
    ref = runs["fg-exact", "float16-as-f32", "memory", True]["counters"]
    looks, hits = half["store_feature_lookups"], half["store_feature_device_hits"]
    assert (looks > hits).all() and np.array_equal(looks, ref["store_feature_lookups"])
    assert np.array_equal(half["store_feature_h2d_bytes"], (looks - hits) * F * 2)
    assert np.array_equal(ref["store_feature_h2d_bytes"], (looks - hits) * F * 4)


def test_exact_fetch_ships_half_precision_rows(runs):
    for store in ("float16", "bfloat16"):
        half = runs["mb-exact", store, "memory", False]["counters"]["exact_feature_bytes_sent"]
        ref = runs["mb-exact", f"{store}-as-f32", "memory", False]["counters"]["exact_feature_bytes_sent"]
        # the same rows at half the bytes (the counter also holds a few request words)
        assert (ref > 0).all() and (half < 0.51 * ref).all() and (half > 0.49 * ref).all()
