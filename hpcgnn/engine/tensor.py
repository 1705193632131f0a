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
once (non-blocking all-to-alls of the data plane, ``Communicator.start_alltoallv``) and chunk
``j``'s aggregation starts when split ``j`` is done, and chunk ``j``'s gather starts as soon as
its last-round rows are computed. Backward runs the chunks in reverse order, so the
output-gradient split of chunk ``j`` and the input-gradient gather of the rows first needed by
chunk ``j`` (complete once chunks ``n-1..j`` are done) are overlapped the same way. Results
equal the unchunked ones up to floating-point order.

**Device path** (``train.device = "cuda"``, or ``tensor.staged`` with the CPU as the device):
the NN layers run on the device; the aggregation rounds go through :class:`DeviceStage` (the
chunk loop shared with the full-graph engine, :class:`~hpcgnn.engine.chunk_stream.ChunkStream`,
its de-duplicated transfer plan and :class:`~hpcgnn.store.mover.DeviceMover`,
:func:`~hpcgnn.nn.aggregate.aggregate_sum` on the device): **resident** when the topology and
the ``[V, C/P]`` slices fit the device budget (:func:`resident_device_bytes`; kept on the device
across rounds and epochs), else **streamed** (both in host memory, every round streams the
chunks); the all-to-alls are unchanged (host buffers). ``tensor.chunks = "auto"`` picks the smallest count whose device working set
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

import functools
import time

import numpy as np
import torch
import torch.nn.functional as F

from hpcgnn.comm.tensor_parallel import CommStats, TPComm, TPLayout, column_bounds
from hpcgnn.engine.hooks import TrainHooks
from hpcgnn.engine.loop import Engine, EpochResult
from hpcgnn.errors import InputError
from hpcgnn.nn.aggregate import kernel_options
from hpcgnn.nn.decoupled import edge_dot, sum_adjoint
from hpcgnn.partition.store import read_store_topology, read_vertex_rows
# the resident path's device bytes live with the estimate (which counts them) to avoid a cycle
from hpcgnn.engine.estimate import resident_device_bytes  # noqa: F401


