"""Minibatches that every rank runs in step: the same number on every rank, so that each
batch's collectives (gradient allreduce, AEP pushes, distributed sampling and feature pulls)
pair up across ranks whatever each rank's share of the seeds."""
from __future__ import annotations

import math

import numpy as np

from hpcgnn.comm.allreduce import allreduce_max


def equalised_batches(num_local: int, batch_size: int, rt) -> tuple[int, list[int]]:
    """Collective: ``(M, this rank's batch sizes)``, ``M = max over ranks of
    ceil(num_local / batch_size)``; a rank's ``num_local`` seeds are split into M batches of
    ``num_local // M`` (+1 for the first ``num_local % M``), so a rank with fewer seeds runs
    smaller (possibly empty) batches but takes part in every collective. ``(0, [])`` when no
    rank has a seed."""
    m = allreduce_max(rt, math.ceil(num_local / batch_size) if num_local else 0)
    if m == 0:
        return 0, []
    base, extra = divmod(num_local, m)
    return m, [base + (1 if k < extra else 0) for k in range(m)]


def batch_bounds(sizes: list[int]) -> np.ndarray:
    """Offsets ``[0, s0, s0 + s1, ...]`` (int64) of consecutive batches of ``sizes``."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
