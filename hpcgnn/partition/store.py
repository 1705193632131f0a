"""The *partition store*: the on-disk HDF5 partition files (``data.partitions``), one file per
partition plus ``meta.h5`` (docs/formats.md). Not to be confused with the in-memory *vertex data
store* of a rank (:mod:`hpcgnn.store`: feature store and graph store, docs/store.md), which the
engines fill from these files and read through.

Readers only; :mod:`hpcgnn.partition.writer` writes the store. Every reader opens a partition
file through :func:`open_partition_file` (the one place that checks a file belongs to the store
and, when asked, re-hashes it). A rank loads its own partition with :func:`load_partition` and
never needs a V-sized array: ownership is a range lookup in ``part_offsets``. The tensor engine
reads slices of every file instead (:func:`read_store_topology`, :func:`read_vertex_rows`).

Local numbering (derived here, not stored): solid vertices ``0..n_solid-1``
(global ``solid_begin + i``), then halo vertices in ``halo_ids`` order.

Feature rows keep the dtype they are stored in (meta.h5's attribute ``feature_dtype``:
float32, float16, or bfloat16 held as its uint16 bit patterns, :mod:`hpcgnn.data.features`):
a rank holds half the bytes of a half-precision store, and the engines cast the rows they
compute on (:mod:`hpcgnn.store`). ``features = "mmap"`` maps a partition's feature rows from
its file (read-only, copy-on-write) instead of reading them into the heap: the rank's resident
memory then holds the pages it touches.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from hpcgnn.data.features import FEATURE_DTYPES, stored_dtype
from hpcgnn.errors import InputError
from hpcgnn.fileio import open_h5, read_dataset

META_FORMAT = "hpcgnn-partitions"
PART_FORMAT = "hpcgnn-partition"
STORE_VERSION = 1
META_FILE = "meta.h5"
META_DATASETS = ("part_offsets", "new_to_orig", "halo_counts")
PART_DATASETS = ("indptr", "indices", "halo_ids", "halo_owner", "halo_degree", "degree",
                 "features", "labels", "train_mask", "val_mask", "test_mask",
                 "send_indptr", "send_ids")
# Measurements of the command that wrote the store, one entry per name in meta.h5's attribute
# ``steps``: not content (outside content_hash), and they differ between identical runs.
STEP_DATASETS = {"step_seconds": np.float64, "step_peak_rss": np.int64, "step_peak_exact": np.bool_}
FEATURE_LOADS = ("memory", "mmap")      # how load_partition holds a partition's feature rows
INDEX_SPACES = ("global", "local")      # which source IDs load_partition's indices hold


def part_file_name(part_id: int) -> str:
    return f"part-{part_id:05d}.h5"


def datasets_digest(f: h5py.File, names) -> str:
    """Hex sha256 over the named datasets (name, dtype, shape, bytes), in the given order."""
    h = hashlib.sha256()
    for name in names:
        ds = f[name]
        h.update(name.encode())
        h.update(str(ds.dtype).encode())
        h.update(repr(tuple(ds.shape)).encode())
        # Stream row blocks so large feature matrices are hashed without a full copy.
        rows = ds.shape[0] if ds.shape else 0
        step = max(1, (64 << 20) // max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))))
        if not ds.shape:
            h.update(np.ascontiguousarray(ds[()]).tobytes())
        for start in range(0, rows, step):
            h.update(np.ascontiguousarray(ds[start:start + step]).tobytes())
    return h.hexdigest()


def combine_hashes(meta_digest: str, part_hashes) -> str:
    """The store's content hash from meta.h5's digest and the partitions' hashes."""
    h = hashlib.sha256(meta_digest.encode())
    for ph in part_hashes:
        h.update(ph.encode())
    return h.hexdigest()


def _attr(f: h5py.File, key: str):
    if key not in f.attrs:
        raise InputError(f"{f.filename}: attribute '{key}' is missing")
    v = f.attrs[key]
    return v.decode() if isinstance(v, bytes) else v


