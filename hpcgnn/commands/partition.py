"""`hpcgnn partition GRAPH.h5 --parts K --out DIR`: write a partition store.

METIS k-way min-edge-cut with multi-constraint balance of vertices, training vertices and
edges (vertex weights [1, is_train, degree], as DistDGL/DistGNN-MB), or a seeded random or
contiguous assignment. Prints a one-paragraph summary; the store layout is docs/formats.md.
"""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError
from hpcgnn.partition.balance import CONSTRAINTS
from hpcgnn.partition.methods import METHODS
from hpcgnn.partition.metis import DEFAULT_NITER

SEED_MAX = 2**31 - 1


def add_arguments(parser) -> None:
    parser.add_argument("graph", metavar="GRAPH.h5", help="graph file written by `hpcgnn prepare`")
    parser.add_argument("--parts", type=int, required=True, metavar="K",
                        help="number of partitions (= MPI ranks that will train on the store)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output partition directory")
    parser.add_argument("--method", choices=METHODS, default="metis",
                        help="assignment method (default: metis)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (METIS and random; default 0)")
    parser.add_argument("--constraints", default=",".join(CONSTRAINTS), metavar="LIST",
                        help="METIS balance constraints, a subset of vertices,train,edges "
                             "(default: all three)")
    parser.add_argument("--ufactor", type=int, default=30,
                        help="METIS allowed imbalance per constraint in 1/1000 (default 30 = 3%%)")
    parser.add_argument("--niter", type=int, default=DEFAULT_NITER,
                        help=f"METIS refinement passes per level (default {DEFAULT_NITER}; METIS' own "
                             "default 10 can lower the cut of unstructured graphs by 2-3%% for twice the time)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def partition_file(graph_path, out, parts: int, method: str = "metis", seed: int = 0,
                   constraints: str = ",".join(CONSTRAINTS), ufactor: int = 30, force: bool = False,
                   progress: bool = True, niter: int = DEFAULT_NITER):
    """Partition the graph file ``graph_path`` into the store ``out``.

    Returns (StoreSummary, timings): wall seconds of ``read`` (the whole graph file),
    ``assign`` (METIS/random/contiguous, which overlaps the read after the topology is in),
    ``wait_assign`` (the part of it after the read) and ``write``; CPU seconds
    ``read_cpu`` and ``assign_cpu`` (of their threads) and ``write_cpu`` (process, all threads).
    Raises InputError on bad arguments or inputs, before any heavy work.
    """
    from hpcgnn.data.graph import read_graph_attrs
    from hpcgnn.fileio import check_output
    from hpcgnn.partition.methods import parse_constraints
    from hpcgnn.partition.writer import file_sha256

    graph_path = Path(graph_path)
    names = parse_constraints(constraints)
    if method not in METHODS:
        raise InputError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    if not 0 <= seed <= SEED_MAX:
        raise InputError(f"--seed {seed}: expected an integer in [0, {SEED_MAX}]")
    if not 1 <= ufactor <= 1000:
        raise InputError(f"--ufactor {ufactor}: expected an integer in [1, 1000] (thousandths)")
    if not 1 <= niter <= 1000:
        raise InputError(f"--niter {niter}: expected an integer in [1, 1000]")
    check_output(out, force)
    attrs = read_graph_attrs(graph_path)
    n = int(attrs.get("num_nodes", 0))
    if not 1 <= parts <= n:
        raise InputError(f"--parts {parts}: expected an integer in [1, {n}] ({graph_path} has {n} vertices)")
    # Hash the source file in a thread (hashlib releases the GIL) while the graph is read and partitioned.
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        source_hash = pool.submit(file_sha256, graph_path, stop=stop)
        try:
            return _partition_graph(graph_path, source_hash, out, parts, method, seed, names, ufactor,
                                    niter, force, progress)
        finally:
            stop.set()  # after a failure, do not wait for the hash of a large file


