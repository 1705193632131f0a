"""The data plane's one seam: the collectives every data exchange of hpcgnn goes through.

A :class:`Communicator` moves torch tensors between the ranks of one job, with these
operations (Megatron style: the data plane and nothing else):

* ``alltoallv`` / ``start_alltoallv``: rows to every rank, variable counts (blocking, or
  started with a :class:`Pending` handle whose ``wait()`` gives the rows);
* ``allreduce_`` / ``start_allreduce_``: element-wise sum over ranks of a flat buffer, in place;
* ``allgatherv``: every rank's rows, concatenated in rank order;
* ``broadcast_``: root's buffer on every rank, in place;
* ``open_capped``: a channel of capped exchanges (:class:`CappedChannel`): rows to every other
  rank, at most a fixed cap per (sender, receiver) pair, with no blocking count exchange at start
  (the receiver learns the counts with the rows): AEP pushes and the cached halo's messages.

Rows are the unit: the first axis of ``send`` is ordered by destination rank
(``send_counts[r]`` rows for rank ``r``); what is received is ordered by source rank. Every
rank calls the same operations in the same order (they are collectives).

Implementations (``runtime.backend``, :func:`make_communicator`):

* :class:`MpiCommunicator` (``mpi4py``): host buffers through mpi4py, the default on the CPU
  and bit for bit the exchanges hpcgnn always made; device tensors are staged through the host.
* :class:`TorchCommunicator` (``gloo``, ``nccl``, ``ccl``): ``torch.distributed`` on tensors
  where they live: nccl on CUDA tensors with no host staging, gloo and ccl on CPU tensors.

MPI (mpi4py) stays the launcher and the control plane (ranks, agreement on errors, abort,
metrics, checkpoints, the run file): those use ``Runtime.comm`` directly, never this seam.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from hpcgnn.errors import InputError
from hpcgnn.upload import upload

BACKENDS = ("mpi4py", "gloo", "nccl", "ccl")   # the data-plane implementations
CHOICES = ("auto",) + BACKENDS                  # runtime.backend's values


def ccl_available() -> bool:
    """True when Intel's oneCCL bindings for PyTorch import (optional backend)."""
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(backend: str, device: str) -> str:
    """The data-plane backend for ``runtime.backend`` = ``backend`` on compute ``device``
    ('cpu', 'cuda', 'cuda:1'); InputError (one line) for a pair that cannot work.

    ``auto``: nccl with CUDA (mpi4py when this torch build has no NCCL), ccl on the CPU when
    oneccl_bindings_for_pytorch imports, else mpi4py. Refused: nccl without CUDA (NCCL moves
    device buffers only), ccl with CUDA (the oneCCL bindings move CPU or XPU tensors), ccl when
    the bindings do not import, nccl when this torch build has none. Ranks that share a GPU
    are :func:`make_communicator`'s to check (NCCL takes one rank per GPU).
    """
    cuda = str(device).startswith("cuda")
    if backend not in CHOICES:
        raise InputError(f"runtime.backend = {backend!r}, expected one of {', '.join(CHOICES)}")
    if backend == "auto":
        if cuda:
            import torch.distributed as dist

            return "nccl" if dist.is_nccl_available() else "mpi4py"
        return "ccl" if ccl_available() else "mpi4py"
    if backend == "nccl":
        if not cuda:
            raise InputError(f"runtime.backend = 'nccl' needs train.device = 'cuda' (NCCL moves GPU "
                             f"buffers only), got device {device!r}: use 'gloo' or 'mpi4py' on the CPU")
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise InputError("runtime.backend = 'nccl' but this torch build has no NCCL (a CPU-only torch?)")
    if backend == "ccl":
        if cuda:
            raise InputError("runtime.backend = 'ccl' cannot move CUDA tensors (oneCCL's bindings take CPU "
                             "or XPU tensors): use 'nccl' with train.device = 'cuda'")
        if not ccl_available():
            raise InputError("runtime.backend = 'ccl' but oneccl_bindings_for_pytorch does not import "
                             "(install it, or use 'gloo' or 'mpi4py')")
    return backend


