"""Variable-size all-to-all exchanges of numpy rows over mpi4py.

Rows are the unit: ``send`` is an array whose first axis is ordered by
destination rank (``send_counts[r]`` rows for rank ``r``); the result is the
rows received, ordered by source rank. Every rank must call the same
exchanges in the same order (they are collectives). Buffers are used in
place: a C-contiguous ``send`` is not copied.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

_MPI_TYPES = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int16): MPI.INT16_T,  # bfloat16 tensors viewed as int16
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.bool_): MPI.BOOL,
    np.dtype(np.uint16): MPI.UINT16_T,  # bfloat16 rows travel as uint16
    np.dtype(np.float16): MPI.UINT16_T,  # float16 feature rows: moved as 16-bit words, never reduced
}


def exchange_counts(comm, send_counts: np.ndarray) -> np.ndarray:
    """Alltoall of per-destination row counts: returns rows to expect from each source."""
    send_counts = np.ascontiguousarray(send_counts, dtype=np.int64)
    recv = np.empty_like(send_counts)
    comm.Alltoall(send_counts, recv)
    return recv


def _spec(arr: np.ndarray, counts: np.ndarray):
    row = int(np.prod(arr.shape[1:], dtype=np.int64)) if arr.ndim > 1 else 1
    c = counts.astype(np.int64) * row
    displs = np.zeros_like(c)
    np.cumsum(c[:-1], out=displs[1:])
    mpi_type = _MPI_TYPES.get(arr.dtype)
    if mpi_type is None:
        raise TypeError(f"alltoallv: unsupported dtype {arr.dtype}")
    return [arr, (c, displs), mpi_type]


def _check(comm, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> None:
    """Reject counts MPI would turn into reads past the buffer or a crash."""
    size = comm.Get_size()
    if send.ndim == 0:
        raise ValueError("alltoallv: send must have a row axis (ndim >= 1)")
    for name, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        if counts.shape != (size,) or (counts < 0).any():
            raise ValueError(f"alltoallv: {name} must be {size} non-negative counts, got {counts!r}")
    if int(send_counts.sum()) != send.shape[0]:
        raise ValueError(f"alltoallv: send_counts sum to {int(send_counts.sum())} "
                         f"but send has {send.shape[0]} rows")


def _recv_buffer(send: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
    return np.empty((int(recv_counts.sum()),) + send.shape[1:], dtype=send.dtype)


def alltoallv(comm, send: np.ndarray, send_counts: np.ndarray,
              recv_counts: np.ndarray | None = None) -> np.ndarray:
    """Blocking variable all-to-all of rows (counts exchanged first if not given)."""
    send = np.ascontiguousarray(send)
    send_counts = np.asarray(send_counts, dtype=np.int64)
    if recv_counts is None:
        recv_counts = exchange_counts(comm, send_counts)
    recv_counts = np.asarray(recv_counts, dtype=np.int64)
    _check(comm, send, send_counts, recv_counts)
    recv = _recv_buffer(send, recv_counts)
    comm.Alltoallv(_spec(send, send_counts), _spec(recv, recv_counts))
    return recv


class PendingExchange:
    """A started non-blocking all-to-all; ``wait()`` returns the received rows.

    The send buffer is kept alive until completion, as MPI requires.
    """

    def __init__(self, comm, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray):
        self._send = np.ascontiguousarray(send)
        self.recv_counts = np.asarray(recv_counts, dtype=np.int64)
        self.send_counts = np.asarray(send_counts, dtype=np.int64)
        _check(comm, self._send, self.send_counts, self.recv_counts)
        self._row_bytes = self._send.itemsize * int(np.prod(self._send.shape[1:], dtype=np.int64))
        self._recv = _recv_buffer(self._send, self.recv_counts)
        self._request = comm.Ialltoallv(_spec(self._send, self.send_counts),
                                        _spec(self._recv, self.recv_counts))
        self.done = False

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sends (including rows to itself)."""
        return int(self.send_counts.sum()) * self._row_bytes

    @property
    def bytes_received(self) -> int:
        """Bytes this rank receives (including rows from itself)."""
        return self._recv.nbytes

    def test(self) -> bool:
        """Drive progress; True once complete."""
        if not self.done:
            self.done = bool(self._request.Test())
        return self.done

    def wait(self) -> np.ndarray:
        """Block until complete; returns the received rows, ordered by source rank."""
        if not self.done:
            self._request.Wait()
            self.done = True
        self._send = None
        return self._recv


def start_alltoallv(comm, send: np.ndarray, send_counts: np.ndarray,
                    recv_counts: np.ndarray | None = None) -> PendingExchange:
    """Start a non-blocking variable all-to-all (counts exchanged first, blocking, if not given)."""
    send_counts = np.asarray(send_counts, dtype=np.int64)
    if recv_counts is None:
        recv_counts = exchange_counts(comm, send_counts)
    return PendingExchange(comm, send, send_counts, recv_counts)


