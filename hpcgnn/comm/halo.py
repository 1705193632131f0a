"""Halo exchange for exact full-graph training, and its adjoint.

A rank owns the solid rows ``0..n_solid-1`` of its partition and needs copies
of the halo rows ``n_solid..n_local-1`` (in-neighbours owned elsewhere). The
forward exchange sends each owner's boundary rows (``Partition.send_list``) to
the ranks that hold them as halo; the backward (adjoint) exchange sends the
gradients of the halo copies back to their owners, where they are **summed**
into the owner's rows. :class:`HaloExchange` wraps the pair as one
``torch.autograd.Function`` (Megatron style: a collective with its adjoint),
so a model written for one process trains exactly over K ranks.

Every exchange goes through the job's data plane, a
:class:`~hpcgnn.comm.communicator.Communicator` (``comm`` below; None = one process, no halo);
every rank must call the same exchanges in the same order (collectives).
Partitions own contiguous global-ID ranges and ``halo_ids`` is sorted, so the
rows received from sources 0..K-1, concatenated, are already in halo order.

Engines reach the halo through a :class:`HaloProvider`: ``fetch`` (a layer's halo rows from
the owners' solid rows) and ``adjoint`` (halo gradients back to their owners) are what an
implementation decides; :meth:`HaloProvider.exchange` (autograd, in-memory engine),
:meth:`HaloProvider.fill` / :meth:`HaloProvider.accumulate` (host buffers, offloaded engine) and
:meth:`HaloProvider.rounds` (streamed, bounded-memory evaluation) are built on them.
:class:`ExactHalo` is the blocking exact exchange; a cached or pipelined provider (stale rows
within a bound) or a tensor-split one overrides ``fetch`` and keeps the same callers.
"""
from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.comm.communicator import Communicator
from hpcgnn.errors import InputError


@dataclass
class HaloPlan:
    """Rows one rank sends and receives in a halo exchange.

    send_index  int64 [S]  local solid rows to send, grouped by destination rank
    send_counts int64 [K]  rows sent to each rank (``send_index`` segments)
    recv_counts int64 [K]  rows received from each rank; concatenated = halo order
    """

    num_solid: int
    num_halo: int
    send_index: np.ndarray
    send_counts: np.ndarray
    recv_counts: np.ndarray

    @property
    def num_parts(self) -> int:
        return int(self.send_counts.shape[0])

    @property
    def rows_sent(self) -> int:
        return int(self.send_index.shape[0])

    @classmethod
    def from_partition(cls, part, comm: Communicator | None = None) -> "HaloPlan":
        """Plan of ``part``'s exchange; with ``comm`` (a Communicator; collective) check the peers
        agree.

        Raises InputError if the communicator size differs from the store's
        partition count or if the send lists of the owners do not match the
        halo lists of the receivers (a store mixing two partitionings).
        """
        k = part.num_parts
        send_counts = np.diff(part.send_indptr).astype(np.int64)
        send_index = (part.send_ids - part.solid_begin).astype(np.int64)
        if send_index.size and (send_index.min() < 0 or send_index.max() >= part.num_solid):
            raise InputError(f"partition {part.part_id}: send_ids hold vertices it does not own")
        owner = np.asarray(part.halo_owner, dtype=np.int64)
        if owner.size and np.any(np.diff(owner) < 0):
            raise InputError(f"partition {part.part_id}: halo_owner is not grouped by owner "
                             "(halo_ids must be sorted and partitions own contiguous ranges)")
        recv_counts = np.bincount(owner, minlength=k).astype(np.int64)
        plan = cls(num_solid=part.num_solid, num_halo=part.num_halo, send_index=send_index,
                   send_counts=send_counts, recv_counts=recv_counts)
        if comm is not None:
            if comm.size != k:
                raise InputError(f"the partition store has {k} partitions but the job has "
                                 f"{comm.size} ranks (one rank per partition)")
            expect = comm.exchange_counts(send_counts)
            bad = torch.tensor([int(np.any(expect != recv_counts))], dtype=torch.int64)
            if int(comm.allreduce_(bad, op="max")[0]):
                raise InputError("partition store is inconsistent: a partition's halo rows do not "
                                 "match its owners' send lists")
        return plan


WIRE_PRECISIONS = ("fp32", "bf16")   # fullgraph.halo_precision: wire formats of float32 rows
WIRE_ITEMSIZE = {"fp32": 4, "bf16": 2}


