"""Counting the calls that make the host wait for a device, on the CPU.

On a GPU every one of these reads device memory back (a value, a shape that depends on values)
and so blocks the host until the device's queued work is done. On the CPU they are cheap, so a
test counts them instead: :class:`HostReads` is a ``TorchFunctionMode`` that records, in order,
the name of every such call made inside its ``with`` block.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# values read back, or outputs whose size depends on values
READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy",
                   "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                   "bincount", "equal", "allclose"})


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads:`` … ``reads.names``: the host-waiting calls made, in order.
    Boolean-mask indexing (``t[mask]``, ``t[mask] = v``) counts as ``"bool_index"`` and
    ``repeat_interleave`` without ``output_size`` as ``"repeat_interleave"``."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.names.append(name)
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _bool_index(args[1]):
            self.names.append("bool_index")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None \
                and len(args) > 1 and isinstance(args[1], torch.Tensor):
            self.names.append("repeat_interleave")
        return func(*args, **kwargs)