def _partition_graph(graph_path: Path, source_hash, out, parts, method, seed, names, ufactor, niter,
                     force, progress):
    """Read, assign, write; ``source_hash`` is a future of the graph file's sha256.

    The assignment needs only the topology and the training mask: it starts in a thread
    (METIS runs in C without the GIL) as soon as those are read and checked, while this
    thread reads and validates the features, labels and other masks.
    """
    from hpcgnn.data.graph import read_graph, read_topology
    from hpcgnn.partition.methods import assign_parts
    from hpcgnn.partition.writer import write_store
    from hpcgnn.progress import Progress

    t0, c0 = time.perf_counter(), time.thread_time()
    topology = indptr, indices, train_mask = read_topology(graph_path)
    assigned: dict = {}

    def assign() -> None:
        ta, ca = time.perf_counter(), time.thread_time()
        try:
            assigned["value"] = assign_parts(method, indptr, indices, train_mask, parts, seed, names, ufactor, niter)
        except BaseException as exc:  # re-raised in the calling thread
            assigned["error"] = exc
        assigned["wall"], assigned["cpu"] = time.perf_counter() - ta, time.thread_time() - ca

    # A daemon thread: if the rest of the file turns out to be bad, the error is reported at once.
    worker = threading.Thread(target=assign, name="hpcgnn-partition-assign", daemon=True)
    worker.start()
    with Progress("partition: reading graph", enabled=progress) as bar:
        graph = read_graph(graph_path, topology=topology)
        bar.update(graph.num_nodes)
    t1, c1 = time.perf_counter(), time.thread_time()
    with Progress(f"partition: {method} into {parts} parts", enabled=progress) as bar:
        worker.join()
        bar.update(graph.num_nodes)
    if "error" in assigned:
        raise assigned["error"]
    part, used = assigned["value"]
    t2, c2 = time.perf_counter(), time.process_time()
    summary = write_store(out, graph, part, parts, method=method, seed=seed, constraints=used,
                          source_graph=str(graph_path.resolve()), source_hash=source_hash.result(),
                          metis_options={"ufactor": ufactor, "niter": niter} if method == "metis" else None,
                          force=force, progress=progress)
    t3, c3 = time.perf_counter(), time.process_time()
    return summary, {"read": t1 - t0, "assign": assigned["wall"], "wait_assign": t2 - t1, "write": t3 - t2,
                     "read_cpu": c1 - c0, "assign_cpu": assigned["cpu"], "write_cpu": c3 - c2}


def run(args) -> int:
    summary, t = partition_file(args.graph, args.out, args.parts, args.method, args.seed, args.constraints,
                                args.ufactor, args.force, progress=not args.quiet, niter=args.niter)
    bal = ", ".join(f"{k} {v:.3f}" for k, v in summary.balance.items())
    cut_pct = 100 * summary.edge_cut / max(summary.num_edges // 2, 1)
    print(f"wrote {summary.path}: {summary.num_parts} partitions ({args.method}, seed {args.seed}), "
          f"edge cut {summary.edge_cut} ({cut_pct:.1f}%), balance max/mean: {bal}; "
          f"halo {int(summary.halo_counts.sum())} vertices; "
          f"read {t['read']:.1f}s, {args.method} {t['assign']:.1f}s, write {t['write']:.1f}s", file=sys.stdout)
    for what, name in (("vertices", "vertices"), ("train", "training vertices")):
        empty = np.flatnonzero(summary.part_weights[what] == 0)
        if empty.size and (what == "vertices" or summary.part_weights[what].any()):
            ids = ", ".join(map(str, empty[:10])) + (", ..." if empty.size > 10 else "")
            plural = empty.size > 1
            print(f"hpcgnn partition: warning: partition{'s' if plural else ''} {ids} "
                  f"{'have' if plural else 'has'} no {name}", file=sys.stderr)
    return 0
