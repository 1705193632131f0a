"""`hpcgnn report RUN [--json]`: summarise a run directory (its ``run.h5``).

The table has one row per logged epoch: loss, accuracies (%), epoch time (slowest rank), the
mean over ranks of each timed phase (the nesting is the run file's,
:func:`~hpcgnn.run.runfile.timing_parents`): the top-level phases (parts of ``epoch``), ``sum``
(their per-rank sum, at most the rank's epoch time), the roots outside the epoch (``eval``), then
``(name)`` for every phase nested in another, which no sum includes; bytes sent (sum over
ranks), for HEC runs the hit rate of every layer's cache (hits / lookups over all ranks), and the largest per-rank peak resident
memory of the epoch with the rank and phase where it happened; below it, each rank's peak. ``--json`` prints the same as one
JSON object (NaN as null).

``--plot FILE.png`` also draws the run into an image (panels in :mod:`hpcgnn.run.plot`), written
atomically; ``--compare RUN2 ...`` overlays further runs' loss and accuracy curves in it.
``--csv FILE`` writes one row per epoch, ``--tensorboard DIR`` the same figures as TensorBoard
scalars (:mod:`hpcgnn.run.export`).
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError

EXAMPLES = """examples:
  hpcgnn report runs/demo
  hpcgnn report runs/demo --json
  hpcgnn report runs/demo --plot demo.png --compare runs/other
  hpcgnn report runs/demo --csv demo.csv --tensorboard tb/demo    # then: tensorboard --logdir tb
(docs/reports.md)
"""


def add_arguments(parser) -> None:
    parser.add_argument("run", metavar="RUN", help="run directory (or its run.h5)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw the run's curves and breakdowns into FILE (.png, .pdf or .svg): "
                             "loss, accuracy, per-rank phase times, bytes by kind, HEC hit rate or "
                             "offload transfers, peak memory (hpcgnn/run/plot.py)")
    parser.add_argument("--compare", nargs="+", default=[], metavar="RUN2",
                        help="with --plot: overlay these runs' loss and accuracy curves on RUN's")
    parser.add_argument("--csv", metavar="FILE",
                        help="also write one row per epoch to FILE: loss, accuracies, epoch and phase "
                             "times, counters (bytes), peak memory")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="also write the same per-epoch figures as TensorBoard scalars into DIR "
                             "(view with: tensorboard --logdir DIR)")


def _over_ranks(fn, values) -> float | None:
    """``fn`` (np.nanmax, np.nanmean) of one epoch's per-rank values; None when none was recorded
    (an epoch without that phase, e.g. no evaluation) instead of numpy's empty-slice warning."""
    v = np.asarray(values, dtype=float)
    return _clean(float(fn(v))) if np.isfinite(v).any() else None


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (np.floating,)):
        return _clean(float(x))
    if isinstance(x, np.integer):
        return int(x)
    return x


