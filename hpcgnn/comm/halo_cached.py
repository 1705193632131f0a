"""CaPGNN's JACA halo cache with a hard staleness bound, and a PipeGCN-style pipelined exchange.

:class:`CachedHalo` is a :class:`~hpcgnn.comm.halo.HaloProvider` for the in-memory full-graph
engine (``fullgraph.halo = "cached"`` and/or ``fullgraph.pipeline = true``).

Cache (receiver side): :class:`~hpcgnn.cache.halo.ReceiverCache`, the two-tier cache of
:mod:`hpcgnn.cache.halo` (tiers, admission by duplication count, stores and lookups). This
module fills it: :func:`duplication_counts` (collective) gives the counts admission orders by.

What a layer's halo holds. Per layer the cache keeps the rows the exact exchange sends at that
layer, in the same width: the layer's input, or its projection where the layer exchanges that
instead (:func:`hpcgnn.nn.conv.halo_exchange_width`, the one rule of both modes: GCN's source
rows, a SAGE or GAT projection narrower than the input). ``widths`` are those widths.

Protocol (:class:`RefreshSchedule`, run by both sides). At start-up every receiver tells each
owner which of the rows it sends are cached there (one all-to-all of a byte per halo row), so
both sides agree deterministically. The owner keeps, per (receiver, row) = per entry of its send
list and layer, the epoch it last sent the row. At epoch ``t`` with staleness bound ``S`` and
pipeline lag ``lag`` (0 blocking, 1 pipelined: a message sent at ``t`` is used at ``t + 1``) it
sends a row when the receiver does not cache it or when ``last_sent < t + lag - S`` (the cached
copy would be older than ``S`` when used), and updates ``last_sent``. Layer 0 (the input features
never change) sends a cached row once, ever. The receiver runs the same schedule over its halo
rows (the same cached bits, the same calls), so it knows which rows arrive: a message is the rows
alone, in the owner's send-list order (a capped exchange of the data plane,
:meth:`~hpcgnn.comm.communicator.Communicator.open_capped`: no blocking count exchange, at most the
plan's halo rows per peer), and the receiver checks the count from every owner (it raises on a
mismatch). So a row costs what it costs in the exact exchange, **every row used at epoch t was
written at an epoch >= t - S** (a hard bound; :meth:`~hpcgnn.cache.halo.ReceiverCache.assemble`
raises if it ever would not hold), S = 0 without pipeline is the exact exchange, and the pipeline (which needs
S >= 1) uses rows exactly one epoch old for the rows the receiver does not cache. With every row
cached a hidden layer's rows travel once every S + 1 epochs (pipelined: S), so its forward bytes
are 1/(S + 1) (1/S) of the exact exchange's.

Pipeline. Layer ``l`` of epoch ``t`` waits for the message started at layer ``l`` of epoch
``t - 1`` (its rows are one epoch old), then starts epoch ``t``'s message non-blocking and
returns; the message travels while the rest of the forward, the backward, the gradient allreduce
and the update run. The first epoch (after start-up or a resume: the cache is soft state, never
checkpointed) fetches blocking (age 0) and starts the pipeline.

Where the rows live. :meth:`CachedHalo.fetch_tensor` (the in-memory engine's autograd exchange)
works on the training device: the rows sent are selected there (with a host data plane,
mpi4py or gloo, only they are copied to the host; with nccl none), and the halo block is
assembled there (:meth:`~hpcgnn.cache.halo.ReceiverCache.assemble_tensor`): device-tier rows
never leave the device, only host-tier rows and, with a host data plane, the received rows are
uploaded. :meth:`CachedHalo.fetch` (host arrays: the offloaded engine's ``fill``) builds the same
block in host memory. Both give the same rows, ages and byte counts; the epoch report counts
the row bytes each moved between host memory and the device (``halo_h2d_bytes`` /
``halo_d2h_bytes``, by side, so a CPU run counts what a GPU run moves).

Gradients (:meth:`CachedHalo.adjoint_tensor`) are always exact: the blocking exact adjoint
exchange, on the gradients' device.
Evaluation (:meth:`CachedHalo.exact_mode`) is exact too: hidden layers use a blocking exact
exchange that neither reads nor writes the cache; layer 0 reads the cache (exact: features are
constant).

Wire precision (``fullgraph.halo_precision``, :attr:`CacheSettings.precision`). With ``"bf16"``
the owner rounds the hidden-layer (layer >= 1) rows it sends to bfloat16 once (nearest even) and
sends 2 bytes a value; the receiver widens them to float32 before they enter the cache or the
halo block, so cached rows hold the rounded values. Layer 0 (exact, sent once), evaluation and
the gradient messages stay float32.

Measured staleness, per training epoch (:meth:`CachedHalo.epoch_report`): per layer the
histogram of the ages of the halo rows used (0 = sent this epoch), rows taken from each tier,
bytes sent and what the exact exchange sends for the same layer and step (``halo_fwd_nocache_bytes``:
the exact run's ``halo_fwd_bytes``: nothing for layer 0, whose rows it sends once at start-up), and
the adjoint bytes (the exact exchange's: gradients are not cached).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.cache.halo import NEVER, TIER_NONE, ReceiverCache, admission
from hpcgnn.comm.communicator import Communicator, Pending
from hpcgnn.comm.halo import WIRE_ITEMSIZE, HaloPlan, HaloProvider, alltoallv_rows, exchange_rows
from hpcgnn.upload import upload


@dataclass(frozen=True)
class CacheSettings:
    """``cache``: admit rows at all (``fullgraph.halo = "cached"``); ``staleness``: the bound S
    (epochs, >= 0); ``pipeline``: lag 1; ``budget_bytes`` / ``device_bytes``: the total and the
    device-tier budget per rank (None = unbounded: every halo row); ``precision``: the wire
    format of hidden-layer (layer >= 1) training rows, ``"fp32"`` or ``"bf16"``
    (:func:`~hpcgnn.comm.halo.to_wire`: rounded once by the owner, widened by the receiver before
    the cache)."""

    cache: bool
    staleness: int
    pipeline: bool
    budget_bytes: int | None = None
    device_bytes: int | None = None
    precision: str = "fp32"

    @property
    def lag(self) -> int:
        return 1 if self.pipeline else 0


class RefreshSchedule:
    """Which rows travel at each epoch (see the module text), run by both sides: by the owner over
    its send list, by the receiver over its halo rows, with the same cached bits and the same
    calls, so both get the same rows.

    ``cacheable`` bool [n]: whether the receiver caches row ``i``."""

    def __init__(self, cacheable: np.ndarray, num_layers: int):
        self.cacheable = np.asarray(cacheable, dtype=bool)
        self.last_sent = np.full((num_layers, self.cacheable.shape[0]), NEVER, dtype=np.int64)

    def select(self, layer: int, epoch: int, staleness: int, lag: int, constant: bool) -> np.ndarray:
        """Bool mask [n] of the rows sent at ``epoch`` for ``layer`` (recorded as sent)."""
        last = self.last_sent[layer]
        if constant:
            mask = ~self.cacheable | (last == NEVER)
        else:
            mask = ~self.cacheable | (last < epoch + lag - staleness)
        last[mask] = epoch
        return mask


def uses_cached_halo(cfg) -> bool:
    """Whether the config's full graph fetches its halo through :class:`CachedHalo` (a cache or a
    pipeline, ``[fullgraph]``); else through the exact, stateless exchange."""
    return cfg.fullgraph.halo == "cached" or bool(cfg.fullgraph.pipeline)


class _Message:
    """One started halo message of a layer: the exchange, the epoch its rows belong to, and the
    halo positions of the rows it brings (in arrival order: by owner, then send-list order)."""

    def __init__(self, exchange: Pending, epoch: int, positions: np.ndarray):
        self.exchange, self.epoch, self.positions = exchange, epoch, positions


def duplication_counts(comm: Communicator, plan: HaloPlan) -> np.ndarray:
    """Collective: for every halo row of this rank, the number of partitions that hold the vertex
    as halo (its owner counts the destinations of the vertex in its send list)."""
    dup_solid = np.bincount(plan.send_index, minlength=plan.num_solid).astype(np.int64)
    return exchange_rows(comm, plan, dup_solid)


class CachedHalo(HaloProvider):
    """A cached and/or pipelined halo provider (collective constructor; see the module text).

    ``widths`` [L]: the width of the rows every layer exchanges (its input, or the projection
    the exact exchange sends instead: :func:`hpcgnn.nn.conv.halo_exchange_width`); ``device``:
    where the device tier lives. Call :meth:`begin_epoch` before every training epoch,
    :meth:`close` after the last one."""

    def __init__(self, comm: Communicator | None, plan: HaloPlan, settings: CacheSettings, widths: list[int],
                 device="cpu", stats: dict | None = None):
        super().__init__(comm, plan, stats)
        self.settings = settings
        self.widths = [int(w) for w in widths]
        self.num_layers = len(self.widths)
        k = comm.size if comm is not None else 1
        # the forward messages: at most the plan's rows from each owner
        self._channel = comm.open_capped(plan.recv_counts) if self.distributed else None
        if self.distributed:
            dup = duplication_counts(comm, plan)
        else:
            dup = np.zeros(plan.num_halo, dtype=np.int64)
        row_bytes = 4 * sum(self.widths)
        if settings.cache:
            tier, slot = admission(dup, row_bytes, settings.budget_bytes, settings.device_bytes)
        else:
            tier, slot = np.zeros(plan.num_halo, np.int8), np.full(plan.num_halo, -1, np.int64)
        self.dup = dup
        self.cache = ReceiverCache(tier, slot, self.widths, device)
        cached = (tier != TIER_NONE).astype(np.uint8)
        if self.distributed:
            cacheable = alltoallv_rows(comm, cached, plan.recv_counts, plan.send_counts).astype(bool)
        else:
            cacheable = np.zeros(plan.rows_sent, dtype=bool)
        self.sender = RefreshSchedule(cacheable, self.num_layers)
        self.receiver = RefreshSchedule(tier != TIER_NONE, self.num_layers)   # the owners' schedule, mirrored
        self._owner = np.repeat(np.arange(k, dtype=np.int64), plan.recv_counts)
        self._dest = np.repeat(np.arange(k, dtype=np.int64), plan.send_counts)
        self._pending: dict[int, _Message] = {}
        self.epoch = 0
        self._exact = False
        self.report: dict = {}

    # ---- epochs and modes ------------------------------------------------------------------
    def begin_epoch(self, epoch: int) -> None:
        """Training epoch ``epoch`` starts (same value on every rank); clears the epoch report."""
        self.epoch = int(epoch)
        self.report = {}

    @contextlib.contextmanager
    def exact_mode(self):
        """Within: exact blocking exchanges that leave the cache and the pipeline untouched
        (evaluation)."""
        self._exact = True
        try:
            yield
        finally:
            self._exact = False

    def progress(self) -> None:
        """Drive the in-flight pipelined messages (MPI moves large messages only inside MPI
        calls): called at every adjoint exchange, so they travel during the backward."""
        for msg in self._pending.values():
            msg.exchange.test()

    def close(self) -> None:
        """Collective: complete outstanding pipelined messages and close the channel."""
        for msg in self._pending.values():
            msg.exchange.wait()
        self._pending.clear()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # ---- the provider ----------------------------------------------------------------------
    def fetch(self, layer: int, solid_rows: np.ndarray) -> np.ndarray:
        """The host path (the offloaded engine's :meth:`fill`): the halo block [num_halo, w] in
        host memory; device-tier rows are read back from the device."""
        if not self.distributed:
            return np.ascontiguousarray(solid_rows[:0])
        solid = np.ascontiguousarray(solid_rows, dtype=np.float32).reshape(solid_rows.shape[0], -1)
        return self._fetch(layer, torch.from_numpy(solid), on_device=False).numpy()

    def fetch_tensor(self, layer: int, h_solid: torch.Tensor) -> torch.Tensor:
        """The device path (autograd :meth:`exchange`): the halo block on ``h_solid``'s device.

        The rows sent are selected there (only they cross to the host, and only with a host data
        plane: mpi4py, gloo); the block is assembled there: device-tier rows stay on the device,
        only host-tier rows and received rows of a host data plane are uploaded. The same rows,
        ages and byte counts as :meth:`fetch`. A subclass that overrides :meth:`fetch` (a
        reference that transforms the rows) is honoured: its ``fetch`` is called, through the host."""
        if type(self).fetch is not CachedHalo.fetch:
            return super().fetch_tensor(layer, h_solid)
        rows = h_solid.detach()
        if not self.distributed:
            return rows[:0]
        halo = self._fetch(layer, rows.reshape(rows.shape[0], -1), on_device=True)
        return halo.to(h_solid.dtype).reshape((-1,) + tuple(h_solid.shape[1:]))

    def adjoint(self, layer: int, halo_grads: np.ndarray) -> np.ndarray:
        return self.adjoint_tensor(layer, torch.from_numpy(np.ascontiguousarray(halo_grads))).numpy()

    def adjoint_tensor(self, layer: int, halo_grads: torch.Tensor) -> torch.Tensor:
        """The exact blocking adjoint exchange on the gradients' device (the data plane stages
        them through the host only when it is not on that device)."""
        t0 = time.perf_counter()
        self.progress()
        g = halo_grads.detach().contiguous()
        if self.distributed:
            back = self.comm.alltoallv(g, self.plan.recv_counts, self.plan.send_counts)
        else:
            back = g[:0]
        nbytes = g.numel() * g.element_size() if self.distributed else 0
        self.account(t0, nbytes)
        self.stats["halo_adjoint_s"] = self.stats.get("halo_adjoint_s", 0.0) + time.perf_counter() - t0
        self.stats["halo_adjoint_bytes"] = self.stats.get("halo_adjoint_bytes", 0) + nbytes
        return back

    # ---- internals -----------------------------------------------------------------------
    def _host_plane(self) -> bool:
        """Whether the data plane takes host buffers (mpi4py, gloo, ccl) rather than device ones."""
        return self.comm.device.type == "cpu"

    def _fetch(self, layer: int, solid: torch.Tensor, on_device: bool) -> torch.Tensor:
        """The forward halo of ``layer`` from this rank's ``solid`` rows [num_solid, w] (any
        device): a float32 block [num_halo, w] on ``solid``'s device, built on the device side
        (``on_device``) or in host memory (the host path; see :meth:`ReceiverCache.assemble_tensor`)."""
        constant = layer == 0
        if self._exact and not constant:
            t0 = time.perf_counter()
            w = solid.shape[1]
            send = (solid.index_select(0, self._send_index(solid.device)) if self.plan.rows_sent
                    else solid[:0]).float()
            halo = self.comm.alltoallv(send.contiguous(), self.plan.send_counts, self.plan.recv_counts)
            self.account(t0, self.plan.rows_sent * 4 * w)
            return halo
        s, t = self.settings, self.epoch
        t0 = time.perf_counter()
        if constant or not s.pipeline or layer not in self._pending:
            # blocking: this epoch's rows (the first pipelined epoch too)
            msg = self._start(layer, solid, lag=0, constant=constant, on_device=on_device)
            w0 = time.perf_counter()
            (rows,), src = msg.exchange.wait()
            wait_s = time.perf_counter() - w0
            if s.pipeline and not constant:
                self._pending[layer] = self._start(layer, solid, lag=1, constant=False, on_device=on_device)
        else:
            msg = self._pending.pop(layer)
            w0 = time.perf_counter()
            (rows,), src = msg.exchange.wait()
            wait_s = time.perf_counter() - w0
            self._pending[layer] = self._start(layer, solid, lag=1, constant=False, on_device=on_device)
        wire = "fp32" if constant else s.precision
        if wire == "bf16":
            rows = rows.view(torch.bfloat16).float()     # from_wire on the rows' device
        positions = msg.positions
        got = np.bincount(src.numpy().astype(np.int64), minlength=self.plan.num_parts)
        want = np.bincount(self._owner[positions], minlength=self.plan.num_parts)
        if not np.array_equal(got, want):
            raise RuntimeError(f"halo cache protocol: layer {layer} epoch {t}: rows received per owner "
                               f"{got.tolist()}, the schedule expects {want.tolist()}")
        moved0 = dict(self.cache.transfers)
        self.cache.on_device = on_device
        halo, ages, hit_dev, hit_host = self.cache.assemble(
            layer, t, msg.epoch, positions, rows.numpy() if rows.device.type == "cpu" else rows,
            None if self._exact else s.staleness, constant)
        halo = torch.as_tensor(halo).to(solid.device)
        moved = {k: v - moved0[k] for k, v in self.cache.transfers.items()}
        self.account(t0, 0)
        if not self._exact:       # training's figures only (evaluation's layer-0 fetch not counted)
            self.stats["halo_wait_s"] = self.stats.get("halo_wait_s", 0.0) + wait_s
            self._record(layer, ages, hit_dev, hit_host)
            rep = self._layer_report(layer)
            rep["rows_received"] += int(positions.size)
            if not constant:    # the exact exchange sends layer 0 once, at start-up
                rep["bytes_nocache"] += self.plan.rows_sent * WIRE_ITEMSIZE[wire] * solid.shape[1]
            rep["h2d_bytes"] += moved["h2d"]
            rep["d2h_bytes"] += moved["d2h"]
        return halo

    def _start(self, layer: int, solid: torch.Tensor, lag: int, constant: bool, on_device: bool) -> _Message:
        """Select and start (non-blocking) this epoch's message of ``layer``; count its bytes.

        The rows are selected on ``solid``'s device; on the device side (``on_device``) with a
        host data plane only they are copied to the host (counted as d2h bytes)."""
        s, t = self.settings, self.epoch
        sel = np.flatnonzero(self.sender.select(layer, t, s.staleness, lag, constant))
        positions = np.flatnonzero(self.receiver.select(layer, t, s.staleness, lag, constant))
        rows = solid.index_select(0, upload(torch.from_numpy(self.plan.send_index[sel]), solid.device)).float()
        if not constant and s.precision == "bf16":
            rows = rows.to(torch.bfloat16).view(torch.int16)   # to_wire: half the bytes
        host_plane = self._host_plane()
        if host_plane:
            rows = rows.cpu()          # only the rows that go out cross to the host
        counts = np.bincount(self._dest[sel], minlength=self.plan.num_parts).astype(np.int64)
        ex = self._channel.start([rows.contiguous()], counts, tag=2 * layer)
        payload = int(rows.numel() * rows.element_size())
        self.account(time.perf_counter(), payload)
        if not self._exact:
            rep = self._layer_report(layer)
            rep["bytes_sent"] += payload
            rep["rows_sent"] += int(sel.size)
            if on_device and host_plane:
                rep["d2h_bytes"] += payload
        return _Message(ex, t, positions)

    def _layer_report(self, layer: int) -> dict:
        return self.report.setdefault(layer, {"bytes_sent": 0, "rows_sent": 0,
                                              "bytes_nocache": 0, "ages": np.zeros(0, np.int64), "rows_received": 0,
                                              "hits_device": 0, "hits_host": 0, "rows_used": 0,
                                              "h2d_bytes": 0, "d2h_bytes": 0})

    def _record(self, layer: int, ages: np.ndarray, hit_dev: int, hit_host: int) -> None:
        rep = self._layer_report(layer)
        rep["ages"] = _add_hist(rep["ages"], np.bincount(ages, minlength=1))
        rep["hits_device"] += hit_dev
        rep["hits_host"] += hit_host
        rep["rows_used"] += int(ages.size)

    def epoch_report(self) -> tuple[dict, dict]:
        """(counters, per_layer) of the training epoch so far (see the module text).

        per_layer (one value per layer; a layer without halo fetches reads 0): ``halo_age_<a>``
        rows used with age ``a`` for a = 0..max(S, 1), ``halo_age_over_bound`` rows older than
        S (always 0: the bound is enforced), ``halo_age_max``, ``halo_rows_used``,
        ``halo_hits_device`` / ``halo_hits_host`` (rows read from each tier), ``halo_rows_sent`` /
        ``halo_rows_received`` (rows this rank sent / received),
        ``halo_fwd_bytes`` (rows sent, in the wire format) and ``halo_fwd_nocache_bytes`` (what
        the exact exchange sends for the layer in the same step and wire format: 0 for layer 0,
        which it sends once at start-up). counters: the sums over layers of the last two,
        ``halo_cache_device_bytes`` / ``halo_cache_host_bytes``, ``halo_adjoint_bytes`` (the
        gradients sent back, as the exact exchange sends them), and ``halo_h2d_bytes`` /
        ``halo_d2h_bytes``: forward halo row bytes
        moved host -> device / device -> host (rows sent through a host data plane, received rows,
        tier reads and stores that cross; counted by side, also on a CPU run)."""
        s, L = self.settings, self.num_layers
        top = max(s.staleness, 1)
        per = {f"halo_age_{a}": np.zeros(L) for a in range(top + 1)}
        for name in ("halo_age_over_bound", "halo_age_max", "halo_rows_used", "halo_hits_device",
                     "halo_hits_host", "halo_rows_sent", "halo_rows_received", "halo_fwd_bytes",
                     "halo_fwd_nocache_bytes"):
            per[name] = np.zeros(L)
        for l, rep in self.report.items():
            hist = rep["ages"]
            for a in range(min(top + 1, hist.shape[0])):
                per[f"halo_age_{a}"][l] = hist[a]
            per["halo_age_over_bound"][l] = hist[s.staleness + 1:].sum()
            nz = np.flatnonzero(hist)
            per["halo_age_max"][l] = nz[-1] if nz.size else 0
            per["halo_rows_used"][l] = rep["rows_used"]
            per["halo_hits_device"][l] = rep["hits_device"]
            per["halo_hits_host"][l] = rep["hits_host"]
            per["halo_rows_sent"][l] = rep["rows_sent"]
            per["halo_rows_received"][l] = rep["rows_received"]
            per["halo_fwd_bytes"][l] = rep["bytes_sent"]
            per["halo_fwd_nocache_bytes"][l] = rep["bytes_nocache"]
        nb = self.cache.nbytes
        counters = {"halo_fwd_bytes": float(per["halo_fwd_bytes"].sum()),
                    "halo_fwd_nocache_bytes": float(per["halo_fwd_nocache_bytes"].sum()),
                    "halo_cache_device_bytes": float(nb["device"]),
                    "halo_cache_host_bytes": float(nb["host"])}
        counters["halo_adjoint_bytes"] = float(self.stats.get("halo_adjoint_bytes", 0))
        counters["halo_h2d_bytes"] = float(sum(r["h2d_bytes"] for r in self.report.values()))
        counters["halo_d2h_bytes"] = float(sum(r["d2h_bytes"] for r in self.report.values()))
        return counters, per

    def timing_report(self) -> dict:
        """``halo`` plus ``halo_wait`` (waiting on pipelined or blocking forward messages) and
        ``halo_adjoint`` (gradient exchanges)."""
        return {**super().timing_report(), "halo_wait": float(self.stats.get("halo_wait_s", 0.0)),
                "halo_adjoint": float(self.stats.get("halo_adjoint_s", 0.0))}


def _add_hist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = max(a.shape[0], b.shape[0])
    out = np.zeros(n, dtype=np.int64)
    out[:a.shape[0]] += a
    out[:b.shape[0]] += b
    return out
