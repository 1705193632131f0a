"""OGB node-property datasets from their raw CSV or binary layout (no ogb package needed).

CSV layout (:func:`load_ogb`, read whole):

``ROOT/raw/edge.csv.gz``        one ``src,dst`` pair per line (taken as undirected)
``ROOT/raw/node-feat.csv.gz``   one comma-separated feature row per vertex
``ROOT/raw/node-label.csv.gz``  one label per line; NaN = unlabelled (-1)
``ROOT/raw/num-node-list.csv.gz``  optional: the vertex count

Binary layout (:func:`ogb_binary_source`, read in blocks: ogbn-papers100M ships in it; OGB's
``DatasetSaver`` writes it with ``np.savez_compressed``, ``read_binary_graph_raw`` reads it):

``ROOT/raw/data.npz``           ``edge_index`` [2, E] int64, ``node_feat`` [N, F] float32,
                                ``num_nodes_list`` [1], ``num_edges_list`` [1] (one graph), and
                                optional ``node_*`` arrays (``node_year``: not imported)
``ROOT/raw/node-label.npz``     ``node_label`` [N, 1] float; NaN = unlabelled (-1)

Both: ``ROOT/split/<name>/{train,valid,test}.csv.gz`` (vertex indices, one per line) or
``ROOT/split/<name>/split_dict.pt`` (a torch file of a dict of index arrays ``train``,
``valid``, ``test``, written by newer ogb).

This is the layout of an extracted ``ogbn-*.zip`` (e.g. ``products/``). The
split directory is ``--split NAME`` or the only one present. CSV files may also be
uncompressed (``.csv``). The binary layout is used when ``raw/data.npz`` exists.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcgnn.data.build import GraphSource
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
    return _labels_from_floats(raw, path)


def _labels_from_floats(raw: np.ndarray, path: Path) -> tuple[np.ndarray, int]:
    """(int64 labels, class count) of float labels, NaN = unlabelled (-1)."""
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


# ---------------------------------------------------------------- binary layout

BLOCK = 1 << 22          # elements per read of an .npz member


def is_binary_layout(root: str | Path) -> bool:
    """Whether ``root`` holds OGB's binary layout (``raw/data.npz``)."""
    return (Path(root) / "raw" / "data.npz").is_file()


def _split_indices(split_dir: Path) -> dict[str, tuple[np.ndarray, Path]]:
    """{train/val/test: (vertex indices, the file they came from)} of a split directory:
    ``{train,valid,test}.csv[.gz]``, else ``split_dict.pt``."""
    if _find(split_dir, "train", required=False) is not None or not (split_dir / "split_dict.pt").is_file():
        out = {}
        for key, stem in SPLIT_FILES:
            path = _find(split_dir, stem)
            out[key] = (read_text_matrix(path, np.int64, columns=1, what=f"{stem} split").ravel(), path)
        return out
    path = split_dir / "split_dict.pt"
    d = _load_split_dict(path)
    out = {}
    for key, stem in SPLIT_FILES:
        if stem not in d:
            raise InputError(f"{path}: key '{stem}' not found (the file has {sorted(map(str, d))})")
        idx = np.asarray(d[stem].numpy() if hasattr(d[stem], "numpy") else d[stem])
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise InputError(f"{path}: '{stem}' is {idx.dtype} {idx.shape}, expected 1-D integer vertex indices")
        out[key] = (idx.astype(np.int64), path)
    return out


def _load_split_dict(path: Path) -> dict:
    """OGB's ``split_dict.pt``: a dict of numpy arrays or tensors, loaded with torch's
    weights-only unpickler and numpy's array types allowed (no other code runs)."""
    import torch
    from numpy._core.multiarray import _reconstruct

    allowed = [np.ndarray, _reconstruct, np.dtype,
               *(getattr(np.dtypes, k) for k in dir(np.dtypes) if k.endswith("DType"))]
    try:
        with torch.serialization.safe_globals(allowed):
            d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for unreadable or unsafe files
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise InputError(f"{path}: not a readable split_dict.pt ({exc.__class__.__name__}: {first})") from None
    if not isinstance(d, dict):
        raise InputError(f"{path}: holds {type(d).__name__}, expected a dict of train/valid/test indices")
    return d