def summarise(run: dict) -> dict:
    """The report as a plain dict (used by both outputs). Per epoch ``phases_mean_s`` (every
    timing but ``epoch``, mean over ranks) and ``top_level_s`` (per rank: the sum of the
    top-level phases, those with parent ``epoch``; None for a rank without any); the run's
    ``timing_parents``."""
    from hpcgnn.run.config import canonical_names
    from hpcgnn.run.runfile import timing_parents

    a = run["attrs"]
    parents = timing_parents(run)
    top = [k for k, parent in parents.items() if parent == "epoch"]
    try:
        config = canonical_names(json.loads(a.get("config", "{}")))
    except (json.JSONDecodeError, AttributeError):
        config = {}
    m, t, c, pl = run["metrics"], run["timings"], run["counters"], run["per_layer"]
    epochs = [int(e) for e in m.get("epoch", [])]
    rows = []
    for i, e in enumerate(epochs):
        row = {"epoch": e}
        for k, v in m.items():
            if k != "epoch":
                row[k] = _clean(float(v[i]))
        if "epoch" in t:
            row["time_s"] = _over_ranks(np.nanmax, t["epoch"][i])
        row["phases_mean_s"] = {k: _over_ranks(np.nanmean, t[k][i]) for k in parents if k != "epoch"}
        if top:
            parts = np.array([t[k][i] for k in top], dtype=float)           # [phases, ranks]
            row["top_level_s"] = [_clean(float(np.nansum(col))) if np.isfinite(col).any() else None
                                  for col in parts.T]
        if "bytes_sent" in c:
            row["bytes_sent"] = _clean(float(np.nansum(c["bytes_sent"][i])))
        if "hec_hits" in pl and "hec_lookups" in pl:
            hits = np.nansum(pl["hec_hits"][i], axis=0)
            looks = np.nansum(pl["hec_lookups"][i], axis=0)
            row["hec_hit_rate"] = [_clean(float(h / l)) if l else None for h, l in zip(hits, looks)]
        if "halo_age_max" in pl:      # full-graph halo cache / pipeline (docs/capgnn.md)
            row["halo_cache"] = _halo_cache_row(pl, i)
        if "store_h2d_bytes" in c:
            row["store"] = _store_row(c, i)
        if "peak_rss_bytes" in c and np.isfinite(c["peak_rss_bytes"][i]).any():
            per_rank = c["peak_rss_bytes"][i]
            r = int(np.nanargmax(per_rank))
            phase = run.get("labels", {}).get("peak_rss_phase")
            row["peak_rss_bytes"] = _clean(float(per_rank[r]))
            row["peak_rss_rank"] = r
            row["peak_rss_phase"] = None if phase is None else str(phase[i, r])
            row["peak_rss_sum_bytes"] = _clean(float(np.nansum(per_rank)))
        rows.append(row)
    val = [(r.get("val_acc"), r) for r in rows if r.get("val_acc") is not None]
    best = max(val, key=lambda x: x[0])[1] if val else None
    evaluated = [r for r in rows if r.get("test_acc") is not None]
    times = [r["time_s"] for r in rows if r.get("time_s") is not None]
    return {
        "path": run["path"], "status": a.get("status"), "stopped_by": a.get("stopped_by"),
        "engine": a.get("engine"),
        "num_ranks": _clean(a.get("num_ranks")), "partition_hash": a.get("partition_hash"),
        "partition_dir": a.get("partition_dir"), "created": a.get("created"),
        "halo_mode": a.get("halo_mode"), "eval_method": a.get("eval_method"),
        "hpcgnn_version": a.get("hpcgnn_version"), "config": config, "timing_parents": parents,
        "epochs": rows,
        "best_val": None if best is None else {"epoch": best["epoch"], "val_acc": best["val_acc"],
                                                "test_acc": best.get("test_acc")},
        "final": None if not evaluated else {"epoch": evaluated[-1]["epoch"],
                                             "val_acc": evaluated[-1].get("val_acc"),
                                             "test_acc": evaluated[-1].get("test_acc")},
        "mean_epoch_time_s": float(np.mean(times)) if times else None,
        "memory_per_rank": _memory_per_rank(run),
        "memory_estimates": _memory_estimates(run),
        "comm_backend": _label_values(run, "comm_backend"),
        "mpi_library": _label_values(run, "mpi_library"),
    }


def _label_values(run: dict, name: str) -> str | None:
    """The distinct values of ``labels/<name>`` over epochs and ranks, ", "-joined (None when the
    file has none: written before the label, or nothing recorded it)."""
    values = run.get("labels", {}).get(name)
    if values is None:
        return None
    seen = list(dict.fromkeys(str(v) for v in np.asarray(values).reshape(-1) if str(v)))
    return ", ".join(seen) or None