@dataclass
class PartitionMeta:
    """Store-wide metadata (small: no V-sized array is loaded unless asked)."""

    path: Path
    num_parts: int
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    part_offsets: np.ndarray
    halo_counts: np.ndarray
    content_hash: str
    method: str
    seed: int
    edge_cut: int
    balance: dict
    attrs: dict = field(default_factory=dict)
    # [{"name", "seconds", "peak_rss", "exact"}] of the command that wrote the store (None if unrecorded)
    steps: list | None = None

    def owner_of(self, global_ids: np.ndarray) -> np.ndarray:
        """Owner partition of each global ID (range lookup)."""
        return (np.searchsorted(self.part_offsets, global_ids, side="right") - 1).astype(np.int32)

    @property
    def feature_dtype(self) -> str:
        """The stored feature dtype (one of FEATURE_DTYPES; float32 in a store without the attribute)."""
        name = str(self.attrs.get("feature_dtype", "float32"))
        if name not in FEATURE_DTYPES:
            raise InputError(f"{self.path / META_FILE}: attribute 'feature_dtype' is {name!r}, expected one of: "
                             f"{', '.join(FEATURE_DTYPES)}")
        return name

    def new_to_orig(self) -> np.ndarray:
        with open_h5(self.path / META_FILE, META_FORMAT) as f:
            return read_dataset(f, "new_to_orig", np.int64, (self.num_nodes,))


def read_meta(directory: str | os.PathLike) -> PartitionMeta:
    """Read ``DIR/meta.h5``; InputError if the directory is not a partition store."""
    d = Path(directory)
    if not d.is_dir():
        raise InputError(f"{d}: partition directory not found")
    with open_h5(d / META_FILE, META_FORMAT) as f:
        version = int(_attr(f, "version"))
        if version != STORE_VERSION:
            raise InputError(f"{f.filename}: attribute 'version' is {version}, expected {STORE_VERSION}")
        k = int(_attr(f, "num_parts"))
        attrs = {key: (v.decode() if isinstance(v, bytes) else v) for key, v in f.attrs.items()}
        return PartitionMeta(
            path=d, num_parts=k, num_nodes=int(_attr(f, "num_nodes")),
            num_edges=int(_attr(f, "num_edges")), num_features=int(_attr(f, "num_features")),
            num_classes=int(_attr(f, "num_classes")),
            part_offsets=read_dataset(f, "part_offsets", np.int64, (k + 1,)),
            halo_counts=read_dataset(f, "halo_counts", np.int64, (k,)),
            content_hash=str(_attr(f, "content_hash")), method=str(_attr(f, "method")),
            seed=int(_attr(f, "seed")), edge_cut=int(_attr(f, "edge_cut")),
            balance=json.loads(_attr(f, "balance")), attrs=attrs, steps=_read_steps(f))


def _read_steps(f: h5py.File) -> list | None:
    """The recorded step measurements (see STEP_DATASETS), or None in a store without them."""
    if "steps" not in f.attrs or any(name not in f for name in STEP_DATASETS):
        return None
    names = json.loads(_attr(f, "steps"))
    columns = {name: read_dataset(f, name, dtype, (len(names),)) for name, dtype in STEP_DATASETS.items()}
    return [{"name": name, "seconds": float(columns["step_seconds"][i]),
             "peak_rss": int(columns["step_peak_rss"][i]), "exact": bool(columns["step_peak_exact"][i])}
            for i, name in enumerate(names)]


@dataclass
class Partition:
    """One partition as a rank holds it (see the module docstring for numbering)."""

    part_id: int
    num_parts: int
    solid_begin: int
    solid_end: int
    indptr: np.ndarray        # int64 [n_solid+1]
    indices: np.ndarray       # int64 [E_p], source IDs: global, or local when index_space == "local"
    halo_ids: np.ndarray      # int64 [n_halo], sorted global IDs
    halo_owner: np.ndarray    # int32 [n_halo]
    halo_degree: np.ndarray   # int64 [n_halo]
    degree: np.ndarray        # int64 [n_solid]
    features: np.ndarray      # [n_solid, F] in the stored dtype (feature_dtype; a np.memmap when mapped)
    labels: np.ndarray        # int64 [n_solid]
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    send_indptr: np.ndarray   # int64 [K+1]
    send_ids: np.ndarray      # int64 [S], global IDs
    num_classes: int
    content_hash: str
    part_hash: str
    feature_dtype: str = "float32"   # float32, float16, or bfloat16 (features hold its uint16 bits)
    index_space: str = "global"      # what ``indices`` holds: "global" or "local" source IDs

    @property
    def num_solid(self) -> int:
        return self.solid_end - self.solid_begin

    @property
    def num_halo(self) -> int:
        return int(self.halo_ids.shape[0])

    @property
    def num_local(self) -> int:
        return self.num_solid + self.num_halo

    def send_list(self, dest: int) -> np.ndarray:
        """Global IDs of own solid vertices that are halo vertices on ``dest`` (db_halo)."""
        return self.send_ids[self.send_indptr[dest]:self.send_indptr[dest + 1]]

    def to_local(self, global_ids: np.ndarray) -> np.ndarray:
        """Local IDs of global IDs that are solid or halo here (undefined for others)."""
        return local_ids(global_ids, self.solid_begin, self.solid_end, self.halo_ids)

    def to_global(self, local_ids: np.ndarray) -> np.ndarray:
        """Global IDs of local IDs."""
        l = np.asarray(local_ids, dtype=np.int64)
        out = l + self.solid_begin
        halo = l >= self.num_solid
        out[halo] = self.halo_ids[l[halo] - self.num_solid]
        return out

    def local_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """(indptr, local source IDs) of the solid vertices' in-edges: ``indices`` itself when
        the partition was loaded with local IDs (no copy), else a converted copy."""
        if self.index_space == "local":
            return self.indptr, self.indices
        return self.indptr, self.to_local(self.indices)

    def local_degree(self) -> np.ndarray:
        """Full-graph degree of every local vertex (solid, then halo)."""
        return np.concatenate([self.degree, self.halo_degree])


