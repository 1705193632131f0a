"""`hpcgnn infer RUN --out FILE.h5 [--checkpoint FILE] [--what logits|embeddings|predictions]
[--layer L] [--partitions DIR] [--device D] [--force]` (collective: under mpiexec/srun, or one process).

Loads the run's configuration (``RUN/run.h5``) and a checkpoint (the newest in
``RUN/checkpoints`` unless ``--checkpoint``), runs exact full-neighbour inference in bounded memory
(:mod:`hpcgnn.engine.infer`) and writes ONE HDF5 file (``format = "hpcgnn-infer"``) with a row for
every vertex in the graph file's vertex order (docs/infer.md):

* ``logits`` float32 [V, C], ``predictions`` int64 [V] (their argmax) or ``embeddings`` float32
  [V, W] (the output of layer ``--layer``, 1-based, default the last hidden layer);
* ``vertex_ids`` int64 [V]: the graph file's id of every row (``0 .. V-1``);
* attributes: ``what``, ``layer``, ``num_layers``, ``engine``, ``checkpoint``,
  ``checkpoint_epoch``, ``checkpoint_sha256`` (of the checkpoint file), the run and store
  read, the rank count, seconds and per-rank peak resident memory.

The job has one rank per partition of the store it reads: the run's store by default,
``--partitions DIR`` another store of the same graph with as many parts as the job has ranks.
Bad input (no checkpoint, a layer out of range, a checkpoint of another model shape or engine,
a store of another graph or with another part count) is one line naming it, exit 2 on every
rank, and nothing is written; the output appears complete (temporary name, then rename) or not
at all.
"""
from __future__ import annotations

import time
from pathlib import Path

from hpcgnn.errors import InputError


def add_arguments(parser) -> None:
    from hpcgnn.engine.infer import WHATS

    parser.add_argument("run", metavar="RUN", help="run directory (holds run.h5 and checkpoints/)")
    parser.add_argument("--out", required=True, metavar="FILE.h5", help="the HDF5 file to write")
    parser.add_argument("--checkpoint", metavar="FILE",
                        help="checkpoint file (default: the newest in RUN/checkpoints)")
    parser.add_argument("--what", default="logits", choices=WHATS,
                        help="what to write per vertex (default: logits)")
    parser.add_argument("--layer", type=int, metavar="L",
                        help="with --what embeddings: the output of layer L, 1-based "
                             "(default: the last hidden layer, num_layers - 1)")
    parser.add_argument("--partitions", metavar="DIR",
                        help="partition store to read (default: the run's); it must have one part "
                             "per rank of this job and partition the run's graph")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="compute device (default: the run's train.device; one GPU per rank)")
    parser.add_argument("--block-bytes", default="64MiB", metavar="SIZE",
                        help="rank 0 assembles the file in blocks of this many bytes of rows "
                             "(default 64MiB)")
    parser.add_argument("--force", action="store_true", help="replace an existing output file")


def run(args) -> int:
    from hpcgnn.supervisor import run_watched

    return run_watched(lambda: _infer(args))


