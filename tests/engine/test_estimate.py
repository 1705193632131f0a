"""The coarse memory estimate (hpcgnn.engine.estimate and the engines' memory terms) against
measured peaks, the pre-run refusal and the measured first step's stop.

* Per engine (minibatch, full graph in memory, offloaded, tensor staged) on Cora and a
  20k-vertex SBM, 2 ranks: the estimate ``train`` records is an upper bound within 2x of every
  rank's measured peak RSS, and its device estimate (the CPU meter's tensors) of the measured
  device peak.
* Clearly over the node's limit: refused before any data is read (one line, exit 2 on every
  rank, no run file), naming the largest term and the setting that shrinks it.
* Within the pre-run check's floor but over the limit once the first step is measured: stopped
  after that step, one line and exit 2 on every rank, the run file ``failed`` with that line
  and no epoch or checkpoint written.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402
from mpiutil import ROOT, run_cli  # noqa: E402

from hpcgnn.run.output import read_run  # noqa: E402
from hpcgnn.units import parse_size  # noqa: E402

ONE_THREAD = {"HPCGNN_THREADS": "1"}
FULLGRAPH = ROOT / "inputs" / "cora-gcn-fullgraph.toml"


@pytest.fixture(scope="module")
def sbm_parts(tmp_path_factory):
    """A 20k-vertex SBM (64 features, 8 classes, 400k edges) in 2 METIS parts."""
    d = tmp_path_factory.mktemp("sbm")
    for args in (["prepare", "--dataset", "sbm", "--nodes", "20000", "--edges", "400000", "--features", "64",
                  "--classes", "8", "--out", d / "g.h5", "--force"],
                 ["partition", d / "g.h5", "--parts", "2", "--seed", "0", "--out", d / "p2", "--force"]):
        proc = run_cli(args, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return d / "p2"


ENGINES = {
    "minibatch": ("cora-sage.toml", []),
    "fullgraph": ("cora-gcn-fullgraph.toml", []),
    "offloaded": ("cora-gcn-fullgraph.toml", ["model.arch=gat", "model.heads=2", "model.hidden=16",
                                              "fullgraph.offload=true", "fullgraph.chunks=4"]),
    "tensor": ("cora-tensor.toml", ["tensor.staged=true", "tensor.chunks=1"]),
}
MORE = {   # other architectures and layouts (slow)
    "minibatch-gat": ("cora-gat.toml", []),
    "fullgraph-sage": ("cora-gcn-fullgraph.toml", ["model.arch=sage"]),
    "fullgraph-gat": ("cora-gcn-fullgraph.toml", ["model.arch=gat", "model.heads=2", "model.hidden=16"]),
    "offloaded-gcn": ("cora-gcn-fullgraph.toml", ["fullgraph.offload=true", "fullgraph.chunks=4"]),
}


def _ratios(parts, tmp_path, config: str, sets: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(host, device) estimate / measured peak per rank of a 2-rank, 2-epoch run (the estimate is
    the one train recorded; a stated device size makes it estimate the device too)."""
    extra = [a for s in [*sets, "train.epochs=2", "train.eval_every=1", "train.checkpoint_every=0",
                         "runtime.device_memory_limit=64GiB"] for a in ("--set", s)]
    proc = mb.train(2, ROOT / "inputs" / config, parts, tmp_path / "run", *extra, timeout=240, env=ONE_THREAD,
                    fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(tmp_path / "run")
    c, a = run["counters"], run["attrs"]
    host = np.asarray(json.loads(a["estimated_peak_rss_bytes"]), float) / np.nanmax(c["peak_rss_bytes"], axis=0)
    measured = np.nanmax(c["peak_device_bytes"], axis=0)
    assert (measured > 0).all()
    device = np.asarray(json.loads(a["estimated_peak_device_bytes"]), float) / measured
    return host, device


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("graph", ["cora", "sbm"])
def test_estimate_is_an_upper_bound_within_2x_of_the_measured_peak(cora_parts, sbm_parts, tmp_path, engine, graph):
    config, sets = ENGINES[engine]
    host, device = _ratios(cora_parts(2) if graph == "cora" else sbm_parts, tmp_path, config, sets)
    assert ((host >= 1) & (host <= 2)).all(), host
    assert ((device >= 1) & (device <= 2)).all(), device


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(MORE))
def test_estimate_bounds_other_architectures_within_2x(sbm_parts, tmp_path, engine):
    host, device = _ratios(sbm_parts, tmp_path, *MORE[engine])
    assert ((host >= 1) & (host <= 2)).all(), host
    assert ((device >= 1) & (device <= 2)).all(), device