def local_ids(global_ids: np.ndarray, solid_begin: int, solid_end: int, halo_ids: np.ndarray) -> np.ndarray:
    """Local IDs (solid ``[solid_begin, solid_end)`` first, then ``halo_ids``' order, sorted) of
    global IDs that are solid or halo in a partition (undefined for others)."""
    g = np.asarray(global_ids, dtype=np.int64)
    out = g - solid_begin
    halo = (g < solid_begin) | (g >= solid_end)   # searched for these only
    out[halo] = np.searchsorted(halo_ids, g[halo]) + (solid_end - solid_begin)
    return out


@contextlib.contextmanager
def open_partition_file(directory: str | os.PathLike, part_id: int, meta: PartitionMeta, verify: bool = False):
    """Partition file ``part_id`` of the store in ``directory``, open (h5py.File, closed on exit),
    after checking it belongs to the store (content hash, solid range) and, with ``verify``, that
    its data still matches its part_hash. InputError otherwise. The one opener of partition
    files: :func:`load_partition` reads a whole file through it, the slice readers parts of it."""
    d = Path(directory)
    if not 0 <= part_id < meta.num_parts:
        raise InputError(f"{d}: partition {part_id} requested, the store has {meta.num_parts}")
    path = d / part_file_name(part_id)
    with open_h5(path, PART_FORMAT) as f:
        ch = str(_attr(f, "content_hash"))
        if ch != meta.content_hash:
            raise InputError(f"{path}: content_hash {ch[:12]}... does not match {d / META_FILE} "
                             f"({meta.content_hash[:12]}...); the store mixes two partitionings")
        if verify:
            got = datasets_digest(f, PART_DATASETS)
            if got != str(_attr(f, "part_hash")):
                raise InputError(f"{path}: data does not match its part_hash (file modified or corrupt)")
        b, e = int(_attr(f, "solid_begin")), int(_attr(f, "solid_end"))
        if (b, e) != (int(meta.part_offsets[part_id]), int(meta.part_offsets[part_id + 1])):
            raise InputError(f"{path}: solid range [{b}, {e}) disagrees with meta.h5 part_offsets")
        yield f


