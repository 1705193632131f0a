"""`hpcgnn inspect PATH [--json]`: summarise a graph file or a partition directory.

Reads only attributes and small arrays (row pointers, masks, labels); never features.
``--json`` prints one JSON object; a partition store's balance is keyed by constraint name
(vertices, train, edges). The summaries are :mod:`hpcgnn.partition.summary`'s; the memory
estimate of ``--config``, the text and the flow are here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hpcgnn.errors import InputError
from hpcgnn.partition.summary import summarise


EXAMPLES = """examples:
  hpcgnn inspect data/cora.h5
  hpcgnn inspect data/cora-metis-2
  hpcgnn inspect data/cora-metis-2 --config inputs/cora-sage.toml   # each rank's memory estimate
  hpcgnn inspect data/cora-metis-2 --json
"""


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="PATH", help="graph file (.h5) or partition directory")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="with a partition directory: estimate every rank's peak memory for "
                             "this training configuration")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a configuration key of --config (repeatable)")
    parser.add_argument("--rank-speed", default=None, metavar="LIST|FILE|RUN",
                        help="with a partition directory: predict the per-rank work and the straggler for "
                             "these rank speeds (as for `partition --rank-speed`) instead of the recorded ones")


def _normalised(s: dict) -> str:
    """" (row-normalised)" when the features were normalised by `prepare`, else ""."""
    norm = s.get("feature_normalization", "none")
    return "" if norm in ("none", None) else f" ({norm}-normalised)"


def _text(s: dict) -> str:
    if s["kind"] == "graph":
        sp, dg = s["split"], s["degree"]
        norm = _normalised(s)
        return "\n".join([
            f"graph {s['path']} ({s['name']})",
            f"  vertices {s['num_nodes']:,}  edges {s['num_undirected_edges']:,} undirected "
            f"({s['num_edges']:,} directed)",
            f"  features {s['num_features']}{norm}  classes {s['num_classes']}  labelled {s['labelled']:,}",
            f"  stored as features {s['feature_dtype']}, vertex IDs {s['index_dtype']}",
            f"  split train {sp['train']:,}  val {sp['val']:,}  test {sp['test']:,}",
            f"  degree mean {dg['mean']:.2f}  max {dg['max']:,}  isolated {dg['isolated']:,}",
        ])
    bal = "  ".join(f"{k} {v:.3f}" for k, v in s["balance"].items())
    lines = [
        f"partition store {s['path']}: {s['num_parts']} parts ({s['method']}, seed {s['seed']})",
        f"  graph: vertices {s['num_nodes']:,}  edges {s['num_edges'] // 2:,} undirected  "
        f"features {s['num_features']}{_normalised(s)}  classes {s['num_classes']}",
        f"  edge cut {s['edge_cut']:,} ({100 * s['edge_cut_fraction']:.2f}% of edges)",
        f"  balance (max/mean): {bal}   constraints: {','.join(s['constraints']) or '-'}",
        *([f"  {s['method_choice']}"] if s.get("method_choice") else []),
        f"  halo total {s['halo_total']:,}   replication factor {s['replication_factor']:.3f}",
        f"  {'part':>5} {'solid':>12} {'halo':>12} {'in-edges':>14} {'train':>10} {'send':>12}",
    ]
    for p in s["parts"]:
        lines.append(f"  {p['part_id']:>5} {p['num_solid']:>12,} {p['num_halo']:>12,} {p['num_edges']:>14,} "
                     f"{p['num_train']:>10,} {p['num_send']:>12,}")
    w = s.get("rank_work")
    if w:
        src = f"rank speeds {', '.join(f'{x:.4g}' for x in w['speeds'])} ({w['speed_source']})" \
            if w["speeds_recorded"] else "equal rank speeds (none recorded)"
        lines.append(f"  expected per-rank work (in-edges + solid + halo) / speed, {src}:")
        lines.append(f"  {'rank':>5} {'work':>14} {'speed':>8} {'time/mean':>10}")
        for r, (x, sp, t) in enumerate(zip(w["work"], w["speeds"], w["relative_time"])):
            lines.append(f"  {r:>5} {x:>14,.0f} {sp:>8.3g} {t:>10.3f}")
        lines.append(f"  predicted straggler: rank {w['predicted_straggler']} "
                     f"({w['max_over_mean']:.3f} x the mean)")
        if "halo_trim" in w:
            t = w["halo_trim"]
            lines.append(f"  halo trimming (threshold {t['threshold']:g}): removed halos {t['removed_halos']}, "
                         f"in-edges {t['removed_edges']}")
    return "\n".join(lines)


def memory_estimates(store: Path, config: str, overrides: list[str]) -> dict:
    """Every rank's estimated peak memory (bytes per term) for ``config`` on ``store``; the
    baseline is this process's RSS with torch and the kernels imported."""
    # the baseline includes what a rank imports: every engine, the data plane, MPI
    import torch.distributed  # noqa: F401
    from mpi4py import MPI  # noqa: F401

    import hpcgnn.comm.communicator  # noqa: F401
    import hpcgnn.engine.fullgraph  # noqa: F401
    import hpcgnn.engine.minibatch  # noqa: F401
    import hpcgnn.engine.tensor  # noqa: F401
    import hpcgnn.native  # noqa: F401
    from hpcgnn.engine.estimate import estimate_rank_memory
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.config import load_config
    from hpcgnn.run.memory import node_available_bytes, rss_bytes

    cfg = load_config(config, [*overrides, f"data.partitions={store}"])
    meta = read_meta(store)
    base = rss_bytes()
    ranks = []
    for p in range(meta.num_parts):
        est = estimate_rank_memory(cfg, meta, p, base)
        name, size = est.largest()
        ranks.append({"rank": p, "total_bytes": est.total, "floor_bytes": est.floor(), "terms": est.terms,
                      "largest": name, "largest_bytes": size, "shrink": est.shrink.get(name, ""),
                      "device": est.device})
    avail, source = node_available_bytes()
    return {"config": str(config), "engine": cfg.train.engine, "ranks": ranks,
            "sum_bytes": sum(r["total_bytes"] for r in ranks),
            "this_machine_available_bytes": avail, "available_source": source}


