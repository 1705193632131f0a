"""The one chunk-streaming loop: a rank's chunks go through the compute device unit by unit along
a de-duplicated transfer plan (:func:`hpcgnn.engine.chunk_schedule.build_transfer_plan`). Used by
the offloaded full-graph engine (:mod:`hpcgnn.engine.offload`, HongTu: batches of chunks) and the
tensor engine's staged rounds (:class:`hpcgnn.engine.tensor_staging.DeviceStage`, one chunk per unit).

**Forward** (:meth:`ChunkStream.forward`): a device buffer of ``plan.capacity`` rows; per unit, the
rows not resident in the previous unit arrive (``load(u)``: a
:class:`~hpcgnn.store.mover.Loaded`) and are copied into their slots, the next unit's rows are
requested (:meth:`StreamStep.prefetch`, at the consumer's chosen point or after the unit) while
this one computes, and every chunk of the unit is yielded as a :class:`StreamStep` whose
:meth:`~StreamStep.sources` are its source rows (a view of the buffer when they are its prefix).

**Backward** (:meth:`ChunkStream.backward`): units in reverse; rows entering the device are those
leaving it in forward (their input rows reloaded when ``load`` is given); a gradient buffer with
the same slots accumulates ``A^T g``; after a unit, the rows that entered it in forward leave the
device: ``flush(u, rows, vertices)`` receives their gradients (HongTu's host-side ⊕, or a device
accumulation on the resident path).

The device-side index tensors (every chunk's source slots, every unit's entering and leaving
slots) are built once, on the device, and kept (``index_on_device``; otherwise they stay in host
memory, page-locked on CUDA, and are copied per use). Meter accounting: the buffers are held for
the pass, arriving rows while they are copied in, gathered sources inside the consumer's scope.
"""
from __future__ import annotations

import numpy as np
import torch


class StreamStep:
    """One chunk of a pass: ``unit`` (position in the plan), ``k`` (position in the unit),
    ``chunk`` (chunk id), ``slots`` (device slots of its sources), ``identity`` (sources are the
    buffer's prefix in order), ``buf`` (the row buffer; None in a backward pass without
    input rows), ``gbuf`` (backward: the gradient buffer)."""

    __slots__ = ("stream", "unit", "k", "chunk", "slots", "identity", "buf", "gbuf", "_prefetch")

    def __init__(self, stream, unit, k, chunk, buf, gbuf, prefetch):
        self.stream, self.unit, self.k, self.chunk = stream, unit, k, chunk
        self.slots = stream.chunk_slots[unit][k]
        self.identity = stream.identity[unit][k]
        self.buf, self.gbuf, self._prefetch = buf, gbuf, prefetch

    def prefetch(self) -> None:
        """Request the next unit's rows now (idempotent; done after the unit otherwise)."""
        self._prefetch()

    def sources(self) -> torch.Tensor:
        """The chunk's source rows from the buffer (tracked by the meter when gathered)."""
        if self.identity:             # the buffer's prefix: no slot index to copy to the device
            return self.buf[:self.slots.shape[0]]
        x = self.buf.index_select(0, self.stream.dev(self.slots))
        self.stream.meter.track(x)
        return x

    def accumulate(self, grad: torch.Tensor) -> None:
        """``gbuf[slots] += grad`` (the chunk's source gradients)."""
        if self.identity:
            self.gbuf[:grad.shape[0]].add_(grad)
        else:
            self.gbuf.index_add_(0, self.stream.dev(self.slots), grad)


class _Prefetcher:
    """The pending load of the next unit's rows (issued at most once per unit)."""

    def __init__(self, load, before_load, order):
        self.load, self.before_load, self.order = load, before_load, order
        self.pending = None
        self.issued = -1

    def issue(self, pos: int) -> None:
        if pos <= self.issued or pos >= len(self.order):
            return
        self.issued = pos
        if self.before_load is not None:
            self.before_load(self.order[pos])
        self.pending = self.load(self.order[pos])