# ---- the tensor-parallel aggregation (split, k rounds, gather) as one autograd Function --------
class DeviceStage:
    """The staged path: the propagation matrix's chunks streamed through the compute device.

    For each chunk ``j`` (destinations ``[a, b)``, sources ``N_j``) the source rows not already
    on the device enter a buffer of ``plan.capacity`` rows along the HongTu engine's
    de-duplicated transfer plan (:func:`hpcgnn.engine.chunk_schedule.build_transfer_plan`,
    natural order, one chunk per unit: rows shared by consecutive chunks stay in their slots),
    through the one chunk-streaming loop (:class:`hpcgnn.engine.chunk_stream.ChunkStream`);
    :func:`hpcgnn.nn.aggregate.aggregate_sum` aggregates on the device (native kernels on the
    CPU, the torch backend on CUDA). Backward streams the chunks in reverse: destination
    gradients in, ``A^T g`` accumulated in a device buffer with the same slots, rows flushed
    when they leave the device. Copies go through :class:`hpcgnn.store.mover.DeviceMover`
    (pinned staging reused and a side stream on CUDA, plain copies on the CPU).

    **Streamed** (``resident = False``): the topology, the edge weights and the ``[V, C/P]``
    slices stay in host memory (page-locked on CUDA); every round loads its rows host->device,
    writes its output rows back and, on CUDA, copies every chunk's CSR, slots and weights
    (h2d ``topo``). **Resident** (``resident = True``, when :func:`resident_device_bytes` fits
    the device budget): the chunks' CSRs and slots are copied to the device once and kept (their
    transposes cached with them), the edge weights once per pass, and the slices between the
    exchanges live on the device: only the first round's rows (the split's result), the
    output-gradient rows of the last round, the last round's output and the rows of the
    gradient of Z_0 cross the link. The arithmetic is the same in the same order: resident and
    streamed results are bit for bit equal. With ``device = cpu`` the same code runs with the
    CPU as the device (tests, transfer counters); ``meter`` then counts the bytes resident in
    the simulated device scope. ``backend = "torch"`` runs the chunk operators with torch ops
    even on the CPU (what CUDA runs; tests); ``deterministic`` as ``train.deterministic``.
    """

    def __init__(self, prop, device, counter=None, meter=None, backend: str = "auto", resident: bool = False,
                 deterministic: bool = False):
        from hpcgnn.engine.chunk_schedule import build_chunks, build_transfer_plan, natural_schedule
        from hpcgnn.engine.chunk_stream import ChunkStream
        from hpcgnn.engine.transfer import TransferCounter
        from hpcgnn.run.memory import DeviceMemoryMeter
        from hpcgnn.sampling.block import Block
        from hpcgnn.store.mover import DeviceMover

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda
        self.backend, self.deterministic = backend, bool(deterministic)
        self.resident = bool(resident)
        self.counter = counter if counter is not None else TransferCounter()
        self.meter = meter if meter is not None else DeviceMemoryMeter(self.device, rss=False)
        self.mover = DeviceMover(self.device, self.counter)
        chunks = build_chunks(prop.indptr, prop.indices, prop.chunk_bounds)
        plan = build_transfer_plan(chunks, natural_schedule(len(chunks), 1), prop.num_nodes, dedup=True)
        self.capacity = int(plan.capacity)
        self.rows_loaded = plan.rows_loaded()          # source rows loaded per pass
        # the chunk loop; its slot tensors live on the device when resident
        self.stream = ChunkStream(chunks, plan, self.device, self.meter, index_on_device=self.resident)
        host = self._host
        self.blocks = [Block(c.num_src, c.num_dst, host(torch.from_numpy(c.indptr)), host(torch.from_numpy(c.indices)))
                       for c in chunks]
        self.bounds = [(c.dst_begin, c.dst_end) for c in chunks]
        self.edges = [prop.edge_range(c.dst_begin, c.dst_end) for c in chunks]
        self.weight = None if prop.weight is None else host(prop.weight)
        self.rows_nodedup = int(sum(c.num_src for c in chunks))   # rows per pass without reuse
        self._pool: dict = {}
        self._dev_pool: dict = {}
        self._dev_blocks = None
        self._dev_weight = (None, 0, None)   # (the host weights copied, their version, the device copy)
        if self.resident and self.cuda:               # the topology, copied once and kept
            self._dev_blocks = [Block(b.num_src, b.num_dst, b.indptr.to(self.device), b.indices.to(self.device))
                                for b in self.blocks]
        # resident: the rows entering / leaving each unit and each chunk's destinations as device
        # indices (slices gathered and scattered on the device), built once
        put = self._index
        self._rows_dev = {"enter": [put(r) for r in self.stream.enter_rows],
                          "leave": [put(r) for r in self.stream.leave_rows],
                          "dst": [put(np.arange(a, b)) for a, b in self.bounds]} if self.resident else None

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

    def device_buffer(self, tag: str, shape, dtype, zero: bool = False) -> torch.Tensor:
        """A device [V, w] slice of the resident path, allocated once per tag and shape and
        kept across rounds and epochs (held by the meter while it exists)."""
        key = (tag, tuple(shape), dtype)
        t = self._dev_pool.get(key)
        if t is None:
            t = self._dev_pool[key] = torch.empty(shape, dtype=dtype, device=self.device)
            self.meter.hold(t.nbytes)
        if zero:
            t.zero_()
        return t

    def _span_start(self):
        """On CUDA, a timing event recorded now on the compute stream (the start of a chunk's
        aggregation, :meth:`TPRun._agg`); None on the CPU (host time is the device's)."""
        if self.device.type != "cuda":
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _weight(self, weight):
        """The edge weights on the device: the host ones on the CPU; resident, one copy per
        distinct weight tensor (the matrix's own once, attention's once per pass)."""
        w = self.weight if weight is None else weight.detach()
        if w is None or not self.cuda or not self.resident:
            return w
        # the cache holds the host tensor it copied (detached: no autograd graph), so that its
        # memory cannot go to the next pass's weights while the key still names it
        held, version, dev = self._dev_weight
        if held is None or not (held.data_ptr() == w.data_ptr() and held.shape == w.shape
                                and held.dtype == w.dtype and version == w._version):
            self.counter.add_h2d("topo", w.nbytes)
            self._dev_weight = (w, w._version, w.to(self.device, copy=True))
        return self._dev_weight[2]

    def _inputs(self, j: int, weight):
        """Chunk ``j``'s block and edge weights on the device (streamed on CUDA: copied from
        host memory with the chunk's slots, counted as h2d ``topo``)."""
        e0, e1 = self.edges[j]
        w = self._weight(weight)
        w = None if w is None else w[e0:e1]
        block = self.blocks[j]
        if not self.cuda:
            return block, w
        if self._dev_blocks is not None:
            return self._dev_blocks[j], w
        slots = self.stream.chunk_slots[j][0]
        self.counter.add_h2d("topo", slots.nbytes + (0 if w is None else w.nbytes))
        # backward: the host block's transpose copied, not sorted on the device every round
        db = block.streamed_copy(self.device, self.pin, functools.partial(self.counter.add_h2d, "topo"))
        return db, None if w is None else w.to(self.device, non_blocking=True)

    def _index(self, rows) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(self.device)

    def _rows(self, which: str, u: int) -> np.ndarray:
        """Host ids: ``enter`` / ``leave`` rows of unit ``u``, or ``dst`` rows of chunk ``u``."""
        if which == "dst":
            return np.arange(*self.bounds[u], dtype=np.int64)
        return (self.stream.enter_rows if which == "enter" else self.stream.leave_rows)[u]

    def _rows_on_device(self, which: str, u: int) -> torch.Tensor:
        if self._rows_dev is not None:
            return self._rows_dev[which][u]
        return self._index(self._rows(which, u))

    def _load(self, src: torch.Tensor, which: str, u: int, kind: str, on_device: bool):
        """Rows ``src[ids]`` on the device (``ids``: :meth:`_rows`): copied from host memory
        (counted as ``kind``), or gathered on the device when ``src`` is a resident slice."""
        from hpcgnn.store.mover import Loaded

        if on_device:
            return Loaded(src.index_select(0, self._rows_on_device(which, u)))
        return self.mover.load_rows(src, self._rows(which, u), kind)

    def _range(self, src: torch.Tensor, a: int, b: int, kind: str, on_device: bool) -> torch.Tensor:
        return src[a:b] if on_device else self.mover.load_range(src, a, b, kind).get()

    def _add(self, dev: torch.Tensor, target: torch.Tensor, which: str, u: int, kind: str, on_device: bool) -> None:
        """``target[ids] += dev`` (``ids``: :meth:`_rows`): on the device for a resident slice,
        else a host-side add."""
        if on_device:
            target.index_add_(0, self._rows_on_device(which, u), dev)
        else:
            self.mover.add_rows(dev, target, self._rows(which, u), kind)

    def forward_round(self, run, prev: torch.Tensor, nxt: torch.Tensor, z0: torch.Tensor | None, c: float,
                      alpha: float, weight, before_load, after_store, prev_dev: bool = False,
                      nxt_dev: bool = False, z0_dev: bool = False, capture: torch.Tensor | None = None) -> None:
        """``nxt[a:b] = c A[a:b] prev + alpha z0[a:b]`` for every chunk (``z0`` None: ``prev`` is
        ``Z_0``). ``prev_dev`` / ``nxt_dev`` / ``z0_dev``: the tensor is a resident device slice
        (else host [V, w]). ``capture``: a device [V, w] slice receiving every row of ``prev``
        that arrives (resident round 1: Z_0 kept on the device). ``before_load(j)`` runs before
        chunk ``j``'s rows are read from ``prev``, ``after_store(j)`` once its output rows are
        written or their device->host copy is issued (on CUDA, host ``nxt[a:b]`` is complete
        after ``self.mover.settle`` of a mark taken there, or after the round)."""
        from hpcgnn.nn.aggregate import aggregate_sum

        w = int(prev.shape[1])
        st = self.stream
        if not prev_dev:
            self.counter.h2d_rows_nodedup += self.rows_nodedup * w * prev.element_size()
        waited = [0.0]

        def before(u):
            t = time.perf_counter()
            before_load(u)
            waited[0] += time.perf_counter() - t

        received = None if capture is None else \
            (lambda u, rows: capture.index_copy_(0, self._rows_on_device("enter", u), rows))
        load = (lambda u: self._load(prev, "enter", u, "rows", prev_dev))  # noqa: E731
        for step in st.forward(load, (w,), prev.dtype, before_load=before, received=received):
            j = step.chunk
            a, b = self.bounds[j]
            t0, w0 = time.perf_counter(), waited[0]
            with self.meter.scope(), torch.no_grad():
                block, wj = self._inputs(j, weight)
                x = step.sources()
                start = self._span_start()             # after the wait for the chunk's rows
                out = aggregate_sum(block, x, wj, **kernel_options(self))
                self.meter.track(out)
                if c != 1.0:
                    out.mul_(c)
                if alpha:
                    zd = x[:b - a] if z0 is None else self._range(z0, a, b, "z0", z0_dev)
                    out.add_(zd, alpha=alpha)
                step.prefetch()                    # the next chunk's rows while this one's go out
                if nxt_dev:
                    nxt[a:b].copy_(out)
                else:
                    self.mover.store_range(out, nxt, a, "out")
                x = out = zd = None         # one chunk's tensors at a time (not two across chunks)
            e0, e1 = self.edges[j]
            run._agg(time.perf_counter() - t0 - (waited[0] - w0), (e1 - e0) * w, start)
            after_store(j)
        if not nxt_dev:                 # host rows written: complete them (a resident round
            self.mover.synchronize()    # leaves its rows on the device, for the next one)

    def backward_round(self, run, gk: torch.Tensor, gprev: torch.Tensor, g0: torch.Tensor, c: float,
                       alpha: float, weight, x_saved, grad_w, before_chunk, after_flush, gk_dev: bool = False,
                       gprev_dev: bool = False, g0_dev: bool = False, x_dev: bool = False,
                       g0_host: torch.Tensor | None = None) -> None:
        """Chunks in reverse: ``gprev += A^T (c gk)``, ``g0 += alpha gk`` and, with ``x_saved``
        (``Z_(r-1)``), ``grad_w[e] += c gk[v] . x_saved[u]`` (``grad_w`` host; the ``*_dev``
        flags as in :meth:`forward_round`). ``g0_host``: after each chunk, the rows of the
        resident ``g0`` that entered it in forward are written there (the last round of the
        resident path: the gather reads them). ``before_chunk(i, j)`` runs before the ``i``-th
        chunk ``j`` reads ``gk[a:b]``, ``after_flush(i, j)`` after the rows first read by chunk
        ``j`` left the device."""
        w = int(gk.shape[1])
        n = self.num_chunks
        st = self.stream
        if not gprev_dev:
            self.counter.d2h_grad_nodedup += self.rows_nodedup * w * gk.element_size()
        load = None
        if x_saved is not None:
            load = (lambda u: self._load(x_saved, "leave", u, "rows", x_dev))  # noqa: E731
            if not x_dev:
                self.counter.h2d_rows_nodedup += self.rows_nodedup * w * gk.element_size()

        def flush(u, part, verts):
            self._add(part, gprev, "enter", u, "grad", gprev_dev)
            if g0_host is not None:
                self.mover.store_rows(g0.index_select(0, self._rows_on_device("enter", u)), g0_host, verts, "grad")
            after_flush(n - 1 - u, u)

        for step in st.backward((w,), gk.dtype, flush=flush, load=load):
            j = step.chunk
            a, b = self.bounds[j]
            before_chunk(n - 1 - j, j)
            t0 = time.perf_counter()
            with self.meter.scope(), torch.no_grad():
                block, wj = self._inputs(j, weight)
                x = None
                if x_saved is not None:
                    x = step.sources()
                    self.meter.track(x)
                g = self._range(gk, a, b, "grad", gk_dev)
                start = self._span_start()             # after the waits for the chunk's inputs
                g_rows = g * c if c != 1.0 else g
                gx = sum_adjoint(block, g_rows, wj, **kernel_options(self))
                self.meter.track(g, g_rows, gx)
                step.accumulate(gx)
                if alpha:
                    self._add(g * alpha, g0, "dst", j, "grad", g0_dev)
                if x is not None:
                    self.mover.add_range(edge_dot(block, g_rows, x, **kernel_options(self)), grad_w,
                                         self.edges[j][0], "edge_grad")
                x = g = g_rows = gx = None  # one chunk's tensors at a time (not two across chunks)
            e0, e1 = self.edges[j]
            run._agg(time.perf_counter() - t0, (e1 - e0) * w, start)
        if not (gprev_dev and g0_host is None and x_saved is None):
            self.mover.synchronize()    # host rows or flushes of the round (resident: none)


