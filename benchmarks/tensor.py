"""Benchmark the tensor-parallel engine (NeutronTP): `python -m benchmarks.tensor --out FILE.h5`.

1. Data: ``hpcgnn prepare --dataset products-like --scale S`` (the ogbn-products-shaped graph,
   harder preset) and ``hpcgnn partition`` (METIS) into each rank count of ``--ranks``, in a work
   directory (reused when already there).
2. For each rank count, ``hpcgnn train`` under mpiexec, the same 2-layer GCN width ``--hidden``:
   * ``tensor``: decoupled tensor parallelism (MLP, split, k = 2 rounds, gather);
   * ``tensor-chunks``: the same with ``--chunks`` pipelined chunks;
   * ``tensor-coupled``: a split and a gather around every layer (naive tensor parallelism);
   * ``fullgraph``: the partition-parallel exact full-graph engine (halo exchange per layer).
3. From each run file (epochs after the first; the machine may be shared): epoch time (slowest
   rank, mean over epochs), bytes sent per epoch (all ranks: tensor = split + gather + gradient
   allreduce; full-graph = halo + gradient allreduce), the per-rank compute time (tensor: MLP +
   aggregation; full-graph: forward + backward minus halo exchange) as max / mean over ranks
   (NeutronTP's claim: balance ~ 1.0), layout all-to-alls per epoch (4 decoupled vs 4 x layers
   coupled) and the per-rank aggregation work (edges x columns).

Prints a table and writes the figures to FILE.h5 (atomically). On this 2-core machine 4 ranks
share 2 cores: timings at 4 ranks measure oversubscription as much as the engines.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.launch import rank_command, run_checked
from benchmarks.workdir import products_like_inputs

CONFIG = """
[model]
arch = "gcn"
hidden = {hidden}
layers = 2
dropout = 0.0
[train]
engine = "{engine}"
epochs = {epochs}
lr = 0.003
seed = 0
eval_every = 0
checkpoint_every = 0
[output]
keep_checkpoints = 1
"""

CASES = {
    "tensor": ("tensor", []),
    "tensor-chunks": ("tensor", ["tensor.chunks={chunks}"]),
    "tensor-coupled": ("tensor", ["tensor.mode=coupled"]),
    "fullgraph": ("fullgraph", []),
}


def summarise_run(run_dir: Path, engine: str) -> dict:
    """Figures of one run file (see the module docstring)."""
    from hpcgnn.run.runfile import read_run

    r = read_run(run_dir)
    t, c = r["timings"], r["counters"]
    e = t["epoch"].shape[0]
    sel = slice(1, None) if e > 1 else slice(0, None)
    epoch = t["epoch"][sel]                                 # [E', P]
    ranks = epoch.shape[1]
    if engine == "tensor":
        compute = t["compute"][sel]
        comm_bytes = c["split_bytes"][sel] + c["gather_bytes"][sel]
        allreduce = c["allreduce_bytes"][sel]
    else:
        compute = t["forward"][sel] + t["backward"][sel] - t.get("halo", np.zeros_like(epoch))[sel]
        comm_bytes = c["halo_bytes"][sel]
        allreduce = np.full_like(epoch, float(r["attrs"].get("bench_param_bytes", 0.0))) if ranks > 1 else \
            np.zeros_like(epoch)
    comp_mean = compute.mean(axis=0)                        # per rank
    out = {
        "ranks": ranks, "epochs": e, "epoch_s": float(np.mean(np.max(epoch, axis=1))),
        "comm_bytes_per_epoch": float(np.mean(np.sum(comm_bytes, axis=1))),
        "allreduce_bytes_per_epoch": float(np.mean(np.sum(allreduce, axis=1))),
        "compute_s_per_rank": comp_mean.tolist(),
        "compute_max_over_mean": float(comp_mean.max() / max(comp_mean.mean(), 1e-12)),
        "phases_mean_s": {k: float(np.mean(v[sel])) for k, v in t.items() if k not in ("epoch", "eval")},
        "loss": float(r["metrics"]["loss"][-1]),
    }
    out["bytes_per_epoch"] = out["comm_bytes_per_epoch"] + out["allreduce_bytes_per_epoch"]
    if engine == "tensor":
        out["layout_alltoalls"] = float(c["layout_alltoalls"][-1, 0])
        out["mpi_exchanges"] = float(c["split_calls"][-1, 0] + c["gather_calls"][-1, 0])
        work = c["agg_edge_columns"][-1]
        out["agg_work_per_rank"] = work.tolist()
        out["agg_work_max_over_mean"] = float(work.max() / max(work.mean(), 1e-12))
        out["nn_rows_per_rank"] = c["nn_rows"][-1].tolist()
    return out


def _param_bytes(meta, hidden: int) -> int:
    """Bytes of the 2-layer GCN's parameters (the gradient allreduce buffer)."""
    f, c = meta.num_features, meta.num_classes
    return 4 * (f * hidden + hidden + hidden * c + c)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tensor", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="HDF5 file with the figures")
    p.add_argument("--work", default=None, help="work directory (default: beside --out)")
    p.add_argument("--scale", type=float, default=0.04, help="products-like scale (1 = ogbn-products size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--epochs", type=int, default=4, help="epochs per run (the first is warm-up)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    from benchmarks.results_file import write_results
    from hpcgnn.partition.store import read_meta

    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / "tensor-work"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    ranks = [int(x) for x in args.ranks.split(",") if x]
    graph, stores = products_like_inputs(work, args.scale, args.seed, set(ranks), args.timeout,
                                         "benchmarks.tensor")
    results: dict = {}
    for k in ranks:
        meta = read_meta(stores[k])
        for name in [c for c in args.cases.split(",") if c]:
            engine, sets = CASES[name]
            cfg = work / f"{name}.toml"
            cfg.write_text(CONFIG.format(hidden=args.hidden, engine=engine, epochs=args.epochs))
            run = work / f"run-{name}-{k}"
            cmd = rank_command(k, ["-m", "hpcgnn", "train", "--config", str(cfg),
                                   "--set", f"data.partitions={stores[k]}", "--set", f"output.dir={run}", "--force"])
            for s in sets:
                cmd += ["--set", s.format(chunks=args.chunks)]
            wall = run_checked(cmd, work / f"train-{name}-{k}.log", args.timeout, "benchmarks.tensor")
            if engine == "fullgraph":
                _tag_param_bytes(run, _param_bytes(meta, args.hidden))
            r = summarise_run(run, engine)
            r["wall_s"] = wall
            results[f"{name}/ranks_{k}"] = r
            print(f"{name:>15} {k} ranks: {r['epoch_s']:.3f} s/epoch, {r['bytes_per_epoch'] / 2**20:.1f} MiB/epoch, "
                  f"compute max/mean {r['compute_max_over_mean']:.3f}", flush=True)
    m = read_meta(stores[ranks[0]])
    meta = {"scale": args.scale, "seed": args.seed, "host": platform.node(), "python": platform.python_version(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "num_nodes": m.num_nodes, "num_edges": m.num_edges, "num_features": m.num_features,
            "num_classes": m.num_classes, "hidden": args.hidden, "layers": 2, "chunks": args.chunks,
            "epochs": args.epochs, "total_wall_s": time.perf_counter() - t_start}
    nested: dict = {}
    for key, r in results.items():
        name, rk = key.split("/")
        nested.setdefault(name, {})[rk] = r
    write_results(out, nested, meta, "hpcgnn-bench-tensor")
    print_table(results, meta)
    print(f"wrote {out}")
    return 0


def _tag_param_bytes(run: Path, nbytes: int) -> None:
    """Record the gradient-allreduce buffer size in a full-graph run file (its counters do not
    include the allreduce), so both engines' bytes per epoch count the same things."""
    import h5py

    from hpcgnn.run.runfile import RUN_FILE

    with h5py.File(run / RUN_FILE, "a") as f:
        f.attrs["bench_param_bytes"] = float(nbytes)


def print_table(results: dict, meta: dict) -> None:
    print(f"\ntensor-parallel benchmark: products-like scale {meta['scale']:g}, {meta['num_nodes']:,} vertices, "
          f"{meta['num_edges']:,} directed edges, {meta['num_features']} features, {meta['num_classes']} classes; "
          f"GCN 2 layers x {meta['hidden']}, {meta['cores']} cores")
    head = ["case", "ranks", "epoch_s", "MiB/epoch", "(layout/halo", "allreduce)", "compute max/mean",
            "all-to-alls", "MPI exch", "agg work max/mean"]
    rows = [head]
    for key, r in results.items():
        name, rk = key.split("/")
        rows.append([name, str(r["ranks"]), f"{r['epoch_s']:.3f}", f"{r['bytes_per_epoch'] / 2**20:.2f}",
                     f"{r['comm_bytes_per_epoch'] / 2**20:.2f}", f"{r['allreduce_bytes_per_epoch'] / 2**20:.2f}",
                     f"{r['compute_max_over_mean']:.3f}", str(int(r.get("layout_alltoalls", 0))) if "layout_alltoalls" in r
                     else "-", str(int(r["mpi_exchanges"])) if "mpi_exchanges" in r else "-",
                     f"{r['agg_work_max_over_mean']:.3f}" if "agg_work_max_over_mean" in r else "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    sys.exit(main())
