"""Validate `hpcgnn plan` against measured runs: `python -m benchmarks.plan --out FILE.h5`.

1. Data: products-like at ``--scale`` (0.04 default; at 1.0 only under
   ``flock /tmp/hpcgnn-bigmem.lock``) and its METIS store of ``--ranks`` parts, in a work
   directory (reused when there).
2. Calibration: measured now into ``WORK/calibration.json`` (``--reuse-calibration`` keeps an
   earlier one), so rates and runs see the same machine load.
3. The planner's predictions for the benchmark configuration (``--arch`` GCN, ``--layers`` 2 x
   ``--hidden`` 128, minibatch ``--fanouts`` 10,10, batch 1000) on ``--ranks`` ranks of this
   machine.
4. ``--rounds`` times, back to back, for each case of ``--cases`` (planner candidate labels):
   ``hpcgnn train`` under mpiexec with the candidate's settings for ``--epochs`` epochs
   (training epochs timed, evaluation once at the end); a run's epoch time = mean over epochs
   after the first of the slowest rank's epoch, the case's = the fastest round's (the
   calibration's rates are best-of-N too: on a shared machine both approach the unloaded
   figures); measured peak memory = the largest per-rank peak RSS of any round (training and
   the final evaluation; ``hpcgnn.run.memory``).
5. Prints predicted vs measured (peak memory error, epoch times, the two orderings, pairwise
   order agreement) and writes the figures to FILE.h5 (atomically).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.results_file import write_results
from benchmarks.launch import rank_command, run_checked
from benchmarks.workdir import products_like_inputs
from hpcgnn.runtime import usable_cpus

CONFIG = """
[model]
arch = "{arch}"
hidden = {hidden}
layers = {layers}
dropout = 0.5
[train]
engine = "fullgraph"
epochs = {epochs}
lr = 0.003
seed = 0
eval_every = 0
checkpoint_every = 0
[minibatch]
fanouts = [{fanouts}]
batch_size = 1000
[output]
keep_checkpoints = 1
"""

DEFAULT_CASES = ("minibatch hec", "minibatch exact", "fullgraph in-memory", "fullgraph offload k=4",
                 "tensor decoupled", "tensor coupled")


def measured(run_dir: Path) -> dict:
    """Epoch time (slowest rank, mean over epochs after the first), peak RSS (largest rank,
    any epoch) and bytes sent per training epoch (busiest rank; epochs after the first, before
    the last, whose counters include the final evaluation) of a run directory."""
    from hpcgnn.run.runfile import read_run

    r = read_run(run_dir)
    t, c = r["timings"], r["counters"]
    ep = t["epoch"]
    sel = slice(1, None) if ep.shape[0] > 1 else slice(0, None)
    if "bytes_sent" in c:
        sent = c["bytes_sent"]
    elif "split_bytes" in c:
        sent = c["split_bytes"] + c["gather_bytes"] + c.get("allreduce_bytes", 0 * ep)
    else:
        sent = c.get("halo_bytes", 0 * ep)
    # the last epoch's counters include the final evaluation's exchanges: bytes of the others
    bsel = slice(1, -1) if ep.shape[0] > 2 else (slice(0, -1) if ep.shape[0] > 1 else slice(0, None))
    return {"epoch_s": float(np.mean(np.max(ep[sel], axis=1))),
            "epoch_s_per_epoch": np.max(ep, axis=1).tolist(),
            "peak_rss_bytes": float(np.max(c["peak_rss_bytes"])),
            "bytes_per_epoch": float(np.mean(np.max(np.asarray(sent)[bsel], axis=1)))}


def pairwise_agreement(pred: list[float], meas: list[float]) -> float:
    """Fraction of case pairs that the prediction orders as measured."""
    n, agree, total = len(pred), 0, 0
    for i in range(n):
        for j in range(i + 1, n):
            total += 1
            agree += (pred[i] - pred[j]) * (meas[i] - meas[j]) > 0
    return agree / total if total else 1.0


def summarise(results: dict, cases: list, engines: dict) -> dict:
    """Orders by predicted and measured epoch time (all cases, and engines by their best case),
    pairwise order agreement, cases with the peak memory within +-25 %."""
    pred_t = [results[c]["predicted_epoch_s"] for c in cases]
    meas_t = [results[c]["measured_epoch_s"] for c in cases]
    names = sorted(set(engines.values()))
    best_p = {e: min(results[c]["predicted_epoch_s"] for c in cases if engines[c] == e) for e in names}
    best_m = {e: min(results[c]["measured_epoch_s"] for c in cases if engines[c] == e) for e in names}
    out = {
        "predicted_order": [cases[i] for i in np.argsort(pred_t, kind="stable")],
        "measured_order": [cases[i] for i in np.argsort(meas_t, kind="stable")],
        "pairwise_order_agreement": pairwise_agreement(pred_t, meas_t),
        "peak_within_25pct": int(sum(abs(results[c]["peak_error"]) <= 0.25 for c in cases)),
        "engine_predicted_order": sorted(names, key=best_p.get),
        "engine_measured_order": sorted(names, key=best_m.get),
    }
    out["order_matches"] = out["predicted_order"] == out["measured_order"]
    out["engine_order_matches"] = out["engine_predicted_order"] == out["engine_measured_order"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="HDF5 file with the figures")
    p.add_argument("--work", default=None, help="work directory (default: beside --out)")
    p.add_argument("--scale", type=float, default=0.04)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (the first is warm-up)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--arch", default="gcn", choices=("gcn", "sage"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fanouts", default="10,10", help="minibatch fanouts, input side first (one per layer)")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help="planner candidate labels, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="runs of every case, back to back; the fastest counts")
    p.add_argument("--reuse-calibration", action="store_true")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    from hpcgnn.plan.calibrate import load_or_measure
    from hpcgnn.plan.planner import make_plan
    from hpcgnn.plan.proposer import toml_value
    from hpcgnn.plan.topology import build_topology

    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / "plan-work"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    k = args.ranks
    _, stores = products_like_inputs(work, args.scale, args.seed, {k}, args.timeout, "benchmarks.plan")
    store = stores[k]
    cfg = work / f"plan-bench-{args.arch}{args.layers}x{args.hidden}.toml"
    cfg.write_text(CONFIG.format(hidden=args.hidden, epochs=args.epochs, arch=args.arch, layers=args.layers,
                                 fanouts=", ".join(str(int(x)) for x in args.fanouts.split(","))))
    cal = load_or_measure(work / "calibration.json", recalibrate=not args.reuse_calibration)
    topo = build_topology(k, None, None, "cpu", None)
    plan = make_plan(cfg, [], store, topo, cal, (4,), None)
    rows = {r.candidate.label: r for r in plan.rows}
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in rows or rows[c].pred is None:
            raise SystemExit(f"benchmarks.plan: case {c!r} is not a planned candidate "
                             f"({', '.join(rows)}) or has no prediction ({rows[c].reason if c in rows else ''})")
    results: dict = {}
    runs: dict = {c: [] for c in cases}
    for rnd in range(args.rounds):             # rounds back to back: the machine may be shared
        for c in cases:
            row = rows[c]
            tag = c.replace(" ", "-").replace("=", "")
            run = work / f"run-{args.arch}{args.layers}-{tag}-{k}-r{rnd}"
            cmd = rank_command(k, ["-m", "hpcgnn", "train", "--config", str(cfg),
                                   "--set", f"data.partitions={store}", "--set", f"output.dir={run}", "--force"])
            for key, v in row.candidate.overrides.items():
                cmd += ["--set", f"{key}={toml_value(v)}"]
            wall = run_checked(cmd, work / f"train-{args.arch}{args.layers}-{tag}-{k}-r{rnd}.log", args.timeout,
                              "benchmarks.plan")
            m = measured(run)
            m["wall_s"] = wall
            runs[c].append(m)
            print(f"{c:>24} round {rnd + 1}: {m['epoch_s']:.3f} s/epoch, {m['peak_rss_bytes'] / 2**30:.3f} GiB",
                  flush=True)
    for c in cases:
        pr, ms = rows[c].pred, runs[c]
        best = min(ms, key=lambda m: m["epoch_s"])
        peak = max(m["peak_rss_bytes"] for m in ms)
        results[c] = {"predicted_epoch_s": pr.epoch_s, "measured_epoch_s": best["epoch_s"],
                      "measured_epoch_s_rounds": [m["epoch_s"] for m in ms],
                      "predicted_peak_bytes": float(pr.host_peak), "measured_peak_bytes": peak,
                      "peak_error": pr.host_peak / peak - 1.0,
                      "predicted_bytes_per_epoch": pr.bytes_per_epoch, "measured_bytes_per_epoch": best["bytes_per_epoch"],
                      "predicted_parts_s": pr.parts, "memory_terms": {t: float(v) for t, v in pr.terms.items()},
                      "wall_s": float(sum(m["wall_s"] for m in ms))}
    summary = summarise(results, cases, {c: rows[c].candidate.engine for c in cases})
    from hpcgnn.partition.store import read_meta

    m = read_meta(store)
    meta = {"scale": args.scale, "seed": args.seed, "ranks": k, "host": platform.node(),
            "cores": usable_cpus(),
            "num_nodes": m.num_nodes, "num_edges": m.num_edges, "hidden": args.hidden, "epochs": args.epochs,
            "arch": args.arch, "layers": args.layers, "fanouts": args.fanouts, "rounds": args.rounds,
            "calibration": json.dumps(cal.to_json()), "load_average": json.dumps(os.getloadavg()),
            "total_wall_s": time.perf_counter() - t_start, "recommended": plan.best.candidate.label if plan.best else ""}
    write_results(out, results, {**meta, **summary}, "hpcgnn-bench-plan")
    print_table(results, summary, meta, cases)
    print(f"wrote {out}")
    return 0


def print_table(results: dict, summary: dict, meta: dict, cases: list) -> None:
    print(f"\nplan benchmark: products-like scale {meta['scale']:g} ({meta['num_nodes']:,} vertices, "
          f"{meta['num_edges']:,} directed edges), {meta['arch'].upper()} {meta['layers']} x {meta['hidden']} "
          f"(fanouts {meta['fanouts']}), {meta['ranks']} ranks on "
          f"{meta['cores']} cores, load average {meta['load_average']}")
    head = ["case", "pred GiB", "meas GiB", "error", "pred s", "meas s", "pred #", "meas #", "pred MiB", "meas MiB"]
    po, mo = summary["predicted_order"], summary["measured_order"]
    rows = [head]
    for c in cases:
        r = results[c]
        rows.append([c, f"{r['predicted_peak_bytes'] / 2**30:.3f}", f"{r['measured_peak_bytes'] / 2**30:.3f}",
                     f"{100 * r['peak_error']:+.1f}%", f"{r['predicted_epoch_s']:.3f}", f"{r['measured_epoch_s']:.3f}",
                     str(po.index(c) + 1), str(mo.index(c) + 1), f"{r['predicted_bytes_per_epoch'] / 2**20:.1f}",
                     f"{r['measured_bytes_per_epoch'] / 2**20:.1f}"])
    w = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  " + "  ".join(c.rjust(x) for c, x in zip(row, w)))
    print(f"  peak memory within +-25 %: {summary['peak_within_25pct']} of {len(cases)} cases; "
          f"ordering {'matches' if summary['order_matches'] else 'differs'} "
          f"(pairwise agreement {100 * summary['pairwise_order_agreement']:.0f} %)")
    print(f"  predicted order: {' < '.join(po)}")
    print(f"  measured order:  {' < '.join(mo)}")
    print(f"  engines by their best case: predicted {' < '.join(summary['engine_predicted_order'])}, "
          f"measured {' < '.join(summary['engine_measured_order'])} "
          f"({'match' if summary['engine_order_matches'] else 'differ'})")


if __name__ == "__main__":
    sys.exit(main())
