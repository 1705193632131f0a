"""Partition a graph file into a store (what `hpcgnn partition` runs): :func:`partition_file`.

The steps (:data:`STEPS`) run one after another so that each holds only what it needs. ``read``
loads the topology with 32-bit vertex IDs when the graph allows; ``prepare`` builds METIS'
vertex weights in its own index type (or writes KaMinPar's input file and lets the topology
go); ``assign`` runs METIS (cmeel-metis' 32-bit build when installed, see
hpcgnn.partition.metis) on those arrays without copies, or KaMinPar, or the random or
contiguous assignment; ``trim`` is RAPA's halo trimming (:mod:`hpcgnn.partition.rapa`);
``read_data`` checks the features, labels and masks against the file's hashes in blocks, and
``write`` reads and writes one partition at a time from the graph file
(hpcgnn.partition.source): O(V) plus one partition. With an MPI communicator rank 0 reads and
assigns, and the ranks write the partitions in parallel; the store is the same as one process
writes (layout: docs/formats.md).
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError
from hpcgnn.partition.balance import CONSTRAINTS
from hpcgnn.partition.kaminpar import CONTEXTS as KAMINPAR_CONTEXTS
from hpcgnn.partition.kaminpar import DEFAULT_CONTEXT as KAMINPAR_DEFAULT_CONTEXT
from hpcgnn.partition.methods import METHODS
from hpcgnn.partition.metis import DEFAULT_NITER, LIBRARIES

SEED_MAX = 2**31 - 1
STEPS = ("read", "prepare", "assign", "read_data", "trim", "write")


def partition_file(graph_path, out, parts: int, method: str = "metis", seed: int = 0,
                   constraints: str = ",".join(CONSTRAINTS), ufactor: int = 30, force: bool = False,
                   progress: bool = True, niter: int = DEFAULT_NITER, metis_library: str = "auto",
                   metis_ondisk: bool | None = None, rank_speed: str | None = None,
                   halo_trim: bool = False, trim_threshold: float | None = None,
                   memory_budget: str | None = None, kaminpar_threads: int = 1,
                   kaminpar_context: str = KAMINPAR_DEFAULT_CONTEXT, comm=None, log=None):
    """Partition the graph file ``graph_path`` into the store ``out``.

    ``method`` "auto" picks METIS when its modelled memory fits ``memory_budget`` (a size; default:
    what the node has available, :func:`hpcgnn.run.memory.memory_budget`) and KaMinPar
    otherwise (:func:`hpcgnn.partition.methods.choose_method`), says so in one line on ``log``
    (default stdout) and records it in the store; a graph that even KaMinPar cannot partition
    within the budget is an InputError naming the memory it needs. ``comm`` (mpi4py, collective):
    rank 0 reads and assigns, every rank writes its share of the partitions
    (:func:`hpcgnn.partition.writer.write_store`); all ranks return the same summary.

    Returns (StoreSummary, timings): wall seconds of each step in STEPS that ran and of
    ``total``; ``summary.steps`` holds their peak memory too (also recorded in meta.h5).
    ``rank_speed`` (RAPA, :mod:`hpcgnn.partition.rapa`): relative rank speeds (a comma list,
    a file or a run); METIS sizes the parts in proportion (equal speeds: today's partition).
    ``halo_trim``: then apply the halo-trimming step, stopping at ``trim_threshold``.
    Raises InputError on bad arguments or inputs (an unwritable output directory included),
    before any heavy work; a graph file that fails its recorded hashes or the CSR invariants
    (:func:`hpcgnn.data.graph.read_topology`) before the assignment; an OSError while writing the
    store as a one-line InputError, with nothing left behind.
    """
    from hpcgnn.data.graph import read_graph_attrs
    from hpcgnn.fileio import check_output, check_writable_dir
    from hpcgnn.partition.methods import choose_method, parse_constraints
    from hpcgnn.partition.writer import file_sha256
    from hpcgnn.run.memory import memory_budget as parse_budget

    graph_path = Path(graph_path).resolve()  # --metis-ondisk changes the working directory
    out = Path(out)
    names = parse_constraints(constraints)
    if method not in METHODS:
        raise InputError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    if not 0 <= seed <= SEED_MAX:
        raise InputError(f"--seed {seed}: expected an integer in [0, {SEED_MAX}]")
    if not 1 <= ufactor <= 1000:
        raise InputError(f"--ufactor {ufactor}: expected an integer in [1, 1000] (thousandths)")
    if not 1 <= niter <= 1000:
        raise InputError(f"--niter {niter}: expected an integer in [1, 1000]")
    if metis_library not in ("auto", *LIBRARIES):
        raise InputError(f"--metis-library {metis_library!r}: expected auto or one of {', '.join(LIBRARIES)}")
    if not 1 <= kaminpar_threads <= 4096:
        raise InputError(f"--kaminpar-threads {kaminpar_threads}: expected an integer in [1, 4096]")
    if kaminpar_context not in KAMINPAR_CONTEXTS:
        raise InputError(f"--kaminpar-context {kaminpar_context!r}: expected one of {', '.join(KAMINPAR_CONTEXTS)}")
    root = comm is None or comm.rank == 0
    budget = parse_budget(memory_budget)
    if comm is not None:
        budget = comm.bcast(budget, root=0)      # rank 0's node decides
    check_output(out, force)
    check_writable_dir(out.parent, "output directory")
    attrs = read_graph_attrs(graph_path)
    n = int(attrs.get("num_nodes", 0))
    if not 1 <= parts <= n:
        raise InputError(f"--parts {parts}: expected an integer in [1, {n}] ({graph_path} has {n} vertices)")
    m = int(attrs.get("num_edges", 0))
    choice = None
    if method == "auto":
        if metis_library != "auto" or metis_ondisk:    # METIS options named: they must be usable
            _metis_library(metis_library, bool(metis_ondisk), n, m, len(names))
        choice = choose_method(str(graph_path), n, m, parts, len(names), budget[0], budget[1], metis_library,
                               metis_ondisk)
        method = choice.method
        if root:
            print(choice.line(), file=log or sys.stdout, flush=True)
    rapa = _rapa_settings(rank_speed, halo_trim, trim_threshold, parts, method)
    kaminpar_opts = {"threads": int(kaminpar_threads), "context": kaminpar_context}
    library = None
    if method == "metis":
        library = _metis_library(metis_library, bool(metis_ondisk), n, int(attrs.get("num_edges", 0)), len(names))
        if metis_ondisk is None:     # default: wherever the library can
            metis_ondisk = library.supports_ondisk
    # Hash the source file in a thread (hashlib releases the GIL) while the graph is read and partitioned.
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        source_hash = pool.submit(file_sha256, graph_path, stop=stop) if root else None
        try:
            return _partition_graph(graph_path, source_hash, out, parts, method, seed, names, ufactor,
                                    niter, force, progress and root, library,
                                    bool(metis_ondisk) and method == "metis", rapa, choice, kaminpar_opts, comm)
        finally:
            stop.set()  # after a failure, do not wait for the hash of a large file


def _metis_library(name: str, ondisk: bool, num_nodes: int, num_edges: int, ncon: int):
    """The METIS build for this graph (InputError when the requested one is unusable)."""
    from hpcgnn.partition.metis import choose_library

    try:
        library = choose_library(name, num_nodes, num_edges, ncon)
    except RuntimeError as exc:
        raise InputError(f"--metis-library {name}: {exc}") from None
    if ondisk and not library.supports_ondisk:
        raise InputError(f"--metis-ondisk needs METIS 5.2 (cmeel-metis); this graph would use "
                         f"{library.describe()}")
    return library


def _rapa_settings(rank_speed, halo_trim: bool, trim_threshold, parts: int, method: str) -> dict | None:
    """Validated RAPA options: {speeds, source, fractions, trim, threshold}, or None without them."""
    from hpcgnn.partition import rapa

    if trim_threshold is not None and not halo_trim:
        raise InputError("--trim-threshold needs --halo-trim")
    threshold = rapa.DEFAULT_TRIM_THRESHOLD if trim_threshold is None else float(trim_threshold)
    if not rapa.is_valid_threshold(threshold):
        raise InputError(f"--trim-threshold {trim_threshold}: expected a number in (0, 1)")
    if rank_speed is None and not halo_trim:
        return None
    if rank_speed is not None:
        if method != "metis":
            raise InputError(f"--rank-speed needs --method metis (METIS target part weights), not {method}")
        speeds, source = rapa.read_rank_speed(rank_speed, parts)
    else:
        speeds, source = np.ones(parts), "equal (no --rank-speed)"
    return {"speeds": speeds, "source": source, "fractions": rapa.target_fractions(speeds),
            "trim": bool(halo_trim), "threshold": threshold}


def _partition_graph(graph_path: Path, source_hash, out: Path, parts, method, seed, names, ufactor, niter,
                     force, progress, library, ondisk: bool, rapa_opts: dict | None = None, choice=None,
                     kaminpar_opts: dict | None = None, comm=None):
    """Read the topology, assign, check the vertex data, write: one step at a time, each measured.

    ``source_hash`` is a future of the graph file's sha256 (None on ranks other than 0). With
    ``comm``, rank 0 runs the steps up to the assignment and broadcasts it; every rank writes.
    """
    from hpcgnn.partition.memory import StepMeter
    from hpcgnn.partition.source import FileSource
    from hpcgnn.partition.writer import write_store

    root = comm is None or comm.rank == 0
    with StepMeter() as meter:
        assigned, error = None, None
        if root:
            try:
                assigned = _assign(graph_path, out, parts, method, seed, names, ufactor, niter, progress, library,
                                   ondisk, rapa_opts, kaminpar_opts, meter)
            except InputError as exc:
                if comm is None:
                    raise
                error = str(exc)
        if comm is not None:
            error = comm.bcast(error, root=0)
            if error is not None:
                raise InputError(error)
            assigned = _bcast_assignment(comm, assigned)
        part, used, halo_drop, extra, indptr, train_mask = assigned
        extra = dict(extra or {})
        if choice is not None:
            extra.update(choice.attrs())
        metis_options = None
        if method == "metis":
            metis_options = {"ufactor": ufactor, "niter": niter, "metis_ondisk": int(ondisk)}
        with FileSource(graph_path, indptr, train_mask) as source:
            del indptr, train_mask
            summary = write_store(out, source, part, parts, method=method, seed=seed, constraints=used,
                                  source_graph=str(graph_path),
                                  source_hash=source_hash.result() if source_hash is not None else "",
                                  metis_options=metis_options,
                                  metis_library=library.describe() if library is not None else None,
                                  force=force, progress=progress, meter=meter, halo_drop=halo_drop,
                                  extra_attrs=extra, comm=comm)
    return summary, {r.name: r.seconds for r in summary.steps}


def _bcast_assignment(comm, assigned):
    """Rank 0's (part, constraints, halo_drop, extra attributes, indptr, train_mask) on every rank
    (the V-sized arrays as MPI buffers, the rest pickled)."""
    from mpi4py import MPI

    small = None
    if comm.rank == 0:
        part, used, halo_drop, extra, indptr, train_mask = assigned
        small = (part.shape[0], used, halo_drop, extra)
    n, used, halo_drop, extra = comm.bcast(small, root=0)
    arrays = assigned[0::4] + (assigned[5],) if comm.rank == 0 else (
        np.empty(n, dtype=np.int64), np.empty(n + 1, dtype=np.int64), np.empty(n, dtype=bool))
    part, indptr, train_mask = arrays
    comm.Bcast([part, MPI.INT64_T], root=0)
    comm.Bcast([indptr, MPI.INT64_T], root=0)
    comm.Bcast([train_mask.view(np.uint8), MPI.UINT8_T], root=0)
    return part, used, halo_drop, extra, indptr, train_mask


def _assign(graph_path: Path, out: Path, parts, method, seed, names, ufactor, niter, progress, library,
            ondisk: bool, rapa_opts, kaminpar_opts, meter):
    """Steps read, prepare, assign (and trim), read_data on one process: (part, constraints
    balanced, halo_drop, extra meta attributes, indptr, train_mask)."""
    from hpcgnn.data.graph import read_graph_attrs, read_topology
    from hpcgnn.partition import kaminpar, rapa
    from hpcgnn.partition.methods import assign_parts, metis_weights
    from hpcgnn.partition.metis import part_graph_kway
    from hpcgnn.partition.source import FileSource
    from hpcgnn.progress import Progress

    n = int(read_graph_attrs(graph_path)["num_nodes"])
    extra = {}
    with meter.step("read"), Progress("partition: reading topology", enabled=progress) as bar:
        if library is not None and parts > 1:
            index_dtype = library.idx_dtype  # what METIS takes without a copy
        else:
            index_dtype = np.int32 if n <= np.iinfo(np.int32).max else np.int64
        indptr, indices, train_mask = read_topology(graph_path, index_dtype)
        bar.update(n)
    if method == "metis" and parts > 1:
        with meter.step("prepare"):
            metis_indptr = indptr.astype(library.idx_dtype)
            vwgt, used = metis_weights(indptr, train_mask, names, library.idx_dtype)
            tpwgts = None   # equal speeds: METIS' own equal targets, today's partition exactly
            if rapa_opts is not None and not rapa.equal_speeds(rapa_opts["speeds"]):
                tpwgts = rapa.tpwgts_matrix(rapa_opts["fractions"], 1 if vwgt is None else vwgt.shape[1])
        with meter.step("assign"), Progress(f"partition: metis into {parts} parts", enabled=progress) as bar:
            part, _ = part_graph_kway(metis_indptr, indices, parts, vwgt, seed=seed, ufactor=ufactor,
                                      niter=niter, library=library,
                                      ondisk=out.resolve().parent if ondisk else None, tpwgts=tpwgts)
            del metis_indptr, vwgt
            bar.update(n)
    elif method == "kaminpar":
        with meter.step("prepare"):
            graph_input = kaminpar.write_input(indptr, indices, train_mask, names, scratch=out.resolve().parent)
            del indices     # KaMinPar reads the file; the repair maps it
        try:
            with meter.step("assign"), Progress(f"partition: kaminpar into {parts} parts", enabled=progress) as bar:
                result = kaminpar.run_kaminpar(graph_input, indptr, train_mask, parts, seed, ufactor / 1000.0,
                                               context=kaminpar_opts["context"], threads=kaminpar_opts["threads"])
                meter.child_peak(result.child_peak_rss)
                bar.update(n)
        finally:
            graph_input.remove()
        part, used = result.part, result.constraints
        extra.update(result.attrs())
        extra["kaminpar_version"] = kaminpar.version()
        if result.over:
            print(f"hpcgnn partition: warning: KaMinPar's repair pass left {', '.join(result.over)} over "
                  f"{1 + ufactor / 1000:.3f} x the mean in some partition (see the balance below)", file=sys.stderr)
    else:
        with meter.step("assign"):
            part, used = assign_parts(method, indptr, indices, train_mask, parts, seed, names)
    halo_drop = None
    if rapa_opts is not None:
        extra.update({"rank_speed": rapa_opts["speeds"].tolist(), "rank_speed_source": rapa_opts["source"],
                      "target_fractions": rapa_opts["fractions"].tolist()})
        if rapa_opts["trim"]:
            with meter.step("trim"):
                if method == "kaminpar":    # the topology was given up for KaMinPar's memory
                    _, indices, _ = read_topology(graph_path, index_dtype)
                trim = rapa.trim_halos(indptr, indices, part, parts, rapa_opts["speeds"], rapa_opts["threshold"])
            halo_drop = trim.dropped
            extra["halo_trim"] = trim.summary()
    indices = None   # the writer reads each partition's rows from the file
    with meter.step("read_data"), Progress("partition: checking vertex data", enabled=progress) as bar:
        with FileSource(graph_path, indptr, train_mask) as source:
            source.verify()
        bar.update(n)
    return part, used, halo_drop, extra, indptr, train_mask