def _store_row(c: dict, i: int) -> dict:
    """One epoch's store counters over all ranks: bytes host -> device, device hit rate per data
    type (rows served by the device tier / rows looked up), the predicted feature hit rate."""
    out = {"h2d_bytes": _clean(float(np.nansum(c["store_h2d_bytes"][i])))}
    for kind in ("feature", "hec"):
        looks = float(np.nansum(c.get(f"store_{kind}_lookups", np.zeros_like(c["store_h2d_bytes"]))[i]))
        hits = float(np.nansum(c.get(f"store_{kind}_device_hits", np.zeros_like(c["store_h2d_bytes"]))[i]))
        out[f"{kind}_hit_rate"] = hits / looks if looks else None
    looks_f = c.get("store_feature_lookups")
    pred = c.get("store_predicted_feature_hit_rate")
    if pred is not None and looks_f is not None and np.nansum(looks_f[i]) > 0:   # lookup-weighted over ranks
        out["predicted_feature_hit_rate"] = _clean(float(np.nansum(pred[i] * looks_f[i]) / np.nansum(looks_f[i])))
    return out


def _halo_cache_row(pl: dict, i: int) -> dict:
    """Epoch ``i``'s halo-cache figures: per layer the largest age used, the age histogram and
    the share of rows read from the cache (all ranks); forward bytes with and without it."""
    used = np.nansum(pl["halo_rows_used"][i], axis=0)
    hits = np.nansum(pl["halo_hits_device"][i], axis=0) + np.nansum(pl["halo_hits_host"][i], axis=0)
    ages = sorted((int(k.rsplit("_", 1)[1]), k) for k in pl if re.fullmatch(r"halo_age_\d+", k))
    return {"age_max": [int(a) for a in np.nanmax(pl["halo_age_max"][i], axis=0)],
            "age_hist": [[_clean(float(np.nansum(pl[k][i][:, l]))) for _, k in ages]
                         for l in range(used.shape[0])],
            "over_bound": _clean(float(np.nansum(pl["halo_age_over_bound"][i]))),
            "hit_rate": [_clean(float(h / u)) if u else None for h, u in zip(hits, used)],
            "fwd_bytes": _clean(float(np.nansum(pl["halo_fwd_bytes"][i]))),
            "nocache_bytes": _clean(float(np.nansum(pl["halo_fwd_nocache_bytes"][i])))}


def _memory_per_rank(run: dict) -> list[dict]:
    """Per rank: the largest epoch peak RSS over the run, the epoch and phase where it happened,
    and (runs that record them) the process's peak, set-up included, and the device's: the
    largest epoch peak and the peak with set-up (None where not recorded)."""
    c = run["counters"].get("peak_rss_bytes")
    if c is None or c.size == 0:
        return []
    proc = run["counters"].get("peak_process_rss_bytes")
    dev, dev_proc = run["counters"].get("peak_device_bytes"), run["counters"].get("peak_process_device_bytes")

    def largest(counter, r):
        return None if counter is None or not np.isfinite(counter[:, r]).any() else \
            _clean(float(np.nanmax(counter[:, r])))

    phases = run.get("labels", {}).get("peak_rss_phase")
    epochs = run["metrics"].get("epoch", np.arange(1, c.shape[0] + 1))
    out = []
    for r in range(c.shape[1]):
        col = c[:, r]
        if not np.isfinite(col).any():
            continue
        i = int(np.nanargmax(col))
        out.append({"rank": r, "peak_rss_bytes": _clean(float(col[i])), "epoch": int(epochs[i]),
                    "phase": None if phases is None else str(phases[i, r]),
                    "process_peak_rss_bytes": largest(proc, r),
                    "peak_device_bytes": largest(dev, r), "process_peak_device_bytes": largest(dev_proc, r)})
    return out