class TPRun:
    """What one rank needs to run :class:`TPPropagate`: the layout and its exchanges, the
    propagation matrix, the rounds and coefficients, time/volume accounting and, on the
    staged path, the :class:`DeviceStage`."""

    def __init__(self, tp: TPComm, layout: TPLayout, prop, pipeline: bool, stage: DeviceStage | None = None):
        self.tp, self.layout, self.prop, self.pipeline = tp, layout, prop, pipeline
        self.stage = stage
        self._aggregate_s = 0.0
        self._spans: list = []          # CUDA (start, end) event pairs of chunk aggregations
        self.edge_columns = 0
        self.alltoalls = 0
        self.record = True

    def reset(self) -> None:
        self._aggregate_s, self._spans, self.edge_columns, self.alltoalls = 0.0, [], 0, 0

    @property
    def aggregate_s(self) -> float:
        """Seconds of chunk aggregation since :meth:`reset`: host time on the CPU; on CUDA the
        device time between each chunk's events, resolved here (once per epoch: it waits for
        the last of them) instead of a synchronisation per chunk."""
        if self._spans:
            self._spans[-1][1].synchronize()
            self._aggregate_s += sum(s.elapsed_time(e) for s, e in self._spans) / 1e3
            self._spans = []
        return self._aggregate_s

    def _agg(self, seconds: float, columns: int = 0, start=None) -> None:
        """Count one chunk's aggregation: ``seconds`` of host time, or, with ``start`` (a CUDA
        event recorded on the compute stream before its kernels), the device time from
        ``start`` to now (an end event of the same kind, recorded here)."""
        if not self.record:
            return
        self.edge_columns += columns
        if start is None:
            self._aggregate_s += seconds
            return
        end = type(start)(enable_timing=True)
        end.record()
        self._spans.append((start, end))

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


