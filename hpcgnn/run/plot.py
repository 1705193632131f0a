"""Figures of run files: `hpcgnn report RUN --plot FILE.png [--compare RUN2 ...]`.

:func:`build_figure` draws one matplotlib Figure on the non-interactive Agg canvas (pyplot is
never imported and matplotlib's global backend is left alone, so no display is needed and a
caller's own plotting is not disturbed) from runs read with :func:`hpcgnn.run.runfile.read_run`;
:func:`save_figure` writes it atomically. matplotlib is imported only when a figure is built.

Panels, each drawn only when the run has its data:

============ =================================================================================
``loss``     training loss per epoch; with ``--compare`` one line per run
``accuracy`` train / val / test accuracy (%) at the evaluated epochs; per run with ``--compare``
``phases``   seconds per epoch of every rank, one bar per rank in each epoch's group, stacked
             by top-level phase (parent ``epoch`` in
             :func:`~hpcgnn.run.runfile.timing_parents`; ``other`` is the rest of the epoch
             time, the other roots such as ``eval`` on top); timings nested in others (``cache``
             in ``forward``, ``halo`` in ``forward+backward+eval`` ...) are named under the
             axis, never stacked; a straggler is the tallest bar of its group
``bytes``    bytes per epoch by kind, summed over ranks: every counter with ``bytes`` in its name
             except memory peaks (offload transfers as their h2d/d2h totals); kinds with
             identical series share one line
``layers``   minibatch: HEC hit rate per layer (hits / lookups over all ranks); offloaded
             full-graph: host-device transfers per rank by kind (mean per epoch), with the
             host-to-device volume the run would have had without deduplication; full-graph
             with the halo cache: mean and oldest age of the halo rows used per layer
``memory``   peak resident memory of every rank per epoch (and peak CUDA memory on GPUs)
============ =================================================================================

``loss`` and ``accuracy`` show every run given; the other panels show the first run.
Each panel's Axes carries its key as ``gid`` (``ax.get_gid()``), for tests and scripts.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError

PANELS = ("loss", "accuracy", "phases", "bytes", "layers", "memory")
SPLITS = (("train_acc", "train", ":"), ("val_acc", "val", "--"), ("test_acc", "test", "-"))
MAX_LEGEND_RANKS = 16


def run_label(run: dict) -> str:
    """A run's name in legends: its directory name."""
    path = Path(run["path"])
    return path.parent.name if path.name == "run.h5" else path.stem


def _figure_classes():
    """matplotlib's Figure and the Agg canvas (imported here: only --plot pays for them)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise InputError(f"--plot needs matplotlib, which is not installed ({exc}); run 'make install' "
                         "or '.venv/bin/pip install matplotlib'") from None
    return Figure, FigureCanvasAgg


def _epochs(run: dict) -> np.ndarray:
    return np.asarray(run["metrics"].get("epoch", np.zeros(0)), dtype=np.int64)


def _finite(y) -> np.ndarray:
    return np.isfinite(np.asarray(y, dtype=float))


def _mean_over_epochs(arr) -> np.ndarray:
    """[P] mean over the epochs (axis 0) of the finite values; 0 where a rank has none (no
    numpy empty-slice warning)."""
    a = np.asarray(arr, dtype=float)
    n = _finite(a).sum(axis=0)
    return np.nansum(a, axis=0) / np.maximum(n, 1)


# ---- which panels a run has -------------------------------------------------------------
def _has_loss(runs) -> bool:
    return any(_finite(r["metrics"].get("loss", [])).any() for r in runs)


def _has_accuracy(runs) -> bool:
    return any(_finite(r["metrics"].get(k, [])).any() for r in runs for k, _, _ in SPLITS)


def _phase_kinds(run: dict) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(top-level phases: stacked, parent ``epoch``; roots other than ``epoch``: on top;
    (nested timing, its parent): in no stack) of the timings with a finite value, in
    :func:`~hpcgnn.run.runfile.timing_parents` order."""
    from hpcgnn.run.runfile import timing_parents

    t = run["timings"]
    parents = {k: v for k, v in timing_parents(run).items() if k != "epoch" and _finite(t[k]).any()}
    return ([k for k, v in parents.items() if v == "epoch"], [k for k, v in parents.items() if v == ""],
            [(k, v) for k, v in parents.items() if v not in ("", "epoch")])


