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
(native SpMM, no communication) -> one **gather** all-to-all back -> loss on the rank's training
vertices (sum / global training count). Backward mirrors it (split of the output gradient,
``k`` transposed rounds, gather): **4 all-to-alls per epoch whatever k is**, then one
allreduce (sum) of the parameter gradients and Adam. GAT adds one allgather of 2 scalars per
vertex (attention precomputed before aggregation) and its adjoint (an allreduce of 2 V
partial sums). ``tensor.mode = "coupled"`` runs a split and a gather around every layer's
aggregation instead (4 x layers all-to-alls per epoch) for comparison.
``train.precision = "bf16"``: the linear maps' products run in bfloat16 with float32
accumulation (:mod:`hpcgnn.nn.precision`); aggregation, the all-to-alls, the attention
scores, the loss, gradients and Adam stay float32.

**Chunks** (``tensor.chunks = n``): destinations cut into ``n`` contiguous ranges balanced by
in-edges (:func:`hpcgnn.engine.chunk_schedule.chunk_bounds`, as the HongTu engine's chunks),
processed in the same order on every rank. The split is cut per chunk into the rows first
needed by that chunk (de-duplicated: a row is sent once, later chunks reuse it), the gather
per chunk into its destination rows; with ``tensor.pipeline`` all chunk splits are started at
once (non-blocking ``Ialltoallv``) and chunk ``j``'s aggregation starts when split ``j`` is done,
and chunk ``j``'s gather starts as soon as its last-round rows are computed. Backward runs the
chunks in reverse order, so the output-gradient split of chunk ``j`` and the input-gradient
gather of the rows first needed by chunk ``j`` (complete once chunks ``n-1..j`` are done) are
overlapped the same way. Results equal the unchunked ones up to floating-point order.

**Device path** (``train.device = "cuda"``, or ``tensor.staged`` with the CPU as the device):
the NN layers run on the device; the topology and the ``[V, C/P]`` slices stay in host memory
and every aggregation round streams the chunks through the device (:class:`DeviceStage`: the
full-graph engine's de-duplicated transfer plan and :class:`~hpcgnn.engine.transfer.RowMover`,
:func:`~hpcgnn.nn.aggregate.aggregate_sum` on the device); the all-to-alls are unchanged (host
buffers). ``tensor.chunks = "auto"`` picks the smallest count whose device working set
(:func:`hpcgnn.engine.estimate.tensor_device_bytes`) fits ``tensor.device_memory``.

**Run output** (per rank and epoch): timings ``nn`` (MLP forward/backward, loss), ``split``,
``gather`` (posting + waiting, forward and backward), ``aggregate``, ``attention``, ``compute``
(= nn + aggregate: the load balance), ``allreduce``, ``optimizer``, ``eval``; counters
``split_bytes``, ``gather_bytes``, ``attention_bytes``, ``allreduce_bytes``, ``bytes_sent`` (their
sum; bytes this rank sent to other ranks in training), ``eval_bytes``, ``split_calls`` /
``gather_calls`` (MPI exchanges, one per chunk), ``layout_alltoalls`` (logical split/gather
collectives: 4 decoupled, 4 x layers coupled), ``nn_rows``, ``agg_edge_columns`` (edges x local
columns x rounds of the forward). Checkpoints and ``--resume`` through the shared loop.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from hpcgnn.comm.tensor_parallel import CommStats, TPComm, TPLayout, column_bounds
from hpcgnn.engine.hooks import TrainHooks
from hpcgnn.engine.loop import Engine, EpochResult
from hpcgnn.errors import InputError
from hpcgnn.nn.decoupled import edge_dot, sum_adjoint
from hpcgnn.partition.store import read_store_topology, read_vertex_rows


# ---- the tensor-parallel aggregation (split, k rounds, gather) as one autograd Function --------
class DeviceStage:
    """The staged path: the propagation matrix's chunks streamed through the compute device.

    The topology, the edge weights and the ``[V, C/P]`` feature-layout slices stay in host
    memory (page-locked on CUDA); for each chunk ``j`` (destinations ``[a, b)``, sources
    ``N_j``) the source rows not already on the device are copied host->device into a
    buffer of ``plan.capacity`` rows (the HongTu engine's de-duplicated transfer plan,
    :func:`hpcgnn.engine.chunk_schedule.build_transfer_plan`, natural order, one chunk per
    unit: rows shared by consecutive chunks stay in their slots), the chunk's CSR (local
    source positions) and weights follow, :func:`hpcgnn.nn.aggregate.aggregate_sum`
    aggregates on the device (native kernels on the CPU, the torch backend on CUDA) and the
    destination rows go back to host memory (:class:`hpcgnn.engine.transfer.RowMover`: a side
    stream and pinned staging on CUDA, plain copies on the CPU). Backward streams the chunks
    in reverse: destination gradients in, ``A^T g`` accumulated in a device buffer with the
    same slots, rows flushed to host memory and added there when they leave the device.
    With ``device = cpu`` the same code runs with the CPU as the device (tests, transfer
    counters); ``meter`` then counts the bytes resident in the simulated device scope.
    ``backend = "torch"`` runs the chunk operators with torch ops even on the CPU (what CUDA
    runs; tests).
    """

    def __init__(self, prop, device, counter=None, meter=None, backend: str = "auto"):
        from hpcgnn.engine.chunk_schedule import build_chunks, build_transfer_plan, natural_schedule
        from hpcgnn.engine.transfer import DeviceMemoryMeter, RowMover, TransferCounter
        from hpcgnn.sampling.block import Block

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda
        self.backend = backend
        self.counter = counter if counter is not None else TransferCounter()
        self.meter = meter if meter is not None else DeviceMemoryMeter(self.device)
        self.mover = RowMover(self.device, self.counter)
        chunks = build_chunks(prop.indptr, prop.indices, prop.chunk_bounds)
        plan = build_transfer_plan(chunks, natural_schedule(len(chunks), 1), prop.num_nodes, dedup=True)
        self.capacity = int(plan.capacity)
        self.rows_loaded = plan.rows_loaded()          # source rows loaded per pass
        host = self._host
        self.blocks = [Block(c.num_src, c.num_dst, host(torch.from_numpy(c.indptr)), host(torch.from_numpy(c.indices)))
                       for c in chunks]
        self.bounds = [(c.dst_begin, c.dst_end) for c in chunks]
        self.edges = [prop.edge_range(c.dst_begin, c.dst_end) for c in chunks]
        units = plan.units                              # kept only as the arrays below
        # per chunk: slots of its sources, of the rows entering in forward / in backward
        self.slots = [host(torch.from_numpy(u.chunk_slots[0])) for u in units]
        self.enter = [(u.vertices[u.enter], host(torch.from_numpy(u.slots[u.enter]))) for u in units]
        self.leave = [(u.vertices[u.leave], host(torch.from_numpy(u.slots[u.leave]))) for u in units]
        self.identity = [bool(np.array_equal(u.chunk_slots[0], np.arange(c.num_src))) for u, c in zip(units, chunks)]
        self.weight = None if prop.weight is None else host(prop.weight)
        self.rows_nodedup = int(sum(c.num_src for c in chunks))   # rows per pass without reuse
        self._pool: dict = {}

    @property
    def num_chunks(self) -> int:
        return len(self.blocks)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.pin else t

    def host_buffer(self, tag: str, shape, dtype, zero: bool = False) -> torch.Tensor:
        """A host [V, w] buffer (page-locked on CUDA, reused per tag and shape: pinned
        allocations are slow; fresh on the CPU)."""
        if not self.pin:
            return torch.zeros(shape, dtype=dtype) if zero else torch.empty(shape, dtype=dtype)
        key = (tag, tuple(shape), dtype)
        t = self._pool.get(key)
        if t is None:
            t = self._pool[key] = torch.empty(shape, dtype=dtype, pin_memory=True)
        if zero:
            t.zero_()
        return t

    def _inputs(self, j: int, weight):
        """Chunk ``j``'s block, source slots and edge weights on the device (copied from host
        memory on CUDA, counted as h2d ``topo``)."""
        from hpcgnn.sampling.block import Block

        e0, e1 = self.edges[j]
        w = self.weight if weight is None else weight
        w = None if w is None else w.detach()[e0:e1]
        block, slots = self.blocks[j], self.slots[j]
        if not self.cuda:
            return block, slots, w
        dev = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        self.counter.add_h2d("topo", block.indptr.nbytes + block.indices.nbytes + slots.nbytes
                             + (0 if w is None else w.nbytes))
        return Block(block.num_src, block.num_dst, dev(block.indptr), dev(block.indices)), dev(slots), \
            None if w is None else dev(w)

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if not self.cuda else t.to(self.device, non_blocking=True)

    def forward_round(self, run, prev: torch.Tensor, nxt: torch.Tensor, z0: torch.Tensor | None, c: float,
                      alpha: float, weight, before_load, after_store) -> None:
        """``nxt[a:b] = c A[a:b] prev + alpha z0[a:b]`` for every chunk (host [V, w] tensors;
        ``z0`` None: ``prev`` is ``Z_0``). ``before_load(j)`` runs before chunk ``j``'s rows are
        read from ``prev``, ``after_store(j)`` once its device->host copy into ``nxt`` is
        issued (call ``self.mover.synchronize()`` there before reading ``nxt[a:b]`` on CUDA)."""
        from hpcgnn.nn.aggregate import aggregate_sum

        w = int(prev.shape[1])
        n = self.num_chunks
        buf = torch.empty((self.capacity, w), dtype=prev.dtype, device=self.device)
        self.meter.hold(buf.nbytes)
        self.counter.h2d_rows_nodedup += self.rows_nodedup * w * prev.element_size()
        before_load(0)
        pending = self.mover.load_rows(prev, self.enter[0][0], "rows")
        for j in range(n):
            a, b = self.bounds[j]
            t0 = time.perf_counter()
            with self.meter.scope(), torch.no_grad():
                block, slots, wj = self._inputs(j, weight)
                rows = pending.get()
                self.meter.track(rows)
                buf.index_copy_(0, self._dev(self.enter[j][1]), rows)
                x = buf[:block.num_src] if self.identity[j] else buf.index_select(0, slots)
                if not self.identity[j]:
                    self.meter.track(x)
                out = aggregate_sum(block, x, wj, backend=self.backend)
                self.meter.track(out)
                if c != 1.0:
                    out.mul_(c)
                if alpha:
                    zd = x[:b - a] if z0 is None else self.mover.load_range(z0, a, b, "z0").get()
                    out.add_(zd, alpha=alpha)
                t1 = time.perf_counter()
                if j + 1 < n:
                    before_load(j + 1)
                    t1b = time.perf_counter()
                    pending = self.mover.load_rows(prev, self.enter[j + 1][0], "rows")
                else:
                    t1b = time.perf_counter()
                self.mover.store_range(out, nxt, a, "out")
            e0, e1 = self.edges[j]
            run._agg(time.perf_counter() - t0 - (t1b - t1), (e1 - e0) * w)
            after_store(j)
        self.mover.synchronize()
        self.meter.release(buf.nbytes)

    def backward_round(self, run, gk: torch.Tensor, gprev: torch.Tensor, g0: torch.Tensor, c: float,
                       alpha: float, weight, x_saved, grad_w, before_chunk, after_flush) -> None:
        """Chunks in reverse: ``gprev += A^T (c gk)``, ``g0 += alpha gk`` and, with ``x_saved``
        (``Z_(r-1)``, host), ``grad_w[e] += c gk[v] . x_saved[u]`` (host tensors).
        ``before_chunk(i, j)`` runs before the ``i``-th chunk ``j`` reads ``gk[a:b]``,
        ``after_flush(i, j)`` after the rows first read by chunk ``j`` left the device."""
        w = int(gk.shape[1])
        n = self.num_chunks
        gbuf = torch.zeros((self.capacity, w), dtype=gk.dtype, device=self.device)
        self.meter.hold(gbuf.nbytes)
        self.counter.d2h_grad_nodedup += self.rows_nodedup * w * gk.element_size()
        buf = None
        order = list(range(n - 1, -1, -1))
        if x_saved is not None:
            buf = torch.empty((self.capacity, w), dtype=gk.dtype, device=self.device)
            self.meter.hold(buf.nbytes)
            pending = self.mover.load_rows(x_saved, self.leave[order[0]][0], "rows")
            self.counter.h2d_rows_nodedup += self.rows_nodedup * w * gk.element_size()
        for i, j in enumerate(order):
            a, b = self.bounds[j]
            before_chunk(i, j)
            t0 = time.perf_counter()
            with self.meter.scope(), torch.no_grad():
                block, slots, wj = self._inputs(j, weight)
                entering = self._dev(self.leave[j][1])
                gbuf.index_fill_(0, entering, 0.0)
                x = None
                if buf is not None:
                    rows = pending.get()
                    self.meter.track(rows)
                    buf.index_copy_(0, entering, rows)
                    if i + 1 < n:
                        pending = self.mover.load_rows(x_saved, self.leave[order[i + 1]][0], "rows")
                    x = buf[:block.num_src] if self.identity[j] else buf.index_select(0, slots)
                    self.meter.track(x)
                g = self.mover.load_range(gk, a, b, "grad").get()
                g_rows = g * c if c != 1.0 else g
                gx = sum_adjoint(block, g_rows, wj, backend=self.backend)
                self.meter.track(g, g_rows, gx)
                if self.identity[j]:
                    gbuf[:block.num_src].add_(gx)
                else:
                    gbuf.index_add_(0, slots, gx)
                if alpha:
                    self.mover.add_rows(g * alpha, g0, np.arange(a, b, dtype=np.int64), "grad")
                if x is not None:
                    e0, e1 = self.edges[j]
                    self.mover.add_rows(edge_dot(block, g_rows, x, backend=self.backend), grad_w,
                                        np.arange(e0, e1, dtype=np.int64), "edge_grad")
                verts, enter_slots = self.enter[j]
                part = gbuf.index_select(0, self._dev(enter_slots))
                self.mover.add_rows(part, gprev, verts, "grad")
            e0, e1 = self.edges[j]
            run._agg(time.perf_counter() - t0, (e1 - e0) * w)
            after_flush(i, j)
        self.mover.synchronize()
        self.meter.release(gbuf.nbytes)
        if buf is not None:
            self.meter.release(buf.nbytes)


class TPRun:
    """What one rank needs to run :class:`TPPropagate`: the layout and its exchanges, the
    propagation matrix, the rounds and coefficients, time/volume accounting and, on the
    staged path, the :class:`DeviceStage`."""

    def __init__(self, tp: TPComm, layout: TPLayout, prop, pipeline: bool, stage: DeviceStage | None = None):
        self.tp, self.layout, self.prop, self.pipeline = tp, layout, prop, pipeline
        self.stage = stage
        self.aggregate_s = 0.0
        self.edge_columns = 0
        self.alltoalls = 0
        self.record = True

    def reset(self) -> None:
        self.aggregate_s, self.edge_columns, self.alltoalls = 0.0, 0, 0

    def _agg(self, seconds: float, columns: int = 0) -> None:
        if self.record:
            self.aggregate_s += seconds
            self.edge_columns += columns

    def _collective(self, count: int = 1) -> None:
        if self.record:
            self.alltoalls += count


def _start_all(run: TPRun, starts: list):
    """Start the exchanges ``starts`` (callables) now (pipelined) or lazily, one by one."""
    if run.pipeline:
        return [s() for s in starts]
    return list(starts)


def _finish(handles: list, i: int):
    h = handles[i]
    if callable(h):
        h = handles[i] = h()
    return h.finish()


def _drive(handles: list, i: int) -> None:
    """Let MPI progress the next outstanding exchange (non-blocking test)."""
    if 0 <= i < len(handles) and not callable(handles[i]):
        handles[i].test()


def _post(run: TPRun, handles: list, i: int, start) -> None:
    """Append the ``i``-th exchange of a sequence: started now (pipelined) or run to completion
    now (not pipelined); then let the previous one progress."""
    handles.append(start() if run.pipeline else start)
    if not run.pipeline:
        _finish(handles, i)
    _drive(handles, i - 1)


def _finish_all(handles: list, n: int, run: TPRun) -> None:
    """Complete the ``n`` exchanges of a sequence (2 all-to-alls counted: split and gather)."""
    for i in range(n):
        _finish(handles, i)
    run._collective(2)


class TPPropagate(torch.autograd.Function):
    """``TPPropagate.apply(h_rows, edge_weight, run, k, c, alpha)``: vertex-layout rows
    [n_i, C] -> split -> ``Z_r = c A Z_(r-1) + alpha Z_0`` for r = 1..k on the column slice ->
    gather -> [n_i, C]. ``edge_weight`` [E + V] (attention) or None (the matrix's own weights);
    its gradient is this rank's partial sum over its columns. Chunked and pipelined as the
    module docstring says; backward runs the mirror image."""

    @staticmethod
    def forward(ctx, h, edge_weight, run: TPRun, k: int, c: float, alpha: float):
        if run.stage is not None:
            return _staged_forward(ctx, h, edge_weight, run, k, c, alpha)
        lay, prop, tp = run.layout, run.prop, run.tp
        h = h.detach().contiguous()
        width = int(h.shape[1])
        w = int(np.diff(column_bounds(width, lay.size))[lay.rank])
        n = lay.num_chunks
        cb = lay.chunk_bounds
        z0 = h.new_zeros((lay.num_nodes, w))
        out = h.new_zeros((lay.num_own, width))
        splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.split_transfer(j), h, z0, "split"))
                                  for j in range(n)])
        gathers = []
        need_saved = edge_weight is not None and ctx.needs_input_grad[1]
        saved = []
        prev = z0
        for r in range(1, k + 1):
            nxt = h.new_empty((lay.num_nodes, w))
            for j in range(n):
                if r == 1:
                    _finish(splits, j)
                    _drive(splits, j + 1)
                a, b = int(cb[j]), int(cb[j + 1])
                t0 = time.perf_counter()
                rows = nxt[a:b]
                prop.forward_rows(a, b, prev, rows, edge_weight)
                if c != 1.0:
                    rows.mul_(c)
                if alpha:
                    rows.add_(z0[a:b], alpha=alpha)
                e0, e1 = prop.edge_range(a, b)
                run._agg(time.perf_counter() - t0, (e1 - e0) * w)
                if r == k:
                    start = (lambda j=j, nxt=nxt: tp.start_to_rows(lay.gather_transfer(j), nxt, width, out, "gather"))
                    _post(run, gathers, j, start)
            if need_saved:
                saved.append(prev)
            prev = nxt
        _finish_all(gathers, n, run)
        ctx.run, ctx.k, ctx.c, ctx.alpha, ctx.width, ctx.w = run, k, c, alpha, width, w
        ctx.saved_z = saved
        ctx.save_for_backward(edge_weight if edge_weight is not None else None)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.run.stage is not None:
            return _staged_backward(ctx, grad_out)
        run, k, c, alpha, width, w = ctx.run, ctx.k, ctx.c, ctx.alpha, ctx.width, ctx.w
        (edge_weight,) = ctx.saved_tensors
        lay, prop, tp = run.layout, run.prop, run.tp
        n, cb = lay.num_chunks, lay.chunk_bounds
        g_out = grad_out.detach().contiguous()
        gk = g_out.new_zeros((lay.num_nodes, w))
        rev = list(range(n - 1, -1, -1))
        splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.gather_transfer(j), g_out, gk, "split"))
                                  for j in rev])
        g0 = g_out.new_zeros((lay.num_nodes, w))        # gradient of Z_0
        grad_h = g_out.new_zeros((lay.num_own, width))
        grad_w = None
        if edge_weight is not None and ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(edge_weight)
        gathers = []
        for r in range(k, 0, -1):
            gprev = g0 if r == 1 else g_out.new_zeros((lay.num_nodes, w))
            for i, j in enumerate(rev):
                if r == k:
                    _finish(splits, i)
                    _drive(splits, i + 1)
                a, b = int(cb[j]), int(cb[j + 1])
                t0 = time.perf_counter()
                g_rows = gk[a:b] * c if c != 1.0 else gk[a:b]
                prop.backward_rows(j, g_rows, gprev, edge_weight)
                if alpha:
                    g0[a:b].add_(gk[a:b], alpha=alpha)
                if grad_w is not None:
                    prop.edge_grad_rows(a, b, g_rows, ctx.saved_z[r - 1], grad_w)
                e0, e1 = prop.edge_range(a, b)
                run._agg(time.perf_counter() - t0, (e1 - e0) * w)
                if r == 1:
                    start = (lambda j=j: tp.start_to_rows(lay.split_transfer(j), g0, width, grad_h, "gather"))
                    _post(run, gathers, i, start)
            gk = gprev
        _finish_all(gathers, n, run)
        ctx.saved_z = None
        return grad_h, grad_w, None, None, None, None


