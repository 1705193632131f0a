"""OGB node-property datasets from their raw CSV layout (no ogb package needed).

``ROOT/raw/edge.csv.gz``        one ``src,dst`` pair per line (taken as undirected)
``ROOT/raw/node-feat.csv.gz``   one comma-separated feature row per vertex
``ROOT/raw/node-label.csv.gz``  one label per line; NaN = unlabelled (-1)
``ROOT/raw/num-node-list.csv.gz``  optional: the vertex count
``ROOT/split/<name>/{train,valid,test}.csv.gz``  vertex indices, one per line

This is the layout of an extracted ``ogbn-*.zip`` (e.g. ``products/``). The
split directory is ``--split NAME`` or the only one present. Files may also be
uncompressed (``.csv``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.data.graph import Graph
from hpcgnn.data.plain import check_features, check_splits, mask_from_array, read_text_matrix
from hpcgnn.errors import InputError

SPLIT_FILES = (("train", "train"), ("val", "valid"), ("test", "test"))


def _find(directory: Path, stem: str, required: bool = True) -> Path | None:
    for name in (f"{stem}.csv.gz", f"{stem}.csv"):
        if (directory / name).is_file():
            return directory / name
    if required:
        raise InputError(f"{directory / (stem + '.csv.gz')}: file not found (OGB raw layout)")
    return None


def _split_dir(root: Path, split: str | None) -> Path:
    base = root / "split"
    if not base.is_dir():
        raise InputError(f"{base}: split directory not found (OGB layout needs split/<name>/train.csv.gz ...)")
    if split is not None:
        d = base / split
        if not d.is_dir():
            have = sorted(p.name for p in base.iterdir() if p.is_dir())
            raise InputError(f"{d}: split {split!r} not found, available: {', '.join(have) or 'none'}")
        return d
    dirs = sorted(p for p in base.iterdir() if p.is_dir())
    if len(dirs) != 1:
        raise InputError(f"{base}: {len(dirs)} split directories ({', '.join(p.name for p in dirs) or 'none'}), "
                         "pass --split NAME")
    return dirs[0]


def _labels(path: Path, n: int) -> tuple[np.ndarray, int]:
    raw = read_text_matrix(path, np.float64, what="node labels")
    if raw.shape[1] != 1:
        raise InputError(f"{path}: {raw.shape[1]} label columns, expected 1 (multi-label tasks are not supported)")
    raw = raw[:, 0]
    if raw.shape[0] != n:
        raise InputError(f"{path}: {raw.shape[0]} labels, expected {n} (one per vertex)")
    unlabelled = np.isnan(raw)
    known = raw[~unlabelled]
    if known.size and (np.any(~np.isfinite(known)) or np.any(known != np.round(known)) or known.min() < 0):
        bad = known[(~np.isfinite(known)) | (known != np.round(known)) | (known < 0)][0]
        raise InputError(f"{path}: label {float(bad):g} is out of range, "
                         "expected an integer class >= 0 or NaN (unlabelled)")
    labels = np.where(unlabelled, -1, np.nan_to_num(raw, nan=-1)).astype(np.int64)
    num_classes = int(known.max()) + 1 if known.size else 1
    return labels, num_classes


def load_ogb(root: str | Path, split: str | None = None, name: str | None = None,
             progress: bool = False) -> Graph:
    """Import an OGB node-property dataset directory as a :class:`Graph`."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: OGB dataset directory not found")
    raw = root / "raw"
    if not raw.is_dir():
        raise InputError(f"{raw}: directory not found (OGB layout needs raw/edge.csv.gz ...)")
    split_dir = _split_dir(root, split)
    edge_path = _find(raw, "edge")
    feat_path = _find(raw, "node-feat")
    label_path = _find(raw, "node-label")
    count_path = _find(raw, "num-node-list", required=False)

    features = read_text_matrix(feat_path, np.float32, what="node features", progress=progress)
    n = int(features.shape[0])
    if count_path is not None:
        counts = read_text_matrix(count_path, np.int64, columns=1, what="vertex count").ravel()
        if counts.size != 1:
            raise InputError(f"{count_path}: {counts.size} graphs, expected exactly one")
        if int(counts[0]) != n:
            raise InputError(f"{feat_path}: {n} feature rows, but {count_path.name} says {int(counts[0])} vertices")
    if n < 1:
        raise InputError(f"{feat_path}: no feature rows")
    features = check_features(features, feat_path, n)
    labels, num_classes = _labels(label_path, n)

    masks, sources = {}, {}
    for key, stem in SPLIT_FILES:
        path = _find(split_dir, stem)
        idx = read_text_matrix(path, np.int64, columns=1, what=f"{stem} split").ravel()
        masks[key] = mask_from_array(idx, path, n, key)
        sources[key] = path
    check_splits(masks, sources, labels)

    edges = read_text_matrix(edge_path, np.int64, columns=2, what="edge list", progress=progress)
    indptr, indices, stats = build_symmetric_csr(edges[:, 0], edges[:, 1], n, where=str(edge_path))
    input_edges = int(edges.shape[0])
    del edges
    meta = {
        "name": name or root.name,
        "source": {"importer": "ogb", "root": str(root), "split": split_dir.name, "input_edges": input_edges},
        **stats,
    }
    return Graph(indptr, indices, features, labels, masks["train"], masks["val"], masks["test"],
                 num_classes=num_classes, meta=meta)