class _LaggedPosts:
    """The gathers of the last round on the staged path, each posted (:func:`_post`) one chunk
    late: chunk ``i``'s host rows are still being copied from the device when it is handed in,
    so :meth:`add` waits only for the copies issued before the previous chunk's
    (:meth:`DeviceMover.settle`) and posts that one, while the device works on this chunk;
    :meth:`finish` posts the rest. Every rank posts the same exchanges in the same order."""

    def __init__(self, run: TPRun, handles: list, mover):
        self.run, self.handles, self.mover = run, handles, mover
        self._queue: list = []

    def add(self, i: int, start) -> None:
        self._queue.append((i, start, self.mover.mark()))
        if len(self._queue) > 1:
            self._post_oldest()

    def finish(self) -> None:
        while self._queue:
            self._post_oldest()

    def _post_oldest(self) -> None:
        i, start, mark = self._queue.pop(0)
        self.mover.settle(mark)
        _post(self.run, self.handles, i, start)


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
    device, the rounds through :class:`DeviceStage`; the exchanges' buffers in host memory, the
    slices between them on the device when the stage is resident (else in host memory). The
    exchanges and their order are the unstaged path's (same collectives, same overlap)."""
    lay, tp, st = run.layout, run.tp, run.stage
    res = st.resident
    h = h.detach().contiguous()
    width = int(h.shape[1])
    w = int(np.diff(column_bounds(width, lay.size))[lay.rank])
    n, v = lay.num_chunks, lay.num_nodes
    need_saved = edge_weight is not None and ctx.needs_input_grad[1]
    z0 = st.host_buffer("z0", (v, w), h.dtype, zero=True)          # the split's target
    # resident: Z_0 kept on the device from the first round's rows (later rounds' teleport and
    # GAT's saved Z_0)
    z0d = st.device_buffer("z0", (v, w), h.dtype, zero=True) if res and (k > 1 or need_saved) else None
    out = h.new_zeros((lay.num_own, width))
    splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.split_transfer(j), h, z0, "split"))
                              for j in range(n)])
    gathers, saved = [], []
    posts = _LaggedPosts(run, gathers, st.mover)
    prev, prev_dev = z0, False
    for r in range(1, k + 1):
        tag = f"z{r}" if need_saved else f"z{2 - r % 2}"
        nxt_dev = res and r < k                 # the last round's rows go to the gather (host)
        nxt = st.device_buffer(tag, (v, w), h.dtype) if nxt_dev else st.host_buffer(tag, (v, w), h.dtype)

        def before_load(j, first=r == 1):
            if first:
                _finish(splits, j)
                _drive(splits, j + 1)

        def after_store(j, last=r == k, nxt=nxt):
            if last:                        # posted once chunk j's rows are in host memory
                posts.add(j, lambda j=j: tp.start_to_rows(lay.gather_transfer(j), nxt, width, out, "gather"))

        if r == 1:
            st.forward_round(run, prev, nxt, None, c, alpha, edge_weight, before_load, after_store,
                             nxt_dev=nxt_dev, capture=z0d)
        else:
            st.forward_round(run, prev, nxt, z0d if res else z0, c, alpha, edge_weight, before_load, after_store,
                             prev_dev=prev_dev, nxt_dev=nxt_dev, z0_dev=res)
        if need_saved:
            saved.append((z0d, True) if r == 1 and res else (prev, prev_dev))
        prev, prev_dev = nxt, nxt_dev
    posts.finish()
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
    res = st.resident
    n, v = lay.num_chunks, lay.num_nodes
    g_out = grad_out.detach().contiguous()
    gk = st.host_buffer("gk", (v, w), g_out.dtype, zero=True)       # the split's target
    rev = list(range(n - 1, -1, -1))
    splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.gather_transfer(j), g_out, gk, "split"))
                              for j in rev])
    g0h = st.host_buffer("g0", (v, w), g_out.dtype, zero=True)      # the gather's source
    g0 = st.device_buffer("g0", (v, w), g_out.dtype, zero=True) if res else g0h
    grad_h = g_out.new_zeros((lay.num_own, width))
    grad_w = None
    if edge_weight is not None and ctx.needs_input_grad[1]:
        grad_w = torch.zeros_like(edge_weight)
    gathers = []
    posts = _LaggedPosts(run, gathers, st.mover)
    gk_dev = False
    for r in range(k, 0, -1):
        if r == 1:
            gprev = g0
        elif res:
            gprev = st.device_buffer(f"g{1 + r % 2}", (v, w), g_out.dtype, zero=True)
        else:
            gprev = st.host_buffer(f"g{1 + r % 2}", (v, w), g_out.dtype, zero=True)

        def before_chunk(i, j, first=r == k):
            if first:
                _finish(splits, i)
                _drive(splits, i + 1)

        def after_flush(i, j, last=r == 1):
            if last:                        # posted once every gradient of chunk j's rows is in g0
                posts.add(i, lambda j=j: tp.start_to_rows(lay.split_transfer(j), g0h, width, grad_h, "gather"))

        x_saved, x_dev = ctx.saved_z[r - 1] if grad_w is not None else (None, False)
        st.backward_round(run, gk, gprev, g0, c, alpha, edge_weight, x_saved, grad_w, before_chunk, after_flush,
                          gk_dev=gk_dev, gprev_dev=res, g0_dev=res, x_dev=x_dev,
                          g0_host=g0h if res and r == 1 else None)
        gk, gk_dev = gprev, res
    posts.finish()
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
            got = tp.comm.allgatherv(x, tr.counts)
        full = x.new_empty((lay.num_nodes, d))
        full[tr.ids] = got
        tp.stats.add("attention", (lay.size - 1) * x.numel() * x.element_size(), time.perf_counter() - t0, 1)
        ctx.tp = tp
        return full

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        tp = ctx.tp
        t0 = time.perf_counter()
        g = grad.detach().contiguous().clone()
        if tp.comm is not None:
            tp.comm.allreduce_(g)
        own = torch.from_numpy(tp.layout.own_ids).to(g.device)
        tp.stats.add("attention", g.numel() * g.element_size(), time.perf_counter() - t0, 1)
        return g.index_select(0, own), None


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
        from hpcgnn.comm.communicator import make_communicator

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
        from hpcgnn.engine.estimate import tensor_device_bytes

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

    def _fits_resident(self, cfg, meta, parts: int, chunks: int, device) -> bool:
        """Whether the staged path keeps its topology and slices on the device: a device budget
        exists (``tensor.device_memory``; none with the CPU's ``'auto'``, where the staged path
        streams) and the NN layers, one chunk's working set and :func:`resident_device_bytes`
        fit it."""
        from hpcgnn.engine.estimate import _tensor_cols, tensor_device_bytes

        if self._budget is None:
            return False
        t = cfg.tensor
        k = (t.k or cfg.model.layers) if t.mode == "decoupled" else 1
        nn_b, chunk_b = tensor_device_bytes(cfg, meta, parts, chunks, device.type)
        res_b = resident_device_bytes(self.prop.num_nodes, int(self.prop.indices.shape[0]), chunks,
                                      _tensor_cols(cfg, meta, parts), k, self.kind == "attention")
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
