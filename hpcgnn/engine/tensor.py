"""NeutronTP: tensor-parallel full-graph training (``train.engine = "tensor"``, section ``[tensor]``).

**What a rank holds.** The whole topology, read from the ``indptr``/``indices`` datasets of *all*
partition files of the store (each file holds the in-edges of its contiguous global-ID range,
so concatenating them in part order is the global in-edge CSR; no other dataset of another
partition is read, and the graph file the store names is not needed): O(V + E) int64, plus
the propagation matrix with self loops and its transpose. Vertex data: full rows (features,
labels, masks) of its own ``~V/P`` vertices (read from whichever partition files hold them)
and, during the epoch, ``[V, C/P]`` column slices of the propagated embedding: O(V D / P),
never O(V D). Every partition file is opened through
:func:`hpcgnn.partition.store.open_partition_file` (content hash and solid range checked; rank
``r`` re-hashes file ``r`` when ``data.verify``). The feature rows of the rank's vertices are
held by a feature store (:func:`hpcgnn.store.rank.full_pass_features`, ``store.device_memory``:
host-only, tiered or device-only; docs/store.md) and gathered through it at every forward
(training and evaluation), so per-epoch counters ``store_*`` say how many rows the device tier
served; every layout gives the same rows, so the same losses.

**One decoupled epoch** (:class:`~hpcgnn.nn.decoupled.DecoupledModel`): the MLP on the rank's
vertex rows -> one **split** all-to-all to the feature layout
(:mod:`hpcgnn.comm.tensor_parallel`) -> ``k`` aggregation rounds on the local column slice
(native SpMM, no communication) -> one **gather** all-to-all back (split, rounds and gather are
one autograd collective, :class:`~hpcgnn.comm.tp_propagate.TPPropagate`) -> loss on the rank's training
vertices (sum / global training count). Backward mirrors it (split of the output gradient,
``k`` transposed rounds, gather): **4 all-to-alls per epoch whatever k is**, then one
allreduce (sum) of the parameter gradients and Adam. GAT adds one allgather of 2 scalars per
vertex (:class:`~hpcgnn.comm.tensor_parallel.AllgatherRows`; attention precomputed before
aggregation) and its adjoint (an allreduce of 2 V
partial sums). ``tensor.mode = "coupled"`` runs a split and a gather around every layer's
aggregation instead (4 x layers all-to-alls per epoch) for comparison.
``train.precision = "bf16"``: the linear maps' products run in bfloat16 with float32
accumulation (:mod:`hpcgnn.nn.precision`); aggregation, the all-to-alls, the attention
scores, the loss, gradients and Adam stay float32.

**Chunks** (``tensor.chunks = n``): destinations cut into ``n`` contiguous ranges balanced by
in-edges (:func:`hpcgnn.engine.chunk_schedule.chunk_bounds`, as the HongTu engine's chunks),
processed in the same order on every rank (:mod:`hpcgnn.comm.tp_propagate`). The split is cut
per chunk into the rows first needed by that chunk (de-duplicated: a row is sent once, later
chunks reuse it), the gather per chunk into its destination rows; with ``tensor.pipeline`` all
chunk splits are started at once (non-blocking all-to-alls of the data plane,
``Communicator.start_alltoallv``) and chunk ``j``'s aggregation starts when split ``j`` is
done, and chunk ``j``'s gather starts as soon as its last-round rows are computed. Backward
runs the chunks in reverse order, so the output-gradient split of chunk ``j`` and the
input-gradient gather of the rows first needed by chunk ``j`` (complete once chunks ``n-1..j``
are done) are overlapped the same way. Results equal the unchunked ones up to floating-point
order.

**Device path** (``train.device = "cuda"``, or ``tensor.staged`` with the CPU as the device):
the NN layers run on the device; the aggregation rounds go through
:class:`~hpcgnn.engine.tensor_staging.DeviceStage` (the chunk loop shared with the full-graph
engine, :class:`~hpcgnn.engine.chunk_stream.ChunkStream`, its de-duplicated transfer plan and
:class:`~hpcgnn.store.mover.DeviceMover`, :func:`~hpcgnn.nn.aggregate.aggregate_sum` on the
device): **resident** when the topology and the ``[V, C/P]`` slices fit the device budget
(:func:`~hpcgnn.engine.memory_tensor.resident_device_bytes`; kept on the device across rounds
and epochs), else **streamed** (both in host memory, every round streams the chunks); the
all-to-alls are unchanged (host buffers). ``tensor.chunks = "auto"`` picks the smallest count
whose device working set (:func:`hpcgnn.engine.memory_tensor.tensor_device_bytes`) fits
``tensor.device_memory``.

**Run output** (per rank and epoch): timings ``nn`` (MLP forward/backward, loss), ``split``,
``gather`` (posting + waiting, forward and backward), ``aggregate``, ``attention``, ``compute``
(= nn + aggregate: the load balance), ``allreduce``, ``optimizer``, ``eval``; counters
``split_bytes``, ``gather_bytes``, ``attention_bytes``, ``allreduce_bytes``, ``bytes_sent`` (their
sum; bytes this rank sent to other ranks in training), ``eval_bytes``, ``split_calls`` /
``gather_calls`` (MPI exchanges, one per chunk), ``layout_alltoalls`` (logical split/gather
collectives: 4 decoupled, 4 x layers coupled), ``nn_rows``, ``agg_edge_columns`` (edges x local
columns x rounds of the forward). Checkpoints and ``--resume`` through the shared loop.

This module holds the engine (:class:`TensorEngine`: set-up, chunk sizing, epochs, evaluation);
the host-device staging is :mod:`hpcgnn.engine.tensor_staging`, the autograd collectives are
:mod:`hpcgnn.comm.tp_propagate` and :mod:`hpcgnn.comm.tensor_parallel`.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from hpcgnn.comm.tensor_parallel import AllgatherRows, CommStats, TPComm, TPLayout, column_bounds
from hpcgnn.comm.tp_propagate import TPPropagate, TPRun
from hpcgnn.engine.hooks import TrainHooks
from hpcgnn.engine.loop import Engine, EpochResult
from hpcgnn.engine.memory_tensor import resident_device_bytes
from hpcgnn.engine.tensor_staging import DeviceStage
from hpcgnn.errors import InputError
from hpcgnn.partition.store import read_store_topology, read_vertex_rows


# ---- the engine ------------------------------------------------------------------------------
class TensorEngine(Engine):
    """The tensor-parallel engine on one rank (collective constructor)."""

    def __init__(self, cfg, rt, out, hooks: TrainHooks | None = None):
        from hpcgnn.engine.chunk_schedule import chunk_bounds
        from hpcgnn.comm.allreduce import GradientAllreduce, allreduce_sum
        from hpcgnn.engine.device import resolve_device
        from hpcgnn.engine.model import broadcast_parameters, build_optimizer, kernel_backend
        from hpcgnn.run.timer import PhaseTimer
        from hpcgnn.seeding import seed_torch
        from hpcgnn.nn.decoupled import PROPAGATIONS, CoupledModel, DecoupledModel, Propagation

        self.cfg, self.rt, self.out = cfg, rt, out
        self.hooks = hooks or TrainHooks()
        t = cfg.tensor
        meta = out.meta
        store = cfg.data.partitions
        t0 = time.perf_counter()
        error, data = None, None
        chunks, self._budget = 1, None
        try:
            device = resolve_device(cfg, rt)
            # train.kernels = "torch": the torch chunk operators live in the staged path
            kernels = kernel_backend(cfg, device)
            staged = device.type != "cpu" or t.staged or kernels == "torch"
            chunks = self._chunk_count(cfg, meta, rt, device)
        except InputError as exc:
            error = str(exc)
        rt.agree(error)
        # every rank must cut the same chunks (GPUs of different sizes: the largest count)
        from mpi4py import MPI

        chunks = int(rt.comm.allreduce(chunks, op=MPI.MAX))
        error = None
        try:
            # the whole graph's topology on every rank (NeutronTP), through the graph store
            # interface; int64 arrays, so the store holds them without a copy, and only until the
            # propagation operators are built below
            from hpcgnn.store.graph import HostGraphStore

            topo = read_store_topology(store, meta, rt.rank if cfg.data.verify else None)
            graph = HostGraphStore(*topo, num_solid=meta.num_nodes, num_local=meta.num_nodes)
            del topo
            indptr, indices = graph.csr()
            bounds = chunk_bounds(indptr, chunks)
            layout = TPLayout.build(indptr, indices, bounds, rt.size, rt.rank)
            data = read_vertex_rows(store, meta, layout.own_ids)
            from hpcgnn.store.rank import full_pass_features

            features = full_pass_features(cfg.store.device_memory, data["features"],
                                          np.diff(indptr)[layout.own_ids], device, rt.store_device_available)
        except InputError as exc:
            error = str(exc)
        rt.agree(error)
        self.device = device
        self.staged = staged
        self.timer = PhaseTimer(sync_cuda=device.type == "cuda", cuda_device=device)
        self.layout = layout
        self.mode = t.mode
        self.kind = PROPAGATIONS[cfg.model.arch]
        det = cfg.train.deterministic
        self.prop = Propagation(indptr, indices, self.kind, bounds, backend=kernels, deterministic=det)
        del indices, graph
        self.stats = CommStats()
        from hpcgnn.comm.data_plane import make_communicator

        self.data_plane = make_communicator(rt, cfg.runtime.backend, device)
        self.tp = TPComm(self.data_plane, layout, self.stats)
        # resident when the slices and the topology fit the device budget (streamed otherwise)
        self.resident = bool(staged) and self._fits_resident(cfg, meta, rt.size, layout.num_chunks, device)
        self.stage = DeviceStage(self.prop, device, meter=self.timer.memory, backend=kernels,   # the rank's one meter
                                 resident=self.resident, deterministic=det) if staged else None
        self.run = TPRun(self.tp, layout, self.prop, t.pipeline, self.stage)
        self.k = t.k or cfg.model.layers
        self.c = t.gamma * (1.0 - t.alpha)
        self.alpha = t.alpha
        self.features = features      # the rank's rows of X, read through :attr:`x` per forward
        self.labels = torch.from_numpy(data["labels"]).to(device)
        self.masks = {s: torch.from_numpy(m).to(device) for s, m in data["masks"].items()}
        m = cfg.model
        seed_torch(cfg.train.seed, -1)
        if self.mode == "decoupled":
            self.model = DecoupledModel(meta.num_features, m.hidden, meta.num_classes, m.layers, m.dropout,
                                        attention=self.kind == "attention")
        else:
            self.model = CoupledModel(meta.num_features, m.hidden, meta.num_classes, m.layers, m.dropout)
        from hpcgnn.nn.precision import set_precision

        set_precision(self.model, cfg.train.precision).to(device)   # bf16: the linear maps' products
        if rt.size > 1:
            broadcast_parameters(self.model, rt)
        self.optimizer = build_optimizer(cfg, self.model)
        # sum of the partial gradients of the global mean loss; buckets start during backward on
        # a duplicate of the data plane (its gathers are collectives of their own), once each
        # gradient has had the accumulations the first step counted (chunked: per chunk)
        self.reducer = GradientAllreduce(self.model, self.data_plane.duplicate(),
                                         op="sum", accumulations="learn")
        self.n_train = float(allreduce_sum(rt, [int(self.masks["train"].sum())])[0])
        if self.n_train == 0:
            rt.agree(f"{store}: the graph has no training vertices")
        self.eval_stats = CommStats()
        setup_s = time.perf_counter() - t0
        sizes = rt.comm.allgather(layout.num_own)
        from hpcgnn.engine.memory_tensor import tensor_device_bytes

        nn_b, chunk_b = tensor_device_bytes(cfg, meta, rt.size, layout.num_chunks, device.type)
        device_attrs = dict(tensor_staged=bool(staged), tensor_chunks_setting=str(t.chunks),
                            tensor_device_nn_bytes=int(nn_b), tensor_device_chunk_bytes=int(chunk_b))
        if self._budget is not None:
            device_attrs["tensor_device_budget_bytes"] = int(self._budget)
        if staged:
            device_attrs["tensor_stage_capacity_rows"] = int(self.stage.capacity)
            device_attrs["tensor_resident"] = bool(self.resident)
        if t.chunks == "auto" and rt.rank == 0:
            from hpcgnn.units import fmt_bytes

            budget = "no device budget (the CPU's 'auto')" if self._budget is None else \
                f"the budget {fmt_bytes(self._budget)} (tensor.device_memory = {t.device_memory!r})"
            print(f"hpcgnn: tensor.chunks = auto: {layout.num_chunks} chunk(s); estimated device working set "
                  f"{fmt_bytes(nn_b + chunk_b)} (NN layers {fmt_bytes(nn_b)}, one chunk {fmt_bytes(chunk_b)}) "
                  f"within {budget}", flush=True)
        out.set_attrs(store_mode=features.name, tensor_mode=self.mode, tensor_propagation=self.kind, tensor_k=self.k,
                      tensor_chunks=layout.num_chunks, tensor_vertex_rows=sizes, **device_attrs,
                      tensor_columns=[int(x) for x in np.diff(column_bounds(meta.num_classes, rt.size))],
                      tensor_topology="indptr/indices of every partition file (whole graph on every rank)",
                      tensor_grad_reduce="sum of partial gradients of the global mean loss",
                      device=str(device), setup_seconds=setup_s)

    def _chunk_count(self, cfg, meta, rt, device) -> int:
        """``tensor.chunks`` resolved on this rank (``'auto'``: :func:`~hpcgnn.engine.memory_tensor.auto_chunks`
        for ``tensor.device_memory``); sets ``self._budget`` (bytes or None)."""
        from hpcgnn.engine.memory_tensor import auto_chunks
        from hpcgnn.run.engines.tensor import device_budget

        t = cfg.tensor
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        self._budget = device_budget(t.device_memory, device.type, total)
        if t.chunks == "auto":
            return auto_chunks(cfg, meta, rt.size, self._budget, device.type)[0]
        if self._budget is not None and rt.rank == 0 and (device.type != "cpu" or t.staged):
            from hpcgnn.engine.memory_tensor import tensor_device_bytes
            from hpcgnn.units import fmt_bytes
            from hpcgnn.run.console import warn

            need = sum(tensor_device_bytes(cfg, meta, rt.size, int(t.chunks), device.type))
            if need > self._budget:
                warn(f"tensor.chunks = {t.chunks}: the estimated device working set {fmt_bytes(need)} exceeds "
                     f"tensor.device_memory ({fmt_bytes(self._budget)}); tensor.chunks = 'auto' sizes the chunks")
        return int(t.chunks)

    def _fits_resident(self, cfg, meta, parts: int, chunks: int, device) -> bool:
        """Whether the staged path keeps its topology and slices on the device: a device budget
        exists (``tensor.device_memory``; none with the CPU's ``'auto'``, where the staged path
        streams) and the NN layers, one chunk's working set and :func:`resident_device_bytes`
        fit it."""
        from hpcgnn.engine.memory_tensor import tensor_cols, tensor_device_bytes

        if self._budget is None:
            return False
        t = cfg.tensor
        k = (t.k or cfg.model.layers) if t.mode == "decoupled" else 1
        nn_b, chunk_b = tensor_device_bytes(cfg, meta, parts, chunks, device.type)
        res_b = resident_device_bytes(self.prop.num_nodes, int(self.prop.indices.shape[0]), chunks,
                                      tensor_cols(cfg, meta, parts), k, self.kind == "attention")
        return nn_b + chunk_b + res_b <= self._budget

    # ---- forward -------------------------------------------------------------------------------
    @property
    def x(self) -> torch.Tensor:
        """Input feature rows [n_own, F] of the rank's vertices, gathered through the feature
        store (counted in its counters)."""
        return self.features.gather_all()      # the store holds exactly this rank's rows, in order

    def logits(self) -> torch.Tensor:
        """Vertex-layout output rows [n_i, C] of the rank's vertices (autograd when enabled)."""
        from hpcgnn.nn.decoupled import DecoupledModel

        model, run = self.model, self.run
        x = self.x
        if isinstance(model, DecoupledModel):
            h = model.mlp(x)
            weight = None
            if self.kind == "attention":
                el, er = model.scores(h)
                # the scalars and the edge weights live in host memory (the topology's side)
                both = AllgatherRows.apply(torch.stack([el, er], 1).cpu(), self.tp)
                weight = self.prop.attention(both[:, 0], both[:, 1])
            return TPPropagate.apply(h, weight, run, self.k, self.c, self.alpha)
        h = x
        for l in range(model.num_layers):
            h = model.pre(l, h)
            h = TPPropagate.apply(h, None, run, 1, 1.0, 0.0)
            h = model.post(l, h)
        return h

    def train_epoch(self, epoch: int) -> EpochResult:
        from hpcgnn.comm.allreduce import allreduce_sum

        timer = self.timer
        with timer.phase("housekeeping"):     # per-epoch set-up, so the phases cover the epoch
            self.stats.reset()
            self.run.reset()
            self.features.reset_counters()
            if self.stage is not None:
                self.stage.counter.reset()
                self.stage.meter.reset()
            self.optimizer.zero_grad(set_to_none=True)
            self.hooks.before_step(epoch, 0)
        t0 = time.perf_counter()
        logits = self.logits()
        idx = self.masks["train"].nonzero().squeeze(1)
        loss_sum = F.cross_entropy(logits.index_select(0, idx), self.labels.index_select(0, idx), reduction="sum")
        self.reducer.begin()
        (loss_sum / self.n_train).backward()
        fb = time.perf_counter() - t0
        with timer.phase("allreduce"):
            self.reducer(loss_sum, epoch)     # raises on a non-finite loss or gradient
        with timer.phase("optimizer"):
            self.optimizer.step()
        with timer.phase("housekeeping"):     # the global loss (collective)
            loss_local = float(loss_sum.detach())
            loss = float(allreduce_sum(self.rt, [loss_local])[0] / self.n_train)
        self.hooks.after_step(epoch, 0, loss_local, int(idx.shape[0]), self.model)
        s = self.stats
        comm_s = sum(s.seconds.values())
        nn_s = max(fb - comm_s - self.run.aggregate_s, 0.0)
        timings = {"nn": nn_s, "split": s.seconds.get("split", 0.0), "gather": s.seconds.get("gather", 0.0),
                   "aggregate": self.run.aggregate_s, "compute": nn_s + self.run.aggregate_s}
        if "attention" in s.seconds:
            timings["attention"] = s.seconds["attention"]
        allreduce_bytes = self.reducer.bytes_per_call if self.rt.size > 1 else 0
        counters = {f"{kind}_bytes": float(v) for kind, v in s.bytes.items()}
        counters.update({f"{kind}_calls": float(v) for kind, v in s.calls.items()})
        counters["allreduce_bytes"] = float(allreduce_bytes)
        counters["allreduce_buckets_in_backward"] = float(self.reducer.started_in_backward)
        counters["bytes_sent"] = float(sum(s.bytes.values()) + allreduce_bytes)
        counters["layout_alltoalls"] = float(self.run.alltoalls)
        counters["nn_rows"] = float(self.layout.num_own)
        counters["agg_edge_columns"] = float(self.run.edge_columns)
        if self.stage is not None:
            counters.update({k: float(v) for k, v in self.stage.counter.as_dict().items()})
            counters["peak_device_bytes"] = float(self.stage.meter.peak_bytes)
        # parts of the forward/backward, which is no phase of its own; compute sums two of them
        parents = {"nn": "epoch", "split": "epoch", "gather": "epoch", "aggregate": "epoch", "attention": "epoch",
                   "compute": "nn+aggregate"}
        return EpochResult(loss, counters=counters, timings=timings, timing_parents=parents)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        from hpcgnn.engine.metrics import accuracy_metrics, split_counts

        self.tp.stats, self.run.record = self.eval_stats, False
        try:
            pred = self.logits().argmax(1)
        finally:
            self.tp.stats, self.run.record = self.stats, True
        correct, total = split_counts(pred, self.labels, self.masks)
        return accuracy_metrics(self.rt, correct, total)

    def finish_epoch(self, result: EpochResult) -> None:
        result.counters["eval_bytes"] = float(sum(self.eval_stats.bytes.values()))
        result.counters.update(self.features.counters.as_dict())    # training and evaluation reads
        self.eval_stats.reset()


def make_engine(cfg, rt, out, hooks: TrainHooks | None = None) -> TensorEngine:
    """Collective: the tensor-parallel engine of this rank (registry factory)."""
    return TensorEngine(cfg, rt, out, hooks)
