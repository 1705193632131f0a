"""Where the partition writer reads a graph from: rows of the CSR and vertex data, one set of
rows (a partition's) at a time.

Two sources with one interface (:class:`GraphSource`):

* :class:`MemorySource`: a :class:`hpcgnn.data.graph.Graph` already in memory;
* :class:`FileSource`: the graph file itself. Only the row pointer and the training mask are
  held (O(V)); a partition's CSR rows, features, labels and masks are gathered from the file
  when asked, in row blocks of bounded size, through memory maps of the file's contiguous
  datasets (h5py reads in the same blocks where a dataset is chunked). Mapped pages are given
  back to the kernel after each gather, so the resident memory is O(V) plus one partition's
  data however large the file.

Features keep the file's stored dtype (float32, float16, or bfloat16 as uint16 bit patterns
with the dataset attribute ``dtype = "bfloat16"``): :attr:`GraphSource.feature_attrs` are the
attributes the partition files' ``features`` dataset carries.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import h5py
import numpy as np

from hpcgnn.data.graph import GRAPH_FORMAT, MASKS, Graph
from hpcgnn.errors import InputError
from hpcgnn.fileio import open_h5

BLOCK_BYTES = 16 << 20          # mapped pages a gather touches (and holds) at a time, at most
HASH_BLOCK_BYTES = 16 << 20     # consecutive rows hashed at a time


class GraphSource:
    """A graph the writer reads row sets of. Subclasses set the attributes and the two gathers."""

    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    indptr: np.ndarray            # int64 [N+1]
    train_mask: np.ndarray        # bool [N]
    index_dtype: np.dtype         # dtype of gather_indices' result (int32 or int64)
    feature_dtype: np.dtype       # stored dtype of the features
    feature_attrs: dict           # attributes of the features dataset
    meta: dict                    # feature_normalization, feature_dtype

    def degree(self) -> np.ndarray:
        return np.diff(self.indptr)

    def gather_indices(self, rows: np.ndarray) -> np.ndarray:
        """The concatenated CSR rows (source IDs) of the sorted vertex IDs ``rows``."""
        raise NotImplementedError

    def vertex_rows(self, rows: np.ndarray) -> dict:
        """{features, labels, train_mask, val_mask, test_mask} of the sorted vertex IDs ``rows``."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _edge_positions(indptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """int64 positions in ``indices`` of the concatenated rows ``rows``."""
    starts = indptr[rows]
    lens = indptr[rows + 1] - starts
    total = int(lens.sum())
    shift = np.repeat(starts - (np.cumsum(lens) - lens), lens)
    return shift + np.arange(total, dtype=np.int64)


def _row_blocks(indptr: np.ndarray, rows: np.ndarray, max_edges: int, max_rows: int):
    """Consecutive slices of ``rows`` of at most ``max_rows`` rows holding at most ``max_edges``
    edges (one row at least)."""
    ends = np.cumsum(indptr[rows + 1] - indptr[rows])
    a = 0
    while a < rows.shape[0]:
        base = ends[a - 1] if a else 0
        b = max(min(int(np.searchsorted(ends, base + max_edges, side="right")), a + max_rows), a + 1)
        yield a, min(b, rows.shape[0])
        a = b


class MemorySource(GraphSource):
    """A :class:`Graph` in memory (its features as stored: float32 unless ``meta['feature_dtype']``
    says float16 or bfloat16)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.num_nodes, self.num_edges = graph.num_nodes, graph.num_edges
        self.num_features, self.num_classes = graph.num_features, int(graph.num_classes)
        self.indptr = np.ascontiguousarray(graph.indptr, dtype=np.int64)
        self.train_mask = graph.train_mask
        self.index_dtype = np.dtype(np.int32 if graph.indices.dtype == np.int32 else np.int64)
        self._indices = np.ascontiguousarray(graph.indices, dtype=self.index_dtype)
        name = str(graph.meta.get("feature_dtype", "float32"))
        stored = graph.features.dtype
        if name == "float32" or stored == np.float32:
            name, stored = "float32", np.dtype(np.float32)
        self.feature_dtype = np.dtype(stored)
        self.feature_attrs = {"dtype": "bfloat16"} if name == "bfloat16" else {}
        self.meta = {"feature_normalization": str(graph.meta.get("feature_normalization", "none")),
                     "feature_dtype": name}

    def gather_indices(self, rows):
        return self._indices[_edge_positions(self.indptr, rows)]

    def vertex_rows(self, rows):
        g = self.graph
        return {"features": np.asarray(g.features[rows], dtype=self.feature_dtype),
                "labels": np.asarray(g.labels[rows], dtype=np.int64),
                **{name: np.asarray(getattr(g, name)[rows], dtype=bool) for name in MASKS}}


class _Column:
    """One dataset of the graph file read by row index: a memory map of a contiguous dataset,
    else h5py (sorted index lists)."""

    def __init__(self, f: h5py.File, name: str, path: Path):
        if name not in f or not isinstance(f[name], h5py.Dataset):
            raise InputError(f"{path}: dataset '{name}' is missing")
        self.ds = f[name]
        self.dtype = self.ds.dtype
        self.shape = self.ds.shape
        self.row_bytes = max(1, self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64)))
        offset = self.ds.id.get_offset() if self.ds.chunks is None and self.ds.compression is None else None
        self._map = self._array = None
        if offset is not None and self.shape[0] > 0:
            size = self.row_bytes * self.shape[0]
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            with open(path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), size + offset - start, access=mmap.ACCESS_READ, offset=start)
            self._array = np.frombuffer(self._map, dtype=self.dtype, count=int(np.prod(self.shape)),
                                        offset=offset - start).reshape(self.shape)

    def take(self, idx: np.ndarray, out: np.ndarray) -> None:
        """``out[:] = dataset[idx]`` for sorted distinct ``idx``."""
        if self._array is not None:
            out[...] = self._array[idx]
        elif idx.size:
            out[...] = self.ds[idx]

    def release(self) -> None:
        """Give the mapped pages back (they are re-read from the file if touched again)."""
        if self._map is not None and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._array = None
        if self._map is not None:
            self._map.close()
            self._map = None