def _resolve(args, size: int) -> dict:
    """Every rank: the run, its configuration, the store, the layer, the output and the
    checkpoint path, checked (InputError names what is wrong)."""
    from hpcgnn.engine.infer import resolve_layer, run_config
    from hpcgnn.fileio import check_output, check_writable_dir
    from hpcgnn.partition.store import read_meta
    from hpcgnn.run.checkpoint import list_checkpoints
    from hpcgnn.units import parse_size
    from hpcgnn.run.output import RUN_FILE, read_run

    run_dir = Path(args.run)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: run directory not found")
    attrs = read_run(run_dir)["attrs"]
    label = str(run_dir / RUN_FILE)
    cfg = run_config(attrs.get("config"), label)
    engine = str(attrs.get("engine", cfg.train.engine))
    layer = resolve_layer(args.what, args.layer, int(cfg.model.layers))
    block_bytes = parse_size(args.block_bytes, "--block-bytes")
    if block_bytes <= 0:
        raise InputError(f"--block-bytes {args.block_bytes!r}: expected a size > 0")
    out = check_output(args.out, args.force)
    if out.is_dir():
        raise InputError(f"{out}: is a directory, expected an HDF5 file name")
    check_writable_dir(out.parent, "--out directory")   # before the inference, not after it
    run_store = str(attrs.get("partition_dir", cfg.data.partitions))
    store = args.partitions or run_store
    try:
        meta = read_meta(store)
    except InputError as exc:
        if args.partitions:
            raise
        raise InputError(f"{exc} (the run's store, as recorded in {label}; pass --partitions DIR)") from None
    run_hash = str(attrs.get("partition_hash", ""))
    if meta.content_hash != run_hash:
        _same_graph(meta, run_store, store)
    if meta.num_parts != size:
        hint = "" if args.partitions else " or pass --partitions DIR with a store of that many parts"
        raise InputError(f"{store}: the partition store has {meta.num_parts} partitions but the job "
                         f"has {size} ranks (run mpiexec -n {meta.num_parts}{hint})")
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        found = list_checkpoints(run_dir)
        if not found:
            raise InputError(f"{run_dir}: the run has no checkpoint (nothing in "
                             f"{run_dir / 'checkpoints'}; pass --checkpoint FILE)")
        ckpt = found[-1][1]
    data = cfg.to_dict()
    data["data"]["partitions"] = str(store)
    if args.device:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise InputError("--device cuda: torch sees no CUDA device")
        data["train"]["device"] = args.device
    from hpcgnn.run.config import Config

    return {"run_dir": run_dir, "attrs": attrs, "cfg": Config(data), "engine": engine, "layer": layer,
            "out": out, "store": store, "meta": meta, "run_hash": run_hash, "ckpt": ckpt,
            "block_bytes": block_bytes}


def _read_newest(path: Path, run_dir: Path, explicit: bool, tries: int = 5):
    """Rank 0: read checkpoint ``path`` (bytes read once, hashed and loaded from memory). Without
    ``--checkpoint`` the newest may be removed by a live run's ``output.keep_checkpoints`` between
    listing and reading: then the new newest is read (a consistent file either way: checkpoints
    are renamed into place complete)."""
    from hpcgnn.engine.infer import read_checkpoint
    from hpcgnn.run.checkpoint import list_checkpoints

    for _ in range(tries):
        if explicit or path.exists():
            try:
                return read_checkpoint(path)
            except InputError:
                if explicit or path.exists():
                    raise
        found = list_checkpoints(run_dir)
        if not found:
            break
        path = found[-1][1]
    return read_checkpoint(path)


def _same_graph(meta, run_store: str, store: str) -> None:
    """A store other than the run's must partition the same graph file (``source_hash``)."""
    from hpcgnn.partition.store import read_meta

    try:
        theirs = read_meta(run_store)
    except InputError:
        return   # the run's store is gone: the model shape check still guards features/classes
    want, got = theirs.attrs.get("source_hash"), meta.attrs.get("source_hash")
    if want != got or theirs.num_nodes != meta.num_nodes:
        raise InputError(f"{store}: partitions graph {meta.attrs.get('source_graph')!r} "
                         f"(source_hash {str(got)[:12]}..., {meta.num_nodes} vertices), the run was "
                         f"trained on {theirs.attrs.get('source_graph')!r} (source_hash "
                         f"{str(want)[:12]}..., {theirs.num_nodes} vertices)")


