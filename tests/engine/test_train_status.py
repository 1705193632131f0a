"""`hpcgnn train` under real mpiexec -n 2: the device each rank used is in the run file, a run
that fails says so in run.h5, and --resume refuses changed settings (exit 2 on every rank, one
line), accepts safe ones with one warning, and starts fresh where there is no run."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402

from hpcgnn.run.runfile import read_run  # noqa: E402

CONFIG = mb.small_config(epochs=2, batch_size=32, fanouts=4, nc=8, checkpoint_every=1, eval_every=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("status")
    store = mb.tiny_store(tmp / "store", mb.tiny_graph(num_nodes=200, seed=3), 2)
    cfg = mb.write_config(tmp / "run.toml", CONFIG)
    run = tmp / "run"
    proc = mb.train(2, cfg, store, run, "--resume")   # nothing to resume yet: a new run
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, cfg, store, run, proc


def _args(cfg, store, run, *extra):
    return ["train", "--config", str(cfg), "--set", f"data.partitions={store}",
            "--set", f"output.dir={run}", *extra]


def _lines(text, prefix):
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


def test_each_rank_records_its_device_and_the_run_finishes(setup):
    _, _, _, run, _ = setup
    r = read_run(run)
    assert r["attrs"]["status"] == "finished" and "error" not in r["attrs"]
    assert r["labels"]["device"].tolist() == [["cpu", "cpu"], ["cpu", "cpu"]]   # [epoch, rank]


def test_resume_with_a_changed_learning_rate_is_refused_on_every_rank(setup):
    tmp, cfg, store, run, _ = setup
    before = (run / "run.h5").read_bytes()
    proc, codes = mb.train_each_rank_exit(2, _args(cfg, store, run, "--resume", "--set", "train.lr=0.02"))
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"hpcgnn: error: {run / 'run.h5'}: cannot resume with changed settings: train.lr 0.01 -> 0.02 "
        "(resume with the run's values, or start a new run with --force; docs/runs.md lists what may "
        "change)"], proc.stderr
    assert (run / "run.h5").read_bytes() == before          # the refused resume wrote nothing


def test_resume_with_more_epochs_is_accepted_with_one_warning(setup):
    tmp, cfg, store, run, _ = setup
    cont = tmp / "cont"
    shutil.copytree(run, cont)
    proc = mb.train(2, cfg, store, cont, "--resume", "--set", "train.epochs=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _lines(proc.stderr, "hpcgnn:") == [   # (the copied run moved: output.dir changed too)
        "hpcgnn: warning: --resume with changed settings (safe to change): train.epochs 2 -> 3, "
        f'output.dir "{run}" -> "{cont}"']
    assert sum(l.startswith("epoch ") for l in proc.stdout.splitlines()) == 1                 # epoch 3 only
    r = read_run(cont)
    assert r["metrics"]["epoch"].tolist() == [1, 2, 3] and r["attrs"]["status"] == "finished"
    assert r["labels"]["device"].shape == (3, 2)


def test_resume_where_there_is_no_run_starts_fresh_and_says_so_once(setup):
    _, _, _, run, proc = setup     # the set-up's run was started with --resume
    assert _lines(proc.stderr, "hpcgnn:") == [
        f"hpcgnn: warning: --resume: {run} holds no run (run.h5 not found): starting a new run"]
    assert read_run(run)["metrics"]["epoch"].tolist() == [1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_input_error_after_the_run_started_marks_it_failed(setup):
    tmp, cfg, store, _, _ = setup
    bad = tmp / "nocuda"
    proc, codes = mb.train_each_rank_exit(2, _args(cfg, store, bad, "--set", "train.device=cuda"))
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "hpcgnn: error: train.device = 'cuda' but torch sees no CUDA device"], proc.stderr
    a = read_run(bad)["attrs"]
    assert a["status"] == "failed", a
    assert a["error"] == "train.device = 'cuda' but torch sees no CUDA device"


def test_a_checkpoint_of_another_model_shape_is_one_line_and_marks_the_run_failed(setup):
    tmp, cfg, store, run, _ = setup
    broken = tmp / "shape"
    shutil.copytree(run, broken)
    state = torch.load(broken / "checkpoints" / "ckpt-000002.pt", weights_only=True)
    state["model"] = {"no_such_parameter": torch.zeros(1)}   # load_state_dict fails on every rank
    torch.save(state, broken / "checkpoints" / "ckpt-000002.pt")
    proc, codes = mb.train_each_rank_exit(2, _args(cfg, store, broken, "--resume", "--set",
                                                   "train.epochs=3"), timeout=90)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    lines = _lines(proc.stderr, "hpcgnn: error:")
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "checkpoint does not fit the run's model (model.arch=sage, layers=2, hidden=8): Missing " \
        "key(s) in state_dict" in lines[0]
    a = read_run(broken)["attrs"]
    assert a["status"] == "failed" and a["error"] == lines[0][len("hpcgnn: error: "):], a


def test_exception_on_rank_0_marks_the_run_failed(setup):
    tmp, cfg, store, run, _ = setup
    broken = tmp / "broken"
    shutil.copytree(run, broken)
    state = torch.load(broken / "checkpoints" / "ckpt-000002.pt", weights_only=True)
    state["torch_rng"] = torch.zeros(3, dtype=torch.uint8)   # set_rng_state raises on every rank
    torch.save(state, broken / "checkpoints" / "ckpt-000002.pt")
    proc = mb.train(2, cfg, store, broken, "--resume", "--set", "train.epochs=3", timeout=90)
    assert proc.returncode != 0
    assert "RuntimeError: " in proc.stderr, proc.stderr[-3000:]
    a = read_run(broken)["attrs"]
    assert a["status"] == "failed", a
    assert a["error"].startswith("rank 0: RuntimeError: "), a["error"]
    assert "\n" not in a["error"]
    assert np.asarray(read_run(broken)["metrics"]["epoch"]).tolist() == [1, 2]
