"""The canonical in-memory graph and its HDF5 file (see docs/formats.md).

A :class:`Graph` is undirected, stored symmetrised as an in-edge CSR with no
self-loops and no duplicate edges. Importers and generators build one with
:func:`hpcgnn.data.clean.build_symmetric_csr` and write it with
:func:`write_graph`; every other command reads it with :func:`read_graph`.

Integrity: the writer records each dataset's sha256 in the attribute ``dataset_hashes``;
readers that validate verify the datasets they read against it and check the CSR invariants
(rows sorted without duplicates, no self-loops, symmetric), so a corrupt file is refused in
one line naming the file and the dataset. Files written before the hashes were recorded get
the invariant checks only.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from hpcgnn import __version__
from hpcgnn.errors import InputError
from hpcgnn.fileio import atomic_file, check_output, open_h5, read_dataset

GRAPH_FORMAT = "hpcgnn-graph"
GRAPH_VERSION = 1
MASKS = ("train_mask", "val_mask", "test_mask")
HASH_ATTR = "dataset_hashes"
_CORRUPT = "the file is corrupt or was modified; run hpcgnn prepare again"


@dataclass
class Graph:
    """An undirected graph with vertex data.

    indptr  int64 [N+1]   in-edge CSR row pointer (row = destination)
    indices int64 or int32 [E]  sources, sorted within a row; E counts both directions
    features float32 [N, F]  (the file may store them as float16 or bfloat16: :func:`read_graph`
                          decodes them)
    labels  int64 [N]     class in [0, num_classes) or -1 (unlabelled)
    train_mask / val_mask / test_mask  bool [N], pairwise disjoint
    meta    name, source (dict), self_loops_removed, duplicates_removed, feature_normalization
            ("none" or "row", see hpcgnn/data/features.py)
    """

    indptr: np.ndarray
    indices: np.ndarray
    features: np.ndarray
    labels: np.ndarray
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    num_classes: int
    meta: dict = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def degree(self) -> np.ndarray:
        return np.diff(self.indptr)

    def validate(self, where: str = "graph", topology: bool = True) -> None:
        """Raise InputError naming ``where`` and the field if any invariant fails.

        ``topology=False`` skips the rows-sorted, self-loop and symmetry checks of
        :func:`check_topology` (for a CSR :func:`read_topology` already checked).
        """
        n = self.num_nodes
        if n < 1:
            raise InputError(f"{where}: graph has no vertices")
        _check_csr(where, self.indptr, self.indices, n)
        if topology:
            check_topology(where, self.indptr, self.indices)
        if self.features.ndim != 2 or self.features.shape[0] != n:
            raise InputError(f"{where}: 'features' has shape {self.features.shape}, expected ({n}, F)")
        bits = self.features.dtype == np.uint16       # bfloat16 as stored (read_graph(decode_features=False))
        row = _first_nonfinite_row(self.features, "bfloat16" if bits else "float32")
        if row >= 0:
            raise InputError(f"{where}: 'features' holds NaN or inf (first at row {row})")
        if self.labels.shape != (n,):
            raise InputError(f"{where}: 'labels' has shape {self.labels.shape}, expected ({n},)")
        check_vertex_data(where, self.labels, self.num_classes, {name: getattr(self, name) for name in MASKS})


def check_vertex_data(where: str, labels: np.ndarray, num_classes: int, masks: dict) -> None:
    """Refuse (InputError naming ``where``) labels outside -1 .. C-1 and split masks (``masks``:
    name -> bool [N]) of the wrong length, selecting an unlabelled vertex or overlapping."""
    n = labels.shape[0] if labels.ndim == 1 else -1
    if labels.ndim != 1:
        raise InputError(f"{where}: 'labels' has shape {labels.shape}, expected (N,)")
    if num_classes < 1:
        raise InputError(f"{where}: num_classes is {num_classes}, expected >= 1")
    bad = (labels < -1) | (labels >= num_classes)
    if np.any(bad):
        v = int(labels[np.argmax(bad)])
        raise InputError(f"{where}: 'labels' holds {v}, expected -1 or a class in [0, {num_classes})")
    union = np.zeros(n, dtype=np.int8)
    for name in MASKS:
        m = masks[name]
        if m.shape != (n,):
            raise InputError(f"{where}: '{name}' has length {m.shape[0] if m.ndim else 0}, expected {n}")
        if np.any(m & (labels < 0)):
            raise InputError(f"{where}: '{name}' selects an unlabelled vertex (label -1)")
        union += m
    if np.any(union > 1):
        raise InputError(f"{where}: split masks overlap (vertex {int(np.argmax(union > 1))} is in two splits)")


INDEX_DTYPES = ("auto", "int32", "int64")


def index_dtype_for(num_nodes: int, requested: str = "auto") -> np.dtype:
    """The dtype of dataset 'indices' for ``num_nodes`` vertices: ``requested`` int32 or int64,
    or ``auto``: int32 where every vertex ID fits 32 bits (N <= 2**31), else int64. int32 for
    more vertices is an InputError naming the count."""
    if requested not in INDEX_DTYPES:
        raise InputError(f"--index-dtype is {requested!r}, expected one of: {', '.join(INDEX_DTYPES)}")
    fits32 = int(num_nodes) - 1 <= np.iinfo(np.int32).max
    if requested == "int32" and not fits32:
        raise InputError(f"--index-dtype int32: {int(num_nodes):,} vertices do not fit 32-bit vertex IDs (at most "
                         f"{np.iinfo(np.int32).max + 1:,} vertices); use --index-dtype int64 or auto")
    if requested == "int64" or not fits32:
        return np.dtype(np.int64)
    return np.dtype(np.int32)


def root_attrs(meta: dict, name: str, num_nodes: int, num_edges: int, num_features: int, num_classes: int,
               feature_dtype: str = "float32") -> dict:
    """The root attributes of a graph file (docs/formats.md) but ``dataset_hashes``."""
    return {
        "format": GRAPH_FORMAT, "version": GRAPH_VERSION, "name": str(meta.get("name", name)),
        "source": json.dumps(meta.get("source", {}), sort_keys=True),
        "num_nodes": int(num_nodes), "num_edges": int(num_edges), "num_features": int(num_features),
        "num_classes": int(num_classes), "symmetrized": True,
        "self_loops_removed": int(meta.get("self_loops_removed", 0)),
        "duplicates_removed": int(meta.get("duplicates_removed", 0)),
        "feature_normalization": str(meta.get("feature_normalization", "none")),
        "feature_dtype": str(feature_dtype), "hpcgnn_version": __version__,
    }


class GraphFileWriter:
    """Writes the datasets of one graph file into an open, empty h5py.File, whole (:meth:`put`)
    or in consecutive blocks of rows (:meth:`rows`), each hashed as it is written
    (:func:`dataset_hash`), then the root attributes with ``dataset_hashes`` (:meth:`finish`).
    Datasets are contiguous (no chunks, no filters), as :func:`write_graph` writes them."""

    def __init__(self, f: h5py.File):
        self._f = f
        self._hashes: dict[str, str] = {}
        self._open: dict[str, "_RowWriter"] = {}

    def put(self, name: str, a: np.ndarray, attrs: dict | None = None) -> None:
        a = np.ascontiguousarray(a)
        ds = self._f.create_dataset(name, data=a)
        for key, value in (attrs or {}).items():
            ds.attrs[key] = value
        self._hashes[name] = dataset_hash(name, a)

    def rows(self, name: str, dtype, shape: tuple, attrs: dict | None = None) -> "_RowWriter":
        """A writer of dataset ``name`` that takes its rows in order (``append``), then ``close``."""
        ds = self._f.create_dataset(name, shape=tuple(int(s) for s in shape), dtype=np.dtype(dtype))
        for key, value in (attrs or {}).items():
            ds.attrs[key] = value
        w = self._open[name] = _RowWriter(ds, name)
        return w

    def finish(self, attrs: dict) -> None:
        """Close every row writer (each must be complete) and write ``attrs`` and the hashes."""
        for name, w in self._open.items():
            self._hashes[name] = w.close()
        self._open.clear()
        for key, value in attrs.items():
            self._f.attrs[key] = value
        self._f.attrs[HASH_ATTR] = json.dumps(self._hashes, sort_keys=True)


class _RowWriter:
    """Consecutive row blocks of one dataset, hashed as they arrive."""

    def __init__(self, ds: h5py.Dataset, name: str):
        self._ds, self._name, self._pos = ds, name, 0
        self._hasher = DatasetHasher(name, ds.dtype, ds.shape)

    @property
    def position(self) -> int:
        return self._pos

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self._ds.dtype)
        k = block.shape[0]
        if self._pos + k > self._ds.shape[0]:
            raise ValueError(f"dataset '{self._name}': {self._pos + k} rows written, shape {self._ds.shape}")
        if k:
            self._ds[self._pos:self._pos + k] = block
            self._hasher.update(block)
        self._pos += k

    def close(self) -> str:
        if self._pos != self._ds.shape[0]:
            raise ValueError(f"dataset '{self._name}': {self._pos} of {self._ds.shape[0]} rows written")
        return self._hasher.hexdigest()


def write_graph(path: str | os.PathLike, graph: Graph, force: bool = False, feature_dtype: str = "float32",
                index_dtype: str = "int64", block_rows: int = 1 << 16) -> Path:
    """Validate ``graph`` and write it atomically to ``path``, with each dataset's sha256
    (:func:`dataset_hash`) in the attribute ``dataset_hashes``.

    ``feature_dtype``: float32, float16 or bfloat16 (:mod:`hpcgnn.data.features`; stored as
    uint16 bit patterns with the dataset attribute ``dtype = "bfloat16"``), recorded in the root
    attribute ``feature_dtype``. ``index_dtype``: int64, int32 or auto (:func:`index_dtype_for`).
    Features are encoded ``block_rows`` rows at a time (a few MB beyond the graph).
    """
    from hpcgnn.data.features import encode_features, stored_dtype

    path = check_output(path, force)
    graph.validate(str(path))
    ix_dtype = index_dtype_for(graph.num_nodes, index_dtype)
    n, feats = graph.num_nodes, graph.num_features
    with atomic_file(path) as tmp:
        with h5py.File(tmp, "w", track_order=False) as f:
            w = GraphFileWriter(f)
            w.put("indptr", np.ascontiguousarray(graph.indptr, dtype=np.int64))
            w.put("indices", np.ascontiguousarray(graph.indices, dtype=ix_dtype))
            fw = w.rows("features", stored_dtype(feature_dtype), (n, feats),
                        {"dtype": "bfloat16"} if feature_dtype == "bfloat16" else None)
            for lo in range(0, n, block_rows):
                fw.append(encode_features(graph.features[lo:lo + block_rows], feature_dtype, str(path), lo))
            w.put("labels", np.ascontiguousarray(graph.labels, dtype=np.int64))
            for name in MASKS:
                w.put(name, np.ascontiguousarray(getattr(graph, name), dtype=bool))
            w.finish(root_attrs(graph.meta, path.stem, n, graph.num_edges, feats, graph.num_classes,
                                feature_dtype))
    return path


class DatasetHasher:
    """Streaming :func:`dataset_hash`: feed the array's blocks in order with :meth:`update`."""

    def __init__(self, name: str, dtype, shape: tuple):
        self._h = hashlib.sha256()
        for part in (name, str(np.dtype(dtype)), repr(tuple(int(s) for s in shape))):
            self._h.update(part.encode())
        self._dtype = np.dtype(dtype)

    def update(self, block: np.ndarray) -> None:
        self._h.update(np.ascontiguousarray(block, dtype=self._dtype).reshape(-1).view(np.uint8))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def dataset_hash(name: str, a: np.ndarray) -> str:
    """Hex sha256 of a graph file dataset as recorded in ``dataset_hashes``: its name, dtype,
    shape, then its bytes in C order (the layout of hpcgnn.partition.store.datasets_digest)."""
    h = DatasetHasher(name, a.dtype, a.shape)
    h.update(a)
    return h.hexdigest()


