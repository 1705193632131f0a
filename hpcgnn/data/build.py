"""Graph files written in bounded memory: a :class:`GraphSource` through the external sort.

A source (a generator, OGB's binary layout) gives its vertex data whole (O(N) arrays: labels,
split masks) and its edges and feature rows as streams of blocks. :func:`write_graph_stream`
turns it into a graph file (docs/formats.md) holding at most ``budget`` bytes of graph data
at once, however many edges there are:

1. edges -> :class:`~hpcgnn.data.external_sort.SymmetricEdgeSorter` (runs in a scratch
   directory beside the output, merged into ``indptr`` and a raw ``indices`` file);
2. the graph file, written under a temporary name (:func:`hpcgnn.fileio.atomic_file`) dataset
   by dataset with :class:`~hpcgnn.data.graph.GraphFileWriter`: ``indptr``; ``indices`` copied
   in blocks, then checked as every reader checks them (:func:`~hpcgnn.data.graph.check_topology`,
   blocks read back from the copy); feature rows block by block (checked finite, normalised if
   asked, encoded to the feature dtype); labels and masks checked and written;
3. renamed into place. The scratch directory is removed on success, on error and on a full
   disk, and the temporary file with it: nothing half-written remains.

The budget covers the O(N) arrays (:data:`BYTES_PER_VERTEX` plus the source's own
``vertex_bytes``), one feature block and the sort's buffers (the rest); a budget below what the
O(N) arrays and the smallest sort need is an InputError naming the memory needed. The Python
interpreter and its libraries (about 0.1-0.2 GB) come on top.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import h5py
import numpy as np

from hpcgnn.data.external_sort import SymmetricEdgeSorter, min_sort_bytes
from hpcgnn.data.graph import (MASKS, Graph, GraphFileWriter, check_row_pointer, check_topology, check_vertex_data,
                               index_dtype_for, root_attrs)
from hpcgnn.errors import InputError
from hpcgnn.fileio import new_temp, atomic_file, check_output, write_failure
from hpcgnn.progress import Progress
from hpcgnn.units import fmt_bytes

# Bytes per vertex the writer itself holds: labels (8) and masks (3) for the whole build, the
# sorter's degree counts and indptr (16), check_topology's two random fingerprints (16).
BYTES_PER_VERTEX = 43
FEATURE_BLOCK_BYTES = 64 << 20      # float32 feature rows per block, at most (a quarter of a small budget)
COPY_BLOCK = 1 << 22                # indices entries per copy step


@dataclass
class GraphSource:
    """A graph given as O(N) vertex arrays and streams of edge and feature blocks.

    ``vertex_data()`` returns ``(labels int64 [N], train_mask, val_mask, test_mask)`` (called
    once, after the budget is checked, before the streams); ``num_classes`` None: the largest
    label + 1 (known once ``vertex_data`` has run). ``edge_blocks()`` yields ``(src, dst)`` integer arrays of undirected edges (self-loops and
    duplicates allowed: they are removed); ``feature_blocks(rows)`` yields consecutive float32
    row blocks of at most ``rows`` rows covering [0, N) in order. ``vertex_bytes``: bytes per
    vertex the source holds while it streams (beyond ``labels`` and the masks). ``input_edges``:
    the number of edges the stream holds when known (0: unknown). ``where``: names the input in
    errors.
    """

    name: str
    num_nodes: int
    num_features: int
    num_classes: int | None
    vertex_data: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    edge_blocks: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]
    feature_blocks: Callable[[int], Iterator[np.ndarray]]
    meta: dict = field(default_factory=dict)
    vertex_bytes: int = 0
    input_edges: int = 0
    where: str = "edges"


@dataclass(frozen=True)
class StreamSummary:
    """What :func:`write_graph_stream` wrote and how: sizes, the sort's runs and passes."""

    path: Path
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    split_counts: tuple[int, int, int]
    self_loops_removed: int
    duplicates_removed: int
    index_dtype: str
    feature_dtype: str
    budget: int
    sort_budget: int
    runs: int
    merge_passes: int


