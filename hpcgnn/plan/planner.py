"""The plan: every candidate's prediction, the fit checks, the ranking by predicted epoch time,
the table of why, and the recommended configuration written as TOML (atomically).

A candidate is rejected (with the reason) when its configuration is invalid, when the engine
cannot run on the device, when the ranks of the fullest node need more host memory than
``Topology.host_memory``, or when one rank needs more GPU memory than ``device_memory``.
The rest are ranked by predicted epoch time (ties: smaller host peak, then proposal order).
Every candidate with a time model is also ranked by its predicted halo bytes per epoch, all
ranks (:attr:`~hpcgnn.plan.estimator.Prediction.halo_bytes_per_epoch`: the full graph's exact,
cached and pipelined halo, the AEP pushes, the exact minibatch fetch, the tensor engine's
layouts; ties: proposal order), fitting or not: ``Row.halo_order``.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from hpcgnn.errors import InputError


@dataclass
class Row:
    """One candidate in the plan: ``order`` is its rank (1 = recommended; 0 = not ranked)."""

    candidate: object
    pred: object = None
    fits: bool = False
    reason: str = ""
    order: int = 0
    halo_order: int = 0      # rank by predicted halo bytes per epoch (1 = fewest; 0 = no time model)


@dataclass
class Plan:
    rows: list = field(default_factory=list)
    topo: object = None
    cal: object = None
    meta: object = None
    notes: list = field(default_factory=list)
    config: str = ""
    overrides: list = field(default_factory=list)
    store: str = ""
    any_model: bool = False

    @property
    def best(self) -> Row | None:
        """The recommendation: the fastest fitting candidate, among those that train the
        configured model unless ``any_model``."""
        ranked = [r for r in self.rows if r.order > 0 and (self.any_model or not r.candidate.model_change)]
        return min(ranked, key=lambda r: r.order) if ranked else None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def make_plan(config, overrides, store, topo, cal, chunks=None, engines=None, any_model=False) -> Plan:
    """Propose, estimate, check and rank (see the module docstring); ``any_model`` lets a
    candidate that trains another model (decoupled tensor mode) be the recommendation."""
    from hpcgnn.partition.store import read_meta
    from hpcgnn.plan.estimator import estimate, scaled_shapes, store_shapes
    from hpcgnn.plan.proposer import DEFAULT_CHUNKS, propose
    from hpcgnn.units import fmt_bytes

    meta = read_meta(store)
    cands = propose(config, overrides, store, chunks or DEFAULT_CHUNKS, engines)
    shapes = scaled_shapes(meta, store_shapes(meta), topo.ranks)
    plan = Plan(topo=topo, cal=cal, meta=meta, config=str(config), overrides=list(overrides), store=str(store),
                any_model=any_model)
    if topo.ranks != meta.num_parts:
        plan.notes.append(f"the store has {meta.num_parts} partitions, the plan is for {topo.ranks} ranks: "
                          f"partition sizes are extrapolated; run `hpcgnn partition GRAPH --parts {topo.ranks}` "
                          "and set data.partitions before training (and plan again for exact sizes)")
    for c in cands:
        row = Row(c)
        plan.rows.append(row)
        if c.invalid:
            row.reason = f"invalid: {c.invalid}"
            continue
        cfg = c.cfg
        if topo.device == "cuda":
            from hpcgnn.run.config import load_config

            cfg = load_config(config, [*overrides, f"data.partitions={store}", "train.device=cuda",
                                       *[f"{k}={_value(v)}" for k, v in c.overrides.items()]])
        p = row.pred = estimate(cfg, meta, shapes, topo, cal)
        if p.host_node > topo.host_memory:
            name, size = p.largest
            row.reason = (f"host memory: {topo.ranks_per_node} rank(s) per node need {fmt_bytes(p.host_node)} > "
                          f"{fmt_bytes(topo.host_memory)} ({topo.host_memory_source}); largest term {name} "
                          f"{fmt_bytes(size)} on rank {p.worst_rank}, shrink with {p.shrink or 'more nodes'}")
            continue
        if topo.device == "cuda" and p.device_peak > topo.device_memory:
            name, size = p.device_largest
            row.reason = (f"device memory: {fmt_bytes(p.device_peak)} per GPU > {fmt_bytes(topo.device_memory)}"
                          f" (--device-memory); largest term {name} {fmt_bytes(size)}: {p.device_shrink}")
            continue
        row.fits = True
        if math.isnan(p.epoch_s):
            row.reason = "fits; not ranked: " + "; ".join(p.notes)
            continue
        top = max(p.parts, key=p.parts.get)
        row.reason = (f"fits; {p.epoch_s:.3g} s/epoch, mostly {top} "
                      f"({100 * p.parts[top] / max(p.epoch_s, 1e-30):.0f} %)")
        if c.model_change:
            row.reason += f"; {c.model_change}" + ("" if any_model else " (not recommended without --any-model)")
    ranked = sorted([r for r in plan.rows if r.fits and not math.isnan(r.pred.epoch_s)],
                    key=lambda r: (r.pred.epoch_s, r.pred.host_peak, plan.rows.index(r)))
    for i, r in enumerate(ranked, 1):
        r.order = i
    by_bytes = sorted([r for r in plan.rows if r.pred is not None and not math.isnan(r.pred.epoch_s)],
                      key=lambda r: (r.pred.halo_bytes_per_epoch, plan.rows.index(r)))
    for i, r in enumerate(by_bytes, 1):
        r.halo_order = i
    return plan


def _value(v) -> str:
    from hpcgnn.plan.proposer import toml_value

    return toml_value(v)


def table(plan: Plan) -> str:
    """The printed table: every candidate with memory, bytes, predicted time, fit and reason."""
    t, cal, meta = plan.topo, plan.cal, plan.meta
    lines = [f"plan for {meta.path} ({meta.num_nodes:,} vertices, {meta.num_edges:,} edges, "
             f"{meta.num_parts} parts): {t.ranks} ranks, {t.ranks_per_node} per node, device {t.device}, "
             f"host memory {_gib(t.host_memory)} GiB per node ({t.host_memory_source})"
             + (f", {_gib(t.device_memory)} GiB per GPU" if t.device == "cuda" else ""),
             f"calibration of {cal.host} ({cal.measured_at or 'given'}): SpMM {cal.agg_rate(128) / 1e9:.2f} GB/s "
             f"(128 wide), GEMM {cal.gemm_flops / 1e9:.1f} GFLOP/s, stream {cal.stream / 1e9:.1f} GB/s, "
             f"gather {cal.gather / 1e9:.1f} GB/s, all-to-all {cal.alltoall / 1e9:.2f} GB/s + "
             f"{cal.alltoall_latency_s * 1e6:.0f} us ({cal.alltoall_source})"]
    head = ["rank", "candidate", "host GiB/rank", "node GiB", "device GiB", "MiB sent/epoch",
            "halo MiB/epoch (#)", "epoch s", "fits", "reason"]
    rows = [head]
    order = sorted(plan.rows, key=lambda r: (r.order == 0, r.order))
    for r in order:
        p = r.pred
        rows.append([str(r.order) if r.order else "-", r.candidate.label,
                     _gib(p.host_peak) if p else "-", _gib(p.host_node) if p else "-",
                     _gib(p.device_peak) if p and t.device == "cuda" else "-",
                     f"{p.bytes_per_epoch / 2**20:.1f}" if p and not math.isnan(p.epoch_s) else "-",
                     f"{p.halo_bytes_per_epoch / 2**20:.2f} ({r.halo_order})" if r.halo_order else "-",
                     f"{p.epoch_s:.3f}" if p and not math.isnan(p.epoch_s) else "-",
                     "yes" if r.fits else "no", r.reason])
    w = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    for row in rows:
        lines.append("  " + "  ".join(c.rjust(x) if i != 1 else c.ljust(x)
                                      for i, (c, x) in enumerate(zip(row[:-1], w))) + "  " + row[-1])
    lines += [f"  note: {n}" for n in plan.notes]
    b = plan.best
    lines.append(f"recommended: {b.candidate.label} ({b.pred.epoch_s:.3f} s/epoch predicted)" if b
                 else "recommended: none (no candidate fits; see the reasons)")
    return "\n".join(lines)


def to_json(plan: Plan) -> dict:
    """The plan as plain data (for ``--json`` and the benchmark)."""
    out = []
    for r in plan.rows:
        p = r.pred
        out.append({"label": r.candidate.label, "engine": r.candidate.engine, "overrides": r.candidate.overrides,
                    "order": r.order, "fits": r.fits, "reason": r.reason,
                    "host_peak_bytes": p.host_peak if p else None, "node_bytes": p.host_node if p else None,
                    "device_peak_bytes": p.device_peak if p else None,
                    "bytes_per_epoch": p.bytes_per_epoch if p else None,
                    "halo_bytes_per_epoch": p.halo_bytes_per_epoch if p else None,
                    "halo_order": r.halo_order,
                    "epoch_s": None if not p or math.isnan(p.epoch_s) else p.epoch_s,
                    "time_parts_s": p.parts if p else None, "memory_terms": p.terms if p else None})
    b = plan.best
    return {"store": str(plan.meta.path), "ranks": plan.topo.ranks, "device": plan.topo.device,
            "recommended": b.candidate.label if b else None, "candidates": out, "notes": plan.notes}


# ---- the recommended configuration ------------------------------------------------------------

def _toml_key(k: str) -> str:
    import re

    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _value(k)


def recommended_toml(config, overrides, store, row: Row, header: list[str]) -> str:
    """The user's configuration (its file, then ``--set``) with the candidate's settings and
    ``data.partitions = store``, as TOML text with ``header`` as comments."""
    from hpcgnn.run.config import parse_override

    raw: dict = {}
    if config:
        try:
            raw = tomllib.loads(Path(config).read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{config}: not valid TOML ({exc})") from None
    sets = list(overrides) + [f"{k}={_value(v)}" for k, v in row.candidate.overrides.items()]
    for text in sets:
        name, value = parse_override(text)
        section, key = name.split(".", 1)
        raw.setdefault(section, {})[key] = value
    raw.setdefault("data", {})["partitions"] = str(store)
    lines = [f"# {h}" for h in header]
    for section, values in raw.items():
        lines += ["", f"[{_toml_key(section)}]"]
        lines += [f"{_toml_key(k)} = {_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def write_recommended(path, plan: Plan) -> Row:
    """Write the top candidate's configuration to ``path`` (temporary name, then rename)."""
    from hpcgnn.fileio import atomic_file

    b = plan.best
    if b is None:
        raise InputError(f"{plan.store}: no candidate fits ({plan.rows[0].reason if plan.rows else 'none proposed'}); "
                         f"nothing written to {path}")
    path = Path(path)
    if not path.parent.exists():
        raise InputError(f"{path}: parent directory {path.parent} does not exist")
    p = b.pred
    header = [f"written by `hpcgnn plan {plan.store} --config {plan.config}`: {b.candidate.label}",
              f"predicted {p.epoch_s:.3f} s/epoch, {p.host_peak / 2**30:.2f} GiB peak host memory per rank"
              f" on {plan.topo.ranks} ranks ({plan.topo.ranks_per_node} per node)"]
    text = recommended_toml(plan.config, plan.overrides, plan.store, b, header)
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return b
