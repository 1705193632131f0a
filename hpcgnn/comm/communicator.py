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

Implementations (``runtime.backend``, :func:`hpcgnn.comm.data_plane.make_communicator`):

* :class:`~hpcgnn.comm.communicator_mpi.MpiCommunicator` (``mpi4py``): host buffers through
  mpi4py, the default on the CPU and bit for bit the exchanges hpcgnn always made; device
  tensors are staged through the host.
* :class:`~hpcgnn.comm.communicator_torch.TorchCommunicator` (``gloo``, ``nccl``, ``ccl``):
  ``torch.distributed`` on tensors where they live: nccl on CUDA tensors with no host staging,
  gloo and ccl on CPU tensors.

This module holds the interface (:class:`Communicator`, :class:`Pending`,
:class:`CappedChannel`) and the choice of backend (:func:`choose_backend`); the
implementations live in the modules named above.

MPI (mpi4py) stays the launcher and the control plane (ranks, agreement on errors, abort,
metrics, checkpoints, the run file): those use ``Runtime.comm`` directly, never this seam.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from hpcgnn.errors import InputError

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
    are :func:`~hpcgnn.comm.data_plane.make_communicator`'s to check (NCCL takes one rank per GPU).
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


class _Done(Pending):
    """A completed operation (the implementations' answer where nothing is left to wait for)."""

    def __init__(self, result=None):
        self.result = result

    def test(self) -> bool:
        return True

    def wait(self):
        return self.result


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


def moves_device_buffers(backend: str, device: str) -> bool:
    """Whether ``runtime.backend`` = ``backend`` on compute ``device`` carries the data plane
    in device buffers (NCCL: its messages live in device memory) rather than host ones; for ranks
    with a GPU each (ranks sharing one fall back to mpi4py, see
    :func:`~hpcgnn.comm.data_plane.make_communicator`). A
    pair :func:`choose_backend` refuses: False (the run is refused before any buffer exists)."""
    try:
        return choose_backend(backend, str(device)) == "nccl"
    except InputError:
        return False
