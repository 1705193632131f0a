"""The compute device's memory (hpcgnn.engine.estimate: estimate_device_memory,
check_device_memory; hpcgnn.store.budget: store.device_memory = 'auto'; hpcgnn.run.memory:
the one DeviceMemoryMeter).

* A stated ``runtime.device_memory_limit`` that a config cannot fit stops every rank of a real
  2-rank run with exit 2 and one line naming the largest term and the setting that shrinks it,
  before any run file exists.
* ``store.device_memory = 'auto'`` on a GPU gets what the device has left after the other terms.
* The device terms against the meter's measured peak of device-placed tensors of real CPU runs:
  within 25 % for the in-memory full graph, an upper bound for the minibatch and tensor engines.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402
from mpiutil import ROOT  # noqa: E402

from hpcgnn.run.output import read_run  # noqa: E402


def test_a_config_the_stated_device_cannot_hold_is_refused_on_every_rank(cora_parts, tmp_path):
    run = tmp_path / "run"
    proc, codes = mb.train_each_rank_exit(2, [
        "train", "--config", str(ROOT / "inputs" / "cora-gcn-fullgraph.toml"),
        "--set", f"data.partitions={cora_parts(2)}", "--set", f"output.dir={run}",
        "--set", "runtime.device_memory_limit=4MiB"], timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(set(lines)) == 1, proc.stderr
    line = lines[0]
    assert "train: the device needs" in line and "runtime.device_memory_limit is 4.00 MiB" in line
    assert "largest: activations" in line and "fullgraph.offload" in line
    assert not run.exists()                                    # refused before the run file


def test_store_auto_on_a_gpu_gets_what_the_other_device_terms_leave(cora_parts):
    from hpcgnn.engine.estimate import CUDA_CONTEXT, estimate_device_memory, store_auto_bytes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config
    from hpcgnn.store.budget import resolve_budget

    store = cora_parts(2)
    meta = read_meta(store)
    cfg = load_config(ROOT / "inputs" / "cora-sage.toml", [f"data.partitions={store}"])
    full = estimate_device_memory(cfg, meta, 0, device="cuda")          # 'auto', no figure: all rows
    rows = full.terms["store_rows"]
    assert rows > 0 and full.terms["cuda_context"] == CUDA_CONTEXT
    others = full.total - rows
    for free, want in ((others + rows // 3, rows // 3), (others + 2 * rows, rows), (others // 2, 0)):
        got = store_auto_bytes(cfg, meta, 0, free)
        assert got == max(free - others, 0)
        assert resolve_budget("auto", rows, "cuda", got) == want
        est = estimate_device_memory(cfg, meta, 0, device="cuda", store_available=got)
        assert est.terms["store_rows"] == want
    assert resolve_budget("auto", rows, "cpu", 10 ** 9) == 0                # the CPU: host-only


@pytest.mark.parametrize("config,extra,within", [
    # full graph in memory: the estimate is within 25 % of the meter's peak (measured 0.999-1.001
    # for GCN 2 and 3 layers and SAGE, 0.82 for GAT on 2 ranks of Cora)
    ("cora-gcn-fullgraph.toml", [], 0.25),
    # minibatch: the expected-frontier model over-counts Cora's clustered neighbourhoods
    # (measured 1.23-1.53x at batch 16, up to 2.1x at 3 layers); the tensor engine's chunk
    # working set counts three source-sized slices where one chunk holds about two (2-2.7x):
    # both are upper bounds only
    ("cora-sage.toml", [], None),
    ("cora-tensor.toml", ["--set", "tensor.staged=true"], None),
])
def test_device_estimate_against_the_meters_peak_on_the_cpu(cora_parts, tmp_path, config, extra, within):
    """The meter's epoch peak of device-placed tensors (counters/peak_device_bytes, the one
    DeviceMemoryMeter of the rank) is positive, below the device estimate of every rank and,
    where ``within`` is given, within that fraction of it; a stated device size that holds the
    estimate lets the run train."""
    from hpcgnn.engine.estimate import estimate_device_memory
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    proc = mb.train(2, ROOT / "inputs" / config, store, tmp_path / "run", "--set", "train.epochs=1",
                    "--set", "runtime.device_memory_limit=1GiB", *extra,
                    timeout=180, env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(tmp_path / "run")
    measured = np.nanmax(run["counters"]["peak_device_bytes"], axis=0)
    cfg = load_config(ROOT / "inputs" / config, [f"data.partitions={store}", *[a for a in extra if a != "--set"]])
    meta = read_meta(store)
    for rank in (0, 1):
        est = estimate_device_memory(cfg, meta, rank, device="cpu").total
        assert measured[rank] > 0, measured
        if within is None:
            assert measured[rank] <= est, (rank, measured[rank], est)
        else:
            assert abs(est / measured[rank] - 1) <= within, (rank, measured[rank], est)
