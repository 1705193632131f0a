"""Renumber a partitioned graph and write the partition store (docs/formats.md).

Partition p owns the contiguous new-ID range [part_offsets[p], part_offsets[p+1]); inside a
partition vertices keep their original-ID order. Each partition's CSR, halo and send lists
are cut out by the native kernel ``hpcgnn.native.partition.extract_part`` one partition at a
time from that partition's rows only, gathered from a :class:`~hpcgnn.partition.source.GraphSource`
(the graph in memory, or the graph file read a partition at a time: then peak memory is O(V)
plus two partitions, one being written and one being hashed). The graph's ``indices`` may be
int32 or int64; features keep their stored dtype. Under MPI the ranks write the partitions in
parallel (:func:`write_store` ``comm``). The directory is written atomically and is
byte-identical for identical inputs, except the measured wall times and peak memory of the
steps in ``meta.h5`` (docs/formats.md).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpcgnn import __version__
from hpcgnn.data.graph import Graph
from hpcgnn.errors import InputError
from hpcgnn.fileio import atomic_dir, check_output, h5_writing, persist_and_drop_cache, write_error
from hpcgnn.partition.balance import imbalance, part_weights
from hpcgnn.partition.memory import StepMeter, StepRecord
from hpcgnn.partition.store import (META_DATASETS, META_FILE, META_FORMAT, PART_DATASETS, PART_FORMAT,
                                    STEP_DATASETS, STORE_VERSION, combine_hashes, datasets_digest,
                                    part_file_name)
from hpcgnn.partition.source import GraphSource, MemorySource
from hpcgnn.progress import Progress


@dataclass
class StoreSummary:
    """What :func:`write_store` wrote (all counts over the whole store)."""

    path: Path
    num_parts: int
    num_edges: int          # directed edges of the graph
    edge_cut: int           # undirected edges between partitions
    balance: dict           # {constraint: max/mean part weight}
    part_weights: dict      # {constraint: int64 [K] weight of each partition}
    halo_counts: np.ndarray
    content_hash: str
    steps: list = None      # [StepRecord]: wall time and peak memory per step, recorded in meta.h5


def renumber(part: np.ndarray, num_parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(new_to_orig, orig_to_new, part_offsets) for an assignment ``part`` int [N] in [0, K).

    New IDs group vertices by partition; a stable sort keeps original-ID order inside each.
    """
    part = np.asarray(part, dtype=np.int64)
    new_to_orig = np.argsort(part, kind="stable").astype(np.int64, copy=False)
    orig_to_new = np.empty_like(new_to_orig)
    orig_to_new[new_to_orig] = np.arange(new_to_orig.shape[0], dtype=np.int64)
    part_offsets = np.zeros(num_parts + 1, dtype=np.int64)
    np.cumsum(np.bincount(part, minlength=num_parts), out=part_offsets[1:])
    return new_to_orig, orig_to_new, part_offsets