def ogb_binary_source(root: str | Path, split: str | None = None, name: str | None = None) -> GraphSource:
    """An OGB node-property dataset in the binary layout as a
    :class:`~hpcgnn.data.build.GraphSource`: its arrays are read in blocks when streamed
    (:mod:`hpcgnn.data.npz`), never whole."""
    from hpcgnn.data.npz import NpzArchive

    root = Path(root)
    raw = root / "raw"
    split_dir = _split_dir(root, split)
    data_path, label_path = raw / "data.npz", raw / "node-label.npz"
    if not label_path.is_file():
        raise InputError(f"{label_path}: file not found (OGB binary layout)")
    with NpzArchive(data_path) as data:
        counts = data.read("num_nodes_list").ravel()
        if counts.size != 1:
            raise InputError(f"{data_path}: 'num_nodes_list' lists {counts.size} graphs, expected exactly one")
        n = int(counts[0])
        edge = data.member("edge_index", 2)
        if edge.shape[0] != 2 or edge.dtype.kind not in "iu":
            raise InputError(f"{data_path}: 'edge_index' is {edge.dtype} {edge.shape}, expected integer (2, E)")
        m = edge.shape[1]
        ecounts = data.read("num_edges_list").ravel()
        if ecounts.size != 1 or int(ecounts[0]) != m:
            raise InputError(f"{data_path}: 'num_edges_list' is {ecounts.tolist()}, expected [{m}] (the "
                             "columns of 'edge_index')")
        feat = data.member("node_feat", 2)
        if feat.shape[0] != n or feat.dtype.kind not in "fiu":
            raise InputError(f"{data_path}: 'node_feat' is {feat.dtype} {feat.shape}, expected numeric ({n}, F)")
        if feat.fortran_order and feat.shape[1] > 1:
            raise InputError(f"{data_path}: 'node_feat' is stored in Fortran order, expected C order (rows "
                             "contiguous, as OGB writes it)")
        f = feat.shape[1]
    with NpzArchive(label_path) as labels_npz:
        lab = labels_npz.member("node_label")
        if lab.shape not in ((n,), (n, 1)):
            raise InputError(f"{label_path}: 'node_label' has shape {lab.shape}, expected ({n}, 1) (one label "
                             "per vertex; multi-label tasks are not supported)")

    def vertex_data():
        with NpzArchive(label_path) as labels_npz:
            labels, _ = _read_binary_labels(labels_npz.member("node_label"), label_path)
        masks, sources = {}, {}
        for key, (idx, path) in _split_indices(split_dir).items():
            masks[key] = mask_from_array(idx, path, n, key)
            sources[key] = path
        check_splits(masks, sources, labels)
        return labels, masks["train"], masks["val"], masks["test"]

    def edges():
        with NpzArchive(data_path) as a:
            e = a.member("edge_index", 2)
            if e.fortran_order:
                for pairs in e.blocks(0, 2 * m, 2 * BLOCK):
                    pairs = pairs.reshape(-1, 2)
                    yield pairs[:, 0], pairs[:, 1]
            else:
                yield from zip(e.blocks(0, m, BLOCK), e.blocks(m, m, BLOCK))

    def features(rows: int):
        with NpzArchive(data_path) as a:
            for block in a.member("node_feat", 2).blocks(0, n * f, max(1, rows) * f):
                yield block.reshape(-1, f).astype(np.float32, copy=False)

    meta = {"name": name or root.name,
            "source": {"importer": "ogb", "layout": "binary", "root": str(root), "split": split_dir.name,
                       "input_edges": int(m)}}
    return GraphSource(meta["name"], n, f, None, vertex_data, edges, features, meta=meta,
                       vertex_bytes=0, input_edges=int(m), where=str(data_path))


def _read_binary_labels(member, path: Path) -> tuple[np.ndarray, int]:
    """(int64 labels, class count) of ``node_label`` read in blocks; NaN = unlabelled."""
    n = member.shape[0]
    labels = np.empty(n, dtype=np.int64)
    at, top = 0, -1
    for block in member.blocks(block=BLOCK):
        block = block.astype(np.float64, copy=False)
        part, classes = _labels_from_floats(block, path)
        if part.size and part.max() >= 0:
            top = max(top, classes - 1)
        labels[at:at + block.shape[0]] = part
        at += block.shape[0]
    return labels, max(1, top + 1)
