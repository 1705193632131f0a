"""Benchmark work directories: the products-like inputs the benches share."""
from __future__ import annotations

from pathlib import Path

from benchmarks.launch import python_command, run_checked


def products_like_inputs(work: Path, scale: float, seed: int, parts, timeout: float,
                         who: str) -> tuple[Path, dict[int, Path]]:
    """(graph file, {K: METIS store}) of a products-like graph in ``work`` for each K in ``parts``.

    Made with ``hpcgnn prepare`` / ``hpcgnn partition`` (default options) when missing, and
    reused when present: delete ``work`` after changing the partitioner's defaults.
    """
    hpcgnn = [*python_command(), "-m", "hpcgnn"]
    tag = f"products-like-s{scale:g}-seed{seed}"
    graph = work / f"{tag}.h5"
    if not graph.exists():
        run_checked(hpcgnn + ["prepare", "--dataset", "products-like", "--scale", f"{scale:g}", "--seed", str(seed),
                             "--out", str(graph)], work / "prepare.log", timeout, who)
    stores = {}
    for k in sorted(set(parts)):
        store = work / f"{tag}-metis-{k}"
        if not (store / "meta.h5").exists():
            run_checked(hpcgnn + ["partition", str(graph), "--parts", str(k), "--seed", str(seed), "--out",
                                 str(store), "--force"], work / f"partition-{k}.log", timeout, who)
        stores[k] = store
    return graph, stores
