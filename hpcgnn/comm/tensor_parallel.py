"""Tensor-parallel layouts of vertex data (NeutronTP) and the all-to-alls between them.

Two layouts of a ``[V, C]`` matrix over ``P`` ranks:

* **vertex layout**: rank ``i`` holds full rows (all ``C`` columns) of its own vertex set
  ``V_i`` (about ``V/P`` vertices), in its *local order* (``TPLayout.own_ids``);
* **feature layout**: rank ``i`` holds columns ``[c_i, c_(i+1))`` of every vertex, as a
  ``[V, w_i]`` buffer indexed by global vertex ID (``c_i = i * C // P``: widths differ by at
  most one column; no padding, the counts of the all-to-all say who gets what).

**split** moves rows from the vertex to the feature layout, **gather** back. Both are built on
one descriptor, :class:`Transfer`: a list ``T`` of global IDs grouped by owner rank
(``counts[r]`` rows owned by rank ``r``) and the owner's local positions ``R`` of its rows.
``to_cols(T)`` is a split of those rows (each owner sends column slice ``k`` of its rows to rank
``k``; every rank writes what it receives into rows ``T`` of its feature-layout buffer) and
``to_rows(T)`` a gather of them (every rank sends its columns of rows ``T`` to their owners,
which concatenate the column slices). The adjoint of ``to_cols(T)`` is ``to_rows(T)`` and
vice versa, so the pair makes autograd Functions Megatron style (:class:`Split`, :class:`Gather`);
:class:`AllgatherRows` (every rank's rows on every rank, adjoint an allreduce) is the third.
Both have a non-blocking form (``start_*`` returns a handle; ``finish`` waits and places the
rows) for overlapping a chunk's exchange with another chunk's compute.

**Chunks and de-duplication** (NeutronTP Alg. 1 lines 1-2, Fig. 9(d)): :meth:`TPLayout.build`
cuts the destinations into contiguous ranges ``V_j`` (chunk ``j`` = all in-edges of ``V_j``,
sources ``N_j``, self loops included) processed in the same order on every rank. A vertex's
*first chunk* is the first ``j`` with the vertex in ``N_j``; ``new_j`` = vertices whose first
chunk is ``j`` (sorted by ID) is dealt out evenly, in contiguous blocks, to ranks ``0..P-1``.
So the split of chunk ``j`` moves exactly ``new_j`` (each vertex once per epoch, never again for
a later chunk that reuses it), the vertex-layout sets ``V_i`` are the union of rank ``i``'s
blocks (sizes within ``chunks`` rows of ``V/P``), and with one chunk ``V_i`` is the contiguous
block ``[i V / P, (i+1) V / P)``. The gather of chunk ``j`` moves the rows ``V_j`` to their owners.

Every exchange goes through the job's data plane (a
:class:`~hpcgnn.comm.communicator.Communicator`); every rank must start the same exchanges in
the same order (collectives).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.comm.communicator import Communicator
from hpcgnn.upload import upload


def column_bounds(width: int, size: int) -> np.ndarray:
    """[size+1] column boundaries of ``width`` columns over ``size`` ranks (``c_i = i w // P``)."""
    return (np.arange(size + 1, dtype=np.int64) * int(width)) // int(size)


@dataclass
class Transfer:
    """Rows that move in one split or gather.

    ids     int64 [m]   global IDs, grouped by owner rank (``counts[r]`` rows of rank ``r``)
    counts  int64 [P]   rows of each owner
    local   int64 [counts[rank]]  this rank's local positions of its rows, aligned with its segment
    """

    ids: torch.Tensor
    counts: np.ndarray
    local: torch.Tensor
    contiguous_ids: tuple | None = None     # (begin, end) when ids == arange(begin, end)
    contiguous_local: tuple | None = None   # (begin, end) when local == arange(begin, end)

    @classmethod
    def make(cls, ids: np.ndarray, counts: np.ndarray, local: np.ndarray) -> "Transfer":
        def span(a):
            a = np.asarray(a)
            if a.size and int(a[-1]) - int(a[0]) + 1 == a.size and np.all(np.diff(a) == 1):
                return (int(a[0]), int(a[-1]) + 1)
            return (0, 0) if a.size == 0 else None
        return cls(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)),
                   np.asarray(counts, dtype=np.int64),
                   torch.from_numpy(np.ascontiguousarray(local, dtype=np.int64)),
                   span(ids), span(local))

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])


LAYOUT_SLICE = 1 << 20   # edges per slice of TPLayout.build's first-read pass (~26 bytes each)


