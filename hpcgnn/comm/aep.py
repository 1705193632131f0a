"""Asynchronous Embedding Push (DistGNN-MB §3.5, Algorithm 2).

At layer ``l`` of iteration ``k`` a rank pushes, to every rank ``q``, the layer-input rows
``h_l`` of the solid vertices of its current frontier ``S_l`` that are halo vertices on ``q``
(``db_halo``, :meth:`Partition.send_list`), at most ``nc`` per destination chosen with
DistGNN-MB's degree-biased sampling. The push sends the global IDs (int64) and the rows
(float32) non-blocking through a capped exchange of the data plane
(:meth:`~hpcgnn.comm.communicator.Communicator.open_capped`; with mpi4py point-to-point into
receive buffers of min(``nc``, the halo vertices that source owns) rows, with torch.distributed
async collectives padded to those caps): no blocking count exchange, so posting a push never
waits for another rank (the blocking count alltoall it replaced made every layer of every
iteration a synchronisation point). The receiver consumes the message posted at layer ``l`` of
iteration ``k`` at layer ``l`` of iteration ``k + d``; the messages of one layer match in the
order they were posted (one tag pair per layer, on a channel of the AEP's own).

:class:`DestinationMap` is ``db_halo`` inverted once at start-up into a CSR from local vertex to
destination ranks (none for halo vertices), so selecting the candidates of a frontier costs
O(|frontier| + candidates) vectorised numpy work, independent of the number of ranks. The send
and receive buffers of a layer are allocated once and reused: a push takes a free set, the
receive that completes its exchange gives it back (at most ``d`` sets per layer are in flight).

**Staged pushes** (rows on a device). A push whose layer input lives on a GPU gathers the rows
there and copies them with ``non_blocking=True`` into its buffer set's page-locked host rows,
then records an event after the copy: it never waits for the device. Such a push is *staged*:
its exchange starts once the event has completed, from a later call (:meth:`push`,
:meth:`progress`: the leading staged pushes whose events completed; :meth:`receive`: every
staged push up to the one it consumes, waiting on their events). One FIFO of staged pushes per
channel keeps the exchanges starting in the order they were posted, across layers, on every
rank. A push from a CPU layer input writes its rows before returning and starts its exchange at
once, as it always did. Pushes are staged only on an ``independent`` channel (mpi4py's: a
communicator of its own whose point-to-point messages match by tag in posting order), where
the start points may differ between ranks. On a torch.distributed plane the capped exchanges are
collectives of the plane's process group, which the gradient allreduce uses too: collectives
must start in the same order on every rank, so there a push waits for its copy and starts at
once (NCCL's exchange takes device rows anyway).

Every rank must call :meth:`AsyncEmbeddingPush.push` and :meth:`AsyncEmbeddingPush.receive` in
the same order (they are collectives): the engine equalises the iteration count M over ranks
and pushes for ``k < M - d`` and receives for ``k >= d`` at every layer, so nothing is
outstanding at the end of an epoch (:meth:`AsyncEmbeddingPush.assert_drained`).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hpcgnn.comm.communicator import Communicator
from hpcgnn.upload import upload


def device_event(device: torch.device):
    """The default ``copy_event`` of :class:`AsyncEmbeddingPush`: after the rows' copy from
    ``device`` has been queued on its current stream, an event recorded there (``query()``: True
    once the copy has run, without waiting; ``synchronize()``: wait for it), or None on the CPU
    (the rows are in place when the copy returns)."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event
    event = torch.Event(device=device)
    event.record()
    return event


