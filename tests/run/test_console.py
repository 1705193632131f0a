"""What `hpcgnn train` prints (hpcgnn.run.console, hpcgnn.log) and `hpcgnn report --csv/--tensorboard`.

One real run, as `make demo` starts it (inputs/cora-sage.toml, 2 ranks, a relative run
directory), shortened to 3 epochs: no line wider than 120 characters, one line per epoch, the
summary last with the best validation epoch of run.h5; its CSV has one row per epoch and its
TensorBoard export, read back with tensorboard's own event reader, the losses of run.h5.
"""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from mpiutil import ROOT, run_cli, run_mpi  # noqa: E402

from hpcgnn import log  # noqa: E402
from hpcgnn.run.console import WIDTH, RunConsole, epoch_line, phase_lines, summary_lines  # noqa: E402
from hpcgnn.run.runfile import read_run  # noqa: E402

EPOCHS = 3


@pytest.fixture(scope="module")
def demo(cora_parts, tmp_path_factory):
    """The demo's train command (3 epochs) in a fresh directory: (directory, process, run)."""
    d = tmp_path_factory.mktemp("demo")
    proc = run_mpi(2, ["-m", "hpcgnn", "train", "--config", ROOT / "inputs" / "cora-sage.toml",
                       "--set", f"data.partitions={cora_parts(2)}", "--set", "output.dir=runs/demo",
                       "--set", f"train.epochs={EPOCHS}", "--force"], timeout=180, cwd=d)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return d, proc, read_run(d / "runs" / "demo")


def test_the_demo_prints_narrow_lines_and_ends_with_the_summary(demo):
    d, proc, run = demo
    lines = proc.stdout.splitlines() + proc.stderr.splitlines()
    assert lines and max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
    out = proc.stdout.splitlines()
    epochs = [line for line in out if line.startswith("epoch ")]
    assert len(epochs) == EPOCHS
    assert out[0].startswith("engine     minibatch on 2 rank(s)")      # the banner comes first
    assert any(line.startswith("memory     estimated peak") for line in out[:out.index(epochs[0])])
    # each epoch's line: its loss and validation accuracy as run.h5 holds them, no test accuracy
    m = run["metrics"]
    for e, line in enumerate(epochs):
        assert line.startswith(f"epoch {e + 1}/{EPOCHS} | loss {m['loss'][e]:.4f} | ")
        assert f"val {100 * m['val_acc'][e]:.2f}" in line and "test" not in line
    best = int(np.nanargmax(m["val_acc"]))
    summary = out[out.index(epochs[-1]) + 1:]
    assert summary[0].startswith(f"finished   all {EPOCHS} epochs")
    assert summary[1] == (f"best val   {100 * m['val_acc'][best]:.2f}% at epoch {best + 1}, "
                          f"test {100 * m['test_acc'][best]:.2f}%")
    assert f"run file   runs/demo/run.h5" in summary
    assert f"checkpoint runs/demo/checkpoints/ckpt-{EPOCHS:06d}.pt" in summary
    assert summary[-2].startswith("next       hpcgnn report runs/demo")
    assert summary[-1].strip().startswith("mpiexec -n 2 hpcgnn infer runs/demo --out ")
    assert (d / "runs" / "demo" / "checkpoints" / f"ckpt-{EPOCHS:06d}.pt").exists()


