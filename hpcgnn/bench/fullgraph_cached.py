"""Exact vs cached vs pipelined halo exchange (CaPGNN, docs/capgnn.md), measured on real runs.

Driver, under ``mpiexec -n K``::

    python -m hpcgnn.bench.fullgraph_cached --store STORE --work DIR [--config FILE]
        [--cases exact,S1,S2,S4,S2+pipe] [--seeds 0] [--epochs N] [--set key=value ...]

trains one full-graph run per (case, seed) in this one MPI job (``hpcgnn train``'s engine and
loop, run files ``DIR/<case>-seed<k>``; evaluation after the last epoch only) and writes nothing
else. :func:`summarise` reads those run files into the figures the full-graph benchmark
(:mod:`hpcgnn.bench.fullgraph`) prints and stores: epoch time (median over epochs 2.., slowest
rank), forward halo bytes per epoch (all ranks, epochs 2..; hidden layers and layer 0 apart),
adjoint bytes, time waiting for halo rows, final test accuracy, the largest age recorded.

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


def driver(argv: list[str] | None = None) -> int:
    """Collective (under mpiexec): the runs of every case and seed, one after the other."""
    p = argparse.ArgumentParser(prog="python -m hpcgnn.bench.fullgraph_cached")
    p.add_argument("--store", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--config", default=None)
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--seeds", default="0")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(argv)
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
            sets = ["train.engine=fullgraph", f"data.partitions={args.store}", "train.eval_every=0",
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
    from hpcgnn.run.output import read_run

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
        out["adjoint_bytes_per_epoch"] = float(c["halo_bytes"][steady].sum(axis=1).mean()) - out["fwd_bytes_per_epoch"]
        out["wait_s_per_epoch"] = float(np.nanmean(t["halo"][steady].max(axis=1)))   # blocking exchanges
        out["age_max"] = 0
        out["age_over_bound"] = 0
    return out


if __name__ == "__main__":
    sys.exit(driver())