def file_sha256(path: str | os.PathLike, block: int = 16 << 20, stop=None) -> str | None:
    """Hex sha256 of a file's bytes; None if the ``stop`` event (threading.Event) gets set."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            if stop is not None and stop.is_set():
                return None
            h.update(chunk)
    return h.hexdigest()


def tool_versions(metis_library: str | None = None) -> dict:
    """Versions of the tools that shape the store's content (``metis_library``: the description
    of the METIS build that made the assignment; default: the one METIS calls would use)."""
    from importlib import metadata

    import pymetis

    from hpcgnn.partition.metis import metis_version

    versions = {"hpcgnn": __version__, "numpy": np.__version__, "h5py": h5py.__version__,
                "hdf5": h5py.version.hdf5_version, "pymetis": pymetis.version,
                "METIS": metis_library or metis_version()}
    try:
        versions["cmeel-metis"] = metadata.version("cmeel-metis")
    except metadata.PackageNotFoundError:
        pass
    return versions


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _create(f: h5py.File, name: str, data: np.ndarray) -> None:
    f.create_dataset(name, data=data, track_times=False)


def _drop_halos(indptr, indices, halo_ids, send_indptr, send_ids, halo_drop: list, part_id: int):
    """Partition ``part_id``'s arrays without the halo vertices ``halo_drop[part_id]`` (new IDs,
    sorted) and their in-edges, and without the rows its send lists would send to the halo
    vertices other partitions dropped (RAPA halo trimming, :mod:`hpcgnn.partition.rapa`)."""
    mine = halo_drop[part_id]
    if mine.size:
        keep = ~np.isin(indices, mine, assume_unique=False)
        rows = np.repeat(np.arange(indptr.shape[0] - 1, dtype=np.int64), np.diff(indptr))
        indptr = np.zeros_like(indptr)
        np.cumsum(np.bincount(rows[keep], minlength=indptr.shape[0] - 1), out=indptr[1:])
        indices = indices[keep]
        halo_ids = halo_ids[~np.isin(halo_ids, mine)]
    k = send_indptr.shape[0] - 1
    keep = np.ones(send_ids.shape[0], dtype=bool)
    for q in range(k):   # one vectorised test per peer
        b, e = int(send_indptr[q]), int(send_indptr[q + 1])
        if e > b and halo_drop[q].size:
            keep[b:e] = ~np.isin(send_ids[b:e], halo_drop[q])
    dest = np.repeat(np.arange(k, dtype=np.int64), np.diff(send_indptr))
    counts = np.bincount(dest[keep], minlength=k)
    send_indptr = np.zeros_like(send_indptr)
    np.cumsum(counts, out=send_indptr[1:])
    return indptr, indices, halo_ids, send_indptr, send_ids[keep]


def _part_arrays(source: GraphSource, part_id: int, new_to_orig: np.ndarray, orig_to_new: np.ndarray,
                 part_offsets: np.ndarray, degree: np.ndarray, halo_drop: list | None = None) -> tuple[dict, int]:
    """({dataset: array} of partition ``part_id`` in PART_DATASETS dtypes (features as the source
    stores them), in-edges cut before trimming); ``halo_drop``: per partition, sorted new IDs of
    halo vertices it drops.

    Only this partition's CSR rows are gathered: the native kernel gets them as a CSR over all
    vertices whose other rows are empty (an O(V) row pointer)."""
    from hpcgnn.native import partition as native

    b, e = int(part_offsets[part_id]), int(part_offsets[part_id + 1])
    rows = new_to_orig[b:e]
    sub_indptr = np.zeros(source.num_nodes + 1, dtype=np.int64)
    sub_indptr[rows + 1] = degree[rows]
    np.cumsum(sub_indptr, out=sub_indptr)
    sub_indices = source.gather_indices(rows)
    indptr, indices, halo_ids, send_indptr, send_ids, cut_entries = native.extract_part(
        sub_indptr, sub_indices, rows, orig_to_new, part_offsets, part_id)
    del sub_indptr, sub_indices
    solid_degree = np.diff(indptr)
    if halo_drop is not None:
        indptr, indices, halo_ids, send_indptr, send_ids = _drop_halos(
            indptr, indices, halo_ids, send_indptr, send_ids, halo_drop, part_id)
    vertex = source.vertex_rows(rows)
    data = {
        "indptr": indptr,
        "indices": indices,
        "halo_ids": halo_ids,
        "halo_owner": (np.searchsorted(part_offsets, halo_ids, side="right") - 1).astype(np.int32),
        "halo_degree": degree[new_to_orig[halo_ids]],
        "degree": solid_degree,        # the full graph's degree, also after halo trimming
        **vertex,
        "send_indptr": send_indptr,
        "send_ids": send_ids,
    }
    assert set(data) == set(PART_DATASETS)
    return data, int(cut_entries)


def _write_part(path: Path, data: dict, attrs: dict, feature_attrs: dict | None = None) -> None:
    """Write one partition file: its datasets and attributes (part_hash and content_hash come
    later). A write the OS refuses is the OSError raised at the end (:func:`hpcgnn.fileio.h5_writing`)."""
    with h5_writing(path) as f:
        for name in PART_DATASETS:
            _create(f, name, data[name])
        for key, value in (feature_attrs or {}).items():
            f["features"].attrs[key] = value
        for key, value in attrs.items():
            f.attrs[key] = value


def write_store(out: str | os.PathLike, graph: Graph | GraphSource, part: np.ndarray, num_parts: int, *,
                method: str, seed: int, constraints, source_graph: str, source_hash: str,
                metis_options: dict | None = None, metis_library: str | None = None,
                force: bool = False, progress: bool = True, meter: StepMeter | None = None,
                halo_drop: list | None = None, extra_attrs: dict | None = None,
                comm=None) -> StoreSummary:
    """Renumber ``graph`` by the assignment ``part`` and write the store to directory ``out``.

    ``graph``: a :class:`Graph` in memory or a :class:`~hpcgnn.partition.source.GraphSource`
    (:class:`~hpcgnn.partition.source.FileSource` reads the graph file one partition's rows at
    a time: peak memory O(V) plus one partition's data). Features keep their stored dtype.
    ``metis_options`` ({"ufactor": int, "niter": int, ...} for METIS assignments) become
    attributes of the same names in the metadata file; ``metis_library`` (the description of
    the METIS build used) becomes its attribute ``metis_library`` and tool_versions' "METIS".
    ``meter``: the caller's :class:`StepMeter` with its finished steps (read, assign, ...); this
    function measures its own work as step ``write`` and records every step in ``meta.h5``.

    ``halo_drop``: per partition, the original IDs of halo vertices it drops with their in-edges
    (RAPA halo trimming, :func:`hpcgnn.partition.rapa.trim_halos`); the owners' send lists drop
    them too, and ``degree`` stays the full graph's. ``extra_attrs``: more ``meta.h5``
    attributes (str/int/float; dicts and lists as JSON), outside the content hash.

    ``comm`` (an mpi4py communicator; collective over it): every rank passes the same
    arguments and writes the partitions ``p`` with ``p % size == rank``; rank 0 makes the
    temporary directory and writes ``meta.h5`` last. The store's datasets are the same bytes
    whatever the number of ranks. A write error on any rank is an InputError on every rank.

    ``out`` must not exist unless ``force``; nothing is left behind if writing fails, and an
    OSError while writing (a full disk, a lost permission) is a one-line InputError naming ``out``.
    """
    own_meter = meter is None
    meter = meter or StepMeter()
    source = graph if isinstance(graph, GraphSource) else MemorySource(graph)
    try:
        return _write_store(out, source, part, num_parts, method=method, seed=seed, constraints=constraints,
                            source_graph=source_graph, source_hash=source_hash, metis_options=metis_options,
                            metis_library=metis_library, force=force, progress=progress, meter=meter,
                            halo_drop=halo_drop, extra_attrs=extra_attrs, comm=comm)
    finally:
        if own_meter:
            meter.close()


@contextlib.contextmanager
def _one_line_write_errors(out: Path):
    """Turn an OSError raised inside into :func:`hpcgnn.fileio.write_error` naming ``out``."""
    try:
        yield
    except OSError as exc:
        raise write_error(out, exc) from None


def _record_steps(f: h5py.File, records: list[StepRecord]) -> None:
    """Fill the step datasets (created with the final shapes) in place."""
    values = {"step_seconds": [r.seconds for r in records], "step_peak_rss": [r.peak_rss for r in records],
              "step_peak_exact": [r.exact for r in records]}
    for name, dtype in STEP_DATASETS.items():
        f[name][...] = np.asarray(values[name], dtype=dtype)


class _Serial:
    """The communicator of a one-process write (the mpi4py calls the writer uses)."""

    rank, size = 0, 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]


def _agree(comm, error: str | None) -> None:
    """Collective: every rank raises InputError with the first rank's error, if any rank has one."""
    first = next((e for e in comm.allgather(error) if e), None)
    if first is not None:
        raise InputError(first)


def _write_store(out, source: GraphSource, part: np.ndarray, num_parts: int, *, method, seed, constraints,
                 source_graph, source_hash, metis_options, metis_library, force, progress,
                 meter: StepMeter, halo_drop=None, extra_attrs=None, comm=None) -> StoreSummary:
    comm = comm or _Serial()
    out = check_output(out, force)
    k = int(num_parts)
    part = np.asarray(part, dtype=np.int64)
    if part.shape != (source.num_nodes,) or (part.size and (part.min() < 0 or part.max() >= k)):
        raise ValueError(f"part must be int [{source.num_nodes}] with values in [0, {k})")
    step_names = [r.name for r in meter.records()[:-1]] + ["write", "total"]
    root = comm.rank == 0
    tmp_box: list = []
    with contextlib.ExitStack() as stack:
        if root:
            try:
                with _one_line_write_errors(out):
                    tmp = stack.enter_context(atomic_dir(out))
                    os.chmod(tmp, 0o777 & ~_umask())  # atomic_dir creates it 0700; give the store normal permissions
                tmp_box.append(str(tmp))
            except InputError as exc:
                tmp_box.append(exc)
        made = comm.bcast(tmp_box[0] if root else None, root=0)
        if isinstance(made, InputError):
            raise InputError(str(made))
        tmp = Path(made)
        with meter.step("write"):
            degree = source.degree()
            new_to_orig, orig_to_new, part_offsets = renumber(part, k)
            if halo_drop is not None:
                if len(halo_drop) != k:
                    raise ValueError(f"halo_drop has {len(halo_drop)} entries, expected {k}")
                halo_drop = [np.sort(orig_to_new[np.asarray(d, dtype=np.int64)]) for d in halo_drop]
            weights = part_weights(part, k, degree, source.train_mask)
            bal = {name: imbalance(w) for name, w in weights.items()}
            mine = list(range(comm.rank, k, comm.size))
            error, written = None, {}
            try:
                with _one_line_write_errors(out):
                    written = _write_parts(tmp, source, mine, k, new_to_orig, orig_to_new, part_offsets,
                                           degree, progress and root, halo_drop)
            except InputError as exc:
                error = str(exc)
            _agree(comm, error)
            results = {}
            for got in comm.allgather(written):
                results.update(got)
            halo_counts = np.array([results[p][0] for p in range(k)], dtype=np.int64)
            part_hashes = [results[p][1] for p in range(k)]
            edge_cut = sum(results[p][2] for p in range(k)) // 2
            meta = {"part_offsets": part_offsets, "new_to_orig": new_to_orig, "halo_counts": halo_counts}
            content_hash = combine_hashes(datasets_digest(meta, META_DATASETS), part_hashes)
            error = None
            if root:
                try:
                    with _one_line_write_errors(out):
                        _write_meta(tmp, meta, part_hashes, content_hash, step_names, {
                            "format": META_FORMAT, "version": STORE_VERSION, "num_parts": k, "method": method,
                            "seed": int(seed), "num_nodes": source.num_nodes, "num_edges": source.num_edges,
                            "num_features": source.num_features, "num_classes": int(source.num_classes),
                            "edge_cut": int(edge_cut), "balance": json.dumps(bal, sort_keys=True),
                            "constraints": json.dumps(list(constraints)), "source_graph": str(source_graph),
                            "source_hash": source_hash,
                            "feature_normalization": str(source.meta.get("feature_normalization", "none")),
                            "feature_dtype": str(source.meta.get("feature_dtype", "float32")),
                            "tool_versions": json.dumps(tool_versions(metis_library), sort_keys=True),
                            "content_hash": content_hash, "hpcgnn_version": __version__,
                            "steps": json.dumps(step_names), "writer_ranks": int(comm.size),
                        }, metis_library, metis_options, extra_attrs)
                except InputError as exc:
                    error = str(exc)
        _agree(comm, comm.bcast(error, root=0))
        records = meter.records()
        assert [r.name for r in records] == step_names, (records, step_names)
        error = None
        if root:
            try:
                with _one_line_write_errors(out), h5py.File(tmp / META_FILE, "r+") as f:
                    _record_steps(f, records)
            except InputError as exc:
                error = str(exc)
        _agree(comm, comm.bcast(error, root=0))
        if root:
            try:
                with _one_line_write_errors(out):
                    stack.close()          # atomic_dir: the store appears at ``out``
            except InputError as exc:
                error = str(exc)
    _agree(comm, comm.bcast(error, root=0))
    return StoreSummary(path=out, num_parts=k, num_edges=source.num_edges, edge_cut=int(edge_cut),
                        balance=bal, part_weights=weights, halo_counts=halo_counts,
                        content_hash=content_hash, steps=records)


def _write_meta(tmp: Path, meta: dict, part_hashes: list, content_hash: str, step_names: list, attrs: dict,
                metis_library, metis_options, extra_attrs) -> None:
    """meta.h5 (step datasets created with their final shapes, filled later) and every partition
    file's part_hash and content_hash attributes."""
    with h5py.File(tmp / META_FILE, "w") as f:
        for name in META_DATASETS:
            _create(f, name, meta[name])
        for name, dtype in STEP_DATASETS.items():
            _create(f, name, np.zeros(len(step_names), dtype=dtype))
        if metis_library:
            attrs["metis_library"] = metis_library
        for key, value in (metis_options or {}).items():
            attrs[key] = int(value)
        for key, value in (extra_attrs or {}).items():
            attrs[key] = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, tuple)) else value
        for key, value in attrs.items():
            f.attrs[key] = value
    for p, ph in enumerate(part_hashes):
        with h5py.File(tmp / part_file_name(p), "r+") as f:
            f.attrs["part_hash"] = ph
            f.attrs["content_hash"] = content_hash


