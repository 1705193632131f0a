"""`hpcgnn partition GRAPH.h5 --parts K --out DIR`: write a partition store.

METIS k-way min-edge-cut with multi-constraint balance of vertices, training vertices and
edges (vertex weights [1, is_train, degree], as DistDGL/DistGNN-MB); KaMinPar, for graphs
beyond METIS' memory, with the same three constraints (hpcgnn.partition.kaminpar); or a seeded
random or contiguous assignment. ``--method auto`` (the default) takes METIS when its modelled
memory fits ``--memory-budget`` and KaMinPar otherwise, says so in one line and records it in
the store; a graph beyond even KaMinPar's budget is refused in one line (exit 2). Prints a
one-paragraph summary and the wall time and peak memory of each step; the store layout is
docs/formats.md.

Memory: the steps run one after another so that each holds only what it needs. ``read``
loads the topology with 32-bit vertex IDs when the graph allows; ``prepare`` builds METIS'
vertex weights in its own index type (or writes KaMinPar's input file and lets the topology
go); ``assign`` runs METIS (cmeel-metis' 32-bit build when installed, see
hpcgnn.partition.metis) on those arrays without copies, or KaMinPar; ``read_data`` checks the
features, labels and masks against the file's hashes in blocks, and ``write`` reads and writes
one partition at a time from the graph file (hpcgnn.partition.source): O(V) plus one
partition. Under ``mpiexec -n P`` (or srun) rank 0 reads and assigns, and the ranks write the
partitions in parallel; the store is the same as one process writes. The steps are
:func:`hpcgnn.partition.pipeline.partition_file`; here are the options, the launch and the
messages. On the ogbn-products-sized graph (123M directed edges) METIS dominates; the peaks per
step are in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from hpcgnn.partition.balance import CONSTRAINTS
from hpcgnn.partition.kaminpar import CONTEXTS as KAMINPAR_CONTEXTS
from hpcgnn.partition.kaminpar import DEFAULT_CONTEXT as KAMINPAR_DEFAULT_CONTEXT
from hpcgnn.partition.methods import METHODS
from hpcgnn.partition.metis import DEFAULT_NITER, LIBRARIES
from hpcgnn.partition.pipeline import partition_file


EXAMPLES = """examples:
  hpcgnn partition data/cora.h5 --parts 2 --out data/cora-metis-2
  hpcgnn partition data/cora.h5 --parts 4 --method random --seed 1 --out data/cora-random-4
  hpcgnn partition data/g.h5 --parts 2 --rank-speed 1,2 --out data/g-rapa-2   # ranks of unequal speed
