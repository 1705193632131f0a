"""HongTu-style offloaded full-graph training of one rank's partition.

Every layer's vertex representations ``h^l`` (and in backward their gradients)
live in host memory, pinned when the device is CUDA; the partition is split
into edge-balanced chunks (:mod:`hpcgnn.engine.chunk_schedule`) that go through
the compute device one batch at a time, so the device holds one layer of one
batch: the batch's source rows, the chunk's intermediates and its outputs.

Forward, per layer: the rows a batch needs that are not already in the device
buffer are copied host->device (deduplicated, reused in place across batches),
each chunk's layer output is written back to host memory, and, for layers in
**cache** mode, so is the chunk's aggregation output ``a^l``. Between layers
the host rows of the halo are refreshed from their owners (one
:class:`~hpcgnn.comm.halo.HaloProvider` fill per layer). Backward walks layers and batches
in reverse: **recompute** mode reloads the sources and re-runs the whole layer
from its input checkpoint ``h^l`` (GAT-like layers, whose edge computation
needs the neighbours); **cache** mode loads ``a^l``, re-runs only UPDATE and
maps the aggregation gradient back to the sources through the transpose of
the (linear) aggregation, loading no neighbour rows. Source gradients
accumulate in a device buffer with the same slots as the forward rows; rows
leaving the buffer are flushed to host memory and added there (HongTu's ⊕),
then the halo gradients go back to their owners (the adjoint exchange).
Dropout masks are replayed in recomputation from the RNG state saved in
forward. The result equals in-memory training up to floating-point order.

With a feature store (:mod:`hpcgnn.store`, the rank's vertex data store) layer 0's solid source
rows are gathered through it instead of copied from ``h^0`` (device-tier hits do not cross the
link; the misses' bytes count as ``h2d_rows``/``h2d_self``), and ``h^0`` holds the halo rows only.

The model is reached through a :class:`LayerOps` adapter (see
:mod:`hpcgnn.engine.fullgraph`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hpcgnn.comm.halo import HaloProvider
from hpcgnn.engine.chunk_schedule import (Chunk, TransferPlan, Volumes, build_transfer_plan, choose_schedule,
                                          make_chunks, schedule_volumes)
from hpcgnn.engine.chunk_stream import ChunkStream
from hpcgnn.engine.transfer import TransferCounter, host_empty, host_zeros
from hpcgnn.errors import InputError
from hpcgnn.run.memory import DeviceMemoryMeter
from hpcgnn.store.mover import DeviceMover, Loaded
from hpcgnn.upload import upload


class LayerOps(Protocol):
    """What the offloaded passes need from a model (one implementation per model family).

    ``block`` is a :class:`hpcgnn.sampling.block.Block` on the compute device,
    ``x`` the chunk's source rows (destinations first), ``ctx`` the chunk's
    extra arguments (:meth:`chunk_context`).
    """

    num_layers: int
    edge_weighted: bool     # some layer weights its edges: backward reads the transposes' edge ids

    def chunk_context(self, src: np.ndarray, dst_begin: int, dst_end: int, device) -> dict: ...

    def forward(self, layer: int, block, x: torch.Tensor, ctx: dict,
                x_dst: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output rows; ``x_dst``, when given, the destinations' own rows held apart
        from ``x`` (same values as ``x[:num_dst]``), kept for backward instead of a view of ``x``."""

    def can_cache(self, layer: int) -> bool: ...

    def aggregate(self, layer: int, block, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Parameter-free, linear in ``x``: the AGGREGATE output of the destinations."""

    def update(self, layer: int, block, x_dst: torch.Tensor | None, agg: torch.Tensor,
               ctx: dict) -> torch.Tensor:
        """The rest of the layer: ``forward(x) == update(x[:num_dst], aggregate(x))``."""

    def update_needs_dst(self, layer: int) -> bool: ...

    def aggregate_adjoint(self, layer: int, block, grad_agg: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Gradient w.r.t. the sources of :meth:`aggregate` ([num_src, d])."""

    def exchanges_projection(self, layer: int) -> bool:
        """Whether the in-memory full graph exchanges :meth:`project`'s rows instead of the
        layer's input (:func:`hpcgnn.nn.conv.exchanged_width`): SAGE and GAT when the projection
        is narrower (fewer bytes, no halo row projected twice), GCN always (its source rows:
        no scaled copy of every local row)."""

    def project(self, layer: int, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Row-wise: the projection of rows ``x``, the first rows of the context's sources."""

    def forward_from_projection(self, layer: int, block, p: torch.Tensor, ctx: dict,
                                x_dst: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward` from the sources' projection ``p`` and the destinations' own rows."""


@dataclass
class OffloadSettings:
    """fullgraph.* keys: chunks per partition, chunks per batch, dedup, order, recompute mode."""

    chunks: int = 1
    batch_chunks: int = 1
    dedup: bool = True
    order: str = "cost"
    recompute: str = "auto"


def resolve_modes(ops: LayerOps, requested: str) -> list[str]:
    """Per layer 'cache' or 'recompute' ('auto': cache where the layer's aggregation is linear)."""
    modes = []
    for l in range(ops.num_layers):
        if requested == "recompute" or not ops.can_cache(l):
            modes.append("recompute")
        else:
            modes.append("cache")
    return modes


class _RngReplay:
    """RNG states saved before each chunk's forward, restored to replay its dropout masks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.states: dict = {}

    def save(self, key) -> None:
        cpu = torch.get_rng_state()
        gpu = torch.cuda.get_rng_state(self.device) if self.cuda else None
        self.states[key] = (cpu, gpu)

    @contextlib.contextmanager
    def replay(self, key):
        cpu, gpu = self.states[key]
        devices = [self.device] if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu)
            if gpu is not None:
                torch.cuda.set_rng_state(gpu, self.device)
            yield

    def clear(self) -> None:
        self.states.clear()


class OffloadedPasses:
    """One rank's chunked, host-offloaded forward and backward passes (see module docstring).

    ``x0`` is the host tensor of input features of every local vertex (solid
    then halo, [num_local, F]); the passes own host buffers for every later
    layer. ``halo`` (the rank's :class:`~hpcgnn.comm.halo.HaloProvider`) may be None on a single rank.
    ``features``: the rank's :class:`~hpcgnn.store.base.FeatureStore` of the solid rows (layer 0's
    solid rows are then read through it and only x0's halo rows are kept), or None.
    """

    def __init__(self, ops: LayerOps, indptr: np.ndarray, local_indices: np.ndarray, num_solid: int,
                 num_local: int, x0: torch.Tensor, halo: HaloProvider | None, device,
                 settings: OffloadSettings, counter: TransferCounter | None = None,
                 meter: DeviceMemoryMeter | None = None, features=None):
        from hpcgnn.sampling.block import Block

        if num_solid < 1:
            raise InputError("fullgraph.offload: this rank's partition owns no vertices")
        self.ops = ops
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.num_solid, self.num_local = int(num_solid), int(num_local)
        self.halo = halo
        self.settings = settings
        self.counter = counter or TransferCounter()
        self.meter = meter or DeviceMemoryMeter(self.device, rss=False)
        self.mover = DeviceMover(self.device, self.counter)
        self.rng = _RngReplay(self.device)
        self.chunks: list[Chunk] = make_chunks(indptr, local_indices, settings.chunks)
        row_bytes = x0.shape[1] * x0.element_size()
        self.schedule, self.candidate_volumes = choose_schedule(
            self.chunks, settings.batch_chunks, settings.order, self.num_local, row_bytes)
        self.plan: TransferPlan = build_transfer_plan(self.chunks, self.schedule, self.num_local,
                                                      dedup=settings.dedup)
        # Chunk topology and per-chunk constants stay in host memory (pinned on CUDA) and are
        # copied to the device with the chunk; on the CPU the blocks keep their cached transposes.
        self.pin = self.cuda
        self.blocks = [Block(c.num_src, c.num_dst, self._host(torch.from_numpy(c.indptr)),
                             self._host(torch.from_numpy(c.indices))) for c in self.chunks]
        if not ops.edge_weighted:
            # SAGE, GCN: the transposes without edge ids, 8 bytes an edge less in host memory
            # and in every copy of a chunk's transpose to the device
            for b in self.blocks:
                b.drop_edge_ids()
        self.contexts = [{k: self._host(v.to(x0.dtype) if v.is_floating_point() else v)
                          for k, v in ops.chunk_context(c.src, c.dst_begin, c.dst_end, "cpu").items()}
                         for c in self.chunks]
        self.modes = resolve_modes(ops, settings.recompute)
        if x0.shape[0] != self.num_local:
            raise ValueError(f"x0 has {x0.shape[0]} rows, expected {self.num_local} local vertices")
        self.features = features
        if features is not None:        # h^0: the halo rows (the solid ones are the store's)
            x0 = x0[self.num_solid:].clone() if not self.pin else x0[self.num_solid:]
        self.h: list[torch.Tensor | None] = [x0.pin_memory() if self.pin else x0] + [None] * ops.num_layers
        self.agg: list[torch.Tensor | None] = [None] * ops.num_layers
        # the chunk loop over the plan (its slot tensors built once, on the device)
        self.stream = ChunkStream(self.chunks, self.plan, self.device, self.meter)
        self._device_topology = self._resident_topology()

    # ---- reporting -------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def volumes(self) -> Volumes:
        """Eq. 4 volumes (rows per layer pass) of the schedule in use."""
        return schedule_volumes(self.chunks, self.schedule)

    def predicted_h2d_rows(self) -> int:
        """Source rows loaded per layer pass by the plan in use (V_reuse, or V_ori without dedup)."""
        return self.plan.rows_loaded()

    def host_bytes(self) -> int:
        return int(sum(t.nbytes for t in self.h + self.agg if t is not None))

    # ---- helpers -----------------------------------------------------------
    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.pin else t

    def topology_bytes(self) -> int:
        """Bytes of every chunk's CSR and context (what a resident device copy holds)."""
        return int(sum(b.indptr.nbytes + b.indices.nbytes for b in self.blocks)
                   + sum(v.nbytes for ctx in self.contexts for v in ctx.values()))

    def _resident_topology(self):
        """On CUDA, the chunks' blocks and contexts copied to the device once (counted as h2d
        ``topo``) when they fit: their bytes plus three layer buffers of the plan (rows,
        gradients, reloaded rows at the widest layer input) within the device's free memory;
        None otherwise (then :meth:`_chunk_inputs` copies them per use). None on the CPU, where
        the host blocks are used in place."""
        if not self.cuda:
            return None
        widest = max([int(np.prod(self.h[0].shape[1:]))] + [int(getattr(c, "in_dim", 0))
                                                              for c in getattr(self.ops, "convs", [])])
        need = self.topology_bytes() + 3 * self.plan.capacity * widest * self.h[0].element_size()
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > free:
            return None
        return [self._copy_inputs(c) for c in range(len(self.chunks))]

    def _copy_inputs(self, c: int):
        """Chunk ``c``'s block and context copied to the device (h2d ``topo``); the block's
        backward takes the host block's transpose (built once) instead of sorting on the device."""
        block, ctx = self.blocks[c], self.contexts[c]
        self.counter.add_h2d("topo", sum(v.nbytes for v in ctx.values()))
        return (block.streamed_copy(self.device, self.pin, lambda n: self.counter.add_h2d("topo", n)),
                {k: v.to(self.device, non_blocking=True) for k, v in ctx.items()})

    def _chunk_inputs(self, c: int):
        """Chunk ``c``'s block and context on the device: the host ones on the CPU, the
        resident copies on CUDA when they fit, else copied from host memory per use."""
        if not self.cuda:
            return self.blocks[c], self.contexts[c]
        if self._device_topology is not None:
            return self._device_topology[c]
        return self._copy_inputs(c)

    def _host_out(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        return host_empty((rows,) + tuple(like.shape[1:]), like.dtype, self.pin)


    def _load_rows(self, l: int, rows: np.ndarray, kind: str) -> Loaded:
        """Start loading layer ``l``'s input rows ``rows`` (local ids) to the device: from
        ``h^l``, or for layer 0 with a feature store the solid rows through it (only its misses'
        bytes count as ``kind``) and the halo rows from ``h^0``."""
        if l > 0 or self.features is None:
            return self.mover.load_rows(self.h[l], rows, kind)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        c = self.features.counters["feature"]
        before = c.h2d_bytes
        out = self.features.gather(torch.from_numpy(rows))      # halo ids give zero rows
        self.counter.add_h2d(kind, c.h2d_bytes - before)
        halo = np.flatnonzero(rows >= self.num_solid)
        if halo.size:
            got = self.mover.load_rows(self.h[0], rows[halo] - self.num_solid, kind).get()
            out.index_copy_(0, upload(torch.from_numpy(halo), self.device), got)
        return Loaded(out, None)

    def _count_nodedup(self, x: torch.Tensor, grads: bool = False) -> None:
        """Bytes of one pass over every chunk's whole source set (what no deduplication moves)."""
        nbytes = sum(c.num_src for c in self.chunks) * int(np.prod(x.shape[1:])) * x.element_size()
        if grads:
            self.counter.d2h_grad_nodedup += nbytes
        else:
            self.counter.h2d_rows_nodedup += nbytes

    # ---- forward -------------------------------------------------------------
    def forward(self, training: bool) -> torch.Tensor:
        """All layers chunk by chunk; returns the host logits [num_solid, C] (no autograd graph).

        With ``training`` the RNG states are saved for recomputation and the
        aggregation outputs of cache-mode layers are written to host memory.
        """
        self.rng.clear()
        L = self.ops.num_layers
        for l in range(L):
            self._forward_layer(l, training)
            if l + 1 < L and self.halo is not None:
                self.halo.fill(l + 1, self.h[l + 1])
        return self.h[L]

    def _forward_layer(self, l: int, training: bool) -> None:
        x_host = self.h[l]
        cache = training and self.modes[l] == "cache"
        st = self.stream
        self._count_nodedup(x_host)
        load = lambda u: self._load_rows(l, st.enter_rows[u], "rows")  # noqa: E731
        # the next batch's new rows are requested as soon as this one's are in the buffer
        for step in st.forward(load, x_host.shape[1:], x_host.dtype, early_prefetch=True):
            c = step.chunk
            chunk = self.chunks[c]
            with self.meter.scope(), torch.no_grad():
                x = step.sources()
                block, ctx = self._chunk_inputs(c)
                if training:
                    self.rng.save((l, c))
                if cache:
                    a = self.ops.aggregate(l, block, x, ctx)
                    self.meter.track(a)
                    out = self.ops.update(l, block, x[:chunk.num_dst], a, ctx)
                    if self.agg[l] is None:
                        self.agg[l] = self._host_out(self.num_solid, a)
                    self.mover.store_range(a, self.agg[l], chunk.dst_begin, "cache")
                else:
                    out = self.ops.forward(l, block, x, ctx)
                self.meter.track(out)
                if self.h[l + 1] is None:
                    rows_out = self.num_solid if l + 1 == self.ops.num_layers else self.num_local
                    self.h[l + 1] = self._host_out(rows_out, out)
                    self.h[l + 1][self.num_solid:].zero_()  # halo rows: filled by the exchange
                self.mover.store_range(out, self.h[l + 1], chunk.dst_begin, "out")
                # the chunk's tensors go now (the copies out hold their own stream use), not when
                # the next chunk's replace them: one chunk's sources on the device at a time
                x = a = out = None
        self.mover.synchronize()

    # ---- backward ------------------------------------------------------------
    def backward(self, grad_logits: torch.Tensor) -> None:
        """Accumulate parameter gradients of ``sum(logits * grad_logits)`` (after :meth:`forward`)."""
        g = grad_logits.detach().to("cpu").contiguous()
        if self.pin:
            g = g.pin_memory()
        for l in reversed(range(self.ops.num_layers)):
            g = self._backward_layer(l, g)

    def _backward_layer(self, l: int, g_out: torch.Tensor) -> torch.Tensor | None:
        """Backward of layer ``l`` given host grads of its output rows; returns host grads of h^l solid rows."""
        need_src = l > 0
        recompute = self.modes[l] == "recompute"
        x_host = self.h[l]
        width = tuple(x_host.shape[1:])
        st = self.stream
        g_in = host_zeros((self.num_local,) + width, x_host.dtype, self.pin) if need_src else None
        load = flush = None
        if recompute:
            self._count_nodedup(x_host)
            load = lambda u: self._load_rows(l, st.leave_rows[u], "rows")  # noqa: E731
        if need_src:
            self._count_nodedup(x_host, grads=True)
            flush = lambda u, part, verts: self.mover.add_rows(part, g_in, verts, "grad")  # noqa: E731
        for step in st.backward(width, x_host.dtype, flush=flush, load=load):
            self._backward_chunk(l, step, g_out, recompute, need_src)
        self.mover.synchronize()
        if not need_src:
            return None
        if self.halo is not None:
            self.halo.accumulate(l, g_in[:self.num_solid], g_in[self.num_solid:])
        return g_in[:self.num_solid]

    def _backward_chunk(self, l, step, g_out, recompute, need_src) -> None:
        c = step.chunk
        chunk = self.chunks[c]
        block, ctx = self._chunk_inputs(c)
        with self.meter.scope(), self.rng.replay((l, c)):
            g = self.mover.load_range(g_out, chunk.dst_begin, chunk.dst_end, "grad").get()
            self.meter.track(g)
            if recompute:
                x = step.sources().detach().requires_grad_(need_src)
                out = self.ops.forward(l, block, x, ctx)
                torch.autograd.backward(out, g)
                if need_src:
                    step.gbuf.index_add_(0, step.slots, x.grad)
                return
            a = self.mover.load_range(self.agg[l], chunk.dst_begin, chunk.dst_end, "cache").get()
            a.requires_grad_(True)
            x_dst = None
            if self.ops.update_needs_dst(l):
                x_dst = (self._load_rows(l, np.arange(chunk.dst_begin, chunk.dst_end), "self") if l == 0
                         and self.features is not None else
                         self.mover.load_range(self.h[l], chunk.dst_begin, chunk.dst_end, "self")).get()
                x_dst.requires_grad_(need_src)
            self.meter.track(a, x_dst)
            out = self.ops.update(l, block, x_dst, a, ctx)
            torch.autograd.backward(out, g)
            if need_src:
                gx = self.ops.aggregate_adjoint(l, block, a.grad, ctx)
                self.meter.track(gx)
                if x_dst is not None and x_dst.grad is not None:
                    gx[:chunk.num_dst] += x_dst.grad
                step.gbuf.index_add_(0, step.slots, gx)


class ModelLayerOps:
    """:class:`LayerOps` over :class:`hpcgnn.nn.models.GNN` (SAGE, GCN, GAT).

    ``degree`` [num_local] is the full-graph degree of every local vertex; GCN layers get
    :func:`~hpcgnn.nn.conv.gcn_norm` of it as source and destination scales (per chunk, in its
    context), so a chunk or a partition computes exactly what the whole graph computes. The
    cache split is the layers' own (``conv.aggregate`` / ``conv.update_from_aggregate`` /
    ``conv.aggregate_adjoint``, :mod:`hpcgnn.nn.conv`), followed by the model's between-layer
    ReLU + dropout (``model.between_layers``); layers that are not ``cacheable`` (GAT) always
    recompute.
    """

    def __init__(self, model, degree: np.ndarray):
        from hpcgnn.nn.conv import GCNConv, gcn_norm

        self.model = model
        self.num_layers = model.num_layers
        self.convs = list(model.layers)
        self.is_gcn = [isinstance(conv, GCNConv) for conv in self.convs]
        # whether any layer weights its edges (GAT): its backward reads the transpose's edge ids
        self.edge_weighted = any(conv.edge_weighted for conv in self.convs)
        self.gcn_scale = gcn_norm(degree) if any(self.is_gcn) else None

    def chunk_context(self, src: np.ndarray, dst_begin: int, dst_end: int, device) -> dict:
        if self.gcn_scale is None:
            return {}
        s = self.gcn_scale
        return {"src_scale": s[torch.from_numpy(np.asarray(src, dtype=np.int64))].to(device),
                "dst_scale": s[dst_begin:dst_end].to(device)}

    def _kw(self, layer: int, ctx: dict) -> dict:
        return ctx if self.is_gcn[layer] else {}

    def forward(self, layer: int, block, x: torch.Tensor, ctx: dict,
                x_dst: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.layer_forward(layer, block, x, h_dst=x_dst, **self._kw(layer, ctx))

    def can_cache(self, layer: int) -> bool:
        return bool(getattr(self.convs[layer], "cacheable", False))

    def update_needs_dst(self, layer: int) -> bool:
        return bool(self.convs[layer].update_needs_dst)

    def aggregate(self, layer: int, block, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self.convs[layer].aggregate(block, x, **self._kw(layer, ctx))

    def update(self, layer: int, block, x_dst: torch.Tensor | None, agg: torch.Tensor,
               ctx: dict) -> torch.Tensor:
        return self.model.between_layers(layer, self.convs[layer].update_from_aggregate(agg, x_dst))

    def aggregate_adjoint(self, layer: int, block, grad_agg: torch.Tensor, ctx: dict) -> torch.Tensor:
        return self.convs[layer].aggregate_adjoint(block, grad_agg, **self._kw(layer, ctx))

    def exchanges_projection(self, layer: int) -> bool:
        return bool(self.convs[layer].exchanges_projection)

    def project(self, layer: int, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        if self.is_gcn[layer]:
            return self.convs[layer].projection(x, ctx["src_scale"][:x.shape[0]])
        return self.convs[layer].projection(x)

    def forward_from_projection(self, layer: int, block, p: torch.Tensor, ctx: dict,
                                x_dst: torch.Tensor | None) -> torch.Tensor:
        return self.model.layer_forward_from_projection(layer, block, p, h_dst=x_dst, **self._kw(layer, ctx))
