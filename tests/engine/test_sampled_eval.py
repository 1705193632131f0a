"""The minibatch engine's sampled evaluation (``minibatch.eval = "sampled"``) on 2 ranks: the
validation and test vertices only, predictions independent of ``minibatch.eval_batch_size`` and
of whether training vertices are evaluated too, train accuracy from the epoch's training
minibatches (sampled_eval_driver.py)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402
from mpiutil import ROOT, run_mpi  # noqa: E402


def test_sampled_evaluation_vertex_set_batch_independence_and_train_accuracy(tmp_path):
    parts = mb.tiny_store(tmp_path / "parts", mb.tiny_graph(), 2)
    cfg = mb.write_config(tmp_path / "cfg.toml", mb.small_config(epochs=1, batch_size=10, fanouts=3, nc=6))
    proc = run_mpi(2, [str(Path(__file__).parent / "sampled_eval_driver.py"), parts, cfg, tmp_path / "runs"],
                   timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"SAMPLED-EVAL-OK (\d+)", proc.stdout)) == ["0", "1"], proc.stdout
