"""Host<->device row transfers for offloaded training, with byte and memory accounting.

:class:`RowMover` moves rows between host tensors (pinned when the device is
CUDA) and the compute device. On CUDA the host->device copies run on a side
stream (``non_blocking``) so the next batch's rows arrive while the current one
computes, and device->host gradient flushes land in pinned staging buffers that
the CPU adds into the host gradients once their copy has completed. With the
CPU as the "device" the same calls are plain copies.

:class:`TransferCounter` counts bytes per direction and kind (also the bytes a
plan without deduplication would have moved); :class:`DeviceMemoryMeter`
reports peak device memory: ``torch.cuda.max_memory_allocated`` on CUDA, and on
the CPU the peak of the bytes resident in the simulated device scope (explicit
buffers plus the tensors autograd saves while a chunk is on the "device").
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch


def host_empty(shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when ``pin`` (for async CUDA copies)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def host_zeros(shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
    t = host_empty(shape, dtype, pin)
    t.zero_()
    return t


@dataclass
class TransferCounter:
    """Bytes moved host->device and device->host, by kind.

    Kinds used by the engine: h2d ``rows`` (layer-input rows of the chunks'
    source sets), ``grad`` (output gradients), ``cache`` (cached aggregations);
    d2h ``out`` (layer outputs), ``cache``, ``grad`` (source gradients).
    ``h2d_rows_nodedup`` / ``d2h_grad_nodedup`` count the source-row / source-gradient
    bytes a plan without deduplication would have moved for the same work.
    """

    h2d: dict = field(default_factory=lambda: defaultdict(int))
    d2h: dict = field(default_factory=lambda: defaultdict(int))
    h2d_rows_nodedup: int = 0
    d2h_grad_nodedup: int = 0

    def add_h2d(self, kind: str, nbytes: int) -> None:
        self.h2d[kind] += int(nbytes)

    def add_d2h(self, kind: str, nbytes: int) -> None:
        self.d2h[kind] += int(nbytes)

    @property
    def h2d_total(self) -> int:
        return int(sum(self.h2d.values()))

    @property
    def d2h_total(self) -> int:
        return int(sum(self.d2h.values()))

    def reset(self) -> None:
        self.h2d.clear()
        self.d2h.clear()
        self.h2d_rows_nodedup = 0
        self.d2h_grad_nodedup = 0

    def as_dict(self) -> dict:
        out = {f"h2d_{k}_bytes": int(v) for k, v in sorted(self.h2d.items())}
        out.update({f"d2h_{k}_bytes": int(v) for k, v in sorted(self.d2h.items())})
        out.update(h2d_bytes=self.h2d_total, d2h_bytes=self.d2h_total,
                   h2d_rows_nodedup_bytes=int(self.h2d_rows_nodedup),
                   d2h_grad_nodedup_bytes=int(self.d2h_grad_nodedup))
        return out


class DeviceMemoryMeter:
    """Peak bytes resident on the compute device.

    CUDA: ``torch.cuda.max_memory_allocated`` since :meth:`reset`. CPU: explicit
    accounting; :meth:`hold` / :meth:`release` count long-lived buffers,
    :meth:`scope` counts tensors registered with :meth:`track` plus every
    tensor autograd saves inside it (each storage once) and releases them on exit.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.current = 0
        self.peak = 0
        self._seen: list[set] = []

    def reset(self) -> None:
        self.current = 0
        self.peak = 0
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _add(self, nbytes: int) -> None:
        self.current += int(nbytes)
        self.peak = max(self.peak, self.current)

    def hold(self, nbytes: int) -> None:
        """Count a buffer that stays resident until :meth:`release`."""
        self._add(nbytes)

    def release(self, nbytes: int) -> None:
        self.current -= int(nbytes)

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors living until the enclosing :meth:`scope` ends (each storage once)."""
        for t in tensors:
            if t is None:
                continue
            seen = self._seen[-1] if self._seen else None
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if seen is not None:
                if key in seen:
                    continue
                seen.add(key)
            self._add(t.untyped_storage().nbytes())

    @contextlib.contextmanager
    def scope(self):
        """Count tensors tracked or saved for backward inside; release them on exit."""
        start = self.current
        self._seen.append(set())

        def pack(t):
            self.track(t)
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            self._seen.pop()
            self.current = start

    @property
    def peak_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self.peak)


class _PendingFlush:
    """A device->host gradient copy in flight; ``finish()`` adds it into the host rows."""

    def __init__(self, staged: torch.Tensor, host: torch.Tensor, rows: torch.Tensor, event):
        self.staged, self.host, self.rows, self.event = staged, host, rows, event

    def finish(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.host.index_add_(0, self.rows, self.staged)


class RowMover:
    """Row copies between host tensors and ``device`` (side stream + pinned staging on CUDA)."""

    def __init__(self, device: torch.device, counter: TransferCounter):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.counter = counter
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._flushes: list[_PendingFlush] = []

    # -- host -> device --------------------------------------------------------
    def load_rows(self, host: torch.Tensor, rows: np.ndarray, kind: str) -> "Loaded":
        """Start copying ``host[rows]`` to the device; ``.get()`` returns the device tensor."""
        idx = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        self.counter.add_h2d(kind, idx.shape[0] * host[0:1].nbytes if host.shape[0] else 0)
        if not self.cuda:
            return Loaded(host.index_select(0, idx), None)
        staged = torch.empty((idx.shape[0],) + tuple(host.shape[1:]), dtype=host.dtype, pin_memory=True)
        torch.index_select(host, 0, idx, out=staged)
        return self._upload(staged)

    def load_range(self, host: torch.Tensor, begin: int, end: int, kind: str) -> "Loaded":
        """Start copying the contiguous rows ``host[begin:end]`` to the device."""
        part = host[begin:end]
        self.counter.add_h2d(kind, part.nbytes)
        if not self.cuda:
            return Loaded(part.clone(), None)
        return self._upload(part)

    def _upload(self, pinned: torch.Tensor) -> "Loaded":
        # The source is final host data and the destination a fresh allocation of the side
        # stream (handed to the compute stream by Loaded.get), so the copy need not wait for
        # the compute stream: it overlaps with the kernels already queued there.
        with torch.cuda.stream(self.stream):
            dev = pinned.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Loaded(dev, event)

    # -- device -> host --------------------------------------------------------
    def store_range(self, dev: torch.Tensor, host: torch.Tensor, begin: int, kind: str) -> None:
        """Copy ``dev`` into ``host[begin:begin+len]`` (completes by :meth:`synchronize`)."""
        self.counter.add_d2h(kind, dev.nbytes)
        target = host[begin:begin + dev.shape[0]]
        if not self.cuda:
            target.copy_(dev)
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            dev.record_stream(self.stream)
            target.copy_(dev, non_blocking=True)

    def add_rows(self, dev: torch.Tensor, host: torch.Tensor, rows: np.ndarray, kind: str) -> None:
        """``host[rows] += dev`` (CPU-side accumulation, HongTu's ⊕); completes by :meth:`drain`."""
        idx = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        self.counter.add_d2h(kind, dev.nbytes)
        if not self.cuda:
            host.index_add_(0, idx, dev)
            return
        staged = torch.empty(tuple(dev.shape), dtype=dev.dtype, pin_memory=True)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            dev.record_stream(self.stream)
            staged.copy_(dev, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._flushes.append(_PendingFlush(staged, host, idx, event))

    def drain(self) -> None:
        """Finish every pending gradient flush (CPU additions in issue order)."""
        for f in self._flushes:
            f.finish()
        self._flushes.clear()

    def synchronize(self) -> None:
        """Wait for every copy; host tensors are then up to date."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
            self.stream.synchronize()
        self.drain()


class Loaded:
    """A host->device copy; ``get()`` makes the compute stream wait for it."""

    def __init__(self, tensor: torch.Tensor, event):
        self.tensor, self.event = tensor, event

    def get(self) -> torch.Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
            self.tensor.record_stream(torch.cuda.current_stream(self.tensor.device))
            self.event = None
        return self.tensor
