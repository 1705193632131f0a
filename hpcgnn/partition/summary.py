"""Summaries of a graph file and of a partition store, as plain dicts (what `hpcgnn inspect`
prints, and ``--json`` writes).

Reads only attributes and small arrays (row pointers, masks, labels); never features. A
partition store's balance is keyed by constraint name (vertices, train, edges); its
``rank_work`` is RAPA's expected per-rank work (:func:`rank_work`).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError


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
