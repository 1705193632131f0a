"""What ``hpcgnn train`` prints on rank 0, through :mod:`hpcgnn.log` (stdout; ``--quiet`` hides it).

* a start banner, once the engine is built: engine, ranks, threads and device; the engine's
  settings; the data's and the model's sizes; the estimated peak memory per rank; the run
  directory (:meth:`RunConsole.banner`);
* one line per epoch of at most :data:`WIDTH` characters (:func:`epoch_line`): epoch, loss,
  train and validation accuracy with the best validation accuracy so far and its epoch, the
  epoch's time (slowest rank), the evaluation's time after it, the epoch's peak resident memory
  (largest rank; and the device's on a GPU). Test accuracy is left to the summary: it is not
  for choosing epochs;
* with ``hpcgnn -v``, under each epoch line its phases (:func:`phase_lines`), grouped as
  ``hpcgnn report`` groups them (:func:`hpcgnn.run.runfile.timing_parents`): the epoch's
  top-level phases with the phases nested in each in parentheses after it, then what ran
  outside the epoch (the evaluation);
* a heartbeat on stderr while an epoch or a set-up step runs long
  (:class:`hpcgnn.progress.Heartbeat`);
* a summary at the end (:meth:`RunConsole.summary`), also of a run that a stop signal ended or
  that failed: how it ended, the best validation epoch and its test accuracy, the last epoch,
  the mean epoch and evaluation times, each rank's peak memory against its estimate, the run
  file, the last checkpoint and the commands that come next.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from hpcgnn import log
from hpcgnn.progress import Heartbeat, fmt_seconds
from hpcgnn.units import fmt_bytes

WIDTH = 120          # the widest epoch line
LABEL = 11           # the label column of the banner and the summary ("checkpoint " + 1)


def _pct(x) -> str:
    return f"{100 * x:.2f}"


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _loss(x: float) -> str:
    return f"{x:.4f}" if _finite(x) and abs(x) < 1e4 else f"{x:.3g}"


def epoch_line(epoch: int, epochs: int, metrics: dict, best: tuple[float, int] | None,
               epoch_s: float | None, eval_s: float | None, peak_rss: float | None,
               peak_device: float | None = None) -> str:
    """The epoch's line, at most :data:`WIDTH` characters (module docstring). ``metrics``: the
    epoch's ``loss``, ``train_acc``, ``val_acc`` (NaN: not evaluated, left out); ``best``:
    (validation accuracy, epoch) of the best epoch so far, this one included; times in seconds
    (``eval_s`` None: no evaluation); peaks in bytes (None: not measured)."""
    parts = [f"epoch {epoch:>{len(str(epochs))}}/{epochs}"]
    if "loss" in metrics:
        parts.append(f"loss {_loss(metrics['loss'])}")
    acc = [f"{k} {_pct(metrics[f'{k}_acc'])}" for k in ("train", "val")
           if _finite(metrics.get(f"{k}_acc"))]
    if acc:
        parts.append("acc% " + " ".join(acc) + (f" best {_pct(best[0])}@{best[1]}" if best else ""))
    if epoch_s is not None:
        parts.append(fmt_seconds(epoch_s) + ("" if eval_s is None else f" + eval {fmt_seconds(eval_s)}"))
    peak = []
    if _finite(peak_rss):
        peak.append(f"peak {fmt_bytes(peak_rss)}")
    if _finite(peak_device) and peak_device:
        peak.append(f"device {fmt_bytes(peak_device)}")
    if peak:
        parts.append(" ".join(peak))
    line = " | ".join(parts)
    if len(line) > WIDTH:      # only with absurd values: keep the line's promise
        line = line[:WIDTH - 3] + "..."
    return line


def _wrap(items: list[str], first: str, indent: int, sep: str = ", ") -> list[str]:
    """``items`` joined by ``sep`` after ``first``, wrapped at :data:`WIDTH` into lines indented
    by ``indent`` spaces (an item wider than a line stands alone)."""
    lines, cur = [], first
    for i, item in enumerate(items):
        piece = item if i == 0 else sep + item
        if i and len(cur) + len(piece) > WIDTH:
            lines.append(cur + sep.rstrip())
            cur = " " * indent + item
        else:
            cur += piece
    lines.append(cur)
    return lines


def _group(parents: dict[str, str], names: list[str]) -> tuple[list, list, dict]:
    """(top-level phases, roots other than ``epoch``, {parent: nested phases}) of ``names``."""
    top = [p for p in names if parents.get(p, "epoch") == "epoch"]
    roots = [p for p in names if parents.get(p) == "" and p != "epoch"]
    nested: dict[str, list[str]] = {}
    for p in names:
        if parents.get(p, "epoch") not in ("", "epoch"):
            nested.setdefault(parents[p], []).append(p)
    return top, roots, nested


def phase_lines(timings: list[dict], parents: dict[str, str]) -> list[str]:
    """``hpcgnn -v``'s lines under an epoch line: each phase's seconds, mean over ranks
    (``timings``: one {name: seconds} per rank), grouped as ``hpcgnn report`` groups them: the
    top-level phases (parts of ``epoch``) each with the phases nested in it in parentheses, then
    the roots outside the epoch (``eval``) with theirs; a phase nested in several (``a+b``) after
    them. Lines of at most :data:`WIDTH` characters (a long list wraps), e.g.::

        phases, s (mean over ranks): sample 0.001, forward 0.009 (cache 0.001, push 0.001), backward 0.004
        outside the epoch: eval 0.009
    """
    names = [k for k in parents if k != "epoch" and any(k in t for t in timings)]
    names += [k for t in timings for k in t if k not in parents and k != "epoch" and k not in names]

    def mean(k):
        v = [t[k] for t in timings if k in t and t[k] is not None and math.isfinite(t[k])]
        return f"{np.mean(v):.3f}" if v else "-"

    top, roots, nested = _group(parents, names)

    def item(p):
        inner = nested.pop(p, [])
        text = f"{p} {mean(p)}"
        return text + (" (" + ", ".join(f"{c} {mean(c)}" for c in inner) + ")" if inner else "")

    lines = _wrap([item(p) for p in top], "    phases, s (mean over ranks): ", 6) if top else []
    if roots:
        lines += _wrap([item(p) for p in roots], "    outside the epoch: ", 6)
    if nested:
        lines += _wrap([f"{c} {mean(c)} (in {parent})" for parent, kids in nested.items() for c in kids],
                       "    in several phases: ", 6)
    return lines


class RunConsole:
    """Rank 0's console of one training run (every method is a no-op on the other ranks).

    ``cfg``: the run's configuration; ``rt``: the runtime; ``out``: its
    :class:`~hpcgnn.run.output.RunOutput` (history, attributes, nesting of the timings);
    ``verbose``: ``hpcgnn -v`` (the phase lines)."""

    def __init__(self, cfg, rt, out, verbose: bool = False):
        self.cfg, self.rt, self.out = cfg, rt, out
        self.verbose = bool(verbose)
        self.on = bool(rt.is_root)
        self.epochs = int(cfg.train.epochs)
        self.best: tuple[float, int] | None = None
        self._summarised = False

    # ---- heartbeats ---------------------------------------------------------
    def setup_step(self, what: str) -> Heartbeat:
        """A heartbeat for a set-up step (``with console.setup_step("building the engine"):``)."""
        return Heartbeat(what, enabled=self.on)

    def epoch_running(self, epoch: int) -> Heartbeat:
        """A heartbeat for a training epoch (module docstring)."""
        return Heartbeat(f"epoch {epoch}/{self.epochs}", enabled=self.on)

    # ---- banner ---------------------------------------------------------------
    def banner(self, meta, model=None) -> None:
        """The start banner (module docstring); ``model``: the engine's model (its parameter count)."""
        if not self.on:
            return
        for line in banner_lines(self.cfg, self.rt, meta, self.out, model):
            log.info(line)

    # ---- epochs ----------------------------------------------------------------
    def resumed(self, rows: list[dict]) -> None:
        """The logged epochs a resumed run continues (``RunOutput.history``): the best so far."""
        for row in rows:
            self._track(row)

    def _track(self, row: dict) -> None:
        val = row["metrics"].get("val_acc")
        if _finite(val) and (self.best is None or val > self.best[0]):
            self.best = (float(val), int(row["epoch"]))

    def epoch(self, row: dict | None) -> None:
        """The epoch's line (and ``-v``'s phase lines) of ``row``, what
        :meth:`~hpcgnn.run.output.RunOutput.log_epoch` returned on rank 0."""
        if not self.on or row is None:
            return
        self._track(row)
        log.info(epoch_line_of(row, self.epochs, self.best))
        if self.verbose:
            for line in phase_lines(row["timings"], self.out.timing_parents):
                log.info(line)

    # ---- summary ---------------------------------------------------------------
    def summary(self, ended: str) -> None:
        """The summary (module docstring), once; ``ended``: its first line (how the run ended)."""
        if not self.on or self._summarised:
            return
        self._summarised = True
        for line in summary_lines(ended, self.cfg, self.rt.size, self.out):
            log.info(line)

    def failed(self, message: str) -> None:
        """Failure hook (``Runtime.on_failure``): the summary of a run that failed."""
        last = self.out.history[-1]["epoch"] if self.on and self.out.history else None
        where = "before its first epoch" if last is None else f"after epoch {last} of {self.epochs}"
        self.summary(f"failed     {where}: {message}"[:WIDTH])


