"""Overlapping store reads with compute: a gather thread (CPU) and pinned double buffers copied
on a side stream (GPU).

:class:`Prefetcher` runs :meth:`FeatureStore.read_misses` of the *next* minibatch on one worker
thread while the main thread computes the current one (the native row gather and torch's
``index_select`` release the GIL). Only reads happen on the thread; planning, counting and
assembling stay on the main thread, in minibatch order, so results and counters do not depend
on thread timing. The same thread runs the minibatch engine's loader (:meth:`run`: the
sampling of a later minibatch, queued behind the reads). ``submit`` (planning) and ``get`` (blocked until the rows are there) add their time to
``store.counters.wait_seconds`` (with ``overlap = False`` the whole read happens in ``get``).

Thread teams: the rank has ``threads`` = T threads (:meth:`hpcgnn.runtime.Runtime.set_threads`).
OpenMP's team size (nthreads-var) is per thread, so the gather thread sizes its own team to
g (:func:`split_threads`) when it starts, and the main thread's teams (torch intra-op,
MKL and the native kernels) shrink to T - g while a gather is in flight (from the ``submit`` that
makes one pending to the ``get`` that leaves none; the engine keeps one pending through a
training epoch) and are T again otherwise. The two teams add up to T: no oversubscription. With
T = 1 (or a store whose ``read_misses`` does no work) there is no gather thread: ``overlap`` is
False and the read runs inline in ``get``.

Host -> device copies of the rows are :class:`hpcgnn.store.mover.DeviceMover`'s (pinned staging
buffers reused, side-stream copies; one mover for the stores and the engines).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


GATHER_SHARE = 0.25
"""Share of a rank's threads given to the gather thread's OpenMP team (:func:`split_threads`)."""


MIN_OVERLAP_THREADS = 4
"""Fewest threads of a rank that get a gather thread. Below, the read runs inline on the main
thread with all of them: on the 2-core development VM at T = 2 (products-like 0.04, 1 rank) an
epoch took 0.63 s inline, 0.78 s with a 1 + 1 split and 0.71 s with the former 2 + 2
oversubscription (docs/store.md, "Thread teams")."""


def split_threads(threads: int, share: float = GATHER_SHARE,
                  min_threads: int = MIN_OVERLAP_THREADS) -> tuple[int, int]:
    """(gather, compute) team sizes of a rank with ``threads`` threads while a gather is in
    flight: gather = max(1, round(threads * share)), at most threads - 1; compute = threads -
    gather. (0, threads) when threads < ``min_threads``: no gather thread, the read runs
    inline."""
    t = max(1, int(threads))
    if t < max(2, int(min_threads)):
        return 0, t
    g = min(t - 1, max(1, round(t * share)))
    return g, t - g


def set_calling_thread_team(n: int) -> None:
    """Size the calling thread's compute team: torch intra-op (and MKL) and the native kernels."""
    torch.set_num_threads(int(n))
    _native_set_threads(n)


def _native_set_threads(n: int) -> None:
    try:
        from hpcgnn import native
    except ImportError:        # pragma: no cover - only on a broken install
        return
    native.set_threads(int(n))


def _start_gather_thread(n: int) -> None:
    """Gather thread initialiser: its own OpenMP team of ``n``. torch initialises a thread's
    team lazily, to its global count, at the thread's first parallel op: do that first, then
    set this thread's nthreads-var (shared with torch's OpenMP backend)."""
    torch.get_num_threads()
    _native_set_threads(n)


class Prefetcher:
    """Double-buffered reads of a feature store (see the module docstring). ``submit(ids)``
    plans the gather and starts its host reads; ``get(handle)`` returns the rows.

    ``threads``: the rank's thread count T (default: torch's count on the calling thread, which
    must be the main thread). Attributes ``loader`` (a worker thread exists: with ``overlap``
    and T >= :data:`MIN_OVERLAP_THREADS`; the minibatch engine samples ahead on it, :meth:`run`),
    ``overlap`` (the store's reads run on it too: a store whose ``read_misses`` does work; a
    device store reads inline, on the compute stream, and still gets the loader),
    ``gather_threads`` (the worker's team, 0 without one) and ``compute_threads`` (the main
    thread's team while the worker has work)."""

    def __init__(self, store, overlap: bool = True, threads: int | None = None, share: float = GATHER_SHARE):
        self.store = store
        self.threads = max(1, int(threads if threads is not None else torch.get_num_threads()))
        g, c = split_threads(self.threads, share)
        self.loader = bool(overlap) and g > 0
        self.overlap = self.loader and getattr(store, "reads_on_thread", True)
        self.gather_threads, self.compute_threads = (g, c) if self.loader else (0, self.threads)
        self._pending = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcgnn-store",
                                        initializer=_start_gather_thread,
                                        initargs=(g,)) if self.loader else None

    def submit(self, ids: torch.Tensor):
        t0 = time.perf_counter()
        plan = self.store.plan(ids)
        fut = None
        if self.overlap:
            if self._pending == 0:
                set_calling_thread_team(self.compute_threads)
            self._pending += 1
            fut = self._pool.submit(self.store.read_misses, plan)
        self.store.counters.wait_seconds += time.perf_counter() - t0
        return plan, fut

    def get(self, handle) -> torch.Tensor:
        plan, fut = handle
        t0 = time.perf_counter()
        if isinstance(fut, Future):
            try:
                misses = fut.result()
            finally:
                self._collected()
        else:
            misses = self.store.read_misses(plan)
        rows = self.store.assemble(plan, misses)
        self.store.counters.wait_seconds += time.perf_counter() - t0
        return rows

    def run(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the gather thread, after the reads submitted before it (the
        minibatch engine's loader: the sampling of a later minibatch); the main thread's teams
        are T - g until :meth:`wait` collects it. Needs ``loader`` (a worker thread)."""
        if self._pool is None:
            raise RuntimeError("Prefetcher.run needs a worker thread (loader)")
        if self._pending == 0:
            set_calling_thread_team(self.compute_threads)
        self._pending += 1
        return self._pool.submit(fn, *args)

    def wait(self, fut: Future):
        """The result of a :meth:`run` (blocks until it is there; re-raises its exception)."""
        try:
            return fut.result()
        finally:
            self._collected()

    def _collected(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            set_calling_thread_team(self.threads)

    def close(self) -> None:
        """Stop the gather thread; the main thread's teams are T again (also with handles never
        collected)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            if self._pending:
                self._pending = 0
                set_calling_thread_team(self.threads)
