"""KaMinPar (PyPI ``kaminpar``): shared-memory multilevel partitioning for graphs beyond
whole-graph METIS' memory, with hpcgnn's three balance constraints kept.

The graph reaches KaMinPar through a ParHIP binary file that this module writes from the CSR
in blocks (header: version, n, m as u64; n + 1 u64 byte offsets; neighbour IDs; vertex
weights), which KaMinPar compresses while reading (``compress=True``): 7-18 bytes per
directed edge with ``fast_context`` (more with more parts; :func:`memory_bytes`), measured,
against about 22 with 32-bit METIS. The Python binding has no in-memory graph constructor.

KaMinPar balances one vertex weight. hpcgnn balances up to three constraints (vertices,
training vertices, edges: :mod:`hpcgnn.partition.balance`), kept in two steps:

1. *combined weight*: each vertex weighs the sum of its shares of every constraint's total,
   ``16 N / ncon * sum_c w_c(v) / T_c`` rounded (at least 1), so a part within KaMinPar's
   ``eps`` of the combined weight is near balance in each constraint on average;
2. *repair*: :func:`hpcgnn.partition.rebalance.rebalance` then moves vertices out of parts
   still over ``(1 + eps)`` times the mean in some constraint.

Reproducibility: KaMinPar's result is a function of its seed (``kaminpar.reseed``, in force
when the context is made) with one thread, in a process that has loaded the same libraries:
measured, loading an OpenMP runtime into the process (as torch does) changed the partition of
the same graph and seed. KaMinPar therefore runs in a child interpreter that imports numpy and
kaminpar only (``python -m hpcgnn.partition.kaminpar``): the partition does not depend on what
the calling process imported (``hpcgnn partition`` alone, under mpiexec, or in a test). With
more threads the result varies from run to run (measured), so the default is one thread and
more are an opt-in that the store records. The child reports its own peak memory, which the
command records as its ``assign`` step's peak when larger than its own.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcgnn.partition.balance import vertex_weights
from hpcgnn.partition.rebalance import balance_limits, rebalance

CONTEXTS = ("fast", "default", "terapart")
DEFAULT_CONTEXT = "fast"
# Peak memory model of KaMinPar (fast context, compressed graph): bytes per directed edge
# growing with the number of parts, plus per-vertex arrays (KaMinPar's and hpcgnn's row pointer,
# weights, assignment, renumbering). Fitted as an upper bound to measurements
# (docs/benchmarks.md): products-like (123M directed edges) 1.34 GiB at 4 parts and 2.16 GiB at
# 16; a 10M-vertex SBM (497M directed edges) 3.6 GB at 4 parts, below the model's 6.4 GB.
BYTES_PER_EDGE = 8
BYTES_PER_EDGE_PER_PART = 0.6
BYTES_PER_VERTEX = 120
WEIGHT_SCALE = 16
_VERSION_NO_EDGE_WEIGHTS = 1
_VERSION_NO_VERTEX_WEIGHTS = 2
_VERSION_32BIT_VERTEX_IDS = 8
_VERSION_32BIT_EDGE_WEIGHTS = 32


def memory_bytes(num_nodes: int, num_edges: int, num_parts: int) -> int:
    """Modelled peak bytes of partitioning a graph of ``num_edges`` directed edges into
    ``num_parts`` parts with KaMinPar (an upper bound of the measurements above)."""
    per_edge = BYTES_PER_EDGE + BYTES_PER_EDGE_PER_PART * max(int(num_parts), 1)
    return int(per_edge * num_edges + BYTES_PER_VERTEX * num_nodes)


def version() -> str:
    """``KaMinPar 3.7.3`` (the installed binding), or a line saying it is missing."""
    try:
        import kaminpar
    except ImportError:
        return "unavailable (pip install kaminpar)"
    return f"KaMinPar {kaminpar.__version__}"


def combined_weights(degree: np.ndarray, train_mask: np.ndarray, constraints) -> np.ndarray:
    """int64 [N] one weight standing for ``constraints`` (see the module docstring); constraints
    of zero total weight are left out (all left out: unit weights)."""
    n = degree.shape[0]
    used = [c for c in constraints if vertex_weights(c, degree, train_mask).any()]
    if not used:
        return np.ones(n, dtype=np.int64)
    acc = np.zeros(n, dtype=np.float64)
    for name in used:
        w = vertex_weights(name, degree, train_mask)
        acc += w / float(w.sum())
    return np.maximum(np.rint(acc * (WEIGHT_SCALE * n / len(used))), 1).astype(np.int64)


def write_parhip(path, indptr: np.ndarray, indices, vwgt: np.ndarray | None = None,
                 block: int = 1 << 24) -> None:
    """Write the symmetric CSR (``indptr`` int64 [N+1]; ``indices`` an array, memory map or h5py
    dataset, read ``block`` entries at a time) and optional vertex weights (int64 [N]) as a
    ParHIP binary graph file (32-bit vertex IDs when N < 2**32)."""
    n = indptr.shape[0] - 1
    m = int(indptr[-1])
    vid = np.dtype(np.uint32) if n < 2**32 else np.dtype(np.uint64)
    ver = _VERSION_NO_EDGE_WEIGHTS | _VERSION_32BIT_EDGE_WEIGHTS
    ver |= _VERSION_32BIT_VERTEX_IDS if vid.itemsize == 4 else 0
    ver |= _VERSION_NO_VERTEX_WEIGHTS if vwgt is None else 0
    base = 24 + 8 * (n + 1)
    with open(path, "wb") as f:
        np.array([ver, n, m], dtype=np.uint64).tofile(f)
        for a in range(0, n + 1, block):
            (np.asarray(indptr[a:a + block], dtype=np.uint64) * np.uint64(vid.itemsize)
             + np.uint64(base)).tofile(f)
        for a in range(0, m, block):
            np.asarray(indices[a:a + block]).astype(vid, copy=False).tofile(f)
        if vwgt is not None:
            for a in range(0, n, block):
                np.asarray(vwgt[a:a + block], dtype=np.int64).tofile(f)


def parhip_neighbours(path, num_nodes: int, num_edges: int) -> np.memmap:
    """The neighbour IDs of a ParHIP file written by :func:`write_parhip`, memory-mapped."""
    vid = np.uint32 if num_nodes < 2**32 else np.uint64
    return np.memmap(path, dtype=vid, mode="r", offset=24 + 8 * (num_nodes + 1), shape=(num_edges,))


@dataclass
class KaMinParResult:
    part: np.ndarray                  # int64 [N]
    constraints: tuple                # the constraints balanced
    seconds: dict = field(default_factory=dict)   # write_file, kaminpar, repair
    moved: int = 0                    # vertices the repair pass moved
    over: list = field(default_factory=list)      # constraints the repair could not bring within limits
    threads: int = 1
    context: str = DEFAULT_CONTEXT
    child_peak_rss: int = 0           # bytes: the KaMinPar child's own peak resident memory

    def attrs(self) -> dict:
        """What the store records about this assignment (meta.h5 attributes)."""
        return {"kaminpar_context": self.context, "kaminpar_threads": int(self.threads),
                "kaminpar_repair_moved": int(self.moved),
                "kaminpar_seconds": {k: round(v, 3) for k, v in self.seconds.items()}}


@dataclass
class KaMinParInput:
    """The ParHIP file KaMinPar reads (a temporary: :meth:`remove` it) and what it balances."""

    path: Path
    num_nodes: int
    num_edges: int
    constraints: tuple
    seconds: float

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def write_input(indptr: np.ndarray, indices, train_mask: np.ndarray, constraints, *,
                scratch: str | os.PathLike | None = None, log=None) -> KaMinParInput:
    """Write KaMinPar's input: the CSR (``indices`` an array, memory map or h5py dataset, read in
    blocks) with the combined vertex weight of ``constraints`` (:func:`combined_weights`), to a
    temporary ParHIP file in ``scratch`` (default: the system's temporary directory).
    Constraints of zero total weight are dropped with a note on ``log``."""
    t0 = time.perf_counter()
    degree = np.diff(indptr)
    used = []
    for name in constraints:
        if vertex_weights(name, degree, train_mask).any():
            used.append(name)
        else:
            print(f"hpcgnn partition: note: constraint '{name}' has zero total weight; not balanced",
                  file=log or sys.stderr)
    used = tuple(used) or ("vertices",)
    fd, tmp = tempfile.mkstemp(prefix=".hpcgnn-kaminpar.", suffix=".parhip", dir=scratch)
    os.close(fd)
    try:
        write_parhip(tmp, indptr, indices, combined_weights(degree, train_mask, used))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return KaMinParInput(Path(tmp), indptr.shape[0] - 1, int(indptr[-1]), used, time.perf_counter() - t0)


def run_kaminpar(graph_input: KaMinParInput, indptr: np.ndarray, train_mask: np.ndarray, num_parts: int,
                 seed: int, eps: float = 0.03, *, context: str = DEFAULT_CONTEXT,
                 threads: int = 1) -> KaMinParResult:
    """KaMinPar on ``graph_input`` (compressed while read), then the repair pass over the same
    file's neighbour lists (memory-mapped): every constraint of ``graph_input`` within
    ``1 + eps`` where the repair can reach it (the result's ``over`` lists the others).
    KaMinPar runs in a child interpreter (see the module docstring)."""
    if context not in CONTEXTS:
        raise ValueError(f"unknown KaMinPar context {context!r}, expected one of {', '.join(CONTEXTS)}")
    n, m, used = graph_input.num_nodes, graph_input.num_edges, graph_input.constraints
    seconds = {"write_file": graph_input.seconds}
    if num_parts == 1:
        return KaMinParResult(np.zeros(n, dtype=np.int64), used, seconds, threads=threads, context=context)
    t0 = time.perf_counter()
    part_file = graph_input.path.with_name(graph_input.path.name + ".part.npy")
    try:
        cmd = [sys.executable, "-m", "hpcgnn.partition.kaminpar", str(graph_input.path), str(part_file),
               str(int(num_parts)), str(int(seed)), repr(float(eps)), context, str(int(threads))]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": _package_root()})
        if proc.returncode != 0:
            tail = " | ".join(proc.stdout.strip().splitlines()[-5:])
            raise RuntimeError(f"KaMinPar ended with exit code {proc.returncode}: {tail}")
        part = np.load(part_file)
        peak = [int(line.split("=", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("peak_rss=")]
    finally:
        part_file.unlink(missing_ok=True)
    if part.shape != (n,) or (n and (part.min() < 0 or part.max() >= num_parts)):
        raise RuntimeError(f"KaMinPar returned an assignment of shape {part.shape} outside [0, {num_parts})")
    seconds["kaminpar"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    degree = np.diff(indptr)
    weights = np.empty((n, len(used)), dtype=np.int64)
    for j, name in enumerate(used):
        weights[:, j] = vertex_weights(name, degree, train_mask)
    limits = balance_limits(weights.sum(axis=0), weights.max(axis=0, initial=0), num_parts, eps)
    fixed = rebalance(indptr, parhip_neighbours(graph_input.path, n, m), part, num_parts, weights, limits, used)
    seconds["repair"] = time.perf_counter() - t0
    return KaMinParResult(fixed.part, used, seconds, fixed.moved, fixed.over, threads, context,
                          peak[-1] if peak else 0)


def _package_root() -> str:
    """The directory holding this hpcgnn package, first on the child's PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")


def _partition_in_this_process(path: str, num_parts: int, seed: int, eps: float, context: str,
                               threads: int) -> np.ndarray:
    """KaMinPar on the ParHIP file ``path`` (compressed while read) in this process."""
    import kaminpar

    # A context takes the seed in force when it is made (kaminpar.reseed), not when it is used.
    kaminpar.reseed(int(seed))
    ctx = {"fast": kaminpar.fast_context, "default": kaminpar.default_context,
           "terapart": kaminpar.terapart_context}[context]()
    solver = kaminpar.KaMinPar(int(threads), ctx)
    graph = kaminpar.load_graph(str(path), kaminpar.GraphFileFormat.PARHIP, compress=True)
    return np.asarray(solver.compute_partition(graph, int(num_parts), float(eps)), dtype=np.int64)


def _main(argv: list[str]) -> int:
    """``python -m hpcgnn.partition.kaminpar PARHIP OUT.npy K SEED EPS CONTEXT THREADS``; prints
    ``peak_rss=BYTES`` (this process's VmHWM) last."""
    from hpcgnn.run.memory import peak_rss_bytes

    path, out, k, seed, eps, context, threads = argv
    np.save(out, _partition_in_this_process(path, int(k), int(seed), float(eps), context, int(threads)))
    print(f"peak_rss={peak_rss_bytes()}", flush=True)
    return 0


def kaminpar_parts(indptr: np.ndarray, indices, train_mask: np.ndarray, num_parts: int, seed: int,
                   constraints, eps: float = 0.03, *, context: str = DEFAULT_CONTEXT, threads: int = 1,
                   scratch: str | os.PathLike | None = None, log=None) -> KaMinParResult:
    """KaMinPar k-way min-cut assignment balancing every named constraint within ``1 + eps``:
    :func:`write_input` then :func:`run_kaminpar`, the temporary file removed on return. With
    ``threads`` > 1 the result is not reproducible."""
    graph_input = write_input(indptr, indices, train_mask, constraints, scratch=scratch, log=log)
    try:
        return run_kaminpar(graph_input, indptr, train_mask, num_parts, seed, eps, context=context,
                            threads=threads)
    finally:
        graph_input.remove()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
