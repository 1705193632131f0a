"""The store section of ``make bench-minibatch`` (``python -m benchmarks.minibatch``):
host-only vs tiered stores (docs/store.md) at device budgets of 5 %, 20 % and 50 % of a rank's
features, on the same products-like graph and config as the rest of the benchmark.

Per run (``store-host``, ``store-<budget>``, and ``store-<budget>-sync`` with ``store.overlap =
false``): epoch time (slowest rank, mean over epochs after the first), bytes host -> device per
epoch (all ranks; on a CPU-only machine what would cross the link), the device-tier hit rate of
feature rows measured and as the placement solver predicted it (lookup-weighted over ranks), the
HEC's device hit rate, and the store wait share (time the training loop blocked on the store /
epoch, worst rank). Targets: |predicted - measured| <= 5 points; wait share <= 5 % with overlap.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.table import cell

TARGET_PREDICTION_POINTS = 5.0
TARGET_STORE_WAIT_SHARE = 0.05


def add_arguments(p) -> None:
    p.add_argument("--store-budgets", default="0.05,0.2,0.5",
                   help="store section: tiered budgets as fractions of a rank's features ('' = skip the section)")
    p.add_argument("--store-sync", default="0.2",
                   help="store section: budgets also run without overlap (store.overlap = false)")
    p.add_argument("--store-ranks", type=int, default=1, help="store section: ranks per run (1 or 2)")
    p.add_argument("--store-hotness", default="degree", choices=("degree", "presample"))


def summarise_store(run_dir: Path) -> dict:
    """The store figures of one run file (see the module docstring)."""
    from hpcgnn.run.runfile import read_run

    r = read_run(run_dir)
    t, c = r["timings"], r["counters"]
    e = t["epoch"].shape[0]
    sel = slice(1, None) if e > 1 else slice(0, None)
    epoch = t["epoch"][sel]

    def tot(name):
        return float(np.nansum(c[name][sel]))

    looks = tot("store_feature_lookups")
    pred = c["store_predicted_feature_hit_rate"][sel]
    hec_looks = tot("store_hec_lookups")
    return {
        "ranks": int(r["attrs"]["num_ranks"]), "store_mode": r["attrs"].get("store_mode"),
        "epoch_time_s": float(np.mean(np.max(epoch, axis=1))),
        "h2d_bytes_per_epoch": float(np.mean(np.sum(c["store_h2d_bytes"][sel], axis=1))),
        "feature_h2d_bytes_per_epoch": float(np.mean(np.sum(c["store_feature_h2d_bytes"][sel], axis=1))),
        "feature_hit_rate": tot("store_feature_device_hits") / looks if looks else float("nan"),
        "predicted_feature_hit_rate": float(np.nansum(pred * c["store_feature_lookups"][sel]) / looks)
        if looks else float("nan"),
        "hec_hit_rate": tot("store_hec_device_hits") / hec_looks if hec_looks else float("nan"),
        "store_wait_share": float(np.max(np.mean(t["store_wait"][sel] / epoch, axis=0))),
        "test_acc": float(r["metrics"]["test_acc"][-1]), "loss": float(r["metrics"]["loss"][-1]),
    }


def run_section(args, work: Path, stores: dict) -> tuple[dict, dict]:
    """Run the store section's trainings; (results by run name, summary figures)."""
    from benchmarks.launch import rank_command, run_checked

    if not args.store_budgets.strip():
        return {}, {}
    budgets = [b.strip() for b in args.store_budgets.split(",") if b.strip()]
    sync = {b.strip() for b in args.store_sync.split(",") if b.strip()}
    runs = [("store-host", "0", True)] + [(f"store-{b}", b, True) for b in budgets] + \
        [(f"store-{b}-sync", b, False) for b in budgets if b in sync]
    ranks = args.store_ranks
    results = {}
    for name, budget, overlap in runs:
        run_dir = work / f"run-{name}-{ranks}"
        cmd = rank_command(ranks, [
            "-m", "hpcgnn", "train", "--config", args.config,
            "--set", f"data.partitions={stores[ranks]}", "--set", f"output.dir={run_dir}",
            "--set", "minibatch.halo=hec", "--set", f"train.epochs={args.epochs}",
            "--set", f"train.eval_every={args.epochs}", "--set", f"train.seed={args.seed}",
            "--set", f"store.device_memory={budget}", "--set", f"store.overlap={str(overlap).lower()}",
            "--set", f"store.hotness={args.store_hotness}", "--force"])
        for s in args.set:
            cmd += ["--set", s]
        wall = run_checked(cmd, work / f"run-{name}-{ranks}.log", args.timeout, "benchmarks.minibatch")
        results[name] = summarise_store(run_dir)
        results[name].update(wall_s=wall, budget=float(budget), overlap=overlap)
        print(f"{name}: {results[name]['epoch_time_s']:.2f} s/epoch", flush=True)
    tiered = [r for n, r in results.items() if n != "store-host"]
    err = [abs(r["feature_hit_rate"] - r["predicted_feature_hit_rate"]) * 100 for r in tiered]
    waits = [r["store_wait_share"] for r in tiered if r["overlap"]]
    summary = {"store_ranks": ranks, "store_hotness": args.store_hotness,
               "store_prediction_error_points_max": max(err) if err else float("nan"),
               "store_wait_share_max_overlap": max(waits) if waits else float("nan"),
               "target_store_prediction_points": TARGET_PREDICTION_POINTS,
               "target_store_wait_share": TARGET_STORE_WAIT_SHARE}
    return results, summary


def table(results: dict, summary: dict) -> str:
    head = ["store run", "budget%", "overlap", "epoch_s", "MB_h2d/ep", "feat_MB/ep", "dev_hit%", "pred%",
            "hec_dev%", "wait%", "test%"]
    rows = [head]
    for name, r in results.items():
        rows.append([name, cell(100 * r["budget"], ".0f"), "yes" if r["overlap"] else "no",
                     cell(r["epoch_time_s"]), cell(r["h2d_bytes_per_epoch"] / 1e6, ".2f"),
                     cell(r["feature_h2d_bytes_per_epoch"] / 1e6, ".2f"), cell(100 * r["feature_hit_rate"], ".2f"),
                     cell(100 * r["predicted_feature_hit_rate"], ".2f"), cell(100 * r["hec_hit_rate"], ".1f"),
                     cell(100 * r["store_wait_share"], ".2f"), cell(100 * r["test_acc"], ".2f")])
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(x) for c, x in zip(r, w)) for r in rows]
    lines.append(f"store ({summary['store_ranks']} rank(s), hotness {summary['store_hotness']}): largest "
                 f"|predicted - measured| device hit rate {cell(summary['store_prediction_error_points_max'], '.2f')} "
                 f"points (target <= {TARGET_PREDICTION_POINTS:.0f}); store wait share with overlap "
                 f"<= {cell(100 * summary['store_wait_share_max_overlap'], '.2f')}% of the epoch "
                 f"(target <= {100 * TARGET_STORE_WAIT_SHARE:.0f}%)")
    return "\n".join(lines)
