"""``store.device_memory`` -> a device budget in bytes (torch-free: the config checks it).

``'auto'`` on a GPU is sized from the device memory the rank has left for the store: the
pre-run device check (:func:`hpcgnn.engine.memory_check.check_device_memory`) states it on the
runtime (``Runtime.store_device_available``: the GPU's free memory from
``torch.cuda.mem_get_info``, or ``runtime.device_memory_limit``, minus the engine's other device
terms), and the engine passes it here as ``available``; the store takes what it can use of it:
every feature row and, for the minibatch engine, every HEC line at capacity (``extra_bytes``);
without a figure ``'auto'`` keeps all of them on the GPU."""
from __future__ import annotations

import math

from hpcgnn.errors import InputError
from hpcgnn.units import parse_size

HELP = ("device memory per rank for the feature store of every engine: 'auto' (on a GPU as many rows and "
        "HEC lines as fit in the device memory left by the engine's other terms, host-only on the CPU), 0 "
        "(host-only), a fraction in (0, 1] of the rank's feature bytes, or a size such as '6GiB'")

def resolve_budget(value, feature_bytes: int, device_type: str, available: int | None = None,
                   extra_bytes: int = 0) -> int | None:
    """Budget in bytes; None = unlimited; InputError for a bad value. ``'auto'``: 0 on the CPU;
    on a GPU ``min(feature_bytes + extra_bytes, available)`` (``extra_bytes``: what else the
    store can place on the device, the HEC rows at capacity), None (all of it) when
    ``available`` is None. A fraction is of ``feature_bytes`` alone."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        if device_type != "cuda":
            return 0
        want = int(feature_bytes) + max(int(extra_bytes), 0)
        return None if available is None else int(min(want, max(int(available), 0)))
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
