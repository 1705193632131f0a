"""`hpcgnn inspect PATH [--json]`: summarise a graph file or a partition directory.

Reads only attributes and small arrays (row pointers, masks, labels); never features.
``--json`` prints one JSON object; a partition store's balance is keyed by constraint name
(vertices, train, edges).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError


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


def graph_summary(path: Path) -> dict:
    """Sizes, feature width, classes, split sizes and degree statistics of a graph file."""
    from hpcgnn.data.graph import GRAPH_FORMAT, MASKS
    from hpcgnn.fileio import open_h5, read_dataset

    with open_h5(path, GRAPH_FORMAT) as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        for key in ("num_nodes", "num_edges", "num_features", "num_classes"):
            if key not in attrs:
                raise InputError(f"{path}: attribute '{key}' is missing")
        n = int(attrs["num_nodes"])
        degree = np.diff(read_dataset(f, "indptr", np.int64, (n + 1,)))
        index_dtype = str(f["indices"].dtype) if "indices" in f else "missing"
        labels = read_dataset(f, "labels", np.int64, (n,))
        split = {name.removesuffix("_mask"): int(read_dataset(f, name, bool, (n,)).sum()) for name in MASKS}
    try:
        source = json.loads(attrs.get("source", "{}"))
    except json.JSONDecodeError:
        source = attrs.get("source")
    return {
        "kind": "graph", "path": str(path), "name": str(attrs.get("name", path.stem)),
        "num_nodes": n, "num_edges": int(attrs["num_edges"]),
        "num_undirected_edges": int(attrs["num_edges"]) // 2,
        "num_features": int(attrs["num_features"]), "num_classes": int(attrs["num_classes"]),
        "feature_normalization": str(attrs.get("feature_normalization", "none")),
        "feature_dtype": str(attrs.get("feature_dtype", "float32")), "index_dtype": index_dtype,
        "split": split, "labelled": int(np.count_nonzero(labels >= 0)),
        "degree": {"mean": float(degree.mean()) if n else 0.0, "max": int(degree.max()) if n else 0,
                   "isolated": int(np.count_nonzero(degree == 0))},
        "self_loops_removed": int(attrs.get("self_loops_removed", 0)),
        "duplicates_removed": int(attrs.get("duplicates_removed", 0)),
        "source": source,
    }


def partition_summary(directory: Path, rank_speed: str | None = None) -> dict:
    """Edge cut, per-constraint balance, per-partition sizes and replication of a store."""
    from hpcgnn.fileio import open_h5, read_dataset
    from hpcgnn.partition.store import PART_FORMAT, part_file_name, read_meta

    meta = read_meta(directory)
    parts = []
    for p in range(meta.num_parts):
        path = directory / part_file_name(p)
        with open_h5(path, PART_FORMAT) as f:
            n_solid = int(meta.part_offsets[p + 1] - meta.part_offsets[p])
            indptr = read_dataset(f, "indptr", np.int64, (n_solid + 1,))
            send_indptr = read_dataset(f, "send_indptr", np.int64, (meta.num_parts + 1,))
            parts.append({
                "part_id": p, "num_solid": n_solid, "num_halo": int(meta.halo_counts[p]),
                "num_edges": int(indptr[-1]),
                "num_train": int(read_dataset(f, "train_mask", bool, (n_solid,)).sum()),
                "num_send": int(send_indptr[-1]),
            })
    a = meta.attrs
    undirected = meta.num_edges // 2
    summary = {
        "kind": "partitions", "path": str(directory), "num_parts": meta.num_parts,
        "method": meta.method, "seed": meta.seed, "num_nodes": meta.num_nodes,
        "num_edges": meta.num_edges, "num_features": meta.num_features,
        "num_classes": meta.num_classes, "edge_cut": meta.edge_cut,
        "edge_cut_fraction": meta.edge_cut / undirected if undirected else 0.0,
        "constraints": json.loads(a.get("constraints", "[]")),
        "balance": {k: float(meta.balance[k]) for k in ("vertices", "train", "edges") if k in meta.balance},
        "halo_total": int(meta.halo_counts.sum()),
        "replication_factor": (meta.num_nodes + int(meta.halo_counts.sum())) / max(meta.num_nodes, 1),
        "parts": parts,
        "content_hash": meta.content_hash,
        "source_graph": a.get("source_graph"), "source_hash": a.get("source_hash"),
        "tool_versions": json.loads(a.get("tool_versions", "{}")),
        "feature_normalization": str(a.get("feature_normalization", "none")),
        "method_choice": a.get("method_choice"),   # what --method auto chose and why (None: named)
    }
    summary["rank_work"] = rank_work(meta, parts, rank_speed)
    return summary


def rank_work(meta, parts: list, rank_speed: str | None = None) -> dict:
    """Expected per-rank work (RAPA's model, :mod:`hpcgnn.partition.rapa`): W = in-edges +
    solid vertices + halo rows of each part, divided by the rank speed recorded by
    ``partition --rank-speed`` (1 for every rank without it) or given as ``rank_speed`` (a
    ``--rank-speed`` spec), relative to the mean; the rank with the largest is the predicted
    straggler."""
    from hpcgnn.partition import rapa

    speeds, recorded = rapa.store_speeds(meta)
    source = meta.attrs.get("rank_speed_source")
    if rank_speed is not None:
        speeds, source = rapa.read_rank_speed(rank_speed, meta.num_parts)
        recorded = True
    work = rapa.part_work([p["num_edges"] for p in parts], [p["num_solid"] for p in parts],
                          [p["num_halo"] for p in parts])
    pred = rapa.predict(work, speeds)
    out = {"speeds": speeds.tolist(), "speeds_recorded": recorded,
           "speed_source": source,
           "target_fractions": rapa.target_fractions(speeds).tolist(), "work": work.tolist(),
           "relative_time": pred["relative_time"], "predicted_straggler": pred["straggler"],
           "max_over_mean": pred["max_over_mean"]}
    if "halo_trim" in meta.attrs:
        out["halo_trim"] = json.loads(meta.attrs["halo_trim"])
    return out


def summarise(path: str | Path, rank_speed: str | None = None) -> dict:
    """The summary of a graph file, a partition directory, or a store's meta.h5 (``rank_speed``:
    see :func:`rank_work`)."""
    path = Path(path)
    if path.is_dir():
        from hpcgnn.partition.store import META_FILE

        if not (path / META_FILE).exists():
            raise InputError(f"{path}: directory has no {META_FILE}, expected a partition directory")
        return partition_summary(path, rank_speed)
    if not path.exists():
        raise InputError(f"{path}: file not found")
    from hpcgnn.fileio import open_h5
    from hpcgnn.partition.store import META_FORMAT

    with open_h5(path) as f:
        fmt = f.attrs.get("format")
        fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    if fmt == META_FORMAT:
        return partition_summary(path.parent, rank_speed)
    if rank_speed is not None:
        raise InputError(f"{path}: --rank-speed needs a partition directory, not a graph file")
    if fmt != "hpcgnn-graph":
        raise InputError(f"{path}: attribute 'format' is {fmt!r}, expected a graph file ('hpcgnn-graph') "
                         "or a partition directory")
    return graph_summary(path)


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
        ranks.append({"rank": p, "total_bytes": est.total, "terms": est.terms, "largest": name,
                      "largest_bytes": size, "shrink": est.shrink.get(name, ""), "device": est.device})
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
    dev = max(m["ranks"], key=lambda r: sum(v for k, v in r.get("device", {}).items() if k != "chunks"))
    if dev.get("device"):           # tensor engine on a GPU: bytes in device memory, not in the total
        from hpcgnn.units import fmt_bytes

        d = dev["device"]
        lines.append(f"  device memory per rank (not in the totals): NN layers {fmt_bytes(d['nn'])} + one of "
                     f"{d['chunks']} chunk(s) {fmt_bytes(d['chunk'])}")
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
