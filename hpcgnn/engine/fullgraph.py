"""Exact full-graph training: one partition per rank, every layer over all in-neighbours.

Each rank holds its partition as one block (sources = solid + halo vertices,
destinations = solid vertices). Before every layer after the first, the halo
rows are fetched from their owners by the rank's :class:`~hpcgnn.comm.halo.HaloProvider`
(:meth:`~hpcgnn.comm.halo.HaloProvider.exchange`, exact today; its backward sends the halo gradients back and sums them into the owners'
rows); layer 0's halo features are exchanged once. A layer whose projection is narrower
than its input (SAGE and GCN with ``out < in``, GAT with ``heads x out < in``: the last layer
of a SAGE 64-47 model) exchanges that projection instead, computed by every rank on its own
rows, with every provider (:func:`halo_layers`, the one rule: a halo cache keeps the same rows):
fewer bytes on the wire, no halo row projected by its receiver, and no ``[num_local, in]`` input
to keep. The loss is the mean over
all training vertices of the whole graph (sum of the local losses / global
training count), so the allreduce **sums** the per-rank partial gradients: the
step equals single-process full-graph training up to floating-point order.
``train.grad_reduce`` does not apply (it is a minibatch setting).

With ``fullgraph.offload`` the rank runs :class:`~hpcgnn.engine.offload.OffloadedPasses`
instead (HongTu: host-resident layer data, chunks streamed through the device).

With ``fullgraph.halo = "cached"`` and/or ``fullgraph.pipeline`` the in-memory runner fetches
halo rows through a :class:`~hpcgnn.comm.halo_cached.CachedHalo` (CaPGNN's JACA cache with the
hard staleness bound ``fullgraph.staleness``, PipeGCN-style pipelining; docs/capgnn.md), which
keeps per layer the rows the exact exchange would send (the input or the projection). With
the cache on, layer 0's halo features are not fetched at start-up but through the cache (each
cached row sent once, the rest every epoch); evaluation stays exact. Its per-layer figures
(ages of the halo rows used, tier hits, bytes with and without the cache) go into the run file
as ``per_layer/halo_*`` and counters ``halo_fwd_bytes``, ``halo_fwd_nocache_bytes``, ... The
cache is soft state: a resumed run starts it cold (first epoch fetches fresh).

Vertex data comes from the rank's vertex data store (:mod:`hpcgnn.store`, built by
:func:`~hpcgnn.store.rank.build_rank_store` as the minibatch engine does; ``store.device_memory``:
host-only, tiered or device-only, docs/store.md): the block structure is the graph store's CSR,
and layer 0's solid input rows are gathered through the feature store at every use (every
forward that reads them, training and evaluation; recomputations of the offloaded backward
too); the halo rows of layer 0 are exchanged once and held by the runner. With layer 0's
aggregate cached (SAGE, GCN) only the update reads features: SAGE's destination rows (gathered
per forward), GCN none. Every layout gives the same rows, so the same losses; counters
``store_*`` per epoch (training and evaluation reads) say how many rows the device tier served.

Per epoch the run file gets timings (forward, backward, allreduce, update, eval, halo) and
counters per rank: ``halo_bytes`` (sent), ``peak_device_bytes`` and, offloaded, the
host<->device bytes by kind (``h2d_rows_bytes`` = source rows of the chunks,
``h2d_rows_nodedup_bytes`` = what the same passes would move without deduplication, ...);
counters include the evaluation pass when the epoch evaluates. The chunk plan of every rank
(chunks, schedule, Eq. 4 volumes) is the run attribute ``fullgraph_plans``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hpcgnn.comm.halo import ExactHalo, HaloPlan, HaloProvider
from hpcgnn.comm.halo_cached import CacheSettings, CachedHalo, uses_cached_halo
from hpcgnn.engine.hooks import TrainHooks
from hpcgnn.engine.loop import Engine, EpochResult
from hpcgnn.engine.offload import ModelLayerOps, OffloadedPasses, OffloadSettings
from hpcgnn.engine.transfer import TransferCounter
from hpcgnn.run.memory import DeviceMemoryMeter
from hpcgnn.upload import upload


@dataclass
class LocalGraph:
    """One rank's share of the graph for full-graph training.

    x0       float [num_local, F] host features of solid then halo vertices (an in-memory
             runner that caches layer 0's aggregate may release the rows it does not read:
             :meth:`InMemoryFullGraph.release_graph_inputs`)
    degree   int64 [num_local]   full-graph degree of every local vertex
    labels   int64 [num_solid]; masks: bool [num_solid] per split
    features the rank's :class:`~hpcgnn.store.base.FeatureStore` of the solid rows, or None;
             when set, the runners read layer 0's solid rows through it (x0's are a setup copy)
    """

    num_solid: int
    num_local: int
    indptr: np.ndarray
    local_indices: np.ndarray
    halo: HaloPlan
    x0: torch.Tensor
    degree: np.ndarray
    labels: torch.Tensor
    masks: dict
    features: object = None


def build_local_graph(part, comm, fetch_halo: bool = True, store=None) -> LocalGraph:
    """Collective (``comm``: the data plane, a :class:`~hpcgnn.comm.communicator.Communicator`,
    or None on one process): the rank's block structure, and its features with the halo rows
    fetched once (layer 0's input never changes; ``fetch_halo`` False leaves them zero: a halo
    cache fetches them). ``store``: the rank's :class:`~hpcgnn.store.rank.RankStore`; the topology and the
    solid rows are then read from it and the runners gather layer 0's solid rows through its
    feature store; None: from ``part``."""
    from hpcgnn.store.base import feature_tensor

    plan = HaloPlan.from_partition(part, comm)
    if store is None:
        solid = feature_tensor(part.features)        # as stored (float32, float16 or bfloat16)
        indptr, local_indices = part.local_csr()
    else:
        solid = store.features.full_rows()
        indptr, local_indices = store.graph.csr()
    x0 = torch.empty((part.num_local, solid.shape[1]), dtype=torch.float32)
    x0[:part.num_solid] = solid     # cast to float32 (exact)
    x0[part.num_solid:] = 0.0       # stays zero without peers (comm None: the caller fills it)
    exact = ExactHalo(comm, plan)
    if fetch_halo and exact.distributed:
        # the halo rows travel as the store holds them (2 bytes a value for half precision)
        x0[part.num_solid:] = exact.fetch_tensor(0, solid).reshape(-1, solid.shape[1])
    return LocalGraph(num_solid=part.num_solid, num_local=part.num_local, indptr=indptr,
                      local_indices=local_indices, halo=plan, x0=x0, degree=part.local_degree(),
                      features=None if store is None else store.features,
                      labels=torch.from_numpy(np.asarray(part.labels, dtype=np.int64)),
                      masks={"train": torch.from_numpy(np.asarray(part.train_mask, dtype=bool)),
                             "val": torch.from_numpy(np.asarray(part.val_mask, dtype=bool)),
                             "test": torch.from_numpy(np.asarray(part.test_mask, dtype=bool))})


def masked_loss_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of the masked rows (0 when the mask is empty)."""
    idx = upload(mask.nonzero().squeeze(1), logits.device)
    return F.cross_entropy(logits.index_select(0, idx), upload(labels, logits.device).index_select(0, idx),
                           reduction="sum")


