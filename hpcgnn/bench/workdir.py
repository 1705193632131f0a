"""Benchmark work directories: logged child commands and the products-like inputs they share."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_logged(cmd: list[str], log: Path, timeout: float, who: str) -> float:
    """Run ``cmd`` from the repository root with its output in ``log``; wall seconds.

    Exits (SystemExit naming ``who``, the command and the log's tail) when it fails.
    """
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, "HPCGNN_PROGRESS": "0"}, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{who}: {' '.join(cmd)} failed (exit {proc.returncode})\n{log.read_text()[-3000:]}")
    return wall


def products_like_inputs(work: Path, scale: float, seed: int, parts, timeout: float,
                         who: str) -> tuple[Path, dict[int, Path]]:
    """(graph file, {K: METIS store}) of a products-like graph in ``work`` for each K in ``parts``.

    Made with ``hpcgnn prepare`` / ``hpcgnn partition`` (default options) when missing, and
    reused when present: delete ``work`` after changing the partitioner's defaults.
    """
    from hpcgnn.bench.launch import python_command

    hpcgnn = [*python_command(), "-m", "hpcgnn"]
    tag = f"products-like-s{scale:g}-seed{seed}"
    graph = work / f"{tag}.h5"
    if not graph.exists():
        run_logged(hpcgnn + ["prepare", "--dataset", "products-like", "--scale", f"{scale:g}", "--seed", str(seed),
                             "--out", str(graph)], work / "prepare.log", timeout, who)
    stores = {}
    for k in sorted(set(parts)):
        store = work / f"{tag}-metis-{k}"
        if not (store / "meta.h5").exists():
            run_logged(hpcgnn + ["partition", str(graph), "--parts", str(k), "--seed", str(seed), "--out",
                                 str(store), "--force"], work / f"partition-{k}.log", timeout, who)
        stores[k] = store
    return graph, stores