def _max_over_ranks(values: list, key: str) -> float | None:
    v = [d.get(key) for d in values if _finite(d.get(key))]
    return float(max(v)) if v else None


def _on_gpu(row: dict) -> bool:
    """Whether some rank computed the logged epoch ``row`` on a GPU (its ``device`` label)."""
    return any(str(lab.get("device", "")).startswith("cuda") for lab in row.get("labels", []))


def epoch_line_of(row: dict, epochs: int, best) -> str:
    """:func:`epoch_line` of a logged row (per-rank timings and counters; the slowest rank's
    epoch and evaluation, the largest rank's peaks, the device's on a GPU only)."""
    return epoch_line(int(row["epoch"]), epochs, row["metrics"], best,
                      _max_over_ranks(row["timings"], "epoch"), _max_over_ranks(row["timings"], "eval"),
                      _max_over_ranks(row["counters"], "peak_rss_bytes"),
                      _max_over_ranks(row["counters"], "peak_device_bytes") if _on_gpu(row) else None)


def _setting(v) -> str:
    return json.dumps(v) if isinstance(v, str) else str(v)


def _estimates(out, attr: str) -> list:
    raw = out.attrs.get(attr)
    try:
        got = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return []
    return list(got) if isinstance(got, list) else []


def banner_lines(cfg, rt, meta, out, model=None) -> list[str]:
    """The start banner's lines (see :class:`RunConsole`)."""
    from hpcgnn.run.engines.registry import engine_spec

    name = cfg.train.engine
    spec = engine_spec(name)
    device = getattr(rt, "device", None) or cfg.train.device
    lines = [f"{'engine':<{LABEL}}{name} on {rt.size} rank(s), {rt.threads} thread(s) each, device {device}"]
    section = cfg.to_dict().get(spec.section) if spec.section else None
    if section:
        lines += _wrap([f"{k} {_setting(v)}" for k, v in section.items()], f"{'settings':<{LABEL}}", LABEL)
    lines.append(f"{'data':<{LABEL}}{meta.num_nodes:,} vertices, {meta.num_edges:,} edges, "
                 f"{meta.num_features:,} features, {meta.num_classes} classes in {meta.num_parts} partitions")
    params = "" if model is None else f", {sum(p.numel() for p in model.parameters()):,} parameters"
    m, t = cfg.model, cfg.train
    lines.append(f"{'model':<{LABEL}}{m.arch}, {m.layers} layers of {m.hidden}{params}; "
                 f"lr {t.lr}, {t.epochs} epochs, seed {t.seed}")
    est = [e for e in _estimates(out, "estimated_peak_rss_bytes") if e is not None]
    dev = [e for e in _estimates(out, "estimated_peak_device_bytes") if e is not None]
    if est or dev:
        text = []
        if est:
            text.append(f"host {fmt_bytes(max(est))}")
        if dev:
            text.append(f"device {fmt_bytes(max(dev))}")
        lines.append(f"{'memory':<{LABEL}}estimated peak of the largest rank: " + ", ".join(text))
    start = first_epoch(out)
    lines.append(f"{'run':<{LABEL}}{out.run_dir}" + (f" (resumed at epoch {start})" if start > 1 else ""))
    return lines


