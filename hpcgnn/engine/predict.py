"""The rows `hpcgnn infer` writes, computed from a checkpoint: collective, one rank per partition
of the store (``cfg.data.partitions``) the rows are read from; docs/infer.md.

* **Partition-parallel models** (``train.engine`` = ``minibatch`` or ``fullgraph``: the GNN of
  :mod:`hpcgnn.nn.models`, :func:`gnn_rows`): the minibatch engine's evaluation,
  :func:`hpcgnn.engine.inference.partition_inference`: exact full-neighbour inference layer by
  layer over the rank's solid vertices, destinations in chunks (``minibatch.eval_rows``, 0 =
  a 256 MiB budget) and halo rows streamed in rounds (``minibatch.eval_halo_rounds``, 0 = sized
  to a 256 MiB round). The full-graph engine's evaluation runs the same layers unchunked; the
  results agree up to floating-point order.
* **Sampled** (partition-parallel models, :func:`sampled_gnn_rows`): the minibatch engine's
  sampled evaluation (:func:`hpcgnn.engine.inference.sampled_inference`): each selected vertex's
  neighbours sampled over the whole graph with the given fanouts, keyed by (seed, hop, vertex),
  input rows pulled from their owners, in batches of ``minibatch.eval_batch_size`` seeds per
  rank. A rank holds its partition, the model and one batch, so the memory does not grow with
  the layers' width times the vertex count; the rows are a sample's, not exact.
* **Tensor parallel** (``tensor``, :func:`tensor_rows`): the engine itself
  (:class:`hpcgnn.engine.tensor.TensorEngine`, whole topology on every rank) and its forward
  (:meth:`~hpcgnn.engine.tensor.TensorEngine.logits`), with the model in eval mode.

**Layers** are numbered from 1: ``layer = L`` is the output of the model's ``L``-th layer, after
its ReLU (hidden layers; dropout is off at inference); ``layer = num_layers`` is the logits. For
the decoupled tensor models (MLP, then propagation) the hidden layers are the MLP's and the last
layer includes the propagation; for the coupled tensor model layer ``L`` includes its
aggregation.

The rows come in store ids; :func:`graph_ids` maps them to the graph file's vertex ids and
:func:`split_rows` selects a split's rows (:func:`hpcgnn.run.rows_file.write_rows` writes them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hpcgnn.errors import InputError

if TYPE_CHECKING:
    import torch


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


def _partition_and_model(cfg, rt, meta, model_state: dict, ckpt: Path, local_dtype: str):
    """Collective: this rank's partition (source ids local, ``local_dtype`` as
    :func:`~hpcgnn.partition.store.load_partition` takes it), the device and the run's model with
    the checkpoint's parameters; an InputError on any rank ends every rank with its line."""
    from hpcgnn.engine.device import resolve_device
    from hpcgnn.engine.model import build_model_from_config
    from hpcgnn.partition.store import load_partition
    from hpcgnn.run.checkpoint import load_model_state

    error, part, model, device = None, None, None, None
    try:
        part = load_partition(cfg.data.partitions, rt.rank, meta, verify=cfg.data.verify,
                              features=cfg.store.features, indices="local", local_dtype=local_dtype)
        device = resolve_device(cfg, rt)
        model = build_model_from_config(cfg, int(meta.num_features), int(meta.num_classes), None, device)
        load_model_state(model, model_state, ckpt, cfg)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    return part, model, device


def gnn_rows(cfg, rt, meta, model_state: dict, ckpt: Path, layer: int) -> tuple[np.ndarray, torch.Tensor]:
    """Collective (minibatch / fullgraph checkpoints): (store ids [n_solid], output rows
    [n_solid, width]) of this rank's partition of ``cfg.data.partitions`` after ``layer`` layers
    (:func:`hpcgnn.engine.inference.partition_inference`, the minibatch engine's evaluation)."""
    from hpcgnn.engine.inference import partition_inference
    from hpcgnn.store.host import HostFeatureStore

    part, model, device = _partition_and_model(cfg, rt, meta, model_state, ckpt, "int64")
    mb = cfg.minibatch
    features = HostFeatureStore(part.features).full_rows()
    from hpcgnn.comm.data_plane import make_communicator

    rows = partition_inference(model, part, make_communicator(rt, cfg.runtime.backend, device), features, device,
                               rows=mb.eval_rows, halo_rounds=mb.eval_halo_rounds, num_layers=layer)
    ids = np.arange(part.solid_begin, part.solid_end, dtype=np.int64)
    return ids, rows.cpu()


def sampled_gnn_rows(cfg, rt, meta, model_state: dict, ckpt: Path, fanouts: list[int], vertices: str,
                     argmax: bool) -> tuple[np.ndarray, torch.Tensor]:
    """Collective (minibatch / fullgraph checkpoints, ``--method sampled``): (store ids, rows) of
    this rank's solid vertices of ``vertices`` (a split, or all) after ``len(fanouts)`` layers,
    by sampled inference over the whole graph (:func:`hpcgnn.engine.inference.sampled_inference`,
    the minibatch engine's sampled evaluation: same seed, same streams, so the same rows), in
    batches of ``minibatch.eval_batch_size`` (0: ``minibatch.batch_size``) seeds per rank; with
    ``argmax`` the rows' argmax (predictions). The rank holds its partition, the model and one
    batch: no [num_solid, width] layer output."""
    from hpcgnn.comm.data_plane import make_communicator
    from hpcgnn.comm.exact_fetch import ExactFetch
    from hpcgnn.engine.inference import sampled_inference

    part, model, device = _partition_and_model(cfg, rt, meta, model_state, ckpt, "auto")
    model.eval()
    mask = np.ones(part.num_solid, dtype=bool) if vertices == "all" else getattr(part, f"{vertices}_mask")
    local = np.flatnonzero(mask).astype(np.int64)
    fetch = ExactFetch(make_communicator(rt, cfg.runtime.backend, device), part, meta.part_offsets, fanouts,
                       cfg.train.seed, csr=part.local_csr())
    mb = cfg.minibatch
    rows = sampled_inference(model, fetch, local, mb.eval_batch_size or mb.batch_size, rt, device, argmax=argmax)
    return local + part.solid_begin, rows


def tensor_rows(cfg, rt, meta, model_state: dict, ckpt: Path, layer: int) -> tuple[np.ndarray, torch.Tensor]:
    """Collective (tensor checkpoints): (store ids [n_i], output rows [n_i, width]) of this
    rank's vertices of the tensor engine's layout after ``layer`` layers."""
    import torch

    from hpcgnn.comm.tp_propagate import TPPropagate
    from hpcgnn.engine.tensor import TensorEngine
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
