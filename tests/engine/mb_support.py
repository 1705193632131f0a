"""Helpers for the minibatch-engine tests: tiny partition stores, launching `hpcgnn train`
under real mpiexec, and reading the engine's debug records."""
from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np

from mpiutil import ROOT, run_mpi

from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.data.graph import Graph

# Prints each rank's exit code so a test can check that *every* rank stopped with it. The rank
# comes from the launcher (PMI_RANK, OMPI_COMM_WORLD_RANK ...: hpcgnn.supervisor.launcher_rank), not from MPI: `hpcgnn train` forks its watcher before MPI
# starts (hpcgnn/supervisor.py), and runs unwatched in a process that started MPI first.
RANK_EXIT = (
    "import sys\n"
    "from hpcgnn.cli import main\n"
    "from hpcgnn.supervisor import launcher_rank\n"
    "try:\n"
    "    rc = main(sys.argv[1:])\n"
    "except SystemExit as exc:\n"
    "    rc = exc.code\n"
    "print(f'RANK {launcher_rank()} EXIT {rc}', flush=True)\n"
    "sys.exit(rc)\n"
)


def tiny_graph(num_nodes: int = 360, num_features: int = 6, num_classes: int = 3, seed: int = 0,
               window: int = 30, no_train_range: tuple[int, int] | None = None) -> Graph:
    """Random local graph (edges within ``window`` IDs, plus a ring); class-dependent features.

    ``no_train_range`` = (lo, hi): vertices in [lo, hi) are never training vertices.
    """
    rng = np.random.default_rng(seed)
    m = num_nodes * 3
    src = rng.integers(0, num_nodes, m)
    dst = np.clip(src + rng.integers(-window, window + 1, m), 0, num_nodes - 1)
    ring = np.arange(num_nodes)
    indptr, indices, _ = build_symmetric_csr(np.concatenate([src, ring]),
                                             np.concatenate([dst, (ring + 1) % num_nodes]), num_nodes)
    labels = rng.integers(0, num_classes, num_nodes).astype(np.int64)
    centers = rng.standard_normal((num_classes, num_features)).astype(np.float32)
    features = (centers[labels] + rng.standard_normal((num_nodes, num_features))).astype(np.float32)
    split = rng.random(num_nodes)
    train = split < 0.4
    if no_train_range is not None:
        train[no_train_range[0]:no_train_range[1]] = False
    return Graph(indptr=indptr, indices=indices, features=features, labels=labels,
                 train_mask=train, val_mask=(split >= 0.4) & (split < 0.7), test_mask=split >= 0.7,
                 num_classes=num_classes, meta={"name": "tiny"})


def tiny_store(out: Path, graph: Graph, num_parts: int) -> Path:
    """Contiguous partitioning of ``graph`` written with the real store writer."""
    from hpcgnn.partition.writer import write_store

    n = graph.num_nodes
    part = (np.arange(n) * num_parts) // n
    write_store(out, graph, part, num_parts, method="contiguous", seed=0, constraints=(),
                source_graph="tiny", source_hash="tiny", force=True, progress=False)
    return Path(out)


def small_config(epochs: int, batch_size: int, fanouts: int, nc: int, **train) -> str:
    """The TOML of a 2-layer, 8-wide minibatch run (lr 0.01) with these settings; ``train``:
    further [train] keys (e.g. checkpoint_every=1)."""
    extra = "".join(f"{k} = {v}\n" for k, v in train.items())
    return (f"[model]\nhidden = 8\nlayers = 2\n[train]\nepochs = {epochs}\nlr = 0.01\n{extra}"
            f"[minibatch]\nbatch_size = {batch_size}\nfanouts = [{fanouts}, {fanouts}]\nnc = {nc}\n")


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def train(n: int, config: Path, parts: Path, run: Path, *extra: str, timeout: float = 120,
          env: dict | None = None, fresh: bool = False):
    """`mpiexec -n n python -m hpcgnn train ...`; returns the CompletedProcess (``fresh``: see
    :func:`mpiutil.python`)."""
    args = ["-m", "hpcgnn", "train", "--config", str(config), "--set", f"data.partitions={parts}",
            "--set", f"output.dir={run}", *extra]
    return run_mpi(n, args, timeout=timeout, env=env, cwd=ROOT, fresh=fresh)


def train_each_rank_exit(n: int, args: list[str], timeout: float = 60):
    """Run `hpcgnn <args>` on n ranks; returns (process, {rank: exit code})."""
    proc = run_mpi(n, ["-c", RANK_EXIT, *args], timeout=timeout, cwd=ROOT)
    codes = {int(r): int(c) for r, c in re.findall(r"RANK (\d+) EXIT (-?\d+)", proc.stdout)}
    return proc, codes


def read_debug(run: Path, rank: int) -> dict:
    """The debug record of one rank: steps (structured array); pushes, receives, inputs as lists
    of dicts with epoch, iteration, layer, ids, ranks, rows."""
    out: dict = {}
    with h5py.File(Path(run) / "debug" / f"rank-{rank:05d}.h5", "r") as f:
        out["steps"] = f["steps"][()]
        for name in ("pushes", "receives", "inputs"):
            g = f[name]
            index, ids, ranks, rows = g["index"][()], g["ids"][()], g["ranks"][()], g["rows"][()]
            out[name] = [{"epoch": int(e), "iteration": int(k), "layer": int(l), "ids": ids[o:o + n],
                          "ranks": ranks[o:o + n], "rows": np.ascontiguousarray(rows[o:o + n, :w])}
                         for e, k, l, o, n, w in index]
    return out