(docs/formats.md)
"""


def add_arguments(parser) -> None:
    parser.add_argument("graph", metavar="GRAPH.h5", help="graph file written by `hpcgnn prepare`")
    parser.add_argument("--parts", type=int, required=True, metavar="K",
                        help="number of partitions (= MPI ranks that will train on the store)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output partition directory")
    parser.add_argument("--method", choices=METHODS, default="auto",
                        help="assignment method; auto (default): METIS when its modelled memory for the graph "
                             "fits --memory-budget, else KaMinPar (the choice is printed and recorded in the store)")
    parser.add_argument("--memory-budget", default=None, metavar="SIZE",
                        help="memory the partitioner may use, e.g. 20GiB (default: what the node has available: "
                             "MemAvailable, or the cgroup or SLURM limit when lower); --method auto refuses a "
                             "graph that even KaMinPar cannot partition within it")
    parser.add_argument("--kaminpar-threads", type=int, default=1, metavar="T",
                        help="KaMinPar threads (default 1: the seed fixes the partition; with more threads "
                             "KaMinPar is faster but its result varies from run to run)")
    parser.add_argument("--kaminpar-context", choices=KAMINPAR_CONTEXTS, default=KAMINPAR_DEFAULT_CONTEXT,
                        help=f"KaMinPar preset (default {KAMINPAR_DEFAULT_CONTEXT}: the leanest, about 7-18 bytes "
                             "per directed edge with the compressed graph, more with more parts)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (METIS and random; default 0)")
    parser.add_argument("--constraints", default=",".join(CONSTRAINTS), metavar="LIST",
                        help="METIS balance constraints, a subset of vertices,train,edges "
                             "(default: all three)")
    parser.add_argument("--ufactor", type=int, default=30,
                        help="METIS allowed imbalance per constraint in 1/1000 (default 30 = 3%%)")
    parser.add_argument("--niter", type=int, default=DEFAULT_NITER,
                        help=f"METIS refinement passes per level (default {DEFAULT_NITER}; METIS' own "
                             "default 10 can lower the cut of unstructured graphs by 2-3%% for twice the time)")
    parser.add_argument("--metis-library", choices=("auto", *LIBRARIES), default="auto",
                        help="METIS build: cmeel-metis (METIS 5.2.1, 32-bit indices: half the memory) or "
                             "pymetis (METIS 5.1.0, 64-bit); auto (default) takes cmeel-metis when it is "
                             "installed and the graph fits 32-bit indices. The choice is recorded in the store")
    parser.add_argument("--metis-ondisk", action=argparse.BooleanOptionalAction, default=None,
                        help="METIS keeps the coarsened graphs of 128 MiB or more that it is not working on "
                             "in files in a private directory beside --out (METIS 5.2, cmeel-metis): the "
                             "same partition in a fraction of the memory (products-like, 123M edges: 2.5 "
                             "instead of 8.3 GiB). Default: on with cmeel-metis, off with pymetis")
    parser.add_argument("--rank-speed", default=None, metavar="LIST|FILE|RUN",
                        help="RAPA: relative throughput of each rank, as a comma list (1,2), a text or JSON "
                             "file of K numbers, or a finished run (directory or run.h5) whose per-rank "
                             "compute time gives them; METIS then sizes part r's share of every balanced "
                             "constraint to speed_r / sum(speeds) (docs/rapa.md)")
    parser.add_argument("--halo-trim", action="store_true",
                        help="RAPA: after partitioning, drop the lowest-score halo vertices (and their edges) "
                             "of partitions whose modelled cost is above the mean (CaPGNN's trimming step; "
                             "changes the graph the model trains on, docs/rapa.md)")
    parser.add_argument("--trim-threshold", type=float, default=None, metavar="X",
                        help="--halo-trim stops when std/mean of the modelled per-rank cost is below X "
                             "(default 0.01)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args) -> int:
    from hpcgnn.partition.memory import format_table

    if _launched_ranks() <= 1:        # one process
        return _run(args, None)
    from hpcgnn.runtime import Runtime

    rt = Runtime.start()
    with rt.guard():
        code = _run(args, rt.comm)
    rt.finish()
    return code


# Set by mpiexec (MPICH/Hydra, Open MPI, PMIx) and srun for the ranks of a job step; not by a
# batch script's own shell, which may run `hpcgnn partition` as one process.
WORLD_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


def _launched_ranks() -> int:
    """How many ranks the launcher says this process is one of (1 outside a launcher)."""
    import os

    for var in WORLD_SIZE_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return 1


def _run(args, comm) -> int:
    from hpcgnn.partition.memory import format_table

    summary, t = partition_file(args.graph, args.out, args.parts, args.method, args.seed, args.constraints,
                                args.ufactor, args.force, progress=not args.quiet, niter=args.niter,
                                metis_library=args.metis_library, metis_ondisk=args.metis_ondisk,
                                rank_speed=args.rank_speed, halo_trim=args.halo_trim,
                                trim_threshold=args.trim_threshold, memory_budget=args.memory_budget,
                                kaminpar_threads=args.kaminpar_threads, kaminpar_context=args.kaminpar_context,
                                comm=comm)
    if comm is not None and comm.rank != 0:
        return 0
    method = _recorded_method(summary)
    bal = ", ".join(f"{k} {v:.3f}" for k, v in summary.balance.items())
    cut_pct = 100 * summary.edge_cut / max(summary.num_edges // 2, 1)
    print(f"wrote {summary.path}: {summary.num_parts} partitions ({method}, seed {args.seed}) in "
          f"{t['total']:.1f}s\n  edge cut {summary.edge_cut} ({cut_pct:.1f}%), balance max/mean: {bal}; "
          f"halo {int(summary.halo_counts.sum())} vertices", file=sys.stdout)
    print(format_table(summary.steps), file=sys.stdout)
    if args.rank_speed is not None or args.halo_trim:
        print(_rapa_text(summary), file=sys.stdout)
    for what, name in (("vertices", "vertices"), ("train", "training vertices")):
        empty = np.flatnonzero(summary.part_weights[what] == 0)
        if empty.size and (what == "vertices" or summary.part_weights[what].any()):
            ids = ", ".join(map(str, empty[:10])) + (", ..." if empty.size > 10 else "")
            plural = empty.size > 1
            print(f"hpcgnn partition: warning: partition{'s' if plural else ''} {ids} "
                  f"{'have' if plural else 'has'} no {name}", file=sys.stderr)
    return 0


def _recorded_method(summary) -> str:
    """The method the store records (what ``auto`` chose)."""
    from hpcgnn.partition.store import read_meta

    return str(read_meta(summary.path).method)


def _rapa_text(summary) -> str:
    """RAPA lines: speeds, target vs achieved shares, trimming, predicted straggler."""
    from hpcgnn.partition import rapa
    from hpcgnn.partition.store import read_meta

    meta = read_meta(summary.path)
    speeds, _ = rapa.store_speeds(meta)
    frac = rapa.target_fractions(speeds)
    w = summary.part_weights
    share = lambda a: ", ".join(f"{x:.3f}" for x in np.asarray(a, float) / max(float(np.sum(a)), 1.0))  # noqa: E731
    lines = [f"RAPA: rank speeds {', '.join(f'{x:g}' for x in speeds)} ({meta.attrs.get('rank_speed_source')}); "
             f"target shares {', '.join(f'{x:.3f}' for x in frac)}",
             f"  achieved shares: train {share(w['train'])}; edges {share(w['edges'])}; "
             f"vertices {share(w['vertices'])}"]
    if "halo_trim" in meta.attrs:
        t = json.loads(meta.attrs["halo_trim"])
        lines.append(f"  halo trimming (threshold {t['threshold']:g}): removed halos {t['removed_halos']}, "
                     f"edges {t['removed_edges']}; cost std/mean {t['cv_before']:.4f} -> {t['cv_after']:.4f}")
    lines.append("  " + rapa.describe_prediction(rapa.part_work_of_store(meta), speeds))
    return "\n".join(lines)