class ChunkStream:
    """The de-duplicated chunk-streaming loop over ``plan`` (see the module docstring).

    ``chunks``: the :class:`~hpcgnn.engine.chunk_schedule.Chunk` list the plan refers to;
    ``meter``: the rank's device-memory meter (``hold``/``release``/``track``)."""

    def __init__(self, chunks, plan, device, meter, index_on_device: bool = True):
        self.chunks, self.plan = chunks, plan
        self.device = torch.device(device)
        self.meter = meter
        self.cuda = self.device.type == "cuda"
        self.index_on_device = bool(index_on_device) or not self.cuda
        pin = self.cuda and not self.index_on_device
        put = (lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)) \
            if self.index_on_device else \
            (lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).pin_memory() if pin
             else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)))
        units = plan.units
        self.chunk_slots = [[put(s) for s in u.chunk_slots] for u in units]
        self.identity = [[bool(np.array_equal(s, np.arange(s.shape[0]))) for s in u.chunk_slots] for u in units]
        self.enter_rows = [u.vertices[u.enter] for u in units]
        self.leave_rows = [u.vertices[u.leave] for u in units]
        self.enter_slots = [put(u.slots[u.enter]) for u in units]
        self.leave_slots = [put(u.slots[u.leave]) for u in units]

    @property
    def num_units(self) -> int:
        return len(self.plan.units)

    def index_bytes(self) -> int:
        """Bytes of the index tensors (on the device with ``index_on_device``)."""
        ts = [t for u in self.chunk_slots for t in u] + self.enter_slots + self.leave_slots
        return int(sum(t.nbytes for t in ts))

    def dev(self, t: torch.Tensor) -> torch.Tensor:
        """An index tensor on the device (a copy per use when the indices stay in host memory)."""
        return t if t.device == self.device else t.to(self.device, non_blocking=True)

    def forward(self, load, row_shape, dtype, before_load=None, received=None, early_prefetch: bool = False):
        """Generator of a forward pass: one :class:`StreamStep` per chunk, in plan order.

        ``load(u)``: a :class:`~hpcgnn.store.mover.Loaded` of the rows ``enter_rows[u]`` (row
        shape ``row_shape``); ``before_load(u)`` runs before it; ``received(u, rows)`` sees
        the rows once they are on the device; ``early_prefetch``: request the next unit's rows
        as soon as this unit's are in the buffer (else at :meth:`StreamStep.prefetch` or after
        the unit)."""
        units = self.plan.units
        buf = torch.empty((self.plan.capacity,) + tuple(row_shape), dtype=dtype, device=self.device)
        self.meter.hold(buf.nbytes)
        order = list(range(len(units)))
        pre = _Prefetcher(load, before_load, order)
        try:
            pre.issue(0)
            for ui, unit in enumerate(units):
                rows = pre.pending.get()
                pre.pending = None
                self.meter.hold(rows.nbytes)
                buf.index_copy_(0, self.dev(self.enter_slots[ui]), rows)
                if received is not None:
                    received(ui, rows)
                self.meter.release(rows.nbytes)
                del rows                 # in the buffer now: not held beside it while the unit computes
                if early_prefetch:
                    pre.issue(ui + 1)
                nxt = (lambda p=ui + 1: pre.issue(p))
                for k, c in enumerate(unit.chunks):
                    yield StreamStep(self, ui, k, c, buf, None, nxt)
                pre.issue(ui + 1)
        finally:
            self.meter.release(buf.nbytes)

    def backward(self, row_shape, dtype, flush=None, load=None, before_load=None):
        """Generator of a backward pass: units in reverse, their chunks in reverse, one
        :class:`StreamStep` each (``gbuf``: the gradient buffer when ``flush`` is given,
        ``buf``: the reloaded input rows when ``load`` is given).

        ``load(u)``: a :class:`~hpcgnn.store.mover.Loaded` of the rows ``leave_rows[u]``
        (requested one unit ahead); ``flush(u, grads, vertices)``: after unit ``u``, the
        gradients of the rows that entered it in forward (their slots' rows of ``gbuf``)."""
        units = self.plan.units
        order = list(range(len(units) - 1, -1, -1))
        buf = gbuf = None
        if load is not None:
            buf = torch.empty((self.plan.capacity,) + tuple(row_shape), dtype=dtype, device=self.device)
            self.meter.hold(buf.nbytes)
        if flush is not None:
            gbuf = torch.zeros((self.plan.capacity,) + tuple(row_shape), dtype=dtype, device=self.device)
            self.meter.hold(gbuf.nbytes)
        pre = _Prefetcher(load, before_load, order) if load is not None else None
        try:
            if pre is not None:
                pre.issue(0)
            for pos, ui in enumerate(order):
                unit = units[ui]
                entering = self.dev(self.leave_slots[ui])
                if pre is not None:
                    rows = pre.pending.get()
                    pre.pending = None
                    self.meter.hold(rows.nbytes)
                    buf.index_copy_(0, entering, rows)
                    self.meter.release(rows.nbytes)
                    del rows
                    pre.issue(pos + 1)
                if gbuf is not None:
                    gbuf.index_fill_(0, entering, 0.0)
                for k in reversed(range(len(unit.chunks))):
                    yield StreamStep(self, ui, k, unit.chunks[k], buf, gbuf, lambda: None)
                if gbuf is not None:      # rows not resident in the previous unit leave the device now
                    flush(ui, gbuf.index_select(0, self.dev(self.enter_slots[ui])), self.enter_rows[ui])
        finally:
            for t in (buf, gbuf):
                if t is not None:
                    self.meter.release(t.nbytes)