def to_wire(rows: np.ndarray, precision: str) -> np.ndarray:
    """Float32 ``rows`` as sent: unchanged for ``"fp32"``; for ``"bf16"`` rounded once (to
    nearest, ties to even) to bfloat16 and viewed as int16 (2 bytes a value, same shape)."""
    if precision == "fp32":
        return rows
    if precision != "bf16":
        raise ValueError(f"halo wire precision {precision!r}, expected one of {WIRE_PRECISIONS}")
    t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy()


def from_wire(rows: np.ndarray, precision: str) -> np.ndarray:
    """The inverse of :func:`to_wire` up to its rounding: received rows widened to float32."""
    if precision == "fp32":
        return rows
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int16)).view(torch.bfloat16).float().numpy()


def alltoallv_rows(comm: Communicator, send: np.ndarray, send_counts, recv_counts) -> np.ndarray:
    """Host rows through ``comm``'s blocking :meth:`~Communicator.alltoallv` (zero-copy torch
    views of the numpy buffers on the way in and out)."""
    return comm.alltoallv(torch.from_numpy(np.ascontiguousarray(send)), send_counts, recv_counts).numpy()


def exchange_rows(comm: Communicator | None, plan: HaloPlan, solid_rows: np.ndarray,
                  precision: str = "fp32") -> np.ndarray:
    """Forward exchange: halo rows [n_halo, ...] gathered from their owners' ``solid_rows``
    (float32 rows travel in the wire format ``precision``, :func:`to_wire`)."""
    send = solid_rows[plan.send_index] if plan.rows_sent else solid_rows[:0]
    if comm is None or comm.size == 1:
        return np.ascontiguousarray(send[:0])
    if precision == "fp32":
        return alltoallv_rows(comm, send, plan.send_counts, plan.recv_counts)
    return from_wire(alltoallv_rows(comm, to_wire(send, precision), plan.send_counts, plan.recv_counts),
                     precision)


def adjoint_rows(comm: Communicator | None, plan: HaloPlan, halo_grads: np.ndarray) -> np.ndarray:
    """Adjoint exchange: halo gradients back to owners; rows aligned with ``plan.send_index``.

    The caller adds the result into its solid rows at ``send_index``
    (see :meth:`HaloProvider.accumulate`).
    """
    if comm is None or comm.size == 1:
        return np.ascontiguousarray(halo_grads[:0])
    return alltoallv_rows(comm, halo_grads, plan.recv_counts, plan.send_counts)