def _vertex_bytes(source: GraphSource) -> int:
    return int(source.num_nodes) * (BYTES_PER_VERTEX + int(source.vertex_bytes))


def required_bytes(source: GraphSource) -> int:
    """The smallest budget for ``source``: its vertex arrays, a feature block of 64 rows and the
    smallest edge sort."""
    return _vertex_bytes(source) + 64 * 8 * max(1, source.num_features) + min_sort_bytes()


def _feature_block_rows(source: GraphSource, budget: int) -> int:
    """Rows per feature block (float32 rows and their encoded copy): a quarter of what the
    budget leaves beyond the vertex arrays and the smallest sort, at most FEATURE_BLOCK_BYTES,
    at least 64 rows."""
    per_row = 8 * max(1, source.num_features)
    spare = int(budget) - _vertex_bytes(source) - min_sort_bytes()
    return int(max(64, min(FEATURE_BLOCK_BYTES // per_row, spare // (4 * per_row))))


def check_budget(source: GraphSource, budget: int) -> int:
    """The sort's share of ``budget``; InputError naming the memory needed when too small."""
    if int(budget) < required_bytes(source):
        raise InputError(f"--memory-budget {fmt_bytes(budget)} is too small for {source.where}: its "
                         f"{source.num_nodes:,} vertices need at least {fmt_bytes(required_bytes(source))} "
                         f"({BYTES_PER_VERTEX + source.vertex_bytes} bytes per vertex for the vertex "
                         f"arrays, a feature block and the smallest edge sort)")
    rows = _feature_block_rows(source, budget)
    return int(budget) - _vertex_bytes(source) - rows * 8 * max(1, source.num_features)


def _write_features(writer: GraphFileWriter, source: GraphSource, rows: int, feature_dtype: str,
                    normalize: str, where: str, progress: bool) -> None:
    from hpcgnn.data.features import encode_features, first_negative, row_normalize_, stored_dtype

    n, f = source.num_nodes, source.num_features
    out = writer.rows("features", stored_dtype(feature_dtype), (n, f),
                      {"dtype": "bfloat16"} if feature_dtype == "bfloat16" else None)
    with Progress("features", total=n, enabled=progress) as bar:
        for block in source.feature_blocks(rows):
            block = np.ascontiguousarray(block, dtype=np.float32)
            lo = out.position
            if block.ndim != 2 or block.shape[1] != f or lo + block.shape[0] > n:
                raise InputError(f"{where}: feature block of shape {block.shape} at row {lo}, expected "
                                 f"rows of {f} features, {n} rows in all")
            bad = ~np.isfinite(block)
            if bad.any():
                r = int(np.nonzero(bad.any(axis=1))[0][0])
                raise InputError(f"{where}: features hold NaN or inf (first at row {lo + r})")
            if normalize == "row":
                neg = first_negative(block)
                if neg is not None:
                    raise InputError(f"{where}: features hold negative values (first at row {lo + neg[0]}: "
                                     f"{neg[1]:.6g}); --normalize-features row expects non-negative features "
                                     "such as bag-of-words counts")
                row_normalize_(block if block.flags.writeable else block.copy())
            out.append(encode_features(block, feature_dtype, where, lo))
            bar.update(block.shape[0])
    if out.position != n:
        raise InputError(f"{where}: {out.position} feature rows, expected {n} (one per vertex)")


def _vertex_data(source: GraphSource) -> tuple[np.ndarray, dict]:
    """(labels, {mask name: mask}) of ``source``, checked."""
    labels, *split = source.vertex_data()
    labels = np.asarray(labels, dtype=np.int64)
    n = int(source.num_nodes)
    if labels.shape != (n,):
        raise InputError(f"{source.where}: {labels.shape[0]} labels, expected {n} (one per vertex)")
    masks = {name: np.asarray(m, dtype=bool) for name, m in zip(MASKS, split)}
    if source.num_classes is None:
        source.num_classes = max(1, int(labels.max()) + 1)
    check_vertex_data(source.where, labels, source.num_classes, masks)
    return labels, masks


def write_graph_stream(path: str | os.PathLike, source: GraphSource, budget: int, feature_dtype: str = "float32",
                       index_dtype: str = "auto", normalize: str = "none", force: bool = False,
                       progress: bool = False) -> StreamSummary:
    """Write ``source`` to the graph file ``path`` within ``budget`` bytes (module docstring)."""
    path = check_output(path, force)
    n = int(source.num_nodes)
    if n < 1:
        raise InputError(f"{source.where}: graph has no vertices")
    ix_dtype = index_dtype_for(n, index_dtype)
    sort_budget = check_budget(source, budget)
    labels, masks = _vertex_data(source)
    rows = _feature_block_rows(source, budget)
    scratch = new_temp(path, ".tmp", directory=True)
    try:
        sorter = SymmetricEdgeSorter(n, sort_budget, scratch, where=source.where)
        with Progress("edges", enabled=progress) as bar:
            for src, dst in source.edge_blocks():
                sorter.add(src, dst)
                bar.update(int(np.shape(src)[0]))
        with Progress("edge sort: merge", enabled=progress) as bar:
            csr = sorter.finish(ix_dtype)
            bar.update(csr.indices.size)
        del sorter
        m = csr.indices.size
        meta = {**source.meta, **csr.stats, "feature_normalization": normalize}
        with atomic_file(path) as tmp:
            with h5py.File(tmp, "w", track_order=False) as f:
                w = GraphFileWriter(f)
                w.put("indptr", csr.indptr)
                out = w.rows("indices", ix_dtype, (m,))
                for lo in range(0, m, COPY_BLOCK):
                    out.append(csr.indices[lo:lo + COPY_BLOCK])
                check_row_pointer(str(path), csr.indptr, m, n)
                check_topology(str(path), csr.indptr, csr.indices, block=COPY_BLOCK)
                csr.indices.path.unlink()
                _write_features(w, source, rows, feature_dtype, normalize, source.where, progress)
                w.put("labels", labels)
                for name in MASKS:
                    w.put(name, masks[name])
                w.finish(root_attrs(meta, path.stem, n, m, source.num_features, source.num_classes,
                                    feature_dtype))
    except OSError as exc:
        raise write_failure(path, exc) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return StreamSummary(path=path, num_nodes=n, num_edges=m, num_features=source.num_features,
                         num_classes=source.num_classes,
                         split_counts=tuple(int(masks[k].sum()) for k in MASKS),
                         self_loops_removed=csr.stats["self_loops_removed"],
                         duplicates_removed=csr.stats["duplicates_removed"], index_dtype=str(ix_dtype),
                         feature_dtype=feature_dtype, budget=int(budget), sort_budget=sort_budget,
                         runs=csr.runs, merge_passes=csr.merge_passes)


def materialize(source: GraphSource, progress: bool = False) -> Graph:
    """``source`` as an in-memory :class:`~hpcgnn.data.graph.Graph` (the native CSR builder;
    the same CSR as :func:`write_graph_stream` writes)."""
    from hpcgnn.data.clean import SymmetricCsrBuilder

    n = int(source.num_nodes)
    labels, masks = _vertex_data(source)
    builder = SymmetricCsrBuilder(n, reserve=source.input_edges, where=source.where)
    with Progress("edges", total=source.input_edges or None, enabled=progress) as bar:
        for src, dst in source.edge_blocks():
            builder.add(src, dst)
            bar.update(int(np.shape(src)[0]))
    with Progress("csr", enabled=progress) as bar:
        indptr, indices, stats = builder.finish()
        bar.update(int(indices.shape[0]))
    features = np.empty((n, source.num_features), dtype=np.float32)
    at = 0
    with Progress("features", total=n, enabled=progress) as bar:
        for block in source.feature_blocks(FEATURE_BLOCK_BYTES // (4 * max(1, source.num_features))):
            features[at:at + block.shape[0]] = block
            at += block.shape[0]
            bar.update(block.shape[0])
    if at != n:
        raise InputError(f"{source.where}: {at} feature rows, expected {n} (one per vertex)")
    return Graph(indptr, indices, features, labels, masks["train_mask"], masks["val_mask"], masks["test_mask"],
                 num_classes=source.num_classes, meta={**source.meta, **stats})
