"""run.h5 status (running / finished / failed) and what --resume accepts, in one process
(COMM_SELF). The same under mpiexec -n 2: tests/engine/test_train_status.py."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcgnn.errors import InputError
from hpcgnn.run.checkpoint import checkpoint_path, write_checkpoint_file
from hpcgnn.run.config import load_config
from hpcgnn.run.output import RunOutput
from hpcgnn.run.resume import SAFE_ON_RESUME, config_changes
from hpcgnn.run.runfile import read_run


@pytest.fixture(scope="module")
def rt():
    from mpi4py import MPI

    from hpcgnn.runtime import Runtime

    return Runtime.start(threads=1, comm=MPI.COMM_SELF)


def _meta(tmp_path):
    return SimpleNamespace(content_hash="ab" * 32, path=tmp_path / "parts", num_parts=1)


def _cfg(run_dir, *sets):
    return load_config(None, ["data.partitions=x", f"output.dir={run_dir}", *sets])


def _run_with_checkpoint(tmp_path, rt, *sets):
    run = tmp_path / "run"
    cfg = _cfg(run, *sets)
    out = RunOutput(run, rt, cfg, _meta(tmp_path), resume=False, force=False)
    out.log_epoch(1, {"loss": 1.0}, {"epoch": 1.0}, {})
    _write_checkpoint(run, 1, cfg, out.run_id, _meta(tmp_path).content_hash)
    out.close()
    return run


def _write_checkpoint(run, epoch, cfg, run_id, content_hash, **more):
    """A checkpoint as save_training_state writes it, without model state (RunOutput checks
    its identity, epoch and settings only)."""
    state = {"epoch": epoch, "content_hash": content_hash, "config": cfg.to_json(),
             "engine": cfg.train.engine, "run_id": run_id, "model": {}, **more}
    write_checkpoint_file(checkpoint_path(run, epoch), state)


def _stderr_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_resume_refuses_changed_settings_naming_each_with_old_and_new_value(tmp_path, rt, capsys):
    run = _run_with_checkpoint(tmp_path, rt, "train.lr=0.01", "minibatch.halo=hec")
    before = (run / "run.h5").read_bytes()
    cases = [(["train.lr=0.02"], "train.lr 0.01 -> 0.02"),
             (["train.seed=7"], "train.seed 0 -> 7"),
             (["minibatch.halo=exact"], 'minibatch.halo "hec" -> "exact"'),
             (["model.hidden=16", "model.layers=2", "minibatch.fanouts=[5, 10]", "train.epochs=20"],
              "model.hidden 256 -> 16, model.layers 3 -> 2, minibatch.fanouts [5, 10, 15] -> [5, 10]")]
    for sets, listed in cases:
        cfg = _cfg(run, "train.lr=0.01", "minibatch.halo=hec", *sets)
        with pytest.raises(InputError) as exc:
            RunOutput(run, rt, cfg, _meta(tmp_path), resume=True, force=False)
        assert str(exc.value) == (
            f"{run / 'run.h5'}: cannot resume with changed settings: {listed} (resume with the "
            "run's values, or start a new run with --force; docs/runs.md lists what may change)")
    assert (run / "run.h5").read_bytes() == before          # a refused resume touches nothing
    assert read_run(run)["attrs"]["status"] == "finished"


def test_resume_accepts_safe_changes_with_one_warning_line(tmp_path, rt, capsys):
    run = _run_with_checkpoint(tmp_path, rt, "train.epochs=3")
    capsys.readouterr()
    cfg = _cfg(run, "train.epochs=5", "train.eval_every=2", "runtime.threads=1")
    out = RunOutput(run, rt, cfg, _meta(tmp_path), resume=True, force=False)
    assert _stderr_lines(capsys) == [
        "hpcgnn: warning: --resume with changed settings (safe to change): train.epochs 3 -> 5, "
        "train.eval_every 1 -> 2, runtime.threads 0 -> 1"]
    r = read_run(run)
    assert r["attrs"]["status"] == "running" and r["metrics"]["epoch"].tolist() == [1]
    assert json.loads(r["attrs"]["config"])["train"]["epochs"] == 5
    out.close()
    # unchanged settings: no line at all
    RunOutput(run, rt, cfg, _meta(tmp_path), resume=True, force=False).close()
    assert _stderr_lines(capsys) == []


def test_resume_without_a_run_starts_fresh_and_says_so(tmp_path, rt, capsys):
    for run in (tmp_path / "missing", tmp_path / "empty"):
        if run.name == "empty":
            run.mkdir()
        out = RunOutput(run, rt, _cfg(run), _meta(tmp_path), resume=True, force=False)
        assert _stderr_lines(capsys) == [
            f"hpcgnn: warning: --resume: {run} holds no run (run.h5 not found): starting a new run"]
        assert read_run(run)["attrs"]["status"] == "running"
        out.close()


def test_resume_of_a_run_without_checkpoint_starts_at_epoch_1_and_compares_nothing(tmp_path, rt, capsys):
    run = tmp_path / "r"
    RunOutput(run, rt, _cfg(run), _meta(tmp_path), resume=False, force=False)
    capsys.readouterr()
    RunOutput(run, rt, _cfg(run, "train.lr=0.5"), _meta(tmp_path), resume=True, force=False)
    assert _stderr_lines(capsys) == [
        f"hpcgnn: warning: --resume: {run} has no checkpoint yet: the run starts again at epoch 1"]


def test_resume_with_checkpoints_but_no_run_file_is_refused(tmp_path, rt):
    run = _run_with_checkpoint(tmp_path, rt)
    (run / "run.h5").unlink()
    with pytest.raises(InputError, match=r"--resume but the directory has checkpoints and no run.h5"):
        RunOutput(run, rt, _cfg(run), _meta(tmp_path), resume=True, force=False)


def test_failure_marks_the_run_failed_and_a_resume_clears_it(tmp_path, rt, capsys):
    run = tmp_path / "f"
    RunOutput(run, rt, _cfg(run), _meta(tmp_path), resume=False, force=False)
    with pytest.raises(SystemExit) as exc:
        with rt.guard():
            raise InputError("train.device = 'cuda' but torch sees no CUDA device")
    assert exc.value.code == 2
    a = read_run(run)["attrs"]
    assert a["status"] == "failed" and a["error"] == "train.device = 'cuda' but torch sees no CUDA device"
    assert a["ended"] >= a["created"]
    out = RunOutput(run, rt, _cfg(run), _meta(tmp_path), resume=True, force=False)
    a = read_run(run)["attrs"]
    assert a["status"] == "running" and "error" not in a and "ended" not in a
    out.close()
    a = read_run(run)["attrs"]
    assert a["status"] == "finished" and "error" not in a
    # after close() a later failure of the process does not touch the finished run
    with pytest.raises(SystemExit):
        with rt.guard():
            raise RuntimeError("after the run")
    assert read_run(run)["attrs"]["status"] == "finished"
    capsys.readouterr()


def test_config_changes_counts_a_missing_key_as_its_default():
    new = _cfg("x").to_dict()
    old = json.loads(json.dumps(new))
    del old["minibatch"]["halo"]                       # a run file from before the key existed
    old["train"]["lr"] = 0.5
    assert config_changes(old, new) == [("train.lr", 0.5, new["train"]["lr"])]
    assert {"train.epochs", "train.eval_every", "output.dir", "runtime.threads"} <= set(SAFE_ON_RESUME)
    assert not {"train.lr", "train.seed", "minibatch.halo", "model.hidden", "model.layers",
                "model.arch"} & set(SAFE_ON_RESUME)


# ---- what --resume refuses about the checkpoint (issue 23, class 4) -----------------------------
def test_resume_with_every_checkpoint_unreadable_is_refused_not_restarted(tmp_path, rt):
    run = _run_with_checkpoint(tmp_path, rt)
    (run / "checkpoints" / "ckpt-000001.pt").write_bytes(b"\0garbage")
    before = (run / "run.h5").read_bytes()
    with pytest.raises(InputError, match=r"none of the 1 checkpoint\(s\) can be read.*pass --force"):
        RunOutput(run, rt, _cfg(run), _meta(tmp_path), resume=True, force=False)
    assert (run / "run.h5").read_bytes() == before


def test_resume_with_epochs_below_the_checkpoint_is_refused(tmp_path, rt, capsys):
    run = _run_with_checkpoint(tmp_path, rt, "train.epochs=3")
    _write_checkpoint(run, 5, _cfg(run, "train.epochs=3"), read_run(run)["attrs"]["run_id"],
                      _meta(tmp_path).content_hash)
    before = (run / "run.h5").read_bytes()
    with pytest.raises(InputError, match=r"ckpt-000005.pt: the run is at epoch 5 but train.epochs = 3: "
                                         r"nothing to train \(to continue, set train.epochs above 5\)"):
        RunOutput(run, rt, _cfg(run, "train.epochs=3"), _meta(tmp_path), resume=True, force=False)
    assert (run / "run.h5").read_bytes() == before
    capsys.readouterr()
    out = RunOutput(run, rt, _cfg(run, "train.epochs=5"), _meta(tmp_path), resume=True, force=False)
    assert f"{run} is already at epoch 5 = train.epochs: nothing to train" in capsys.readouterr().err
    out.close()


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, rt):
    run = _run_with_checkpoint(tmp_path, rt, "train.lr=0.01")
    cfg = _cfg(run, "train.lr=0.01")
    meta = _meta(tmp_path)
    own = read_run(run)["attrs"]["run_id"]
    # same store and shape, another run's identity
    _write_checkpoint(run, 2, cfg, "f" * 32, meta.content_hash)
    with pytest.raises(InputError, match=r"ckpt-000002.pt: checkpoint belongs to another run"):
        RunOutput(run, rt, cfg, meta, resume=True, force=False)
    # no identity recorded (an older checkpoint), other learning rate and seed
    _write_checkpoint(run, 2, _cfg(run, "train.lr=0.5", "train.seed=9"), "", meta.content_hash)
    with pytest.raises(InputError, match=r"written with other settings than this run's \(train.lr "
                                         r"0.5 -> 0.01, train.seed 9 -> 0\)"):
        RunOutput(run, rt, cfg, meta, resume=True, force=False)
    _write_checkpoint(run, 2, cfg, own, meta.content_hash)       # its own: accepted
    RunOutput(run, rt, cfg, meta, resume=True, force=False).close()


def test_a_checkpoint_of_another_model_shape_is_one_line():
    import torch

    from hpcgnn.run.checkpoint import load_model_state

    cfg = load_config(None, ["data.partitions=x", "model.hidden=4"])
    with pytest.raises(InputError, match=r"ckpt: checkpoint does not fit the run's model \(model.arch=sage, "
                                         r"layers=3, hidden=4\): size mismatch for weight"):
        load_model_state(torch.nn.Linear(3, 4), {"weight": torch.zeros(5, 3), "bias": torch.zeros(4)},
                         "ckpt", cfg)


def test_every_setting_resume_accepts_is_in_the_docs_table():
    """docs/runs.md and the code say one thing: each key safe_on_resume() accepts is a row of the
    table, and no row names a key it refuses."""
    import re

    from hpcgnn.run.resume import safe_on_resume

    text = (Path(__file__).resolve().parents[2] / "docs" / "runs.md").read_text()
    table = text[text.index("| setting | why it is safe |"):]
    table = table[:table.index("\n\n")]
    documented = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", table))
    assert documented == set(safe_on_resume()), (documented ^ set(safe_on_resume()))


def test_run_file_rewrites_follow_flush_seconds(tmp_path, rt):
    """``output.flush_seconds``: the first and the last epoch are always written; in between only
    once the last rewrite is old enough; ``flush()`` (before each checkpoint) writes what is
    pending; 0 writes every epoch."""
    import torch

    from hpcgnn.run.checkpoint import list_checkpoints, save_training_state

    def epochs(run):
        return read_run(run)["metrics"]["epoch"].tolist()

    run = tmp_path / "slow"
    out = RunOutput(run, rt, _cfg(run, "train.epochs=6", "output.flush_seconds=1e9"), _meta(tmp_path),
                    resume=False, force=False)
    out.log_epoch(1, {"loss": 1.0}, {"epoch": 1.0}, {})
    assert epochs(run) == [1]
    for e in (2, 3):
        out.log_epoch(e, {"loss": 1.0 / e}, {"epoch": 1.0}, {})
    assert epochs(run) == [1]                         # not yet due
    out.flush()
    assert epochs(run) == [1, 2, 3]
    out.log_epoch(4, {"loss": 0.25}, {"epoch": 1.0}, {})
    model = torch.nn.Linear(2, 2)
    from hpcgnn.nn.optim import Adam

    save_training_state(out, 4, model, Adam(model.parameters()))
    assert [e for e, _ in list_checkpoints(run)] == [4]
    assert epochs(run) == [1, 2, 3, 4]                # the checkpoint's epochs are in the file
    out.log_epoch(5, {"loss": 0.2}, {"epoch": 1.0}, {})
    assert epochs(run) == [1, 2, 3, 4]
    out.log_epoch(6, {"loss": 0.1}, {"epoch": 1.0}, {})
    assert epochs(run) == [1, 2, 3, 4, 5, 6]          # the last epoch
    out.close()
    assert read_run(run)["attrs"]["status"] == "finished"

    run = tmp_path / "every"
    out = RunOutput(run, rt, _cfg(run, "train.epochs=6", "output.flush_seconds=0"), _meta(tmp_path),
                    resume=False, force=False)
    for e in (1, 2, 3):
        out.log_epoch(e, {"loss": 1.0 / e}, {"epoch": 1.0}, {})
        assert epochs(run) == list(range(1, e + 1))
    out.close()