def _staged_forward(ctx, h, edge_weight, run: TPRun, k: int, c: float, alpha: float):
    """:meth:`TPPropagate.forward` on the staged path: ``h`` and the output on the compute
    device, the feature-layout slices in host memory, the rounds through :class:`DeviceStage`.
    The exchanges and their order are the unstaged path's (same collectives, same overlap)."""
    lay, tp, st = run.layout, run.tp, run.stage
    h = h.detach().contiguous()
    width = int(h.shape[1])
    w = int(np.diff(column_bounds(width, lay.size))[lay.rank])
    n, v = lay.num_chunks, lay.num_nodes
    need_saved = edge_weight is not None and ctx.needs_input_grad[1]
    z0 = st.host_buffer("z0", (v, w), h.dtype, zero=True)
    out = h.new_zeros((lay.num_own, width))
    splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.split_transfer(j), h, z0, "split"))
                              for j in range(n)])
    gathers, saved = [], []
    prev = z0
    for r in range(1, k + 1):
        nxt = st.host_buffer(f"z{r}" if need_saved else f"z{2 - r % 2}", (v, w), h.dtype)

        def before_load(j, first=r == 1):
            if first:
                _finish(splits, j)
                _drive(splits, j + 1)

        def after_store(j, last=r == k, nxt=nxt):
            if not last:
                return
            st.mover.synchronize()          # chunk j's rows are in host memory
            start = (lambda j=j: tp.start_to_rows(lay.gather_transfer(j), nxt, width, out, "gather"))
            _post(run, gathers, j, start)

        st.forward_round(run, prev, nxt, None if r == 1 else z0, c, alpha, edge_weight, before_load, after_store)
        if need_saved:
            saved.append(prev)
        prev = nxt
    _finish_all(gathers, n, run)
    ctx.run, ctx.k, ctx.c, ctx.alpha, ctx.width, ctx.w = run, k, c, alpha, width, w
    ctx.saved_z = saved
    ctx.save_for_backward(edge_weight if edge_weight is not None else None)
    return out


