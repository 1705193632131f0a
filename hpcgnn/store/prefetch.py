"""Overlapping store reads with compute: a gather thread (CPU) and pinned double buffers copied
on a side stream (GPU).

:class:`Prefetcher` runs :meth:`FeatureStore.read_misses` of the *next* minibatch on one worker
thread while the main thread computes the current one (the native row gather and torch's
``index_select`` release the GIL). Only reads happen on the thread; planning, counting and
assembling stay on the main thread, in minibatch order, so results and counters do not depend
on thread timing. ``submit`` (planning) and ``get`` (blocked until the rows are there) add their time to
``store.counters.wait_seconds`` (with ``overlap = False`` the whole read happens in ``get``).

:class:`DeviceMover` moves host rows to the device. On the CPU it is the identity. On a GPU the
rows are gathered into one of two pinned staging buffers (alternating, so batch k+1 is
written while batch k's copy may still run), copied with ``non_blocking=True`` on a side
stream, and an event orders the main stream after the copy (``receive``). This CUDA path is
written for torch >= 2.11 and has not run on a GPU in this repository's tests (docs/store.md).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class DeviceMover:
    """Host rows -> device rows; identity on the CPU (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._turn = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self._staging = [None, None]     # pinned buffers, grown as needed
            self._done = [None, None]        # event: the last copy out of that buffer finished

    def move(self, fill, rows: int, dim: int, dtype: torch.dtype):
        """``fill(out)`` writes ``rows`` host rows into ``out`` (a pinned [rows, dim] view); returns
        what :meth:`receive` turns into the device tensor. Thread-safe for one caller at a time."""
        i = self._turn
        self._turn ^= 1
        if self._done[i] is not None:
            self._done[i].synchronize()       # the copy that last read this buffer is finished
        buf = self._staging[i]
        if buf is None or buf.numel() < rows * dim or buf.dtype != dtype:
            buf = torch.empty(max(rows * dim, 1), dtype=dtype).pin_memory()
            self._staging[i] = buf
        host = buf[:rows * dim].view(rows, dim)
        fill(host)
        with torch.cuda.stream(self.stream):
            dev = torch.empty(rows, dim, dtype=dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._done[i] = ev
        return dev, ev

    def receive(self, moved) -> torch.Tensor:
        """The device tensor of :meth:`move`'s result, ordered after its copy on the current stream."""
        if not self.cuda or moved is None or isinstance(moved, torch.Tensor):
            return moved
        dev, ev = moved
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(ev)
        dev.record_stream(cur)
        return dev


class Prefetcher:
    """Double-buffered reads of a feature store (see the module docstring). ``submit(ids)``
    plans the gather and starts its host reads; ``get(handle)`` returns the rows."""

    def __init__(self, store, overlap: bool = True):
        self.store = store
        self.overlap = bool(overlap)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcgnn-store") if self.overlap else None

    def submit(self, ids: torch.Tensor):
        t0 = time.perf_counter()
        plan = self.store.plan(ids)
        fut = None if self._pool is None else self._pool.submit(self.store.read_misses, plan)
        self.store.counters.wait_seconds += time.perf_counter() - t0
        return plan, fut

    def get(self, handle) -> torch.Tensor:
        plan, fut = handle
        t0 = time.perf_counter()
        misses = fut.result() if isinstance(fut, Future) else self.store.read_misses(plan)
        rows = self.store.assemble(plan, misses)
        self.store.counters.wait_seconds += time.perf_counter() - t0
        return rows

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