def _memory_text(m: dict) -> str:
    names = []
    for r in m["ranks"]:
        names += [k for k in r["terms"] if k not in names]
    head = ["rank"] + [f"{k}_GiB" for k in names] + ["total_GiB"]
    rows = [head] + [[str(r["rank"])] + [f"{r['terms'].get(k, 0) / 2**30:.2f}" for k in names] +
                     [f"{r['total_bytes'] / 2**30:.2f}"] for r in m["ranks"]]
    w = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"estimated peak memory per rank ({m['engine']} engine, {m['config']}):"]
    lines += ["  " + "  ".join(c.rjust(x) for c, x in zip(row, w)) for row in rows]
    worst = max(m["ranks"], key=lambda r: r["total_bytes"])
    lines.append(f"  all ranks together {m['sum_bytes'] / 2**30:.2f} GiB; this machine offers "
                 f"{m['this_machine_available_bytes'] / 2**30:.2f} GiB ({m['available_source']}); "
                 f"largest term {worst['largest']} on rank {worst['rank']}: shrink with {worst['shrink']}")
    dev = max(m["ranks"], key=lambda r: sum(r.get("device", {}).values()))
    if dev.get("device"):           # the compute device's terms (on the CPU: what its meter counts)
        from hpcgnn.units import fmt_bytes

        d = dev["device"]
        lines.append(f"  device memory of rank {dev['rank']} (not in the totals): {fmt_bytes(sum(d.values()))} ("
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.items() if v) + ")")
    return "\n".join(lines)


def run(args) -> int:
    summary = summarise(args.path, getattr(args, "rank_speed", None))
    if args.config:
        if not Path(args.path).is_dir():
            raise InputError(f"{args.path}: --config needs a partition directory, not a graph file")
        summary["memory_estimate"] = memory_estimates(Path(args.path), args.config, args.set)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(_text(summary))
        if "memory_estimate" in summary:
            print(_memory_text(summary["memory_estimate"]))
    sys.stdout.flush()
    return 0
