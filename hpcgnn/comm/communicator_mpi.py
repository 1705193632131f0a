"""The mpi4py implementation of the data plane: :class:`MpiCommunicator` (``runtime.backend =
"mpi4py"``), the default on the CPU. Host buffers through mpi4py (the variable-count
all-to-alls of :mod:`hpcgnn.comm.alltoall`); device tensors are staged through the host.
The interface it implements is :class:`~hpcgnn.comm.communicator.Communicator`; the job's
instance is made by :func:`hpcgnn.comm.data_plane.make_communicator`.
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.comm.communicator import CappedChannel, Communicator, Pending, _Done
from hpcgnn.upload import upload


def _host_view(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of ``t`` on the host (bfloat16 viewed as int16; copied from a
    device or when not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def _from_host(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    out = torch.from_numpy(a)
    if like.dtype == torch.bfloat16:
        out = out.view(torch.bfloat16)
    return upload(out, like.device)


class _MpiRows(Pending):
    def __init__(self, pending, like: torch.Tensor):
        self.pending, self.like = pending, like

    def test(self) -> bool:
        return self.pending.test()

    def wait(self) -> torch.Tensor:
        return _from_host(self.pending.wait(), self.like)


class _MpiReduce(Pending):
    def __init__(self, request, host: np.ndarray, buf: torch.Tensor):
        self.request, self.host, self.buf = request, host, buf
        self.done = False

    def test(self) -> bool:
        if not self.done:
            self.done = bool(self.request.Test())
            if self.done:
                self._finish()
        return self.done

    def _finish(self) -> None:
        if self.buf.device.type != "cpu":
            self.buf.copy_(torch.from_numpy(self.host))

    def wait(self):
        if not self.done:
            self.request.Wait()
            self.done = True
            self._finish()
        return None


class _MpiCappedPending(Pending):
    def __init__(self, pending, like: list[torch.Tensor]):
        self.pending, self.like = pending, like
        self.result = None

    def test(self) -> bool:
        return self.pending.test()

    def wait(self):
        if self.result is None:
            arrays, sources = self.pending.wait()
            self.result = ([_from_host(a, t) for a, t in zip(arrays, self.like)], torch.from_numpy(sources))
            self.like = None
        return self.result


class _MpiCappedChannel(CappedChannel):
    """Point-to-point Isend/Irecv on a duplicate of the job's communicator
    (:class:`hpcgnn.comm.alltoall.PendingCappedExchange`: counts travel as message lengths)."""

    independent = True                  # point-to-point on a communicator of its own

    def __init__(self, comm, recv_caps: np.ndarray):
        self.comm = comm.Dup()          # collective; the channel's tags are its own
        self.recv_caps = recv_caps

    def start(self, arrays, send_counts, tag, recv_buffers=None) -> Pending:
        from hpcgnn.comm import alltoall

        if self.comm is None:
            raise RuntimeError("capped exchange: the channel is closed")
        bufs = None if recv_buffers is None else [[_host_view(b) for b in per] for per in recv_buffers]
        if bufs is not None and any(b.device.type != "cpu" for per in recv_buffers for b in per):
            raise ValueError("capped exchange: mpi4py receives into CPU recv_buffers only")
        pending = alltoall.PendingCappedExchange(self.comm, [_host_view(a) for a in arrays],
                                                 np.asarray(send_counts, dtype=np.int64), self.recv_caps, tag,
                                                 recv_buffers=bufs)
        return _MpiCappedPending(pending, list(arrays))

    def close(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


class MpiCommunicator(Communicator):
    """mpi4py on host buffers (numpy views of CPU tensors, zero-copy where contiguous)."""

    name = "mpi4py"

    def __init__(self, comm, device: torch.device | str = "cpu"):
        super().__init__(comm.Get_rank(), comm.Get_size(), "cpu")
        self.comm = comm

    def exchange_counts(self, send_counts) -> np.ndarray:
        from hpcgnn.comm.alltoall import exchange_counts

        return exchange_counts(self.comm, self._counts(send_counts, "send_counts"))

    def start_alltoallv(self, send, send_counts, recv_counts=None) -> Pending:
        from hpcgnn.comm.alltoall import PendingExchange

        sc = self._counts(send_counts, "send_counts")
        self._check_rows(send, sc)
        rc = self.exchange_counts(sc) if recv_counts is None else self._counts(recv_counts, "recv_counts")
        return _MpiRows(PendingExchange(self.comm, _host_view(send), sc, rc), send)

    def alltoallv(self, send, send_counts, recv_counts=None) -> torch.Tensor:
        from hpcgnn.comm.alltoall import alltoallv

        sc = self._counts(send_counts, "send_counts")
        self._check_rows(send, sc)
        rc = self.exchange_counts(sc) if recv_counts is None else self._counts(recv_counts, "recv_counts")
        return _from_host(alltoallv(self.comm, _host_view(send), sc, rc), send)

    def open_capped(self, recv_caps) -> CappedChannel:
        return _MpiCappedChannel(self.comm, self._counts(recv_caps, "recv_caps"))

    def duplicate(self) -> "MpiCommunicator":
        return MpiCommunicator(self.comm.Dup() if self.size > 1 else self.comm)

    def start_allreduce_(self, buf) -> Pending:
        from mpi4py import MPI

        if self.size == 1:
            return _Done()
        if buf.device.type == "cpu" and not buf.is_contiguous():
            raise ValueError("allreduce_: buf must be contiguous")
        host = _host_view(buf)
        return _MpiReduce(self.comm.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM), host, buf)

    def allreduce_(self, buf, op: str = "sum"):
        from mpi4py import MPI

        if op not in ("sum", "max"):
            raise ValueError(f"{self.name}: allreduce_ op {op!r}, expected 'sum' or 'max'")
        if self.size > 1:
            if buf.device.type == "cpu" and not buf.is_contiguous():
                raise ValueError("allreduce_: buf must be contiguous")
            host = _host_view(buf)
            self.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM if op == "sum" else MPI.MAX)
            if buf.device.type != "cpu":
                buf.copy_(torch.from_numpy(host))
        return buf

    def allgatherv(self, send, counts) -> torch.Tensor:
        c = self._counts(counts, "counts")
        x = _host_view(send)
        if x.shape[0] != c[self.rank]:
            raise ValueError(f"allgatherv: rank {self.rank} sends {x.shape[0]} rows, counts say {c[self.rank]}")
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        recv = np.empty((int(c.sum()),) + x.shape[1:], dtype=x.dtype)
        if self.size == 1:
            recv[...] = x
        else:
            self.comm.Allgatherv(x.reshape(-1), [recv.reshape(-1), c * row])
        return _from_host(recv, send)

    def broadcast_(self, buf, root: int = 0):
        if self.size > 1:
            host = _host_view(buf)
            self.comm.Bcast(host, root=root)
            if buf.device.type != "cpu" or not buf.is_contiguous():
                buf.copy_(_from_host(host, buf))
        return buf
