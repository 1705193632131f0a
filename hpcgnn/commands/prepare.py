"""`hpcgnn prepare`: write one canonical HDF5 graph file from a dataset or a generator.

    hpcgnn prepare --dataset cora --root inputs/data --out data/cora.h5
    hpcgnn prepare --dataset ogb --root ogbn_products [--split sales_ranking] --out products.h5
    hpcgnn prepare --dataset files --edges E.csv --features X.npy --labels Y.npy \\
                   [--train T.npy --val V.npy --test T.npy] --out g.h5
    hpcgnn prepare --dataset sbm --nodes 20000 --edges 200000 --features 64 --classes 8 --seed 0 --out s.h5
    hpcgnn prepare --dataset rmat --nodes 65536 --edges 1000000 --out r.h5
    hpcgnn prepare --dataset products-like [--scale 0.1] --out p.h5
    hpcgnn prepare --dataset products-like --feature-noise 1 --feature-flip 0 --edge-flip 0 --p-in 0.7 \
                   --out easy.h5    # the earlier, easy preset
    hpcgnn prepare --dataset cora --root inputs/data --normalize-features row --out data/cora-rownorm.h5

``--normalize-features row`` divides every feature row by its sum (rows summing to 0 stay), the
transform the Planetoid/GCN results are published with (hpcgnn/data/features.py); the graph file
records it in its attribute ``feature_normalization`` ("none" or "row").

The file format is docs/formats.md ("hpcgnn-graph"). An existing --out is
refused unless --force; the file is written atomically, so a failed run
leaves nothing behind.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hpcgnn.data.features import NORMALIZATIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True, metavar="NAME",
                        help="cora | citeseer | pubmed | planetoid:<name> | ogb | files | rmat | sbm | products-like")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE.h5", help="graph file to write")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--root", metavar="DIR", help="dataset directory (planetoid: ROOT/<name>/; ogb: ROOT)")
    parser.add_argument("--normalize-features", choices=NORMALIZATIONS, default="none",
                        help="row: divide every feature row by its sum, rows summing to 0 left as they "
                             "are (Planetoid/GCN preprocessing; non-negative features only); "
                             "default none")
    parser.add_argument("--split", metavar="NAME",
                        help="ogb: split directory under ROOT/split/ (default: the only one)")
    files = parser.add_argument_group("plain files (--dataset files) / synthetic sizes")
    files.add_argument("--edges", metavar="FILE|COUNT",
                       help="files: edge list (.csv/.tsv/.txt[.gz], .npy (E,2), .npz src/dst or edges); "
                            "synthetic: undirected edge draws (default 10 x --nodes)")
    files.add_argument("--features", metavar="FILE|F",
                       help="files: features .npy (N, F); synthetic: feature dimension (default 32)")
    files.add_argument("--labels", metavar="FILE", help="files: labels .npy (N,), -1 = unlabelled")
    for split, default in (("train", "0.1"), ("val", "0.1"), ("test", "0.8")):
        files.add_argument(f"--{split}", metavar="FILE|X",
                           help=f"files: {split} split .npy (bool mask or indices); synthetic: fraction "
                                f"(with a decimal point) or vertex count (default {default})")
    files.add_argument("--num-nodes", metavar="N", help="files: vertex count (default: feature rows)")
    files.add_argument("--num-classes", metavar="C", help="files: class count (default: max label + 1)")
    synth = parser.add_argument_group("synthetic generators (rmat, sbm, products-like)")
    synth.add_argument("--nodes", metavar="N", help="vertices (default 10000)")
    synth.add_argument("--classes", metavar="C", help="classes (default 8)")
    synth.add_argument("--seed", metavar="S", help="random seed (default 0)")
    synth.add_argument("--p-in", metavar="P",
                       help="sbm: probability an edge stays inside its class (default 0.7; products-like 0.6)")
    synth.add_argument("--degree-skew", metavar="S",
                       help="sbm: Zipf exponent of vertex weights, 0 = uniform (default 0.6)")
    synth.add_argument("--feature-noise", metavar="SIGMA",
                       help="synthetic: feature noise std; class centroids are ~2 apart (default 1.0; "
                            "products-like 0.3)")
    synth.add_argument("--feature-flip", metavar="F",
                       help="sbm: fraction of vertices whose features follow another vertex's class, "
                            "not their own label (default 0; products-like 0.36)")
    synth.add_argument("--edge-flip", metavar="F",
                       help="sbm: fraction of vertices whose edges follow another vertex's class, "
                            "not their own label (default 0; products-like 0.19)")
    synth.add_argument("--noise", metavar="MU", help="rmat: NSKG per-level noise (default 0)")
    synth.add_argument("--scale", metavar="X", help="products-like: size multiplier in (0, 1] (default 1)")


def run(args: argparse.Namespace) -> int:
    from hpcgnn.data.datasets import dataset_options, load_dataset, resolve
    from hpcgnn.data.graph import write_graph
    from hpcgnn.errors import InputError
    from hpcgnn.fileio import check_output

    out = check_output(args.out, args.force)  # refuse before doing any work
    if out.is_dir():
        raise InputError(f"{out}: is a directory, expected an output file name")
    start = time.perf_counter()
    options = {key: getattr(args, key, None) for key in dataset_options()}
    if args.normalize_features == "row" and resolve(args.dataset).name in ("rmat", "sbm", "products-like"):
        raise InputError(f"--normalize-features row does not apply to --dataset {args.dataset}: its "
                         "features are Gaussian, with negative entries (row normalisation is for "
                         "non-negative features such as bag-of-words counts)")
    graph = load_dataset(args.dataset, options, progress=True)
    if args.normalize_features != "none":
        from hpcgnn.data.features import normalize_features

        graph.features = normalize_features(graph.features, args.normalize_features,
                                            where=f"--dataset {args.dataset}")
    graph.meta["feature_normalization"] = args.normalize_features
    try:
        write_graph(out, graph, force=args.force)
    except OSError as exc:
        raise InputError(f"{out}: cannot write the graph file ({exc.strerror or exc})") from None
    counts = "/".join(f"{int(m.sum()):,}" for m in (graph.train_mask, graph.val_mask, graph.test_mask))
    norm = "" if args.normalize_features == "none" else f"{args.normalize_features}-normalised features; "
    print(f"wrote {out}: {graph.meta.get('name', args.dataset)}, {graph.num_nodes:,} vertices, "
          f"{graph.num_edges:,} directed edges, {graph.num_features:,} features, {graph.num_classes} classes, "
          f"train/val/test {counts}; {norm}removed {graph.meta.get('self_loops_removed', 0):,} self-loop and "
          f"{graph.meta.get('duplicates_removed', 0):,} duplicate directed edges "
          f"({time.perf_counter() - start:.1f} s)", file=sys.stdout, flush=True)
    return 0
