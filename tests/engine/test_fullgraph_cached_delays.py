"""The cached, pipelined halo (S = 2) on 4 real MPI ranks under injected delays
(tests/engine/cached_delay_driver.py: sleeps and withheld progress around the point-to-point
messages, by rank and epoch, wrapped in the driver's processes only): every halo block equals
the one built from (rows received) U (rows cached), every recorded age is <= S, and the losses,
the blocks and the ages are the same as without delays (float32 and bfloat16 rows)."""
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

EPOCHS, HIDDEN, LAYERS, S = 8, 8, 3, 2
DRIVER = Path(__file__).resolve().parent / "cached_delay_driver.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("fgdelay")
    g = toy_graph(240, 6.0, num_features=10, num_classes=4, seed=9)
    store = toy_store(d / "store4", g, 4, seed=6)
    out = d / "report.json"
    proc = run_mpi(4, [DRIVER, store, out, EPOCHS, HIDDEN, LAYERS], timeout=240,
                   env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("precision", ["", "-bf16"])
def test_delays_change_nothing_and_every_block_is_sent_union_cached(report, precision):
    plain, delayed = report["plain" + precision], report["delayed" + precision]
    # the delays happened: sleeps on every rank, progress withheld, waits that blocked
    assert min(delayed["slept"]) > 0 and min(delayed["skipped"]) > 0 and sum(delayed["blocked"]) > 0
    assert max(plain["slept"]) == 0 and max(plain["skipped"]) == 0
    # every assembled block was checked against (received) U (cached) in the driver: all rows
    # of every layer of every epoch (and layer 0 of the evaluation at epoch 3)
    halo = np.array(report["num_halo"])
    assert delayed["checked_rows"] == plain["checked_rows"] == (halo * (LAYERS * EPOCHS + 1)).tolist()
    # timing does not change the result: the same blocks with the same ages, the same losses
    assert delayed["digests"] == plain["digests"]
    assert delayed["loss"] == plain["loss"]
    for run in (plain, delayed):
        pl = {k: np.array([[e[k] for e in rank] for rank in run["per_layer"]]) for k in   # [rank, epoch, layer]
              ("halo_age_max", "halo_age_over_bound", "halo_rows_used", "halo_hits_device", "halo_hits_host")}
        assert pl["halo_age_max"].shape == (4, EPOCHS, LAYERS)
        assert pl["halo_age_max"].max() == S and (pl["halo_age_over_bound"] == 0).all()
        assert (pl["halo_rows_used"] == halo[:, None, None]).all()
        assert pl["halo_hits_device"].sum() > 0 and pl["halo_hits_host"].sum() > 0


def test_bf16_rows_are_a_different_run(report):
    assert report["plain"]["loss"] != report["plain-bf16"]["loss"]
    assert report["plain"]["digests"] != report["plain-bf16"]["digests"]
