"""The tensor-parallel engine's host-device staging: :class:`DeviceStage` streams the propagation
matrix's chunks and the ``[V, C/P]`` column slices through the compute device for the
aggregation rounds of :class:`~hpcgnn.comm.tp_propagate.TPPropagate` (``train.device = "cuda"``,
or ``tensor.staged`` with the CPU as the device), resident or streamed. The engine that builds
it is :mod:`hpcgnn.engine.tensor`; the device bytes of the resident path are
:func:`hpcgnn.engine.memory_tensor.resident_device_bytes`.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

from hpcgnn.nn.aggregate import kernel_options
from hpcgnn.nn.decoupled import edge_dot, sum_adjoint


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