def _staged_backward(ctx, grad_out):
    """:meth:`TPPropagate.backward` on the staged path (see :func:`_staged_forward`)."""
    run, k, c, alpha, width, w = ctx.run, ctx.k, ctx.c, ctx.alpha, ctx.width, ctx.w
    (edge_weight,) = ctx.saved_tensors
    lay, tp, st = run.layout, run.tp, run.stage
    n, v = lay.num_chunks, lay.num_nodes
    g_out = grad_out.detach().contiguous()
    gk = st.host_buffer("gk", (v, w), g_out.dtype, zero=True)
    rev = list(range(n - 1, -1, -1))
    splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.gather_transfer(j), g_out, gk, "split"))
                              for j in rev])
    g0 = st.host_buffer("g0", (v, w), g_out.dtype, zero=True)
    grad_h = g_out.new_zeros((lay.num_own, width))
    grad_w = None
    if edge_weight is not None and ctx.needs_input_grad[1]:
        grad_w = torch.zeros_like(edge_weight)
    gathers = []
    for r in range(k, 0, -1):
        gprev = g0 if r == 1 else st.host_buffer(f"g{1 + r % 2}", (v, w), g_out.dtype, zero=True)

        def before_chunk(i, j, first=r == k):
            if first:
                _finish(splits, i)
                _drive(splits, i + 1)

        def after_flush(i, j, last=r == 1):
            if not last:
                return
            st.mover.synchronize()          # every gradient of the rows first read by chunk j is in g0
            start = (lambda j=j: tp.start_to_rows(lay.split_transfer(j), g0, width, grad_h, "gather"))
            _post(run, gathers, i, start)

        st.backward_round(run, gk, gprev, g0, c, alpha, edge_weight,
                          ctx.saved_z[r - 1] if grad_w is not None else None, grad_w, before_chunk, after_flush)
        gk = gprev
    _finish_all(gathers, n, run)
    ctx.saved_z = None
    return grad_h, grad_w, None, None, None, None


