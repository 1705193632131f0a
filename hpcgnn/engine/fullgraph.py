"""Exact full-graph training: one partition per rank, every layer over all in-neighbours.

Each rank holds its partition as one block (sources = solid + halo vertices,
destinations = solid vertices). Before every layer after the first, the halo
rows are fetched from their owners by an all-to-all (:func:`halo_exchange`,
whose backward sends the halo gradients back and sums them into the owners'
rows); layer 0's halo features are exchanged once. The loss is the mean over
all training vertices of the whole graph (sum of the local losses / global
training count), so the allreduce **sums** the per-rank partial gradients: the
step equals single-process full-graph training up to floating-point order.
``train.grad_reduce`` does not apply (it is a minibatch setting).

With ``fullgraph.offload`` the rank runs :class:`~hpcgnn.engine.offload.OffloadEngine`
instead (HongTu: host-resident layer data, chunks streamed through the device).

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

from hpcgnn.comm.halo import HaloPlan, exchange_rows, halo_exchange
from hpcgnn.engine.offload import ModelLayerOps, OffloadEngine, OffloadSettings
from hpcgnn.engine.transfer import DeviceMemoryMeter, TransferCounter


@dataclass
class LocalGraph:
    """One rank's share of the graph for full-graph training.

    x0       float [num_local, F] host features of solid then halo vertices
    degree   int64 [num_local]   full-graph degree of every local vertex
    labels   int64 [num_solid]; masks: bool [num_solid] per split
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


def build_local_graph(part, comm) -> LocalGraph:
    """Collective: the rank's block structure, and its features with the halo rows fetched once."""
    plan = HaloPlan.from_partition(part, comm)
    feats = np.ascontiguousarray(part.features, dtype=np.float32)
    halo_feats = exchange_rows(comm, plan, feats) if comm is not None and comm.Get_size() > 1 \
        else feats[:0]
    x0 = torch.from_numpy(np.concatenate([feats, halo_feats.reshape(-1, feats.shape[1])]))
    indptr, local_indices = part.local_csr()
    return LocalGraph(num_solid=part.num_solid, num_local=part.num_local, indptr=indptr,
                      local_indices=local_indices, halo=plan, x0=x0, degree=part.local_degree(),
                      labels=torch.from_numpy(np.asarray(part.labels, dtype=np.int64)),
                      masks={"train": torch.from_numpy(np.asarray(part.train_mask, dtype=bool)),
                             "val": torch.from_numpy(np.asarray(part.val_mask, dtype=bool)),
                             "test": torch.from_numpy(np.asarray(part.test_mask, dtype=bool))})


def masked_loss_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of the masked rows (0 when the mask is empty)."""
    idx = mask.nonzero().squeeze(1).to(logits.device)
    return F.cross_entropy(logits.index_select(0, idx), labels.to(logits.device).index_select(0, idx),
                           reduction="sum")


class InMemoryFullGraph:
    """The whole partition on the device; halo exchange between layers (autograd through it)."""

    def __init__(self, model, graph: LocalGraph, comm, device):
        from hpcgnn.sampling.block import Block

        self.model, self.graph, self.comm = model, graph, comm
        self.device = torch.device(device)
        self.ops = ModelLayerOps(model, graph.degree)
        self.block = Block(graph.num_local, graph.num_solid, torch.from_numpy(graph.indptr),
                           torch.from_numpy(graph.local_indices)).to(self.device)
        self.ctx = self.ops.chunk_context(np.arange(graph.num_local), 0, graph.num_solid, self.device)
        self.x0 = graph.x0.to(self.device)
        self.meter = DeviceMemoryMeter(self.device)
        self.stats: dict = {}

    def logits(self) -> torch.Tensor:
        """Forward over all layers: [num_solid, C] (autograd graph when grad is enabled)."""
        h = self.x0
        for l in range(self.ops.num_layers):
            if l > 0:
                h = halo_exchange(h, self.comm, self.graph.halo, self.stats)
            h = self.ops.forward(l, self.block, h, self.ctx)
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
        return self.logits().cpu()

    def counters(self) -> dict:
        return {"halo_bytes": float(self.stats.get("halo_bytes", 0)),
                "peak_device_bytes": float(self.meter.peak_bytes)}

    def timings(self) -> dict:
        return {"halo": float(self.stats.get("halo_s", 0.0))}

    def reset_stats(self) -> None:
        self.stats.clear()
        self.meter.reset()


class OffloadedFullGraph:
    """HongTu-style offloaded training of the rank's partition (see :mod:`hpcgnn.engine.offload`)."""

    def __init__(self, model, graph: LocalGraph, comm, device, settings: OffloadSettings):
        self.model, self.graph = model, graph
        self.device = torch.device(device)
        self.ops = ModelLayerOps(model, graph.degree)
        self.counter = TransferCounter()
        self.meter = DeviceMemoryMeter(self.device)
        self.engine = OffloadEngine(self.ops, graph.indptr, graph.local_indices, graph.num_solid,
                                    graph.num_local, graph.x0, graph.halo, comm, self.device, settings,
                                    self.counter, self.meter)

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
        out["halo_bytes"] = float(self.engine.halo_stats.get("halo_bytes", 0))
        out["peak_device_bytes"] = float(self.meter.peak_bytes)
        return out

    def timings(self) -> dict:
        return {"halo": float(self.engine.halo_stats.get("halo_s", 0.0))}

    def reset_stats(self) -> None:
        self.counter.reset()
        self.engine.halo_stats.clear()
        self.meter.reset()

    def plan_attrs(self) -> dict:
        """Chunking and schedule facts for the run file (this rank)."""
        e = self.engine
        vols = {k: vars(v) for k, v in e.candidate_volumes.items()}
        return {"chunks": e.num_chunks, "batches": len(e.schedule.batches), "schedule": e.schedule.method,
                "modes": e.modes, "capacity_rows": e.plan.capacity, "volumes": vols,
                "predicted_h2d_rows_per_layer_pass": e.predicted_h2d_rows()}


