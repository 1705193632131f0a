"""Stopping on a batch system's signal (hpcgnn.run.stop, ``train.stop_signals``) under real
mpiexec: the epoch in progress ends, is checkpointed, every rank exits 75 and ``run.h5`` says
``stopped``; ``--resume`` then reaches exactly what an uninterrupted run reaches. The signals are
real ones, sent by a rank to itself at a chosen step (the debug hooks' ``kill = [rank, epoch, step,
name]``, tests/debug_hooks.py) or by the test to ``mpiexec``, which forwards them to every rank as ``srun`` does.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mpiutil import MPIEXEC, ROOT, clean_env, debug_env, python, run_jobs, run_mpi, train_job

from hpcgnn.commands.report import format_table, summarise
from hpcgnn.run.checkpoint import list_checkpoints
from hpcgnn.run.runfile import read_run
from hpcgnn.run.stop import EXIT_STOPPED, StopRequest, describe_ranks

EPOCHS = 6
CONFIGS = {   # engine -> (config, overrides): the shipped Cora configs, checkpoints only at the end
    "minibatch": ("cora-sage.toml", []),
    "fullgraph": ("cora-gcn-fullgraph.toml", []),
    "tensor": ("cora-tensor.toml", ["tensor.k=4"]),
}


def _sets(engine: str, parts, *extra: str) -> list[str]:
    config, sets = CONFIGS[engine]
    return [f"data.partitions={parts}", f"train.epochs={EPOCHS}", "train.checkpoint_every=0",
            "train.eval_every=1", *sets, *extra]


def _model(run: Path, epoch: int) -> dict:
    return torch.load(run / "checkpoints" / f"ckpt-{epoch:06d}.pt", weights_only=True)["model"]


def test_a_stop_signal_ends_the_epoch_with_a_checkpoint_and_resume_is_exact(cora_parts, tmp_path):
    """For every engine at 2 ranks: rank 1 gets SIGUSR1 before step 0 of epoch 3 (dropout on); the
    job stops after epoch 3 (its evaluation skipped) with ckpt-000003 only, exit 75 on every rank,
    status ``stopped``; ``--resume`` ends with the losses, accuracies and parameters of an
    uninterrupted run, bit for bit."""
    parts = cora_parts(2)
    jobs = []
    for engine, (config, _) in CONFIGS.items():
        cfg = ROOT / "inputs" / config
        jobs += [train_job(cfg, tmp_path / f"{engine}-ref", *_sets(engine, parts)),
                 train_job(cfg, tmp_path / f"{engine}-stop", *_sets(engine, parts),
                           env=debug_env(kill=[1, 3, 0, "SIGUSR1"]), expect=EXIT_STOPPED)]
    proc = run_jobs(2, jobs, tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for engine in CONFIGS:
        stop = tmp_path / f"{engine}-stop"
        line = (f"hpcgnn: stopped after epoch 3 of {EPOCHS} (SIGUSR1 on rank 1): checkpoint "
                f"{stop / 'checkpoints' / 'ckpt-000003.pt'}; continue with hpcgnn train --resume (exit status 75)")
        assert proc.stdout.count(line) == 1, (engine, proc.stdout[-3000:])
        run = read_run(stop)
        assert run["attrs"]["status"] == "stopped" and run["attrs"]["stopped_by"] == "SIGUSR1 on rank 1", engine
        assert list(run["metrics"]["epoch"]) == [1, 2, 3], engine
        assert [e for e, _ in list_checkpoints(stop)] == [3], engine
        acc = run["metrics"]["val_acc"]
        assert np.isfinite(acc[:2]).all() and np.isnan(acc[2]), (engine, acc)   # the stop skips epoch 3's evaluation
        table = format_table(summarise(run))
        assert f"stopped    after epoch 3 of {EPOCHS} by SIGUSR1 on rank 1" in table, table
    # resume each stopped run to the end (one launch)
    jobs = [train_job(ROOT / "inputs" / CONFIGS[e][0], tmp_path / f"{e}-stop", *_sets(e, parts), resume=True)
            for e in CONFIGS]
    proc = run_jobs(2, jobs, tmp_path / "resume", timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for engine in CONFIGS:
        ref, got = read_run(tmp_path / f"{engine}-ref"), read_run(tmp_path / f"{engine}-stop")
        assert got["attrs"]["status"] == "finished" and "stopped_by" not in got["attrs"], engine
        assert list(got["metrics"]["epoch"]) == list(range(1, EPOCHS + 1)), engine
        assert np.array_equal(ref["metrics"]["loss"], got["metrics"]["loss"]), (engine, ref["metrics"]["loss"],
                                                                               got["metrics"]["loss"])
        for k in ("val_acc", "test_acc"):
            assert np.array_equal(ref["metrics"][k][3:], got["metrics"][k][3:]), (engine, k)
        a, b = _model(tmp_path / f"{engine}-ref", EPOCHS), _model(tmp_path / f"{engine}-stop", EPOCHS)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), engine


def test_a_signal_in_the_last_epoch_finishes_the_run_and_no_stop_signals_keep_the_default(cora_parts, tmp_path):
    """SIGTERM before the last epoch's step: that run finishes (exit 0, every epoch evaluated).
    With ``train.stop_signals = []`` the same SIGTERM kills the rank at once: its watcher names it,
    the job fails, and the run file keeps ``running`` (ended from outside)."""
    parts = cora_parts(2)
    cfg = ROOT / "inputs" / "cora-gcn-fullgraph.toml"
    last = train_job(cfg, tmp_path / "last", *_sets("fullgraph", parts), env=debug_env(kill=[0, EPOCHS, 0, "SIGTERM"]))
    proc = run_jobs(2, [last], tmp_path, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = read_run(tmp_path / "last")
    assert run["attrs"]["status"] == "finished" and np.isfinite(run["metrics"]["val_acc"]).all()
    assert "stopped" not in proc.stdout

    args = ["-m", "hpcgnn", "train", "--config", cfg, "--force", "--set", "train.stop_signals=[]",
            "--set", f"output.dir={tmp_path / 'plain'}",
            *[a for s in _sets("fullgraph", parts) for a in ("--set", s)]]
    proc = run_mpi(2, args, timeout=200, env=debug_env(kill=[1, 2, 0, "SIGTERM"]))
    assert proc.returncode not in (0, EXIT_STOPPED), (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "hpcgnn: error: rank 1 was killed by SIGTERM" in proc.stderr, proc.stderr[-2000:]
    assert read_run(tmp_path / "plain")["attrs"]["status"] == "running"


SETUP_DRIVER = r"""
import os, signal, sys
from hpcgnn.run import stop
from hpcgnn.supervisor import launcher_rank

