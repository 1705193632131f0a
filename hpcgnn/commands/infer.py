"""`hpcgnn infer RUN --out FILE.h5 [--checkpoint FILE] [--what logits|embeddings|predictions]
[--layer L] [--vertices all|train|val|test] [--partitions DIR] [--device D] [--backend B] [--force]`
(collective: under mpiexec/srun, or one process).

Loads the run's configuration (``RUN/run.h5``) and a checkpoint (the newest in
``RUN/checkpoints`` unless ``--checkpoint``), runs exact full-neighbour inference in bounded memory
(see below) and writes ONE HDF5 file (``format = "hpcgnn-infer"``) with a row for every vertex
in the graph file's vertex order (docs/infer.md):

* ``logits`` float32 [V, C], ``predictions`` int64 [V] (their argmax) or ``embeddings`` float32
  [V, W] (the output of layer ``--layer``, 1-based, default the last hidden layer);
* ``vertex_ids`` int64 [V]: the graph file's id of every row (``0 .. V-1``);
* with ``--vertices train|val|test`` the rows of that split's vertices only, in the same order:
  [V_split, ...] and ``vertex_ids`` [V_split] their (increasing) graph ids. Inference computes
  the same rows either way (layer-wise full-neighbour inference needs every vertex's hidden
  layers); the option selects what is written. Every rank holds the graph ids of the whole
  split (8 bytes each) to place its rows;
* attributes: ``what``, ``layer``, ``num_layers``, ``engine``, ``comm_backend`` (what carried the
  data plane, ``runtime.backend`` of the run's configuration; ``""`` when none was made),
  ``mpi_library``, ``checkpoint``,
  ``checkpoint_epoch``, ``checkpoint_sha256`` (of the checkpoint file), ``vertices`` (``all`` or
  the split written), the run and store
  read, the rank count, seconds and per-rank peak resident memory.

The job has one rank per partition of the store it reads: the run's store by default,
``--partitions DIR`` another store of the same graph with as many parts as the job has ranks.
Bad input (no checkpoint, a layer out of range, a checkpoint of another model shape or engine,
a store of another graph or with another part count) is one line naming it, exit 2 on every
rank, and nothing is written; the output appears complete (temporary name, then rename) or not
at all.

**Computing the rows** (the store may have another rank count than training's):

* **Partition-parallel models** (``train.engine`` = ``minibatch`` or ``fullgraph``: the GNN of
  :mod:`hpcgnn.nn.models`, :func:`gnn_rows`): the minibatch engine's evaluation,
  :func:`hpcgnn.engine.inference.partition_inference`: exact full-neighbour inference layer by
  layer over the rank's solid vertices, destinations in chunks (``minibatch.eval_rows``, 0 =
  a 256 MiB budget) and halo rows streamed in rounds (``minibatch.eval_halo_rounds``, 0 = sized
  to a 256 MiB round). The full-graph engine's evaluation runs the same layers unchunked; the
  results agree up to floating-point order.
* **Tensor parallel** (``tensor``, :func:`tensor_rows`): the engine itself (:class:`hpcgnn.engine.tensor.TensorEngine`,
  whole topology on every rank) and its forward (:meth:`~hpcgnn.engine.tensor.TensorEngine.logits`),
  with the model in eval mode.

**Layers** are numbered from 1: ``layer = L`` is the output of the model's ``L``-th layer, after
its ReLU (hidden layers; dropout is off at inference); ``layer = num_layers`` is the logits. For
the decoupled tensor models (MLP, then propagation) the hidden layers are the MLP's and the last
layer includes the propagation; for the coupled tensor model layer ``L`` includes its
aggregation. The default of ``--what embeddings`` is the last hidden layer, ``num_layers - 1``.

**Writing** (:func:`write_rows`): rank 0 assembles the file block by block (``block_bytes`` of
output rows per block): every rank sorts its rows by graph vertex id once, and for each block
sends the rows that fall in it (one ``Gatherv`` of ids, one of rows); rank 0 checks that every
vertex of the block arrived exactly once and writes it. Memory beyond the rank's own result: one
block (rank 0: two). The file is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hpcgnn.errors import InputError

if TYPE_CHECKING:
    import torch

WHATS = ("logits", "embeddings", "predictions")
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
DEFAULT_BLOCK_BYTES = 64 << 20


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


@dataclass
class Checkpoint:
    """The parts of a checkpoint inference uses; ``sha256`` is of the file's bytes."""

    path: Path
    sha256: str
    epoch: int
    engine: str
    content_hash: str
    model: dict = field(repr=False)


