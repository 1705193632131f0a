"""Host-only feature store: every row in host memory (pinned in place on a GPU machine).

On the CPU this is exactly what the minibatch engine did before the store existed:
``gather_rows(features, ids, num_rows)`` over the partition's own array (no copy). On a GPU the
rows are gathered on the host into a pinned staging buffer and copied to the device on a side
stream (:class:`~hpcgnn.store.mover.DeviceMover`); every valid row is a miss and its bytes
count as host -> device traffic. The CUDA path is written for torch >= 2.11 and has not run on
a GPU in this repository's tests (docs/store.md).
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.nn.aggregate import gather_rows
from hpcgnn.store.base import FeatureStore, GatherPlan, feature_tensor

_EMPTY = torch.zeros(0, dtype=torch.int64)


def pin_in_place(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` page-locked for fast, asynchronous host -> device copies: registered in place
    with ``cudaHostRegister`` (no second copy), else a pinned copy (the caller drops the
    original). Identity without CUDA."""
    if not torch.cuda.is_available() or rows.numel() == 0 or rows.is_pinned():
        return rows
    try:
        rc = torch.cuda.cudart().cudaHostRegister(rows.data_ptr(), rows.numel() * rows.element_size(), 0)
        if int(getattr(rc, "value", rc)) == 0:
            return rows
    except (AttributeError, RuntimeError, TypeError):
        pass
    return rows.pin_memory()


def as_rows(features) -> torch.Tensor:
    """A tensor view of the partition's feature array in its stored dtype (shares its memory:
    :func:`~hpcgnn.store.base.feature_tensor`)."""
    return feature_tensor(features)


def host_tier(features, device: torch.device) -> torch.Tensor:
    """The host tier's rows: :func:`as_rows`, page-locked in place on a GPU machine, except a
    memory map (registering a mapped file would read it whole; its rows go through the
    mover's pinned staging buffers instead)."""
    rows = as_rows(features)
    if device.type != "cuda" or isinstance(features, np.memmap):
        return rows
    return pin_in_place(rows)


def count_valid(ids: torch.Tensor, num_rows: int) -> int:
    """Ids < num_rows (rows that exist here) among ``ids``."""
    if ids.numel() == 0:
        return 0
    return int((ids < num_rows).sum())


class HostFeatureStore(FeatureStore):
    """All rows in host memory; see the module docstring."""

    name = "host"

    def __init__(self, features, device: torch.device | str = "cpu"):
        super().__init__()
        from hpcgnn.store.mover import DeviceMover

        self.device = torch.device(device)
        self.rows = host_tier(features, self.device)
        self.num_rows, self.dim = int(self.rows.shape[0]), int(self.rows.shape[1])
        self.dtype = self.rows.dtype
        self.mover = DeviceMover(self.device)

    def plan(self, ids: torch.Tensor) -> GatherPlan:
        ids = ids.to("cpu", torch.int64)
        self._count_features(0, count_valid(ids, self.num_rows))
        return GatherPlan(int(ids.shape[0]), _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, ids=ids)

    def read_misses(self, plan: GatherPlan):
        if self.device.type != "cuda":
            return gather_rows(self.rows, plan.ids, self.num_rows).to(self.compute_dtype)
        return self.mover.move(lambda out: _gather_into(self.rows, plan.ids, self.num_rows, out),
                               plan.num, self.dim, self.dtype)

    def assemble(self, plan: GatherPlan, misses) -> torch.Tensor:
        return self.mover.receive(misses).to(self.compute_dtype)     # on the device

    def full_rows(self) -> torch.Tensor:
        return self.rows

    def rows_on_device_in_order(self) -> bool:
        return self.device.type == "cpu"


def _gather_into(rows: torch.Tensor, ids: torch.Tensor, num_valid: int, out: torch.Tensor) -> None:
    """``out[:] = rows[ids]`` with zero rows for ids >= num_valid (host tensors)."""
    out.copy_(gather_rows(rows, ids, num_valid))