def _stacked_phases(run: dict) -> list[str]:
    return _phase_kinds(run)[0]


def _has_phases(run: dict) -> bool:
    t = run["timings"]
    return _epochs(run).size > 0 and (bool(_stacked_phases(run)) or _finite(t.get("epoch", [])).any())


def _byte_kinds(run: dict) -> list[tuple[str, np.ndarray]]:
    """(label, per-epoch sum over ranks) of every non-zero byte counter; identical series merged.
    An offloaded run's transfers appear as their totals (``h2d_bytes``, ``d2h_bytes``): the
    ``layers`` panel breaks them down."""
    c = run["counters"]
    parts = set()
    for direction in ("h2d", "d2h"):
        if f"{direction}_bytes" in c:
            parts.update(k for k in c if k.startswith(f"{direction}_") and k != f"{direction}_bytes")
    series: list[tuple[list[str], np.ndarray]] = []
    for name in sorted(c):
        if "bytes" not in name.split("_") or name.startswith(("peak_", "halo_cache_")) or name in parts:
            continue
        arr = np.asarray(run["counters"][name], dtype=float)
        if arr.ndim != 2 or not (np.nan_to_num(arr) != 0).any():
            continue
        total = np.nansum(arr, axis=1)
        for names, other in series:
            if np.array_equal(total, other):
                names.append(name)
                break
        else:
            series.append(([name], total))
    return [(" = ".join(names), total) for names, total in series]


