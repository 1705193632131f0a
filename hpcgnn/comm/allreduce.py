"""Allreduces of the engines: :class:`GradientAllreduce` (the parameter gradients in buckets over
the job's data plane, started during backward, with the step's finiteness check and the
sample-weighted mean) and the small float/int reductions of evaluation counts
(:func:`allreduce_sum`, :func:`allreduce_max`)."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

BUCKET_BYTES = 25 * 1024 * 1024     # DDP's default bucket size


class GradientAllreduce:
    """Sum over ranks of every parameter gradient, in buckets over a
    :class:`~hpcgnn.comm.communicator.Communicator`, with a divergence check (DDP style).

    **Buckets.** The trainable parameters in reverse registration order (the order backward
    produces their gradients) are cut into float32 buckets of about ``bucket_bytes`` (a
    parameter larger than that is a bucket of its own), living on ``comm.device``. With
    ``overlap`` and :meth:`begin` called before backward, a hook on every parameter
    (``register_post_accumulate_grad_hook``) marks its gradient ready; buckets are started
    (``comm.start_allreduce_``, non-blocking) strictly in bucket index order, each as soon as it
    and every bucket before it are complete. :meth:`__call__` (after backward) starts the rest
    in the same order, then waits for all: every rank starts the same buckets in the same
    order whatever its backward did (an empty batch, unused parameters), so nothing deadlocks.
    A parameter without a gradient contributes zeros; afterwards every parameter has a
    gradient, identical on all ranks. A gradient is ready after ``accumulations`` = 'once' one
    accumulation, or ('learn', for a backward in several passes: the offloaded chunks) as many as
    the first step with a backward counted (that step starts nothing during backward). Should a
    gradient grow after its bucket was started, every rank (agreed through the tail) reduces the
    step again after backward and stops overlapping: a wrong count costs time, never a wrong
    gradient. An engine whose backward runs collectives of its own (halo adjoints, tensor-parallel
    gathers) gives the reducer ``comm.duplicate()``, so buckets started between those
    collectives at different points on different ranks keep MPI's same-order rule.

    **Reduction** (``op``). 'sum': Σ_r g_r. 'mean': the sample-weighted mean
    Σ_r n_r·g_r / Σ_r n_r, where g_r is rank r's gradient of its mean loss and n_r its number
    of training samples in the step (:meth:`begin` or ``samples``; a rank with n_r = 0
    contributes zeros whatever its gradient or loss, a NaN of an empty batch included;
    ``samples=None`` weighs the rank as 1, the plain mean over ranks). Σ_r n_r rides in a
    three-element float64 tail allreduce with the loss (and the
    'late' flag above); with Σ n_r = 0 the gradients stay zero.
    On one rank the gradients are passed through unchanged (no scaling, no communication).

    **Divergence.** The tail's first element is this rank's loss (0 without one). After the
    reduction every rank holds the same values, so one test decides identically everywhere:
    their sum is finite iff every element is (one pass; only a sum that overflows is looked
    at element-wise). A non-finite loss or gradient on any rank raises
    :class:`~hpcgnn.errors.TrainingDiverged` on every rank, before the gradients are written
    back and before the caller's optimizer step.
    """

    def __init__(self, model: torch.nn.Module, comm, op: str = "mean", bucket_bytes: int = BUCKET_BYTES,
                 overlap: bool = True, accumulations: str = "once"):
        if op not in ("mean", "sum"):
            raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {op!r}")
        if accumulations not in ("once", "learn"):
            raise ValueError(f"accumulations must be 'once' or 'learn', got {accumulations!r}")
        if int(bucket_bytes) <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes!r}")
        self.comm, self.op, self.overlap = comm, op, bool(overlap)
        self.size = int(comm.size)
        self.device = torch.device(getattr(comm, "device", "cpu"))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        # buckets: lists of (param, offset, numel), reverse registration order
        self.buckets: list[list[tuple[torch.Tensor, int, int]]] = []
        self._bucket_of: list[int] = []          # param index (reverse order) -> bucket
        cap = max(1, int(bucket_bytes) // 4)
        cur, off = [], 0
        for p in reversed(self.params):
            cur.append((p, off, p.numel()))
            off += p.numel()
            self._bucket_of.append(len(self.buckets))
            if off >= cap:
                self.buckets.append(cur)
                cur, off = [], 0
        if cur:
            self.buckets.append(cur)
        self._bufs = [torch.zeros(sum(n for _, _, n in b), dtype=torch.float32, device=self.device)
                      for b in self.buckets]
        self._tail = torch.zeros(3, dtype=torch.float64, device=self.device)   # [loss, n_r, late]
        n = len(self._bucket_of)
        # accumulations of each gradient in one backward after which it is ready: 1, or (learn)
        # what the first step with a backward counted (None until then: that step starts
        # nothing during backward)
        self._expect = [1] * n if accumulations == "once" else None
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
                         for i, p in enumerate(reversed(self.params))]
        self.started_in_backward = 0    # buckets of the last step started from a hook
        self._reset_step()

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def bytes_per_call(self) -> int:
        """Bytes allreduced per step: the float32 buckets and the float64 tail."""
        return self.numel * 4 + self._tail.numel() * 8

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def close(self) -> None:
        """Remove the hooks from the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- one step ------------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._armed = self._begun = False
        self._samples = None
        self._hits = [0] * len(self._bucket_of)
        self._late = False
        self._missing = [len(b) for b in self.buckets]
        self._pending: list = [None] * len(self.buckets)
        self._next = 0                 # the next bucket to start (bucket index order)

    def begin(self, samples: int | None = None) -> None:
        """Before backward: this rank's training samples in the step (n_r >= 0, or None: weight
        1); with ``overlap``, arms the hooks that start buckets during backward."""
        if samples is not None and int(samples) < 0:
            raise ValueError(f"samples must be >= 0, got {samples!r}")
        if self._next:
            raise RuntimeError("GradientAllreduce.begin: the previous step was not finished (call the reducer)")
        self._reset_step()
        self._samples = None if samples is None else int(samples)
        self._armed, self._begun = self.overlap and self._expect is not None, True
        self.started_in_backward = 0

    def _scale(self):
        """Factor applied to this rank's gradients before the sum: None (as is), 0 (zeros), n_r."""
        if self.size == 1 or self.op == "sum" or self._samples is None:
            return None
        return float(self._samples)

    def _ready(self, i: int, param: torch.Tensor) -> None:
        """Hook: the gradient of parameter ``i`` (reverse order) is accumulated."""
        if not self._begun:
            return
        self._hits[i] += 1
        if not self._armed:
            return
        b = self._bucket_of[i]
        if self._pending[b] is not None:
            # accumulated after its bucket was started: this step is reduced again after backward
            # (every rank agrees through the tail) and overlap is switched off
            self._late = True
            return
        if self._hits[i] != self._expect[i]:
            return
        self._missing[b] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._start(self._next)
            self.started_in_backward += 1

    def _start(self, b: int) -> None:
        """Copy bucket ``b``'s gradients (scaled) into its buffer and start its allreduce."""
        assert b == self._next
        buf, scale = self._bufs[b], self._scale()
        for p, off, n in self.buckets[b]:
            dst = buf[off:off + n]
            if p.grad is None or scale == 0.0:
                dst.zero_()
            else:
                dst.copy_(p.grad.detach().reshape(-1))
                if scale is not None and scale != 1.0:
                    dst.mul_(scale)
        self._pending[b] = self.comm.start_allreduce_(buf) if self.size > 1 else True
        self._next += 1

    def __call__(self, loss=None, epoch: int | None = None, step: int = 0, steps: int = 1,
                 samples: int | None = None) -> None:
        """Collective, after backward: reduce the gradients, then raise TrainingDiverged on every
        rank if any rank's loss or gradient is not finite. ``loss``: this rank's loss of the step
        (a tensor, copied without a host sync of its own; a float; or None when the rank had
        none); ``samples``: n_r when :meth:`begin` was not called this step (same meaning);
        ``epoch``, ``step`` (0-based) of ``steps`` name the step in the error."""
        if samples is not None:
            if self._begun and self._samples != int(samples):
                raise ValueError(f"samples = {samples} differs from begin({self._samples})")
            if int(samples) < 0:
                raise ValueError(f"samples must be >= 0, got {samples!r}")
            self._samples = int(samples)
        if not self._begun:
            self.started_in_backward = 0
        self._armed = False
        try:
            while self._next < len(self.buckets):
                self._start(self._next)
            tail = self._tail
            zero = self.op == "mean" and self._samples == 0
            if isinstance(loss, torch.Tensor) and not zero:
                tail[0:1].copy_(loss.detach().reshape(1))
            else:
                tail[0] = 0.0 if (loss is None or zero) else float(loss)
            tail[1] = 1.0 if self._samples is None else float(self._samples)
            tail[2] = 1.0 if self._late else 0.0
            pending = [self.comm.start_allreduce_(tail)] if self.size > 1 else []
            for p in self._pending:
                if p is not True:
                    p.wait()
            for p in pending:
                p.wait()
            # one host read of the step: Σ n_r, the 'late' flag and the finiteness sum
            total, late, finite = self._read()
            if late > 0:
                # a gradient grew after its bucket left on some rank: every rank reduces the
                # step again, from the gradients as they are now, and stops overlapping
                self.overlap = False
                self._next = 0
                self._pending = [None] * len(self.buckets)
                while self._next < len(self.buckets):
                    self._start(self._next)
                for p in self._pending:
                    if p is not True:
                        p.wait()
                total, late, finite = self._read()
            elif self._expect is None and self._begun and any(self._hits):
                self._expect = [max(h, 1) for h in self._hits]
        finally:
            self._reset_step()
        self._check(finite, epoch, step, steps)
        if self.size > 1 and self.op == "mean" and total > 0:
            for buf in self._bufs:
                buf.div_(total)
        for b, bucket in enumerate(self.buckets):
            buf = self._bufs[b]
            for p, off, n in bucket:
                g = buf[off:off + n].view_as(p)
                if p.grad is None:
                    p.grad = g.to(p.device, p.dtype, copy=True)
                else:
                    p.grad.copy_(g)

    def _read(self) -> tuple[float, float, bool]:
        """(Σ n_r, the 'late' flag, whether the sum of every reduced value is finite), read from
        the device in one copy (one wait for the device per step on a GPU data plane). A sum
        over finite values is finite unless it overflows: :meth:`_check` then looks element-wise."""
        sums = [buf.sum() for buf in self._bufs] + [self._tail.sum().float()]
        total = torch.stack(sums).sum() if len(sums) > 1 else sums[0]
        got = torch.stack([self._tail[1], self._tail[2], total.double()]).tolist()
        return got[0], got[1], math.isfinite(got[2])

    def _check(self, finite: bool, epoch, step: int, steps: int) -> None:
        """Raise TrainingDiverged when a reduced value is not finite (the same on every rank);
        ``finite``: :meth:`_read`'s sum test (element-wise only when it failed). Before the mean's
        division: dividing by Σ n_r > 0 neither makes nor removes a NaN or an infinity."""
        if finite:
            return
        bufs = self._bufs + [self._tail]
        if all(bool(torch.isfinite(b).all()) for b in bufs):
            return
        from hpcgnn.errors import TrainingDiverged

        kind = "nan" if any(bool(torch.isnan(b).any()) for b in bufs) else "inf"
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
