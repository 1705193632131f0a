"""Allreduces of the engines: :class:`GradientAllreduce` (all parameter gradients as one flat
buffer, with the step's finiteness check) and the small float/int reductions of evaluation
counts (:func:`allreduce_sum`, :func:`allreduce_max`)."""
from __future__ import annotations

import math

import numpy as np
import torch



class GradientAllreduce:
    """Allreduce of all parameter gradients as one flat float32 buffer, with a divergence check.

    ``op`` = 'mean' divides the sum by the number of ranks. A parameter without a gradient
    contributes zeros, and after the call every parameter has a gradient (identical on all
    ranks). Uses mpi4py, or torch.distributed when ``use_torch_distributed`` (the caller has
    initialised it). ``bytes_per_call`` is the buffer size.

    Divergence: the buffer has one more element, the caller's local ``loss`` (0 without one).
    After the allreduce every rank holds the same buffer, so one test decides identically
    everywhere (size 1 too, with no allreduce): its sum is finite iff every element is (one
    pass; only a sum that overflows is looked at element-wise). A non-finite loss or gradient
    on any rank raises :class:`~hpcgnn.errors.TrainingDiverged` on every rank, before the
    gradients are written back and before the caller's optimizer step.
    """

    def __init__(self, model: torch.nn.Module, rt, op: str = "mean", use_torch_distributed: bool = False):
        if op not in ("mean", "sum"):
            raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {op!r}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.rt = rt
        self.op = op
        self.use_torch = use_torch_distributed
        self.numel = sum(p.numel() for p in self.params)
        self._flat = torch.zeros(self.numel + 1, dtype=torch.float32)
        self._loss = self._flat[self.numel:]     # the divergence flag: this rank's loss

    @property
    def bytes_per_call(self) -> int:
        return (self.numel + 1) * 4

    def __call__(self, loss=None, epoch: int | None = None, step: int = 0, steps: int = 1) -> None:
        """Collective: reduce the gradients, then raise TrainingDiverged on every rank if any
        rank's loss or gradient is not finite. ``loss``: this rank's loss of the step (a tensor,
        copied with the gradients, no host sync of its own; a float; or None when the rank had
        none); ``epoch``, ``step`` (0-based) of ``steps`` name the step in the error."""
        flat = self._flat
        off = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                flat[off:off + n].zero_()
            else:
                flat[off:off + n].copy_(p.grad.detach().reshape(-1))
            off += n
        if isinstance(loss, torch.Tensor):
            self._loss.copy_(loss.detach())
        else:
            self._loss.fill_(0.0 if loss is None else float(loss))
        if self.rt.size > 1:
            if self.use_torch:
                import torch.distributed as dist

                dev = self.params[0].device if self.params else torch.device("cpu")
                buf = flat.to(dev)
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
                flat.copy_(buf.cpu())
            else:
                from mpi4py import MPI

                self.rt.comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            if self.op == "mean":
                flat.div_(self.rt.size)
        # a sum over finite values is finite unless it overflows: only then look element-wise
        if not math.isfinite(flat.sum().item()) and not bool(torch.isfinite(flat).all()):
            self._diverged(epoch, step, steps)
        off = 0
        for p in self.params:
            n = p.numel()
            g = flat[off:off + n].view_as(p).to(p.device, p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            off += n

    def _diverged(self, epoch, step: int, steps: int):
        """Raise TrainingDiverged; the message depends only on the reduced buffer (same on every rank)."""
        from hpcgnn.errors import TrainingDiverged

        kind = "nan" if bool(torch.isnan(self._flat).any()) else "inf"
        where = "" if epoch is None else f" at epoch {epoch}, step {step + 1} of {steps}"
        raise TrainingDiverged(f"training diverged{where}: the loss or a gradient is not finite ({kind}); "
                               "no checkpoint was written for it (lower train.lr, check the input features)")


def allreduce_sum(rt, values) -> np.ndarray:
    """Element-wise sum over ranks of a float64 vector (one Allreduce)."""
    from mpi4py import MPI

    buf = np.ascontiguousarray(values, dtype=np.float64).copy()
    if rt.size > 1:
        rt.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return buf


def allreduce_max(rt, value: int) -> int:
    """Maximum of an integer over ranks."""
    from mpi4py import MPI

    return int(rt.comm.allreduce(int(value), op=MPI.MAX)) if rt.size > 1 else int(value)