class HaloProvider(ABC):
    """Where the halo rows of a layer's input come from and where their gradients go (one rank;
    every method is collective: all ranks call it for the same layers in the same order).

    ``comm``: the data plane (a :class:`~hpcgnn.comm.communicator.Communicator`, None on one
    process). ``stats`` accumulates ``halo_s`` (seconds in exchanges) and ``halo_bytes`` (bytes
    this rank sent, forward and adjoint); :meth:`reset_stats` clears it.
    """

    def __init__(self, comm: Communicator | None, plan: HaloPlan, stats: dict | None = None):
        if comm is not None and not isinstance(comm, Communicator):
            raise TypeError(f"halo provider: comm must be a Communicator (hpcgnn.comm.communicator), "
                            f"got {type(comm).__name__}")
        self.comm, self.plan = comm, plan
        self.stats = {} if stats is None else stats

    @property
    def num_solid(self) -> int:
        return self.plan.num_solid

    @property
    def num_halo(self) -> int:
        return self.plan.num_halo

    @property
    def distributed(self) -> bool:
        """Whether there is anything to exchange (more than one rank)."""
        return self.comm is not None and self.comm.size > 1

    def reset_stats(self) -> None:
        self.stats.clear()

    # ---- epochs, evaluation and the run file's figures (defaults: an exact provider) ---------
    def begin_epoch(self, epoch: int) -> None:
        """Training epoch ``epoch`` starts (same value on every rank)."""

    @contextlib.contextmanager
    def exact_mode(self):
        """Within: exact exchanges whose forward bytes do not count as training's (evaluation)."""
        fwd = self.stats.get("halo_fwd_bytes", 0)
        try:
            yield
        finally:
            self.stats["halo_fwd_bytes"] = fwd

    def epoch_report(self) -> tuple[dict, dict]:
        """(counters, per_layer) of the training epoch so far for the run file: ``halo_fwd_bytes``
        (training's forward rows sent) and ``halo_adjoint_bytes`` (their gradients sent back)."""
        if not self.distributed:
            return {}, {}
        return {"halo_fwd_bytes": float(self.stats.get("halo_fwd_bytes", 0)),
                "halo_adjoint_bytes": float(self.stats.get("halo_adjoint_bytes", 0))}, {}

    def timing_report(self) -> dict:
        """Seconds of the epoch so far: ``halo`` (all exchanges)."""
        return {"halo": float(self.stats.get("halo_s", 0.0))}

    def close(self) -> None:
        """Collective: release what the provider holds (nothing for an exact one)."""

    def account(self, t0: float, nbytes: int) -> None:
        """Add the seconds since ``t0`` and ``nbytes`` sent to :attr:`stats`."""
        _account(self.stats, t0, nbytes)

    @abstractmethod
    def fetch(self, layer: int, solid_rows: np.ndarray) -> np.ndarray:
        """The halo rows [num_halo, ...] of layer ``layer``'s input, given this rank's solid rows
        [num_solid, ...] of it (host arrays). Only the rows at ``plan.send_index`` of
        ``solid_rows`` may be read (from a device-resident layer only those are copied)."""

    @abstractmethod
    def adjoint(self, layer: int, halo_grads: np.ndarray) -> np.ndarray:
        """The adjoint of :meth:`fetch`: gradients of this rank's halo rows [num_halo, ...] go to
        their owners; returns the rows received, aligned with ``plan.send_index`` (to be summed
        into the solid gradients there)."""

    # ---- tensors (default: through the host arrays of fetch / adjoint) --------------------------
    def fetch_tensor(self, layer: int, h_solid: torch.Tensor) -> torch.Tensor:
        """:meth:`fetch` on tensors: the halo rows [num_halo, ...] of ``h_solid`` [num_solid, ...],
        on ``h_solid``'s device and dtype. This default goes through the host (only the rows
        at ``plan.send_index`` of a device tensor are copied); a provider whose exchange runs on
        tensors (:class:`ExactHalo`) overrides it, so a device data plane (nccl) moves device
        rows with no host staging."""
        halo = self.fetch(layer, _host_solid_rows(h_solid, self.plan.send_index))
        return torch.from_numpy(halo).to(h_solid.device, h_solid.dtype).reshape((-1,) + tuple(h_solid.shape[1:]))

    def adjoint_tensor(self, layer: int, halo_grads: torch.Tensor) -> torch.Tensor:
        """:meth:`adjoint` on tensors (the default goes through the host)."""
        return torch.from_numpy(self.adjoint(layer, halo_grads.detach().cpu().contiguous().numpy()))

    def _send_index(self, device: torch.device) -> torch.Tensor:
        """``plan.send_index`` as an int64 tensor on ``device`` (made once per device)."""
        cache = self.__dict__.setdefault("_send_index_cache", {})
        key = str(device)
        if key not in cache:
            cache[key] = torch.from_numpy(self.plan.send_index).to(device)
        return cache[key]

    # ---- built on fetch / adjoint --------------------------------------------------------
    def exchange(self, layer: int, h_solid: torch.Tensor) -> torch.Tensor:
        """Differentiable: [num_solid, ...] -> [num_solid + num_halo, ...]; the backward sums the
        halo gradients into their owners' rows (:meth:`adjoint`)."""
        if h_solid.shape[0] != self.num_solid:
            raise ValueError(f"halo exchange: {h_solid.shape[0]} rows, plan expects {self.num_solid}")
        if not self.distributed and self.num_halo == 0:
            return h_solid  # a single partition has no halo
        return HaloExchange.apply(h_solid, self, int(layer))

    def fill(self, layer: int, h: torch.Tensor) -> None:
        """In place on a host tensor [num_solid + num_halo, ...]: its halo rows from :meth:`fetch`
        of its solid rows."""
        if not self.distributed:
            return
        halo = self.fetch(layer, h[:self.num_solid].numpy())
        h[self.num_solid:] = torch.from_numpy(halo).view(-1, *h.shape[1:])

    def accumulate(self, layer: int, solid_grads: torch.Tensor, halo_grads: torch.Tensor) -> None:
        """``solid_grads[send_index] += adjoint(halo_grads)`` in place (CPU or device tensors)."""
        if not self.distributed:
            return
        back = self.adjoint_tensor(layer, halo_grads.detach())
        if back.shape[0]:
            solid_grads.index_add_(0, self._send_index(solid_grads.device),
                                   back.to(solid_grads.device, solid_grads.dtype).reshape(
                                       (-1,) + tuple(solid_grads.shape[1:])))

    def rounds(self, count: int) -> "HaloRounds":
        """The exact forward exchange in ``count`` collectives of part of the rows each
        (bounded-memory evaluation, :mod:`hpcgnn.engine.inference`)."""
        return HaloRounds(self.comm, self.plan, count)