def recorded_hashes(f: h5py.File) -> dict | None:
    """The file's ``dataset_hashes`` ({dataset: hex sha256}), or None for a file written before
    they were recorded."""
    raw = f.attrs.get(HASH_ATTR)
    if raw is None:
        return None
    try:
        hashes = json.loads(_text_attr(raw))
    except ValueError:
        hashes = None
    if not isinstance(hashes, dict):
        raise InputError(f"{f.filename}: attribute '{HASH_ATTR}' is not a JSON object of dataset hashes "
                         f"({_CORRUPT})")
    return hashes


def verify_hash(f: h5py.File, recorded: dict | None, name: str, digest: str) -> None:
    """Refuse dataset ``name`` whose sha256 ``digest`` differs from the recorded one."""
    if recorded is not None and recorded.get(name) != digest:
        raise InputError(f"{f.filename}: dataset '{name}' does not match the file's recorded content hash "
                         f"({_CORRUPT})")


def check_topology(where: str, indptr: np.ndarray, indices: np.ndarray, block: int = 1 << 22) -> None:
    """Refuse (InputError naming ``where`` and dataset 'indices') a CSR whose rows are not
    strictly increasing (unsorted or duplicate edges), that holds a self-loop, or that is not
    symmetric. ``indptr`` must already be a valid row pointer and IDs in range (_check_csr).

    Symmetry is tested by fingerprint: with random 64-bit a and b, the sums of a[u] * b[v] and
    of b[u] * a[v] over the edges u -> v (mod 2**64) are equal for a symmetric edge multiset, and
    equal for an asymmetric one with probability about 2**-60; a failure then names a vertex
    whose in- and out-degree differ when there is one. Vectorised over blocks of whole rows of
    about ``block`` edges (temporaries: a few times ``block`` x 8 bytes), one pass over ``indices``,
    which may be any object with ``dtype`` whose slices ``indices[lo:hi]`` are arrays (a file read
    in blocks: :class:`hpcgnn.data.external_sort.RawArray`).
    """
    n = indptr.shape[0] - 1
    m = int(indptr[-1])
    if m == 0:
        return
    rng = np.random.default_rng(0x6870636E)
    a, b = rng.bit_generator.random_raw(n), rng.bit_generator.random_raw(n)
    row_dtype = np.int32 if indices.dtype == np.int32 else np.int64
    forward, backward = np.uint64(0), np.uint64(0)
    # Row blocks of about `block` entries (a longer row is a block of its own).
    bounds = np.unique(np.searchsorted(indptr, np.arange(0, m, block, dtype=np.int64), side="right") - 1)
    bounds = np.append(bounds, n)
    with np.errstate(over="ignore"):
        for r0, r1 in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            lo, hi = int(indptr[r0]), int(indptr[r1])
            ix, deg = indices[lo:hi], np.diff(indptr[r0:r1 + 1])
            rows = np.repeat(np.arange(r0, r1, dtype=row_dtype), deg)
            loop = ix == rows
            if loop.any():
                v = int(rows[np.argmax(loop)])
                raise InputError(f"{where}: dataset 'indices' holds a self-loop at vertex {v} "
                                 f"(the format has none; {_CORRUPT})")
            bad = ix[1:] <= ix[:-1]
            nonempty = np.flatnonzero(deg)
            starts = indptr[r0:r1][nonempty] - lo      # first entry of each non-empty row
            bad[starts[1:] - 1] = False                # a row's first entry may be below the last one's
            if bad.any():
                v = int(rows[np.argmax(bad) + 1])
                raise InputError(f"{where}: dataset 'indices' is not sorted within row {v} (sources must "
                                 f"increase strictly: sorted, no duplicate edges; {_CORRUPT})")
            dest = nonempty + r0
            forward += np.sum(np.add.reduceat(a[ix], starts) * b[dest], dtype=np.uint64)
            backward += np.sum(np.add.reduceat(b[ix], starts) * a[dest], dtype=np.uint64)
    if forward != backward:
        in_degree, out_degree = np.diff(indptr), np.zeros(n, dtype=np.int64)
        for lo in range(0, m, block):
            out_degree += np.bincount(indices[lo:lo + block], minlength=n)
        differ = np.flatnonzero(in_degree != out_degree)
        v = int(differ[0]) if differ.size else -1
        which = " (an edge u -> v has no v -> u)" if v < 0 else \
            f": vertex {v} has {in_degree[v]} in-edges but is the source of {out_degree[v]} edges"
        raise InputError(f"{where}: dataset 'indices' is not symmetric{which} ({_CORRUPT})")


