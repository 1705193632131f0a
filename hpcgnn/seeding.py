"""Random streams as functions of integers.

Every random stream of a run (initialisation, data order, sampling, dropout, AEP choice) is seeded
by :func:`rng_key` of integers such as (seed, stream tag, epoch, step, rank), so a run resumed at
an epoch boundary continues exactly and no generator state is shared between modules.
"""
from __future__ import annotations

import hashlib

import numpy as np


def rng_key(*parts: int) -> int:
    """A 63-bit integer determined by ``parts`` (ints; negative allowed). Stable across runs."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(int(p).to_bytes(16, "little", signed=True))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def numpy_rng(*parts: int) -> np.random.Generator:
    """numpy Generator seeded with :func:`rng_key` of ``parts``."""
    return np.random.default_rng(rng_key(*parts))


def seed_torch(*parts: int) -> None:
    """Seed torch's global generators (dropout ...) with :func:`rng_key` of ``parts``."""
    import torch

    torch.manual_seed(rng_key(*parts))