def make_runner(cfg, model, graph: LocalGraph, comm, device):
    """The in-memory or the offloaded runner, as ``cfg.fullgraph.offload`` says."""
    fg = cfg.fullgraph
    if fg.offload:
        settings = OffloadSettings(chunks=fg.chunks, batch_chunks=fg.batch_chunks, dedup=fg.dedup,
                                   order=fg.order, recompute=fg.recompute)
        return OffloadedFullGraph(model, graph, comm, device, settings)
    return InMemoryFullGraph(model, graph, comm, device)


def _due(epoch: int, every: int, last: int) -> bool:
    return epoch == last or (every > 0 and epoch % every == 0)


def train(cfg, rt, out) -> None:
    """Collective: full-graph training of ``cfg`` on this job; logs through ``out``."""
    from hpcgnn.engine.common import (GradientAllreduce, PhaseTimer, accuracy_metrics, allreduce_sum,
                                      build_model_from_config, build_optimizer, resolve_device,
                                      restore_training_state, save_training_state, seed_torch,
                                      split_counts)
    from hpcgnn.errors import InputError
    from hpcgnn.partition.store import load_partition

    error, part = None, None
    try:
        part = load_partition(cfg.data.partitions, rt.rank, out.meta, verify=cfg.data.verify)
        device = resolve_device(cfg, rt)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    t0 = time.perf_counter()
    graph = build_local_graph(part, rt.comm)
    model = build_model_from_config(cfg, int(graph.x0.shape[1]), out.meta.num_classes, rt, device)
    optimizer = build_optimizer(cfg, model)
    error, runner = None, None
    try:
        runner = make_runner(cfg, model, graph, rt.comm, device)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    reducer = GradientAllreduce(model, rt, op="sum")
    n_train = float(allreduce_sum(rt, [int(graph.masks["train"].sum())])[0])
    if n_train == 0:
        rt.agree(f"{cfg.data.partitions}: the graph has no training vertices")
    setup_s = time.perf_counter() - t0
    plan = runner.plan_attrs() if isinstance(runner, OffloadedFullGraph) else {}
    plans = rt.comm.gather(plan, root=0)
    out.set_attrs(fullgraph_mode="offload" if cfg.fullgraph.offload else "in-memory",
                  fullgraph_grad_reduce="sum of partial gradients of the global mean loss",
                  device=str(device), setup_seconds=setup_s,
                  **({"fullgraph_plans": plans} if cfg.fullgraph.offload and rt.is_root else {}))
    start, _ = restore_training_state(out, model, optimizer)
    epochs = cfg.train.epochs
    masks = {k: graph.masks[k] for k in ("train", "val", "test")}
    for epoch in range(start, epochs + 1):
        timer = PhaseTimer(sync_cuda=device.type == "cuda", cuda_device=device)
        runner.reset_stats()
        seed_torch(cfg.train.seed, epoch, rt.rank)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with timer.phase("epoch"):
            loss_local = runner.train_step(timer, n_train)
            with timer.phase("allreduce"):
                reducer()
            with timer.phase("update"):
                optimizer.step()
        metrics = {"loss": float(allreduce_sum(rt, [loss_local])[0] / n_train)}
        if _due(epoch, cfg.train.eval_every, epochs):
            with timer.phase("eval"):
                model.eval()
                pred = runner.predict().argmax(1)
                correct, total = split_counts(pred, graph.labels, masks)
                metrics.update(accuracy_metrics(rt, correct, total))
        timings = dict(timer.seconds)
        timings.update(runner.timings())
        mem_counters, mem_labels = timer.memory_record()
        out.log_epoch(epoch, metrics, timings, {**runner.counters(), **mem_counters}, labels=mem_labels)
        if _due(epoch, cfg.train.checkpoint_every, epochs):
            save_training_state(out, epoch, model, optimizer)
