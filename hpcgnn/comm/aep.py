"""Asynchronous Embedding Push (DistGNN-MB §3.5, Algorithm 2).

At layer ``l`` of iteration ``k`` a rank pushes, to every rank ``q``, the layer-input rows
``h_l`` of the solid vertices of its current frontier ``S_l`` that are halo vertices on ``q``
(``db_halo``, :meth:`Partition.send_list`), at most ``nc`` per destination chosen with
DistGNN-MB's degree-biased sampling. The push sends the global IDs (int64) and the rows
(float32) point-to-point, non-blocking, into receive buffers of min(``nc``, the halo vertices that source owns) rows
(:class:`~hpcgnn.comm.alltoall.PendingCappedExchange`): no count exchange, so posting a push
never waits for another rank (the blocking count alltoall it replaced made every layer of every
iteration a synchronisation point). The receiver consumes the message posted at layer ``l`` of
iteration ``k`` at layer ``l`` of iteration ``k + d``; the messages of one layer match in the
order they were posted (one tag pair per layer, on a communicator of the AEP's own).

:class:`DestinationMap` is ``db_halo`` inverted once at start-up into a CSR from solid vertex to
destination ranks, so selecting the candidates of a frontier costs O(|frontier| + candidates)
vectorised numpy work, independent of the number of ranks.

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

from hpcgnn.comm.alltoall import PendingCappedExchange


class DestinationMap:
    """For each solid local vertex, the ranks on which it is a halo vertex (CSR).

    ``indptr`` int64 [n_solid+1], ``ranks`` int32 [S]; built from ``Partition.send_list``.
    """

    def __init__(self, part):
        k = part.num_parts
        counts = np.diff(part.send_indptr).astype(np.int64)
        dest = np.repeat(np.arange(k, dtype=np.int32), counts)
        local = (part.send_ids - part.solid_begin).astype(np.int64)
        order = np.lexsort((dest, local))              # by vertex, then by rank
        self.num_solid = part.num_solid
        self.num_parts = k
        self.ranks = dest[order]
        self.indptr = np.zeros(part.num_solid + 1, dtype=np.int64)
        np.cumsum(np.bincount(local, minlength=part.num_solid), out=self.indptr[1:])

    def expand(self, solid_local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position in ``solid_local``, destination rank) of every (vertex, rank) pair.

        Pairs come grouped by destination rank (ascending); within a rank in the order of
        ``solid_local`` (a stable sort).
        """
        v = np.asarray(solid_local, dtype=np.int64)
        start = self.indptr[v]
        cnt = self.indptr[v + 1] - start
        total = int(cnt.sum())
        if total == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        pos = np.repeat(np.arange(v.shape[0], dtype=np.int64), cnt)
        first = np.cumsum(cnt) - cnt
        offs = np.arange(total, dtype=np.int64) - np.repeat(first, cnt)
        ranks = self.ranks[np.repeat(start, cnt) + offs]
        order = np.argsort(ranks, kind="stable")
        return pos[order], ranks[order]


@dataclass
class PushRecord:
    """What one push sent (for the debug record): per destination rank the global IDs and rows."""

    epoch: int
    iteration: int
    layer: int
    ids: np.ndarray          # int64 [n] sent, grouped by destination
    dest: np.ndarray         # int32 [n] destination rank of each row
    rows: np.ndarray         # float32 [n, D]


@dataclass
class _Pending:
    epoch: int
    iteration: int
    layer: int
    exchange: object         # PendingCappedExchange of (ids, rows)


@dataclass
class AEPCounters:
    """Per-epoch counters of one rank (bytes: IDs and rows)."""

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

    ``degrees`` are the solid vertices' degrees (biasing the ``nc`` cap); ``max_degree`` the
    global maximum degree (the paper's ``hil = floor(log2(max degree))``).
    """

    def __init__(self, comm, part, num_layers: int, nc: int, delay: int, max_degree: int,
                 record: bool = False):
        from hpcgnn.sampling.choice import degree_biased_choice

        self._choice = degree_biased_choice
        self.comm = comm.Dup()       # collective; the AEP's point-to-point tags are its own
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
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
        self.delay = int(delay)
        self.record = record
        self.pushes: list[PushRecord] = []
        self.receives: list[PushRecord] = []
        self._queues = [collections.deque() for _ in range(self.num_layers)]
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
        solid_pos = np.flatnonzero(f < self.num_solid)
        pos, ranks = self.destinations.expand(f[solid_pos])
        pos = solid_pos[pos]
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

    def push(self, layer: int, iteration: int, frontier_local: np.ndarray, h: torch.Tensor,
             rng_key: int) -> None:
        """Collective: post the push of layer ``layer`` at ``iteration`` (rows of ``h`` = frontier)."""
        t0 = time.perf_counter()
        pos, counts, candidates = self.select(frontier_local, rng_key)
        ids = np.asarray(frontier_local, dtype=np.int64)[pos] + self.solid_begin
        if pos.shape[0]:
            rows = h.detach().index_select(0, torch.from_numpy(pos).to(h.device)).to(
                "cpu", torch.float32).contiguous().numpy()
        else:
            rows = np.zeros((0, int(h.shape[1])), dtype=np.float32)
        exchange = PendingCappedExchange(self.comm, [ids, rows], counts, self.recv_caps, tag=2 * layer)
        self._queues[layer].append(_Pending(self.epoch, iteration, layer, exchange))
        c = self.counters
        c.bytes_sent += int(counts.sum()) * (8 + 4 * int(rows.shape[1]))
        c.rows_sent[layer] += int(counts.sum())
        c.candidates[layer] += candidates
        c.max_rows_to_one_rank[layer] = max(int(c.max_rows_to_one_rank[layer]), int(counts.max(initial=0)))
        if self.record:
            dest = np.repeat(np.arange(self.size, dtype=np.int32), counts)
            self.pushes.append(PushRecord(self.epoch, iteration, layer, ids.copy(), dest, rows.copy()))
        c.push_seconds += time.perf_counter() - t0

    def receive(self, layer: int, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        """Collective completion: (global IDs, rows) posted at ``iteration - delay``, this layer."""
        q = self._queues[layer]
        if not q:
            raise RuntimeError(f"AEP: nothing posted for layer {layer} to receive at iteration {iteration}")
        pending = q.popleft()
        if pending.iteration != iteration - self.delay:
            raise RuntimeError(f"AEP: layer {layer} iteration {iteration} expected the push of iteration "
                               f"{iteration - self.delay}, found {pending.iteration}")
        t0 = time.perf_counter()
        (ids, rows), sources = pending.exchange.wait()
        self.counters.wait_seconds += time.perf_counter() - t0
        self.counters.rows_received[layer] += int(ids.shape[0])
        self.counters.bytes_received += int(ids.shape[0]) * (8 + 4 * int(rows.shape[1]))
        if self.record:
            self.receives.append(PushRecord(self.epoch, iteration, layer, ids.copy(), sources, rows.copy()))
        return ids, rows

    def progress(self) -> None:
        """Drive MPI progress of every posted exchange (cheap, non-blocking)."""
        for q in self._queues:
            for p in q:
                p.exchange.test()

    def outstanding(self) -> int:
        return sum(len(q) for q in self._queues)

    def close(self) -> None:
        """Collective: release the duplicated communicator (after the last epoch; every posted
        exchange has been received by then)."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def assert_drained(self) -> None:
        """Raise if a posted exchange was never received (the epoch schedule is broken)."""
        n = self.outstanding()
        if n:
            raise RuntimeError(f"AEP: {n} posted exchanges outstanding at the end of the epoch")