@dataclass
class TPLayout:
    """Vertex ownership and the per-chunk transfers (identical on every rank; see the module
    docstring). Memory O(V) int64 arrays plus the chunk boundaries."""

    num_nodes: int
    size: int
    rank: int
    chunk_bounds: np.ndarray   # int64 [n+1] destination ranges
    split_order: np.ndarray    # int64 [V] new_0, new_1, ... (each sorted by ID)
    split_bounds: np.ndarray   # int64 [n+1] new_j = split_order[split_bounds[j]:split_bounds[j+1]]
    deal: np.ndarray           # int64 [n, P+1] positions in split_order of each rank's block of new_j
    owner: np.ndarray          # int32 [V]
    local_pos: np.ndarray      # int64 [V] position of each vertex in its owner's local order
    own_ids: np.ndarray        # int64 [n_i] this rank's vertices in local order
    gather_perm: np.ndarray    # int64 [V] per chunk: its destinations grouped by owner
    gather_counts: np.ndarray  # int64 [n, P]

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_bounds.shape[0] - 1)

    @property
    def num_own(self) -> int:
        return int(self.own_ids.shape[0])

    @classmethod
    def build(cls, indptr: np.ndarray, indices: np.ndarray, chunk_bounds: np.ndarray, size: int,
              rank: int) -> "TPLayout":
        """The layout of the in-edge CSR ``(indptr, indices)`` (global IDs, no self loops needed:
        every vertex counts as a source of its own chunk) cut at ``chunk_bounds``."""
        v = int(indptr.shape[0] - 1)
        cb = np.asarray(chunk_bounds, dtype=np.int64)
        n = int(cb.shape[0] - 1)
        chunk_of = np.repeat(np.arange(n, dtype=np.int64), np.diff(cb))
        first = chunk_of.copy()
        if indices.shape[0] and n > 1:
            # edges are ordered by destination, hence by chunk: chunk by chunk, the sources not
            # seen in an earlier chunk are first read here (one pass over the edges, vectorised
            # per slice of at most LAYOUT_SLICE edges of a chunk: the masks and fresh sources
            # stay bounded; one chunk reads everything first in chunk 0, which ``first`` holds)
            seen = np.zeros(v, dtype=bool)
            ends = indptr[cb]
            for c in range(n):
                for e0 in range(int(ends[c]), int(ends[c + 1]), LAYOUT_SLICE):
                    s = indices[e0:min(e0 + LAYOUT_SLICE, int(ends[c + 1]))]
                    fresh = s[~seen[s]]
                    seen[fresh] = True
                    first[fresh] = np.minimum(first[fresh], c)
        split_order = np.argsort(first, kind="stable").astype(np.int64)
        split_bounds = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(first, minlength=n), out=split_bounds[1:])
        m = np.diff(split_bounds)
        deal = split_bounds[:-1, None] + (m[:, None] * np.arange(size + 1, dtype=np.int64)[None, :]) // size
        lengths = np.diff(deal, axis=1)                      # [n, P]
        owner_by_pos = np.repeat(np.tile(np.arange(size, dtype=np.int32), n), lengths.ravel())
        local_by_pos = np.empty(v, dtype=np.int64)
        for r in range(size):                                 # one pass per rank, not per vertex
            idx = np.flatnonzero(owner_by_pos == r)
            local_by_pos[idx] = np.arange(idx.shape[0], dtype=np.int64)
        owner = np.empty(v, dtype=np.int32)
        owner[split_order] = owner_by_pos
        local_pos = np.empty(v, dtype=np.int64)
        local_pos[split_order] = local_by_pos
        own_ids = split_order[owner_by_pos == rank]
        gather_perm = np.empty(v, dtype=np.int64)
        gather_counts = np.zeros((n, size), dtype=np.int64)
        for j in range(n):                                    # one pass per chunk
            a, b = int(cb[j]), int(cb[j + 1])
            own = owner[a:b]
            gather_perm[a:b] = a + np.argsort(own, kind="stable")
            gather_counts[j] = np.bincount(own, minlength=size)
        return cls(num_nodes=v, size=size, rank=rank, chunk_bounds=cb, split_order=split_order,
                   split_bounds=split_bounds, deal=deal, owner=owner, local_pos=local_pos,
                   own_ids=own_ids, gather_perm=gather_perm, gather_counts=gather_counts)

    def split_transfer(self, j: int) -> Transfer:
        """Chunk ``j``'s split: the rows ``new_j`` (first needed by chunk ``j``)."""
        ids = self.split_order[self.split_bounds[j]:self.split_bounds[j + 1]]
        counts = np.diff(self.deal[j])
        lo = int(self.deal[j, self.rank] - self.split_bounds[j])
        mine = ids[lo:lo + int(counts[self.rank])]
        return Transfer.make(ids, counts, self.local_pos[mine])

    def gather_transfer(self, j: int) -> Transfer:
        """Chunk ``j``'s gather: its destination rows ``V_j`` to their owners."""
        a, b = int(self.chunk_bounds[j]), int(self.chunk_bounds[j + 1])
        ids = self.gather_perm[a:b]
        counts = self.gather_counts[j]
        lo = int(counts[:self.rank].sum())
        mine = ids[lo:lo + int(counts[self.rank])]
        return Transfer.make(ids, counts, self.local_pos[mine])

    def full_transfer(self) -> Transfer:
        """Every vertex at once (grouped by owner, each owner's rows in its local order)."""
        order = np.lexsort((self.local_pos, self.owner))
        counts = np.bincount(self.owner, minlength=self.size).astype(np.int64)
        return Transfer.make(order, counts, np.arange(self.num_own, dtype=np.int64))