def _memory_estimates(run: dict) -> dict:
    """The pre-run estimates the run recorded (``estimated_peak_rss_bytes`` /
    ``estimated_peak_device_bytes``, per rank) beside the measured peaks (the largest epoch's
    ``counters/peak_rss_bytes`` / ``peak_device_bytes``): {"host"|"device": [{rank, estimated,
    measured, ratio}]} (:func:`hpcgnn.run.memory.estimate_against_peak`); a kind without an
    estimate or a measurement is left out."""
    from hpcgnn.run.memory import estimate_against_peak

    out = {}
    for kind, est_key, counter in (("host", "estimated_peak_rss_bytes", "peak_rss_bytes"),
                                   ("device", "estimated_peak_device_bytes", "peak_device_bytes")):
        rows = estimate_against_peak(run["attrs"].get(est_key), run["counters"].get(counter))
        if rows:
            out[kind] = [{k: _clean(v) for k, v in row.items()} for row in rows]
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def format_table(s: dict) -> str:
    cfg = s["config"]
    model, train, mb = cfg.get("model", {}), cfg.get("train", {}), cfg.get("minibatch", {})
    lines = [f"run        {s['path']}  ({s['status']}, hpcgnn {s['hpcgnn_version']}, {s['created']})",
             f"engine     {s['engine']} on {s['num_ranks']} ranks; partitions {s['partition_dir']} "
             f"({str(s['partition_hash'])[:12]})",
             f"model      {model.get('arch')} layers {model.get('layers')} hidden {model.get('hidden')} "
             f"dropout {model.get('dropout')}; lr {train.get('lr')} wd {train.get('weight_decay')} "
             f"seed {train.get('seed')}"]
    if s.get("comm_backend") or s.get("mpi_library"):
        lines.insert(2, f"comm       data plane {s.get('comm_backend') or '-'}; MPI {s.get('mpi_library') or '-'}")
    if s.get("status") == "stopped":
        last = s["epochs"][-1]["epoch"] if s["epochs"] else 0
        lines.insert(1, f"stopped    after epoch {last} of {train.get('epochs')} by {s.get('stopped_by')}; "
                        "its checkpoint is written: hpcgnn train ... --resume continues the run")
    if s["engine"] == "minibatch":
        lines.append(f"minibatch  batch {mb.get('batch_size')} fanouts {mb.get('fanouts')} halo "
                     f"{mb.get('halo')} (push_delay {mb.get('push_delay')}, push_limit {mb.get('push_limit')}, "
                     f"cache_lines {mb.get('cache_lines')}, cache_lifespan {mb.get('cache_lifespan')}); "
                     f"eval {mb.get('eval')}")
    rows = s["epochs"]
    parents = s["timing_parents"]
    timed = [p for p in parents if p != "epoch" and any(r["phases_mean_s"].get(p) is not None for r in rows)]
    top = [p for p in timed if parents[p] == "epoch"]
    roots = [p for p in timed if parents[p] == ""]
    nested = [p for p in timed if parents[p] not in ("", "epoch")]
    phases = top + roots + nested
    layers = max((len(r.get("hec_hit_rate") or []) for r in rows), default=0)
    head = ["epoch", "loss", "train%", "val%", "test%", "time_s"] + top + (["sum"] if top else []) + roots + \
        [f"({p})" for p in nested] + \
        (["MB_sent"] if any("bytes_sent" in r for r in rows) else []) + [f"hit_L{l}%" for l in range(layers)] + \
        (["h2d_MB", "dev_feat%", "pred%", "dev_hec%"] if any("store" in r for r in rows) else []) + \
        (["peak_GiB", "peak_at"] if any("peak_rss_bytes" in r for r in rows) else [])
    hc_layers = max((len(r["halo_cache"]["age_max"]) for r in rows if "halo_cache" in r), default=0)
    if hc_layers:
        head += ["fwd_MB", "nocache_MB"] + [f"age_L{l}" for l in range(hc_layers)] + \
            [f"chit_L{l}%" for l in range(hc_layers)]
    table = [head]
    for r in rows:
        cells = [str(r["epoch"]), "-" if r.get("loss") is None else f"{r['loss']:.4f}",
                 _pct(r.get("train_acc")), _pct(r.get("val_acc")), _pct(r.get("test_acc")),
                 "-" if r.get("time_s") is None else f"{r['time_s']:.3f}"]
        cells += ["-" if r["phases_mean_s"].get(p) is None else f"{r['phases_mean_s'][p]:.3f}" for p in top]
        if top:
            sums = [x for x in r.get("top_level_s") or [] if x is not None]
            cells.append(f"{np.mean(sums):.3f}" if sums else "-")
        cells += ["-" if r["phases_mean_s"].get(p) is None else f"{r['phases_mean_s'][p]:.3f}"
                  for p in roots + nested]
        if "MB_sent" in head:
            cells.append("-" if r.get("bytes_sent") is None else f"{r['bytes_sent'] / 1e6:.2f}")
        hits = r.get("hec_hit_rate") or []
        cells += [_pct(hits[l]) if l < len(hits) else "-" for l in range(layers)]
        if "h2d_MB" in head:
            st = r.get("store") or {}
            cells += ["-" if st.get("h2d_bytes") is None else f"{st['h2d_bytes'] / 1e6:.2f}",
                      _pct(st.get("feature_hit_rate")), _pct(st.get("predicted_feature_hit_rate")),
                      _pct(st.get("hec_hit_rate"))]
        if "peak_GiB" in head:
            if r.get("peak_rss_bytes") is None:
                cells += ["-", "-"]
            else:
                cells += [f"{r['peak_rss_bytes'] / 2**30:.2f}", f"r{r['peak_rss_rank']}:{r['peak_rss_phase']}"]
        if hc_layers:
            hc = r.get("halo_cache")
            if hc is None:
                cells += ["-"] * (2 + 2 * hc_layers)
            else:
                cells += [f"{hc['fwd_bytes'] / 1e6:.2f}", f"{hc['nocache_bytes'] / 1e6:.2f}"]
                cells += [str(a) for a in hc["age_max"]] + [_pct(h) for h in hc["hit_rate"]]
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines.append("")
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.append("")
    if s["best_val"]:
        b = s["best_val"]
        lines.append(f"best val   {_pct(b['val_acc'])}% at epoch {b['epoch']} (test {_pct(b['test_acc'])}%)")
    if s["final"]:
        f = s["final"]
        lines.append(f"final      epoch {f['epoch']}: val {_pct(f['val_acc'])}%, test {_pct(f['test_acc'])}%")
    if s["mean_epoch_time_s"] is not None:
        lines.append(f"epoch time {s['mean_epoch_time_s']:.3f} s (mean over epochs, slowest rank)")
    if s["memory_per_rank"]:
        mem = s["memory_per_rank"]
        lines.append("peak RSS   " + ", ".join(
            f"rank {m['rank']} {m['peak_rss_bytes'] / 2**30:.2f} GiB (epoch {m['epoch']}, {m['phase']})"
            for m in mem) + f"; sum {sum(m['peak_rss_bytes'] for m in mem) / 2**30:.2f} GiB")
        if all(m.get("process_peak_rss_bytes") is not None for m in mem):
            lines.append("process    peak RSS with set-up: " + ", ".join(
                f"rank {m['rank']} {m['process_peak_rss_bytes'] / 2**30:.2f} GiB" for m in mem))
        if all(m.get("peak_device_bytes") and m.get("process_peak_device_bytes") is not None for m in mem):
            lines.append("device     peak of an epoch / with set-up: " + ", ".join(
                f"rank {m['rank']} {m['peak_device_bytes'] / 2**30:.2f} / "
                f"{m['process_peak_device_bytes'] / 2**30:.2f} GiB" for m in mem))
    for kind, per_rank in s.get("memory_estimates", {}).items():
        lines.append(f"estimate   {kind} peak estimated before the run / measured: " + ", ".join(
            f"rank {m['rank']} {m['estimated'] / 2**30:.2f} / {m['measured'] / 2**30:.2f} GiB"
            + ("" if m["ratio"] is None else f" ({m['ratio']:.2f}x)") for m in per_rank))
    if phases:
        line = "phases: mean over ranks in seconds"
        if top:
            line += "; sum: the top-level phases (parts of the epoch, at most its time)"
        if nested:
            within: dict[str, list[str]] = {}
            for p in nested:
                within.setdefault(parents[p], []).append(p)
            line += "; (x): part of another phase, in no sum: " + "; ".join(
                f"{', '.join(names)} in {parent}" for parent, names in within.items())
        lines.append(line)
    if any("store" in r for r in rows):
        lines.append("store: h2d_MB bytes host->device (all ranks; on a CPU what would cross the link); "
                     "dev_feat% / dev_hec%: rows served by the device tier; pred%: the solver's prediction")
    if any("peak_rss_bytes" in r for r in rows):
        lines.append("peak_GiB: largest per-rank peak resident memory of the epoch; peak_at: rank:phase")
    if hc_layers:
        hist = np.zeros((hc_layers, max(len(h) for r in rows if "halo_cache" in r
                                        for h in r["halo_cache"]["age_hist"])))
        for r in rows:
            for l, h in enumerate(r.get("halo_cache", {}).get("age_hist", [])):
                hist[l, :len(h)] += np.nan_to_num(np.asarray(h, dtype=float))
        fg = cfg.get("fullgraph", {})
        lines.append(f"halo cache: fullgraph.halo {fg.get('halo')} staleness {fg.get('staleness')} pipeline "
                     f"{fg.get('pipeline')} precision {fg.get('halo_precision', 'fp32')}; ages of the halo rows used, all epochs and ranks: " + "; ".join(
                         f"L{l} " + " ".join(f"{a}:{100 * c / max(hist[l].sum(), 1):.1f}%"
                                             for a, c in enumerate(hist[l]) if c)
                         for l in range(hc_layers) if hist[l].sum()))
        lines.append("fwd_MB / nocache_MB: forward halo bytes sent by training (all ranks) with the cache / "
                     "without it; age_L: oldest halo row used (epochs); chit_L%: rows read from the cache")
    return "\n".join(lines)


