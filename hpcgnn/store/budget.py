"""``store.device_memory`` -> a device budget in bytes (torch-free: the config checks it)."""
from __future__ import annotations

import math

from hpcgnn.errors import InputError
from hpcgnn.units import parse_size

HELP = ("device memory per rank for the feature store of every engine: 'auto' (all on the GPU, host-only on the CPU), 0 "
        "(host-only), a fraction in (0, 1] of the rank's feature bytes, or a size such as '6GiB'")


def resolve_budget(value, feature_bytes: int, device_type: str) -> int | None:
    """Budget in bytes; None = unlimited (``"auto"`` on a GPU); InputError for a bad value."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None if device_type == "cuda" else 0
    if isinstance(value, bool):
        raise InputError(f"store.device_memory = {value!r}: expected {HELP}")
    if isinstance(value, (int, float)):
        if not 0 <= value <= 1:
            raise InputError(f"store.device_memory = {value!r}: a number is a fraction in [0, 1] of "
                             "the rank's features; give a size as a string such as '6GiB'")
        return int(math.floor(float(value) * feature_bytes))
    return parse_size(value, "store.device_memory")


def valid_device_memory(value) -> bool:
    """Whether ``store.device_memory`` has a valid form (config check)."""
    try:
        resolve_budget(value, 0, "cpu")
        return True
    except InputError:
        return False