def first_epoch(out) -> int:
    """The first epoch this job trains (rank 0): after the checkpoint ``--resume`` continues
    (``RunOutput.resume_state``), else 1."""
    state = getattr(out, "resume_state", None)
    return int(state["epoch"]) + 1 if state else 1


def _memory_items(out) -> list[str]:
    """Per rank: ``rank R 0.44 / 0.45 GiB`` (the largest epoch peak / the estimate); the device's
    where one was measured."""
    peaks = [[r.get("peak_rss_bytes") for r in row["counters"]] for row in out.history]
    devs = [[r.get("peak_device_bytes") for r in row["counters"]] for row in out.history if _on_gpu(row)]
    est = _estimates(out, "estimated_peak_rss_bytes")
    dest = _estimates(out, "estimated_peak_device_bytes")
    ranks = max((len(p) for p in peaks), default=0)
    items = []
    for r in range(ranks):
        host = [p[r] for p in peaks if r < len(p) and _finite(p[r])]
        if not host:
            continue
        text = f"rank {r} {max(host) / 2**30:.2f}"
        text += f" / {est[r] / 2**30:.2f} GiB" if r < len(est) and est[r] else " GiB"
        dev = [p[r] for p in devs if r < len(p) and _finite(p[r]) and p[r]]
        if dev:
            text += f" (device {max(dev) / 2**30:.2f}"
            text += f" / {dest[r] / 2**30:.2f} GiB)" if r < len(dest) and dest[r] else " GiB)"
        items.append(text)
    return items


