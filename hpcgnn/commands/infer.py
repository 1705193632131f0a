"""`hpcgnn infer RUN --out FILE.h5 [--checkpoint FILE] [--what logits|embeddings|predictions]
[--layer L] [--vertices all|train|val|test] [--method full|sampled] [--fanouts F,...]
[--partitions DIR] [--device D] [--backend B] [--force]` (collective: under mpiexec/srun, or one
process).

Loads the run's configuration (``RUN/run.h5``) and a checkpoint (the newest in
``RUN/checkpoints`` unless ``--checkpoint``), runs exact full-neighbour inference in bounded memory
or sampled inference of the selected vertices (see below) and writes ONE HDF5 file (``format = "hpcgnn-infer"``) with a row for every vertex
in the graph file's vertex order (docs/infer.md):

* ``logits`` float32 [V, C], ``predictions`` int64 [V] (their argmax) or ``embeddings`` float32
  [V, W] (the output of layer ``--layer``, 1-based, default the last hidden layer);
* ``vertex_ids`` int64 [V]: the graph file's id of every row (``0 .. V-1``);
* with ``--vertices train|val|test`` the rows of that split's vertices only, in the same order:
  [V_split, ...] and ``vertex_ids`` [V_split] their (increasing) graph ids. ``--method full``
  computes every vertex's rows either way (layer-wise full-neighbour inference needs every
  vertex's hidden layers) and the option selects what is written; ``--method sampled`` computes
  the split's rows only. Every rank holds the graph ids of the whole
  split (8 bytes each) to place its rows;
* attributes: ``what``, ``layer``, ``num_layers``, ``engine``, ``comm_backend`` (what carried the
  data plane, ``runtime.backend`` of the run's configuration; ``""`` when none was made),
  ``mpi_library``, ``method``, ``fanouts`` (``[]`` for ``full``), ``checkpoint``,
  ``checkpoint_epoch``, ``checkpoint_sha256`` (of the checkpoint file), ``vertices`` (``all`` or
  the split written), the run and store
  read, the rank count, seconds and per-rank peak resident memory.

The job has one rank per partition of the store it reads: the run's store by default,
``--partitions DIR`` another store of the same graph with as many parts as the job has ranks.
Bad input (no checkpoint, a layer out of range, a checkpoint of another model shape or engine,
a store of another graph or with another part count) is one line naming it, exit 2 on every
rank, and nothing is written; the output appears complete (temporary name, then rename) or not
at all.

**Computing the rows** (the store may have another rank count than training's;
:mod:`hpcgnn.engine.predict`):

* **Partition-parallel models** (``train.engine`` = ``minibatch`` or ``fullgraph``: the GNN of
  :mod:`hpcgnn.nn.models`, :func:`~hpcgnn.engine.predict.gnn_rows`): the minibatch engine's
  evaluation, :func:`hpcgnn.engine.inference.partition_inference`: exact full-neighbour inference layer by
  layer over the rank's solid vertices, destinations in chunks (``minibatch.eval_rows``, 0 =
  a 256 MiB budget) and halo rows streamed in rounds (``minibatch.eval_halo_rounds``, 0 = sized
  to a 256 MiB round). The full-graph engine's evaluation runs the same layers unchunked; the
  results agree up to floating-point order.
* **Sampled** (``--method sampled``, partition-parallel models,
  :func:`~hpcgnn.engine.predict.sampled_gnn_rows`): the minibatch engine's sampled evaluation
  (:func:`hpcgnn.engine.inference.sampled_inference`): each selected vertex's neighbours sampled over the whole graph with ``--fanouts`` (default
  the run's ``minibatch.fanouts``; ``--layer L`` runs the first L), keyed by (seed, hop,
  vertex), input rows pulled from their owners, in batches of ``minibatch.eval_batch_size``
  seeds per rank. A rank holds its partition, the model and one batch, so the memory does not
  grow with the layers' width times the vertex count; the rows are a sample's, not exact.
* **Tensor parallel** (``tensor``, :func:`~hpcgnn.engine.predict.tensor_rows`): the engine itself
  (:class:`hpcgnn.engine.tensor.TensorEngine`, whole topology on every rank) and its forward
  (:meth:`~hpcgnn.engine.tensor.TensorEngine.logits`), with the model in eval mode.

**Layers** are numbered from 1: ``layer = L`` is the output of the model's ``L``-th layer, after
its ReLU (hidden layers; dropout is off at inference); ``layer = num_layers`` is the logits. For
the decoupled tensor models (MLP, then propagation) the hidden layers are the MLP's and the last
layer includes the propagation; for the coupled tensor model layer ``L`` includes its
aggregation. The default of ``--what embeddings`` is the last hidden layer, ``num_layers - 1``.

**Writing** (:func:`hpcgnn.run.rows_file.write_rows`): rank 0 assembles the file block by block
(``--block-bytes`` of output rows per block), each block gathered from the ranks that hold its
rows. Memory beyond the rank's own result: one block (rank 0: two). The file is written under a
temporary name and renamed when complete.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from hpcgnn.engine.predict import gnn_rows, graph_ids, sampled_gnn_rows, split_rows, tensor_rows
from hpcgnn.errors import InputError
from hpcgnn.run.rows_file import write_rows

WHATS = ("logits", "embeddings", "predictions")
METHODS = ("full", "sampled")
VERTEX_SETS = ("all", "train", "val", "test")
EXAMPLES = """examples:
  python -m hpcgnn infer runs/demo --out preds.h5 --what predictions
  mpiexec -n 2 python -m hpcgnn infer runs/demo --out emb.h5 --what embeddings --layer 1
  python -m hpcgnn infer runs/demo --out logits.h5 --checkpoint runs/demo/checkpoints/ckpt-000010.pt
  mpiexec -n 4 python -m hpcgnn infer runs/papers --out test-preds.h5 --what predictions --vertices test
