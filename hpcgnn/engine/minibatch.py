"""DistGNN-MB minibatch training engine (one MPI rank per partition).

Per epoch every rank runs the same number of iterations ``M = max over ranks of
ceil(local_train / batch_size)``; a rank's local training vertices (shuffled) are split into M
batches of ``local_train // M`` (+1 for the first ``local_train % M``), so ranks with fewer
training vertices run smaller (possibly empty) batches but take part in every collective.

Iteration ``k`` (DistGNN-MB §2.4): sample the minibatch inside the local partition
(:class:`~hpcgnn.sampling.neighbor.NeighborSampler`, no remote access) and drop the work no
halo row needs (:meth:`~hpcgnn.sampling.neighbor.SampledBatch.halo_last`: every frontier is
[solid vertices, halo vertices that send an edge], and a layer computes only its solid
destinations, since a halo row of the next layer's input is always replaced or dropped below;
at products-like scale 1.0 on 4 ranks a third of layer 0's rows); then before each layer ``l``
(:class:`HaloHooks`, called by the model; for ``l > 0`` it first appends the halo rows to the
layer below's output):

a. ``k >= d``: wait for the AEP message posted at layer ``l`` of iteration ``k - d`` and store
   it in HEC_l;
b. halo rows of ``h_l`` take their HEC_l value on a hit (detached: no gradient crosses ranks);
   on a miss the edges from that halo vertex leave the block (``Block.drop_sources``), so a
   mean aggregator averages over the remaining neighbours (and a destination left without
   neighbours aggregates zero);
c. ``k < M - d``: push ``h_l`` of the frontier's solid vertices that are halo elsewhere, at most
   ``minibatch.push_limit`` per destination (:class:`~hpcgnn.comm.aep.AsyncEmbeddingPush`);
d. the model computes layer ``l``.

HEC_0 holds raw input features and never expires. Then loss (cross-entropy, mean over the
rank's seeds), backward with the bucketed gradient allreduce started during it
(:class:`~hpcgnn.comm.allreduce.GradientAllreduce`: ``train.grad_reduce = mean`` weighs each
rank's gradient by its seeds in the step, so an empty or small batch does not shrink the update;
``sum`` sums), Adam step: parameters stay identical on all ranks. Every posted exchange is
received within its epoch.

Feature rows and the local topology come from the rank's store (:mod:`hpcgnn.store`, ``[store]``:
host-only, tiered or device-only; docs/store.md): the sampler reads the graph store's CSR in place,
the layer-0 input rows are gathered through the feature store, with ``store.overlap`` (and a
gather thread, T >= 4) the host rows of minibatch k + 1 are read and minibatch k + 2 is sampled
(the loader, hec/off modes) on the gather thread while k computes, and each HEC lives on the
device or the host as the placement solver decided. Every store layout and the loader give the
same rows, so the same losses; per-epoch counters ``store_*``, the phases ``sample`` (the main
thread's sampling or wait for the loader) and ``store_wait``, the timing ``sample_loader`` (the
loader's seconds, parent ``loader``: they overlap the phases). The per-epoch set-up and the
epoch's totals are the phase ``housekeeping``.

``minibatch.halo``: ``hec`` (above), ``off`` (edges from halo vertices always dropped, no
communication), ``exact`` (DistDGL-style distributed sampling and feature pull, see
:mod:`hpcgnn.comm.exact_fetch`).

Evaluation (``minibatch.eval``): ``full`` = exact layer-wise full-neighbour inference over the
whole graph (each rank computes its solid vertices layer by layer; the halo rows of every
layer's input come from their owners by alltoallv); ``sampled`` = DistDGL-style sampled
inference with the training fanouts over the whole graph for the validation and test vertices
only, in batches of ``minibatch.eval_batch_size`` seeds per rank; its train accuracy is that of
the epoch's own training minibatches (the predictions of the training forward, dropout on, each
training vertex counted once). A vertex's sampled neighbours in evaluation are keyed by
``(seed, hop, vertex)`` only (:meth:`MinibatchEngine._predict_sampled`), so its prediction does
not depend on the batch it is in. Counts are reduced to global accuracies.

Randomness is a function of integers only (so resume at an epoch boundary is exact): model
initialisation ``(seed)``; epoch order ``(seed, epoch, rank)``; sampling ``(seed, rank, epoch,
step, layer, vertex)``; dropout ``(seed, epoch, step, rank)``; AEP choice ``(seed, epoch,
step, layer, rank, destination)``. Checkpoints hold model, optimizer and torch RNG state; the
sampler position is the epoch itself. With ``minibatch.reset_cache_each_epoch = false`` the
HEC contents are not checkpointed, so a resumed run restarts with empty caches (not exact).
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from hpcgnn.comm.aep import AsyncEmbeddingPush
from hpcgnn.comm.allreduce import GradientAllreduce, allreduce_max, allreduce_sum
from hpcgnn.engine.batches import equalised_batches
from hpcgnn.engine.device import resolve_device
from hpcgnn.engine.metrics import accuracy_metrics, split_counts
from hpcgnn.engine.model import build_model_from_config, build_optimizer
from hpcgnn.run.timer import PhaseTimer
from hpcgnn.seeding import numpy_rng, stream_seed, seed_torch
from hpcgnn.engine.hooks import TrainHooks
from hpcgnn.engine.loop import Engine, EpochResult
from hpcgnn.errors import InputError
from hpcgnn.nn.conv import gcn_block_norm
from hpcgnn.upload import upload

# Stream tags of stream_seed (distinct first parts keep the streams unrelated).
_ORDER, _DROPOUT, _AEP, _SAMPLER = 1, 2, 3, 4
MISS_POLICY = "edges from missed halo sources are dropped (mean over the remaining neighbours)"


class HaloHooks:
    """``hooks.before_layer(l, h, block)`` of one iteration: HEC receive/lookup, AEP push, drops.
    The model is given the sampled host blocks: the missed halo sources are dropped on the host
    and the block that layer ``l`` runs on goes to the device here
    (:meth:`MinibatchEngine._device_block`), so that nothing of a block is decided on the device
    (a boolean selection there waits for it)."""

    def __init__(self, trainer: "MinibatchEngine", epoch: int, k: int, m: int, frontiers: list[np.ndarray]):
        self.t = trainer
        self.epoch, self.k, self.m = epoch, k, m
        self.frontiers = frontiers

    def before_layer(self, l: int, h: torch.Tensor, block):
        t = self.t
        f = self.frontiers[l]
        computed = h.shape[0]      # halo-last batches: the layer below computed the solid rows only
        tail = None                # then the halo rows, filled outside autograd and appended
        if computed < f.size:
            halo_pos = np.arange(computed, f.size)
            tail = h.new_zeros(f.size - computed, h.shape[1])
        else:
            halo_pos = np.flatnonzero(f >= t.num_solid)
        if t.halo_mode == "off":
            if tail is not None:
                h = torch.cat([h, tail])
            if block is not None and halo_pos.size:
                keep = torch.ones(block.num_src, dtype=torch.bool)
                keep[torch.from_numpy(halo_pos)] = False
                block = block.drop_sources(keep)
            return h, None if block is None else t._device_block(block)
        hec, aep, timer = t.hecs[l], t.aep, t.timer
        if self.k >= t.delay:
            ids, rows = aep.receive(l, self.k)
            with timer.phase("cache"):
                hec.store(torch.from_numpy(ids), torch.from_numpy(rows))
        if halo_pos.size:
            with timer.phase("cache"):
                tags = t.part.halo_ids[f[halo_pos] - t.num_solid]
                hit, slots = hec.lookup(torch.from_numpy(tags))
                hit_np = hit.numpy()
                t.store.count_hec(l, hit_np.size, int(hit_np.sum()), h.shape[1])
                if hit_np.any():
                    rows = upload(hec.load(slots[hit]), h.device).to(h.dtype)
                    if tail is not None:
                        tail.index_copy_(0, upload(torch.from_numpy(halo_pos[hit_np] - computed), h.device), rows)
                    else:
                        idx = upload(torch.from_numpy(halo_pos[hit_np]), h.device)
                        # the layer-0 input is a fresh gather outside autograd: fill it in place
                        # (a copy of the whole frontier's rows otherwise)
                        h = h.index_copy_(0, idx, rows) if not h.requires_grad else h.index_copy(0, idx, rows)
                missed = halo_pos[~hit_np]
            if block is not None and missed.size:
                keep = torch.ones(block.num_src, dtype=torch.bool)
                keep[torch.from_numpy(missed)] = False
                block = block.drop_sources(keep)
        if tail is not None:
            h = torch.cat([h, tail])
        if t.hooks.wants_layer_inputs:
            t.hooks.layer_input(t, self.epoch, self.k, l, f, h)
        if self.k < self.m - t.delay:
            aep.push(l, self.k, f, h, stream_seed(t.seed, _AEP, self.epoch, self.k, l, t.rt.rank))
        return h, None if block is None else t._device_block(block)


class MinibatchEngine(Engine):
    """The minibatch engine on one rank (collective constructor); the shared loop
    (:func:`hpcgnn.engine.loop.fit`) runs its epochs."""

    def __init__(self, cfg, rt, out, hooks: TrainHooks | None = None):
        from hpcgnn.partition.store import load_partition
        from hpcgnn.sampling.neighbor import NeighborSampler

        self.cfg, self.rt, self.out = cfg, rt, out
        self.hooks = hooks or TrainHooks()
        mb = cfg.minibatch
        self.seed = cfg.train.seed
        self.halo_mode = mb.halo
        self.delay = mb.push_delay
        self.fanouts = list(mb.fanouts)   # one per layer (hpcgnn.run.engines.minibatch.validate)
        part, error = None, None
        try:
            part = load_partition(cfg.data.partitions, rt.rank, out.meta, verify=cfg.data.verify,
                                  features=cfg.store.features, indices="local", local_dtype="auto")
        except InputError as exc:
            error = str(exc)
        rt.agree(error)
        self.part = part
        self.num_solid = part.num_solid
        self.device = resolve_device(cfg, rt)
        self.timer = PhaseTimer(sync_cuda=self.device.type == "cuda", cuda_device=self.device)
        from hpcgnn.comm.data_plane import make_communicator

        # the data plane (AEP pushes, exact fetches, evaluation halo, parameter broadcast)
        self.data_plane = make_communicator(rt, cfg.runtime.backend, self.device)

        from hpcgnn.store.graph import HostGraphStore

        indptr, local_indices = part.local_csr()
        self.graph = HostGraphStore(indptr, local_indices, part.num_solid, part.num_local)
        self.sampler = NeighborSampler(*self.graph.csr(), part.num_solid, self.fanouts,
                                       seed=stream_seed(self.seed, _SAMPLER, rt.rank), num_local=part.num_local)
        self.labels = torch.from_numpy(part.labels).to(self.device)
        self.train_ids = np.flatnonzero(part.train_mask).astype(np.int64)
        self.in_dim = int(part.features.shape[1])
        self.local_train = int(self.train_ids.size)
        self.num_classes = int(part.num_classes)

        self.model = build_model_from_config(cfg, self.in_dim, self.num_classes, rt, self.device)
        self.optimizer = build_optimizer(cfg, self.model)
        # buckets started during backward (which runs no collective here), mean weighted by seeds
        self.reduce_grads = GradientAllreduce(self.model, self.data_plane, cfg.train.grad_reduce)
        self.dims = [int(d) for d in self.model.in_dims]      # width of each layer's input h_l

        self.aep = None
        self.hecs = []
        rows = 0
        if self.halo_mode == "hec":
            from hpcgnn.cache.hec import HistoricalEmbeddingCache

            max_degree = allreduce_max(rt, int(part.degree.max()) if part.degree.size else 0)
            self.aep = AsyncEmbeddingPush(self.data_plane, part, cfg.model.layers, mb.push_limit,
                                          mb.push_delay, max_degree, record=self.hooks.wants_exchanges)
            # only this rank's halo vertices are ever pushed to it: no more rows than those
            rows = max(1, min(mb.cache_lines, part.num_halo))
        self.store = self._build_store(min(mb.cache_lines, part.num_halo) if self.halo_mode == "hec" else 0)
        if self.halo_mode == "hec":
            self.hecs = [HistoricalEmbeddingCache(mb.cache_lines, d, mb.cache_lifespan, never_expire=(l == 0),
                                                  device=self.store.hec_devices[l], max_rows=rows)
                         for l, d in enumerate(self.dims)]
        self._train_counts = (0, 0)    # (correct, seen) of the last epoch's training forwards
        self.fetch = None
        if self.halo_mode == "exact" or mb.eval == "sampled":
            from hpcgnn.comm.exact_fetch import ExactFetch

            self.fetch = ExactFetch(self.data_plane, part, out.meta.part_offsets, self.fanouts, self.seed,
                                    csr=self.graph.csr(), features=self.store.features, sampler=self.sampler)
        self.halo_plan = None
        if mb.eval == "full":
            from hpcgnn.comm.halo import HaloPlan

            error = None
            try:
                self.halo_plan = HaloPlan.from_partition(part, self.data_plane)
            except InputError as exc:
                error = str(exc)
            rt.agree(error)
        out.set_attrs(halo_mode=self.halo_mode, miss_policy=MISS_POLICY if self.halo_mode == "hec" else "",
                      eval_method=("full-neighbour layer-wise inference over the whole graph "
                                   "(exact; halo rows exchanged per layer)" if mb.eval == "full" else
                                   "sampled inference with the training fanouts over the whole graph "
                                   "(DistDGL-style distributed sampling) of the validation and test "
                                   "vertices; train accuracy from the epoch's training minibatches "
                                   "(dropout on)"),
                      layer_input_dims=self.dims, num_train=int(allreduce_sum(rt, [self.train_ids.size])[0]))
        placements = rt.comm.allgather(self.store.summary()) if rt.size > 1 else [self.store.summary()]
        out.set_attrs(store_mode=self.store.features.name, store_placement=placements,
                      store_predicted_hit_rate=[p.get("placement", {}).get("predicted", {}).get(
                          "feature_hit_rate", 1.0 if p["mode"] == "device" else 0.0) for p in placements],
                      # per rank: OpenMP teams while a gather is in flight (0: no gather thread)
                      store_gather_threads=[p["gather_threads"] for p in placements],
                      store_compute_threads=[p["compute_threads"] for p in placements])

    def _build_store(self, hec_lines: int):
        """Collective: this rank's store (:func:`hpcgnn.store.rank.build_rank_store`); the
        placement pre-samples with this epoch's batch size."""
        from hpcgnn.store.rank import build_rank_store

        rt, cfg = self.rt, self.cfg
        m = allreduce_max(rt, math.ceil(self.local_train / cfg.minibatch.batch_size) if self.local_train else 0)
        batch = math.ceil(self.local_train / m) if m else 0
        store, error = None, None
        try:
            store = build_rank_store(cfg, self.part, self.graph, self.sampler, self.device, self.train_ids,
                                     batch, m, self.dims, hec_lines, rt.rank, threads=rt.threads,
                                     available=rt.store_device_available)
        except InputError as exc:
            error = str(exc)
        rt.agree(error)
        return store

    # ---- training ---------------------------------------------------------------
    def checkpoint_extra(self, epoch: int) -> dict:
        return {"next_epoch": epoch + 1, "halo_mode": self.halo_mode}

    def close(self) -> None:
        if self.aep is not None:
            self.aep.close()
        self.store.close()

    def train_epoch(self, epoch: int) -> EpochResult:
        cfg, rt, timer = self.cfg, self.rt, self.timer
        with timer.phase("housekeeping"):     # per-epoch set-up (collective: equalised_batches)
            if self.aep is not None:
                self.aep.reset_counters(epoch)
                for hec in self.hecs:
                    if cfg.minibatch.reset_cache_each_epoch:
                        hec.clear()
                    hec.reset_stats()
            if self.fetch is not None:
                self.fetch.reset_counters()
            self.store.reset_counters()
            order = numpy_rng(self.seed, _ORDER, epoch, rt.rank).permutation(self.train_ids)
            m, sizes = equalised_batches(order.size, cfg.minibatch.batch_size, rt)
            if m == 0:
                raise InputError(f"{cfg.data.partitions}: no training vertices in any partition")
            bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        loss_sum, seen, sampled_edges, inputs, halo_inputs = 0.0, 0, 0, 0, 0
        train_correct = 0       # sampled evaluation's train accuracy: a device tensor, read once
        count_correct = cfg.minibatch.eval == "sampled"
        overlapped = 0          # gradient buckets started during backward, over the epoch's steps
        hooks = self.hooks
        overlap = self.store.prefetch.loader     # sampling ahead on the worker thread
        self._loader_seconds = 0.0
        nxt, loading = None, None
        try:
            for k in range(m):
                with timer.phase("housekeeping"):
                    hooks.before_step(epoch, k)
                    seeds = order[bounds[k]:bounds[k + 1]]
                    seed_torch(self.seed, _DROPOUT, epoch, k, rt.rank)
                with timer.memory.scope():    # the step's tensors kept for backward (CPU: counted)
                    if self.halo_mode == "exact":
                        logits, y, stats = self._forward_exact(seeds, epoch, k)
                    else:
                        cur = nxt if k > 0 and overlap else self._prepare(seeds, epoch, k)
                        # overlap: minibatch k + 1 (sampled by the loader while k - 1 computed) is
                        # counted and its rows' read submitted, then the loader samples k + 2,
                        # both on the gather thread while k computes
                        nxt = self._prepare(order[bounds[k + 1]:bounds[k + 2]], epoch, k + 1, loading) \
                            if overlap and k + 1 < m else None
                        loading = self.store.prefetch.run(self._sample, order[bounds[k + 2]:bounds[k + 3]],
                                                          epoch, k + 2) if overlap and k + 2 < m else None
                        logits, y, stats = self._forward_local(seeds, epoch, k, m, cur)
                        cur = None          # the forward holds what backward needs; drop the rest now
                sampled_edges += stats[0]
                inputs += stats[1]
                halo_inputs += stats[2]
                step_loss, loss = float("nan"), None
                with timer.phase("backward"):
                    self.optimizer.zero_grad(set_to_none=True)
                    self.reduce_grads.begin(0 if logits is None else int(y.shape[0]))   # this rank's seeds
                    if logits is not None:
                        loss = F.cross_entropy(logits, y)
                        loss.backward()
                        step_loss = loss.detach()     # on the device: read once per epoch, no sync here
                        loss_sum = step_loss.double() * int(y.shape[0]) + loss_sum
                        if count_correct:
                            train_correct = (logits.detach().argmax(dim=1) == y).sum() + train_correct
                        seen += int(y.shape[0])
                if self.aep is not None:
                    with timer.phase("housekeeping"):
                        self.aep.progress()
                with timer.phase("allreduce"):
                    self.reduce_grads(loss, epoch, k, m)     # raises on a non-finite loss or gradient
                overlapped += self.reduce_grads.started_in_backward
                with timer.phase("optimizer"):
                    self.optimizer.step()
                with timer.phase("housekeeping"):
                    hooks.after_step(epoch, k, step_loss, seeds.size, self.model)
        finally:
            if loading is not None:       # an exception left the loader's sampling uncollected
                try:
                    self.store.prefetch.wait(loading)
                except Exception:         # the exception in flight is the one to report
                    pass
        with timer.phase("housekeeping"):     # the epoch's totals (collective) and statistics
            if self.aep is not None:
                self.aep.assert_drained()
            timings = {}
            tot = allreduce_sum(rt, [float(loss_sum), seen])
            self._train_counts = (int(train_correct), seen)
            loss = tot[0] / tot[1] if tot[1] else float("nan")
            counters = {"iterations": m, "seeds": seen, "sampled_edges": sampled_edges,
                        "input_vertices": inputs, "halo_inputs": halo_inputs,
                        "allreduce_bytes": m * self.reduce_grads.bytes_per_call,
                        "allreduce_buckets_in_backward": overlapped}
            per_layer = {}
            if self.aep is not None:
                c = self.aep.counters
                timings["comm_wait"] = c.wait_seconds       # AEP receives and pushes run in the
                timings["push"] = c.push_seconds            # halo hooks, inside forward
                counters.update(aep_bytes_sent=c.bytes_sent, aep_bytes_received=c.bytes_received,
                                bytes_sent=c.bytes_sent, bytes_received=c.bytes_received)
                stats = [h.stats() for h in self.hecs]
                per_layer = {
                    "hec_hit_rate": np.array([s["hit_rate"] for s in stats]),
                    "hec_lookups": np.array([s["lookups"] for s in stats], dtype=np.float64),
                    "hec_hits": np.array([s["hits"] for s in stats], dtype=np.float64),
                    "hec_occupancy": np.array([s["occupancy"] / s["capacity"] for s in stats]),
                    "hec_age_mean": np.array([s["age_mean"] for s in stats]),
                    "hec_age_max": np.array([s["age_max"] for s in stats], dtype=np.float64),
                    "hec_rows_allocated": np.array([s["rows_allocated"] for s in stats], dtype=np.float64),
                    "aep_rows_sent": c.rows_sent.astype(np.float64),
                    "aep_rows_received": c.rows_received.astype(np.float64),
                    "aep_candidates": c.candidates.astype(np.float64),
                    "aep_max_rows_to_one_rank": c.max_rows_to_one_rank.astype(np.float64),
                }
            if self.fetch is not None and self.halo_mode == "exact":
                c = self.fetch.counters
                counters.update(bytes_sent=c.bytes_sent, bytes_received=c.bytes_received,
                                exact_sample_bytes_sent=c.sample_bytes_sent,
                                exact_feature_bytes_sent=c.feature_bytes_sent,
                                remote_inputs=c.remote_inputs)
            counters.setdefault("bytes_sent", 0)
            counters.setdefault("bytes_received", 0)
            counters.update(self.store.counters.as_dict())
            counters["store_predicted_feature_hit_rate"] = self.store.predicted_hit_rate
            counters["peak_device_bytes"] = float(timer.memory.peak_bytes)
        if overlap and self.halo_mode != "exact":
            timings["sample_loader"] = self._loader_seconds    # on the loader (gather) thread
        return EpochResult(loss, counters, timings, per_layer,
                           timing_parents={"comm_wait": "forward", "push": "forward", "sample_loader": "loader"})

    def _sample(self, seeds: np.ndarray, epoch: int, k: int):
        """Minibatch ``k`` sampled (halo-last in hec/off mode), or None for an empty one, and the
        seconds it took: (batch, seconds). Runs on the loader (gather) thread too: the native
        sampler releases the GIL and serialises its calls, and its draws depend on
        ``(epoch, k)`` only."""
        if seeds.size == 0:
            return None, 0.0
        t0 = time.perf_counter()
        batch = self.sampler.sample(torch.from_numpy(seeds), epoch=epoch, step=k)
        if self.halo_mode in ("hec", "off"):
            batch = batch.halo_last(self.num_solid)
        return batch, time.perf_counter() - t0

    def _prepare(self, seeds: np.ndarray, epoch: int, k: int, loading=None):
        """Minibatch ``k`` sampled, counted, and its input rows submitted to the store's
        prefetcher: (batch, read handle), or None for an empty minibatch. ``loading``: the
        loader's :meth:`_sample` of it (:meth:`Prefetcher.run`), waited for in phase ``sample``;
        None: sampled here. Counting and submitting stay on the main thread, in minibatch order."""
        if loading is None and seeds.size == 0:
            return None
        with self.timer.phase("sample"):
            if loading is None:
                batch, _ = self._sample(seeds, epoch, k)
            else:
                batch, seconds = self.store.prefetch.wait(loading)
                self._loader_seconds += seconds
            if batch is None:
                return None
            self.graph.account(self.store.counters, batch, True)
        with self.timer.phase("store_wait"):     # planning the gather is store time too
            handle = self.store.prefetch.submit(batch.frontiers[0]) if self.num_solid else None
        return batch, handle

    def _forward_local(self, seeds: np.ndarray, epoch: int, k: int, m: int, prepared=None):
        """Forward of one iteration with local sampling (hec/off); (logits, labels, stats).
        ``prepared``: :meth:`_prepare`'s result for this minibatch."""
        timer = self.timer
        if seeds.size == 0:
            # Nothing to compute, but the per-layer AEP collectives must still happen.
            with timer.phase("forward"):
                if self.halo_mode == "hec":
                    hooks = HaloHooks(self, epoch, k, m, [np.zeros(0, np.int64)] * len(self.dims))
                    for l, d in enumerate(self.dims):
                        hooks.before_layer(l, torch.zeros(0, d, device=self.device), None)
            return None, None, (0, 0, 0)
        batch, handle = prepared
        frontiers = [f.numpy() for f in batch.frontiers]
        with timer.phase("store_wait"):
            x = self._input_rows(batch.frontiers[0], handle)
        with timer.phase("forward"):
            # host blocks: the hooks drop missed halo sources there and send each layer's block
            logits = self.model(batch.blocks, x, hooks=HaloHooks(self, epoch, k, m, frontiers))
            y = self.labels[upload(batch.seeds, self.device)]
        f0 = frontiers[0]
        return logits, y, (batch.num_sampled_edges, f0.size, int((f0 >= self.num_solid).sum()))

    def _device_block(self, b):
        """Sampled host block ``b`` on the compute device: ``b`` itself on the CPU. On CUDA its
        CSR is uploaded without waiting for the device (:func:`hpcgnn.upload.upload`); its
        transpose, when backward asks for it, is built on the host (the native counting sort) and
        uploaded the same way (on the device it would be a sort and a ``bincount``, which waits);
        a GCN layer gets the block's scales from the host block for the same reason."""
        if self.device.type != "cuda":
            return b.to(self.device)
        dev = self.device
        db = b.streamed_copy(dev, copy=lambda t: upload(t, dev))
        if self.cfg.model.arch == "gcn":
            src_scale, dst_scale = gcn_block_norm(b)
            db.src_scale, db.dst_scale = upload(src_scale, dev), upload(dst_scale, dev)
        return db

    def _input_rows(self, frontier: torch.Tensor, handle) -> torch.Tensor:
        """Layer-0 input of a local frontier on the device: features of its solid vertices (the
        store's rows, read under ``handle``), zeros for its halo vertices (the hooks replace or
        drop those rows)."""
        if handle is None:
            return torch.zeros(frontier.shape[0], self.in_dim, device=self.device)
        return self.store.prefetch.get(handle)

    def _forward_exact(self, seeds: np.ndarray, epoch: int, k: int):
        """Forward with DistDGL-style distributed sampling and feature pull."""
        timer = self.timer
        part = self.part
        with timer.phase("sample"):
            batch = self.fetch.sample(seeds + part.solid_begin, epoch, k)
        with timer.phase("fetch"):
            x = self.fetch.fetch_features(batch.frontiers[0])
        if seeds.size == 0:
            return None, None, (0, 0, 0)
        with timer.phase("forward"):
            blocks = [self._device_block(b) for b in batch.blocks]
            logits = self.model(blocks, upload(torch.from_numpy(x), self.device))
        y = self.labels[upload(torch.from_numpy(seeds), self.device)]
        f0 = batch.frontiers[0]
        remote = int(((f0 < part.solid_begin) | (f0 >= part.solid_end)).sum())
        return logits, y, (sum(b.num_edges for b in batch.blocks), f0.size, remote)

    # ---- evaluation -------------------------------------------------------------
    def _masks(self) -> dict[str, torch.Tensor]:
        p = self.part
        return {"train": torch.from_numpy(p.train_mask), "val": torch.from_numpy(p.val_mask),
                "test": torch.from_numpy(p.test_mask)}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Collective: global train/val/test accuracy (see the module docstring)."""
        self.model.eval()
        try:
            if self.cfg.minibatch.eval == "full":
                pred = self._predict_full()
            else:
                pred = self._predict_sampled()
        finally:
            self.model.train()
        masks = self._masks()
        if self.cfg.minibatch.eval == "sampled":
            del masks["train"]      # counted by the epoch's training forwards
        correct, total = split_counts(pred.cpu(), self.labels.cpu(), masks)
        if self.cfg.minibatch.eval == "sampled":
            correct["train"], total["train"] = self._train_counts
        return accuracy_metrics(self.rt, correct, total)

    def _predict_full(self) -> torch.Tensor:
        """Layer-wise full-neighbour inference: predictions for all solid vertices."""
        return self.infer_full().argmax(dim=1)

    @torch.no_grad()
    def infer_full(self, num_layers: int | None = None) -> torch.Tensor:
        """Collective: exact layer-wise full-neighbour output [num_solid, width] of the first
        ``num_layers`` layers (default all: the logits), in bounded memory
        (:func:`hpcgnn.engine.inference.partition_inference`: ``minibatch.eval_rows`` destination
        rows per chunk, halo rows in ``minibatch.eval_halo_rounds`` rounds)."""
        from hpcgnn.engine.inference import partition_inference

        mb = self.cfg.minibatch
        # tiered on a GPU: the host rows stream to the device chunk by chunk (partition_inference)
        return partition_inference(self.model, self.part, self.data_plane, self.store.features.full_rows(),
                                   self.device, rows=mb.eval_rows, halo_rounds=mb.eval_halo_rounds,
                                   plan=self.halo_plan, csr=self.graph.csr(), num_layers=num_layers)

    def eval_batch_size(self) -> int:
        """Seeds per rank per batch of the sampled evaluation: ``minibatch.eval_batch_size``, or
        (0) the training batch size (a batch's fetched input rows, three hops out, are most of
        the evaluation's memory)."""
        mb = self.cfg.minibatch
        return mb.eval_batch_size or mb.batch_size

    @torch.no_grad()
    def _predict_sampled(self, ids: np.ndarray | None = None) -> torch.Tensor:
        """Collective: sampled inference over the whole graph
        (:func:`hpcgnn.engine.inference.sampled_inference`); predictions [num_solid] for the
        solid local ids ``ids`` (default: the validation and test vertices), -1 elsewhere."""
        from hpcgnn.engine.inference import sampled_inference

        part = self.part
        if ids is None:
            ids = np.flatnonzero(part.val_mask | part.test_mask).astype(np.int64)
        rows = sampled_inference(self.model, self.fetch, ids, self.eval_batch_size(), self.rt, self.device,
                                 device_block=self._device_block, argmax=True)
        pred = torch.full((part.num_solid,), -1, dtype=torch.int64)
        pred[torch.from_numpy(ids)] = rows
        return pred


def make_engine(cfg, rt, out, hooks: TrainHooks | None = None) -> MinibatchEngine:
    """Collective: the minibatch engine of this rank (registry factory)."""
    return MinibatchEngine(cfg, rt, out, hooks)