class Pending(ABC):
    """A started operation. ``test()`` drives progress (True once complete); ``wait()`` blocks
    until complete and returns the result (received rows, or None for an in-place reduction)."""

    @abstractmethod
    def test(self) -> bool: ...

    @abstractmethod
    def wait(self): ...


class Communicator(ABC):
    """Collectives of the data plane over the ranks of one job (see the module docstring).

    ``name``: the backend ('mpi4py', 'gloo', 'nccl', 'ccl'). ``device``: where this backend
    takes buffers without staging (CPU for mpi4py, gloo, ccl; the rank's GPU for nccl).
    Tensors may be passed from any device; results come back on the device of the input.
    """

    name: str = ""

    def __init__(self, rank: int, size: int, device: torch.device | str = "cpu"):
        self.rank, self.size = int(rank), int(size)
        self.device = torch.device(device)

    def _counts(self, counts, what: str) -> np.ndarray:
        c = np.asarray(counts, dtype=np.int64).reshape(-1)
        if c.shape != (self.size,) or (c < 0).any():
            raise ValueError(f"{self.name}: {what} must be {self.size} non-negative counts, got {counts!r}")
        return c

    def _check_rows(self, send: torch.Tensor, send_counts: np.ndarray) -> None:
        if send.dim() == 0:
            raise ValueError(f"{self.name}: send must have a row axis (ndim >= 1)")
        if int(send_counts.sum()) != send.shape[0]:
            raise ValueError(f"{self.name}: send_counts sum to {int(send_counts.sum())} "
                             f"but send has {send.shape[0]} rows")

    @abstractmethod
    def exchange_counts(self, send_counts) -> np.ndarray:
        """int64 [size]: rows to expect from each rank, given the rows sent to each (blocking)."""

    @abstractmethod
    def start_alltoallv(self, send: torch.Tensor, send_counts, recv_counts=None) -> Pending:
        """Start a variable all-to-all of rows; ``wait()`` gives the rows received, by source.
        Without ``recv_counts`` the counts are exchanged first (blocking)."""

    def alltoallv(self, send: torch.Tensor, send_counts, recv_counts=None) -> torch.Tensor:
        """Blocking variable all-to-all of rows (see :meth:`start_alltoallv`)."""
        return self.start_alltoallv(send, send_counts, recv_counts).wait()

    @abstractmethod
    def start_allreduce_(self, buf: torch.Tensor) -> Pending:
        """Start an element-wise sum over ranks of the contiguous ``buf``, in place; ``buf`` is
        not to be read or written until ``wait()`` returned."""

    def allreduce_(self, buf: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Blocking in-place reduction over ranks (``op``: 'sum', or 'max' where an
        implementation offers it: mpi4py and torch.distributed do); returns ``buf``."""
        if op != "sum":
            raise ValueError(f"{self.name}: allreduce_ op {op!r} is not offered here, only 'sum'")
        self.start_allreduce_(buf).wait()
        return buf

    @abstractmethod
    def allgatherv(self, send: torch.Tensor, counts) -> torch.Tensor:
        """Every rank's rows concatenated in rank order; ``counts[r]``: rows of rank ``r``
        (the same on every rank; ``send`` has ``counts[rank]`` rows)."""

    @abstractmethod
    def broadcast_(self, buf: torch.Tensor, root: int = 0) -> torch.Tensor:
        """``root``'s ``buf`` on every rank, in place; returns ``buf``."""

    @abstractmethod
    def duplicate(self) -> "Communicator":
        """Collective: a communicator of the same backend over the same ranks whose operations
        are ordered apart from this one's (MPI_Comm_dup; a new torch.distributed group), so
        operations started on it may interleave with this one's differently on different ranks
        (the gradient buckets started during a backward that exchanges halos)."""

    @abstractmethod
    def open_capped(self, recv_caps) -> "CappedChannel":
        """Collective: a channel of capped exchanges in which rank ``q`` sends this rank at most
        ``recv_caps[q]`` rows per exchange (int [size]; this rank's own entry is ignored)."""


class CappedChannel(ABC):
    """Capped exchanges between the ranks of one job (:meth:`Communicator.open_capped`).

    :meth:`start` posts one exchange and returns at once (it never waits for another rank):
    ``arrays`` are tensors of the same row count, rows grouped by destination rank
    (``send_counts[r]`` rows for rank ``r``, none for this rank, at most the receiver's cap), the
    same dtype and row shape on every rank. ``wait()`` of the returned :class:`Pending` gives
    ``(arrays, sources)``: the rows received, ordered by source rank (tensors on the device of
    the inputs), and the source rank of each row (int32 CPU tensor). Every rank starts the same
    exchanges in the same order; exchanges of one ``tag`` are matched in the order they were
    started. ``recv_buffers`` (optional, mpi4py): per array a list with, per other rank in
    ascending order, a CPU tensor of at least ``recv_caps[q]`` rows that is received into in
    place (not to be touched until ``wait()`` returned); other backends allocate their own.

    ``independent``: the channel's exchanges are ordered apart from the plane's other operations
    (a communicator of its own), so a rank may start one before or after a collective on the
    plane where another rank starts it on the other side (still in the same order among the
    channel's exchanges). False where they are collectives of the plane's own group.
    """

    recv_caps: np.ndarray
    independent: bool = False

    @abstractmethod
    def start(self, arrays: list[torch.Tensor], send_counts, tag: int,
              recv_buffers: list[list[torch.Tensor]] | None = None) -> Pending: ...

    @abstractmethod
    def close(self) -> None:
        """Collective: release the channel (every started exchange has completed)."""


# ---- mpi4py ------------------------------------------------------------------------------

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


class _Done(Pending):
    def __init__(self, result=None):
        self.result = result

    def test(self) -> bool:
        return True

    def wait(self):
        return self.result


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


# ---- torch.distributed ----------------------------------------------------------------------

class _TorchWork(Pending):
    """An async torch.distributed work item; ``result`` is what ``wait()`` returns."""

    def __init__(self, work, result=None, finish=None):
        self.work, self.result, self.finish = work, result, finish
        self.done = work is None

    def test(self) -> bool:
        if not self.done and self.work.is_completed():
            self.work.wait()
            self.done = True
        return self.done

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.done = True
        if self.finish is not None:
            self.result, self.finish = self.finish(self.result), None
        return self.result


def copy_back_into(buf: torch.Tensor):
    """The ``finish`` of a :class:`_TorchWork` that reduced a copy of ``buf`` on the
    communicator's device: copies the result into ``buf`` (on its own device) and returns None."""
    def finish(result: torch.Tensor) -> None:
        buf.copy_(result)

    return finish


def _byte_rows(x: torch.Tensor) -> torch.Tensor:
    """A contiguous ``x`` [n, ...] viewed as uint8 rows [n, row bytes] (moves of rows need no
    arithmetic, and gloo has no int16/bfloat16 collectives)."""
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    if x.numel() == 0:          # no bytes to view (an empty tensor's strides may be anything)
        return torch.empty((x.shape[0], row * x.element_size()), dtype=torch.uint8, device=x.device)
    return x.reshape(x.shape[0], row).view(torch.uint8)


def _from_byte_rows(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_byte_rows`: uint8 rows [m, row bytes] as rows of ``like``'s dtype
    and row shape."""
    shape = (b.shape[0],) + tuple(like.shape[1:])
    if b.numel() == 0:
        return torch.empty(shape, dtype=like.dtype, device=b.device)
    return b.view(like.dtype).reshape(shape)


class TorchCommunicator(Communicator):
    """torch.distributed's default process group (initialised by
    :meth:`hpcgnn.runtime.Runtime.init_torch_distributed`) on tensors of ``device``: tensors
    elsewhere are moved there for the operation and the result moved back."""

    def __init__(self, name: str, rank: int, size: int, device: torch.device | str, group=None):
        super().__init__(rank, size, device)
        self.name = name
        self.group = group          # None: the default process group

    def duplicate(self) -> "TorchCommunicator":
        import torch.distributed as dist

        group = dist.new_group(backend=self.name) if self.size > 1 else None
        return TorchCommunicator(self.name, self.rank, self.size, self.device, group)

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the data plane's device, contiguous; a host tensor goes to a GPU without
        waiting for the device (:func:`hpcgnn.upload.upload`: the collective's stream waits for
        the copy, which is queued on the current stream)."""
        t = t.detach().contiguous()
        return t if t.device == self.device else upload(t, self.device)

    def exchange_counts(self, send_counts) -> np.ndarray:
        import torch.distributed as dist

        sc = self._counts(send_counts, "send_counts")
        if self.size == 1:
            return sc.copy()
        s = upload(torch.from_numpy(sc), self.device)
        r = torch.empty_like(s)
        dist.all_to_all_single(r, s, group=self.group)
        return r.cpu().numpy()

    def start_alltoallv(self, send, send_counts, recv_counts=None) -> Pending:
        import torch.distributed as dist

        sc = self._counts(send_counts, "send_counts")
        self._check_rows(send, sc)
        rc = self.exchange_counts(sc) if recv_counts is None else self._counts(recv_counts, "recv_counts")
        if self.size == 1:        # one rank: a copy on the sender's device (as every rank's result)
            return _Done(send.detach().contiguous().clone())
        x = self._on(send)
        xb = _byte_rows(x)
        out = xb.new_empty((int(rc.sum()), xb.shape[1]))
        work = dist.all_to_all_single(out, xb, output_split_sizes=rc.tolist(),
                                      input_split_sizes=sc.tolist(), async_op=True, group=self.group)
        # keep the send buffer alive until completion
        return _TorchWork(work, (out, xb), lambda r: _from_byte_rows(r[0], x).to(send.device))

    def start_allreduce_(self, buf) -> Pending:
        import torch.distributed as dist

        if self.size == 1:
            return _Done()
        if not buf.is_contiguous():
            raise ValueError("allreduce_: buf must be contiguous")
        t = buf if buf.device == self.device else upload(buf, self.device)
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True, group=self.group)
        if t is buf:
            return _TorchWork(work)
        return _TorchWork(work, t, copy_back_into(buf))

    def allreduce_(self, buf, op: str = "sum"):
        import torch.distributed as dist

        if op == "sum":
            return super().allreduce_(buf)
        if op != "max":
            raise ValueError(f"{self.name}: allreduce_ op {op!r}, expected 'sum' or 'max'")
        if self.size > 1:
            if not buf.is_contiguous():
                raise ValueError("allreduce_: buf must be contiguous")
            t = buf if buf.device == self.device else upload(buf, self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            if t is not buf:
                buf.copy_(t)
        return buf

    def open_capped(self, recv_caps) -> CappedChannel:
        return _TorchCappedChannel(self, self._counts(recv_caps, "recv_caps"))

    def allgatherv(self, send, counts) -> torch.Tensor:
        import torch.distributed as dist

        c = self._counts(counts, "counts")
        if send.shape[0] != c[self.rank]:
            raise ValueError(f"allgatherv: rank {self.rank} sends {send.shape[0]} rows, counts say {c[self.rank]}")
        if self.size == 1:
            return send.detach().contiguous().clone()
        x = self._on(send)
        # equal pieces (padded to the largest count), then the padding dropped
        most = int(c.max())
        xb = _byte_rows(x)
        piece = xb.new_zeros((most, xb.shape[1]))
        piece[:x.shape[0]] = xb
        out = xb.new_empty((most * self.size, xb.shape[1]))
        dist.all_gather_into_tensor(out, piece, group=self.group)
        keep = torch.from_numpy(_segment_index(c, np.arange(self.size, dtype=np.int64) * most))
        return _from_byte_rows(out.index_select(0, upload(keep, out.device)), x).to(send.device)

    def broadcast_(self, buf, root: int = 0):
        import torch.distributed as dist

        if self.size > 1:
            t = buf if (buf.device == self.device and buf.is_contiguous()) else upload(buf.contiguous(), self.device)
            dist.broadcast(t, src=root, group=self.group)
            if t is not buf:
                buf.copy_(t)
        return buf


def _segment_index(counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Positions ``starts[r] + i`` for ``i < counts[r]``, r ascending (int64, vectorised)."""
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


class _TorchCappedPending(Pending):
    """One async all_to_all_single of byte rows: per peer a header (the row count, int64) and the
    rows padded to the receiver's cap; the header is read and the padding dropped on :meth:`wait`."""

    def __init__(self, channel: "_TorchCappedChannel", work, recv, width: int, keep, like):
        self.channel, self.work, self.recv, self.width = channel, work, recv, width
        self.keep, self.like = keep, like        # the send buffer alive until completion
        self.result = None

    def test(self) -> bool:
        return self.result is not None or self.work is None or self.work.is_completed()

    def wait(self):
        if self.result is None:
            if self.work is not None:
                self.work.wait()
            ch = self.channel
            size, h = ch.comm.size, ch.header_rows(self.width)
            counts = np.zeros(size, dtype=np.int64)
            if ch.peers.size:
                starts = ch.recv_segments(h)[0][ch.peers]
                head = self.recv.index_select(0, upload(torch.from_numpy(_segment_index(
                    np.full(ch.peers.size, h, dtype=np.int64), starts)), self.recv.device))
                raw = np.ascontiguousarray(head.reshape(ch.peers.size, -1)[:, :8].cpu().numpy())
                counts[ch.peers] = raw.view("<i8").reshape(-1)
            if (counts > ch.recv_caps).any() or (counts < 0).any():
                raise RuntimeError(f"capped exchange: rows {counts.tolist()} exceed the caps "
                                   f"{ch.recv_caps.tolist()}")
            idx = _segment_index(counts, ch.recv_segments(h)[0] + h)
            rows = self.recv.index_select(0, upload(torch.from_numpy(idx), self.recv.device))
            out, b0 = [], 0
            for t in self.like:
                nb = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
                piece = rows.new_empty((rows.shape[0], nb)).copy_(rows[:, b0:b0 + nb])   # fresh strides
                out.append(_from_byte_rows(piece, t).to(t.device))
                b0 += nb
            sources = torch.from_numpy(np.repeat(np.arange(size, dtype=np.int32), counts))
            self.result = (out, sources)
            self.work, self.recv, self.keep, self.like = None, None, None, None
        return self.result


class _TorchCappedChannel(CappedChannel):
    """Capped exchanges as collectives (torch.distributed has no matched point-to-point of
    unknown length): the caps are exchanged once here (blocking, collective), so each sender pads
    its rows for rank ``q`` to ``q``'s cap for it. Starting an exchange posts ONE async
    all_to_all_single and never waits: per peer a header of ``ceil(8 / row bytes)`` rows holding
    the row count, then the rows, padded. The header and padding travel but are no payload:
    callers count rows."""

    def __init__(self, comm: TorchCommunicator, recv_caps: np.ndarray):
        self.comm = comm
        caps = recv_caps.copy()
        caps[comm.rank] = 0
        self.recv_caps = caps
        self.send_caps = comm.exchange_counts(caps)       # what each receiver accepts from here
        self.send_caps[comm.rank] = 0
        self.peers = np.array([q for q in range(comm.size) if q != comm.rank], dtype=np.int64)
        self.closed = False

    @staticmethod
    def header_rows(width: int) -> int:
        return -(-8 // max(int(width), 1))

    def _segments(self, caps: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, size) in rows of every rank's segment: header + cap rows for a peer, none for
        this rank."""
        size = np.where(np.arange(self.comm.size) == self.comm.rank, 0, caps + h).astype(np.int64)
        return np.cumsum(size) - size, size

    def recv_segments(self, h: int):
        return self._segments(self.recv_caps, h)

    def start(self, arrays, send_counts, tag, recv_buffers=None) -> Pending:
        import torch.distributed as dist

        c = self.comm
        if self.closed:
            raise RuntimeError("capped exchange: the channel is closed")
        sc = c._counts(send_counts, "send_counts")
        xs = [c._on(a) for a in arrays]
        n = xs[0].shape[0]
        if int(sc.sum()) != n or any(x.shape[0] != n for x in xs):
            raise ValueError(f"capped exchange: send_counts {sc!r} do not split {n} rows")
        if sc[c.rank] != 0:
            raise ValueError(f"capped exchange: no rows to itself, got {sc!r}")
        if (sc > self.send_caps).any():
            raise ValueError(f"capped exchange: rows {sc.tolist()} exceed the receivers' caps "
                             f"{self.send_caps.tolist()}")
        width = sum(int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size() for x in xs)
        h = self.header_rows(width)
        s_start, s_size = self._segments(self.send_caps, h)
        r_start, r_size = self.recv_segments(h)
        send = torch.zeros((int(s_size.sum()), width), dtype=torch.uint8, device=c.device)
        recv = send.new_empty((int(r_size.sum()), width))
        if c.size == 1:
            return _TorchCappedPending(self, None, recv, width, None, list(arrays))
        head = np.zeros((self.peers.size, h * width), dtype=np.uint8)
        head[:, :8] = sc[self.peers].astype("<i8").view(np.uint8).reshape(-1, 8)
        hidx = _segment_index(np.full(self.peers.size, h, dtype=np.int64), s_start[self.peers])
        send.index_copy_(0, torch.from_numpy(hidx).to(send.device),
                         torch.from_numpy(head.reshape(-1, width)).to(send.device))
        if n:
            packed = torch.cat([_byte_rows(x) for x in xs], dim=1)
            send.index_copy_(0, torch.from_numpy(_segment_index(sc, s_start + h)).to(send.device), packed)
        work = dist.all_to_all_single(recv, send, output_split_sizes=r_size.tolist(),
                                      input_split_sizes=s_size.tolist(), async_op=True, group=c.group)
        return _TorchCappedPending(self, work, recv, width, send, list(arrays))

    def close(self) -> None:
        self.closed = True


def moves_device_buffers(backend: str, device: str) -> bool:
    """Whether ``runtime.backend`` = ``backend`` on compute ``device`` carries the data plane
    in device buffers (NCCL: its messages live in device memory) rather than host ones; for ranks
    with a GPU each (ranks sharing one fall back to mpi4py, see :func:`make_communicator`). A
    pair :func:`choose_backend` refuses: False (the run is refused before any buffer exists)."""
    try:
        return choose_backend(backend, str(device)) == "nccl"
    except InputError:
        return False


def make_communicator(rt, backend: str, device: torch.device | str = "cpu") -> Communicator:
    """The data plane for ``runtime.backend`` = ``backend`` on compute ``device`` (collective:
    a torch.distributed backend initialises its process group on every rank). One per job:
    the communicator is kept on ``rt`` and the same one is returned to later callers (a second,
    different backend in one job is an InputError). NCCL takes one rank per GPU: where ranks
    share one (more ranks than GPUs on a node), ``auto`` carries the data plane with mpi4py
    instead and ``nccl`` is an InputError on every rank."""
    name = choose_backend(backend, str(device))
    if name == "nccl" and rt.size > 1:
        shared = rt.shared_gpus(device)        # collective; the same answer on every rank
        if shared:
            if backend == "nccl":
                gpu, ranks = max(shared.items(), key=lambda kv: kv[1])
                raise InputError(f"runtime.backend = 'nccl' but {ranks} ranks share GPU {gpu} (more ranks than "
                                 "GPUs): NCCL takes one rank per GPU; use 'auto' or 'mpi4py' (host buffers), or "
                                 "as many GPUs as ranks")
            name = "mpi4py"
    have = getattr(rt, "data_plane", None)
    if have is not None:
        if have.name != name:
            raise InputError(f"runtime.backend: this job's data plane is already {have.name!r}, "
                             f"cannot switch to {name!r}")
        return have
    if name == "mpi4py":
        comm = MpiCommunicator(rt.comm)
    else:
        used = rt.init_torch_distributed(name, str(device))
        dev = torch.device("cuda", torch.cuda.current_device()) if used == "nccl" else torch.device("cpu")
        comm = TorchCommunicator(used, rt.rank, rt.size, dev)
    rt.data_plane = comm
    return comm
