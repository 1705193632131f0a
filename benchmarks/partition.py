"""Benchmark graph preparation and partitioning: `python -m benchmarks.partition --out FILE.h5`.

Generates a uniform random graph (default 1M vertices, 10M directed edges, 128 float32
features: the worst case for METIS, which finds no structure), writes it as a graph file, then
runs `hpcgnn partition` (METIS, three constraints) into 4 and 16 parts, with the tool's default
refinement passes (--niter 3) and, for reference, METIS' own default (10). Each step runs in its
own child process; its wall time and peak resident memory (ru_maxrss from wait4) are measured
from outside, and the child reports its own step timings. Prints a table and writes the
figures to FILE.h5 (atomically). Targets (judged at the default --niter): partition <= 30 s and
<= 3 GB peak.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcgnn.partition.metis import DEFAULT_NITER

TARGET_SECONDS = 30.0
TARGET_BYTES = 3 << 30


def random_graph(num_nodes: int, num_edges: int, num_features: int, num_classes: int, seed: int):
    """A uniform random undirected graph with about ``num_edges`` directed edges and random data."""
    from hpcgnn.data.clean import build_symmetric_csr
    from hpcgnn.data.graph import Graph

    rng = np.random.default_rng(seed)
    m = num_edges // 2
    indptr, indices, stats = build_symmetric_csr(rng.integers(0, num_nodes, m), rng.integers(0, num_nodes, m),
                                                 num_nodes)
    features = rng.standard_normal((num_nodes, num_features), dtype=np.float32)
    labels = rng.integers(0, num_classes, num_nodes)
    r = rng.random(num_nodes)
    return Graph(indptr, indices, features, labels, r < 0.6, (r >= 0.6) & (r < 0.8), r >= 0.8,
                 num_classes=num_classes,
                 meta={"name": "bench-random", "source": {"generator": "benchmarks.partition.random_graph",
                                                          "nodes": num_nodes, "edges": num_edges,
                                                          "features": num_features, "seed": seed},
                       **stats})


def _child_prepare(args) -> dict:
    from hpcgnn.data.graph import write_graph

    t0 = time.perf_counter()
    graph = random_graph(args.nodes, args.edges, args.features, args.classes, args.seed)
    t1 = time.perf_counter()
    write_graph(args.graph, graph, force=True)
    t2 = time.perf_counter()
    return {"generate": t1 - t0, "write": t2 - t1, "num_nodes": graph.num_nodes, "num_edges": graph.num_edges}


def _child_partition(args) -> dict:
    from hpcgnn.partition.pipeline import partition_file

    from hpcgnn.partition.metis import metis_version

    summary, timings = partition_file(args.graph, args.store, args.parts, "metis", args.seed, force=True,
                                      progress=False, niter=args.niter[0])
    return {**timings, "metis": metis_version(), "peaks": {r.name: r.peak_rss for r in summary.steps},
            "edge_cut": summary.edge_cut, "balance": summary.balance,
            "halo_total": int(summary.halo_counts.sum())}


def _run_child(step: list[str], report: Path) -> tuple[float, float, int, dict]:
    """Run this module as a child for one step; (wall s, CPU s, peak RSS bytes, child's report).

    CPU seconds (user + system of the child) are the fairer figure on a shared machine.
    """
    cmd = [sys.executable, "-m", "benchmarks.partition", "--report", str(report), *step]
    t0 = time.perf_counter()
    from benchmarks.launch import checkout_first

    proc = subprocess.Popen(cmd, env=checkout_first({**os.environ, "HPCGNN_PROGRESS": "0"}))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks.partition: step {' '.join(step)} failed (exit {proc.returncode})")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, json.loads(report.read_text())


def _write_results(path: Path, rows: list[dict], params: dict) -> None:
    import h5py

    from hpcgnn.fileio import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = "hpcgnn-bench-partition"
            f.attrs["params"] = json.dumps(params, sort_keys=True)
            f.attrs["targets"] = json.dumps({"partition_seconds": TARGET_SECONDS, "peak_bytes": TARGET_BYTES})
            f.create_dataset("step", data=np.array([r["step"] for r in rows], dtype=h5py.string_dtype()))
            f.create_dataset("parts", data=np.array([r["parts"] for r in rows], dtype=np.int64))
            f.create_dataset("niter", data=np.array([r["niter"] for r in rows], dtype=np.int64))
            f.create_dataset("wall_seconds", data=np.array([r["wall"] for r in rows]))
            f.create_dataset("cpu_seconds", data=np.array([r["cpu"] for r in rows]))
            f.create_dataset("peak_rss_bytes", data=np.array([r["rss"] for r in rows], dtype=np.int64))
            for r in rows:
                g = f.create_group(r["step"])
                g.attrs["report"] = json.dumps(r["report"], sort_keys=True)
                g.attrs["wall_seconds"] = r["wall"]
                g.attrs["cpu_seconds"] = r["cpu"]
                g.attrs["peak_rss_bytes"] = r["rss"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.partition", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="results file (HDF5)")
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--edges", type=int, default=10_000_000, help="directed edges (2 x undirected)")
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--parts", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--niter", type=int, nargs="+", default=[DEFAULT_NITER, 10],
                    help="METIS refinement passes to measure (the first is judged against the target)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None, help="where the graph and stores go (temporary)")
    # Child-process steps (internal).
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=["prepare", "partition"], help=argparse.SUPPRESS)
    ap.add_argument("--graph", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        if args.child == "prepare":
            report = _child_prepare(args)
        else:
            args.parts = args.parts[0]
            report = _child_partition(args)
        args.report.write_text(json.dumps(report))
        return 0
    if args.out is None:
        ap.error("--out is required")

    work = Path(tempfile.mkdtemp(prefix="hpcgnn-bench-partition.", dir=args.workdir))
    rows = []
    try:
        graph = work / "graph.h5"
        common = ["--seed", str(args.seed), "--graph", str(graph)]
        size = ["--nodes", str(args.nodes), "--edges", str(args.edges), "--features", str(args.features),
                "--classes", str(args.classes)]
        load_before = os.getloadavg()
        wall, cpu, rss, rep = _run_child(["--child", "prepare", *common, *size], work / "prepare.json")
        rows.append({"step": "prepare", "parts": 0, "niter": 0, "wall": wall, "cpu": cpu, "rss": rss, "report": rep})
        print(f"prepare: {wall:.1f} s (generate {rep['generate']:.1f} s, write {rep['write']:.1f} s), "
              f"peak {rss / 2**30:.2f} GiB", flush=True)
        for niter in args.niter:
            for k in args.parts:
                step = f"partition-{k}" + ("" if niter == args.niter[0] else f"-niter{niter}")
                wall, cpu, rss, rep = _run_child(["--child", "partition", *common, "--parts", str(k), "--niter",
                                                  str(niter), "--store", str(work / f"store-{k}")],
                                                 work / f"partition-{k}.json")
                rows.append({"step": step, "parts": k, "niter": niter, "judged": niter == args.niter[0],
                             "wall": wall, "cpu": cpu, "rss": rss, "report": rep})
                steps = ", ".join(f"{name} {rep[name]:.1f} s {rep['peaks'][name] / 2**30:.2f} GiB"
                                  for name in rep["peaks"] if name != "total")
                print(f"partition {k} (niter {niter}): {wall:.1f} s, peak {rss / 2**30:.2f} GiB; {steps}", flush=True)
                shutil.rmtree(work / f"store-{k}", ignore_errors=True)
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    params = {"nodes": args.nodes, "edges": args.edges, "features": args.features, "classes": args.classes,
              "seed": args.seed, "num_edges_actual": rows[0]["report"]["num_edges"], "cpus": os.cpu_count(),
              "machine": platform.platform(), "python": platform.python_version(),
              "loadavg_before": load_before, "loadavg_after": load_after}
    print()
    print(f"random graph: {args.nodes:,} vertices, {params['num_edges_actual']:,} directed edges, "
          f"{args.features} features ({os.cpu_count()} CPUs, load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after)")
    print(f"{'step':<20} {'wall s':>8} {'cpu s':>7} {'peak GiB':>9} {'read s':>7} {'metis s':>8} {'write s':>8} "
          f"{'edge cut %':>10} {'bal v/t/e':>17} {'target':>7}")
    for r in rows:
        rep = r["report"]
        if r["parts"]:
            ok = r["wall"] <= TARGET_SECONDS and r["rss"] <= TARGET_BYTES
            verdict = ("met" if ok else "MISSED") if r["judged"] else "ref"
            b = rep["balance"]
            cut = 100 * rep["edge_cut"] / (params["num_edges_actual"] // 2)
            print(f"{r['step']:<20} {r['wall']:>8.1f} {r['cpu']:>7.1f} {r['rss'] / 2**30:>9.2f} {rep['read']:>7.1f} "
                  f"{rep.get('prepare', 0) + rep['assign']:>8.1f} {rep.get('read_data', 0) + rep['write']:>8.1f} {cut:>10.1f} "
                  f"{b['vertices']:>5.3f}/{b['train']:.3f}/{b['edges']:.3f} {verdict:>7}")
        else:
            print(f"{r['step']:<20} {r['wall']:>8.1f} {r['cpu']:>7.1f} {r['rss'] / 2**30:>9.2f} {'':>7} {'':>8} "
                  f"{rep['write']:>8.1f}")
    print("(read s: the topology; metis s: the assignment; write s: reading the vertex data and writing; target judged at "
          f"--niter {args.niter[0]}, 'ref' rows for comparison)")
    _write_results(args.out, rows, params)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