def load_partition(directory: str | os.PathLike, part_id: int, meta: PartitionMeta | None = None,
                   verify: bool = True, features: str = "memory", indices: str = "global",
                   local_dtype: str = "int64") -> Partition:
    """Load partition ``part_id``; check it belongs to the store (and its data hash if ``verify``).
    ``features`` (one of FEATURE_LOADS): ``"memory"`` reads the feature rows into the heap,
    ``"mmap"`` maps them from the file (:func:`map_features`); either way in the stored dtype.
    ``indices`` (one of INDEX_SPACES): ``"global"`` keeps the stored global source IDs;
    ``"local"`` converts them to local IDs in place, block by block, as they are read (what the
    engines train on: the rank then holds one copy of its edges, never two), as ``local_dtype``:
    ``"int64"``, or ``"auto"``: int32 when every local id fits (half the bytes; for readers
    that take either, such as the sampler)."""
    meta = meta or read_meta(directory)
    if features not in FEATURE_LOADS:
        raise ValueError(f"features must be one of {FEATURE_LOADS}, got {features!r}")
    if indices not in INDEX_SPACES:
        raise ValueError(f"indices must be one of {INDEX_SPACES}, got {indices!r}")
    with open_partition_file(directory, part_id, meta, verify) as f:
        b, e = int(meta.part_offsets[part_id]), int(meta.part_offsets[part_id + 1])
        n, k = e - b, meta.num_parts
        arrays = dict(
            indptr=read_dataset(f, "indptr", np.int64, (n + 1,)),
            halo_ids=read_dataset(f, "halo_ids", np.int64, (None,)),
            halo_owner=read_dataset(f, "halo_owner", np.int32, (None,)),
            halo_degree=read_dataset(f, "halo_degree", np.int64, (None,)),
            degree=read_dataset(f, "degree", np.int64, (n,)),
            features=(map_features if features == "mmap" else read_features)(f, meta, n),
            labels=read_dataset(f, "labels", np.int64, (n,)),
            train_mask=read_dataset(f, "train_mask", bool, (n,)),
            val_mask=read_dataset(f, "val_mask", bool, (n,)),
            test_mask=read_dataset(f, "test_mask", bool, (n,)),
            send_indptr=read_dataset(f, "send_indptr", np.int64, (k + 1,)),
            send_ids=read_dataset(f, "send_ids", np.int64, (None,)),
        )
        local = None
        if indices == "local":
            fits = n + int(arrays["halo_ids"].shape[0]) <= np.iinfo(np.int32).max
            local = (b, e, arrays["halo_ids"], np.int32 if local_dtype == "auto" and fits else np.int64)
        arrays["indices"] = read_indices(f, local)
        return Partition(part_id=part_id, num_parts=k, solid_begin=b, solid_end=e,
                         num_classes=meta.num_classes, content_hash=meta.content_hash,
                         part_hash=str(_attr(f, "part_hash")), feature_dtype=meta.feature_dtype,
                         index_space=indices, **arrays)


def read_indices(f: h5py.File, local: tuple | None = None, block: int = 1 << 22) -> np.ndarray:
    """The partition file's ``indices`` as int64, read ``block`` entries at a time (the scratch
    is O(block) whatever the stored integer width); ``local`` = ``(solid_begin, solid_end,
    halo_ids[, dtype])``: converted to local IDs (:func:`local_ids`) as they are read, held as
    ``dtype`` (default int64)."""
    ds = f["indices"] if "indices" in f else None
    if not isinstance(ds, h5py.Dataset) or ds.ndim != 1:
        read_dataset(f, "indices", np.int64, (None,))      # raises the InputError that says why
    if ds.dtype.kind not in "iu":
        raise InputError(f"{f.filename}: dataset 'indices' has dtype {ds.dtype}, expected int64")
    if local is None:
        out = np.empty(ds.shape[0], dtype=np.int64)
        for s in range(0, out.shape[0], block):
            t = min(s + block, out.shape[0])
            ds.read_direct(out, source_sel=np.s_[s:t], dest_sel=np.s_[s:t])
        return out
    begin, end, halo_ids = local[:3]
    out = np.empty(ds.shape[0], dtype=local[3] if len(local) > 3 else np.int64)
    buf = np.empty(min(block, out.shape[0]), dtype=np.int64)
    for s in range(0, out.shape[0], block):
        t = min(s + block, out.shape[0])
        ds.read_direct(buf, source_sel=np.s_[s:t], dest_sel=np.s_[:t - s])
        out[s:t] = local_ids(buf[:t - s], begin, end, halo_ids)
    return out


def _feature_dataset(f: h5py.File, meta: PartitionMeta, n: int) -> h5py.Dataset:
    """The ``features`` dataset of an open partition file, checked: shape (n, F) and the dtype
    meta.h5's ``feature_dtype`` stores (bfloat16: uint16 with the attribute dtype = "bfloat16")."""
    name = meta.feature_dtype
    where = f"{f.filename}: dataset 'features'"
    if "features" not in f or not isinstance(f["features"], h5py.Dataset):
        raise InputError(f"{where} is missing")
    ds = f["features"]
    if ds.shape != (n, meta.num_features):
        raise InputError(f"{where} has shape {ds.shape}, expected ({n}, {meta.num_features})")
    tag = ds.attrs.get("dtype", "")
    tag = tag.decode() if isinstance(tag, bytes) else str(tag)
    if ds.dtype != stored_dtype(name) or (tag == "bfloat16") != (name == "bfloat16"):
        raise InputError(f"{where} has dtype {ds.dtype}{' (bfloat16 bits)' if tag == 'bfloat16' else ''}, "
                         f"expected {name} as meta.h5's attribute 'feature_dtype' says")
    return ds


def read_features(f: h5py.File, meta: PartitionMeta, n: int) -> np.ndarray:
    """The partition's feature rows [n, F] read into memory, in the stored dtype."""
    ds = _feature_dataset(f, meta, n)
    out = np.empty(ds.shape, dtype=ds.dtype)
    if out.size:
        ds.read_direct(out)
    return out