def read_checkpoint(path: Path) -> Checkpoint:
    """Read and hash one checkpoint file (rank 0); InputError naming the file if it is not a
    readable hpcgnn checkpoint."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: checkpoint file not found")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: checkpoint not readable ({exc.__class__.__name__})") from None
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is bad input
        raise InputError(f"{path}: not a loadable torch checkpoint ({exc.__class__.__name__})") from None
    if not isinstance(state, dict) or "epoch" not in state or not isinstance(state.get("model"), dict):
        raise InputError(f"{path}: not an hpcgnn checkpoint (expected a dict with 'epoch' and 'model')")
    return Checkpoint(path=path, sha256=hashlib.sha256(data).hexdigest(), epoch=int(state["epoch"]),
                      engine=str(state.get("engine", "")), content_hash=str(state.get("content_hash", "")),
                      model=state["model"])


# ---- computing rows ------------------------------------------------------------------------------
@dataclass
class _InferOutput:
    """What an engine's constructor reads from its run output (``cfg``, ``rt``, ``meta``,
    ``engine``); the run attributes it sets are kept here, since inference writes no run file."""

    cfg: object
    rt: object
    meta: object
    engine: str
    attrs: dict = field(default_factory=dict)

    def set_attrs(self, **values) -> None:
        self.attrs.update(values)


def gnn_rows(cfg, rt, meta, model_state: dict, ckpt: Path, layer: int) -> tuple[np.ndarray, torch.Tensor]:
    """Collective (minibatch / fullgraph checkpoints): (store ids [n_solid], output rows
    [n_solid, width]) of this rank's partition of ``cfg.data.partitions`` after ``layer`` layers
    (:func:`hpcgnn.engine.inference.partition_inference`, the minibatch engine's evaluation)."""
    from hpcgnn.engine.device import resolve_device
    from hpcgnn.engine.model import build_model_from_config
    from hpcgnn.engine.inference import partition_inference
    from hpcgnn.partition.store import load_partition
    from hpcgnn.run.checkpoint import load_model_state
    from hpcgnn.store.host import HostFeatureStore

    error, part, model, device = None, None, None, None
    try:
        part = load_partition(cfg.data.partitions, rt.rank, meta, verify=cfg.data.verify,
                              features=cfg.store.features)
        device = resolve_device(cfg, rt)
        model = build_model_from_config(cfg, int(meta.num_features), int(meta.num_classes), None, device)
        load_model_state(model, model_state, ckpt, cfg)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    mb = cfg.minibatch
    features = HostFeatureStore(part.features).full_rows()
    from hpcgnn.comm.communicator import make_communicator

    rows = partition_inference(model, part, make_communicator(rt, cfg.runtime.backend, device), features, device,
                               rows=mb.eval_rows, halo_rounds=mb.eval_halo_rounds, num_layers=layer)
    ids = np.arange(part.solid_begin, part.solid_end, dtype=np.int64)
    return ids, rows.cpu()


def tensor_rows(cfg, rt, meta, model_state: dict, ckpt: Path, layer: int) -> tuple[np.ndarray, torch.Tensor]:
    """Collective (tensor checkpoints): (store ids [n_i], output rows [n_i, width]) of this
    rank's vertices of the tensor engine's layout after ``layer`` layers."""
    import torch

    from hpcgnn.engine.tensor import TensorEngine, TPPropagate
    from hpcgnn.nn.decoupled import DecoupledModel
    from hpcgnn.run.checkpoint import load_model_state

    engine = TensorEngine(cfg, rt, _InferOutput(cfg, rt, meta, "tensor"))
    error = None
    try:
        load_model_state(engine.model, model_state, ckpt, cfg)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    model = engine.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if layer == model.num_layers:
                h = engine.logits()
            elif isinstance(model, DecoupledModel):   # hidden layers are the MLP's (no exchange)
                h = model.dropout(engine.x)
                for l in range(layer):
                    h = model.dropout.forward_relu(model.lins[l](h))
            else:                                     # coupled: aggregation inside every layer
                h = engine.x
                for l in range(layer):
                    h = model.post(l, TPPropagate.apply(model.pre(l, h), None, engine.run, 1, 1.0, 0.0))
    finally:
        model.train(was_training)
    return np.asarray(engine.layout.own_ids, dtype=np.int64), h


def graph_ids(meta, store_ids: np.ndarray) -> np.ndarray:
    """Graph-file vertex ids of store ids (``meta.h5``'s ``new_to_orig``), reading only the
    range of the store the ids span."""
    import h5py

    from hpcgnn.partition.store import META_FILE

    store_ids = np.asarray(store_ids, dtype=np.int64)
    if store_ids.size == 0:
        return store_ids.copy()
    lo, hi = int(store_ids.min()), int(store_ids.max()) + 1
    with h5py.File(Path(meta.path) / META_FILE, "r") as f:
        span = np.asarray(f["new_to_orig"][lo:hi], dtype=np.int64)
    return span[store_ids - lo]


def split_rows(rt, meta, store_ids: np.ndarray, ids: np.ndarray, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Collective: the rows of ``split``'s vertices among this rank's (store ids ``store_ids``,
    graph ids ``ids``): (positions of this rank's kept rows, in the output, [k]; which of its rows
    are kept, bool [n]; the graph ids of every output row, in increasing order, [V_split]). The
    split masks are read from the partition files that hold ``store_ids``."""
    from hpcgnn.partition.store import open_partition_file

    store_ids = np.asarray(store_ids, dtype=np.int64)
    keep = np.zeros(store_ids.shape[0], dtype=bool)
    error = None
    try:
        offsets = np.asarray(meta.part_offsets, dtype=np.int64)
        part_of = np.searchsorted(offsets, store_ids, side="right") - 1
        for p in np.unique(part_of):
            sel = np.flatnonzero(part_of == p)
            loc = store_ids[sel] - offsets[p]
            lo, hi = int(loc.min()), int(loc.max()) + 1
            with open_partition_file(meta.path, int(p), meta) as f:
                keep[sel] = np.asarray(f[f"{split}_mask"][lo:hi], dtype=bool)[loc - lo]
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    kept = np.ascontiguousarray(ids[keep], dtype=np.int64)
    every = np.sort(np.concatenate(rt.comm.allgather(kept)))
    return np.searchsorted(every, kept), keep, every


# ---- writing -------------------------------------------------------------------------------------
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
    return {"run_dir": run_dir, "attrs": attrs, "cfg": cfg, "engine": engine, "layer": layer,
            "out": out, "store": store, "meta": meta, "run_hash": run_hash, "ckpt": ckpt,
            "block_bytes": block_bytes}


def _read_newest(path: Path, run_dir: Path, explicit: bool, tries: int = 5):
    """Rank 0: read checkpoint ``path`` (bytes read once, hashed and loaded from memory). Without
    ``--checkpoint`` the newest may be removed by a live run's ``output.keep_checkpoints`` between
    listing and reading: then the new newest is read (a consistent file either way: checkpoints
    are renamed into place complete)."""
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
        elif engine in ("minibatch", "fullgraph"):
            store_ids, rows = gnn_rows(cfg, rt, meta, ckpt.model, ckpt.path, s["layer"])
        else:
            rt.agree(f"{s['run_dir']}: engine {engine!r} has no inference path "
                     "(expected minibatch, fullgraph or tensor)")
        from hpcgnn.commands.train import say_data_plane

        say_data_plane(rt, args)     # hpcgnn -v
        if args.what == "predictions":
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
            "checkpoint_sha256": ckpt.sha256, "vertices": vertices,
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
