"""Benchmark peers in their own virtual environments (DGL, issue 13), run as subprocesses.

A peer is a script run by another interpreter (DGL: ``.venv-dgl/bin/python``, made by
``make peer-dgl``, torch 2.2 + DGL 2.1, script :mod:`hpcgnn.bench.peer_dgl`) that prints one
JSON object on the last line of its stdout. :func:`run_peer` runs it (``-I``: isolated, nothing
of this project's environment on its ``sys.path``; ``THP_MEM_ALLOC_ENABLE=1`` as hpcgnn sets it,
unless the caller's environment says otherwise) and raises :class:`PeerError` with a one-line
reason (exit status and stderr tail, no JSON, timeout, interpreter missing) on failure;
:func:`try_peer` prints that reason and returns None so a benchmark goes on without the peer.

:func:`alternate` times hpcgnn and a peer back to back in alternating rounds and keeps the
fastest epoch of each; ratios are ``hpcgnn / peer`` epoch seconds (below 1: hpcgnn is faster).
``HPCGNN_PEER_DGL_PYTHON`` names another interpreter for the DGL peer (empty: no DGL peer).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from hpcgnn.bench.workdir import ROOT

DGL_VENV = ROOT / ".venv-dgl"
DGL_SCRIPT = Path(__file__).resolve().with_name("peer_dgl.py")
DGL_ENV = "HPCGNN_PEER_DGL_PYTHON"


class PeerError(RuntimeError):
    """A peer run failed; the message is one line naming the peer and the reason."""


def dgl_python() -> Path | None:
    """The DGL peer's interpreter: ``$HPCGNN_PEER_DGL_PYTHON`` when set (empty = none), else
    ``.venv-dgl/bin/python`` when it exists, else None (benchmarks run without the peer)."""
    if DGL_ENV in os.environ:
        value = os.environ[DGL_ENV]
        return Path(value) if value else None
    python = DGL_VENV / "bin" / "python"
    return python if python.exists() else None


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


def run_peer(python: Path | str, script: Path | str, args: list[str], timeout: float, name: str = "peer",
             env: dict | None = None) -> dict:
    """Run ``python -I script *args`` from the repository root; the JSON object on the last line
    of its stdout. Raises :class:`PeerError` (one line) when it cannot start, exits non-zero,
    runs past ``timeout`` seconds or prints no JSON object last."""
    cmd = [str(python), "-I", str(script), *[str(a) for a in args]]
    child_env = {**os.environ, "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1"), **(env or {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env, cwd=ROOT)
    except FileNotFoundError:
        raise PeerError(f"{name}: interpreter {python} not found (make peer-dgl creates it)") from None
    except PermissionError:
        raise PeerError(f"{name}: interpreter {python} is not executable") from None
    except subprocess.TimeoutExpired:
        raise PeerError(f"{name}: {Path(script).name} {' '.join(map(str, args[:1]))} ran past its "
                        f"{timeout:g} s timeout") from None
    if proc.returncode != 0:
        raise PeerError(f"{name}: {Path(script).name} failed (exit {proc.returncode}): "
                        f"{_tail(proc.stderr) or _tail(proc.stdout) or 'no output'}")
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    try:
        out = json.loads(last)
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        raise PeerError(f"{name}: {Path(script).name} printed no JSON object on its last line "
                        f"(got {last[:120]!r})")
    return out


def try_peer(*args, **kwargs) -> dict | None:
    """:func:`run_peer`, or None after printing why it failed (the benchmark goes on)."""
    try:
        return run_peer(*args, **kwargs)
    except PeerError as exc:
        print(f"{exc}; going on without it", flush=True)
        return None


def alternate(rounds: int, run_ours: Callable[[int], dict], run_theirs: Callable[[int], dict | None]
              ) -> tuple[dict, dict | None, list[dict]]:
    """``rounds`` alternating rounds (hpcgnn first); each callable gets the round number and
    returns a dict with ``epoch_s`` (the round's fastest epoch after warm-up). The peer returning
    None stops its rounds (hpcgnn's still run). Returns (hpcgnn's fastest round, the peer's
    fastest round or None, every round's {"hpcgnn_epoch_s", "peer_epoch_s"})."""
    ours, theirs, log = None, None, []
    peer_ok = True
    for i in range(max(1, rounds)):
        a = run_ours(i)
        b = run_theirs(i) if peer_ok else None
        peer_ok = b is not None
        log.append({"hpcgnn_epoch_s": a["epoch_s"], "peer_epoch_s": b["epoch_s"] if b else float("nan")})
        ours = a if ours is None or a["epoch_s"] < ours["epoch_s"] else ours
        if b is not None:
            theirs = b if theirs is None or b["epoch_s"] < theirs["epoch_s"] else theirs
    return ours, theirs, log


def run_epochs(run_dir: Path) -> dict:
    """Epoch figures of an ``hpcgnn train`` run file, like the peer's: every epoch's seconds
    (slowest rank), ``epoch_s`` the fastest after the first, ``epoch_mean_s`` their mean, and
    per-phase minimum / mean seconds (mean over ranks) over the same epochs."""
    from hpcgnn.run.output import read_run

    t = read_run(run_dir)["timings"]
    epochs = np.max(t["epoch"], axis=1)
    sel = slice(1, None) if epochs.size > 1 else slice(0, None)
    phases = {k: np.mean(v, axis=1)[sel] for k, v in t.items() if k not in ("epoch", "eval")}
    return {"epoch_s": float(np.min(epochs[sel])), "epoch_mean_s": float(np.mean(epochs[sel])),
            "epochs_s": [float(x) for x in epochs],
            "phases_min_s": {k: float(np.min(v)) for k, v in phases.items()},
            "phases_mean_s": {k: float(np.mean(v)) for k, v in phases.items()}}


def _comparison(ours: dict, theirs: dict, log: list[dict]) -> dict:
    return {"hpcgnn_epoch_s": ours["epoch_s"], "hpcgnn_epoch_mean_s": ours["epoch_mean_s"],
            "dgl_epoch_s": theirs["epoch_s"], "dgl_epoch_mean_s": theirs["epoch_mean_s"],
            "hpcgnn_over_dgl": ours["epoch_s"] / theirs["epoch_s"],
            "hpcgnn_over_dgl_mean": ours["epoch_mean_s"] / theirs["epoch_mean_s"],
            "rounds_hpcgnn_epoch_s": [r["hpcgnn_epoch_s"] for r in log],
            "rounds_dgl_epoch_s": [r["peer_epoch_s"] for r in log],
            "dgl_version": str(theirs.get("dgl", "")), "dgl_torch": str(theirs.get("torch", "")),
            "dgl_phases_min_s": theirs.get("phases_min_s", {}), "hpcgnn_phases_min_s": ours.get("phases_min_s", {})}


def print_comparison(what: str, c: dict) -> None:
    """One line: both fastest epochs and the ratio."""
    print(f"{what}: hpcgnn {c['hpcgnn_epoch_s']:.3f} s, DGL {c['dgl_version']} {c['dgl_epoch_s']:.3f} s per epoch "
          f"(fastest of {len(c['rounds_dgl_epoch_s'])} alternating rounds) -> hpcgnn/DGL "
          f"{c['hpcgnn_over_dgl']:.2f}x (means {c['hpcgnn_over_dgl_mean']:.2f}x)", flush=True)


def fullgraph_vs_dgl(graph_file: Path, model_args: dict, threads: int, epochs: int, rounds: int,
                     run_ours: Callable[[int], dict], timeout: float = 3600) -> dict | None:
    """Full-graph SAGE epochs, hpcgnn (``run_ours``) against DGL in alternating rounds; the
    comparison (:func:`_comparison`) or None without a (working) DGL peer."""
    python = dgl_python()
    if python is None:
        return None
    if model_args.get("arch", "sage") != "sage":
        print(f"DGL peer: times GraphSAGE only, not {model_args['arch']}: skipped", flush=True)
        return None
    args = ["fullgraph", "--graph", graph_file, "--epochs", epochs, "--hidden", model_args["hidden"],
            "--layers", model_args["num_layers"], "--dropout", model_args.get("dropout", 0.0), "--lr", 0.01,
            "--threads", threads, "--seed", model_args.get("seed") or 0]
    ours, theirs, log = alternate(rounds, run_ours,
                                  lambda i: try_peer(python, DGL_SCRIPT, args, timeout, name="DGL peer"))
    if theirs is None:
        return None
    c = _comparison(ours, theirs, log)
    print_comparison("full-graph SAGE, 1 process, back to back", c)
    return c


def minibatch_vs_dgl(graph_file: Path, config: Path, overrides: list[str], epochs: int, seed: int, rounds: int,
                     run_ours: Callable[[int], dict], timeout: float = 3600) -> dict | None:
    """Minibatch SAGE epochs at one rank (hpcgnn: ``run_ours``, one ``hpcgnn train`` per round)
    against DGL's NeighborSampler + DataLoader(num_workers=0) with the same config (model
    sizes, dropout, lr, fanouts, batch size); None without a (working) DGL peer."""
    from hpcgnn.run.config import load_config

    python = dgl_python()
    if python is None:
        return None
    cfg = load_config(config, list(overrides))
    if cfg.model.arch != "sage":
        print(f"DGL peer: times GraphSAGE only, not {cfg.model.arch}: skipped", flush=True)
        return None
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    args = ["minibatch", "--graph", graph_file, "--epochs", epochs, "--hidden", cfg.model.hidden,
            "--layers", cfg.model.layers, "--dropout", cfg.model.dropout, "--lr", cfg.train.lr,
            "--fanouts", ",".join(str(f) for f in cfg.minibatch.fanouts),
            "--batch-size", cfg.minibatch.batch_size, "--threads", threads, "--seed", seed]
    ours, theirs, log = alternate(rounds, run_ours,
                                  lambda i: try_peer(python, DGL_SCRIPT, args, timeout, name="DGL peer"))
    if theirs is None:
        return None
    c = _comparison(ours, theirs, log)
    print_comparison("minibatch SAGE, 1 rank, back to back", c)
    return c


if __name__ == "__main__":  # pragma: no cover - `python -m hpcgnn.bench.peers` shows where the peer is
    p = dgl_python()
    print(f"DGL peer interpreter: {p if p is not None else 'none (make peer-dgl)'}")
    sys.exit(0)