(docs/infer.md)
"""
INFER_FORMAT = "hpcgnn-infer"
INFER_VERSION = 1


# ---- inputs --------------------------------------------------------------------------------------
def resolve_layer(what: str, layer: int | None, num_layers: int) -> int:
    """The 1-based layer whose output ``what`` is (see the module docstring); InputError naming
    ``--what`` / ``--layer`` otherwise."""
    if what not in WHATS:
        raise InputError(f"--what {what!r}: expected one of {', '.join(WHATS)}")
    if what != "embeddings":
        if layer is not None and layer != num_layers:
            raise InputError(f"--layer {layer}: --what {what} is the output of the last layer "
                             f"({num_layers}); --layer selects a layer for --what embeddings")
        return num_layers
    if layer is None:
        if num_layers < 2:
            raise InputError(f"--what embeddings: the model has {num_layers} layer and no hidden "
                             f"layer; pass --layer {num_layers} for its output")
        return num_layers - 1
    if not 1 <= layer <= num_layers:
        raise InputError(f"--layer {layer}: expected 1..{num_layers} (1-based; the model has "
                         f"{num_layers} layers, {num_layers} = the logits)")
    return int(layer)


def run_config(config_json: str, label: str):
    """A :class:`~hpcgnn.run.config.Config` from a run file's ``config`` attribute, keys the run
    file predates filled with their defaults."""
    from hpcgnn.run.config import Config, canonical_names, schema

    try:
        stored = canonical_names(json.loads(config_json))
    except (TypeError, ValueError, AttributeError):
        raise InputError(f"{label}: attribute 'config' is not JSON") from None
    resolved = {}
    for section, keys in schema().items():
        values = stored.get(section) or {}
        resolved[section] = {k: values.get(k, spec.default) for k, spec in keys.items()}
    return Config(resolved)


# ---- the command ---------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("run", metavar="RUN", help="run directory (holds run.h5 and checkpoints/)")
    parser.add_argument("--out", required=True, metavar="FILE.h5", help="the HDF5 file to write")
    parser.add_argument("--checkpoint", metavar="FILE",
                        help="checkpoint file (default: the newest in RUN/checkpoints)")
    parser.add_argument("--what", default="logits", choices=WHATS,
                        help="what to write per vertex (default: logits)")
    parser.add_argument("--layer", type=int, metavar="L",
                        help="with --what embeddings: the output of layer L, 1-based "
                             "(default: the last hidden layer, num_layers - 1)")
    parser.add_argument("--vertices", default="all", choices=VERTEX_SETS,
                        help="write the rows of every vertex (default) or of one split's vertices "
                             "only (their graph ids in vertex_ids)")
    parser.add_argument("--method", default="full", choices=METHODS,
                        help="full (default): exact full-neighbour inference, layer by layer over "
                             "every vertex; sampled: the selected vertices only, their neighbours "
                             "sampled with --fanouts over the whole graph (memory of one batch: "
                             "what large graphs need with --vertices)")
    parser.add_argument("--fanouts", metavar="F,F,...",
                        help="with --method sampled: neighbours per layer, input side first as "
                             "minibatch.fanouts (default: the run's minibatch.fanouts)")
    parser.add_argument("--partitions", metavar="DIR",
                        help="partition store to read (default: the run's); it must have one part "
                             "per rank of this job and partition the run's graph")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="compute device (default: the run's train.device; one GPU per rank)")
    parser.add_argument("--backend", choices=("mpi4py", "auto", "gloo", "nccl", "ccl"),
                        help="what carries the data plane (default: the run's runtime.backend)")
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
    from hpcgnn.run.config import Config, check_backend

    if getattr(args, "backend", None):
        data["runtime"]["backend"] = args.backend
    cfg = Config(data)
    try:   # the data plane on this job's device: nccl on the CPU is one line, before any data
        check_backend(cfg)
    except InputError as exc:
        if getattr(args, "backend", None):
            raise
        if not args.device:
            raise InputError(f"{exc} (the run's setting; pass --backend to choose another)") from None
        # --device moved the job (a GPU run inferred on CPUs): the run's backend cannot follow
        from hpcgnn.run.output import warn
        from hpcgnn.supervisor import launcher_rank

        run_backend = data["runtime"]["backend"]
        data["runtime"]["backend"] = "auto"
        cfg = Config(data)
        chosen = check_backend(cfg)
        if launcher_rank() in (None, 0):
            warn(f"the run's runtime.backend = {run_backend!r} cannot run with --device {args.device}: "
                 f"using {chosen!r} (auto; pass --backend to choose)")
    method = getattr(args, "method", "full")
    fanouts = resolve_fanouts(method, getattr(args, "fanouts", None), cfg, engine, layer)
    return {"run_dir": run_dir, "attrs": attrs, "cfg": cfg, "engine": engine, "layer": layer,
            "out": out, "store": store, "meta": meta, "run_hash": run_hash, "ckpt": ckpt,
            "block_bytes": block_bytes, "method": method, "fanouts": fanouts}


def resolve_fanouts(method: str, given: str | None, cfg, engine: str, layer: int) -> list[int] | None:
    """The fanouts of ``--method sampled`` for the model's first ``layer`` layers (input side
    first): ``--fanouts`` or the run's ``minibatch.fanouts``, one per layer of the model; None
    for ``--method full``. InputError naming the option otherwise."""
    from hpcgnn.sampling.neighbor import check_fanouts

    if method == "full":
        if given:
            raise InputError("--fanouts: only --method sampled samples neighbours")
        return None
    if engine == "tensor":
        raise InputError("--method sampled: the tensor engine's checkpoints infer with --method full")
    if given:
        try:
            values = [int(v) for v in str(given).split(",")]
        except ValueError:
            raise InputError(f"--fanouts {given!r}: expected integers separated by commas, e.g. 5,10,15") from None
        fanouts = check_fanouts(values, "--fanouts")
        where = "--fanouts"
    else:
        fanouts = check_fanouts(cfg.minibatch.fanouts, "minibatch.fanouts")
        where = "the run's minibatch.fanouts"
    layers = int(cfg.model.layers)
    if len(fanouts) != layers:
        raise InputError(f"{where} = {','.join(map(str, fanouts))}: {len(fanouts)} fanouts for a model of "
                         f"{layers} layers (one per layer, input side first; pass --fanouts)")
    return fanouts[:layer]


def _read_newest(path: Path, run_dir: Path, explicit: bool, tries: int = 5):
    """Rank 0: read checkpoint ``path`` (bytes read once, hashed and loaded from memory). Without
    ``--checkpoint`` the newest may be removed by a live run's ``output.keep_checkpoints`` between
    listing and reading: then the new newest is read (a consistent file either way: checkpoints
    are renamed into place complete)."""
    from hpcgnn.run.checkpoint import list_checkpoints, read_checkpoint

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
    from hpcgnn.run.memory import peak_rss_bytes
    from hpcgnn.units import fmt_bytes
    from hpcgnn.runtime import Runtime, mpi_library

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
        elif engine in ("minibatch", "fullgraph") and s["method"] == "sampled":
            store_ids, rows = sampled_gnn_rows(cfg, rt, meta, ckpt.model, ckpt.path, s["fanouts"],
                                               getattr(args, "vertices", "all"), args.what == "predictions")
        elif engine in ("minibatch", "fullgraph"):
            store_ids, rows = gnn_rows(cfg, rt, meta, ckpt.model, ckpt.path, s["layer"])
        else:
            rt.agree(f"{s['run_dir']}: engine {engine!r} has no inference path "
                     "(expected minibatch, fullgraph or tensor)")
        from hpcgnn.commands.train import say_data_plane

        say_data_plane(rt, args)     # hpcgnn -v
        if args.what == "predictions" and rows.ndim == 2:    # sampled_gnn_rows gives them already
            rows = rows.argmax(dim=1).to(torch.int64)
        values = rows.detach().cpu().contiguous().numpy()
        del rows
        ids = graph_ids(meta, store_ids)
        vertices = getattr(args, "vertices", "all")
        num_rows, written_ids = int(meta.num_nodes), None
        if vertices != "all":
            ids, keep, written_ids = split_rows(rt, meta, store_ids, ids, vertices)
            values = np.ascontiguousarray(values[keep])
            num_rows = int(written_ids.shape[0])
            if not rt.is_root:
                written_ids = None
        seconds = time.perf_counter() - t0
        peaks = rt.comm.gather(peak_rss_bytes(), root=0)
        attrs = {
            "format": INFER_FORMAT, "version": INFER_VERSION, "what": args.what,
            "layer": int(s["layer"]), "num_layers": int(cfg.model.layers),
            "layer_numbering": "1-based: layer L is the output of the model's L-th layer "
                               "(after its ReLU if hidden); layer num_layers is the logits",
            "engine": engine, "arch": str(cfg.model.arch),
            "checkpoint": str(ckpt.path), "checkpoint_epoch": int(ckpt.epoch),
            "checkpoint_sha256": ckpt.sha256, "vertices": vertices, "method": s["method"],
            "fanouts": list(s["fanouts"] or []),
            "run_dir": str(s["run_dir"]), "run_partition_hash": s["run_hash"],
            "partitions": str(s["store"]), "partition_hash": meta.content_hash,
            "source_graph": str(meta.attrs.get("source_graph", "")),
            "source_hash": str(meta.attrs.get("source_hash", "")),
            "num_nodes": int(meta.num_nodes), "num_ranks": int(rt.size),
            "config": cfg.to_json(), "inference_seconds": float(seconds),
            "comm_backend": rt.data_plane.name if rt.data_plane is not None else "",
            "mpi_library": mpi_library(),
            "peak_rss_bytes": np.asarray(peaks if peaks is not None else [], dtype=np.int64),
            "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "hpcgnn_version": __version__,
        }
        write_rows(rt, s["out"], ids, values, num_rows, args.what, attrs, s["block_bytes"], written_ids)
        peaks = rt.comm.gather(peak_rss_bytes(), root=0)
        if rt.is_root:
            from hpcgnn import log

            shape = "x".join(str(d) for d in (num_rows,) + values.shape[1:])
            log.info(f"hpcgnn: wrote {s['out']}: {args.what} [{shape}]"
                  + ("" if vertices == "all" else f" of the {vertices} vertices")
                  + (f" of layer {s['layer']}" if args.what == "embeddings" else "")
                  + f", {engine} checkpoint epoch {ckpt.epoch} (sha256 {ckpt.sha256[:12]}), "
                  f"{rt.size} rank(s), inference {seconds:.1f} s, peak RSS per rank "
                  + " ".join(fmt_bytes(p) for p in peaks))
        rt.comm.Barrier()
        rt.finish()
    return 0