def read_graph_attrs(path: str | os.PathLike) -> dict:
    """The root attributes of a graph file (cheap: reads no arrays)."""
    with open_h5(path, GRAPH_FORMAT) as f:
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}


def read_topology(path: str | os.PathLike, index_dtype=np.int64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indptr int64, indices, train_mask) of a graph file with the CSR checked: what a partitioner
    needs before the rest of the file (read and checked by :func:`read_graph`) arrives.

    Checked: IDs in range and indptr a row pointer, then the three datasets against the file's
    recorded hashes (when it has them), then rows sorted, no self-loops and symmetry
    (:func:`check_topology`); the first failure is an InputError naming the file and dataset.

    ``index_dtype`` (int64 or int32) is the dtype of the returned ``indices``: int32 halves
    their memory. They are read in blocks and converted block by block, so the file's int64
    array is never held whole. int32 needs fewer than 2**31 vertices (InputError otherwise).
    """
    index_dtype = np.dtype(index_dtype)
    if index_dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise ValueError(f"index_dtype {index_dtype}: expected int64 or int32")
    with open_h5(path, GRAPH_FORMAT) as f:
        if "num_nodes" not in f.attrs:
            raise InputError(f"{path}: attribute 'num_nodes' is missing")
        n = int(f.attrs["num_nodes"])
        if n > np.iinfo(index_dtype).max:
            raise InputError(f"{path}: {n} vertices do not fit {index_dtype} vertex IDs")
        recorded = recorded_hashes(f)
        indptr = read_dataset(f, "indptr", np.int64, (n + 1,))
        indices, indices_hash = _read_indices(f, n, index_dtype)
        train = read_dataset(f, "train_mask", bool, (n,))
        if n < 1:
            raise InputError(f"{path}: graph has no vertices")
        _check_csr(str(path), indptr, indices, n)
        verify_hash(f, recorded, "indptr", dataset_hash("indptr", indptr))
        verify_hash(f, recorded, "indices", indices_hash)
        verify_hash(f, recorded, "train_mask", dataset_hash("train_mask", train))
    check_topology(str(path), indptr, indices)
    return indptr, indices, train


def _check_csr(where: str, ip: np.ndarray, ix: np.ndarray, n: int) -> None:
    check_row_pointer(where, ip, ix.shape[0])
    check_vertex_ids(where, ix, n)


def check_row_pointer(where: str, ip: np.ndarray, edges: int, rows: int | None = None, hint: str = "") -> None:
    """Refuse (InputError naming ``where``) an ``indptr`` that is not a CSR row pointer of
    ``edges`` entries: from 0, non-decreasing, ending at ``edges`` (and ``rows`` + 1 long when
    given). ``hint``: appended to the message."""
    if (rows is not None and ip.shape != (rows + 1,)) or ip[0] != 0 or ip[-1] != edges or np.any(np.diff(ip) < 0):
        raise InputError(f"{where}: 'indptr' is not a valid CSR row pointer for {edges} edges{hint}")


def check_vertex_ids(where: str, ix: np.ndarray, n: int, hint: str = "") -> None:
    """Refuse (InputError naming ``where``) vertex IDs ``ix`` outside ``[0, n)``; ``hint``:
    appended to the message."""
    if ix.size:
        low, high = int(ix.min()), int(ix.max())
        if low < 0 or high >= n:
            bad = low if low < 0 else high
            raise InputError(f"{where}: 'indices' holds vertex ID {bad}, expected IDs in [0, {n}){hint}")


def _read_indices(f: h5py.File, n: int, dtype: np.dtype, block: int = 1 << 23) -> tuple[np.ndarray, str]:
    """(dataset 'indices' (checked like read_dataset; stored as int32 or int64) as ``dtype``, read
    ``block`` entries at a time; its :func:`dataset_hash` in its stored dtype, computed from the
    blocks as they arrive).

    IDs outside [0, n) are reported here (as :func:`_check_csr` words it), before a narrowing
    conversion could hide them.
    """
    where = f"{f.filename}: dataset 'indices'"
    if "indices" not in f:
        raise InputError(f"{where} is missing")
    ds = f["indices"]
    if not isinstance(ds, h5py.Dataset):
        raise InputError(f"{where} is not a dataset")
    if ds.dtype.kind not in "iu":
        raise InputError(f"{where} has dtype {ds.dtype}, expected int32 or int64")
    if len(ds.shape) != 1:
        raise InputError(f"{where} has shape {ds.shape}, expected (*)")
    if ds.dtype == dtype:
        indices = np.asarray(ds[()])
        return indices, dataset_hash("indices", indices)
    m = ds.shape[0]
    out = np.empty(m, dtype=dtype)
    hasher = DatasetHasher("indices", ds.dtype, (m,))
    lo, hi = 0, 0
    for a in range(0, m, block):
        chunk = ds[a:a + block]
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
        if lo < 0 or hi >= n:
            raise InputError(f"{f.filename}: 'indices' holds vertex ID {lo if lo < 0 else hi}, "
                             f"expected IDs in [0, {n})")
        hasher.update(chunk)
        out[a:a + block] = chunk
    return out, hasher.hexdigest()


def _read_features(f: h5py.File, n: int, decode: bool, recorded: dict | None) -> tuple[np.ndarray, str]:
    """(dataset 'features', its stored dtype name): decoded to float32 when ``decode``, else as
    stored (bfloat16 as its uint16 bit patterns); checked against the recorded hash (when
    ``recorded``) in its stored dtype. Files without the attribute ``feature_dtype`` hold float32."""
    from hpcgnn.data.features import FEATURE_DTYPES, decode_features, stored_dtype

    name = _text_attr(f.attrs.get("feature_dtype", "float32"))
    if name not in FEATURE_DTYPES:
        raise InputError(f"{f.filename}: attribute 'feature_dtype' is {name!r}, expected one of: "
                         f"{', '.join(FEATURE_DTYPES)}")
    raw = read_dataset(f, "features", stored_dtype(name), (n, None))
    where = f"{f.filename}: dataset 'features'"
    if f["features"].dtype != stored_dtype(name):
        raise InputError(f"{where} has dtype {f['features'].dtype}, expected {stored_dtype(name)} "
                         f"(attribute 'feature_dtype' is {name!r}; {_CORRUPT})")
    if recorded is not None:
        verify_hash(f, recorded, "features", dataset_hash("features", raw))
    return (decode_features(raw, name) if decode else raw), name


def _first_nonfinite_row(a: np.ndarray, feature_dtype: str = "float32", block: int = 1 << 22) -> int:
    """Index of the first row of 2-D ``a`` holding NaN or inf, or -1; a few MB of temporaries.
    ``feature_dtype`` bfloat16: ``a`` holds bit patterns (decoded block by block)."""
    from hpcgnn.data.features import decode_features

    rows = max(1, block // max(1, a.shape[1])) if a.ndim == 2 else block
    for start in range(0, a.shape[0], rows):
        bad = ~np.isfinite(decode_features(a[start:start + rows], feature_dtype)
                           if feature_dtype == "bfloat16" else a[start:start + rows])
        if bad.any():
            return start + int(np.nonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0][0])
    return -1


def _text_attr(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def read_graph(path: str | os.PathLike, validate: bool = True, topology=None,
               decode_features: bool = True) -> Graph:
    """Read a graph file, checking every dataset's presence, dtype and shape.

    ``validate``: also check every dataset it reads against the file's recorded hashes (when it
    has them) and :meth:`Graph.validate` the graph. ``topology``: the (indptr, indices,
    train_mask) :func:`read_topology` returned (and checked) for this file; those datasets are
    then not read, hashed or checked again. Without it, ``indices`` are returned as int64
    whatever their stored dtype (int32 or int64).

    Features: float32, decoded from the stored dtype (attribute ``feature_dtype``: float32,
    float16 or bfloat16), or with ``decode_features=False`` as stored (float16, or bfloat16 as
    uint16 bit patterns: :func:`hpcgnn.data.features.decode_features`); the stored dtype's name
    is ``meta["feature_dtype"]`` either way.
    """
    with open_h5(path, GRAPH_FORMAT) as f:
        version = int(f.attrs.get("version", -1))
        if version != GRAPH_VERSION:
            raise InputError(f"{path}: attribute 'version' is {version}, expected {GRAPH_VERSION}")
        for key in ("num_nodes", "num_classes"):
            if key not in f.attrs:
                raise InputError(f"{path}: attribute '{key}' is missing")
        n = int(f.attrs["num_nodes"])
        recorded = recorded_hashes(f) if validate else None
        read = {}
        if topology is None:
            indptr = read["indptr"] = read_dataset(f, "indptr", np.int64, (n + 1,))
            indices, indices_hash = _read_indices(f, n, np.dtype(np.int64))
            verify_hash(f, recorded, "indices", indices_hash)
            known = {}
        else:
            indptr, indices, known = topology[0], topology[1], {"train_mask": topology[2]}
        features, feature_dtype = _read_features(f, n, decode_features, recorded)
        labels = read["labels"] = read_dataset(f, "labels", np.int64, (n,))
        masks = {name: known[name] if name in known else read_dataset(f, name, bool, (n,)) for name in MASKS}
        read.update({name: masks[name] for name in MASKS if name not in known})
        if recorded is not None:
            for name, a in read.items():
                verify_hash(f, recorded, name, dataset_hash(name, a))
        meta = {
            "name": str(f.attrs.get("name", Path(path).stem)),
            "source": json.loads(f.attrs.get("source", "{}")),
            "self_loops_removed": int(f.attrs.get("self_loops_removed", 0)),
            "duplicates_removed": int(f.attrs.get("duplicates_removed", 0)),
            "feature_normalization": _text_attr(f.attrs.get("feature_normalization", "none")),
            "feature_dtype": feature_dtype,
        }
        g = Graph(indptr, indices, features, labels, num_classes=int(f.attrs["num_classes"]),
                  meta=meta, **masks)
    if validate:
        g.validate(str(path), topology=topology is None)
    return g
