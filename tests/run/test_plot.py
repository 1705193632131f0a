"""`hpcgnn report RUN --plot FILE.png [--compare RUN2 ...]` (hpcgnn/run/plot.py): the panels of
real runs (a 2-rank minibatch run with HEC, a 2-rank offloaded full-graph run) checked through
matplotlib's figure objects, the overlay of several runs, panels a run lacks left out, the PNG
written atomically, and one-line exit-2 errors for bad input; the phases' nesting the runs
record, and the report's sum of top-level phases within each rank's epoch time."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mb_support as mb  # noqa: E402
from mpiutil import run_jobs, train_job  # noqa: E402

from hpcgnn.cli import main  # noqa: E402
from hpcgnn.commands.report import load_run  # noqa: E402
from hpcgnn.run.runfile import timing_parents  # noqa: E402
from hpcgnn.run.plot import build_figure, panels_of, save_figure  # noqa: E402

ENV = {"HPCGNN_THREADS": "1"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real 2-rank runs of 3 epochs on one tiny store: minibatch with HEC, and full-graph
    offloaded in 3 chunks per rank."""
    d = tmp_path_factory.mktemp("plot")
    store = mb.tiny_store(d / "store", mb.tiny_graph(num_nodes=240, seed=4), 2)
    mb_cfg = mb.write_config(d / "mb.toml", mb.small_config(epochs=3, batch_size=16, fanouts=4, nc=8,
                                                            eval_every=1))
    fg_cfg = mb.write_config(d / "fg.toml", "[model]\narch = \"gcn\"\nhidden = 8\nlayers = 2\n"
                                            "[train]\nengine = \"fullgraph\"\nepochs = 3\neval_every = 2\n"
                                            "[fullgraph]\noffload = true\nchunks = 3\n")
    runs = {"mb-hec": mb_cfg, "fg-offload": fg_cfg}            # one launch (tests/jobs_driver.py)
    proc = run_jobs(2, [train_job(cfg, d / name, f"data.partitions={store}") for name, cfg in runs.items()], d,
                    timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {name: d / name for name in runs}


def _axes(fig) -> dict:
    return {ax.get_gid(): ax for ax in fig.axes if ax.get_gid()}


def _lines(ax) -> dict:
    return {ln.get_label(): ln for ln in ax.get_lines()}


def test_minibatch_run_panels(runs):
    run = load_run(runs["mb-hec"])
    fig = build_figure([run])
    axes = _axes(fig)
    assert list(axes) == ["loss", "accuracy", "phases", "bytes", "layers", "memory"]
    assert [ax.get_title().split(" (")[0] for ax in axes.values()] == [
        "Loss", "Accuracy", "Phase time per rank", "Bytes per epoch by kind, sum over ranks",
        "HEC hit rate per layer", "Peak memory per rank"]
    loss = _lines(axes["loss"])["train loss"]
    assert list(loss.get_xdata()) == [1, 2, 3] and np.allclose(loss.get_ydata(), run["metrics"]["loss"])
    acc = _lines(axes["accuracy"])
    assert set(acc) == {"train", "val", "test"}
    assert np.allclose(acc["test"].get_ydata(), 100 * run["metrics"]["test_acc"])
    # phases: one bar per (epoch, rank) in every stacked phase, none for the nested ones
    ph = axes["phases"]
    names = [c.get_label() for c in ph.containers]
    assert {"sample", "forward", "backward", "eval"} <= set(names)
    nested = {k for k, parent in timing_parents(run).items() if parent not in ("", "epoch")}
    assert {"cache", "comm_wait", "push"} <= nested and not set(names) & nested
    assert all(len(c.patches) == 3 * 2 for c in ph.containers)
    t = run["timings"]
    fwd = next(c for c in ph.containers if c.get_label() == "forward")
    assert np.allclose([p.get_height() for p in fwd.patches], t["forward"].ravel())
    # a bar's stack below eval is the rank's epoch time
    ev = next(c for c in ph.containers if c.get_label() == "eval")
    assert np.allclose([p.get_y() for p in ev.patches], t["epoch"].ravel(), rtol=1e-9)
    # bytes: summed over ranks; identical series share a line
    by = _lines(axes["bytes"])
    sent = next(k for k in by if "bytes_sent" in k.split(" = "))
    assert "aep_bytes_sent" in sent.split(" = ")          # AEP's bytes are the run's bytes
    unit = axes["bytes"].get_ylabel().split()[0]
    scale = {"bytes": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    assert np.allclose(np.asarray(by[sent].get_ydata()) * scale,
                       np.nansum(run["counters"]["bytes_sent"], axis=1))
    assert not any(k.startswith("peak_") for k in by)
    # HEC hit rate per layer over both ranks
    layers = _lines(axes["layers"])
    pl = run["per_layer"]
    assert sorted(layers) == [f"layer {i}" for i in range(pl["hec_hits"].shape[2])]
    rate = np.nansum(pl["hec_hits"], axis=1) / np.nansum(pl["hec_lookups"], axis=1)
    ok = np.isfinite(rate[:, 0])
    assert np.allclose(layers["layer 0"].get_ydata(), 100 * rate[ok, 0])
    mem = _lines(axes["memory"])
    assert set(mem) == {"rank 0 RSS", "rank 1 RSS"}
    assert np.allclose(mem["rank 1 RSS"].get_ydata(), run["counters"]["peak_rss_bytes"][:, 1] / 2**30)


@pytest.mark.parametrize("name", ["mb-hec", "fg-offload"])
def test_runs_record_the_nesting_and_report_sums_top_level_phases_within_the_epoch(runs, name):
    from hpcgnn.commands.report import summarise

    run = load_run(runs[name])
    parents = run["timing_parents"]                 # recorded by the run, not guessed from names
    assert set(parents) == set(run["timings"]) and parents["epoch"] == "" and parents["eval"] == ""
    if name == "mb-hec":
        inner = {"cache": "forward", "comm_wait": "forward", "push": "forward"}
        top = {"housekeeping", "sample", "store_wait", "forward", "backward", "allreduce", "optimizer"}
    else:
        inner = {"halo": "forward+backward+eval"}
        top = {"housekeeping", "forward", "backward", "allreduce", "update"}
    assert {k: parents[k] for k in inner} == inner
    assert {k for k, parent in parents.items() if parent == "epoch"} == top
    t = run["timings"]
    s = summarise(run)
    for i, row in enumerate(s["epochs"]):
        sums = np.array(row["top_level_s"], dtype=float)                        # per rank
        assert np.allclose(sums, np.nansum([t[k][i] for k in top], axis=0))     # nested ones not in it
        assert (sums <= 1.05 * t["epoch"][i]).all(), (sums, t["epoch"][i])


def test_offloaded_fullgraph_run_panels(runs):
    run = load_run(runs["fg-offload"])
    fig = build_figure([run])
    axes = _axes(fig)
    assert list(axes) == ["loss", "accuracy", "phases", "bytes", "layers", "memory"]
    assert axes["layers"].get_title().startswith("Offload transfers per rank")
    assert "halo" in axes["phases"].get_xlabel()          # nested, named, not stacked
    labels = [c.get_label() for c in axes["layers"].containers]
    assert "h2d_rows" in labels and "h2d without dedup" in labels and any(x.startswith("d2h_") for x in labels)
    assert all(len(c.patches) == 2 for c in axes["layers"].containers)       # one bar per rank
    assert [t.get_text() for t in axes["layers"].get_xticklabels()] == ["rank 0\n3 chunks", "rank 1\n3 chunks"]
    by = _lines(axes["bytes"])
    assert {"h2d_bytes", "d2h_bytes", "halo_bytes"} <= set(by) and "h2d_rows_bytes" not in by
    # evaluated epochs only (eval_every 2 of 3 epochs: 2 and 3)
    assert list(_lines(axes["accuracy"])["val"].get_xdata()) == [2, 3]


def test_cli_writes_png_and_compare_overlays_runs(runs, tmp_path, capsys):
    out = tmp_path / "report.png"
    assert main(["report", str(runs["mb-hec"]), "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "best val" in text                                       # the table is still printed
    assert text.strip().splitlines()[-1] == f"wrote {out}: loss, accuracy, phases, bytes, layers, memory"
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in tmp_path.iterdir()] == ["report.png"]        # no temporary left
    # --compare: both runs' curves on loss and accuracy, labelled by directory name
    cmp = tmp_path / "cmp.png"
    assert main(["report", str(runs["mb-hec"]), "--compare", str(runs["fg-offload"]), "--plot", str(cmp),
                 "--json"]) == 0
    captured = capsys.readouterr()
    import json

    assert json.loads(captured.out)["engine"] == "minibatch"       # stdout stays strict JSON
    assert captured.err.startswith(f"wrote {cmp}: ")
    assert cmp.read_bytes()[:8] == PNG_MAGIC
    fig = build_figure([load_run(runs["mb-hec"]), load_run(runs["fg-offload"])])
    axes = _axes(fig)
    assert set(_lines(axes["loss"])) == {"mb-hec", "fg-offload"}
    acc = _lines(axes["accuracy"])
    assert {"mb-hec test", "mb-hec val", "fg-offload test", "fg-offload train"} <= set(acc)
    assert acc["mb-hec test"].get_color() == acc["mb-hec val"].get_color() != acc["fg-offload test"].get_color()
    assert axes["layers"].get_title().startswith("HEC hit rate")     # per-run panels: the first run


def test_panels_a_run_lacks_are_left_out(tmp_path):
    from types import SimpleNamespace

    from mpi4py import MPI

    from hpcgnn.run.config import load_config
    from hpcgnn.run.output import RunOutput
    from hpcgnn.runtime import Runtime

    rt = Runtime.start(threads=1, comm=MPI.COMM_SELF)
    run = tmp_path / "bare"
    cfg = load_config(None, ["data.partitions=x", f"output.dir={run}", "train.epochs=2"])
    out = RunOutput(run, rt, cfg, SimpleNamespace(content_hash="ab" * 32, path=tmp_path, num_parts=1),
                    resume=False, force=False)
    nan = float("nan")
    for e in (1, 2):       # never evaluated, no phases but the epoch, nothing sent
        out.log_epoch(e, {"loss": 1.0 / e, "train_acc": nan, "val_acc": nan, "test_acc": nan},
                      {"epoch": 0.5}, {"bytes_sent": 0.0})
    out.close()
    r = load_run(run)
    assert panels_of([r]) == ["loss", "phases"]
    fig = build_figure([r])
    assert [ax.get_gid() for ax in fig.axes] == ["loss", "phases"]
    assert [c.get_label() for c in _axes(fig)["phases"].containers] == ["epoch"]
    save_figure(fig, tmp_path / "bare.svg")
    assert (tmp_path / "bare.svg").read_text().lstrip().startswith("<?xml")


def _one_line_exit_2(args, capsys, *needles):
    rc = main(["report", *map(str, args)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcgnn: error: ") and "Traceback" not in err, err
    for n in needles:
        assert str(n) in lines[0], lines[0]


def test_bad_input_is_one_line_exit_2(runs, tmp_path, capsys):
    good = runs["mb-hec"]
    png = tmp_path / "x.png"
    _one_line_exit_2([tmp_path / "nope", "--plot", png], capsys, tmp_path / "nope", "run directory not found")
    _one_line_exit_2([good, "--plot", tmp_path / "missing" / "x.png"], capsys, "parent directory")
    _one_line_exit_2([good, "--plot", tmp_path / "x.jpeg"], capsys, "x.jpeg", ".png")
    _one_line_exit_2([good, "--plot", tmp_path], capsys, "names a directory")
    _one_line_exit_2([good, "--compare", tmp_path, "--plot", png], capsys, tmp_path, "not a run directory")
    junk = tmp_path / "junk.h5"
    junk.write_text("not hdf5")
    _one_line_exit_2([good, "--compare", junk, "--plot", png], capsys, junk, "not a readable HDF5 file")
    _one_line_exit_2([good, "--compare", good], capsys, "--compare needs --plot")
    # unwritable output: refused up front (permissions), or when the write fails (root, /proc)
    _one_line_exit_2([good, "--plot", "/proc/hpcgnn-report.png"], capsys, "/proc/hpcgnn-report.png",
                     "cannot write the plot")
    if os.geteuid() != 0:      # root may write into a mode-0500 directory
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        _one_line_exit_2([good, "--plot", locked / "x.png"], capsys, "directory", "is not writable")
    assert not png.exists()
