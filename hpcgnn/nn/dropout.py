"""Dropout whose CPU mask comes from a native counter-based kernel.

:func:`dropout` keeps each element with probability ``1 - p`` and scales kept elements by
``1 / (1 - p)``, like ``torch.nn.functional.dropout``. On CPU float32/float64 tensors the
mask is a pure function of (seed, element index) (``hpcgnn.native.dropout``): the backward
pass regenerates it from the seed instead of storing it, and it does not depend on the
thread count. The seed is drawn from torch's global CPU generator, so ``torch.manual_seed``
and saving/restoring the RNG state (checkpoints, recomputation in the offload engine)
reproduce the masks exactly as with torch's dropout. Other devices and dtypes use torch's
dropout. Measured on the dev machine, 400k x 256 float32: 1.86 s for torch, ~0.05 s native.

On CUDA, :func:`relu_dropout` draws its mask with torch's fused dropout kernel (the draws of
``F.dropout``, so results are bit-identical to ``dropout(relu(x))``) and, like the native
kernel, keeps only its output for backward: the two ops keep the ReLU output and the mask
besides (5 more bytes per float32 element of every hidden layer until backward).
"""
from __future__ import annotations

import torch
from torch import nn

from hpcgnn.native import dropout as _native

SEED_BOUND = 2**63 - 1


class NativeDropout(torch.autograd.Function):
    """``apply(x, p, seed)``: CPU dropout with the mask of ``seed``; its adjoint is itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        x = x.detach().contiguous()
        out = torch.empty_like(x)
        _native.dropout(x.numpy(), out.numpy(), float(p), int(seed))
        ctx.p, ctx.seed = float(p), int(seed)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.detach().contiguous()
        out = torch.empty_like(grad)
        _native.dropout(grad.numpy(), out.numpy(), ctx.p, ctx.seed)
        return out, None, None


class NativeReluDropout(torch.autograd.Function):
    """``apply(x, p, seed)``: ``dropout(relu(x))`` in one native pass. Backward from the output
    alone (kept and positive where ``out > 0``), so no ReLU output is kept besides it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        x = x.detach().contiguous()
        out = torch.empty_like(x)
        _native.dropout(x.numpy(), out.numpy(), float(p), int(seed), relu=True)
        ctx.p = float(p)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        grad = grad.detach().contiguous()
        grad_in = torch.empty_like(grad)
        _native.relu_dropout_backward(grad.numpy(), out.numpy(), grad_in.numpy(), ctx.p)
        return grad_in, None, None


class FusedReluDropout(torch.autograd.Function):
    """``apply(x, p)`` (0 < p < 1): ``dropout(relu(x))`` with torch's fused dropout kernel
    (``torch.native_dropout``, the random draws of ``F.dropout`` on CUDA); backward from the
    output alone (kept and positive where ``out > 0``), so neither the ReLU output nor the mask
    is kept. Gradients equal the two ops' (``g / (1 - p)`` where kept and positive, else 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        out, _ = torch.native_dropout(torch.relu(x.detach()), float(p), True)
        ctx.scale = 1.0 / (1.0 - float(p))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        return (grad * ctx.scale).masked_fill_(~(out > 0), 0.0), None     # +0 where not kept and positive


def _check_p(p: float) -> float:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return float(p)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout with probability ``p`` in [0, 1] when ``training`` (identity otherwise)."""
    _check_p(p)
    if not training or p == 0.0:
        return x
    if p == 1.0 or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return torch.nn.functional.dropout(x, p, True)
    seed = int(torch.randint(0, SEED_BOUND, (1,)).item())
    return NativeDropout.apply(x, p, seed)


def relu_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``dropout(relu(x), p, training)``: one native pass on CPU float32/float64 when training
    (the same mask and RNG draw as the two calls); on CUDA :class:`FusedReluDropout` (torch's
    draws, one tensor kept for backward); else the two torch ops."""
    _check_p(p)
    if training and 0.0 < p < 1.0 and x.device.type == "cuda":
        return FusedReluDropout.apply(x, p)
    if not training or p == 0.0 or p == 1.0 or x.device.type != "cpu" or \
            x.dtype not in (torch.float32, torch.float64):
        return dropout(torch.relu(x), p, training)
    seed = int(torch.randint(0, SEED_BOUND, (1,)).item())
    return NativeReluDropout.apply(x, p, seed)


class Dropout(nn.Module):
    """``nn.Dropout`` with :func:`dropout`'s native CPU mask."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = _check_p(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def forward_relu(self, x: torch.Tensor) -> torch.Tensor:
        """``self(torch.relu(x))`` in one pass where native (:func:`relu_dropout`)."""
        return relu_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
