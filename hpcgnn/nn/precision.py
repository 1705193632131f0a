"""The arithmetic precision of the dense (linear) layers.

:class:`Linear` is ``torch.nn.Linear`` (same parameters, initialisation and state dict) whose
product can run in bfloat16: with ``compute_dtype = torch.bfloat16`` its input, weight and
bias are rounded to bfloat16, the GEMM runs in bfloat16 with float32 accumulation (oneDNN;
about 2x float32's speed on CPUs with AVX512-BF16, ``make bench-minibatch``), and the result
is widened back to float32. Parameters, their gradients, the optimizer, aggregation, dropout and
the loss stay float32: only the products of the linear layers are rounded. ``None`` (the
default) is plain float32 ``nn.Linear``.

``train.precision = "bf16"`` (:func:`set_precision`) is opt-in: it changes results at the
level of bfloat16 rounding (8 significant bits), so it is measured, not assumed harmless
(docs/dgl.md has the accuracy and speed figures).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


class Linear(nn.Linear):
    """``nn.Linear`` with an optional lower-precision product (see the module docstring)."""

    compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = self.compute_dtype
        if cd is None or x.dtype == cd:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.to(cd)
        return F.linear(x.to(cd), self.weight.to(cd), bias).to(x.dtype)


def linear(lin: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``lin(x) + bias`` for a bias that is not ``lin``'s own (``lin`` has none): in float32 one
    GEMM with the bias as its addend (no ``[rows, out]`` product beside the sum); with a lower
    ``compute_dtype`` the bias is added in float32 after the product, as the layer would."""
    if bias is None:
        return lin(x)
    if lin.bias is None and (lin.compute_dtype is None or x.dtype == lin.compute_dtype):
        return F.linear(x, lin.weight, bias)
    return lin(x) + bias


def set_precision(model: nn.Module, precision: str) -> nn.Module:
    """Set every :class:`Linear` of ``model`` to ``precision`` ("fp32" or "bf16"); returns it."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    for m in model.modules():
        if isinstance(m, Linear):
            m.compute_dtype = PRECISIONS[precision]
    return model