class InMemoryFullGraph:
    """The whole partition on the device; halo exchange between layers (autograd through it)."""

    def __init__(self, model, graph: LocalGraph, comm, device, halo: HaloProvider | None = None,
                 cache_layer0: bool = True):
        from hpcgnn.sampling.block import Block

        self.model, self.graph = model, graph
        self.halo = halo if halo is not None else ExactHalo(comm, graph.halo)
        self.device = torch.device(device)
        self.ops = ModelLayerOps(model, graph.degree)
        host_block = Block(graph.num_local, graph.num_solid, torch.from_numpy(graph.indptr),
                           torch.from_numpy(graph.local_indices))
        if self.device.type != "cpu":
            # backward's transpose: built once on the host by the native counting sort and copied
            # with the block, not sorted on the device in the first backward (a sort's buffers
            # and a per-edge destination vector, several bytes per edge beside the activations)
            if self.ops.edge_weighted:
                host_block.transpose()
            else:
                host_block.drop_edge_ids()      # built without its edge ids (SAGE, GCN): 8 bytes an edge
        self.block = host_block.to(self.device)
        self.ctx = self.ops.chunk_context(np.arange(graph.num_local), 0, graph.num_solid, self.device)
        self.x0 = graph.x0.to(self.device)
        self.features = graph.features      # with a feature store x0 ends up holding halo rows only
        self.meter = DeviceMemoryMeter(self.device, rss=False)   # device accounting; the timer's meter has RSS
        # a cache fetches layer 0's halo rows too (x0's halo rows are not held)
        self.fetch_x0 = isinstance(self.halo, CachedHalo) and self.halo.settings.cache
        # layers l >= 1 exchange their projection instead of their input where the layer says so
        # (SAGE, GAT: narrower; GCN: always, its source rows), exact or cached alike (a cache
        # keeps those rows); layer 0's halo rows are the partition's features
        self.exchange_projection = [projection for projection, _ in halo_layers(model)]
        # Layer 0's aggregation reads only the features, which never change (no dropout before
        # layer 0): a cacheable layer 0 (SAGE, GCN) aggregates them once, and every forward runs
        # only its update (conv.update_from_aggregate). Not with a halo cache, whose layer-0
        # fetches are part of its protocol and counters.
        self.agg0: torch.Tensor | None = None
        self.cache_agg0 = cache_layer0 and self.ops.can_cache(0) and not self.fetch_x0
        if self.cache_agg0:
            # aggregate now and keep only the solid rows of the features: the halo rows (often
            # more than the solid ones) are read by this aggregation alone. ``graph.x0`` is the
            # caller's; FullGraphEngine drops it (``release_graph_inputs``).
            ns = graph.num_solid
            with torch.no_grad():
                self.agg0 = self.ops.aggregate(0, self.block, self.x0, self.ctx)
            if self.features is not None or not self.ops.update_needs_dst(0):
                self.x0 = self.x0.new_empty((0, self.x0.shape[1]))
            elif self.x0.shape[0] > ns:
                self.x0 = self.x0[:ns].clone()
        elif self.features is not None:
            # the solid rows are the store's; a halo cache fetches the halo rows itself
            ns = graph.num_solid
            self.x0 = self.x0.new_empty((0, self.x0.shape[1])) if self.fetch_x0 else self.x0[ns:].clone()

    def release_graph_inputs(self, graph: LocalGraph) -> None:
        """Let ``graph`` hold this runner's rows instead of all of its own (the runner keeps
        only what it reads: with layer 0's aggregate cached, the solid feature rows, or none;
        on a GPU the host copy keeps no rows, only its width; with a feature store it keeps none).
        On the CPU then build backward's transpose without its edge ids (SAGE, GCN: 8 bytes an
        edge; its counting sort holds them while it runs), once the feature rows of the halo
        are gone, not beside them and not in the first backward. A runner used without this
        call builds it in its first backward, edge ids kept."""
        if self.features is not None:
            graph.x0 = torch.empty((0, self.x0.shape[1]), dtype=self.x0.dtype)
        elif self.cache_agg0:
            graph.x0 = self.x0 if self.x0.device.type == "cpu" else \
                torch.empty((0, self.x0.shape[1]), dtype=self.x0.dtype)
        if self.device.type == "cpu" and not self.ops.edge_weighted:
            self.block.drop_edge_ids()

    def _layer0(self) -> torch.Tensor:
        """Layer 0's output rows [num_solid, ...] from the cached aggregate of the features."""
        x_dst = self._solid_rows() if self.ops.update_needs_dst(0) else None
        return self.ops.update(0, self.block, x_dst, self.agg0, self.ctx)

    def _solid_rows(self) -> torch.Tensor:
        """Layer 0's input rows of the solid vertices (gathered through the feature store)."""
        if self.features is None:
            return self.x0[:self.graph.num_solid]
        return self.features.gather_all()      # the store holds exactly the solid rows, in order

    def _input_rows(self) -> torch.Tensor:
        """Layer 0's input [num_local, F] (solid rows only when a halo cache fetches the rest)."""
        if self.features is None:
            return self.x0
        solid = self._solid_rows()
        return torch.cat([solid, self.x0]) if self.x0.shape[0] else solid

    def logits(self) -> torch.Tensor:
        """Forward over all layers: [num_solid, C] (autograd graph when grad is enabled)."""
        h = None
        for l in range(self.ops.num_layers):
            if l == 0 and self.cache_agg0:
                h = self._layer0()
                continue
            if self.exchange_projection[l]:
                # each rank projects its own rows; the narrower projection is exchanged
                p = self.halo.exchange(l, self.ops.project(l, h, self.ctx))
                h = self.ops.forward_from_projection(l, self.block, p, self.ctx, x_dst=h)
                del p       # not kept by backward: freed before the next layer's exchange
                continue
            # the solid rows before their halo exchange: a layer that reads its own rows (SAGE)
            # keeps these for backward (dropout keeps them anyway), not a view of the exchanged
            # [num_local, w] rows, which are then freed once aggregated
            solid = None
            if l > 0:
                solid, h = h, self.halo.exchange(l, h)
            elif self.fetch_x0:
                solid = self._input_rows()[:self.graph.num_solid]
                h = self.halo.exchange(0, solid)
            else:
                h = self._input_rows()
            h = self.ops.forward(l, self.block, h, self.ctx, x_dst=solid)
        return h

    def train_step(self, timer, n_train: float) -> float:
        """Forward, loss (global mean), backward; returns this rank's loss sum."""
        g = self.graph
        with self.meter.scope():
            self.meter.track(self.x0)
            with timer.phase("forward"):
                logits = self.logits()
                loss_sum = masked_loss_sum(logits, g.labels, g.masks["train"])
        with timer.phase("backward"):
            (loss_sum / n_train).backward()
        return float(loss_sum.detach())

    @torch.no_grad()
    def predict(self) -> torch.Tensor:
        """Logits [num_solid, C]; exact (the provider's exact mode: a cached one exchanges hidden
        layers exactly, and evaluation's bytes do not count as training's)."""
        with self.halo.exact_mode():
            return self.logits().cpu()

    def begin_epoch(self, epoch: int) -> None:
        self.halo.begin_epoch(epoch)

    def counters(self) -> dict:
        return {"halo_bytes": float(self.halo.stats.get("halo_bytes", 0)),
                "peak_device_bytes": float(self.meter.peak_bytes), **self.halo.epoch_report()[0]}

    def per_layer(self) -> dict:
        return self.halo.epoch_report()[1]

    def timings(self) -> dict:
        return self.halo.timing_report()

    def reset_stats(self) -> None:
        self.halo.reset_stats()
        self.meter.reset()

    def close(self) -> None:
        self.halo.close()


