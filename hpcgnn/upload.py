"""Host-to-device copies that do not wait for the device: the small one-off copies of a training
step (indices, masks, sampled blocks, received cache rows). Row traffic in bulk (feature-store
reads, offloaded chunks, staged rounds) goes through :class:`hpcgnn.store.mover.DeviceMover`,
with its staging pool and side stream.

A plain ``tensor.to("cuda")`` from pageable host memory waits until the device has run all the
work queued before it: one such copy per layer and step keeps the host from running ahead.
"""
from __future__ import annotations

import torch


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``, without waiting for the device when ``t`` is a host tensor and
    ``device`` a CUDA device: ``t`` is copied into page-locked memory from torch's caching host
    allocator (which does not hand that memory out again before the copy has run) and sent with
    ``non_blocking=True`` on the current stream, which orders every later use after the copy;
    the caller may change or free ``t`` at once. Anything else: ``t.to(device)`` (on the CPU
    that is ``t`` itself)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device, non_blocking=True)