install = stop.StopRequest.install

def install_and_signal(self):      # rank 1 gets SIGUSR1 during set-up, before any data is read
    install(self)
    if launcher_rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    return self

stop.StopRequest.install = install_and_signal
from hpcgnn.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_during_set_up_stops_before_the_first_epoch(cora_parts, tmp_path):
    """Nothing trained, nothing checkpointed, exit 75, ``stopped``; ``--resume`` then starts at
    epoch 1 and finishes."""
    parts = cora_parts(2)
    run = tmp_path / "run"
    args = ["train", "--config", ROOT / "inputs" / "cora-gcn-fullgraph.toml", "--set", f"output.dir={run}",
            *[a for s in _sets("fullgraph", parts) for a in ("--set", s)]]
    proc = run_mpi(2, ["-c", SETUP_DRIVER, *args, "--force"], timeout=200)
    assert proc.returncode == EXIT_STOPPED, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert (f"hpcgnn: stopped after epoch 0 of {EPOCHS} (SIGUSR1 on rank 1): no epoch was trained, no "
            "checkpoint written; continue with hpcgnn train --resume (exit status 75)") in proc.stdout
    got = read_run(run)
    assert got["attrs"]["status"] == "stopped" and len(got["metrics"]["epoch"]) == 0
    assert list_checkpoints(run) == []
    proc = run_mpi(2, ["-m", "hpcgnn", *args, "--resume"], timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "has no checkpoint yet: the run starts again at epoch 1" in proc.stderr, proc.stderr[-2000:]
    assert list(read_run(run)["metrics"]["epoch"]) == list(range(1, EPOCHS + 1))


def test_sigusr1_to_mpiexec_stops_every_rank(cora_parts, tmp_path):
    """The workstation path: ``kill -USR1`` of mpiexec (Hydra forwards it to every rank, as srun
    and SLURM's ``--signal`` do) while epochs run; the job stops after the epoch in progress."""
    parts = cora_parts(2)
    run = tmp_path / "run"
    cmd = [str(MPIEXEC), "-n", "2", *python(), "-m", "hpcgnn", "train", "--config",
           str(ROOT / "inputs" / "cora-sage.toml"), "--force", "--set", f"output.dir={run}",
           "--set", f"data.partitions={parts}", "--set", "train.epochs=2000", "--set", "train.eval_every=0",
           "--set", "minibatch.eval=sampled"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if re.match(r"epoch +2/2000 ", line):
                proc.send_signal(signal.SIGUSR1)
                break
            assert time.monotonic() < deadline, "no second epoch within 120 s"
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            import os
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == EXIT_STOPPED, (proc.returncode, out[-2000:], err[-2000:])
    got = read_run(run)
    epochs = list(got["metrics"]["epoch"])
    # Hydra signals the ranks one after the other: an agreement that falls between the two
    # deliveries stops the job on the first rank's signal alone (the second is then ignored)
    assert got["attrs"]["status"] == "stopped", got["attrs"]
    assert re.fullmatch(r"SIGUSR1 on (every rank|rank [01])", got["attrs"]["stopped_by"]), got["attrs"]
    assert 2 <= epochs[-1] < 2000 and epochs == list(range(1, epochs[-1] + 1)), epochs
    assert [e for e, _ in list_checkpoints(run)] == [epochs[-1]]


def test_stop_signals_and_debug_signals_are_validated():
    from hpcgnn.errors import InputError
    from hpcgnn.run.config import load_config

    cfg = load_config(None, ["data.partitions=x"])
    assert cfg.train.stop_signals == ["SIGTERM", "SIGUSR1"]
    assert load_config(None, ["data.partitions=x", "train.stop_signals=[]"]).train.stop_signals == []
    for bad, words in [("train.stop_signals=['SIGKILL']", "train.stop_signals = ['SIGKILL'], expected a list of "
                        "distinct signal names from SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP"),
                       ("train.stop_signals=['SIGTERM', 'SIGTERM']", "distinct"),
                       ("train.stop_signals='SIGTERM'", "has type str, expected list")]:
        with pytest.raises(InputError) as exc:
            load_config(None, ["data.partitions=x", bad])
        assert words in str(exc.value), str(exc.value)
    import debug_hooks   # tests/debug_hooks.py: the debug hooks' signals

    for bad, words in [('{"kill": [1, 2, 3, "NOPE"]}', "kill = [1, 2, 3, 'NOPE']"),
                       ('{"kill": [1, 2, "SIGTERM"]}', "optionally with a signal name")]:
        with pytest.raises(InputError) as exc:
            debug_hooks.parse(bad)
        assert words in str(exc.value), str(exc.value)
    assert debug_hooks.parse('{"kill": [1, 2, 3, "SIGUSR2"]}') == ([1, 2, 3, "SIGUSR2"], False)


def test_the_handler_records_the_first_signal_and_restore_puts_the_old_one_back():
    before = signal.getsignal(signal.SIGUSR2)
    req = StopRequest(["SIGUSR2"]).install()
    try:
        assert req.signal is None
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGUSR2)      # a second one is no escalation
        assert req.signal == "SIGUSR2" and req.received is not None
    finally:
        req.restore()
    assert signal.getsignal(signal.SIGUSR2) is before
    assert describe_ranks([1], 4) == "rank 1" and describe_ranks([0, 2], 4) == "ranks 0, 2"
    assert describe_ranks([0, 1], 2) == "every rank" and describe_ranks([0], 1) == "rank 0"
    assert describe_ranks(list(range(10)), 16) == "ranks 0, 1, 2, 3, 4, 5, 6, 7 and 2 more"