def load_run(path: str | Path) -> dict:
    """:func:`~hpcgnn.run.runfile.read_run` of a run directory (or its run file), with one-line
    errors for a missing path and a directory that holds no run."""
    from hpcgnn.run.runfile import RUN_FILE, read_run

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: run directory not found")
    if path.is_dir() and not (path / RUN_FILE).exists():
        raise InputError(f"{path}: no {RUN_FILE} in this directory (not a run directory)")
    return read_run(path)


def run(args) -> int:
    if args.compare and not args.plot:
        raise InputError("--compare needs --plot FILE.png (it overlays the runs' curves in the figure)")
    if args.plot:
        from hpcgnn.run.plot import check_plot_path

        check_plot_path(args.plot)            # refuse before reading or drawing anything
    data = load_run(args.run)
    others = [load_run(p) for p in args.compare]
    fig = None
    if args.plot:
        from hpcgnn.run.plot import build_figure

        fig = build_figure([data, *others])
    s = summarise(data)
    if args.json:
        print(json.dumps(s, indent=1, default=_clean))
    else:
        print(format_table(s))
    said = sys.stderr if args.json else sys.stdout
    if getattr(args, "csv", None):
        from hpcgnn.run.export import write_csv

        print(f"wrote {write_csv(data, args.csv)}: {len(s['epochs'])} epoch row(s)", file=said, flush=True)
    if getattr(args, "tensorboard", None):
        from hpcgnn.run.export import write_tensorboard

        print(f"wrote {write_tensorboard(data, args.tensorboard)}: TensorBoard scalars of "
              f"{len(s['epochs'])} epoch(s)", file=said, flush=True)
    if fig is not None:
        from hpcgnn.run.plot import save_figure

        path = save_figure(fig, args.plot)
        panels = ", ".join(ax.get_gid() for ax in fig.axes if ax.get_gid())
        print(f"wrote {path}: {panels}", file=sys.stderr if args.json else sys.stdout, flush=True)
    return 0
