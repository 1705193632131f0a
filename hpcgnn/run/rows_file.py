"""A collective writer of per-vertex rows into one HDF5 file in vertex order (what `hpcgnn infer`
writes; layout: docs/infer.md): :func:`write_rows`.

Rank 0 assembles the file block by block (``block_bytes`` of output rows per block): every rank
sorts its rows by graph vertex id once, and for each block sends the rows that fall in it (one
``Gatherv`` of ids, one of rows); rank 0 checks that every vertex of the block arrived exactly
once and writes it. Memory beyond the rank's own result: one block (rank 0: two). The file is
written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError

DEFAULT_BLOCK_BYTES = 64 << 20


def write_rows(rt, path: Path, ids: np.ndarray, rows: np.ndarray, num_nodes: int, name: str,
               attrs: dict, block_bytes: int = DEFAULT_BLOCK_BYTES, vertex_ids: np.ndarray | None = None) -> None:
    """Collective: write ``rows`` (this rank's, for graph vertex ids ``ids``) of every rank into
    one HDF5 file ``path`` in vertex order: dataset ``name`` [num_nodes, ...] and ``vertex_ids``
    [num_nodes] (the graph file's ids of the rows), file attributes ``attrs``. With
    ``vertex_ids`` (rank 0: [num_nodes] int64), ``ids`` are the rows' positions in the file and
    ``vertex_ids`` the graph ids written for them. Rank 0 writes,
    block by block (see the module docstring); the file appears complete or not at all. A write
    the OS refuses (a full disk) stops every rank after that block with one InputError naming
    ``path`` and the OS reason (:func:`hpcgnn.fileio.atomic_h5`), the temporary removed."""
    from hpcgnn.fileio import atomic_h5, write_failure

    rows = np.ascontiguousarray(rows)
    tail = tuple(int(s) for s in rows.shape[1:])
    width = int(np.prod(tail, dtype=np.int64)) if tail else 1
    block = max(1, int(block_bytes) // max(1, width * rows.dtype.itemsize))
    error = None
    if rt.is_root:
        assembled = False
        try:
            with atomic_h5(path) as out:
                f = out.file
                sink = None
                try:
                    for k, v in attrs.items():
                        f.attrs[k] = json.dumps(v) if isinstance(v, (dict, list, tuple)) else v
                    chunk = (min(max(1, num_nodes), max(1, (1 << 20) // max(1, width * rows.dtype.itemsize))),) + tail
                    sink = (f.create_dataset(name, shape=(num_nodes,) + tail, dtype=rows.dtype, chunks=chunk),
                            f.create_dataset("vertex_ids", shape=(num_nodes,), dtype=np.int64), out)
                except (OSError, RuntimeError, ValueError) as exc:   # h5py's, before any block
                    error = str(out.failure() or write_failure(path, exc))
                assembled = True
                error = _assemble(rt, ids, rows, num_nodes, block, sink, error, vertex_ids)
                if error is not None:
                    raise InputError(error)    # atomic_h5 removes the temporary
        except InputError as exc:              # also a write refused while the file closed
            error = str(exc)
        if not assembled:                      # the temporary could not be made: say so to all
            _assemble(rt, ids, rows, num_nodes, block, None, error)
    else:
        _assemble(rt, ids, rows, num_nodes, block, None, None)
    error = rt.comm.bcast(error, root=0)
    if error is not None:
        raise InputError(error)


def _assemble(rt, ids: np.ndarray, rows: np.ndarray, num_nodes: int, block: int, sink,
              error: str | None, vertex_ids: np.ndarray | None = None) -> str | None:
    """The block loop of :func:`write_rows` (``sink`` = (dataset, vertex_ids,
    :class:`~hpcgnn.fileio.H5Output`) on rank 0, None elsewhere; ``vertex_ids``: the ids written
    for the rows, None = their positions). Rank 0 says first whether it
    can write (``error``: why not) and after each block whether the OS refused a write; every
    rank returns that error (None: all written)."""
    from mpi4py import MPI
    from mpi4py.util.dtlib import from_numpy_dtype

    comm = rt.comm
    error = comm.bcast(error if rt.is_root else None, root=0)
    if error is not None:
        return error
    order = np.argsort(ids, kind="stable")
    sorted_ids = np.ascontiguousarray(ids[order], dtype=np.int64)
    starts = np.unique(np.append(np.arange(0, num_nodes, block, dtype=np.int64), num_nodes))
    cuts = np.searchsorted(sorted_ids, starts)
    counts = np.diff(cuts).astype(np.int64)
    if sorted_ids.size and (sorted_ids[0] < 0 or sorted_ids[-1] >= num_nodes):
        raise ValueError(f"write_rows: vertex ids outside [0, {num_nodes})")
    everyone = comm.gather(counts, root=0)
    tail = rows.shape[1:]
    width = int(np.prod(tail, dtype=np.int64)) if tail else 1
    mpi_type = from_numpy_dtype(rows.dtype)
    for k in range(starts.shape[0] - 1):
        a, b = int(starts[k]), int(starts[k + 1])
        lo, hi = int(cuts[k]), int(cuts[k + 1])
        send_ids = sorted_ids[lo:hi]
        send_rows = np.ascontiguousarray(rows[order[lo:hi]]).reshape(-1)
        if not rt.is_root:
            comm.Gatherv(send_ids, None, root=0)
            comm.Gatherv(send_rows, None, root=0)
            error = comm.bcast(None, root=0)
            if error is not None:
                return error
            continue
        per_rank = np.array([c[k] for c in everyone], dtype=np.int64)
        displs = np.concatenate([[0], np.cumsum(per_rank)[:-1]]).astype(np.int64)
        total = int(per_rank.sum())
        got_ids = np.empty(total, dtype=np.int64)
        got_rows = np.empty(total * width, dtype=rows.dtype)
        comm.Gatherv(send_ids, [got_ids, per_rank, displs, MPI.INT64_T], root=0)
        comm.Gatherv(send_rows, [got_rows, per_rank * width, displs * width, mpi_type], root=0)
        pos = got_ids - a
        hits = np.bincount(pos, minlength=b - a) if total else np.zeros(b - a, np.int64)
        if total != b - a or hits.shape[0] != b - a or not np.all(hits == 1):
            raise RuntimeError(f"write_rows: vertices {a}..{b - 1} arrived {total} times for "
                               f"{b - a} rows (the ranks' stores do not cover the graph once)")
        out = np.empty((b - a,) + tuple(tail), dtype=rows.dtype)
        out[pos] = got_rows.reshape((total,) + tuple(tail))
        data, vids, h5 = sink
        data[a:b] = out
        if vertex_ids is None:
            ordered = np.empty(b - a, dtype=np.int64)
            ordered[pos] = got_ids
            vids[a:b] = ordered
        else:
            vids[a:b] = vertex_ids[a:b]
        failure = h5.failure()
        error = comm.bcast(None if failure is None else str(failure), root=0)
        if error is not None:
            return error
    return None