class AllgatherRows(torch.autograd.Function):
    """``AllgatherRows.apply(x_rows, tp)``: every rank's vertex rows [n_i, d] -> [V, d] in global
    order on every rank (one allgather); the adjoint sums every rank's gradient (allreduce)
    and keeps the rank's own rows. Used for GAT's 2 attention scalars per vertex."""

    @staticmethod
    def forward(ctx, x, tp: TPComm):
        lay = tp.layout
        t0 = time.perf_counter()
        x = x.detach().contiguous()
        d = int(x.shape[1])
        tr = lay.full_transfer()
        if tp.comm is None:
            got = x
        else:
            counts = tr.counts * d
            recv = np.empty(int(counts.sum()), dtype=x.numpy().dtype)
            tp.comm.Allgatherv(x.numpy().reshape(-1), [recv, counts])
            got = torch.from_numpy(recv).view(-1, d)
        full = x.new_empty((lay.num_nodes, d))
        full[tr.ids] = got
        tp.stats.add("attention", (lay.size - 1) * x.numel() * x.element_size(), time.perf_counter() - t0, 1)
        ctx.tp = tp
        return full

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        from mpi4py import MPI

        tp = ctx.tp
        t0 = time.perf_counter()
        g = grad.detach().contiguous().clone()
        if tp.comm is not None:
            tp.comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
        own = torch.from_numpy(tp.layout.own_ids)
        tp.stats.add("attention", g.numel() * g.element_size(), time.perf_counter() - t0, 1)
        return g.index_select(0, own), None


