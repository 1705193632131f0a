"""Offline inference from a checkpoint (`hpcgnn infer`): every vertex's logits, predictions or
one layer's embeddings, computed in bounded memory and written in the graph file's vertex order.

Collective over the job's ranks; the job has one rank per partition of the store it reads
(any store of the run's graph, so the rank count may differ from training's).

* **Partition-parallel models** (``train.engine`` = ``minibatch`` or ``fullgraph``: the GNN of
  :mod:`hpcgnn.nn.models`): the minibatch engine's evaluation path,
  :func:`hpcgnn.engine.inference.layerwise_inference`: exact full-neighbour inference layer by
  layer over the rank's solid vertices, destinations in chunks (``minibatch.eval_rows``, 0 =
  a 256 MiB budget) and halo rows streamed in rounds (``minibatch.eval_halo_rounds``, 0 = sized
  to a 256 MiB round). The full-graph engine's evaluation runs the same layers unchunked; the
  results agree up to floating-point order.
* **Tensor parallel** (``tensor``): the engine itself (:class:`hpcgnn.engine.tensor.TensorEngine`,
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hpcgnn.errors import InputError

if TYPE_CHECKING:
    import torch

WHATS = ("logits", "embeddings", "predictions")
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
    from hpcgnn.run.config import Config, schema

    try:
        stored = json.loads(config_json)
    except (TypeError, ValueError):
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
    [n_solid, width]) of this rank's partition of ``cfg.data.partitions`` after ``layer`` layers."""
    import torch

    from hpcgnn.comm.halo import ExactHalo, HaloPlan
    from hpcgnn.engine.common import build_model_from_config, resolve_device
    from hpcgnn.engine.inference import auto_rounds, layerwise_inference, max_width
    from hpcgnn.partition.store import load_partition
    from hpcgnn.run.checkpoint import load_model_state

    error, part, model, device = None, None, None, None
    try:
        part = load_partition(cfg.data.partitions, rt.rank, meta, verify=cfg.data.verify)
        device = resolve_device(cfg, rt)
        model = build_model_from_config(cfg, int(meta.num_features), int(meta.num_classes), None, device)
        load_model_state(model, model_state, ckpt, cfg)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    plan = HaloPlan.from_partition(part, rt.comm)
    gcn_scale = None
    if cfg.model.arch == "gcn":   # exact full-graph GCN normalisation (D+I)^-1/2
        from hpcgnn.nn.conv import gcn_norm

        gcn_scale = gcn_norm(part.local_degree()[:part.num_solid])
    mb = cfg.minibatch
    rounds = mb.eval_halo_rounds or auto_rounds(rt.comm, part.num_halo, max_width(model))
    halo = ExactHalo(rt.comm, plan).rounds(rounds)
    _, local_indices = part.local_csr()
    x = torch.from_numpy(part.features).to(device)
    rows = layerwise_inference(model, part.indptr, local_indices, x, halo, rows=mb.eval_rows,
                               gcn_scale=gcn_scale, num_layers=layer)
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


# ---- writing -------------------------------------------------------------------------------------
def write_rows(rt, path: Path, ids: np.ndarray, rows: np.ndarray, num_nodes: int, name: str,
               attrs: dict, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
    """Collective: write ``rows`` (this rank's, for graph vertex ids ``ids``) of every rank into
    one HDF5 file ``path`` in vertex order: dataset ``name`` [num_nodes, ...] and ``vertex_ids``
    [num_nodes] (the graph file's ids of the rows), file attributes ``attrs``. Rank 0 writes,
    block by block (see the module docstring); the file appears complete or not at all."""
    from hpcgnn.fileio import atomic_file

    rows = np.ascontiguousarray(rows)
    tail = tuple(int(s) for s in rows.shape[1:])
    width = int(np.prod(tail, dtype=np.int64)) if tail else 1
    block = max(1, int(block_bytes) // max(1, width * rows.dtype.itemsize))
    if rt.is_root:
        import h5py

        with atomic_file(path) as tmp, h5py.File(tmp, "w") as f:
            for k, v in attrs.items():
                f.attrs[k] = json.dumps(v) if isinstance(v, (dict, list, tuple)) else v
            chunk = (min(max(1, num_nodes), max(1, (1 << 20) // max(1, width * rows.dtype.itemsize))),) + tail
            data = f.create_dataset(name, shape=(num_nodes,) + tail, dtype=rows.dtype, chunks=chunk)
            vids = f.create_dataset("vertex_ids", shape=(num_nodes,), dtype=np.int64)
            _assemble(rt, ids, rows, num_nodes, block, (data, vids))
    else:
        _assemble(rt, ids, rows, num_nodes, block, None)


def _assemble(rt, ids: np.ndarray, rows: np.ndarray, num_nodes: int, block: int, sink) -> None:
    """The block loop of :func:`write_rows` (``sink`` = (dataset, vertex_ids) on rank 0)."""
    from mpi4py import MPI
    from mpi4py.util.dtlib import from_numpy_dtype

    comm = rt.comm
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
        if sink is None:
            comm.Gatherv(send_ids, None, root=0)
            comm.Gatherv(send_rows, None, root=0)
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
        data, vids = sink
        data[a:b] = out
        ordered = np.empty(b - a, dtype=np.int64)
        ordered[pos] = got_ids
        vids[a:b] = ordered
