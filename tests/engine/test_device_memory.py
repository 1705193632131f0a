"""The compute device's memory (hpcgnn.engine.estimate: estimate_device_memory;
hpcgnn.engine.memory_check: check_device_memory; hpcgnn.store.budget: store.device_memory =
'auto'; hpcgnn.run.memory: the one DeviceMemoryMeter).

* A stated ``runtime.device_memory_limit`` that a config clearly cannot fit stops every rank of
  a real 2-rank run with exit 2 and one line naming the largest term and the setting that
  shrinks it, before any run file exists.
* ``store.device_memory = 'auto'`` on a GPU gets what the device has left after the other terms.
* The run file records the device estimate of the pre-run check beside the meter's measured
  peak, and ``hpcgnn report`` shows both: an upper bound within 2x for the minibatch, full-graph
  and staged tensor (streamed and resident) engines on Cora.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402
from mpiutil import ROOT, run_mpi  # noqa: E402

from hpcgnn.commands.report import format_table, summarise  # noqa: E402
from hpcgnn.run.runfile import read_run  # noqa: E402


@pytest.mark.parametrize("limit,when", [("3MiB", "before the run"), ("6MiB", "after the first step")])
def test_a_config_the_stated_device_cannot_hold_is_stopped_on_every_rank(cora_parts, tmp_path, limit, when):
    """Full-graph GCN on Cora keeps about 7.6 MiB of device tensors per rank (the CPU meter):
    against 3 MiB it is clearly over (the estimate's floor exceeds it) and refused before any
    run file exists; 6 MiB is within the floor, so the run starts and its measured first step
    stops it. Both: one line naming the largest term and its setting, exit 2 on every rank."""
    run = tmp_path / "run"
    proc, codes = mb.train_each_rank_exit(2, [
        "train", "--config", str(ROOT / "inputs" / "cora-gcn-fullgraph.toml"),
        "--set", f"data.partitions={cora_parts(2)}", "--set", f"output.dir={run}",
        "--set", f"runtime.device_memory_limit={limit}"], timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(set(lines)) == 1, proc.stderr
    line = lines[0]
    assert "train: the device memory of rank" in line
    assert f"the {limit[0]}.00 MiB available (runtime.device_memory_limit)" in line
    assert "largest term: activations" in line and "fullgraph.offload" in line
    assert "runtime.memory_check = false" in line and "Traceback" not in proc.stderr
    if when == "before the run":
        assert "clearly over the limit" in line
        assert not run.exists()                                # refused before the run file
    else:
        assert "projects a peak, from its measured first step" in line
        r = read_run(run)
        assert r["attrs"]["status"] == "failed" and "measured first step" in r["attrs"]["error"]
        assert "loss" not in r["metrics"] and not list(run.glob("checkpoints/*.pt"))


def test_store_auto_on_a_gpu_gets_what_the_other_device_terms_leave(cora_parts):
    from hpcgnn.engine.estimate import CUDA_CONTEXT, estimate_device_memory, part_shapes, store_auto_bytes
    from hpcgnn.engine.memory_minibatch import hec_capacity_bytes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config
    from hpcgnn.store.budget import resolve_budget

    store = cora_parts(2)
    meta = read_meta(store)
    cfg = load_config(ROOT / "inputs" / "cora-sage.toml", [f"data.partitions={store}"])
    shapes = part_shapes(meta.path, 0)
    full = estimate_device_memory(cfg, meta, 0, device="cuda")          # 'auto', no figure: all rows
    rows = full.terms["store_rows"]
    assert rows == shapes["num_solid"] * meta.num_features * 4 and full.terms["cuda_context"] == CUDA_CONTEXT
    cap = hec_capacity_bytes(cfg, meta, shapes)
    assert cap > 0
    others = estimate_device_memory(cfg, meta, 0, device="cuda", store_available=0).total
    assert others == full.total - rows                  # the store's rows are the only difference
    for free, want in ((others + rows // 3, rows // 3), (others + rows + cap, rows + cap),
                       (others + 2 * (rows + cap), rows + cap), (others // 2, 0)):
        got = store_auto_bytes(cfg, meta, 0, free)
        assert got == max(free - others, 0)
        assert resolve_budget("auto", rows, "cuda", got, cap) == want
        est = estimate_device_memory(cfg, meta, 0, device="cuda", store_available=got)
        assert est.terms["store_rows"] == min(want, rows)
    assert est.total == others                                           # nothing left: no store rows
    assert resolve_budget("auto", rows, "cpu", 10 ** 9) == 0                # the CPU: host-only


# (name, config, overrides): every run of the comparison, trained in one 2-rank launch
RUNS = [
    ("mb-b16", "cora-sage.toml", []),
    ("fg-gcn", "cora-gcn-fullgraph.toml", []),
    ("fg-gat", "cora-gcn-fullgraph.toml", ["model.arch=gat"]),
    ("tp-1chunk", "cora-tensor.toml", ["tensor.staged=true"]),
    ("tp-1chunk-resident", "cora-tensor.toml", ["tensor.staged=true", "tensor.device_memory=64MiB"]),
]

# every run of RUNS in one process per rank: `hpcgnn train` one after the other
DRIVER = """
import sys
from hpcgnn.cli import main
store, out = sys.argv[1], sys.argv[2]
for spec in sys.argv[3:]:
    name, config, *sets = spec.split("|")
    args = ["train", "--config", config, "--set", "data.partitions=" + store, "--set", "output.dir=" + out + "/" + name,
            "--set", "train.epochs=1", "--set", "runtime.device_memory_limit=1GiB"]
    for s in sets:
        args += ["--set", s]
    rc = main(args)
    if rc:
        sys.exit("run " + name + " exited " + str(rc))
"""


def test_the_device_estimate_is_recorded_and_reported_beside_the_meters_peak(cora_parts, tmp_path):
    """Each rank's meter peak (counters/peak_device_bytes, the one DeviceMemoryMeter of the rank,
    over a training epoch) beside :func:`estimate_device_memory` (what the pre-run check
    computes, recorded in the run file and shown by ``hpcgnn report``): an upper bound within 2x
    for every run and rank; the resident tensor path is chosen and counted (``resident``), the
    streamed one has no such term."""
    from hpcgnn.engine.estimate import estimate_device_memory
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    specs = ["|".join([name, str(ROOT / "inputs" / config), *sets]) for name, config, sets in RUNS]
    proc = run_mpi(2, ["-c", DRIVER, store, tmp_path, *specs], timeout=300, env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = read_meta(store)
    ratios = {}
    for name, config, sets in RUNS:
        run = read_run(tmp_path / name)
        measured = np.nanmax(run["counters"]["peak_device_bytes"], axis=0)
        cfg = load_config(ROOT / "inputs" / config, [f"data.partitions={store}", *sets])
        for rank in (0, 1):
            est = estimate_device_memory(cfg, meta, rank, device="cpu")
            assert measured[rank] > 0, (name, measured)
            # the run file records the pre-run check's estimate beside the measured peak
            assert json.loads(run["attrs"]["estimated_peak_device_bytes"])[rank] == est.total, name
            assert json.loads(run["attrs"]["estimated_device_terms"])[rank] == est.terms, name
            assert json.loads(run["attrs"]["estimated_peak_rss_bytes"])[rank] > 0, name
            # `hpcgnn report` shows both, per rank
            shown = summarise(run)["memory_estimates"]["device"][rank]
            assert shown["estimated"] == est.total and shown["measured"] == measured[rank]
            assert shown["ratio"] == pytest.approx(est.total / measured[rank]), name
            assert summarise(run)["memory_estimates"]["host"][rank]["ratio"] > 0, name
            ratios[name, rank] = est.total / measured[rank]
            if name.startswith("tp-"):
                assert ("resident" in est.terms) == name.endswith("resident"), (name, est.terms)
                assert bool(run["attrs"]["tensor_resident"]) == name.endswith("resident")
        table = format_table(summarise(run)).splitlines()
        line = next(ln for ln in table if ln.startswith("estimate   device peak estimated before the run / measured: "))
        assert f"rank 1 {est.total / 2**30:.2f} / {measured[1] / 2**30:.2f} GiB ({est.total / measured[1]:.2f}x)" in line
        # the device's peak with set-up beside the epochs' (at least as large)
        whole = np.nanmax(run["counters"]["peak_process_device_bytes"], axis=0)
        assert np.all(whole >= measured), name
        line = next(ln for ln in table if ln.startswith("device     peak of an epoch / with set-up: "))
        assert f"rank 1 {measured[1] / 2**30:.2f} / {whole[1] / 2**30:.2f} GiB" in line
    bad = {k: round(r, 3) for k, r in ratios.items() if not 1 <= r <= 2}
    assert not bad, (bad, ratios)


# --- ranks sharing one GPU: their needs add up against its free memory ----------------------

def _row(rank, need, limit, gpu):
    return (rank, need, ("activations", need // 2), "lower the batch size", limit, gpu)


def test_ranks_on_one_gpu_add_up_and_ranks_on_their_own_gpus_do_not():
    from hpcgnn.engine.memory_check import device_overcommit

    gib = 2**30
    # two ranks, 6 GiB each, on GPUs with 10 GiB free: fine apart, refused together
    apart = [_row(0, 6 * gib, 10 * gib, "n0:GPU-a"), _row(1, 6 * gib, 10 * gib, "n0:GPU-b")]
    assert device_overcommit(apart) is None
    together = [_row(0, 6 * gib, 10 * gib, "n0:GPU-a"), _row(1, 6 * gib, 10 * gib, "n0:GPU-a")]
    ranks, need, limit, worst = device_overcommit(together)
    assert (ranks, need, limit, worst[0]) == ([0, 1], 12 * gib, 10 * gib, 0)
    # the same UUID on another node is another GPU; a stated limit ("" identity) is per rank
    assert device_overcommit([_row(0, 6 * gib, 10 * gib, "n0:GPU-a"), _row(1, 6 * gib, 10 * gib, "n1:GPU-a")]) is None
    assert device_overcommit([_row(0, 6 * gib, 10 * gib, ""), _row(1, 6 * gib, 10 * gib, "")]) is None
    # the group with the largest excess is named, with its neediest rank and the smallest free figure
    rows = [_row(0, 3 * gib, 8 * gib, "n0:GPU-a"), _row(1, 7 * gib, 9 * gib, "n0:GPU-a"),
            _row(2, 11 * gib, 10 * gib, "")]
    ranks, need, limit, worst = device_overcommit(rows)
    assert (ranks, need, limit, worst[0]) == ([0, 1], 10 * gib, 8 * gib, 1)


def test_gpu_identity_is_empty_off_cuda():
    from hpcgnn.runtime import gpu_identity

    assert gpu_identity("cpu") == ""


def test_deterministic_device_runs_count_the_spmm_slice(cora_parts):
    """``train.deterministic`` on CUDA: the SpMM's gathered slice of edge rows is a device term
    (at most SEGMENT_SPMM_ELEMENTS floats, one column when the edges exceed it), absent without
    the setting and on the CPU."""
    from hpcgnn.engine.estimate import estimate_device_memory, layer_widths, part_shapes
    from hpcgnn.nn.aggregate import SEGMENT_SPMM_ELEMENTS
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    meta = read_meta(store)
    s = part_shapes(store, 0)
    for engine in ("fullgraph", "minibatch", "tensor"):
        sets = [f"data.partitions={store}", f"train.engine={engine}"]
        plain = estimate_device_memory(load_config(ROOT / "inputs" / "cora-sage.toml", sets), meta, 0, s, "cuda")
        cfg = load_config(ROOT / "inputs" / "cora-sage.toml", sets + ["train.deterministic=true"])
        det = estimate_device_memory(cfg, meta, 0, s, "cuda")
        assert "deterministic" not in plain.terms and det.terms["deterministic"] > 0, engine
        # the term and its share of the device margin
        assert det.total - plain.total == pytest.approx(1.25 * det.terms["deterministic"], abs=2), engine
        assert "deterministic" not in estimate_device_memory(cfg, meta, 0, s, "cpu").terms
        if engine == "fullgraph":
            width = max(layer_widths(cfg, meta.num_features, meta.num_classes))
            assert det.terms["deterministic"] == min(s["num_edges"] * width, SEGMENT_SPMM_ELEMENTS) * 4


def test_pipelined_halo_messages_count_on_the_device_only_with_a_device_data_plane(cora_parts, monkeypatch):
    """The full graph's cached and pipelined halo on CUDA: the cache's tiers are device terms;
    the messages in flight (``halo_pipeline``) are device bytes only when the data plane moves
    device buffers (NCCL); mpi4py and gloo keep them in host memory."""
    import torch.distributed as dist

    from hpcgnn.comm.communicator import moves_device_buffers
    from hpcgnn.engine.estimate import estimate_rank_memory, part_shapes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    meta = read_meta(store)
    s = part_shapes(store, 0)
    sets = [f"data.partitions={store}", "train.engine=fullgraph", "train.device=cuda", "fullgraph.halo=cached",
            "fullgraph.staleness=2", "fullgraph.pipeline=true"]
    host = estimate_rank_memory(load_config(ROOT / "inputs" / "cora-sage.toml", sets), meta, 0, 0, s, device="cpu")
    assert host.terms["halo_pipeline"] > 0 and host.terms["halo_cache"] > 0
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)       # a CUDA build's answer
    for backend, device_plane in (("mpi4py", False), ("gloo", False), ("nccl", True), ("auto", True)):
        assert moves_device_buffers(backend, "cuda") is device_plane
        cfg = load_config(ROOT / "inputs" / "cora-sage.toml", sets + [f"runtime.backend={backend}"])
        est = estimate_rank_memory(cfg, meta, 0, 0, s, device="cuda")
        assert est.device["halo_cache"] == host.terms["halo_cache"] and "halo_cache" not in est.terms
        # the messages in flight: on the device with a device data plane, else in host memory
        where, other = (est.device, est.terms) if device_plane else (est.terms, est.device)
        assert where["halo_pipeline"] == host.terms["halo_pipeline"] and "halo_pipeline" not in other, backend
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)      # a CPU-only build: auto is mpi4py
    assert not moves_device_buffers("auto", "cuda") and not moves_device_buffers("nccl", "cpu")


def test_the_exact_halo_mode_keeps_the_whole_graph_frontiers(cora_parts):
    """``minibatch.halo = "exact"`` samples over the whole graph: its modelled frontiers draw
    from every vertex, larger than the HEC mode's over the partition's local rows, and so are
    its activations."""
    from hpcgnn.engine.estimate import estimate_device_memory, part_shapes
    from hpcgnn.engine.memory_minibatch import frontier
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    meta = read_meta(store)
    s = part_shapes(store, 0)
    sets = [f"data.partitions={store}", "minibatch.batch_size=64", "minibatch.fanouts=[10, 25]", "model.layers=2"]
    exact = load_config(ROOT / "inputs" / "cora-sage.toml", sets + ["minibatch.halo=\"exact\""])
    hec = load_config(ROOT / "inputs" / "cora-sage.toml", sets)
    whole, local = frontier(exact, meta, s, True, 64)[0], frontier(hec, meta, s, False, 64)[0]
    assert whole[0] > local[0] and whole[-1] == local[-1] == 64
    act = {cfg.minibatch.halo: estimate_device_memory(cfg, meta, 0, s, device="cpu").terms["activations"]
           for cfg in (exact, hec)}
    assert act["exact"] > act["hec"]