MAX_RANKS_LISTED = 8


def summary_lines(ended: str, cfg, ranks: int, out) -> list[str]:
    """The summary's lines (see :class:`RunConsole`); ``ended``: the first line."""
    from hpcgnn.run.checkpoint import list_checkpoints
    from hpcgnn.run.runfile import RUN_FILE

    hist = out.history
    lines = [ended]
    val = [(h["metrics"].get("val_acc"), h) for h in hist if _finite(h["metrics"].get("val_acc"))]
    if val:
        acc, h = max(val, key=lambda x: x[0])
        test = h["metrics"].get("test_acc")
        lines.append(f"{'best val':<{LABEL}}{_pct(acc)}% at epoch {h['epoch']}"
                     + (f", test {_pct(test)}%" if _finite(test) else ""))
    if hist:
        h = hist[-1]
        m = h["metrics"]
        accs = [f"{k} {_pct(m[f'{k}_acc'])}%" for k in ("val", "test") if _finite(m.get(f"{k}_acc"))]
        lines.append(f"{'last epoch':<{LABEL}}{h['epoch']} of {cfg.train.epochs}: loss {_loss(m.get('loss', math.nan))}"
                     + (", " + ", ".join(accs) if accs else ""))
        times = [_max_over_ranks(h["timings"], "epoch") for h in hist]
        times = [t for t in times if t is not None]
        evals = [_max_over_ranks(h["timings"], "eval") for h in hist]
        evals = [t for t in evals if t is not None]
        if times:
            lines.append(f"{'time':<{LABEL}}{fmt_seconds(float(np.mean(times)))} per epoch (mean of {len(times)}, "
                         "slowest rank)" + (f", evaluation {fmt_seconds(float(np.mean(evals)))}" if evals else ""))
        items = _memory_items(out)
        if items:
            more = ""
            if len(items) > MAX_RANKS_LISTED:
                more = f" and {len(items) - MAX_RANKS_LISTED} more ranks (hpcgnn report lists them)"
                items = items[:MAX_RANKS_LISTED]
            lines += _wrap(items, f"{'memory':<{LABEL}}peak / estimate per rank: ", LABEL)
            if more:
                lines[-1] += more
    run_dir = Path(out.run_dir)
    lines.append(f"{'run file':<{LABEL}}{run_dir / RUN_FILE}")
    ckpts = list_checkpoints(run_dir)
    if ckpts:
        lines.append(f"{'checkpoint':<{LABEL}}{ckpts[-1][1]}")
    lines.append(f"{'next':<{LABEL}}hpcgnn report {run_dir}   (per-epoch table; --csv, --tensorboard, --plot)")
    if ckpts:
        lines.append(" " * LABEL + f"mpiexec -n {ranks} hpcgnn infer {run_dir} --out {run_dir / 'logits.h5'}")
    return lines


def warn(message: str) -> None:
    """A one-line warning on stderr (``hpcgnn: warning: ...``, :mod:`hpcgnn.log`), printed by the
    rank that calls it (callers call it on rank 0)."""
    log.warning(message, every_rank=True)
