"""Byte and memory accounting of host<->device transfers for offloaded training.

Rows move between host tensors (pinned when the device is CUDA) and the compute device through
the one staging component, :class:`hpcgnn.store.mover.DeviceMover` (pinned staging buffers
reused, side-stream copies on CUDA, plain copies with the CPU as the "device"), which counts
its bytes in a :class:`TransferCounter`.

:class:`TransferCounter` counts bytes per direction and kind (also the bytes a
plan without deduplication would have moved); peak device memory is metered by
the rank's one meter, :class:`hpcgnn.run.memory.DeviceMemoryMeter` (re-exported
here): ``torch.cuda.max_memory_allocated`` on CUDA, and on the CPU the peak of
the bytes resident in the simulated device scope (explicit buffers plus the
tensors autograd saves while a chunk is on the "device").
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


def host_empty(shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when ``pin`` (for async CUDA copies)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def host_zeros(shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
    t = host_empty(shape, dtype, pin)
    t.zero_()
    return t


@dataclass
class TransferCounter:
    """Bytes moved host->device and device->host, by kind.

    Kinds used by the engine: h2d ``rows`` (layer-input rows of the chunks'
    source sets), ``grad`` (output gradients), ``cache`` (cached aggregations);
    d2h ``out`` (layer outputs), ``cache``, ``grad`` (source gradients).
    ``h2d_rows_nodedup`` / ``d2h_grad_nodedup`` count the source-row / source-gradient
    bytes a plan without deduplication would have moved for the same work.
    """

    h2d: dict = field(default_factory=lambda: defaultdict(int))
    d2h: dict = field(default_factory=lambda: defaultdict(int))
    h2d_rows_nodedup: int = 0
    d2h_grad_nodedup: int = 0

    def add_h2d(self, kind: str, nbytes: int) -> None:
        self.h2d[kind] += int(nbytes)

    def add_d2h(self, kind: str, nbytes: int) -> None:
        self.d2h[kind] += int(nbytes)

    @property
    def h2d_total(self) -> int:
        return int(sum(self.h2d.values()))

    @property
    def d2h_total(self) -> int:
        return int(sum(self.d2h.values()))

    def reset(self) -> None:
        self.h2d.clear()
        self.d2h.clear()
        self.h2d_rows_nodedup = 0
        self.d2h_grad_nodedup = 0

    def as_dict(self) -> dict:
        out = {f"h2d_{k}_bytes": int(v) for k, v in sorted(self.h2d.items())}
        out.update({f"d2h_{k}_bytes": int(v) for k, v in sorted(self.d2h.items())})
        out.update(h2d_bytes=self.h2d_total, d2h_bytes=self.d2h_total,
                   h2d_rows_nodedup_bytes=int(self.h2d_rows_nodedup),
                   d2h_grad_nodedup_bytes=int(self.d2h_grad_nodedup))
        return out
