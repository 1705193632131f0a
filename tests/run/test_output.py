"""RunOutput (run directory, run.h5 layout, refuse/force/resume) and `hpcgnn report`."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from hpcgnn.errors import InputError
from hpcgnn.run.config import load_config
from hpcgnn.run.output import RunOutput
from hpcgnn.run.runfile import read_run


@pytest.fixture(scope="module")
def rt():
    from mpi4py import MPI

    from hpcgnn.runtime import Runtime

    return Runtime.start(threads=1, comm=MPI.COMM_SELF)


def _meta(tmp_path, content_hash="ab" * 32):
    return SimpleNamespace(content_hash=content_hash, path=tmp_path / "parts", num_parts=1)


def _cfg(run_dir, epochs=3):
    return load_config(None, ["data.partitions=x", f"output.dir={run_dir}", f"train.epochs={epochs}",
                              "output.flush_seconds=0"])      # every epoch (the layout's tests)


def test_run_file_layout_and_epoch_line(tmp_path, rt, capsys):
    run = tmp_path / "runs" / "a"          # parents are created
    cfg = _cfg(run)
    out = RunOutput(run, rt, cfg, _meta(tmp_path), resume=False, force=False)
    out.set_attrs(halo_mode="hec", dims=[3, 4])
    for e in (1, 2):
        row = out.log_epoch(e, {"loss": 1.0 / e, "train_acc": 0.5, "val_acc": float("nan"), "test_acc": 0.25 * e},
                            {"epoch": 2.0 * e, "forward": 1.0}, {"bytes_sent": 100 * e},
                            {"hec_hit_rate": np.array([0.5, 0.25, 0.125])})
        assert row["epoch"] == e and row["metrics"]["loss"] == 1.0 / e      # rank 0's row, per rank lists
        assert row["timings"] == [{"epoch": 2.0 * e, "forward": 1.0}] and row["counters"] == [{"bytes_sent": 100 * e}]
    assert [h["epoch"] for h in out.history] == [1, 2]
    assert capsys.readouterr().out == ""    # the run file prints nothing: hpcgnn.run.console does
    r = read_run(run)
    a = r["attrs"]
    assert a["format"] == "hpcgnn-run" and a["engine"] == "minibatch" and a["num_ranks"] == 1
    assert a["partition_hash"] == "ab" * 32 and a["status"] == "running" and a["halo_mode"] == "hec"
    assert json.loads(a["config"])["train"]["epochs"] == 3 and json.loads(a["dims"]) == [3, 4]
    assert r["metrics"]["epoch"].tolist() == [1, 2]
    assert r["metrics"]["loss"].tolist() == [1.0, 0.5]
    assert math.isnan(r["metrics"]["val_acc"][0])
    assert r["timings"]["epoch"].shape == (2, 1) and r["timings"]["epoch"][:, 0].tolist() == [2.0, 4.0]
    assert r["counters"]["bytes_sent"][:, 0].tolist() == [100, 200]
    assert r["per_layer"]["hec_hit_rate"].shape == (2, 1, 3)
    out.close()
    assert read_run(run)["attrs"]["status"] == "finished"
    # no stray temporary files
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "run.h5"]


def test_refuse_force_resume(tmp_path, rt):
    run = tmp_path / "r"
    cfg = _cfg(run)
    out = RunOutput(run, rt, cfg, _meta(tmp_path), resume=False, force=False)
    for e in (1, 2, 3):
        out.log_epoch(e, {"loss": float(e)}, {"epoch": 1.0}, {})
    (run / "keep.txt").write_text("user file")
    with pytest.raises(InputError, match="already holds a run"):
        RunOutput(run, rt, cfg, _meta(tmp_path), resume=False, force=False)
    with pytest.raises(InputError, match="exclude"):
        RunOutput(run, rt, cfg, _meta(tmp_path), resume=True, force=True)
    with pytest.raises(InputError, match="partition store"):
        RunOutput(run, rt, cfg, _meta(tmp_path, "cd" * 32), resume=True, force=False)
    res = RunOutput(run, rt, cfg, _meta(tmp_path), resume=True, force=False)
    assert read_run(run)["metrics"]["loss"].tolist() == [1.0, 2.0, 3.0]
    res.rewind(1)
    res.log_epoch(2, {"loss": 20.0}, {"epoch": 1.0}, {})
    assert read_run(run)["metrics"]["loss"].tolist() == [1.0, 20.0]
    RunOutput(run, rt, cfg, _meta(tmp_path), resume=False, force=True)
    assert read_run(run)["metrics"]["epoch"].size == 0
    assert (run / "keep.txt").read_text() == "user file"   # --force removes only run entries
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        RunOutput(tmp_path / "file", rt, cfg, _meta(tmp_path), resume=False, force=True)


def test_report_table_and_json(tmp_path, rt, capsys):
    from hpcgnn.cli import main

    run = tmp_path / "rep"
    out = RunOutput(run, rt, _cfg(run, epochs=2), _meta(tmp_path), resume=False, force=False)
    out.log_epoch(1, {"loss": 2.0, "train_acc": 0.5, "val_acc": 0.4, "test_acc": 0.3},
                  {"epoch": 1.0, "sample": 0.1, "forward": 0.5}, {"bytes_sent": 2e6},
                  {"hec_hits": np.array([3.0, 1.0]), "hec_lookups": np.array([4.0, 4.0])})
    out.log_epoch(2, {"loss": 1.0, "train_acc": 0.9, "val_acc": 0.6, "test_acc": 0.55},
                  {"epoch": 1.2, "sample": 0.1, "forward": 0.5}, {"bytes_sent": 4e6},
                  {"hec_hits": np.array([4.0, 2.0]), "hec_lookups": np.array([4.0, 4.0])})
    out.close()
    from hpcgnn.commands.report import format_table, summarise

    s = summarise(read_run(run))
    assert s["best_val"] == {"epoch": 2, "val_acc": 0.6, "test_acc": 0.55}
    assert s["epochs"][0]["hec_hit_rate"] == [0.75, 0.25]
    assert s["epochs"][1]["bytes_sent"] == 4e6
    text = format_table(s)
    assert "hit_L0%" in text and "75.00" in text and "best val   60.00% at epoch 2 (test 55.00%)" in text
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)         # strict JSON (NaN written as null)
    assert data["epochs"][0]["val_acc"] == 0.4 and data["final"]["test_acc"] == 0.55
    assert main(["report", str(run)]) == 0
    assert "best val" in capsys.readouterr().out
    assert main(["report", str(tmp_path)]) == 2          # not a run directory


def test_report_of_epochs_without_a_phase_has_no_value_and_no_warning(tmp_path, rt):
    import warnings

    from hpcgnn.commands.report import summarise

    phase = "sample"
    run = tmp_path / "gap"
    out = RunOutput(run, rt, _cfg(run, epochs=2), _meta(tmp_path), resume=False, force=False)
    out.log_epoch(1, {"loss": 2.0, "train_acc": 0.5, "val_acc": 0.4, "test_acc": 0.3},
                  {"epoch": 1.0, "forward": 0.5, phase: 0.25}, {"bytes_sent": 0}, {})
    out.log_epoch(2, {"loss": 1.0, "train_acc": 0.9, "val_acc": float("nan"), "test_acc": float("nan")},
                  {"epoch": 1.2, "forward": 0.5}, {"bytes_sent": 0}, {})
    out.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Mean of empty slice" would fail here
        s = summarise(read_run(run))
    assert s["epochs"][0]["phases_mean_s"][phase] == 0.25
    assert s["epochs"][1]["phases_mean_s"][phase] is None
    assert s["epochs"][1]["time_s"] == 1.2


PARENTS = {"epoch": "", "sample": "epoch", "forward": "epoch", "cache": "forward", "halo": "epoch",
           "eval": "", "comm_wait": "forward"}


def _nested_run(run, rt, tmp_path, parents=PARENTS):
    """Two epochs (the second not evaluated) with nested timings, parents recorded as given."""
    out = RunOutput(run, rt, _cfg(run, epochs=2), _meta(tmp_path), resume=False, force=False)
    t1 = {"epoch": 1.0, "sample": 0.25, "forward": 0.5, "cache": 0.375, "halo": 0.125, "eval": 0.5,
          "comm_wait": 0.0625}
    t2 = {k: v for k, v in t1.items() if k != "eval"}
    for e, t in ((1, t1), (2, t2)):
        out.log_epoch(e, {"loss": 1.0 / e}, t, {}, timing_parents=parents and {k: parents[k] for k in t})
    out.close()
    return read_run(run)


def test_timing_parents_round_trip_and_report_sums_only_top_level(tmp_path, rt, capsys):
    from hpcgnn.cli import main
    from hpcgnn.commands.report import format_table, summarise
    from hpcgnn.run.runfile import timing_parents

    r = _nested_run(tmp_path / "nest", rt, tmp_path)
    # recorded in the order first logged; "halo" as given, whatever the old name list says
    assert list(r["timing_parents"].items()) == list(PARENTS.items())
    assert timing_parents(r) == PARENTS
    s = summarise(r)
    assert s["timing_parents"] == PARENTS
    assert [e["top_level_s"] for e in s["epochs"]] == [[0.875], [0.875]]    # sample + forward + halo
    assert s["epochs"][0]["phases_mean_s"]["cache"] == 0.375                  # shown, not summed
    text = format_table(s)
    head = next(line for line in text.splitlines() if line.lstrip().startswith("epoch"))
    assert head.split()[6:] == ["sample", "forward", "halo", "sum", "eval", "(cache)", "(comm_wait)"]
    assert "(x): part of another phase, in no sum: cache, comm_wait in forward" in text
    capsys.readouterr()
    assert main(["report", str(tmp_path / "nest"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epochs"][1]["top_level_s"] == [0.875]
    # a resumed run keeps the recorded nesting of its earlier epochs
    res = RunOutput(tmp_path / "nest", rt, _cfg(tmp_path / "nest", epochs=3), _meta(tmp_path),
                    resume=True, force=False)
    res.log_epoch(3, {"loss": 0.3}, {"epoch": 1.0, "forward": 0.5}, {},
                  timing_parents={"epoch": "", "forward": "epoch"})
    assert read_run(tmp_path / "nest")["timing_parents"] == PARENTS


def test_old_run_file_without_nesting_falls_back_to_the_names(tmp_path, rt):
    """A run file written before the nesting was recorded: no attribute ``parents``."""
    import h5py

    from hpcgnn.commands.report import summarise
    from hpcgnn.run.runfile import timing_parents

    run = tmp_path / "old"
    _nested_run(run, rt, tmp_path)
    with h5py.File(run / "run.h5", "a") as f:
        del f["timings"].attrs["parents"]
    r = read_run(run)
    assert r["timing_parents"] == {}
    parents = timing_parents(r)
    # old names: halo in forward, backward and eval, cache / comm_wait in forward, eval a root
    assert parents == {"sample": "epoch", "forward": "epoch", "cache": "forward", "comm_wait": "forward",
                       "epoch": "", "eval": "", "halo": "forward+backward+eval"}
    assert list(parents)[:2] == ["sample", "forward"]            # the old display order
    assert summarise(r)["epochs"][0]["top_level_s"] == [0.75]    # sample + forward
    # a file whose logger gave no parents reads the same way
    assert timing_parents(_nested_run(tmp_path / "none", rt, tmp_path, parents=None)) == parents