def map_features(f: h5py.File, meta: PartitionMeta, n: int) -> np.ndarray:
    """The partition's feature rows [n, F] as a copy-on-write memory map of the file (the
    contiguous dataset's bytes at its file offset), in the stored dtype: nothing is read
    until a row is touched. A chunked or filtered dataset (no single file offset) is an
    InputError; :mod:`hpcgnn.partition.writer` writes contiguous ones."""
    ds = _feature_dataset(f, meta, n)
    if ds.size == 0:
        return np.empty(ds.shape, dtype=ds.dtype)
    offset = ds.id.get_offset() if ds.chunks is None and not ds.compression else None
    if offset is None:
        raise InputError(f"{f.filename}: dataset 'features' is chunked or compressed and cannot be memory-mapped "
                         "(store.features = 'mmap'); use store.features = 'memory' or partition the graph again")
    return np.memmap(f.filename, dtype=ds.dtype, mode="c", offset=int(offset), shape=ds.shape)


SPLITS = ("train", "val", "test")


def read_store_topology(directory, meta: PartitionMeta, verify_part: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The global in-edge CSR ``(indptr [V+1], indices [E])`` (int64) from every partition file's
    ``indptr``/``indices`` (each file holds its contiguous global-ID range; no other dataset is
    read); ``verify_part``: re-hash that partition file against its part_hash."""
    v, k = meta.num_nodes, meta.num_parts
    sizes = []
    for p in range(k):
        with open_partition_file(directory, p, meta, verify=p == verify_part) as f:
            sizes.append(int(f["indices"].shape[0]))
    indptr = np.zeros(v + 1, dtype=np.int64)
    indices = np.empty(sum(sizes), dtype=np.int64)
    off = 0
    for p in range(k):
        b, e = int(meta.part_offsets[p]), int(meta.part_offsets[p + 1])
        with open_partition_file(directory, p, meta) as f:
            ip = np.asarray(f["indptr"][()], dtype=np.int64)
            if ip.shape != (e - b + 1,) or ip[-1] != sizes[p]:
                raise InputError(f"{f.filename}: indptr does not match its solid range / indices")
            indptr[b + 1:e + 1] = ip[1:] + off
            if sizes[p]:
                f["indices"].read_direct(indices, dest_sel=np.s_[off:off + sizes[p]])
            off += sizes[p]
    if indices.size and (indices.min() < 0 or indices.max() >= v):
        raise InputError(f"{directory}: an edge source is outside [0, {v})")
    return indptr, indices


def read_vertex_rows(directory, meta: PartitionMeta, ids: np.ndarray, block_bytes: int = 64 << 20) -> dict:
    """Features, labels and split masks of the vertices ``ids`` (global, any order), in that
    order, read from the partition files that hold them (row blocks of ``block_bytes``, so no
    whole feature matrix is loaded). Features in the stored dtype (``meta.feature_dtype``)."""
    ids = np.asarray(ids, dtype=np.int64)
    n, nf = int(ids.shape[0]), int(meta.num_features)
    fdtype = stored_dtype(meta.feature_dtype)
    feats = np.empty((n, nf), dtype=fdtype)
    labels = np.empty(n, dtype=np.int64)
    masks = {s: np.zeros(n, dtype=bool) for s in SPLITS}
    order = np.argsort(ids, kind="stable")
    sids = ids[order]
    step = max(1, block_bytes // max(1, nf * fdtype.itemsize))
    for p in range(meta.num_parts):
        b, e = int(meta.part_offsets[p]), int(meta.part_offsets[p + 1])
        lo, hi = np.searchsorted(sids, [b, e])
        if lo == hi:
            continue
        sel, loc = order[lo:hi], sids[lo:hi] - b
        r0, r1 = int(loc[0]), int(loc[-1]) + 1
        with open_partition_file(directory, p, meta) as f:
            ds = _feature_dataset(f, meta, e - b)
            for s in range(r0, r1, step):
                t = min(s + step, r1)
                i0, i1 = np.searchsorted(loc, [s, t])
                if i0 < i1:
                    block = ds[s:t]
                    feats[sel[i0:i1]] = block[loc[i0:i1] - s]
            labels[sel] = np.asarray(f["labels"][r0:r1], dtype=np.int64)[loc - r0]
            for s in SPLITS:
                masks[s][sel] = np.asarray(f[f"{s}_mask"][r0:r1], dtype=bool)[loc - r0]
    return {"features": feats, "labels": labels, "masks": masks}
