"""The minibatch engine's loader (hpcgnn/engine/minibatch.py, store.overlap with a worker
thread): minibatch k + 2 is sampled on the worker thread while k computes, and the run is
bit-identical to the one that samples inline (store.overlap = false), at 1 and 2 ranks; also
with every feature row in the "device" store (the CPU standing in), whose reads run inline but
whose sampling still goes ahead on the worker."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402
from mpiutil import ROOT, run_mpi  # noqa: E402

from hpcgnn.run.runfile import read_run, timing_parents  # noqa: E402

CONFIG = mb.small_config(epochs=2, batch_size=12, fanouts=3, nc=6)


@pytest.mark.parametrize("ranks,store", [(1, "host"), (2, "host"), (1, "device")])
def test_loader_samples_ahead_and_changes_no_result(tmp_path, ranks, store):
    parts = mb.tiny_store(tmp_path / "parts", mb.tiny_graph(), ranks)
    cfg = mb.write_config(tmp_path / "cfg.toml", CONFIG)
    extra = ["store.device_memory=1GiB"] if store == "device" else []
    proc = run_mpi(ranks, [str(Path(__file__).parent / "mb_loader_driver.py"), parts, tmp_path, cfg, *extra],
                   # no watcher fork between the driver's two runs: a process forked after
                   # OpenMP ran a team hangs in its next one (libgomp)
                   timeout=240, cwd=ROOT, env={"HPCGNN_SUPERVISE": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # (raw_decode, not per line: mpiexec may join the ranks' last lines)
    dec = json.JSONDecoder()
    logs = {int(m.group(1)): dec.raw_decode(proc.stdout, m.end())[0]
            for m in re.finditer(r"LOADER (\d+) ", proc.stdout)}
    assert sorted(logs) == list(range(ranks))
    on, off = read_run(tmp_path / "on"), read_run(tmp_path / "off")
    iterations = on["counters"]["iterations"][0, 0]
    assert iterations >= 4
    for rank, log in logs.items():
        # on: steps 0 and 1 of each epoch sampled inline, every later one on the loader thread,
        # each finished while the step two before it computed; off: all inline, none loaded
        assert log["on"]["inline"] == [[e, k] for e in (1, 2) for k in (0, 1)], log["on"]
        assert log["on"]["loaded"] == log["on"]["submitted"] == \
            [[e, k] for e in (1, 2) for k in range(2, int(iterations))], log["on"]
        assert log["on"]["while_computing"] == [True] * len(log["on"]["loaded"])
        assert log["off"]["loaded"] == [] and log["off"]["while_computing"] == []
        assert log["off"]["inline"] == [[e, k] for e in (1, 2) for k in range(int(iterations))]
    # bit-identical losses, accuracies and counters (memory peaks and store waits are not results)
    for name in ("loss", "train_acc", "val_acc", "test_acc"):
        np.testing.assert_array_equal(on["metrics"][name], off["metrics"][name], err_msg=name)
    assert set(on["counters"]) == set(off["counters"])
    for name in on["counters"]:
        if not name.startswith("peak_"):
            np.testing.assert_array_equal(on["counters"][name], off["counters"][name], err_msg=name)
    for name in on["per_layer"]:
        np.testing.assert_array_equal(on["per_layer"][name], off["per_layer"][name], err_msg=name)
    # the loader's sampling is a timing of its own, outside the epoch's total; the main thread's
    # wait for it is the epoch's phase "sample"
    assert timing_parents(on)["sample_loader"] == "loader" and "sample_loader" not in off["timings"]
    assert (on["timings"]["sample_loader"] > 0).all() and timing_parents(on)["sample"] == "epoch"
    assert json.loads(on["attrs"]["store_gather_threads"]) == [1] * ranks
    assert json.loads(off["attrs"]["store_gather_threads"]) == [0] * ranks
    assert on["attrs"]["store_mode"] == store, on["attrs"]["store_mode"]
