"""Tiered feature store (XGNN's GGMS on one rank): the hottest rows on the device, all rows in
(pinned) host memory.

``hot`` (local row ids, chosen by :mod:`hpcgnn.store.placement`) are copied once into the device
tier; ``slot_of[v]`` is v's row there or -1 (a ``num_rows``-sized int64 table, like XGNN's
``cache_idx``). The host tier keeps every row, as XGNN's artifact keeps the whole pinned feature
matrix; it is the partition's own array, registered in place on a GPU, so no second copy of a
rank's features exists besides the device tier's hot rows. On a CPU-only machine the device tier
is a separate host buffer of exactly the budgeted rows.

A gather splits the ids into hits (read from the device tier on the device) and misses (read
from the host tier, on a GPU through a pinned staging buffer and a side-stream copy), then puts
both in id order: bit for bit the rows of the host-only store.
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.nn.aggregate import gather_rows
from hpcgnn.store.base import FeatureStore, GatherPlan
from hpcgnn.store.host import _gather_into, as_rows, host_tier
from hpcgnn.upload import upload


class TieredFeatureStore(FeatureStore):
    """Hot rows on the device, every row on the host; see the module docstring."""

    name = "tiered"

    def __init__(self, features, hot, device: torch.device | str = "cpu"):
        super().__init__()
        from hpcgnn.store.mover import DeviceMover

        self.device = torch.device(device)
        rows = as_rows(features)
        self.num_rows, self.dim = int(rows.shape[0]), int(rows.shape[1])
        self.dtype = rows.dtype
        hot = torch.as_tensor(np.asarray(hot, dtype=np.int64))
        if hot.numel() and (int(hot.min()) < 0 or int(hot.max()) >= self.num_rows
                            or torch.unique(hot).numel() != hot.numel()):
            raise ValueError(f"tiered store: hot rows must be distinct ids in [0, {self.num_rows})")
        self.slot_of = torch.full((self.num_rows,), -1, dtype=torch.int64)
        self.slot_of[hot] = torch.arange(hot.numel(), dtype=torch.int64)
        # the device tier: a copy of the hot rows (a separately budgeted buffer on the CPU)
        self.hot_rows = gather_rows(rows, hot).to(self.device) if hot.numel() else \
            torch.empty(0, self.dim, dtype=self.dtype, device=self.device)
        self.rows = host_tier(features, self.device)
        self.mover = DeviceMover(self.device)

    @property
    def device_rows(self) -> int:
        return int(self.hot_rows.shape[0])

    @property
    def device_bytes(self) -> int:
        return self.hot_rows.numel() * self.hot_rows.element_size() + self.slot_of.numel() * 8

    def plan(self, ids: torch.Tensor) -> GatherPlan:
        ids = ids.to("cpu", torch.int64)
        valid = ids < self.num_rows
        slots = torch.full_like(ids, -1)
        slots[valid] = self.slot_of[ids[valid]]
        hit = slots >= 0
        miss = valid & ~hit
        hit_pos = torch.nonzero(hit).reshape(-1)
        miss_pos = torch.nonzero(miss).reshape(-1)
        zero_pos = torch.nonzero(~valid).reshape(-1)
        self._count_features(int(hit_pos.numel()), int(miss_pos.numel()))
        return GatherPlan(int(ids.shape[0]), hit_pos, slots[hit_pos], miss_pos, ids[miss_pos], zero_pos)

    def read_misses(self, plan: GatherPlan):
        n = int(plan.miss_ids.numel())
        if self.device.type != "cuda":
            # the device tier is host memory here: the thread assembles the whole output
            return self._assemble(plan, gather_rows(self.rows, plan.miss_ids) if n else None)
        if not n:
            return None
        return self.mover.move(lambda out: _gather_into(self.rows, plan.miss_ids, self.num_rows, out),
                               n, self.dim, self.dtype)

    def assemble(self, plan: GatherPlan, misses) -> torch.Tensor:
        if self.device.type != "cuda":
            return misses                   # assembled by read_misses
        return self._assemble(plan, self.mover.receive(misses) if misses is not None else None)

    def _assemble(self, plan: GatherPlan, misses) -> torch.Tensor:
        """Rows in id order from the device tier's hits and the misses' rows (on the device),
        cast to the compute dtype."""
        dev = self.device
        out = torch.empty(plan.num, self.dim, dtype=self.compute_dtype, device=dev)
        if plan.hit_pos.numel():
            out.index_copy_(0, upload(plan.hit_pos, dev),
                            gather_rows(self.hot_rows, upload(plan.hit_slots, dev)).to(self.compute_dtype))
        if plan.miss_pos.numel():
            out.index_copy_(0, upload(plan.miss_pos, dev), misses.to(self.compute_dtype))
        if plan.zero_pos.numel():
            out.index_fill_(0, upload(plan.zero_pos, dev), 0)
        return out

    def full_rows(self) -> torch.Tensor:
        return self.rows