def test_clearly_over_the_limit_is_refused_before_any_data_is_read(cora_parts, tmp_path):
    parts = cora_parts(2)
    run = tmp_path / "run"
    base = ["train", "--config", str(ROOT / "inputs" / "cora-sage.toml"), "--set", f"data.partitions={parts}",
            "--set", f"output.dir={run}", "--set", "runtime.memory_limit=200MiB"]
    proc, codes = mb.train_each_rank_exit(2, base, timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcgnn: error:")]
    assert len(lines) == 1, proc.stderr
    assert "peak memory of the 2 ranks" in lines[0] and "clearly over the limit" in lines[0]
    assert "runtime.memory_limit" in lines[0] and "largest term" in lines[0] and "shrink it with" in lines[0]
    assert "runtime.memory_check = false" in lines[0]
    assert "Traceback" not in proc.stderr and not (run / "run.h5").exists()
    # the same job with the check off starts and trains (the refusal is the check's)
    proc, codes = mb.train_each_rank_exit(2, [*base, "--set", "runtime.memory_check=false",
                                              "--set", "train.epochs=1"], timeout=120)
    assert codes == {0: 0, 1: 0}, proc.stderr


def test_bad_memory_limit_is_one_line():
    from hpcgnn.errors import InputError

    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("512 MiB") == 512 << 20
    assert parse_size("2GB") == 2_000_000_000 and parse_size(1024) == 1024
    with pytest.raises(InputError, match="runtime.memory_limit = '12 parsecs'"):
        parse_size("12 parsecs", "runtime.memory_limit")


def test_model_too_large_is_refused_naming_model_state(cora_parts, tmp_path):
    """hidden 200000 on Cora's 1433 features: 576 M parameters, 2.1 GiB per float32 copy, five
    copies per rank (counted exactly): refused against a stated 16 GiB before the first epoch."""
    parts = cora_parts(2)
    cfg = str(ROOT / "inputs" / "cora-sage.toml")
    sets = ["--set", "model.hidden=200000", "--set", "runtime.memory_limit=16GiB"]
    got = run_cli(["inspect", str(parts), "--config", cfg, "--json", *sets], timeout=120)
    assert got.returncode == 0, got.stderr
    est = json.loads(got.stdout)["memory_estimate"]
    assert sum(r["floor_bytes"] for r in est["ranks"]) > parse_size("16GiB")
    assert [r["largest"] for r in est["ranks"]] == ["model_state", "model_state"], est
    run = tmp_path / "run"
    proc, codes = mb.train_each_rank_exit(2, ["train", "--config", cfg, "--set", f"data.partitions={parts}",
                                              "--set", f"output.dir={run}", "--set", "train.epochs=1", *sets],
                                          timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcgnn: error:")]
    assert len(lines) == 1, proc.stderr
    assert "runtime.memory_limit" in lines[0] and "largest term: model_state" in lines[0], lines[0]
    assert "shrink it with model.hidden or model.layers" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "epoch 1" not in proc.stdout
    assert not (run / "run.h5").exists()


def test_a_run_over_the_limit_after_its_first_step_is_stopped_there(sbm_parts, tmp_path):
    """Full-graph GAT on the SBM: a node limit above the pre-run floor of the 2 ranks but below
    their measured peaks lets the run start; its first step is measured, the projected epoch
    peak does not fit, and every rank stops there with exit 2 and one line. The run file says
    failed with that line and holds no epoch; no checkpoint exists."""
    cfg = FULLGRAPH
    sets = ["model.arch=gat", "model.heads=2", "model.hidden=16"]
    extra = [a for s in sets for a in ("--set", s)]
    proc = mb.train(2, cfg, sbm_parts, tmp_path / "free", *extra, "--set", "train.epochs=1",
                    "--set", "runtime.memory_check=false", timeout=240, env=ONE_THREAD, fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    free = read_run(tmp_path / "free")
    assert free["metrics"]["loss"].shape == (1,)          # a run that logs its epoch
    peaks = np.nanmax(free["counters"]["peak_rss_bytes"], axis=0)
    got = run_cli(["inspect", str(sbm_parts), "--config", str(cfg), "--json", *extra], timeout=120, fresh=True)
    assert got.returncode == 0, got.stderr
    floor = sum(r["floor_bytes"] for r in json.loads(got.stdout)["memory_estimate"]["ranks"])
    assert floor < 0.9 * peaks.sum(), (floor, peaks)      # room for a limit between the two
    limit = f"{int((floor + peaks.sum()) / 2) >> 20}MiB"
    run = tmp_path / "run"
    proc, codes = mb.train_each_rank_exit(2, [
        "train", "--config", str(cfg), "--set", f"data.partitions={sbm_parts}", "--set", f"output.dir={run}",
        *extra, "--set", "train.epochs=2", "--set", f"runtime.memory_limit={limit}"], timeout=240)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcgnn: error:")]
    assert len(lines) == 1, proc.stderr
    assert "stopped after the first step" in lines[0] and "projected peak memory of the 2 ranks" in lines[0]
    assert "runtime.memory_limit" in lines[0] and "largest term" in lines[0] and "shrink it with" in lines[0]
    assert "Traceback" not in proc.stderr and "epoch 1/" not in proc.stdout
    r = read_run(run)
    assert r["attrs"]["status"] == "failed" and "stopped after the first step" in r["attrs"]["error"]
    assert r["metrics"].get("loss", np.zeros(0)).shape == (0,)
    assert not list(run.glob("checkpoints/*.pt"))


@pytest.mark.parametrize("arch,sets", [
    ("sage", []), ("gcn", []), ("gat", ["model.gat_variant=distgnn"]), ("gat", ["model.gat_variant=standard"]),
    ("sage", ["train.precision=bf16"]), ("gat", ["train.precision=bf16", "model.heads=2"]),
])
def test_model_state_counts_the_built_model(cora_parts, arch, sets):
    """``model_state`` = the parameters of a real model built as the engines build it x 4 bytes
    x 5 copies (values, gradients, Adam's exp_avg and exp_avg_sq, the allreduce buffer); bf16
    adds the linear layers' bfloat16 copies (2 bytes); on CUDA the device holds four copies and
    the host the allreduce buffer and its copy."""
    from types import SimpleNamespace

    from hpcgnn.engine.estimate import MemoryEstimate, model_terms
    from hpcgnn.nn.models import build_model
    from hpcgnn.nn.precision import Linear
    from hpcgnn.run.config import load_config

    cfg = load_config(ROOT / "inputs" / "cora-sage.toml",
                      [f"data.partitions={cora_parts(2)}", f"model.arch={arch}", "model.hidden=24",
                       "model.layers=3", "minibatch.fanouts=[5, 5, 5]", *sets])
    meta = SimpleNamespace(num_features=37, num_classes=5, num_parts=2)
    m = cfg.model
    model = build_model(arch, 37, 24, 5, 3, m.heads, gat_variant=m.gat_variant)
    n = sum(p.numel() for p in model.parameters())
    lin = sum(p.numel() for mod in model.modules() if isinstance(mod, Linear) for p in mod.parameters())
    bf16 = 2 * lin if cfg.train.precision == "bf16" else 0
    est = MemoryEstimate(0)
    model_terms(cfg, meta, est, "cpu")
    assert est.params == n and n > 37 * 24
    assert est.terms["model_state"] == n * 4 * 5 + bf16 and est.terms["optimizer_step"] == n * 4 * 3
    assert est.shrink["model_state"].startswith("model.hidden")
    est = MemoryEstimate(0)
    model_terms(cfg, meta, est, "cuda")
    assert est.device["model_state"] == n * 4 * 4 + bf16 and est.terms["model_state"] == n * 4 * 2


_ADAM_STEP = """
import json, sys
import torch
from hpcgnn.engine.estimate import STEP_COPIES
from hpcgnn.nn.models import build_model
from hpcgnn.nn.optim import Adam
from hpcgnn.run.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

arch, weight_decay = sys.argv[1], float(sys.argv[2])
model = build_model(arch, 1433, 8000, 7, 2, seed=0)
for p in model.parameters():
    p.grad = torch.full_like(p, 1e-3)
opt = Adam(model.parameters(), lr=0.01, weight_decay=weight_decay)
opt.step()                                  # allocates the moments
before = rss_bytes()
resettable = reset_peak_rss()
opt.step()
params = sum(p.numel() for p in model.parameters()) * 4
print(json.dumps({"resettable": resettable, "measured": peak_rss_bytes() - before, "bound": STEP_COPIES * params,
                  "params": params}))
"""


@pytest.mark.parametrize("arch,weight_decay", [("sage", 5e-4), ("gcn", 5e-4)])
def test_optimizer_step_term_bounds_the_measured_adam_step(arch, weight_decay):
    """``optimizer_step`` (three float32 copies of the parameters) bounds the measured rise of
    the peak RSS over one Adam step on the CPU (weights of 46 MB), in a fresh interpreter, and
    is within 2x of it."""
    import subprocess

    from mpiutil import clean_env

    proc = subprocess.run([sys.executable, "-c", _ADAM_STEP, arch, str(weight_decay)], capture_output=True,
                          text=True, timeout=120, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not got["resettable"]:
        pytest.skip("no /proc/self/clear_refs: the peak RSS cannot be reset")
    assert got["measured"] <= got["bound"] <= 2 * got["measured"], got


def test_on_a_gpu_the_tensor_engine_keeps_its_topology_in_host_memory(cora_parts):
    """On CUDA the tensor engine's replicated topology and feature-layout slices stay in host
    memory; the device holds the NN part, one chunk, the model's copies and the CUDA context."""
    from hpcgnn.engine.estimate import CUDA_CONTEXT, estimate_rank_memory, host_device_peak
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config

    store = cora_parts(2)
    meta = read_meta(store)
    cpu = load_config(ROOT / "inputs" / "cora-tensor.toml", [f"data.partitions={store}"])
    gpu = load_config(ROOT / "inputs" / "cora-tensor.toml", [f"data.partitions={store}", "train.device=cuda"])
    on_cpu = estimate_rank_memory(cpu, meta, 0, 0, device="cpu")
    on_gpu = estimate_rank_memory(gpu, meta, 0, 0, device="cuda")
    host, dev = host_device_peak(gpu, meta, {}, on_gpu, 2, "cuda")
    # staged on a GPU: the chunks' topology too
    assert host == on_gpu.total and on_gpu.terms["topology"] > on_cpu.terms["topology"] > 0
    assert {"nn", "chunk", "model_state", "cuda_context"} <= set(on_gpu.device)
    assert dev == sum(on_gpu.device.values()) and on_gpu.device["cuda_context"] == CUDA_CONTEXT
    assert host_device_peak(cpu, meta, {}, on_cpu, 2, "cpu") == (on_cpu.total, 0)


def test_the_first_step_projection_rule():
    """``before + (peak - before) x (1 + spread) + pending``; pending is the evaluation's excess
    over the step and the HEC rows still to write; the minibatch engine's spread is a half."""
    from hpcgnn.engine.memory_check import STEP_SPREAD, FirstStepCheck

    assert FirstStepCheck.project(100, 160, 0.5, 10) == 200
    assert FirstStepCheck.project(100, 90, 0.5, 0) == 100          # a peak below the start adds nothing
    assert FirstStepCheck.pending({"hec": 7}, {"eval": 50, "activations": 20}) == 37
    assert FirstStepCheck.pending({}, {"eval": 20, "activations": 50}) == 0
    assert STEP_SPREAD == {"minibatch": 0.5}


def test_the_first_step_check_passes_every_hook_through():
    """The check wraps the run's hooks: each call and attribute reaches them; with
    ``runtime.memory_check = false`` it measures nothing (no collective)."""
    from types import SimpleNamespace

    from hpcgnn.engine.hooks import TrainHooks
    from hpcgnn.engine.memory_check import FirstStepCheck

    class Recording(TrainHooks):
        wants_layer_inputs = True
        path = "rank-00000.h5"

        def __init__(self):
            self.calls = []

        def before_step(self, epoch, step):
            self.calls.append(("before", epoch, step))

        def after_step(self, epoch, step, loss, seeds, model):
            self.calls.append(("after", epoch, step, seeds))

        def layer_input(self, engine, epoch, step, layer, frontier, h):
            self.calls.append(("layer", layer))

        def after_epoch(self, epoch, engine):
            self.calls.append(("epoch", epoch))

    inner = Recording()
    cfg = SimpleNamespace(runtime=SimpleNamespace(memory_check=False), train=SimpleNamespace(engine="minibatch"))
    hooks = FirstStepCheck(inner, cfg, rt=None, host=None)
    hooks.attach(SimpleNamespace(timer=SimpleNamespace(memory=None)))
    hooks.before_step(1, 0)
    hooks.after_step(1, 0, 0.5, 16, None)
    hooks.layer_input(None, 1, 0, 2, None, None)
    hooks.after_epoch(1, None)
    assert inner.calls == [("before", 1, 0), ("after", 1, 0, 16), ("layer", 2), ("epoch", 1)]
    assert hooks.wants_layer_inputs and not hooks.wants_exchanges and hooks.path == "rank-00000.h5"
    assert hooks.done and hooks.before is None