def _hec_rates(run: dict) -> np.ndarray | None:
    """[E, L] HEC hit rate per layer over all ranks, or None."""
    pl = run["per_layer"]
    if "hec_hits" in pl and "hec_lookups" in pl:
        hits = np.nansum(pl["hec_hits"], axis=1)
        looks = np.nansum(pl["hec_lookups"], axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            rates = np.where(looks > 0, hits / np.where(looks > 0, looks, 1), np.nan)
    elif "hec_hit_rate" in pl:
        arr = np.asarray(pl["hec_hit_rate"], dtype=float)
        if not _finite(arr).any():
            return None
        valid = _finite(arr)
        rates = np.where(valid.any(axis=1), np.nansum(arr, axis=1) / np.maximum(valid.sum(axis=1), 1), np.nan)
    else:
        return None
    return rates if rates.ndim == 2 and _finite(rates).any() else None


def _transfer_kinds(run: dict, direction: str) -> list[str]:
    """Offload counters ``h2d_<kind>_bytes`` / ``d2h_<kind>_bytes`` (not totals, not no-dedup)."""
    c = run["counters"]
    return sorted(k for k in c if k.startswith(f"{direction}_") and k.endswith("_bytes")
                  and k != f"{direction}_bytes" and "nodedup" not in k and _finite(c[k]).any())


def _halo_ages(run: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """Full-graph halo cache (docs/capgnn.md): ([E, L] mean age of the halo rows used over all
    ranks, [E, L] oldest), or None."""
    pl = run["per_layer"]
    if "halo_rows_used" not in pl or "halo_age_max" not in pl:
        return None
    used = np.nansum(pl["halo_rows_used"], axis=1)
    ages = [(int(k.rsplit("_", 1)[1]), k) for k in pl
            if k.startswith("halo_age_") and k.rsplit("_", 1)[1].isdigit()]
    total = sum(a * np.nansum(pl[k], axis=1) for a, k in ages)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(used > 0, total / np.where(used > 0, used, 1), np.nan)
    return (mean, np.nanmax(pl["halo_age_max"], axis=1)) if _finite(mean).any() else None


def _has_layers(run: dict) -> bool:
    return _hec_rates(run) is not None or bool(_transfer_kinds(run, "h2d") or _transfer_kinds(run, "d2h")) \
        or _halo_ages(run) is not None


def _has_memory(run: dict) -> bool:
    return any(_finite(run["counters"].get(k, [])).any() for k in ("peak_rss_bytes", "peak_cuda_bytes"))


def panels_of(runs: list[dict]) -> list[str]:
    """The panel keys :func:`build_figure` draws for ``runs`` (first = the run of the per-run panels)."""
    first = runs[0]
    have = {"loss": _has_loss(runs), "accuracy": _has_accuracy(runs), "phases": _has_phases(first),
            "bytes": bool(_byte_kinds(first)), "layers": _has_layers(first), "memory": _has_memory(first)}
    return [p for p in PANELS if have[p]]


# ---- drawing ------------------------------------------------------------------------------
def _byte_unit(values) -> tuple[float, str]:
    top = max((float(np.nanmax(v)) for v in values if _finite(v).any()), default=0.0)
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if top >= scale:
            return scale, unit
    return 1.0, "bytes"


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", **kw)


def _integer_epochs(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")


def _draw_loss(ax, runs, labels) -> None:
    for run, label in zip(runs, labels):
        e, y = _epochs(run), np.asarray(run["metrics"].get("loss", []), dtype=float)
        ok = _finite(y)
        if ok.any():
            ax.plot(e[ok], y[ok], label=label if len(runs) > 1 else "train loss")
    ax.set_title("Loss")
    ax.set_ylabel("loss")
    _integer_epochs(ax)
    _legend(ax)


def _draw_accuracy(ax, runs, labels) -> None:
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, label, color in zip(runs, labels, colors):
        e = _epochs(run)
        for key, split, style in SPLITS:
            y = np.asarray(run["metrics"].get(key, []), dtype=float)
            ok = _finite(y)
            if not ok.any():
                continue
            kw = {"marker": "o", "markersize": 3} if ok.sum() <= 30 else {}
            if len(runs) > 1:
                ax.plot(e[ok], 100 * y[ok], linestyle=style, color=color, label=f"{label} {split}", **kw)
            else:
                ax.plot(e[ok], 100 * y[ok], label=split, **kw)
    ax.set_title("Accuracy")
    ax.set_ylabel("accuracy (%)")
    epochs = np.concatenate([_epochs(r) for r in runs])
    if epochs.size:                     # the runs' epochs, also when few were evaluated
        lo, hi = int(epochs.min()), int(epochs.max())
        pad = max(0.5, 0.03 * (hi - lo))
        ax.set_xlim(lo - pad, hi + pad)
    _integer_epochs(ax)
    _legend(ax)


def _draw_phases(ax, run) -> None:
    t = run["timings"]
    e = _epochs(run).astype(float)
    ranks = next(iter(t.values())).shape[1]
    width = 0.8 / ranks
    x = (e[:, None] + (np.arange(ranks)[None, :] - (ranks - 1) / 2) * width).ravel()
    bottom = np.zeros(x.size)
    stacked, roots, nested = _phase_kinds(run)
    for name in stacked:
        h = np.nan_to_num(np.asarray(t[name], dtype=float)).ravel()
        ax.bar(x, h, width, bottom=bottom, label=name)
        bottom += h
    if "epoch" in t:
        rest = np.clip(np.nan_to_num(np.asarray(t["epoch"], dtype=float)).ravel() - bottom, 0, None)
        if not stacked or (rest > 0).any():
            ax.bar(x, rest, width, bottom=bottom, label="other" if stacked else "epoch", color="0.75")
            bottom += rest
    for name in roots:                   # outside the epoch time (eval): on top
        h = np.nan_to_num(np.asarray(t[name], dtype=float)).ravel()
        ax.bar(x, h, width, bottom=bottom, label=name, color="0.35" if len(roots) == 1 else None)
        bottom += h
    order = "rank 0" if ranks == 1 else f"ranks 0-{ranks - 1} left to right"
    ax.set_title(f"Phase time per rank ({run_label(run)}; each epoch: {order})")
    ax.set_ylabel("seconds")
    _integer_epochs(ax)
    if nested:
        within: dict[str, list[str]] = {}
        for name, parent in nested:
            within.setdefault(parent, []).append(name)
        ax.set_xlabel("epoch  (parts of other phases, not stacked: " + "; ".join(
            f"{', '.join(names)} in {parent}" for parent, names in within.items()) + ")")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _draw_bytes(ax, run) -> None:
    kinds = _byte_kinds(run)
    scale, unit = _byte_unit([v for _, v in kinds])
    e = _epochs(run)
    for label, total in kinds:
        ax.plot(e, total / scale, marker="o" if e.size <= 30 else None, markersize=3, label=label)
    ax.set_title(f"Bytes per epoch by kind, sum over ranks ({run_label(run)})")
    ax.set_ylabel(f"{unit} per epoch")
    ax.set_ylim(bottom=0)
    _integer_epochs(ax)
    _legend(ax)


def _draw_hec(ax, run, rates) -> None:
    e = _epochs(run)
    for layer in range(rates.shape[1]):
        ok = _finite(rates[:, layer])
        if ok.any():
            ax.plot(e[ok], 100 * rates[ok, layer], marker="o" if ok.sum() <= 30 else None, markersize=3,
                    label=f"layer {layer}")
    ax.set_title(f"HEC hit rate per layer ({run_label(run)})")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    _integer_epochs(ax)
    _legend(ax)


def _draw_transfers(ax, run) -> None:
    c = run["counters"]
    h2d, d2h = _transfer_kinds(run, "h2d"), _transfer_kinds(run, "d2h")
    mean = {k: _mean_over_epochs(c[k]) for k in h2d + d2h}   # [P]
    ranks = next(iter(mean.values())).size
    scale, unit = _byte_unit(list(mean.values()))
    r = np.arange(ranks, dtype=float)
    for kinds, offset, direction in ((h2d, -0.2, "h2d"), (d2h, 0.2, "d2h")):
        bottom = np.zeros(ranks)
        for k in kinds:
            h = np.nan_to_num(mean[k]) / scale
            ax.bar(r + offset, h, 0.38, bottom=bottom, label=k.removesuffix("_bytes"))
            bottom += h
        if direction == "h2d" and "h2d_rows_nodedup_bytes" in c and "h2d_rows_bytes" in mean:
            saved = _mean_over_epochs(c["h2d_rows_nodedup_bytes"]) - mean["h2d_rows_bytes"]
            total = bottom + saved / scale
            ax.bar(r + offset, total, 0.38, fill=False, edgecolor="black", linestyle="--",
                   label="h2d without dedup")
    try:
        plans = json.loads(run["attrs"].get("fullgraph_plans") or "[]")
    except (TypeError, json.JSONDecodeError):
        plans = []
    ticks = [f"rank {i}" + (f"\n{plans[i]['chunks']} chunks" if i < len(plans) and isinstance(plans[i], dict)
                            and "chunks" in plans[i] else "") for i in range(ranks)]
    ax.set_xticks(r, ticks)
    ax.set_title(f"Offload transfers per rank, mean per epoch ({run_label(run)}; left h2d, right d2h)")
    ax.set_ylabel(f"{unit} per epoch")
    _legend(ax)


def _draw_layers(ax, run) -> None:
    rates = _hec_rates(run)
    if rates is not None:
        _draw_hec(ax, run, rates)
    elif _halo_ages(run) is not None:
        _draw_halo_ages(ax, run)
    else:
        _draw_transfers(ax, run)


def _draw_halo_ages(ax, run) -> None:
    mean, oldest = _halo_ages(run)
    e = _epochs(run)
    for l in range(mean.shape[1]):
        ax.plot(e, mean[:, l], color=f"C{l % 10}", label=f"layer {l} mean")
        ax.plot(e, oldest[:, l], color=f"C{l % 10}", linestyle="--", label=f"layer {l} oldest")
    ax.set_title(f"Age of the halo rows used, epochs ({run_label(run)})")
    ax.set_ylabel("epochs")
    ax.set_ylim(bottom=0)
    _integer_epochs(ax)
    _legend(ax)


def _draw_memory(ax, run) -> None:
    c = run["counters"]
    e = _epochs(run)
    for key, style, what in (("peak_rss_bytes", "-", "RSS"), ("peak_cuda_bytes", "--", "CUDA")):
        if key not in c or not _finite(c[key]).any():
            continue
        arr = np.asarray(c[key], dtype=float)
        for rank in range(arr.shape[1]):
            ok = _finite(arr[:, rank])
            if ok.any():
                label = f"rank {rank} {what}" if arr.shape[1] <= MAX_LEGEND_RANKS else None
                ax.plot(e[ok], arr[ok, rank] / 2**30, linestyle=style, color=f"C{rank % 10}",
                        marker="o" if ok.sum() <= 30 else None, markersize=3, label=label)
    ax.set_title(f"Peak memory per rank ({run_label(run)})")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    _integer_epochs(ax)
    _legend(ax)


WIDE = ("phases",)


def build_figure(runs: list[dict]):
    """The report figure of ``runs`` (dicts of :func:`~hpcgnn.run.runfile.read_run`; the first is
    the run of the per-run panels, the others are overlaid on loss and accuracy). Returns a
    matplotlib Figure with an Agg canvas; InputError when the runs have nothing to draw."""
    if not runs:
        raise ValueError("build_figure: no runs")
    Figure, FigureCanvasAgg = _figure_classes()
    keys = panels_of(runs)
    if not keys:
        raise InputError(f"{runs[0]['path']}: the run has no logged epoch to plot")
    labels = [run_label(r) for r in runs]
    if len(set(labels)) < len(labels):             # two directories of one name: use the paths
        labels = [str(Path(r["path"]).parent) for r in runs]
    # Layout: wide panels take a row; the others pair up, a lone one spans the row.
    rows: list[list[str]] = []
    for k in keys:
        if k in WIDE or not rows or len(rows[-1]) == 2 or rows[-1][0] in WIDE:
            rows.append([k])
        else:
            rows[-1].append(k)
    fig = Figure(figsize=(15, 4.6 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(rows), 2)
    first = runs[0]
    a = first["attrs"]
    head = f"{labels[0]}: {a.get('engine')} engine, {a.get('num_ranks')} ranks, {a.get('status')}"
    if len(runs) > 1:
        head += "; compared with " + ", ".join(labels[1:])
    fig.suptitle(head)
    for i, row in enumerate(rows):
        for j, key in enumerate(row):
            ax = fig.add_subplot(grid[i, :] if len(row) == 1 else grid[i, j])
            ax.set_gid(key)
            if key == "loss":
                _draw_loss(ax, runs, labels)
            elif key == "accuracy":
                _draw_accuracy(ax, runs, labels)
            elif key == "phases":
                _draw_phases(ax, first)
            elif key == "bytes":
                _draw_bytes(ax, first)
            elif key == "layers":
                _draw_layers(ax, first)
            else:
                _draw_memory(ax, first)
            ax.grid(True, alpha=0.3)
    return fig


def check_plot_path(path: str | os.PathLike) -> tuple[Path, str]:
    """(path, image format) of a --plot output; InputError for an unusable one (before any work)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: --plot names a directory, expected an image file name")
    fmt = path.suffix.lower().lstrip(".")
    supported = ("png", "pdf", "svg")
    if fmt not in supported:
        raise InputError(f"{path}: --plot file needs one of the extensions "
                         f"{', '.join('.' + s for s in supported)}")
    parent = path.parent
    if not parent.is_dir():
        raise InputError(f"{path}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{path}: cannot write the plot (directory {parent} is not writable)")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"{path}: cannot write the plot (the file is not writable)")
    return path, fmt


def save_figure(fig, path: str | os.PathLike, dpi: int = 100) -> Path:
    """Write ``fig`` to ``path`` atomically (a temporary name beside it, then a rename)."""
    from hpcgnn.fileio import atomic_file

    path, fmt = check_plot_path(path)
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format=fmt, dpi=dpi)
    except OSError as exc:
        raise InputError(f"{path}: cannot write the plot ({exc.strerror or exc})") from None
    return path