class ExactHalo(HaloProvider):
    """The blocking exact exchange: every fetch sends the owners' current rows.

    ``precision`` (``fullgraph.halo_precision``): the wire format of the rows of layers >= 1
    in training (:func:`to_wire`; ``"bf16"`` halves their bytes); layer 0 and evaluation
    (:meth:`exact_mode`) always send float32."""

    def __init__(self, comm: Communicator | None, plan: HaloPlan, stats: dict | None = None,
                 precision: str = "fp32"):
        super().__init__(comm, plan, stats)
        self.precision = precision
        self._eval = False

    @contextlib.contextmanager
    def exact_mode(self):
        self._eval = True
        try:
            with super().exact_mode():
                yield
        finally:
            self._eval = False

    def fetch(self, layer: int, solid_rows: np.ndarray) -> np.ndarray:
        return self.fetch_tensor(layer, torch.from_numpy(solid_rows)).numpy()

    def adjoint(self, layer: int, halo_grads: np.ndarray) -> np.ndarray:
        return self.adjoint_tensor(layer, torch.from_numpy(np.ascontiguousarray(halo_grads))).numpy()

    def fetch_tensor(self, layer: int, h_solid: torch.Tensor) -> torch.Tensor:
        """The exchange on ``h_solid``'s device: its rows at ``send_index`` (float32 rows in the
        wire format, :func:`to_wire`'s rounding) through the data plane, which stages them
        through the host only when it is not on that device (mpi4py, gloo)."""
        t0 = time.perf_counter()
        wire = "fp32" if layer == 0 or self._eval else self.precision
        if wire not in WIRE_PRECISIONS:
            raise ValueError(f"halo wire precision {wire!r}, expected one of {WIRE_PRECISIONS}")
        rows = h_solid.detach()
        if not self.distributed:
            halo = rows[:0]
        else:
            send = rows.index_select(0, self._send_index(rows.device)) if self.plan.rows_sent else rows[:0]
            if wire == "bf16":
                send = send.float().to(torch.bfloat16)
            halo = self.comm.alltoallv(send.contiguous(), self.plan.send_counts, self.plan.recv_counts)
            if wire == "bf16":
                halo = halo.float()
        per_row = rows[0:1].numel() * (rows.element_size() if wire == "fp32" else WIRE_ITEMSIZE[wire])
        nbytes = self.plan.rows_sent * per_row if self.distributed else 0
        self.account(t0, nbytes)
        self.stats["halo_fwd_bytes"] = self.stats.get("halo_fwd_bytes", 0) + nbytes   # forward only
        return halo

    def adjoint_tensor(self, layer: int, halo_grads: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        g = halo_grads.detach().contiguous()
        if not self.distributed:
            back = g[:0]
        else:
            back = self.comm.alltoallv(g, self.plan.recv_counts, self.plan.send_counts)
        nbytes = g.numel() * g.element_size() if self.distributed else 0
        self.account(t0, nbytes)
        self.stats["halo_adjoint_bytes"] = self.stats.get("halo_adjoint_bytes", 0) + nbytes
        return back


class HaloExchange(torch.autograd.Function):
    """h_local = [h_solid; provider.fetch(layer)]; backward: provider.adjoint summed into owners."""

    @staticmethod
    def forward(ctx, h_solid: torch.Tensor, provider: HaloProvider, layer: int) -> torch.Tensor:
        ctx.provider, ctx.layer = provider, layer
        halo = provider.fetch_tensor(layer, h_solid.detach())
        halo = halo.to(h_solid.device, h_solid.dtype).reshape((-1,) + tuple(h_solid.shape[1:]))
        return torch.cat([h_solid, halo], dim=0)

    @staticmethod
    def backward(ctx, grad_local: torch.Tensor):
        provider = ctx.provider
        grad_solid = grad_local[:provider.num_solid].clone()
        provider.accumulate(ctx.layer, grad_solid, grad_local[provider.num_solid:])
        return grad_solid, None, None


def _host_solid_rows(h_solid: torch.Tensor, send_index: np.ndarray) -> np.ndarray:
    """A host array [num_solid, ...] for :meth:`HaloProvider.fetch`: ``h_solid`` itself on the
    CPU; from a device tensor only the rows at ``send_index`` (the only rows a provider sends)
    are copied, into an uninitialised array whose other rows are never read (their pages are
    never touched), so a device-resident layer moves just its boundary rows to the host."""
    if h_solid.device.type == "cpu":
        return h_solid.contiguous().numpy()
    out = np.empty(tuple(h_solid.shape), dtype=torch.empty((), dtype=h_solid.dtype).numpy().dtype)
    if send_index.size:
        index = torch.from_numpy(send_index).to(h_solid.device)
        out[send_index] = h_solid.index_select(0, index).cpu().numpy()
    return out


def _account(stats: dict | None, t0: float, nbytes: int) -> None:
    if stats is not None:
        stats["halo_s"] = stats.get("halo_s", 0.0) + time.perf_counter() - t0
        stats["halo_bytes"] = stats.get("halo_bytes", 0) + int(nbytes)


def halo_exchange(h_solid: torch.Tensor, comm: Communicator | None, plan: HaloPlan,
                  stats: dict | None = None) -> torch.Tensor:
    """Differentiable exact halo exchange: [n_solid, ...] -> [n_solid + n_halo, ...] (collective;
    :meth:`ExactHalo.exchange`). ``stats`` (optional) accumulates ``halo_s`` and ``halo_bytes``."""
    return ExactHalo(comm, plan, stats).exchange(0, h_solid)


class HaloRounds:
    """The forward halo exchange split into ``rounds`` collectives of about ``1/rounds`` of the
    rows each, so a receiver never holds more than one round of halo rows.

    Round ``k`` carries, from every owner ``s`` to every receiver, rows
    ``[n * k // rounds, n * (k + 1) // rounds)`` of the ``n`` rows ``s`` sends it (both sides
    know ``n`` from the plan). On the receiver, :attr:`round_of` [num_halo] gives the round of
    every halo position and :attr:`row_in_round` its row in that round's buffer; the rows of
    round ``k`` arrive in increasing halo position. Every rank must call :meth:`round_rows` for
    the same rounds in the same order (collective). ``comm`` (a Communicator) None or of size 1:
    no halo.
    """

    def __init__(self, comm: Communicator | None, plan: HaloPlan, rounds: int):
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.comm, self.plan, self.rounds = comm, plan, int(rounds)
        self.num_solid, self.num_halo = plan.num_solid, plan.num_halo
        r = self.rounds
        recv = plan.recv_counts
        offsets = np.concatenate([[0], np.cumsum(recv)]).astype(np.int64)
        owner = np.repeat(np.arange(recv.shape[0]), recv)
        j = np.arange(self.num_halo, dtype=np.int64) - offsets[owner]    # index within the owner's rows
        n = recv[owner]
        # round k holds j in [n*k//r, n*(k+1)//r): the largest k with n*k//r <= j, i.e.
        # n*k < (j+1)*r, i.e. k = ceil((j+1)*r/n) - 1
        k = ((j + 1) * r + n - 1) // np.maximum(n, 1) - 1
        self.round_of = np.minimum(k, r - 1).astype(np.int64)
        counts = np.bincount(self.round_of, minlength=r)
        starts = np.concatenate([[0], np.cumsum(counts)])[:-1]
        order = np.argsort(self.round_of, kind="stable")
        self.row_in_round = np.empty(self.num_halo, dtype=np.int64)
        self.row_in_round[order] = np.arange(self.num_halo) - np.repeat(starts, counts)
        self.round_sizes = counts.astype(np.int64)
        send_off = np.concatenate([[0], np.cumsum(plan.send_counts)]).astype(np.int64)
        self._send_off = send_off

    def _pieces(self, counts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        lo = (counts * k) // self.rounds
        hi = (counts * (k + 1)) // self.rounds
        return lo, hi - lo

    def round_rows(self, solid_rows: np.ndarray, k: int) -> np.ndarray:
        """Collective: this rank's halo rows of round ``k`` [round_sizes[k], ...] from their
        owners' ``solid_rows`` [num_solid, ...]."""
        plan = self.plan
        if self.comm is None or self.comm.size == 1 or plan.num_parts == 1:
            return np.ascontiguousarray(solid_rows[:0])
        lo, cnt = self._pieces(plan.send_counts, k)
        starts = self._send_off[:-1] + lo
        idx = np.repeat(starts - np.concatenate([[0], np.cumsum(cnt)])[:-1], cnt) + np.arange(cnt.sum())
        send = solid_rows[plan.send_index[idx]]
        _, rcnt = self._pieces(plan.recv_counts, k)
        return alltoallv_rows(self.comm, send, cnt.astype(np.int64), rcnt.astype(np.int64))

    def all_rows(self, solid_rows: np.ndarray) -> np.ndarray:
        """Collective: every halo row at once (one exchange), [num_halo, ...]."""
        return exchange_rows(self.comm, self.plan, solid_rows)