class DestinationMap:
    """For each local vertex, the ranks on which it is a halo vertex (CSR; none for halo rows).

    ``indptr`` int64 [n_local+1] (constant over the halo rows ``num_solid..n_local``), ``ranks``
    [S] (int16 while the rank count fits, so the grouping sort is a radix sort); built from
    ``Partition.send_list``. ``count`` [n_local] (uint8 below 256 ranks) and ``first`` [n_local]
    (the first destination; meaningful where ``count > 0``) are compact copies for the common
    case, read per frontier vertex (a random gather into an array 8-16x smaller than ``indptr``).
    """

    def __init__(self, part):
        k = part.num_parts
        counts = np.diff(part.send_indptr).astype(np.int64)
        rank_t = np.int16 if k <= np.iinfo(np.int16).max else np.int32
        dest = np.repeat(np.arange(k, dtype=rank_t), counts)
        local = (part.send_ids - part.solid_begin).astype(np.int64)
        order = np.lexsort((dest, local))              # by vertex, then by rank
        self.num_solid = part.num_solid
        self.num_local = part.num_solid + part.num_halo
        self.num_parts = k
        self.ranks = dest[order]
        per_vertex = np.bincount(local, minlength=self.num_local)
        self.indptr = np.zeros(self.num_local + 1, dtype=np.int64)
        np.cumsum(per_vertex, out=self.indptr[1:])
        self.count = per_vertex.astype(np.uint8 if k <= 256 else np.int32)
        self.first = np.zeros(self.num_local, dtype=rank_t)
        has = per_vertex > 0
        self.first[has] = self.ranks[self.indptr[:-1][has]]

    def expand(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position in ``local``, destination rank int32) of every (vertex, rank) pair.

        ``local``: local vertex IDs (solid or halo; halo vertices have no destinations). Pairs
        come grouped by destination rank (ascending); within a rank in the order of ``local``
        (a stable sort).
        """
        v = np.asarray(local, dtype=np.int64)
        cnt = self.count[v]
        nz = np.flatnonzero(cnt)
        if nz.shape[0] == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        cnt = cnt[nz].astype(np.int64)
        total = int(cnt.sum())
        if total == nz.shape[0]:                       # one destination each (always at 2 ranks)
            pos, ranks = nz, self.first[v[nz]]
        else:
            pos = np.repeat(nz, cnt)
            start = self.indptr[v[nz]]
            ranks = self.ranks[np.repeat(start - (np.cumsum(cnt) - cnt), cnt) + np.arange(total, dtype=np.int64)]
        if (ranks[1:] < ranks[:-1]).any():
            order = np.argsort(ranks, kind="stable")
            pos, ranks = pos[order], ranks[order]
        return pos, ranks.astype(np.int32)


@dataclass
class PushRecord:
    """What one push sent (for the debug record): per destination rank the global IDs and rows."""

    epoch: int
    iteration: int
    layer: int
    ids: np.ndarray          # int64 [n] sent, grouped by destination
    dest: np.ndarray         # int32 [n] destination rank of each row
    rows: np.ndarray         # float32 [n, D]


@dataclass(eq=False)           # compared by identity (its buffers hold arrays)
class _Pending:
    """One posted push: staged (``exchange`` None, its rows' copy behind ``event``) until its
    exchange starts, then in flight until received."""

    epoch: int
    iteration: int
    layer: int
    buffers: "_Buffers"      # its send and receive buffers, in use until it completes
    counts: np.ndarray       # rows per destination rank (int64 [size])
    event: object = None     # the rows' copy from the device (None: the rows are in place)
    exchange: object = None  # the capped exchange's Pending of (ids, rows); None while staged


@dataclass
class _Buffers:
    """One push's buffers: send IDs [send_cap] and rows [send_cap, D] (host float32, page-locked
    when ``pinned``: the rows come from a CUDA device); receive buffers (CPU tensors, mpi4py
    only) per array, per other rank (``recv_caps[q]`` rows)."""

    ids: np.ndarray
    rows: torch.Tensor
    recv: list
    pinned: bool = False


@dataclass
class AEPCounters:
    """Per-epoch counters of one rank (bytes: IDs and rows). ``wait_seconds``: receives waiting
    for exchanges, and for staged pushes' copies from the device; ``push_seconds``: posting
    pushes and starting their exchanges in :meth:`~AsyncEmbeddingPush.push` and
    :meth:`~AsyncEmbeddingPush.receive` (both in the engine's forward; starts from
    :meth:`~AsyncEmbeddingPush.progress` are its caller's time, the engine's housekeeping)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    push_seconds: float = 0.0
    rows_sent: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    rows_received: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    candidates: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    max_rows_to_one_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class AsyncEmbeddingPush:
    """The AEP channel of one rank: a FIFO of posted exchanges per layer.

    ``comm``: the data plane (a :class:`~hpcgnn.comm.communicator.Communicator`); ``degrees``
    are the solid vertices' degrees (biasing the ``nc`` cap); ``max_degree`` the global maximum
    degree (the paper's ``hil = floor(log2(max degree))``). ``copy_event(device)``: called after
    a push queued its rows' copy from ``device`` (only for pushes with rows), it returns an
    object with ``query()`` and ``synchronize()`` that completes with that copy, or None when
    the rows are in place already; a push with an event is staged (module docstring). Default
    :func:`device_event` (None on the CPU); tests pass a stand-in that completes when told.
    """

    def __init__(self, comm: Communicator, part, num_layers: int, nc: int, delay: int, max_degree: int,
                 record: bool = False, copy_event=device_event):
        from hpcgnn.sampling.choice import degree_biased_choice

        if not isinstance(comm, Communicator):
            raise TypeError(f"AEP: comm must be a Communicator, got {type(comm).__name__}")
        self._choice = degree_biased_choice
        self.rank = comm.rank
        self.size = comm.size
        self.backend = comm.name     # mpi4py receives in place into reused buffers
        self.solid_begin = part.solid_begin
        self.num_solid = part.num_solid
        self.degrees = np.ascontiguousarray(part.degree, dtype=np.int64)
        self.max_degree = int(max_degree)
        self.destinations = DestinationMap(part)
        self.num_layers = int(num_layers)
        self.nc = int(nc)
        # The most rows rank q can push here per layer: nc, or fewer when q owns fewer of this
        # rank's halo vertices (receive buffers are this large).
        owned = np.bincount(np.asarray(part.halo_owner, dtype=np.int64), minlength=self.size)
        self.recv_caps = np.minimum(owned[:self.size], self.nc)
        self.recv_caps[self.rank] = 0
        self.peers = [q for q in range(self.size) if q != self.rank]
        self.channel = comm.open_capped(self.recv_caps)   # collective; the AEP's tags are its own
        # staged pushes start late, at points that differ between ranks: only where that
        # cannot reorder collectives (module docstring)
        self.stages = bool(getattr(self.channel, "independent", False))
        # The most rows this rank pushes per layer: per destination nc, or its halo vertices there.
        sends = np.diff(np.asarray(part.send_indptr, dtype=np.int64))[:self.size].copy()
        sends[self.rank] = 0
        self.send_cap = int(np.minimum(sends, self.nc).sum())
        self.delay = int(delay)
        self.record = record
        self.pushes: list[PushRecord] = []
        self.receives: list[PushRecord] = []
        self.copy_event = copy_event
        self._queues = [collections.deque() for _ in range(self.num_layers)]
        self._staged: collections.deque[_Pending] = collections.deque()   # posting order, all layers
        self._free: list[list[_Buffers]] = [[] for _ in range(self.num_layers)]
        self.reset_counters()

    def reset_counters(self, epoch: int = 0) -> None:
        """Zero the counters at the start of ``epoch`` (which labels debug records)."""
        self.epoch = int(epoch)
        L = self.num_layers
        self.counters = AEPCounters(rows_sent=np.zeros(L, np.int64), rows_received=np.zeros(L, np.int64),
                                    candidates=np.zeros(L, np.int64),
                                    max_rows_to_one_rank=np.zeros(L, np.int64))

    def select(self, frontier_local: np.ndarray, rng_key: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Rows to push from a frontier: (positions in the frontier, destination counts, candidates).

        Positions are grouped by destination rank; at most ``nc`` per destination, chosen by
        :func:`~hpcgnn.sampling.choice.degree_biased_choice` with key ``(rng_key, dest)`` mixed.
        """
        f = np.asarray(frontier_local, dtype=np.int64)
        pos, ranks = self.destinations.expand(f)
        counts = np.bincount(ranks, minlength=self.size).astype(np.int64)
        candidates = int(pos.shape[0])
        if counts.max(initial=0) > self.nc:
            keep = []
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for q in np.flatnonzero(counts):
                seg = pos[bounds[q]:bounds[q + 1]]
                if seg.shape[0] > self.nc:
                    vid = f[seg]
                    chosen = self._choice(vid + self.solid_begin, self.degrees[vid], self.nc,
                                          (rng_key ^ (int(q) * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1),
                                          max_degree=self.max_degree).numpy()
                    seg = seg[chosen]
                    counts[q] = seg.shape[0]
                keep.append(seg)
            pos = np.concatenate(keep) if keep else pos[:0]
        return pos, counts, candidates

    def _buffers(self, layer: int, width: int, rows: int, pinned: bool) -> "_Buffers":
        """A free buffer set of ``layer`` for ``rows`` send rows of ``width`` floats (allocated on
        first use, when the width changed, or larger when ``rows`` exceeds ``send_cap``; its rows
        page-locked iff ``pinned``, reallocated when that changed)."""
        free = self._free[layer]
        while free:
            b = free.pop()
            if b.rows.shape[1] == width:
                if b.ids.shape[0] < rows or b.pinned != pinned:
                    n = max(b.ids.shape[0], rows)
                    b.ids = np.empty(n, np.int64)
                    b.rows, b.pinned = torch.empty((n, width), dtype=torch.float32, pin_memory=pinned), pinned
                return b
        n = max(self.send_cap, rows)
        recv = [[torch.empty(int(self.recv_caps[q]), dtype=torch.int64) for q in self.peers],
                [torch.empty((int(self.recv_caps[q]), width), dtype=torch.float32) for q in self.peers]] \
            if self.backend == "mpi4py" else []
        return _Buffers(np.empty(n, np.int64), torch.empty((n, width), dtype=torch.float32, pin_memory=pinned),
                        recv, pinned)

    def push(self, layer: int, iteration: int, frontier_local: np.ndarray, h: torch.Tensor,
             rng_key: int) -> None:
        """Collective: post the push of layer ``layer`` at ``iteration`` (rows of ``h`` = frontier).

        On an independent channel (mpi4py's) it never waits for a device: rows of a device ``h`` are gathered
        there and copied asynchronously into page-locked host rows, and the push stays staged
        until that copy has run (module docstring); ``h`` may be changed by work queued on its
        stream after this call. Rows of a CPU ``h`` are copied before this returns and the
        exchange starts at once, as on a torch.distributed plane after the copy. Staged pushes
        posted earlier whose copies have run are started first (posting order)."""
        t0 = time.perf_counter()
        pos, counts, candidates = self.select(frontier_local, rng_key)
        n = int(pos.shape[0])
        hd = h.detach()
        buf = self._buffers(layer, int(h.shape[1]), n, pinned=hd.device.type == "cuda")
        ids = buf.ids[:n]
        np.take(np.asarray(frontier_local, dtype=np.int64), pos, out=ids)
        ids += self.solid_begin
        rows = buf.rows[:n]
        event = None
        if n and hd.device.type == "cpu":
            if hd.dtype == torch.float32:
                torch.index_select(hd, 0, torch.from_numpy(pos), out=rows)
            else:
                rows.copy_(hd.index_select(0, torch.from_numpy(pos)))
            event = self.copy_event(hd.device)
        elif n:
            sel = hd.index_select(0, upload(torch.from_numpy(pos), hd.device))
            rows.copy_(sel if sel.dtype == torch.float32 else sel.float(), non_blocking=True)
            event = self.copy_event(hd.device)
        pending = _Pending(self.epoch, iteration, layer, buf, counts, event)
        self._queues[layer].append(pending)
        self._staged.append(pending)
        c = self.counters
        c.bytes_sent += n * (8 + 4 * int(rows.shape[1]))
        c.rows_sent[layer] += n
        c.candidates[layer] += candidates
        c.max_rows_to_one_rank[layer] = max(int(c.max_rows_to_one_rank[layer]), int(counts.max(initial=0)))
        c.push_seconds += time.perf_counter() - t0
        self._start_staged(None if self.stages else pending)

    def _start_staged(self, until: _Pending | None, timed: bool = True) -> None:
        """Start the exchanges of the leading staged pushes in posting order: while their copies
        have run (``until`` None), or every one up to and including ``until``, waiting for their
        copies (the wait counted as ``wait_seconds``; the starts as ``push_seconds`` if
        ``timed``)."""
        staged, c = self._staged, self.counters
        while staged:
            p = staged[0]
            if p.event is not None and not p.event.query():
                if until is None:
                    return
                t0 = time.perf_counter()
                p.event.synchronize()
                c.wait_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            staged.popleft()
            p.event = None
            n = int(p.counts.sum())
            ids, rows = p.buffers.ids[:n], p.buffers.rows[:n]
            recv = p.buffers.recv if self.backend == "mpi4py" else None
            p.exchange = self.channel.start([torch.from_numpy(ids), rows], p.counts, tag=2 * p.layer,
                                            recv_buffers=recv)
            if self.record:             # the rows as sent: taken once their copy has run
                dest = np.repeat(np.arange(self.size, dtype=np.int32), p.counts)
                self.pushes.append(PushRecord(p.epoch, p.iteration, p.layer, ids.copy(), dest,
                                              rows.numpy().copy()))
            if timed:
                c.push_seconds += time.perf_counter() - t0
            if p is until:
                return

    def receive(self, layer: int, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        """Collective completion: (global IDs, rows) posted at ``iteration - delay``, this layer.

        A staged push is started first, with every staged push posted before it (waiting for
        their copies from the device: by now they were queued ``delay`` iterations ago)."""
        q = self._queues[layer]
        if not q:
            raise RuntimeError(f"AEP: nothing posted for layer {layer} to receive at iteration {iteration}")
        pending = q[0]
        if pending.iteration != iteration - self.delay:
            raise RuntimeError(f"AEP: layer {layer} iteration {iteration} expected the push of iteration "
                               f"{iteration - self.delay}, found {pending.iteration}")
        q.popleft()
        if pending.exchange is None:                   # staged: start it (and those before it)
            self._start_staged(pending)
        t0 = time.perf_counter()
        (ids, rows), sources = pending.exchange.wait()
        ids, rows, sources = ids.numpy(), rows.numpy(), sources.numpy()
        self.counters.wait_seconds += time.perf_counter() - t0
        self._free[layer].append(pending.buffers)      # the exchange is complete: reusable
        self.counters.rows_received[layer] += int(ids.shape[0])
        self.counters.bytes_received += int(ids.shape[0]) * (8 + 4 * int(rows.shape[1]))
        if self.record:
            self.receives.append(PushRecord(self.epoch, iteration, layer, ids.copy(), sources, rows.copy()))
        return ids, rows

    def progress(self) -> None:
        """Start the leading staged pushes whose copies have run (stopping at the first whose
        copy has not: posting order), then drive the progress of every started exchange (cheap,
        non-blocking)."""
        self._start_staged(None, timed=False)
        for q in self._queues:
            for p in q:
                if p.exchange is not None:
                    p.exchange.test()

    def buffer_sets(self) -> int:
        """Buffer sets this channel holds, free or in flight (``d`` per layer once warmed up)."""
        return sum(len(f) for f in self._free) + sum(len(q) for q in self._queues)

    def outstanding(self) -> int:
        """Pushes posted and not yet received, staged ones included."""
        return sum(len(q) for q in self._queues)

    def staged(self) -> int:
        """Pushes posted whose exchange has not started (their copies from the device pending)."""
        return len(self._staged)

    def close(self) -> None:
        """Collective: release the channel (after the last epoch; every posted push has been
        received by then). Staged pushes left (an epoch that did not finish) are dropped
        unstarted, after their copies have run: they never reached the wire."""
        for p in self._staged:
            if p.event is not None:
                p.event.synchronize()
            self._queues[p.layer].remove(p)
        self._staged.clear()
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def assert_drained(self) -> None:
        """Raise if a posted push was never received, staged or started (the epoch schedule
        is broken)."""
        n = self.outstanding()
        if n:
            raise RuntimeError(f"AEP: {n} posted exchanges outstanding at the end of the epoch "
                               f"({len(self._staged)} of them staged, never started)")