class OffloadedFullGraph:
    """HongTu-style offloaded training of the rank's partition (see :mod:`hpcgnn.engine.offload`)."""

    def __init__(self, model, graph: LocalGraph, comm, device, settings: OffloadSettings,
                 halo: HaloProvider | None = None):
        # (the halo cache and the pipeline are refused with offload: run/engines/fullgraph.validate)
        self.model, self.graph = model, graph
        self.halo = halo if halo is not None else ExactHalo(comm, graph.halo)
        self.device = torch.device(device)
        self.ops = ModelLayerOps(model, graph.degree)
        self.counter = TransferCounter()
        self.meter = DeviceMemoryMeter(self.device, rss=False)   # device accounting; the timer's meter has RSS
        self.engine = OffloadedPasses(self.ops, graph.indptr, graph.local_indices, graph.num_solid,
                                    graph.num_local, graph.x0, self.halo, self.device, settings,
                                    self.counter, self.meter, features=graph.features)

    def release_graph_inputs(self, graph: LocalGraph) -> None:
        """With a feature store the engine holds the halo rows of layer 0 only: ``graph`` keeps
        no rows either (only their width)."""
        if graph.features is not None:
            graph.x0 = graph.x0.new_empty((0, graph.x0.shape[1]))

    def train_step(self, timer, n_train: float) -> float:
        g = self.graph
        with timer.phase("forward"):
            logits = self.engine.forward(training=True).detach().clone().requires_grad_(True)
            loss_sum = masked_loss_sum(logits, g.labels, g.masks["train"])
        with timer.phase("backward"):
            (loss_sum / n_train).backward()
            self.engine.backward(logits.grad)
        return float(loss_sum.detach())

    @torch.no_grad()
    def predict(self) -> torch.Tensor:
        return self.engine.forward(training=False).clone()

    def counters(self) -> dict:
        out = {k: float(v) for k, v in self.counter.as_dict().items()}
        out["halo_bytes"] = float(self.halo.stats.get("halo_bytes", 0))
        out["peak_device_bytes"] = float(self.meter.peak_bytes)
        return out

    def timings(self) -> dict:
        return {"halo": float(self.halo.stats.get("halo_s", 0.0))}

    def reset_stats(self) -> None:
        self.counter.reset()
        self.halo.reset_stats()
        self.meter.reset()

    def begin_epoch(self, epoch: int) -> None:
        pass

    def per_layer(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def plan_attrs(self) -> dict:
        """Chunking and schedule facts for the run file (this rank)."""
        e = self.engine
        vols = {k: vars(v) for k, v in e.candidate_volumes.items()}
        return {"chunks": e.num_chunks, "batches": len(e.schedule.batches), "schedule": e.schedule.method,
                "modes": e.modes, "capacity_rows": e.plan.capacity, "volumes": vols,
                "predicted_h2d_rows_per_layer_pass": e.predicted_h2d_rows()}


def halo_layers(model) -> list[tuple[bool, int]]:
    """Per layer of ``model`` (a :class:`~hpcgnn.nn.models.GNN`), what the halo exchange sends,
    exact or cached alike: ``(projection, width)`` (:func:`hpcgnn.nn.conv.halo_exchange_width`)."""
    from hpcgnn.nn.conv import halo_exchange_width

    return [halo_exchange_width(conv, l) for l, conv in enumerate(model.layers)]


def cache_settings(cfg) -> CacheSettings:
    """The ``[fullgraph]`` cache keys as :class:`~hpcgnn.comm.halo_cached.CacheSettings`."""
    from hpcgnn.run.engines.fullgraph import cache_bytes

    fg = cfg.fullgraph
    return CacheSettings(cache=fg.halo == "cached", staleness=fg.staleness, pipeline=fg.pipeline,
                         budget_bytes=cache_bytes(fg.cache_memory, "fullgraph.cache_memory"),
                         device_bytes=cache_bytes(fg.cache_device_memory, "fullgraph.cache_device_memory"),
                         precision=fg.halo_precision)


def make_runner(cfg, model, graph: LocalGraph, comm, device):
    """The in-memory or the offloaded runner, as ``cfg.fullgraph.offload`` says (in memory with a
    :class:`~hpcgnn.comm.halo_cached.CachedHalo` when the config asks for one; collective then)."""
    fg = cfg.fullgraph
    if fg.offload:
        settings = OffloadSettings(chunks=fg.chunks, batch_chunks=fg.batch_chunks, dedup=fg.dedup,
                                   order=fg.order, recompute=fg.recompute)
        return OffloadedFullGraph(model, graph, comm, device, settings)
    if uses_cached_halo(cfg):
        widths = [w for _, w in halo_layers(model)]
        halo = CachedHalo(comm, graph.halo, cache_settings(cfg), widths, device)
        return InMemoryFullGraph(model, graph, comm, device, halo=halo)
    return InMemoryFullGraph(model, graph, comm, device,
                             halo=ExactHalo(comm, graph.halo, precision=fg.halo_precision))


class FullGraphEngine(Engine):
    """The full-graph engine on one rank (collective constructor); the shared loop
    (:func:`hpcgnn.engine.loop.fit`) runs its epochs."""

    def __init__(self, cfg, rt, out, hooks: TrainHooks | None = None):
        from hpcgnn.comm.allreduce import GradientAllreduce, allreduce_sum
        from hpcgnn.engine.device import resolve_device
        from hpcgnn.engine.model import build_model_from_config, build_optimizer
        from hpcgnn.run.timer import PhaseTimer
        from hpcgnn.errors import InputError
        from hpcgnn.partition.store import load_partition

        self.cfg, self.rt, self.out = cfg, rt, out
        self.hooks = hooks or TrainHooks()
        from hpcgnn.store.graph import HostGraphStore
        from hpcgnn.store.rank import build_rank_store

        error, part, store = None, None, None
        try:
            part = load_partition(cfg.data.partitions, rt.rank, out.meta, verify=cfg.data.verify,
                                  features=cfg.store.features, indices="local")
            device = resolve_device(cfg, rt)
            # the rank's vertex data store: every row is read in every pass (no sampler)
            store = build_rank_store(cfg, part, HostGraphStore(*part.local_csr(), part.num_solid, part.num_local),
                                     None, device, None, 0, 0, [], 0, rt.rank, threads=rt.threads,
                                     available=rt.store_device_available)
        except InputError as exc:
            error = str(exc)
        rt.agree(error)
        self.device = device
        self.store = store
        self.timer = PhaseTimer(sync_cuda=device.type == "cuda", cuda_device=device)
        t0 = time.perf_counter()
        from hpcgnn.comm.data_plane import make_communicator

        # the data plane: every halo exchange and the parameter broadcast
        self.data_plane = make_communicator(rt, cfg.runtime.backend, device)
        self.graph = graph = build_local_graph(part, self.data_plane, fetch_halo=cfg.fullgraph.halo != "cached",
                                               store=store)
        del part            # the store holds the rows (and the topology) from here on
        self.model = build_model_from_config(cfg, int(graph.x0.shape[1]), out.meta.num_classes, rt, device)
        self.optimizer = build_optimizer(cfg, self.model)
        error, runner = None, None
        try:
            runner = make_runner(cfg, self.model, graph, self.data_plane, device)
        except InputError as exc:
            error = str(exc)
        rt.agree(error)
        self.runner = runner
        self.timer.memory = runner.meter     # the rank's one meter: the runner counts its device tensors
        runner.release_graph_inputs(graph)
        # sum of the partial gradients of the global mean loss; buckets start during backward on
        # a duplicate of the data plane (the halo adjoints are collectives of their own), once
        # each gradient has had the accumulations the first step counted (offloaded: per chunk)
        self.reducer = GradientAllreduce(self.model, self.data_plane.duplicate(),
                                         op="sum", accumulations="learn")
        self.n_train = float(allreduce_sum(rt, [int(graph.masks["train"].sum())])[0])
        if self.n_train == 0:
            rt.agree(f"{cfg.data.partitions}: the graph has no training vertices")
        setup_s = time.perf_counter() - t0
        plan = runner.plan_attrs() if isinstance(runner, OffloadedFullGraph) else {}
        plans = rt.comm.gather(plan, root=0)
        fg = cfg.fullgraph
        out.set_attrs(fullgraph_mode="offload" if cfg.fullgraph.offload else "in-memory",
                      fullgraph_halo=fg.halo, fullgraph_pipeline=bool(fg.pipeline),
                      fullgraph_staleness=int(fg.staleness), fullgraph_halo_precision=fg.halo_precision,
                      fullgraph_grad_reduce="sum of partial gradients of the global mean loss",
                      device=str(device), setup_seconds=setup_s, store_mode=store.features.name,
                      store_placement=rt.comm.allgather(store.summary()) if rt.size > 1 else [store.summary()],
                      **({"fullgraph_plans": plans} if cfg.fullgraph.offload and rt.is_root else {}))

    def train_epoch(self, epoch: int) -> EpochResult:
        from hpcgnn.comm.allreduce import allreduce_sum

        timer, runner = self.timer, self.runner
        with timer.phase("housekeeping"):     # per-epoch set-up, so the phases cover the epoch
            runner.reset_stats()
            self.store.reset_counters()
            runner.begin_epoch(epoch)
            self.optimizer.zero_grad(set_to_none=True)
            self.hooks.before_step(epoch, 0)
            self.reducer.begin()
        loss_local = runner.train_step(timer, self.n_train)
        with timer.phase("allreduce"):
            self.reducer(loss_local, epoch)     # raises on a non-finite loss or gradient
        with timer.phase("update"):
            self.optimizer.step()
        with timer.phase("housekeeping"):     # the global loss (collective)
            loss = float(allreduce_sum(self.rt, [loss_local])[0] / self.n_train)
        self.hooks.after_step(epoch, 0, loss_local, int(self.graph.masks["train"].sum()), self.model)
        # gradient buckets whose allreduce started during backward (0 in the first, counting, epoch)
        return EpochResult(loss, counters={"allreduce_buckets_in_backward": float(self.reducer.started_in_backward)})

    def finish_epoch(self, result: EpochResult) -> None:
        """The runner's and the store's counters and halo time, which include the evaluation
        pass when the epoch evaluated."""
        result.counters.update(self.runner.counters())
        result.counters.update(self.store.counters.as_dict())
        result.counters["store_predicted_feature_hit_rate"] = self.store.predicted_hit_rate
        timings = self.runner.timings()
        result.timings.update(timings)
        result.timing_parents.update({k: HALO_TIMING_PARENTS[k] for k in timings})
        result.per_layer.update(self.runner.per_layer())

    def close(self) -> None:
        """Collective: a cached halo completes its pipelined messages and frees its communicator."""
        self.runner.close()
        self.store.close()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        from hpcgnn.engine.metrics import accuracy_metrics, split_counts

        g = self.graph
        pred = self.runner.predict().argmax(1)
        correct, total = split_counts(pred, g.labels, {k: g.masks[k] for k in ("train", "val", "test")})
        return accuracy_metrics(self.rt, correct, total)


# The runners' halo timings: ``halo`` is every exchange of the epoch (forward, backward and the
# evaluation's), ``halo_wait`` / ``halo_adjoint`` (the cached halo's) its forward waits and its
# gradient exchanges.
HALO_TIMING_PARENTS = {"halo": "forward+backward+eval", "halo_wait": "forward", "halo_adjoint": "backward"}


def make_engine(cfg, rt, out, hooks: TrainHooks | None = None) -> FullGraphEngine:
    """Collective: the full-graph engine of this rank (registry factory)."""
    return FullGraphEngine(cfg, rt, out, hooks)
