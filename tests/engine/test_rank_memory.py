"""A rank's arrays do not grow with the global vertex count: on a 4-rank run over a cycle of
V vertices (each rank holds about V/4 solid vertices, a few halo vertices and V/2 directed
edges), no array or tensor reachable from the minibatch engine after an epoch and its
evaluation has a dimension of V or more, in the HEC + sampled-evaluation and exact + full
evaluation configurations. A dense per-vertex map, a V-sized tag directory or the global CSR
held by a rank would. The walk is checked to see the rank's own edge array."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpiutil import ROOT, run_mpi  # noqa: E402

DRIVER = Path(__file__).resolve().parent / "rank_arrays_driver.py"
V = 6000


@pytest.fixture(scope="module")
def cycle_store(tmp_path_factory):
    from hpcgnn.cli import main

    work = tmp_path_factory.mktemp("cycle")
    rng = np.random.default_rng(0)
    src = np.arange(V, dtype=np.int64)
    np.save(work / "edges.npy", np.stack([src, (src + 1) % V], axis=1))
    np.save(work / "features.npy", rng.standard_normal((V, 16)).astype(np.float32))
    np.save(work / "labels.npy", (np.arange(V) // 50 % 4).astype(np.int64))
    split = rng.permutation(V)
    for name, ids in (("train", split[:1800]), ("val", split[1800:2400]), ("test", split[2400:3000])):
        np.save(work / f"{name}.npy", np.sort(ids))
    graph = work / "cycle.h5"
    assert main(["prepare", "--dataset", "files", "--edges", str(work / "edges.npy"), "--features",
                 str(work / "features.npy"), "--labels", str(work / "labels.npy"), "--train",
                 str(work / "train.npy"), "--val", str(work / "val.npy"), "--test", str(work / "test.npy"),
                 "--out", str(graph)]) == 0
    assert main(["partition", str(graph), "--parts", "4", "--out", str(work / "p4")]) == 0
    return work


@pytest.mark.parametrize("mode", [
    ("minibatch.halo=hec", "minibatch.eval=sampled"),
    ("minibatch.halo=exact", "minibatch.eval=full"),
], ids=["hec-sampled", "exact-full"])
def test_no_rank_array_is_as_long_as_the_graph(cycle_store, mode):
    prefix = cycle_store / f"arrays-{mode[0][-3:]}"
    sets = ["train.epochs=1", "minibatch.batch_size=64", "minibatch.fanouts=[2, 2]", "minibatch.cache_lines=256",
            "model.hidden=8", *mode]
    proc = run_mpi(4, [DRIVER, cycle_store / "p4", cycle_store / f"run-{mode[0][-3:]}", prefix, *sets],
                   timeout=240, env={"HPCGNN_THREADS": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in range(4):
        found = json.loads(Path(f"{prefix}-{rank}.json").read_text())
        assert found["num_local"] < V / 3 and found["num_edges"] < 0.6 * V      # the store is what we think
        dims = [(max(shape), path) for path, shape, _ in found["arrays"] if shape]
        assert any(n == found["num_edges"] for n, _ in dims), "the walk did not reach the rank's edges"
        longest = max(dims)
        assert longest[0] < V, (rank, longest)