def _infer(args) -> int:
    import datetime

    import numpy as np
    import torch

    from hpcgnn import __version__
    from hpcgnn.engine.infer import (INFER_FORMAT, INFER_VERSION, graph_ids, gnn_rows,
                                     tensor_rows, write_rows)
    from hpcgnn.run.memory import peak_rss_bytes
    from hpcgnn.units import fmt_bytes
    from hpcgnn.runtime import Runtime

    rt = Runtime.start()
    with rt.guard():
        s = rt.agree_on(lambda: _resolve(args, rt.size))
        cfg, meta, engine = s["cfg"], s["meta"], s["engine"]
        rt.apply_settings(cfg.runtime)
        ckpt, error = None, None
        if rt.is_root:
            try:
                ckpt = _read_newest(s["ckpt"], s["run_dir"], explicit=bool(args.checkpoint))
                if ckpt.engine and ckpt.engine != engine:
                    raise InputError(f"{ckpt.path}: checkpoint was written by engine {ckpt.engine!r}, "
                                     f"the run's engine is {engine!r}")
                if ckpt.content_hash != s["run_hash"]:
                    raise InputError(f"{ckpt.path}: checkpoint was written for partition store "
                                     f"{ckpt.content_hash[:12]}..., the run's is {s['run_hash'][:12]}... "
                                     "(a checkpoint of another run)")
            except InputError as exc:
                error = str(exc)
        rt.agree(error)
        ckpt = rt.comm.bcast(ckpt, root=0)
        t0 = time.perf_counter()
        if engine == "tensor":
            store_ids, rows = tensor_rows(cfg, rt, meta, ckpt.model, ckpt.path, s["layer"])
        elif engine in ("minibatch", "fullgraph"):
            store_ids, rows = gnn_rows(cfg, rt, meta, ckpt.model, ckpt.path, s["layer"])
        else:
            rt.agree(f"{s['run_dir']}: engine {engine!r} has no inference path "
                     "(expected minibatch, fullgraph or tensor)")
        if args.what == "predictions":
            rows = rows.argmax(dim=1).to(torch.int64)
        values = rows.detach().cpu().contiguous().numpy()
        del rows
        ids = graph_ids(meta, store_ids)
        seconds = time.perf_counter() - t0
        peaks = rt.comm.gather(peak_rss_bytes(), root=0)
        attrs = {
            "format": INFER_FORMAT, "version": INFER_VERSION, "what": args.what,
            "layer": int(s["layer"]), "num_layers": int(cfg.model.layers),
            "layer_numbering": "1-based: layer L is the output of the model's L-th layer "
                               "(after its ReLU if hidden); layer num_layers is the logits",
            "engine": engine, "arch": str(cfg.model.arch),
            "checkpoint": str(ckpt.path), "checkpoint_epoch": int(ckpt.epoch),
            "checkpoint_sha256": ckpt.sha256,
            "run_dir": str(s["run_dir"]), "run_partition_hash": s["run_hash"],
            "partitions": str(s["store"]), "partition_hash": meta.content_hash,
            "source_graph": str(meta.attrs.get("source_graph", "")),
            "source_hash": str(meta.attrs.get("source_hash", "")),
            "num_nodes": int(meta.num_nodes), "num_ranks": int(rt.size),
            "config": cfg.to_json(), "inference_seconds": float(seconds),
            "peak_rss_bytes": np.asarray(peaks if peaks is not None else [], dtype=np.int64),
            "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "hpcgnn_version": __version__,
        }
        write_rows(rt, s["out"], ids, values, int(meta.num_nodes), args.what, attrs, s["block_bytes"])
        peaks = rt.comm.gather(peak_rss_bytes(), root=0)
        if rt.is_root:
            shape = "x".join(str(d) for d in (int(meta.num_nodes),) + values.shape[1:])
            print(f"hpcgnn: wrote {s['out']}: {args.what} [{shape}]"
                  + (f" of layer {s['layer']}" if args.what == "embeddings" else "")
                  + f", {engine} checkpoint epoch {ckpt.epoch} (sha256 {ckpt.sha256[:12]}), "
                  f"{rt.size} rank(s), inference {seconds:.1f} s, peak RSS per rank "
                  + " ".join(fmt_bytes(p) for p in peaks), flush=True)
        rt.comm.Barrier()
        rt.finish()
    return 0