def test_report_csv_and_tensorboard_hold_the_run_files_epochs(demo, tmp_path):
    d, _, run = demo
    table, tb = tmp_path / "epochs.csv", tmp_path / "tb"
    proc = run_cli(["report", d / "runs" / "demo", "--csv", table, "--tensorboard", tb], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == run["metrics"]["epoch"].tolist() == list(range(1, EPOCHS + 1))
    assert [float(r["loss"]) for r in rows] == run["metrics"]["loss"].tolist()      # exact round trip
    assert [float(r["time/epoch_s"]) for r in rows] == np.max(run["timings"]["epoch"], axis=1).tolist()
    assert all(float(r["memory/peak_rss_bytes"]) > 0 and float(r["counters/bytes_sent"]) > 0 for r in rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "accuracy/val", "time/epoch_s", "time/forward_s", "time/eval_s",
            "counters/bytes_sent", "memory/peak_rss_bytes"} <= tags, tags
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == list(range(1, EPOCHS + 1))
    assert [e.value for e in losses] == run["metrics"]["loss"].astype(np.float32).tolist()
    # a second export into the same directory would mix two runs' events: refused
    again = run_cli(["report", d / "runs" / "demo", "--tensorboard", tb], timeout=120)
    assert again.returncode == 2 and f"{tb}: holds TensorBoard event files already" in again.stderr


def test_the_epoch_line_stays_within_the_width_at_extremes():
    line = epoch_line(123456, 123456, {"loss": 12345.678, "train_acc": 1.0, "val_acc": 1.0},
                      (1.0, 123456), 3599.9, 3599.9, 1023.99 * 2**40, 1023.99 * 2**30)
    assert len(line) <= WIDTH, (len(line), line)
    line = epoch_line(3, 10, {"loss": 0.5, "train_acc": 0.9, "val_acc": math.nan, "test_acc": 0.7},
                      None, 1.5, None, 2**30)
    assert line == "epoch  3/10 | loss 0.5000 | acc% train 90.00 | 1.500 s | peak 1.00 GiB"


def test_phases_are_grouped_as_the_report_groups_them():
    parents = {"epoch": "", "sample": "epoch", "forward": "epoch", "cache": "forward", "push": "forward",
               "backward": "epoch", "eval": "", "halo": "forward+backward+eval"}
    ranks = [{"epoch": 1.0, "sample": 0.1, "forward": 0.4, "cache": 0.1, "push": 0.2, "backward": 0.3,
              "eval": 0.5, "halo": 0.05},
             {"epoch": 1.2, "sample": 0.3, "forward": 0.6, "cache": 0.3, "push": 0.0, "backward": 0.3,
              "eval": 0.7, "halo": 0.15}]
    assert phase_lines(ranks, parents) == [
        "    phases, s (mean over ranks): sample 0.200, forward 0.500 (cache 0.200, push 0.100), backward 0.300",
        "    outside the epoch: eval 0.600",
        "    in several phases: halo 0.100 (in forward+backward+eval)"]
    many = {f"phase_{i}": "epoch" for i in range(30)}
    lines = phase_lines([{k: 1.0 for k in many}], many)
    assert len(lines) > 1 and max(map(len, lines)) <= WIDTH


def _console(tmp_path, history, verbose=False, **attrs):
    from hpcgnn.run.config import load_config

    cfg = load_config(None, ["data.partitions=x", f"output.dir={tmp_path}", "train.epochs=4"])
    out = SimpleNamespace(history=history, attrs=attrs, run_dir=tmp_path,
                          timing_parents={"epoch": "", "forward": "epoch", "cache": "forward", "eval": ""})
    return RunConsole(cfg, SimpleNamespace(is_root=True, size=2), out, verbose=verbose)


def _row(epoch, loss, val, test):
    return {"epoch": epoch, "metrics": {"loss": loss, "train_acc": 0.9, "val_acc": val, "test_acc": test},
            "timings": [{"epoch": 1.0, "forward": 0.5, "cache": 0.1, "eval": 0.2}] * 2,
            "counters": [{"peak_rss_bytes": 2.0 * 2**30}, {"peak_rss_bytes": 3.0 * 2**30}], "labels": [{}, {}]}


def test_verbose_quiet_and_the_summary_of_a_failed_run(tmp_path, capsys):
    rows = [_row(1, 1.0, 0.5, 0.4), _row(2, 0.5, 0.7, 0.6), _row(3, 0.4, 0.6, 0.65)]
    try:
        log.configure(log.NORMAL)
        console = _console(tmp_path, rows[:1], verbose=True, estimated_peak_rss_bytes=f"[{2**31}, {2**31}]")
        console.resumed(rows[:1])
        for r in rows[1:]:
            console.out.history.append(r)
            console.epoch(r)
        got = capsys.readouterr().out.splitlines()
        assert got[0].startswith("epoch 2/4 | loss 0.5000 | acc% train 90.00 val 70.00 best 70.00@2 | 1.000 s + eval")
        assert got[1] == "    phases, s (mean over ranks): forward 0.500 (cache 0.100)"
        assert got[2] == "    outside the epoch: eval 0.200"
        assert "best 70.00@2" in got[3]                       # epoch 3's val is lower: the best stays
        console.failed("rank 1: RuntimeError: boom")
        summary = capsys.readouterr().out.splitlines()
        assert summary[0] == "failed     after epoch 3 of 4: rank 1: RuntimeError: boom"
        assert summary[1] == "best val   70.00% at epoch 2, test 60.00%"
        assert "memory     peak / estimate per rank: rank 0 2.00 / 2.00 GiB, rank 1 3.00 / 2.00 GiB" in summary
        assert summary[-1].startswith("next       hpcgnn report ")   # no checkpoint: no infer line
        console.failed("again")
        assert capsys.readouterr().out == ""                 # the summary is printed once
        log.configure(log.QUIET)
        quiet = _console(tmp_path, rows)
        quiet.epoch(rows[0])
        quiet.summary("finished")
        log.warning("still said")
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == "hpcgnn: warning: still said\n"
    finally:
        log.configure(log.NORMAL)


def test_a_stopped_runs_summary_starts_with_the_stop_line(tmp_path):
    rows = [_row(1, 1.0, 0.5, 0.4)]
    console = _console(tmp_path, rows)
    lines = summary_lines("hpcgnn: stopped after epoch 1 of 4 (SIGTERM on rank 0): ...", console.cfg, 2, console.out)
    assert lines[0].startswith("hpcgnn: stopped after epoch 1 of 4") and lines[1].startswith("best val   50.00%")
    assert lines[2] == "last epoch 1 of 4: loss 1.0000, val 50.00%, test 40.00%"


def test_quiet_and_verbose_exclude_each_other():
    proc = run_cli(["-q", "-v", "inspect", "x"], timeout=60)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr and proc.stdout == ""
