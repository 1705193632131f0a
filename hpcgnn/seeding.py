"""Random streams as functions of integers.

Every random stream of a run (initialisation, data order, sampling, dropout, AEP choice) is seeded
by :func:`stream_seed` of integers such as (seed, stream tag, epoch, step, rank), so a run resumed at
an epoch boundary continues exactly and no generator state is shared between modules.
"""
from __future__ import annotations

import hashlib

import numpy as np


def stream_seed(*parts: int) -> int:
    """A 63-bit integer determined by ``parts`` (ints; negative allowed). Stable across runs."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(int(p).to_bytes(16, "little", signed=True))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def numpy_rng(*parts: int) -> np.random.Generator:
    """numpy Generator seeded with :func:`stream_seed` of ``parts``."""
    return np.random.default_rng(stream_seed(*parts))


def seed_torch(*parts: int) -> None:
    """Seed torch's global generators (dropout ...) with :func:`stream_seed` of ``parts``."""
    import torch

    torch.manual_seed(stream_seed(*parts))