class CommStats:
    """Bytes sent to other ranks, seconds and calls per collective kind (``split``, ``gather``,
    ...); ``record = False`` pauses counting (evaluation is counted apart by the engine)."""

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.record = True

    def add(self, kind: str, nbytes: int = 0, seconds: float = 0.0, calls: int = 0) -> None:
        if not self.record:
            return
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.seconds[kind] = self.seconds.get(kind, 0.0) + float(seconds)
        self.calls[kind] = self.calls.get(kind, 0) + int(calls)

    def reset(self) -> None:
        self.bytes, self.seconds, self.calls = {}, {}, {}


def _rows(x: torch.Tensor, index: torch.Tensor, span) -> torch.Tensor:
    """``x[index]`` (a slice view when the index is a contiguous range)."""
    if span is not None:
        return x[span[0]:span[1]]
    from hpcgnn.nn.aggregate import gather_rows

    return gather_rows(x, index) if x.device.type == "cpu" and x.dim() == 2 else x.index_select(0, index)


def _place(buf: torch.Tensor, index: torch.Tensor, span, rows: torch.Tensor, accumulate: bool = False) -> None:
    """``buf[index] = rows`` (``+=`` when ``accumulate``)."""
    if span is not None:
        target = buf[span[0]:span[1]]
        target.add_(rows) if accumulate else target.copy_(rows)
    elif accumulate:
        buf.index_add_(0, upload(index, buf.device), rows)
    else:
        buf.index_copy_(0, upload(index, buf.device), rows)


class _Local:
    """A completed exchange on one rank (no peers): the received buffer is the sent one."""

    def __init__(self, buf: torch.Tensor):
        self._buf = buf

    def wait(self) -> torch.Tensor:
        return self._buf

    def test(self) -> bool:
        return True


class Handle:
    """A started split or gather; :meth:`finish` waits and places the received rows."""

    def __init__(self, tp: "TPComm", kind: str, pending, place, nbytes: int, t_start: float):
        self.tp, self.kind, self.pending, self._place = tp, kind, pending, place
        self.nbytes, self.post_s = nbytes, time.perf_counter() - t_start
        self.done = False
        self._out = None

    def test(self) -> bool:
        return self.done or self.pending.test()

    def finish(self):
        """Wait for the exchange; place the rows; returns what ``place`` returns (once: a
        second call returns the same without waiting)."""
        if self.done:
            return self._out
        t0 = time.perf_counter()
        recv = self.pending.wait()
        self._out = self._place(recv)
        self.done = True
        self.pending = None
        self.tp.stats.add(self.kind, self.nbytes, self.post_s + time.perf_counter() - t0, 1)
        return self._out


