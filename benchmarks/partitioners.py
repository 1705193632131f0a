"""METIS against KaMinPar on one graph file: `python -m benchmarks.partitioners GRAPH.h5 --out FILE.h5`.

For each number of parts (default 4 and 16) and each method (metis, kaminpar), runs
`hpcgnn partition` in a child process and reports the edge cut ratio, the three balances
(vertices, training vertices, edges: max/mean part weight), the wall and CPU time, the peak
resident memory (ru_maxrss from wait4: the command's own and, for KaMinPar, its partitioner
child's, whichever is larger) and the assignment step's time; then, with ``--budget SIZE``,
`--method auto` under that memory budget at the first part count, and which method it chose.
Prints a table and writes the figures to FILE.h5 (atomically). The stores go to a temporary
directory beside --out and are removed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

METHODS = ("metis", "kaminpar")


def _run(graph: Path, store: Path, parts: int, method: str, budget: str | None) -> dict:
    """One `hpcgnn partition` child: its figures and the store's."""
    from hpcgnn.partition.store import read_meta

    cmd = [sys.executable, "-m", "hpcgnn", "partition", str(graph), "--parts", str(parts), "--method", method,
           "--out", str(store), "--force", "--quiet"]
    if budget is not None:
        cmd += ["--memory-budget", budget]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, "HPCGNN_PROGRESS": "0"}, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"benchmarks.partitioners: {' '.join(cmd)} failed (exit {os.waitstatus_to_exitcode(status)})")
    meta = read_meta(store)
    steps = {s["name"]: s for s in (meta.steps or [])}
    return {"method": str(meta.method), "requested": method, "parts": parts, "wall": wall,
            "cpu": usage.ru_utime + usage.ru_stime,
            "peak": max(usage.ru_maxrss * 1024, int(steps.get("total", {}).get("peak_rss", 0))),
            "assign": float(steps.get("assign", {}).get("seconds", 0.0)),
            "cut": meta.edge_cut / max(meta.num_edges // 2, 1), "balance": meta.balance,
            "choice": str(meta.attrs.get("method_choice", "")), "budget": budget or "",
            "stdout_first": out.splitlines()[0] if out else ""}


def _table(rows: list[dict]) -> str:
    from hpcgnn.units import fmt_bytes

    lines = [f"{'run':<22} {'parts':>5} {'cut %':>7} {'vert':>6} {'train':>6} {'edges':>6} "
             f"{'wall s':>8} {'assign s':>9} {'cpu s':>8} {'peak':>10}"]
    for r in rows:
        name = r["method"] if r["requested"] != "auto" else f"auto->{r['method']}"
        b = r["balance"]
        lines.append(f"{name:<22} {r['parts']:>5} {100 * r['cut']:>7.2f} {b.get('vertices', 1):>6.3f} "
                     f"{b.get('train', 1):>6.3f} {b.get('edges', 1):>6.3f} {r['wall']:>8.1f} {r['assign']:>9.1f} "
                     f"{r['cpu']:>8.1f} {fmt_bytes(r['peak']):>10}")
    return "\n".join(lines)


def _write(path: Path, rows: list[dict], params: dict) -> None:
    import h5py

    from hpcgnn.fileio import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = "hpcgnn-bench-partitioners"
        f.attrs["params"] = json.dumps(params, sort_keys=True)
        text = h5py.string_dtype()
        f.create_dataset("requested", data=np.array([r["requested"] for r in rows], dtype=text))
        f.create_dataset("method", data=np.array([r["method"] for r in rows], dtype=text))
        f.create_dataset("parts", data=np.array([r["parts"] for r in rows], dtype=np.int64))
        f.create_dataset("edge_cut_ratio", data=np.array([r["cut"] for r in rows]))
        for c in ("vertices", "train", "edges"):
            f.create_dataset(f"balance_{c}", data=np.array([r["balance"].get(c, 1.0) for r in rows]))
        f.create_dataset("wall_seconds", data=np.array([r["wall"] for r in rows]))
        f.create_dataset("assign_seconds", data=np.array([r["assign"] for r in rows]))
        f.create_dataset("cpu_seconds", data=np.array([r["cpu"] for r in rows]))
        f.create_dataset("peak_rss_bytes", data=np.array([r["peak"] for r in rows], dtype=np.int64))
        f.create_dataset("memory_budget", data=np.array([r["budget"] for r in rows], dtype=text))
        f.create_dataset("method_choice", data=np.array([r["choice"] for r in rows], dtype=text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.partitioners", description=__doc__.splitlines()[0])
    ap.add_argument("graph", type=Path, help="graph file (hpcgnn prepare)")
    ap.add_argument("--out", type=Path, required=True, help="results file (HDF5)")
    ap.add_argument("--parts", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--budget", default=None, metavar="SIZE",
                    help="also run --method auto under this memory budget (at the first --parts)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix=".hpcgnn-bench-partitioners.", dir=args.out.resolve().parent
                                 if args.out.resolve().parent.exists() else None))
    rows = []
    try:
        for parts in args.parts:
            for method in args.methods:
                rows.append(_run(args.graph, work / "store", parts, method, None))
                print(_table(rows[-1:]).splitlines()[1], flush=True)
        if args.budget is not None:
            rows.append(_run(args.graph, work / "store", args.parts[0], "auto", args.budget))
            print(rows[-1]["choice"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(_table(rows))
    params = {"graph": str(args.graph), "parts": args.parts, "methods": args.methods, "budget": args.budget,
              "host": os.uname().nodename, "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    _write(args.out, rows, params)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
