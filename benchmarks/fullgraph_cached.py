"""Exact vs cached vs pipelined halo exchange (CaPGNN, docs/capgnn.md), measured on real runs.

Driver, under ``mpiexec -n K``::

    python -m benchmarks.fullgraph_cached --store STORE --work DIR [--config FILE]
        [--cases exact,S1,S2,S4,S2+pipe] [--seeds 0] [--epochs N] [--eval-every N] [--set key=value ...]

trains one full-graph run per (case, seed) in this one MPI job (``hpcgnn train``'s engine and
loop, run files ``DIR/<case>-seed<k>``; evaluation every ``--eval-every`` epochs and after the
last, default after the last only; evaluation is exact and its bytes are not counted) and
writes nothing else. :func:`summarise` reads those run files into the figures the full-graph benchmark
(:mod:`benchmarks.fullgraph`) prints and stores: epoch time (median over epochs 2.., slowest
rank), forward halo bytes per epoch (all ranks, epochs 2..; hidden layers and layer 0 apart),
adjoint bytes, time waiting for halo rows, final test accuracy, the largest age recorded.

Table, without MPI, from those run files (halo bytes of the cache against the exact exchange)::

    python -m benchmarks.fullgraph_cached --table --work DIR [--cases exact,S2+pipe,S4+pipe]
        [--seeds 0,1] [--out FILE.h5]

prints per case the steady-state forward halo bytes per epoch (all ranks, the mean over epochs
2..E: choose E - 1 a multiple of every S), the exact exchange's bytes over them (the smallest
per-layer ratio too), the adjoint bytes per epoch, the test accuracy (mean over the seeds and
its difference to ``exact``; the test accuracy at the epoch of the best validation accuracy
among the evaluated ones, the published protocol, so the final one with one evaluation; the
final one apart), the oldest row used, and writes them to HDF5
(:func:`benchmarks.results_file.write_results`, format ``hpcgnn-bench-halo-cache``).

A case name is ``exact`` or ``S<s>`` (``fullgraph.halo = "cached"``, ``staleness = s``), with
``+pipe`` for ``fullgraph.pipeline = true`` (``exact+pipe``: pipelined, nothing cached) and/or
``+bf16`` for ``fullgraph.halo_precision = "bf16"`` (hidden-layer rows sent as bfloat16), in
that order (``S2+pipe+bf16``).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

DEFAULT_CASES = "exact,S1,S2,S4,S2+pipe,exact+bf16,S2+bf16,S2+pipe+bf16"


def case_overrides(case: str) -> list[str]:
    """``--set`` overrides of a case name (ValueError for a bad one)."""
    m = re.fullmatch(r"(exact|S(\d+))(\+pipe)?(\+bf16)?", case)
    if not m:
        raise ValueError(f"bad case {case!r}: expected exact or S<s>, then optionally +pipe, then +bf16")
    sets = [f"fullgraph.pipeline={'true' if m.group(3) else 'false'}",
            f"fullgraph.halo_precision={'bf16' if m.group(4) else 'fp32'}"]
    if m.group(2) is not None:
        sets += ["fullgraph.halo=cached", f"fullgraph.staleness={int(m.group(2))}"]
    else:
        sets += ["fullgraph.halo=exact", "fullgraph.staleness=1"]
    return sets


def run_dir(work: Path, case: str, seed: int) -> Path:
    return Path(work) / f"{case.replace('+', '-')}-seed{seed}"


def steady_bytes(run_path: Path) -> dict:
    """Forward and adjoint halo bytes per training epoch of one run, all ranks, mean over epochs
    2..E (steady state: the cache is warm), and per layer for a cached run: ``fwd``,
    ``adjoint``, ``exact_fwd`` (``halo_fwd_nocache_bytes``; an exact run: its own ``fwd``),
    ``fwd_per_layer`` / ``exact_fwd_per_layer`` (cached runs, hidden layers' lists)."""
    from hpcgnn.run.runfile import read_run

    r = read_run(run_path)
    c = r["counters"]
    n = c["halo_fwd_bytes"].shape[0]
    every = slice(min(1, n - 1), n)
    out = {"fwd": float(c["halo_fwd_bytes"][every].sum(axis=1).mean()),
           "adjoint": float(c["halo_adjoint_bytes"][every].sum(axis=1).mean())}
    pl = r["per_layer"]
    if "halo_fwd_nocache_bytes" in pl:
        out["exact_fwd"] = float(c["halo_fwd_nocache_bytes"][every].sum(axis=1).mean())
        out["fwd_per_layer"] = pl["halo_fwd_bytes"][every].sum(axis=1).mean(axis=0).tolist()
        out["exact_fwd_per_layer"] = pl["halo_fwd_nocache_bytes"][every].sum(axis=1).mean(axis=0).tolist()
        out["age_max"] = int(np.nanmax(pl["halo_age_max"]))
    else:
        out["exact_fwd"], out["age_max"] = out["fwd"], 0
    m = r["metrics"]
    val = np.where(np.isfinite(m["val_acc"]), m["val_acc"], -np.inf)
    best = int(np.argmax(val))                 # the first epoch of the best validation accuracy
    out["test_acc"] = float(m["test_acc"][best])
    out["best_val_epoch"] = best + 1
    out["final_test_acc"] = float(m["test_acc"][-1])
    out["epochs"] = int(n)
    return out


def table(work: Path, cases: list[str], seeds: list[int]) -> dict:
    """Per case the mean over ``seeds`` of :func:`steady_bytes` of its runs under ``work`` (``test_acc``:
at the best validation epoch; ``final_test_acc``: after the last epoch), with
    ``reduction`` (exact's forward bytes / the case's), ``layer_reduction_min`` (the smallest
    over hidden layers with exact bytes) and ``test_acc_delta`` (against ``exact``, points)."""
    rows = {}
    for case in cases:
        runs = [steady_bytes(run_dir(work, case, s)) for s in seeds]
        row = {k: float(np.mean([x[k] for x in runs]))
               for k in ("fwd", "adjoint", "exact_fwd", "test_acc", "final_test_acc")}
        row["test_acc_seeds"] = [x["test_acc"] for x in runs]
        row["best_val_epochs"] = [x["best_val_epoch"] for x in runs]
        row["age_max"] = max(x["age_max"] for x in runs)
        row["epochs"] = runs[0]["epochs"]
        row["reduction"] = row["exact_fwd"] / row["fwd"] if row["fwd"] else float("inf")
        if "fwd_per_layer" in runs[0]:
            f = np.mean([x["fwd_per_layer"] for x in runs], axis=0)
            e = np.mean([x["exact_fwd_per_layer"] for x in runs], axis=0)
            ratios = [e[l] / f[l] if f[l] else float("inf") for l in range(len(e)) if e[l] > 0]
            row["layer_reduction_min"] = float(min(ratios)) if ratios else float("nan")
        else:
            row["layer_reduction_min"] = 1.0
        rows[case] = row
    if "exact" in rows:
        for row in rows.values():
            row["test_acc_delta"] = 100 * (row["test_acc"] - rows["exact"]["test_acc"])
    return rows


def print_table(rows: dict, title: str = "") -> None:
    from benchmarks.table import cell

    if title:
        print(title)
    head = ["case", "fwd kB/epoch", "exact fwd kB", "x fewer", "min layer x", "adjoint kB/epoch",
            "test acc % (best val)", "d acc pts", "final test %", "max age"]
    lines = [head]
    for case, r in rows.items():
        lines.append([case, cell(r["fwd"] / 1e3, ".1f"), cell(r["exact_fwd"] / 1e3, ".1f"),
                      cell(r["reduction"], ".2f"), cell(r["layer_reduction_min"], ".2f"),
                      cell(r["adjoint"] / 1e3, ".1f"), cell(100 * r["test_acc"], ".2f"),
                      cell(r.get("test_acc_delta"), "+.2f"), cell(100 * r["final_test_acc"], ".2f"),
                      str(r["age_max"])])
    w = [max(len(x[i]) for x in lines) for i in range(len(head))]
    for x in lines:
        print("  ".join(c.rjust(n) if i else c.ljust(n) for i, (c, n) in enumerate(zip(x, w))))


def table_main(args) -> int:
    from benchmarks.results_file import write_results

    rows = table(Path(args.work), args.cases.split(","), [int(s) for s in args.seeds.split(",")])
    print_table(rows, f"halo bytes per training epoch, all ranks (epochs 2..E), {args.work}")
    if args.out:
        write_results(args.out, rows, {"work": str(args.work), "seeds": args.seeds}, "hpcgnn-bench-halo-cache")
    return 0


def driver(argv: list[str] | None = None) -> int:
    """Collective (under mpiexec): the runs of every case and seed, one after the other;
    ``--table``: the table of finished runs instead (no MPI)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.fullgraph_cached")
    p.add_argument("--table", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--store", default=None)
    p.add_argument("--work", required=True)
    p.add_argument("--config", default=None)
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--seeds", default="0")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N epochs (0: after the last only)")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(argv)
    if args.table:
        return table_main(args)
    if not args.store:
        p.error("--store is required (or --table)")
    from hpcgnn.engine.loop import fit
    from hpcgnn.run.engines.registry import engine_spec, resolve
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config
    from hpcgnn.run.output import RunOutput
    from hpcgnn.runtime import Runtime

    rt = Runtime.start()
    meta = read_meta(args.store)
    for case in args.cases.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            sets = ["train.engine=fullgraph", f"data.partitions={args.store}", f"train.eval_every={args.eval_every}",
                    "train.checkpoint_every=0", f"train.seed={seed}",
                    f"output.dir={run_dir(Path(args.work), case, seed)}", *args.set, *case_overrides(case)]
            if args.epochs:
                sets.append(f"train.epochs={args.epochs}")
            cfg = load_config(args.config, sets)
            out = RunOutput(cfg.output.dir, rt, cfg, meta, resume=False, force=True)
            engine = resolve(engine_spec("fullgraph").factory)(cfg, rt, out, None)
            fit(engine, cfg, rt, out, None)
            out.close()
    rt.finish()
    return 0


def summarise(run_path: Path) -> dict:
    """The figures of one finished run (see the module text)."""
    from hpcgnn.run.runfile import read_run

    r = read_run(run_path)
    t, c, pl, m = r["timings"], r["counters"], r["per_layer"], r["metrics"]
    n = t["epoch"].shape[0]
    steady = slice(1, n - 1) if n > 2 else slice(min(1, n - 1), n)  # epochs 2.. but the evaluated last
    every = slice(min(1, n - 1), n)     # cache bytes: epochs 2.. (evaluation's exact exchanges not counted)
    out = {"epoch_s": float(np.median(np.nanmax(t["epoch"][steady], axis=1))),
           "test_acc": float(m["test_acc"][-1]), "val_acc": float(m["val_acc"][-1]),
           "epochs": int(t["epoch"].shape[0])}
    if "halo_fwd_bytes" in pl:
        fwd = pl["halo_fwd_bytes"][every]                  # [E, P, L]
        out["fwd_bytes_per_epoch"] = float(fwd.sum(axis=(1, 2)).mean())
        out["fwd_hidden_bytes_per_epoch"] = float(fwd[:, :, 1:].sum(axis=(1, 2)).mean())
        out["fwd_layer0_bytes_per_epoch"] = float(fwd[:, :, 0].sum(axis=1).mean())
        out["nocache_bytes_per_epoch"] = float(pl["halo_fwd_nocache_bytes"][every].sum(axis=(1, 2)).mean())
        out["adjoint_bytes_per_epoch"] = float(c["halo_adjoint_bytes"][every].sum(axis=1).mean())
        # blocked in halo communication: forward waits + the (blocking, exact) adjoint
        out["wait_s_per_epoch"] = float(np.nanmean((t["halo_wait"] + t["halo_adjoint"])[steady].max(axis=1)))
        out["age_max"] = int(np.nanmax(pl["halo_age_max"]))
        out["age_over_bound"] = int(np.nansum(pl["halo_age_over_bound"]))
        used = pl["halo_rows_used"][every].sum()
        out["hit_rate_device"] = float(pl["halo_hits_device"][every].sum() / used) if used else 0.0
        out["hit_rate_host"] = float(pl["halo_hits_host"][every].sum() / used) if used else 0.0
    else:   # exact: forward bytes = every hidden layer's uncached exchange (layer 0 once, at start-up)
        out["fwd_bytes_per_epoch"] = float(c["halo_fwd_bytes"][every].sum(axis=1).mean())
        out["fwd_hidden_bytes_per_epoch"] = out["fwd_bytes_per_epoch"]
        out["fwd_layer0_bytes_per_epoch"] = 0.0
        out["adjoint_bytes_per_epoch"] = float(c["halo_adjoint_bytes"][every].sum(axis=1).mean())
        out["wait_s_per_epoch"] = float(np.nanmean(t["halo"][steady].max(axis=1)))   # blocking exchanges
        out["age_max"] = 0
        out["age_over_bound"] = 0
    return out


if __name__ == "__main__":
    sys.exit(driver())
