"""Benchmark RAPA (speed-proportional parts): `python -m benchmarks.rapa --out FILE.h5`.

1. Data: ``hpcgnn prepare --dataset products-like --scale S`` and the default METIS store into
   ``--ranks`` (2) equal parts, in a work directory (reused when already there).
2. Ranks of unequal speed on one machine: ``runtime.threads = --threads`` (default [1, 2]).
3. Calibration: the exact full-graph engine (GCN, ``--layers`` x ``--hidden``) trains the equal
   store for ``--epochs``; its run gives every rank's speed (``partition --rank-speed RUN``:
   part work / compute seconds, docs/rapa.md). ``--speeds 1,2`` skips it and takes the list.
4. ``hpcgnn partition --rank-speed`` writes the speed-proportional store (``rapa``); with
   ``--trim`` also one with the halo-trimming step (``rapa-trim``).
5. Back to back, ``--repeats`` times: the equal store, then the RAPA store(s), each a fresh
   ``hpcgnn train`` run under mpiexec with the same threads. From each run file (epochs after
   the first, without the final evaluation): epoch time (slowest rank per epoch, mean over epochs),
   per-rank compute seconds
   (forward + backward - halo exchange) and the measured slowest rank (largest compute).
6. ``hpcgnn inspect``'s prediction (:func:`hpcgnn.partition.summary.rank_work`) for each store,
   with the nominal speeds (the thread counts) and with the calibrated ones: the predicted
   straggler against the measured slowest rank.

Prints a table and writes the figures to FILE.h5 (atomically). The machine is shared: compare the
back-to-back pairs, not runs of different invocations.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.launch import python_command, rank_command, run_checked
from benchmarks.workdir import products_like_inputs
from hpcgnn.runtime import usable_cpus

CONFIG = """
[model]
arch = "gcn"
hidden = {hidden}
layers = {layers}
dropout = 0.0
[train]
engine = "fullgraph"
epochs = {epochs}
lr = 0.003
seed = 0
eval_every = 0
checkpoint_every = 0
[runtime]
threads = {threads}
[output]
keep_checkpoints = 1
"""


def summarise_run(run_dir: Path) -> dict:
    """Epoch time and per-rank compute of one run (epochs after the first)."""
    from hpcgnn.partition.rapa import compute_seconds, timed_epochs
    from hpcgnn.run.runfile import read_run

    r = read_run(run_dir)
    t = r["timings"]
    sel = timed_epochs(t)
    epoch = t["epoch"][sel]
    comp = compute_seconds(t)[sel].mean(axis=0)
    slowest = np.max(epoch, axis=1)
    return {"epoch_s": float(np.mean(slowest)), "epoch_median_s": float(np.median(slowest)),
            "epochs_timed": int(epoch.shape[0]),
            "compute_s_per_rank": comp.tolist(), "measured_slowest": int(np.argmax(comp)),
            "compute_max_over_mean": float(comp.max() / max(comp.mean(), 1e-12)),
            "wait_s_per_rank": np.mean(t["allreduce"][sel], axis=0).tolist() if "allreduce" in t else [],
            "rank_threads": r["attrs"].get("rank_threads", ""), "loss": float(r["metrics"]["loss"][-1])}


def predictions(store: Path, nominal: str, calibrated: str | None) -> dict:
    """inspect's expected per-rank work for ``store`` under the nominal and calibrated speeds."""
    from hpcgnn.partition.summary import summarise

    out = {}
    for name, spec in (("nominal", nominal), ("calibrated", calibrated), ("recorded", None)):
        if name == "calibrated" and spec is None:
            continue
        w = summarise(store, spec)["rank_work"]
        out[name] = {"speeds": w["speeds"], "relative_time": w["relative_time"],
                     "predicted_straggler": w["predicted_straggler"], "max_over_mean": w["max_over_mean"],
                     "work": w["work"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rapa", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="HDF5 file with the figures")
    p.add_argument("--work", default=None, help="work directory (default: beside --out)")
    p.add_argument("--scale", type=float, default=0.04, help="products-like scale (1 = ogbn-products size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", default="1,2", help="threads of each rank (runtime.threads)")
    p.add_argument("--speeds", default=None,
                   help="rank speeds for the RAPA store (default: calibrated from an equal-parts run)")
    p.add_argument("--epochs", type=int, default=5,
                   help="epochs per run (the first and the final evaluation epoch are not timed)")
    p.add_argument("--repeats", type=int, default=3, help="back-to-back rounds of (equal, rapa)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--trim", action="store_true", help="also a RAPA store with halo trimming")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    from benchmarks.results_file import write_results
    from hpcgnn.partition.store import read_meta

    threads = [int(x) for x in args.threads.split(",") if x.strip()]
    if len(threads) != args.ranks or min(threads) < 1:
        raise SystemExit(f"--threads {args.threads}: expected {args.ranks} integers >= 1")
    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / "rapa-work"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    who = "benchmarks.rapa"
    graph, stores = products_like_inputs(work, args.scale, args.seed, {args.ranks}, args.timeout, who)
    hpcgnn = [*python_command(), "-m", "hpcgnn"]
    cfg = work / "rapa-train.toml"
    cfg.write_text(CONFIG.format(hidden=args.hidden, layers=args.layers, epochs=args.epochs,
                                 threads=f"[{', '.join(map(str, threads))}]"))

    def train(store: Path, name: str) -> Path:
        run = work / f"run-{name}"
        run_checked(rank_command(args.ranks, ["-m", "hpcgnn", "train", "--config", str(cfg),
                                             "--set", f"data.partitions={store}", "--set", f"output.dir={run}",
                                             "--force"]),
                   work / f"train-{name}.log", args.timeout, who)
        return run

    equal = stores[args.ranks]
    calibration = None
    if args.speeds is None:
        run = train(equal, "calibrate")
        calibration = summarise_run(run)
        speed_spec = str(run)
    else:
        speed_spec = args.speeds
    cases = {"equal": equal}
    tag = f"s{args.scale:g}-{args.ranks}"
    for name, extra in (("rapa", []), ("rapa-trim", ["--halo-trim"])):
        if name == "rapa-trim" and not args.trim:
            continue
        store = work / f"rapa-{tag}-{name}"
        run_checked(hpcgnn + ["partition", str(graph), "--parts", str(args.ranks), "--seed", str(args.seed),
                             "--rank-speed", speed_spec, "--out", str(store), "--force", "--quiet", *extra],
                   work / f"partition-{name}.log", args.timeout, who)
        cases[name] = store
    nominal = ",".join(map(str, threads))
    results: dict = {}
    for rep in range(args.repeats):
        for name, store in cases.items():
            r = summarise_run(train(store, f"{name}-{rep}"))
            results.setdefault(name, {"rounds": []})["rounds"].append(r)
            print(f"round {rep}: {name:>9}: {r['epoch_s']:.3f} s/epoch, compute per rank "
                  f"{', '.join(f'{x:.3f}' for x in r['compute_s_per_rank'])} s", flush=True)
    for name, store in cases.items():
        res = results[name]
        rounds = res["rounds"]
        comp = np.mean([r["compute_s_per_rank"] for r in rounds], axis=0)
        res.update({"epoch_s": float(np.mean([r["epoch_s"] for r in rounds])),
                    "epoch_s_per_round": [r["epoch_s"] for r in rounds],
                    "compute_s_per_rank": comp.tolist(), "measured_slowest": int(np.argmax(comp)),
                    "compute_max_over_mean": float(comp.max() / max(comp.mean(), 1e-12)),
                    "prediction": predictions(store, nominal, speed_spec if calibration is not None else None),
                    "store": str(store)})
        m = read_meta(store)
        res["part_solid"] = np.diff(m.part_offsets).tolist()
        res["part_halo"] = m.halo_counts.tolist()
    for name in cases:
        if name != "equal":
            pairs = [e["epoch_s"] / r["epoch_s"] for e, r in zip(results["equal"]["rounds"], results[name]["rounds"])]
            results[name]["speedup_vs_equal_per_round"] = pairs
            results[name]["speedup_vs_equal"] = float(np.mean(pairs))
            results[name]["speedup_vs_equal_median"] = float(np.median(pairs))
            results[name]["rounds_faster_than_equal"] = int(np.sum(np.array(pairs) > 1))
    m = read_meta(equal)
    meta = {"scale": args.scale, "seed": args.seed, "ranks": args.ranks, "threads": nominal,
            "speeds": speed_spec if calibration is None else "calibrated", "host": platform.node(),
            "python": platform.python_version(),
            "cores": usable_cpus(),
            "loadavg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0,
            "num_nodes": m.num_nodes, "num_edges": m.num_edges, "hidden": args.hidden, "layers": args.layers,
            "epochs": args.epochs, "repeats": args.repeats, "total_wall_s": time.perf_counter() - t_start}
    nested = dict(results)
    if calibration is not None:
        nested["calibration"] = calibration
    write_results(out, nested, meta, "hpcgnn-bench-rapa")
    print_table(results, calibration, meta)
    print(f"wrote {out}")
    return 0


def print_table(results: dict, calibration: dict | None, meta: dict) -> None:
    print(f"\nRAPA benchmark: products-like scale {meta['scale']:g} ({meta['num_nodes']:,} vertices, "
          f"{meta['num_edges']:,} directed edges), {meta['ranks']} ranks with threads {meta['threads']} on "
          f"{meta['cores']} cores; full-graph GCN {meta['layers']} x {meta['hidden']}; {meta['repeats']} "
          f"back-to-back rounds of {meta['epochs']} epochs (first not timed)")
    if calibration is not None:
        print(f"  calibration run (equal parts): compute per rank "
              f"{', '.join(f'{x:.3f}' for x in calibration['compute_s_per_rank'])} s")
    head = ["parts", "epoch_s", "per round", "vs equal mean/median (rounds faster)", "solid per rank", "compute s per rank",
            "max/mean", "slowest", "predicted (nominal)", "predicted (calibrated, else recorded)"]
    rows = [head]
    for name, r in results.items():
        pred = r["prediction"]
        cal = pred.get("calibrated") or pred.get("recorded")
        rows.append([name, f"{r['epoch_s']:.3f}", " ".join(f"{x:.2f}" for x in r["epoch_s_per_round"]),
                     f"{r['speedup_vs_equal']:.2f}x/{r['speedup_vs_equal_median']:.2f}x "
                     f"({r['rounds_faster_than_equal']}/{len(r['rounds'])})" if "speedup_vs_equal" in r else "-",
                     "/".join(str(x) for x in r["part_solid"]),
                     "/".join(f"{x:.2f}" for x in r["compute_s_per_rank"]), f"{r['compute_max_over_mean']:.3f}",
                     f"rank {r['measured_slowest']}",
                     f"rank {pred['nominal']['predicted_straggler']} ({pred['nominal']['max_over_mean']:.2f})",
                     f"rank {cal['predicted_straggler']} ({cal['max_over_mean']:.2f})"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    sys.exit(main())