# ---- the engine ------------------------------------------------------------------------------
class TensorEngine(Engine):
    """The tensor-parallel engine on one rank (collective constructor)."""

    def __init__(self, cfg, rt, out, hooks: TrainHooks | None = None):
        from hpcgnn.engine.chunk_schedule import chunk_bounds
        from hpcgnn.comm.allreduce import GradientAllreduce, allreduce_sum
        from hpcgnn.engine.device import resolve_device
        from hpcgnn.engine.model import broadcast_parameters, build_optimizer
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
            staged = device.type != "cpu" or t.staged
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
                                          np.diff(indptr)[layout.own_ids], device)
        except InputError as exc:
            error = str(exc)
        rt.agree(error)
        self.device = device
        self.staged = staged
        self.timer = PhaseTimer(sync_cuda=device.type == "cuda", cuda_device=device)
        self.layout = layout
        self.mode = t.mode
        self.kind = PROPAGATIONS[cfg.model.arch]
        self.prop = Propagation(indptr, indices, self.kind, bounds)
        del indices, graph
        self.stats = CommStats()
        self.tp = TPComm(rt.comm, layout, self.stats)
        self.stage = DeviceStage(self.prop, device) if staged else None
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
        self.reducer = GradientAllreduce(self.model, rt, op="sum")
        self.n_train = float(allreduce_sum(rt, [int(self.masks["train"].sum())])[0])
        if self.n_train == 0:
            rt.agree(f"{store}: the graph has no training vertices")
        self.eval_stats = CommStats()
        setup_s = time.perf_counter() - t0
        sizes = rt.comm.allgather(layout.num_own)
        from hpcgnn.engine.estimate import tensor_device_bytes

        nn_b, chunk_b = tensor_device_bytes(cfg, meta, rt.size, layout.num_chunks, device.type)
        device_attrs = dict(tensor_staged=bool(staged), tensor_chunks_setting=str(t.chunks),
                            tensor_device_nn_bytes=int(nn_b), tensor_device_chunk_bytes=int(chunk_b))
        if self._budget is not None:
            device_attrs["tensor_device_budget_bytes"] = int(self._budget)
        if staged:
            device_attrs["tensor_stage_capacity_rows"] = int(self.stage.capacity)
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
        """``tensor.chunks`` resolved on this rank (``'auto'``: :func:`~hpcgnn.engine.estimate.auto_chunks`
        for ``tensor.device_memory``); sets ``self._budget`` (bytes or None)."""
        from hpcgnn.engine.estimate import auto_chunks
        from hpcgnn.run.engines.tensor import device_budget

        t = cfg.tensor
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        self._budget = device_budget(t.device_memory, device.type, total)
        if t.chunks == "auto":
            return auto_chunks(cfg, meta, rt.size, self._budget, device.type)[0]
        if self._budget is not None and rt.rank == 0 and (device.type != "cpu" or t.staged):
            from hpcgnn.engine.estimate import tensor_device_bytes
            from hpcgnn.units import fmt_bytes
            from hpcgnn.run.output import warn

            need = sum(tensor_device_bytes(cfg, meta, rt.size, int(t.chunks), device.type))
            if need > self._budget:
                warn(f"tensor.chunks = {t.chunks}: the estimated device working set {fmt_bytes(need)} exceeds "
                     f"tensor.device_memory ({fmt_bytes(self._budget)}); tensor.chunks = 'auto' sizes the chunks")
        return int(t.chunks)

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
        (loss_sum / self.n_train).backward()
        fb = time.perf_counter() - t0
        with timer.phase("allreduce"):
            self.reducer(loss_sum, epoch)     # raises on a non-finite loss or gradient
        with timer.phase("optimizer"):
            self.optimizer.step()
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
