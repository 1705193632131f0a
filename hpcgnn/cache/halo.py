"""CaPGNN's two-tier cache of remote halo rows (JACA): tiers, admission, stores and lookups.

Every rank caches remote halo rows of every layer input in two tiers: a *device* tier (on the
training device; on a CPU run a separately budgeted host buffer, so the same code and counters
run) and a *host* tier. Admission (:func:`admission`) is decided once at start-up, per halo
vertex for all layers together (``4 * sum(layer input widths)`` bytes a row): halo vertices in
decreasing duplication count (the number of partitions that hold the vertex as halo, CaPGNN's
priority), ties by global ID; the first ones fill the device budget, the next ones the host
budget, the rest are never cached. Membership is frozen (JACA never evicts); values are
overwritten whenever a row arrives (:meth:`ReceiverCache.store`).

:meth:`ReceiverCache.assemble` builds a layer's halo block from the rows received and the cached
ones and enforces the staleness bound (it raises if a row is neither received nor cached, or
older than the bound). What is sent when, and the exchange itself, is the protocol of
:mod:`hpcgnn.comm.halo_cached`.
"""
from __future__ import annotations

import numpy as np
import torch

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

    ``tier`` int8 / ``slot`` int64 [num_halo] from :func:`admission`; ``widths`` the layer input
    widths; the device tier lives on ``device``, the host tier in host memory."""

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

    @property
    def nbytes(self) -> dict:
        """Bytes of each tier (device, host)."""
        return {"device": sum(t.numel() * 4 for t in self.dev), "host": sum(t.numel() * 4 for t in self.host)}

    def store(self, layer: int, epoch_sent: int, positions: np.ndarray, rows: np.ndarray) -> None:
        """Write received rows (halo ``positions``, values of ``epoch_sent``) into their tiers."""
        t = self.tier[positions]
        for tier, bufs in ((TIER_DEVICE, self.dev), (TIER_HOST, self.host)):
            sel = np.flatnonzero(t == tier)
            if sel.size:
                slots = torch.from_numpy(self.slot[positions[sel]])
                vals = torch.from_numpy(np.ascontiguousarray(rows[sel]))
                bufs[layer][slots.to(bufs[layer].device)] = vals.to(bufs[layer].device)
        cached = t != TIER_NONE
        self.written[layer, positions[cached]] = epoch_sent

    def assemble(self, layer: int, epoch_used: int, epoch_sent: int, positions: np.ndarray,
                 rows: np.ndarray, staleness: int | None, constant: bool = False):
        """The halo block [num_halo, w] used at ``epoch_used``: the received ``rows`` (written at
        ``epoch_sent``) at their ``positions``, every other row from the cache.

        Stores the received rows first. Returns (block, ages int64 [num_halo], rows from the
        device tier, rows from the host tier). Raises RuntimeError if a row is neither received
        nor cached, or (``staleness`` not None, ``constant`` False) older than ``staleness``."""
        positions = np.asarray(positions, dtype=np.int64)
        w = self.widths[layer]
        self.store(layer, epoch_sent, positions, rows)
        out = np.empty((self.num_halo, w), dtype=np.float32)
        got = np.zeros(self.num_halo, dtype=bool)
        got[positions] = True
        if positions.size:
            out[positions] = rows
        miss = ~got
        if np.any(miss & (self.tier == TIER_NONE)) or np.any(self.written[layer][miss] == NEVER):
            bad = np.flatnonzero(miss & ((self.tier == TIER_NONE) | (self.written[layer] == NEVER)))
            raise RuntimeError(f"halo cache protocol: layer {layer} epoch {epoch_used}: {bad.size} halo "
                               f"rows neither received nor cached (first {bad[:5].tolist()})")
        hits = []
        for tier, bufs, pos in ((TIER_DEVICE, self.dev, self.dev_pos), (TIER_HOST, self.host, self.host_pos)):
            use = pos[miss[pos]]
            if use.size:
                slots = torch.from_numpy(self.slot[use]).to(bufs[layer].device)
                out[use] = bufs[layer].index_select(0, slots).cpu().numpy()
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
        return out, ages, hits[0], hits[1]
