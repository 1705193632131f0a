"""The one host <-> device staging component: feature-store reads (:mod:`hpcgnn.store`), the
offloaded full-graph engine's chunks (:mod:`hpcgnn.engine.offload`) and the tensor engine's
staged rounds (:class:`hpcgnn.engine.tensor_staging.DeviceStage`) all copy through :class:`DeviceMover`.
The small one-off copies of a step (indices, masks, sampled blocks) go through
:func:`hpcgnn.upload.upload` instead: no pool, no side stream, and no wait for the device either.

On the CPU (the "device" is host memory) every call is a plain copy, so results are bit for bit
those of in-memory code. On CUDA:

* **host -> device** rows are gathered into a *pinned staging buffer* taken from a
  :class:`StagingPool` (allocated once per size class and reused: page-locking is slow), copied
  with ``non_blocking=True`` on a side stream, and an event orders the consumer's stream after
  the copy (:meth:`Loaded.get` / :meth:`DeviceMover.receive`); the staging buffer goes back to
  the pool once that event has completed. Contiguous rows of an already pinned host tensor are
  copied without staging.
* **device -> host** writes into pinned host tensors run on the side stream after the compute
  stream's work (:meth:`DeviceMover.store_range`); gradient flushes (:meth:`DeviceMover.add_rows`,
  HongTu's host-side accumulation) land in pooled pinned staging and are added into the host rows
  by :meth:`DeviceMover.drain` once their copy is done.

``counter`` (optional; :class:`hpcgnn.engine.transfer.TransferCounter` or anything with
``add_h2d(kind, nbytes)`` / ``add_d2h(kind, nbytes)``) counts the bytes of every engine-side
copy by kind (bytes of the rows moved, the same on the CPU and on CUDA). The CUDA path ran on an
H200 with torch 2.11 (``make check-gpu``, docs/gpu.md).
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque

import numpy as np
import torch


def _size_class(numel: int) -> int:
    """Elements of the pooled buffer serving a request of ``numel`` (the next power of two)."""
    return 1 << max(0, int(numel) - 1).bit_length()


class StagingPool:
    """Reusable host staging buffers (page-locked when ``pin``), one free list per (dtype, size
    class). :meth:`take` returns a flat buffer of at least ``numel`` elements; :meth:`give`
    hands it back, optionally with an ``event`` (``query()`` / ``synchronize()``) that must
    complete before the buffer is reused. ``allocated`` counts buffers ever created (a pool
    in steady state stops allocating)."""

    def __init__(self, pin: bool):
        self.pin = bool(pin)
        self._free: dict = {}
        self._busy: deque = deque()       # (event, buffer): in use by a copy in flight
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = _size_class(numel)
        with self._lock:
            self._reclaim()
            free = self._free.get((dtype, size))
            if free:
                return free.pop()
            self.allocated += 1
        return torch.empty(size, dtype=dtype, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, event=None) -> None:
        with self._lock:
            if event is None:
                self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)
            else:
                self._busy.append((event, buf))

    def _reclaim(self) -> None:
        """Return buffers whose copy completed to the free lists (oldest first)."""
        while self._busy and self._busy[0][0].query():
            _, buf = self._busy.popleft()
            self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)

    def wait_all(self) -> None:
        """Wait for every copy still using a buffer; all buffers are free afterwards."""
        with self._lock:
            while self._busy:
                ev, buf = self._busy.popleft()
                ev.synchronize()
                self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)


class Loaded:
    """A host->device copy; ``get()`` returns the device tensor, ordered after the copy on the
    current stream."""

    def __init__(self, tensor: torch.Tensor, event=None):
        self.tensor, self.event = tensor, event

    def get(self) -> torch.Tensor:
        if self.event is not None:
            cur = torch.cuda.current_stream(self.tensor.device)
            cur.wait_event(self.event)
            self.tensor.record_stream(cur)
            self.event = None
        return self.tensor


class _PendingFlush:
    """A device->host row copy in flight; ``finish()`` adds it into the host rows (``add``) or
    writes them there."""

    def __init__(self, staged: torch.Tensor, flat: torch.Tensor, host: torch.Tensor, rows, event,
                 add: bool = True):
        self.staged, self.flat, self.host, self.rows, self.event = staged, flat, host, rows, event
        self.add = add

    def finish(self, pool: StagingPool) -> None:
        self.event.synchronize()
        _write_rows(self.host, self.rows, self.staged, self.add)
        pool.give(self.flat)


def _write_rows(host: torch.Tensor, rows, src: torch.Tensor, add: bool) -> None:
    """``host[rows] += src`` (``add``) or ``= src``; ``rows``: an index tensor or a ``slice``."""
    if isinstance(rows, slice):
        target = host[rows]
        target.add_(src) if add else target.copy_(src)
    elif add:
        host.index_add_(0, rows, src)
    else:
        host.index_copy_(0, rows, src)


def _index(rows) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        return rows.to("cpu", torch.int64)
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))


class DeviceMover:
    """Host <-> device row copies (see the module docstring); identity copies on the CPU."""

    def __init__(self, device, counter=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.counter = counter
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pool = StagingPool(pin=self.cuda)
        self._flushes: list[_PendingFlush] = []
        self._finished = 0              # flushes finished so far (drain, settle)

    @contextlib.contextmanager
    def _side_stream(self):
        """The side stream as the current stream, with the rank's device current too: the calls
        may come from another thread (the store's gather thread, the minibatch loader), whose
        current device is 0; leaving a stream scope restores that thread's previous device, and
        on a rank whose GPU is not 0 a CUDA context would then be made on GPU 0 (hundreds of MiB
        there, per rank). The device scope puts back the previous device only where it has a
        context already."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def _h2d(self, kind: str, nbytes: int) -> None:
        if self.counter is not None:
            self.counter.add_h2d(kind, nbytes)

    def _d2h(self, kind: str, nbytes: int) -> None:
        if self.counter is not None:
            self.counter.add_d2h(kind, nbytes)

    def _upload(self, pinned: torch.Tensor, flat: torch.Tensor | None = None) -> Loaded:
        """Copy a pinned host tensor to a fresh device tensor on the side stream; ``flat``: the
        pool buffer behind ``pinned``, returned to the pool once the copy is done. The source
        is final host data and the destination a fresh allocation of the side stream (handed
        to the consumer's stream by :meth:`Loaded.get`), so the copy need not wait for the
        compute stream."""
        with self._side_stream():
            dev = torch.empty(pinned.shape, dtype=pinned.dtype, device=self.device)
            dev.copy_(pinned, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        if flat is not None:
            self.pool.give(flat, event)
        return Loaded(dev, event)

    def _staged(self, shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(np.prod(shape)) if len(shape) else 1
        flat = self.pool.take(max(n, 1), dtype)
        return flat[:n].view(shape), flat

    # -- host -> device: the feature stores' interface (fill a staging view) ---------------------
    def move(self, fill, rows: int, dim: int, dtype: torch.dtype):
        """``fill(out)`` writes ``rows`` host rows into ``out`` ([rows, dim], pinned staging on
        CUDA, a fresh host tensor on the CPU); returns what :meth:`receive` turns into the
        device tensor. Safe for one caller thread at a time (the stores' gather thread)."""
        if not self.cuda:
            out = torch.empty(rows, dim, dtype=dtype)
            fill(out)
            return out
        host, flat = self._staged((rows, dim), dtype)
        fill(host)
        return self._upload(host, flat)

    def receive(self, moved) -> torch.Tensor:
        """The device tensor of :meth:`move`'s result, ordered after its copy on the current stream."""
        if moved is None or isinstance(moved, torch.Tensor):
            return moved
        return moved.get()

    # -- host -> device: the engines' interface (counted by kind) --------------------------------
    def load_rows(self, host: torch.Tensor, rows, kind: str) -> Loaded:
        """Start copying ``host[rows]`` to the device; ``.get()`` returns the device tensor."""
        idx = _index(rows)
        shape = (idx.shape[0],) + tuple(host.shape[1:])
        self._h2d(kind, idx.shape[0] * host[0:1].nbytes if host.shape[0] else 0)
        if not self.cuda:
            return Loaded(host.index_select(0, idx), None)
        staged, flat = self._staged(shape, host.dtype)
        torch.index_select(host, 0, idx, out=staged)
        return self._upload(staged, flat)

    def load_range(self, host: torch.Tensor, begin: int, end: int, kind: str) -> Loaded:
        """Start copying the contiguous rows ``host[begin:end]`` to the device."""
        part = host[begin:end]
        self._h2d(kind, part.nbytes)
        if not self.cuda:
            return Loaded(part.clone(), None)
        if part.is_pinned():
            return self._upload(part)
        staged, flat = self._staged(tuple(part.shape), part.dtype)
        staged.copy_(part)
        return self._upload(staged, flat)

    def load_all(self, host: torch.Tensor, kind: str) -> torch.Tensor:
        """A device copy of the whole host tensor (counted as ``kind``), ready on the current stream."""
        if host.shape[0] == 0:
            self._h2d(kind, 0)
            return host.to(self.device)
        return self.load_range(host, 0, int(host.shape[0]), kind).get()

    # -- device -> host --------------------------------------------------------------------------
    def store_range(self, dev: torch.Tensor, host: torch.Tensor, begin: int, kind: str) -> None:
        """Copy ``dev`` into ``host[begin:begin+len]`` (a pinned host tensor on CUDA; complete
        after :meth:`synchronize`)."""
        self._d2h(kind, dev.nbytes)
        target = host[begin:begin + dev.shape[0]]
        if not self.cuda:
            target.copy_(dev)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._side_stream():
            dev.record_stream(self.stream)
            target.copy_(dev, non_blocking=True)

    def add_rows(self, dev: torch.Tensor, host: torch.Tensor, rows, kind: str) -> None:
        """``host[rows] += dev`` (host-side accumulation, HongTu's ⊕); complete after :meth:`drain`."""
        self._flush(dev, host, rows, kind, add=True)

    def add_range(self, dev: torch.Tensor, host: torch.Tensor, begin: int, kind: str) -> None:
        """``host[begin:begin+len] += dev`` (as :meth:`add_rows` on a contiguous range, without
        an index array); complete after :meth:`drain`."""
        self._flush(dev, host, slice(int(begin), int(begin) + int(dev.shape[0])), kind, add=True)

    def store_rows(self, dev: torch.Tensor, host: torch.Tensor, rows, kind: str) -> None:
        """``host[rows] = dev`` (scattered device rows written back); complete after :meth:`drain`."""
        self._flush(dev, host, rows, kind, add=False)

    def _flush(self, dev: torch.Tensor, host: torch.Tensor, rows, kind: str, add: bool) -> None:
        idx = rows if isinstance(rows, slice) else _index(rows)
        self._d2h(kind, dev.nbytes)
        if not self.cuda:
            _write_rows(host, idx, dev, add)
            return
        staged, flat = self._staged(tuple(dev.shape), dev.dtype)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._side_stream():
            dev.record_stream(self.stream)
            staged.copy_(dev, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._flushes.append(_PendingFlush(staged, flat, host, idx, event, add))

    def drain(self) -> None:
        """Finish every pending gradient flush (host additions in issue order)."""
        for f in self._flushes:
            f.finish(self.pool)
        self._finished += len(self._flushes)
        self._flushes.clear()

    def mark(self):
        """A point in the device->host copies issued so far, for :meth:`settle`: lets a caller
        hand the host rows of one chunk on while the device computes the next, instead of
        waiting for everything (:meth:`synchronize`) after every chunk."""
        issued = self._finished + len(self._flushes)
        if not self.cuda:
            return None, issued
        event = torch.cuda.Event()
        event.record(self.stream)       # the side stream follows the compute stream's writes
        return event, issued

    def settle(self, mark) -> None:
        """Wait for the copies issued before ``mark`` (:meth:`mark`) and finish the flushes
        among them (in issue order); later copies stay in flight."""
        event, flushes = mark
        if event is not None:
            event.synchronize()
        done = max(0, flushes - self._finished)
        for f in self._flushes[:done]:
            f.finish(self.pool)
        del self._flushes[:done]
        self._finished += done

    def synchronize(self) -> None:
        """Wait for every copy; host tensors are then up to date."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
            self.stream.synchronize()
        self.drain()
