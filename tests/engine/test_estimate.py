"""The pre-run memory estimate (hpcgnn.engine.estimate) against measured peaks, and the refusal.

* `hpcgnn inspect STORE --config FILE --json` estimates every rank's peak; real 2-rank runs of
  two configurations (minibatch SAGE with HEC and full evaluation; full-graph GCN) record each
  rank's measured peak RSS per epoch in the run file: the estimate is within +-25 %.
* An estimate over the node's limit (``runtime.memory_limit``) stops every rank with exit 2 and
  one line naming the largest term and the setting that shrinks it, before any run file exists.
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

from hpcgnn.run.memory import parse_size  # noqa: E402
from hpcgnn.run.output import read_run  # noqa: E402

TWO_THREADS = {"HPCGNN_THREADS": "1"}


@pytest.mark.parametrize("config,extra", [
    ("cora-sage.toml", ["--set", "train.epochs=2", "--set", "train.eval_every=1"]),
    ("cora-gcn-fullgraph.toml", ["--set", "train.epochs=3"]),
    ("cora-gcn-fullgraph.toml", ["--set", "train.epochs=2", "--set", "fullgraph.offload=true",
                                 "--set", "fullgraph.chunks=4"]),
])
def test_estimate_within_25_percent_of_measured_peak(cora_parts, tmp_path, config, extra):
    parts = cora_parts(2)
    cfg = ROOT / "inputs" / config
    proc = mb.train(2, cfg, parts, tmp_path / "run", *extra, timeout=240, env=TWO_THREADS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(tmp_path / "run")
    measured = np.nanmax(run["counters"]["peak_rss_bytes"], axis=0)        # per rank
    assert measured.shape == (2,) and (measured > 50e6).all()
    assert set(np.unique(run["labels"]["peak_rss_phase"])) <= {"start", "sample", "forward", "backward",
                                                              "cache", "allreduce", "optimizer", "eval",
                                                              "epoch", "update", "fetch"}
    got = run_cli(["inspect", str(parts), "--config", str(cfg), "--json", *extra], timeout=120)
    assert got.returncode == 0, got.stderr
    est = json.loads(got.stdout)["memory_estimate"]
    for r in est["ranks"]:
        ratio = r["total_bytes"] / measured[r["rank"]]
        assert 0.75 <= ratio <= 1.25, (config, r, measured)


def test_bf16_full_graph_estimate_holds_the_rounded_layer_input(cora_parts):
    """In bfloat16 a full-graph SAGE layer also holds its exchanged input rounded to bfloat16
    (solid + halo rows x width x 2 bytes): the estimate's activations grow by exactly that on
    every rank (hidden 2048: the layers, not the start-up, set the peak)."""
    parts = cora_parts(2)
    terms, rows = {}, {}
    for precision in ("fp32", "bf16"):
        got = run_cli(["inspect", str(parts), "--config", str(ROOT / "inputs" / "cora-gcn-fullgraph.toml"),
                       "--json", "--set", "model.arch=sage", "--set", "model.hidden=2048",
                       "--set", f"train.precision={precision}"], timeout=120)
        assert got.returncode == 0, got.stderr
        info = json.loads(got.stdout)
        terms[precision] = [r["terms"]["activations"] for r in info["memory_estimate"]["ranks"]]
        rows = [p["num_solid"] + p["num_halo"] for p in info["parts"]]
    assert [b - f for b, f in zip(terms["bf16"], terms["fp32"])] == [n * 2048 * 2 for n in rows]


def test_over_the_limit_exits_2_on_every_rank(cora_parts, tmp_path):
    parts = cora_parts(2)
    run = tmp_path / "run"
    proc, codes = mb.train_each_rank_exit(2, [
        "train", "--config", str(ROOT / "inputs" / "cora-sage.toml"), "--set", f"data.partitions={parts}",
        "--set", f"output.dir={run}", "--set", "runtime.memory_limit=200MiB"], timeout=120)
    assert codes == {0: 2, 1: 2}, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcgnn: error:")]
    assert len(lines) == 1, proc.stderr
    assert "estimated peak memory of the 2 ranks" in lines[0] and "runtime.memory_limit" in lines[0]
    assert "largest term" in lines[0] and "shrink it with" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (run / "run.h5").exists()
    # the same job with the check off starts (and the estimate is not a hard-coded refusal)
    proc, codes = mb.train_each_rank_exit(2, [
        "train", "--config", str(ROOT / "inputs" / "cora-sage.toml"), "--set", f"data.partitions={parts}",
        "--set", f"output.dir={run}", "--set", "runtime.memory_limit=200MiB",
        "--set", "runtime.memory_check=false", "--set", "train.epochs=1"], timeout=120)
    assert codes == {0: 0, 1: 0}, proc.stderr


def test_bad_memory_limit_is_one_line():
    from hpcgnn.errors import InputError

    assert parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("512 MiB") == 512 << 20
    assert parse_size("2GB") == 2_000_000_000 and parse_size(1024) == 1024
    with pytest.raises(InputError, match="runtime.memory_limit = '12 parsecs'"):
        parse_size("12 parsecs", "runtime.memory_limit")