class TPComm:
    """The split/gather exchanges of one rank over ``comm`` (the data plane, a
    :class:`~hpcgnn.comm.communicator.Communicator`; None or size 1 = local).

    Send buffers are made on the communicator's device (the host for mpi4py and gloo: CUDA
    tensors are staged through it; the GPU for nccl); received rows are placed on the device of
    the destination buffer.
    """

    def __init__(self, comm: Communicator | None, layout: TPLayout, stats: CommStats | None = None):
        if comm is not None and not isinstance(comm, Communicator):
            raise TypeError(f"tensor parallel: comm must be a Communicator, got {type(comm).__name__}")
        self.comm = comm if comm is not None and comm.size > 1 else None
        self.layout = layout
        self.size, self.rank = layout.size, layout.rank
        self.stats = stats if stats is not None else CommStats()

    @property
    def wire_device(self) -> torch.device:
        """Where send buffers are made (the communicator's device; the host without peers)."""
        return self.comm.device if self.comm is not None else torch.device("cpu")

    def _start(self, send: torch.Tensor, send_counts: np.ndarray, recv_counts: np.ndarray):
        if self.comm is None:
            return _Local(send)
        return self.comm.start_alltoallv(send, send_counts, recv_counts)

    # ---- vertex layout -> feature layout -------------------------------------------------------
    def start_to_cols(self, tr: Transfer, x_rows: torch.Tensor, zbuf: torch.Tensor, kind: str = "split",
                      accumulate: bool = False) -> Handle:
        """Start moving this rank's rows ``tr.local`` of ``x_rows`` [n_i, C] (vertex layout) to the
        feature layout: on :meth:`Handle.finish` rows ``tr.ids`` of ``zbuf`` [V, w_rank] hold them
        (added to them when ``accumulate``)."""
        t0 = time.perf_counter()
        c = int(x_rows.shape[1])
        cb = column_bounds(c, self.size)
        widths = np.diff(cb)
        rows = _rows(x_rows.detach(), upload(tr.local, x_rows.device), tr.contiguous_local)
        if self.size == 1:
            send = rows.contiguous()
        else:
            send = torch.cat([rows[:, cb[k]:cb[k + 1]].reshape(-1) for k in range(self.size)])
        send = send.to(self.wire_device).reshape(-1)
        n_mine = int(tr.counts[self.rank])
        send_counts = n_mine * widths
        w = int(widths[self.rank])
        recv_counts = tr.counts * w
        nbytes = (int(send_counts.sum()) - int(send_counts[self.rank])) * send.element_size()
        pending = self._start(send, send_counts, recv_counts)
        m = tr.num_rows

        def place(recv: torch.Tensor):
            got = recv.view(m, w).to(zbuf.device)
            _place(zbuf, tr.ids, tr.contiguous_ids, got, accumulate)
            return zbuf

        return Handle(self, kind, pending, place, nbytes, t0)

    # ---- feature layout -> vertex layout -------------------------------------------------------
    def start_to_rows(self, tr: Transfer, zbuf: torch.Tensor, width: int, out_rows: torch.Tensor,
                      kind: str = "gather", accumulate: bool = False) -> Handle:
        """Start moving rows ``tr.ids`` of the feature-layout ``zbuf`` [V, w_rank] (total width
        ``width``) to their owners: on :meth:`Handle.finish` rows ``tr.local`` of ``out_rows``
        [n_i, width] hold the full rows (added to them when ``accumulate``)."""
        t0 = time.perf_counter()
        cb = column_bounds(width, self.size)
        widths = np.diff(cb)
        w = int(widths[self.rank])
        send = _rows(zbuf.detach(), tr.ids.to(zbuf.device), tr.contiguous_ids).contiguous()
        send = send.to(self.wire_device).reshape(-1)
        send_counts = tr.counts * w
        n_mine = int(tr.counts[self.rank])
        recv_counts = n_mine * widths
        nbytes = (int(send_counts.sum()) - int(send_counts[self.rank])) * send.element_size()
        pending = self._start(send, send_counts, recv_counts)
        size = self.size

        def place(recv: torch.Tensor):
            flat = recv
            if size == 1:
                full = flat.view(n_mine, width)
            else:
                offs = np.concatenate([[0], np.cumsum(recv_counts)])
                full = torch.cat([flat[offs[k]:offs[k + 1]].view(n_mine, int(widths[k])) for k in range(size)],
                                 dim=1)
            _place(out_rows, tr.local, tr.contiguous_local, upload(full, out_rows.device), accumulate)
            return out_rows

        return Handle(self, kind, pending, place, nbytes, t0)

    # ---- blocking helpers ----------------------------------------------------------------------
    def split(self, x_rows: torch.Tensor, tr: Transfer | None = None) -> torch.Tensor:
        """Blocking split of all rows (or ``tr``'s): the feature-layout buffer [V, w_rank] (rows
        not in ``tr`` are zero)."""
        tr = tr or self.layout.full_transfer()
        w = int(np.diff(column_bounds(int(x_rows.shape[1]), self.size))[self.rank])
        z = x_rows.new_zeros((self.layout.num_nodes, w))
        return self.start_to_cols(tr, x_rows, z).finish()

    def gather(self, z: torch.Tensor, width: int, tr: Transfer | None = None) -> torch.Tensor:
        """Blocking gather of all rows (or ``tr``'s): the vertex-layout rows [n_i, width]."""
        tr = tr or self.layout.full_transfer()
        out = z.new_zeros((self.layout.num_own, width))
        return self.start_to_rows(tr, z, width, out).finish()


class Split(torch.autograd.Function):
    """``Split.apply(x_rows, tp)``: vertex layout [n_i, C] -> feature layout [V, w_rank]; its
    adjoint is the gather of the gradient (and :class:`Gather`'s is the split)."""

    @staticmethod
    def forward(ctx, x_rows, tp: TPComm):
        ctx.tp, ctx.width = tp, int(x_rows.shape[1])
        return tp.split(x_rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return ctx.tp.gather(grad.contiguous(), ctx.width), None


class Gather(torch.autograd.Function):
    """``Gather.apply(z, tp, width)``: feature layout [V, w_rank] -> vertex layout [n_i, width]."""

    @staticmethod
    def forward(ctx, z, tp: TPComm, width: int):
        ctx.tp = tp
        return tp.gather(z, width)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return ctx.tp.split(grad.contiguous()), None, None


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
