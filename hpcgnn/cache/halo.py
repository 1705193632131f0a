"""CaPGNN's two-tier cache of remote halo rows (JACA): tiers, admission, stores and lookups.

Every rank caches remote halo rows of every layer (what the exact exchange sends at that layer:
its input or its projection; ``widths``) in two tiers: a *device* tier (on the
training device; on a CPU run a separately budgeted host buffer, so the same code and counters
run) and a *host* tier. Admission (:func:`admission`) is decided once at start-up, per halo
vertex for all layers together (``4 * sum(widths)`` bytes a row): halo vertices in
decreasing duplication count (the number of partitions that hold the vertex as halo, CaPGNN's
priority), ties by global ID; the first ones fill the device budget, the next ones the host
budget, the rest are never cached. Membership is frozen (JACA never evicts); values are
overwritten whenever a row arrives (:meth:`ReceiverCache.store`).

:meth:`ReceiverCache.assemble` builds a layer's halo block from the rows received and the cached
ones, on the device side (:meth:`ReceiverCache.assemble_tensor`: device-tier rows are read in
place, only host-tier and received host rows are uploaded) or in host memory, counts the row
bytes that cross between the two (:attr:`ReceiverCache.transfers`), and enforces the staleness
bound (it raises if a row is neither received nor cached, or older than the bound). What is
sent when, and the exchange itself, is the protocol of :mod:`hpcgnn.comm.halo_cached`.
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.upload import upload

NEVER = np.iinfo(np.int64).min // 4   # "never sent / never written" epoch
TIER_NONE, TIER_DEVICE, TIER_HOST = 0, 1, 2


def admission(dup: np.ndarray, row_bytes: int, budget_bytes: int | None,
              device_bytes: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Tier (0 none, 1 device, 2 host) and slot in its tier of every halo row, from the rows'
    duplication counts ``dup`` [num_halo] (halo order = global-ID order, the tie-break).

    Rows in decreasing ``dup``: the first ``device_bytes // row_bytes`` go to the device tier,
    the next up to ``budget_bytes // row_bytes`` in all to the host tier (None = no limit)."""
    n = int(dup.shape[0])
    row_bytes = max(int(row_bytes), 1)
    cap = n if budget_bytes is None else min(n, int(budget_bytes) // row_bytes)
    dev = cap if device_bytes is None else min(cap, int(device_bytes) // row_bytes)
    order = np.lexsort((np.arange(n), -np.asarray(dup, dtype=np.int64)))
    tier = np.zeros(n, dtype=np.int8)
    slot = np.full(n, -1, dtype=np.int64)
    tier[order[:dev]] = TIER_DEVICE
    slot[order[:dev]] = np.arange(dev)
    tier[order[dev:cap]] = TIER_HOST
    slot[order[dev:cap]] = np.arange(cap - dev)
    return tier, slot


class ReceiverCache:
    """The receiver's two-tier cache of one rank's halo rows (see the module text).

    ``tier`` int8 / ``slot`` int64 [num_halo] from :func:`admission`; ``widths`` the widths of
    the rows each layer exchanges; the device tier lives on ``device``, the host tier in host memory."""

    def __init__(self, tier: np.ndarray, slot: np.ndarray, widths: list[int], device="cpu"):
        self.tier, self.slot = np.asarray(tier, dtype=np.int8), np.asarray(slot, dtype=np.int64)
        self.num_halo = int(self.tier.shape[0])
        self.device = torch.device(device)
        n_dev = int((self.tier == TIER_DEVICE).sum())
        n_host = int((self.tier == TIER_HOST).sum())
        self.dev_pos = np.flatnonzero(self.tier == TIER_DEVICE)
        self.host_pos = np.flatnonzero(self.tier == TIER_HOST)
        self.widths = list(widths)
        self.dev = [torch.zeros((n_dev, w), dtype=torch.float32, device=self.device) for w in widths]
        self.host = [torch.zeros((n_host, w), dtype=torch.float32) for w in widths]
        self.written = np.full((len(widths), self.num_halo), NEVER, dtype=np.int64)
        self.on_device = False      # the side :meth:`assemble` builds blocks on (set by the caller)
        self.transfers = {"h2d": 0, "d2h": 0}   # row bytes host -> device / device -> host, cumulative

    @property
    def nbytes(self) -> dict:
        """Bytes of each tier (device, host)."""
        return {"device": sum(t.numel() * 4 for t in self.dev), "host": sum(t.numel() * 4 for t in self.host)}

    def store(self, layer: int, epoch_sent: int, positions: np.ndarray, rows: np.ndarray) -> None:
        """Write received host rows (halo ``positions``, values of ``epoch_sent``) into their tiers."""
        rows_t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        self._store(layer, epoch_sent, np.asarray(positions, dtype=np.int64), rows_t, rows_t, True, True)

    def _store(self, layer: int, epoch_sent: int, positions: np.ndarray, rows: torch.Tensor,
               rows_b: torch.Tensor, rows_host: bool, block_host: bool) -> dict:
        """Write the received rows into their tiers, each tier from the copy on its side (``rows``
        on the host if ``rows_host``, their block copy ``rows_b`` on the host if ``block_host``);
        returns the row bytes that crossed between host and device ({"h2d", "d2h"})."""
        moved = {"h2d": 0, "d2h": 0}
        t = self.tier[positions]
        row_bytes = 4 * self.widths[layer]
        for tier, bufs in ((TIER_DEVICE, self.dev), (TIER_HOST, self.host)):
            sel = np.flatnonzero(t == tier)
            if sel.size:
                on_host = tier == TIER_HOST
                src = rows_b if (block_host == on_host and rows_host != on_host) else rows
                if rows_host != on_host and block_host != on_host:   # neither copy is on the tier's side
                    moved["d2h" if on_host else "h2d"] += int(sel.size) * row_bytes
                buf = bufs[layer]
                vals = src.index_select(0, upload(torch.from_numpy(sel), src.device))
                buf[upload(torch.from_numpy(self.slot[positions[sel]]), buf.device)] = upload(vals, buf.device)
        cached = t != TIER_NONE
        self.written[layer, positions[cached]] = epoch_sent
        return moved

    def assemble(self, layer: int, epoch_used: int, epoch_sent: int, positions: np.ndarray,
                 rows, staleness: int | None, constant: bool = False):
        """The halo block [num_halo, w] used at ``epoch_used``: the received ``rows`` (written at
        ``epoch_sent``) at their ``positions``, every other row from the cache.

        Built on the side :attr:`on_device` names (see :meth:`assemble_tensor`): on the device
        tier's device, or in host memory. ``rows``: a host numpy array or a tensor (anywhere;
        in host memory = received through a host data plane). The block is a numpy array when
        ``rows`` is one and the block is in CPU memory, else a tensor. Stores the received rows
        first. Returns (block, ages int64 [num_halo], rows from the device tier, rows from the
        host tier). Raises RuntimeError if a row is neither received nor cached, or
        (``staleness`` not None, ``constant`` False) older than ``staleness``."""
        numpy_in = isinstance(rows, np.ndarray)
        rows_t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)) if numpy_in else rows
        device = self.device if self.on_device else torch.device("cpu")
        block, ages, hit_dev, hit_host = self.assemble_tensor(
            layer, epoch_used, epoch_sent, positions, rows_t, staleness, constant, device=device,
            on_device=self.on_device, rows_host=rows_t.device.type == "cpu")
        if numpy_in and block.device.type == "cpu":
            block = block.numpy()
        return block, ages, hit_dev, hit_host

    def assemble_tensor(self, layer: int, epoch_used: int, epoch_sent: int, positions: np.ndarray,
                        rows: torch.Tensor, staleness: int | None, constant: bool = False,
                        device=None, on_device: bool = True, rows_host: bool = True):
        """:meth:`assemble` on tensors: the block [num_halo, w] float32 is built on ``device``
        (default: the device tier's) from ``rows`` [n, w] (received; any device).

        ``on_device``: the block is on the device side (the training device: device-tier rows
        are read in place and only host-tier rows are uploaded) or, False, in host memory (the
        offloaded engine's host buffers: device-tier rows are read back). ``rows_host``: the
        received rows arrived in host memory (a host data plane: mpi4py, gloo) or, False, on the
        device (nccl). Fresh rows cross once, to the block's side; each tier is stored from the
        copy on its side. Returns (block, ages, device-tier rows, host-tier rows) and adds the row
        bytes that crossed between host memory and the device to :attr:`transfers`, counted by
        side (so a CPU run, whose device tier is a host buffer, counts what a GPU run moves)."""
        positions = np.asarray(positions, dtype=np.int64)
        device = self.device if device is None else torch.device(device)
        w = self.widths[layer]
        row_bytes = 4 * w
        block_host = not on_device
        rows = rows.reshape(positions.shape[0], w)
        rows_b = upload(rows, device)
        moved = {"h2d": 0, "d2h": 0}
        if bool(rows_host) != block_host:
            moved["h2d" if rows_host else "d2h"] += int(positions.size) * row_bytes
        for k, v in self._store(layer, epoch_sent, positions, rows, rows_b, bool(rows_host), block_host).items():
            moved[k] += v
        out = torch.empty((self.num_halo, w), dtype=torch.float32, device=device)
        got = np.zeros(self.num_halo, dtype=bool)
        got[positions] = True
        if positions.size:
            out[upload(torch.from_numpy(positions), device)] = rows_b
        miss = ~got
        if np.any(miss & (self.tier == TIER_NONE)) or np.any(self.written[layer][miss] == NEVER):
            bad = np.flatnonzero(miss & ((self.tier == TIER_NONE) | (self.written[layer] == NEVER)))
            raise RuntimeError(f"halo cache protocol: layer {layer} epoch {epoch_used}: {bad.size} halo "
                               f"rows neither received nor cached (first {bad[:5].tolist()})")
        hits = []
        for tier, bufs, pos in ((TIER_DEVICE, self.dev, self.dev_pos), (TIER_HOST, self.host, self.host_pos)):
            use = pos[miss[pos]]
            if use.size:
                slots = upload(torch.from_numpy(self.slot[use]), bufs[layer].device)
                out[upload(torch.from_numpy(use), device)] = upload(bufs[layer].index_select(0, slots), device)
                if (tier == TIER_HOST) != block_host:
                    moved["d2h" if block_host else "h2d"] += int(use.size) * row_bytes
            hits.append(int(use.size))
        ages = np.empty(self.num_halo, dtype=np.int64)
        if constant:
            ages[:] = 0
        else:
            ages[got] = epoch_used - epoch_sent
            ages[miss] = epoch_used - self.written[layer][miss]
            if staleness is not None and ages.size and int(ages.max()) > staleness:
                raise RuntimeError(f"halo cache protocol: layer {layer} epoch {epoch_used}: a row of age "
                                   f"{int(ages.max())} > staleness bound {staleness}")
        for k, v in moved.items():
            self.transfers[k] += v
        return out, ages, hits[0], hits[1]