class FileSource(GraphSource):
    """The graph file at ``path``, read a row set at a time (see the module docstring).

    ``indptr`` and ``train_mask``: the file's, when the caller already read them
    (:func:`hpcgnn.data.graph.read_topology`), else they are read here. The file's ``indices``
    are read in their stored dtype (int32 or int64). The datasets' contents are not
    checked here: the caller verifies them (:meth:`verify`) before writing a store.
    """

    def __init__(self, path: str | os.PathLike, indptr: np.ndarray | None = None,
                 train_mask: np.ndarray | None = None, block_bytes: int = BLOCK_BYTES):
        self.path = Path(path)
        self.block_bytes = int(block_bytes)
        self._f = open_h5(self.path, GRAPH_FORMAT)
        try:
            f = self._f
            attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
            self.num_nodes = int(attrs["num_nodes"])
            self.num_classes = int(attrs["num_classes"])
            n = self.num_nodes
            self.indptr = (np.asarray(f["indptr"][()], dtype=np.int64) if indptr is None
                           else np.asarray(indptr, dtype=np.int64))
            self.train_mask = (np.asarray(f["train_mask"][()], dtype=bool) if train_mask is None
                               else train_mask)
            self._cols = {name: _Column(f, name, self.path)
                          for name in ("indices", "features", "labels", *MASKS)}
            feats = self._cols["features"]
            if len(feats.shape) != 2 or feats.shape[0] != n:
                raise InputError(f"{self.path}: dataset 'features' has shape {feats.shape}, expected ({n}, F)")
            if self.indptr.shape != (n + 1,) or int(self.indptr[-1]) != self._cols["indices"].shape[0]:
                raise InputError(f"{self.path}: 'indptr' does not match 'indices'")
            self.num_edges = int(self.indptr[-1])
            self.num_features = int(feats.shape[1])
            self.index_dtype = np.dtype(np.int32 if self._cols["indices"].dtype == np.int32 else np.int64)
            self.feature_dtype = np.dtype(feats.dtype)
            self.feature_attrs = {k: (v.decode() if isinstance(v, bytes) else v)
                                  for k, v in f["features"].attrs.items()}
            self.meta = {"feature_normalization": str(attrs.get("feature_normalization", "none")),
                         "feature_dtype": str(attrs.get("feature_dtype", "float32"))}
        except BaseException:
            self.close()
            raise

    def _gather(self, column: str, positions: np.ndarray, dtype, width: tuple = ()) -> np.ndarray:
        col = self._cols[column]
        out = np.empty((positions.shape[0], *width), dtype=dtype)
        step = max(1, self.block_bytes // max(col.row_bytes, mmap.PAGESIZE))   # a row may touch a page
        for a in range(0, positions.shape[0], step):
            col.take(positions[a:a + step], out[a:a + step])
            col.release()
        return out

    def gather_indices(self, rows):
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty(int((self.indptr[rows + 1] - self.indptr[rows]).sum()), dtype=self.index_dtype)
        col = self._cols["indices"]
        pos = 0
        # each row's run touches its own page(s): at most block_bytes of them at a time
        for a, b in _row_blocks(self.indptr, rows, max(1, self.block_bytes // 8),
                                max(1, self.block_bytes // mmap.PAGESIZE)):
            idx = _edge_positions(self.indptr, rows[a:b])
            col.take(idx, out[pos:pos + idx.shape[0]])
            col.release()
            pos += idx.shape[0]
        return out

    def vertex_rows(self, rows):
        rows = np.asarray(rows, dtype=np.int64)
        return {"features": self._gather("features", rows, self.feature_dtype, (self.num_features,)),
                "labels": self._gather("labels", rows, np.int64),
                **{name: self._gather(name, rows, bool) for name in MASKS}}

    def verify(self) -> None:
        """Check the vertex datasets (features, labels, validation and test masks: what
        :func:`hpcgnn.data.graph.read_topology` does not read) against the file's recorded hashes,
        reading each in consecutive blocks; InputError naming the file and dataset on a mismatch.
        A file without recorded hashes passes."""
        from hpcgnn.data.graph import DatasetHasher, recorded_hashes, verify_hash

        recorded = recorded_hashes(self._f)
        if recorded is None:
            return
        for name in ("features", "labels", "val_mask", "test_mask"):
            col = self._cols[name]
            h = DatasetHasher(name, col.dtype, col.shape)
            step = max(1, min(self.block_bytes, HASH_BLOCK_BYTES) // col.row_bytes)
            for a in range(0, col.shape[0], step):
                h.update(col._array[a:a + step] if col._array is not None else col.ds[a:a + step])
                col.release()
            verify_hash(self._f, recorded, name, h.hexdigest())

    def close(self) -> None:
        for col in getattr(self, "_cols", {}).values():
            col.close()
        if getattr(self, "_f", None) is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
