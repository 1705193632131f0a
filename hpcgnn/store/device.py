"""Device-only feature store: every row in device memory; gathers never cross the link.

On a GPU the rows are copied to the device once, in their stored dtype, and the host array is
no longer referenced by the store. On the CPU the device tier *is* the partition's array (no copy): the same gather as
the host-only store, counted as device hits.
"""
from __future__ import annotations

import torch

from hpcgnn.nn.aggregate import gather_rows
from hpcgnn.store.base import FeatureStore, GatherPlan
from hpcgnn.store.host import as_rows, count_valid
from hpcgnn.upload import upload

_EMPTY = torch.zeros(0, dtype=torch.int64)


class DeviceFeatureStore(FeatureStore):
    """All rows on the device; see the module docstring."""

    name = "device"
    reads_on_thread = False      # read_misses does nothing: no gather thread, no thread split

    def __init__(self, features, device: torch.device | str = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.rows = as_rows(features).to(self.device)
        self.num_rows, self.dim = int(self.rows.shape[0]), int(self.rows.shape[1])
        self.dtype = self.rows.dtype

    def plan(self, ids: torch.Tensor) -> GatherPlan:
        ids = ids.to("cpu", torch.int64)
        self._count_features(count_valid(ids, self.num_rows), 0)
        return GatherPlan(int(ids.shape[0]), _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, ids=ids)

    def read_misses(self, plan: GatherPlan):
        return None

    def assemble(self, plan: GatherPlan, misses) -> torch.Tensor:
        return gather_rows(self.rows, upload(plan.ids, self.device), self.num_rows).to(self.compute_dtype)

    def full_rows(self) -> torch.Tensor:
        return self.rows

    def rows_on_device_in_order(self) -> bool:
        return True

    @property
    def device_rows(self) -> int:
        return self.num_rows

    @property
    def device_bytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()
