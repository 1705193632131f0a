"""The compute device's memory (hpcgnn.engine.estimate: estimate_device_memory,
check_device_memory; hpcgnn.store.budget: store.device_memory = 'auto'; hpcgnn.run.memory:
the one DeviceMemoryMeter).

* A stated ``runtime.device_memory_limit`` that a config cannot fit stops every rank of a real
  2-rank run with exit 2 and one line naming the largest term and the setting that shrinks it,
  before any run file exists.
* ``store.device_memory = 'auto'`` on a GPU gets what the device has left after the other terms.
* The device estimate of the pre-run check (``sample``: sampled minibatch frontiers, the real
  tensor chunks) is within 25 % of the meter's measured peak of device-placed tensors of real
  2-rank CPU runs, for the minibatch (2 configs), full graph (GCN, GAT) and staged tensor
  (1 chunk, 4 chunks streamed, 4 chunks resident) engines; the model-only figures (no store:
  ``hpcgnn plan``, and the sizing of ``tensor.chunks = 'auto'``) stay above it.
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
    from hpcgnn.engine.estimate import (CUDA_CONTEXT, estimate_device_memory, hec_capacity_bytes, part_shapes,
                                        store_auto_bytes)
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config
    from hpcgnn.store.budget import resolve_budget

    store = cora_parts(2)
    meta = read_meta(store)
    cfg = load_config(ROOT / "inputs" / "cora-sage.toml", [f"data.partitions={store}"])
    shapes = part_shapes(meta.path, 0)
    full = estimate_device_memory(cfg, meta, 0, device="cuda")          # 'auto', no figure: all rows
    rows = full.terms["store_rows"]
    assert rows > 0 and full.terms["cuda_context"] == CUDA_CONTEXT
    # no figure: the budget is unlimited and the HECs' rows go to the device too; with a figure
    # 'auto' asks for the feature rows and the HECs at capacity, the feature rows first (the
    # HECs' tag directories are host memory whatever the budget)
    hec = full.terms["hec"]
    cap = hec_capacity_bytes(cfg, meta, shapes)
    assert 0 < hec <= cap
    empty = estimate_device_memory(cfg, meta, 0, device="cuda", store_available=0)
    others = empty.total
    # with every row on the device, evaluation reads layer 0's input from the store (no copy);
    # the empty store's estimate counts that input in its eval term instead
    credit = empty.terms.get("eval", 0) - full.terms.get("eval", 0)
    assert credit in (0, shapes["num_solid"] * meta.num_features * 4)
    assert others == full.total - rows - hec + credit
    for free, want, want_hec in ((others + rows // 3, rows // 3, 0),
                                 (others + rows + hec // 2, rows + hec // 2, hec // 2),
                                 (others + rows + cap, rows + cap, hec),
                                 (others + 2 * (rows + cap), rows + cap, hec),
                                 (others // 2, 0, 0)):
        got = store_auto_bytes(cfg, meta, 0, free)
        assert got == max(free - others, 0)
        assert resolve_budget("auto", rows, "cuda", got, cap) == want
        est = estimate_device_memory(cfg, meta, 0, device="cuda", store_available=got)
        assert est.terms["store_rows"] == min(want, rows) and est.terms.get("hec", 0) == want_hec
    assert est.total == others                                           # nothing left: no store rows
    assert resolve_budget("auto", rows, "cpu", 10 ** 9) == 0                # the CPU: host-only


# (name, config, overrides): every run of the comparison, trained in one 2-rank launch
RUNS = [
    ("mb-b16", "cora-sage.toml", []),
    ("mb-3layers", "cora-sage.toml", ["model.layers=3", "minibatch.fanouts=[5,5,5]"]),
    ("fg-gcn", "cora-gcn-fullgraph.toml", []),
    ("fg-gat", "cora-gcn-fullgraph.toml", ["model.arch=gat"]),
    ("tp-1chunk", "cora-tensor.toml", ["tensor.staged=true"]),
    ("tp-4chunks", "cora-tensor.toml", ["tensor.staged=true", "tensor.chunks=4"]),
    ("tp-4chunks-resident", "cora-tensor.toml", ["tensor.staged=true", "tensor.chunks=4",
                                                 "tensor.device_memory=64MiB"]),
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


def test_device_estimate_within_25_percent_of_the_meters_peak_on_the_cpu(cora_parts, tmp_path):
    """Each rank's meter peak (counters/peak_device_bytes, the one DeviceMemoryMeter of the rank,
    over a training epoch) against :func:`estimate_device_memory` with ``sample`` (what the
    pre-run check computes): |estimate / measured - 1| <= 0.25 for every run and rank; the
    resident tensor path is chosen and counted (``resident``), the streamed one has no such
    term; without ``sample`` the minibatch and tensor figures are upper bounds."""
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
            est = estimate_device_memory(cfg, meta, rank, device="cpu", sample=True)
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
            if name.startswith(("mb-", "tp-")):         # the model alone: an upper bound
                assert estimate_device_memory(cfg, meta, rank, device="cpu").total >= measured[rank], name
        table = format_table(summarise(run)).splitlines()
        line = next(ln for ln in table if ln.startswith("estimate   device peak estimated before the run / measured: "))
        assert f"rank 1 {est.total / 2**30:.2f} / {measured[1] / 2**30:.2f} GiB ({est.total / measured[1]:.2f}x)" in line
        # the device's peak with set-up beside the epochs' (at least as large)
        whole = np.nanmax(run["counters"]["peak_process_device_bytes"], axis=0)
        assert np.all(whole >= measured), name
        line = next(ln for ln in table if ln.startswith("device     peak of an epoch / with set-up: "))
        assert f"rank 1 {measured[1] / 2**30:.2f} / {whole[1] / 2**30:.2f} GiB" in line
    bad = {k: round(r, 3) for k, r in ratios.items() if abs(r - 1) > 0.25}
    assert not bad, (bad, ratios)


# --- ranks sharing one GPU: their needs add up against its free memory ----------------------

def _row(rank, need, limit, gpu):
    return (rank, need, ("activations", need // 2), "lower the batch size", limit, gpu)


def test_ranks_on_one_gpu_add_up_and_ranks_on_their_own_gpus_do_not():
    from hpcgnn.engine.estimate import device_overcommit

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


def test_hec_rows_count_on_the_device_only_where_the_store_puts_them(cora_parts):
    """The CUDA estimate's ``hec`` term: the HECs' rows (never their tag directories, which are
    host memory) when the store's budget holds every feature row and every HEC at capacity;
    else at most what the feature rows leave of the budget."""
    from hpcgnn.engine.estimate import _sizes, hec_bytes, hec_device_bytes, part_shapes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    meta = read_meta(store)
    cfg = load_config(ROOT / "inputs" / "cora-sage.toml", [f"data.partitions={store}"])
    s = part_shapes(store, 0)
    rows, directory = hec_bytes(cfg, meta, s)
    assert rows > 0 and directory > 0
    ns, nh, _, _, widths, layers, _ = _sizes(cfg, meta, s)
    feats = ns * int(meta.num_features) * 4
    capacity = min(cfg.minibatch.cache_lines, nh) * sum(widths[:layers]) * 4
    assert hec_device_bytes(cfg, meta, s, None, feats) == rows
    assert hec_device_bytes(cfg, meta, s, feats + capacity, feats) == rows
    assert hec_device_bytes(cfg, meta, s, feats + capacity - 1, feats) == min(rows, capacity - 1)
    assert hec_device_bytes(cfg, meta, s, feats + rows // 2, feats) == rows // 2
    assert hec_device_bytes(cfg, meta, s, feats, feats) == 0 == hec_device_bytes(cfg, meta, s, feats // 2, feats)


def test_evaluation_on_a_gpu_counts_the_csr_it_copies_there(cora_parts):
    """Layer-wise inference on a GPU: the CUDA estimate's ``eval`` is the host ``eval`` phase with
    one destination chunk's temporaries as the inference sizes them (its own
    ``chunk_row_bytes`` of the built model per row, not the host's bound of six widest rows),
    plus the partition's CSR and degree scales it copies there ((num_solid + 1 + nnz) int64,
    2 x num_solid float32), and one round of halo rows where the host holds two (the rows it
    sends, selected from a host copy, and those it receives); with every feature row on the
    device, less layer 0's input (the store's rows, read in place)."""
    from hpcgnn.engine.estimate import (_sizes, estimate_device_memory, estimate_rank_memory,
                                        inference_chunk_row_bytes, part_shapes)
    from hpcgnn.engine.inference import DEFAULT_CHUNK_BYTES, chunk_row_bytes
    from hpcgnn.engine.model import build_model_from_config
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    meta = read_meta(store)
    s = part_shapes(store, 0)
    for arch in ("sage", "gcn", "gat"):
        sets = [f"data.partitions={store}", "minibatch.eval=\"full\"", "minibatch.batch_size=1",
                f"model.arch=\"{arch}\""]
        cfg = load_config(ROOT / "inputs" / "cora-sage.toml", sets + ["store.device_memory=0"])
        ns, nh, ne, _, widths, _, wmax = _sizes(cfg, meta, s)
        avg = ne / ns
        model = build_model_from_config(cfg, meta.num_features, meta.num_classes)
        row = inference_chunk_row_bytes(cfg, widths, avg)
        assert row == chunk_row_bytes(model, avg), arch      # the estimate mirrors the inference
        host = estimate_rank_memory(cfg, meta, 0, 0, s).phases["eval"]
        dev = estimate_device_memory(cfg, meta, 0, s, device="cuda")
        chunks = min(DEFAULT_CHUNK_BYTES, ns * 6 * wmax * 4), min(DEFAULT_CHUNK_BYTES, ns * row)
        rounds = max(1, -(-nh * wmax * 4 // DEFAULT_CHUNK_BYTES))      # auto_rounds from this halo
        one_round = -(-nh // rounds) * wmax * 4
        assert dev.terms["eval"] == host - chunks[0] + chunks[1] - one_round + (ns + 1 + ne) * 8 + 2 * ns * 4, arch
        if arch != "gat":
            every = load_config(ROOT / "inputs" / "cora-sage.toml", sets + ["store.device_memory=\"auto\""])
            got = estimate_device_memory(every, meta, 0, s, device="cuda").terms["eval"]
            assert got == dev.terms["eval"] - ns * meta.num_features * 4, arch


def test_deterministic_device_runs_count_the_spmm_slice(cora_parts):
    """``train.deterministic`` on CUDA: the SpMM's gathered slice of edge rows is a device term
    (at most SEGMENT_SPMM_ELEMENTS floats, one column when the edges exceed it), absent without
    the setting and on the CPU."""
    from hpcgnn.engine.estimate import _sizes, deterministic_spmm_bytes, estimate_device_memory, part_shapes
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
        assert "deterministic" not in plain.terms
        assert det.total - plain.total == det.terms["deterministic"] > 0, engine
        assert "deterministic" not in estimate_device_memory(cfg, meta, 0, s, "cpu").terms
        if engine == "fullgraph":
            _, _, ne, _, widths, _, _ = _sizes(cfg, meta, s)
            assert det.terms["deterministic"] == min(ne * max(widths), SEGMENT_SPMM_ELEMENTS) * 4
    assert deterministic_spmm_bytes(1 << 26, 8) == (1 << 26) * 4          # one column at a time
    assert deterministic_spmm_bytes(1000, 8) == 8000 * 4


def test_pipelined_halo_messages_count_on_the_device_only_with_a_device_data_plane(cora_parts, monkeypatch):
    """The full graph's cached and pipelined halo on CUDA: the cache's tiers are device terms;
    the messages in flight (``halo_pipeline``) are device bytes only when the data plane moves
    device buffers (NCCL); mpi4py and gloo keep them in host memory."""
    import torch.distributed as dist

    from hpcgnn.comm.communicator import moves_device_buffers
    from hpcgnn.engine.estimate import estimate_device_memory, estimate_rank_memory, part_shapes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    meta = read_meta(store)
    s = part_shapes(store, 0)
    sets = [f"data.partitions={store}", "train.engine=fullgraph", "train.device=cuda", "fullgraph.halo=cached",
            "fullgraph.staleness=2", "fullgraph.pipeline=true"]
    host = estimate_rank_memory(load_config(ROOT / "inputs" / "cora-sage.toml", sets), meta, 0, 0, s)
    assert host.terms["halo_pipeline"] > 0 and host.terms["halo_cache"] > 0
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)       # a CUDA build's answer
    for backend, device_plane in (("mpi4py", False), ("gloo", False), ("nccl", True), ("auto", True)):
        assert moves_device_buffers(backend, "cuda") is device_plane
        cfg = load_config(ROOT / "inputs" / "cora-sage.toml", sets + [f"runtime.backend={backend}"])
        est = estimate_device_memory(cfg, meta, 0, s, "cuda")
        assert est.terms["halo_cache"] == host.terms["halo_cache"]
        assert est.terms.get("halo_pipeline", 0) == (host.terms["halo_pipeline"] if device_plane else 0), backend
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)      # a CPU-only build: auto is mpi4py
    assert not moves_device_buffers("auto", "cuda") and not moves_device_buffers("nccl", "cpu")


def test_the_evaluation_halo_round_is_the_inference_round():
    """The evaluation's halo round is the layer-wise inference's: rows of this rank's halo split
    into :func:`~hpcgnn.engine.inference.auto_rounds` rounds (or ``minibatch.eval_halo_rounds``),
    one round on the device and two in host memory (sent and received)."""
    from hpcgnn.engine.estimate import minibatch_eval_bytes
    from hpcgnn.engine.inference import auto_rounds
    from hpcgnn.run.config import load_config

    cfg = load_config(ROOT / "inputs" / "products-sage.toml", [])
    widths = [100, 256, 256, 47]
    s = {"num_solid": 300_000, "num_halo": 311_489, "num_edges": 15_000_000}
    rounds = auto_rounds(None, s["num_halo"], 256)
    assert rounds == 2                                # 304 MiB of 256-wide rows: two rounds
    one = -(-s["num_halo"] // rounds) * 256 * 4
    host, dev = minibatch_eval_bytes(cfg, s, widths), minibatch_eval_bytes(cfg, s, widths, device=True)
    assert host - dev == one
    cfg4 = load_config(ROOT / "inputs" / "products-sage.toml", ["minibatch.eval_halo_rounds=4"])
    assert dev - minibatch_eval_bytes(cfg4, s, widths, device=True) == one - -(-s["num_halo"] // 4) * 256 * 4


def test_the_exact_halo_mode_keeps_the_whole_graph_frontiers(cora_parts):
    """``minibatch.halo = "exact"`` samples over the whole graph: its frontiers are the uniform
    model's over every vertex (``minibatch_frontier_rows`` with ``exact``), larger than over
    the partition's, and the device check does not replace them with the partition sampler's
    (``sample=True``), which draws from local vertices only; the HEC mode's are sampled."""
    from hpcgnn.engine.estimate import estimate_device_memory, minibatch_frontier_rows, part_shapes
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    meta = read_meta(store)
    s = part_shapes(store, 0)
    sets = [f"data.partitions={store}", "minibatch.batch_size=64", "minibatch.fanouts=[10, 25]", "model.layers=2"]
    exact = load_config(ROOT / "inputs" / "cora-sage.toml", sets + ["minibatch.halo=\"exact\""])
    hec = load_config(ROOT / "inputs" / "cora-sage.toml", sets)
    whole, local = minibatch_frontier_rows(exact, meta, s), minibatch_frontier_rows(hec, meta, s)
    assert whole[0] > local[0] and whole[-1] == local[-1]
    act = {(cfg.minibatch.halo, sample): estimate_device_memory(cfg, meta, 0, s, device="cpu", sample=sample)
           .terms["activations"] for cfg in (exact, hec) for sample in (False, True)}
    assert act[("exact", True)] == act[("exact", False)]
    assert act[("hec", True)] != act[("hec", False)]
