"""The torch.distributed implementations of the data plane: :class:`TorchCommunicator`
(``runtime.backend`` = ``gloo``, ``nccl`` or ``ccl``) on tensors where they live: nccl on CUDA
tensors with no host staging, gloo and ccl on CPU tensors. The interface it implements is
:class:`~hpcgnn.comm.communicator.Communicator`; the job's instance is made by
:func:`hpcgnn.comm.data_plane.make_communicator` (which initialises the process group).
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.comm.communicator import CappedChannel, Communicator, Pending, _Done
from hpcgnn.upload import upload


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