def _write_parts(tmp: Path, source: GraphSource, parts: list, k: int, new_to_orig, orig_to_new, part_offsets,
                 degree, progress: bool, halo_drop=None) -> dict:
    """Cut out and write the partition files ``parts``; {p: (halo count, part hash, cut entries)}.

    Pipeline: partition p's digest is computed in a thread (hashlib releases the GIL) while
    the next one is cut out and written. The digest of the arrays equals datasets_digest of the
    written datasets (same names, dtypes, shapes and bytes), so the file is not read back.
    The same thread then syncs the written file and drops it from the page cache.
    """
    out = {}
    with Progress("partition: writing", total=len(parts), enabled=progress) as bar, \
            ThreadPoolExecutor(max_workers=1) as pool:
        pending, synced = None, []
        for p in parts:
            data, cut = _part_arrays(source, p, new_to_orig, orig_to_new, part_offsets, degree, halo_drop)
            digest = pool.submit(datasets_digest, data, PART_DATASETS)
            halo = int(data["halo_ids"].shape[0])
            b, e = int(part_offsets[p]), int(part_offsets[p + 1])
            _write_part(tmp / part_file_name(p), data, {
                "format": PART_FORMAT, "version": STORE_VERSION, "part_id": p, "num_parts": k,
                "solid_begin": b, "solid_end": e, "num_solid": e - b, "num_halo": halo,
                "num_features": source.num_features, "num_classes": int(source.num_classes),
                "hpcgnn_version": __version__}, source.feature_attrs)
            del data
            synced.append(pool.submit(persist_and_drop_cache, tmp / part_file_name(p)))
            if pending is not None:
                q, h, c, fut = pending
                out[q] = (h, fut.result(), c)
            pending = (p, halo, cut, digest)
            bar.update(1)
        if pending is not None:
            q, h, c, fut = pending
            out[q] = (h, fut.result(), c)
        for future in synced:
            future.result()
    return out
