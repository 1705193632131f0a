"""Shared by the cached-halo engine tests: run a 4-rank report script on the toy graph, and read
its per-epoch figures as arrays."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from mpiutil import run_mpi  # noqa: E402
from toygraph import toy_graph, toy_store  # noqa: E402


def run_report(d: Path, script_text: str, epochs: int, f: int, hidden: int, layers: int) -> dict:
    """Write ``script_text`` to ``d`` and run it on 4 ranks (toy graph of 240 vertices with ``f``
    features, random 4-part store; arguments: store, report path, epochs, f, hidden, layers);
    returns the JSON report rank 0 wrote."""
    g = toy_graph(240, 6.0, num_features=f, num_classes=4, seed=7)
    store = toy_store(d / "store4", g, 4, seed=4)
    script = d / "report.py"
    script.write_text(script_text)
    out = d / "report.json"
    proc = run_mpi(4, [script, store, out, epochs, f, hidden, layers], timeout=240, env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def per_layer(rep: dict, case: str, name: str) -> np.ndarray:
    """[epoch, rank, layer] array of a per-layer figure."""
    return np.array([[e["per_layer"][name] for e in rank] for rank in rep[case]["reps"]]).transpose(1, 0, 2)


def counter(rep: dict, case: str, name: str) -> np.ndarray:
    """[epoch, rank] array of a counter."""
    return np.array([[e["counters"][name] for e in rank] for rank in rep[case]["reps"]]).T