class PendingCappedExchange:
    """A started exchange of a bounded number of rows per peer, with no count exchange.

    Point-to-point: for every other rank ``q`` one ``Isend`` of this rank's rows for ``q`` and
    one ``Irecv`` into a buffer of ``recv_caps[q]`` rows from ``q``, per array; the row counts
    travel with the messages (``MPI_Get_count`` of the receive). So starting it never blocks and
    never waits for another rank, and MPI can move the data (also large, rendezvous messages)
    whenever :meth:`test` or :meth:`wait` drives progress. Every rank must start the same
    exchanges in the same order on ``comm`` with the same tags: messages of one (source, tag)
    pair match in the order they were sent.

    ``arrays``: arrays of the same row count, rows grouped by destination rank
    (``send_counts[r]`` rows for rank ``r``, none for this rank); the same dtype and row shape
    on every rank. ``recv_caps`` int [size]: the most rows rank ``q`` may send this rank (a
    larger message is an MPI truncation error). ``tag``: the first of ``len(arrays)`` tags.
    Memory: receive buffers of ``sum(recv_caps)`` rows per array, or ``recv_buffers`` reused
    in place: per array a list with, per other rank in ascending order, an array of at least
    ``recv_caps[q]`` rows of the array's dtype and row shape; the caller must not touch them
    until :meth:`wait` returned (its results are copies, so they are free again then).
    """

    def __init__(self, comm, arrays: list[np.ndarray], send_counts: np.ndarray, recv_caps: np.ndarray,
                 tag: int, recv_buffers: list[list[np.ndarray]] | None = None):
        self.comm = comm
        rank, size = comm.Get_rank(), comm.Get_size()
        self.send_counts = np.asarray(send_counts, dtype=np.int64)
        caps = np.asarray(recv_caps, dtype=np.int64)
        self._send = [np.ascontiguousarray(a) for a in arrays]
        n = self._send[0].shape[0]
        if self.send_counts.shape != (size,) or caps.shape != (size,) or (self.send_counts < 0).any() or \
                int(self.send_counts.sum()) != n or any(a.shape[0] != n for a in self._send):
            raise ValueError(f"capped exchange: send_counts {self.send_counts!r} do not split {n} rows "
                             f"over {size} ranks (or recv_caps is not [{size}])")
        if self.send_counts[rank] != 0:
            raise ValueError(f"capped exchange: no rows to itself, got {self.send_counts!r}")
        types = [_MPI_TYPES.get(a.dtype) for a in self._send]
        if any(t is None for t in types):
            raise TypeError(f"capped exchange: unsupported dtype in {[a.dtype for a in self._send]}")
        self.peers = [q for q in range(size) if q != rank]
        self._row_items = [max(int(np.prod(a.shape[1:], dtype=np.int64)), 1) for a in self._send]
        self._types = types
        if recv_buffers is None:
            self._recv = [[np.empty((int(caps[q]),) + a.shape[1:], dtype=a.dtype) for q in self.peers]
                          for a in self._send]
        else:
            self._recv = [[b[:int(caps[q])] for b, q in zip(bufs, self.peers)]
                          for bufs in recv_buffers]
            if len(self._recv) != len(self._send) or any(
                    len(bufs) != len(self.peers) or any(
                        b.shape != (int(caps[q]),) + a.shape[1:] or b.dtype != a.dtype or
                        not b.flags.c_contiguous for b, q in zip(bufs, self.peers))
                    for bufs, a in zip(self._recv, self._send)):
                raise ValueError("capped exchange: recv_buffers must hold, per array and other rank, "
                                 "a C-contiguous array of at least recv_caps[q] rows of the array's "
                                 "dtype and row shape")
        bounds = np.concatenate([[0], np.cumsum(self.send_counts)])
        self._recv_requests, self._send_requests = [], []
        for j, (a, t) in enumerate(zip(self._send, types)):
            for i, q in enumerate(self.peers):
                self._recv_requests.append(comm.Irecv([self._recv[j][i], t], source=q, tag=tag + j))
            for q in self.peers:
                self._send_requests.append(comm.Isend([a[bounds[q]:bounds[q + 1]], t], dest=q, tag=tag + j))
        self._statuses = [MPI.Status() for _ in self._recv_requests]
        self.done = self._recv_done = False
        self._result = None

    def test(self) -> bool:
        """Drive progress; True once complete."""
        if not self.done:
            # Completed receives are freed by Testall: their statuses (the row counts) must be
            # kept now, so the receives are tested apart from the sends.
            if not self._recv_done:
                self._recv_done = bool(MPI.Request.Testall(self._recv_requests, self._statuses))
            self.done = self._recv_done and bool(MPI.Request.Testall(self._send_requests))
        return self.done

    def wait(self) -> tuple[list[np.ndarray], np.ndarray]:
        """Block until complete: (the received arrays, rows ordered by source rank; the source
        rank of each row, int32)."""
        if self._result is None:
            if not self._recv_done:
                MPI.Request.Waitall(self._recv_requests, self._statuses)
                self._recv_done = True
            MPI.Request.Waitall(self._send_requests)
            self.done = True
            p = len(self.peers)
            counts = np.zeros(p, dtype=np.int64)
            for j in range(len(self._recv)):
                got = np.array([self._statuses[j * p + i].Get_count(self._types[j]) // self._row_items[j]
                                for i in range(p)], dtype=np.int64)
                if j == 0:
                    counts = got
                elif not np.array_equal(got, counts):
                    raise RuntimeError(f"capped exchange: arrays of one exchange with different row counts "
                                       f"{counts.tolist()} and {got.tolist()}")
            out = []
            for j, bufs in enumerate(self._recv):
                if p:
                    out.append(np.concatenate([b[:c] for b, c in zip(bufs, counts)]))
                else:
                    out.append(np.empty((0,) + self._send[j].shape[1:], dtype=self._send[j].dtype))
            sources = np.repeat(np.asarray(self.peers, dtype=np.int32), counts)
            self._result = (out, sources)
            self._send = self._recv = None
        return self._result
