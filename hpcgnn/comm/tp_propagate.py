"""The tensor-parallel aggregation as one autograd collective: :class:`TPPropagate` (split,
``k`` aggregation rounds on the rank's column slice, gather; backward the mirror image) and
what it runs on, :class:`TPRun`, with the chunk pipelining of its exchanges.

**Chunks and pipelining.** The destinations are cut into ``n`` contiguous chunks
(:class:`~hpcgnn.comm.tensor_parallel.TPLayout`), processed in the same order on every rank. The
split is cut per chunk into the rows first needed by that chunk (each row sent once), the
gather per chunk into its destination rows. With ``pipeline`` all chunk splits are started at
once (non-blocking all-to-alls, :meth:`~hpcgnn.comm.tensor_parallel.TPComm.start_to_cols`) and
chunk ``j``'s aggregation starts when split ``j`` is done; chunk ``j``'s gather starts as soon as
its last-round rows are computed. Backward runs the chunks in reverse order: the
output-gradient split of chunk ``j`` and the input-gradient gather of the rows first needed by
chunk ``j`` overlap the same way. Without ``pipeline`` every exchange runs to completion when
it is posted. Results equal the unchunked ones up to floating-point order.

**Staged path** (``TPRun.stage`` set): the rounds run on the compute device through the
engine's :class:`~hpcgnn.engine.tensor_staging.DeviceStage` (passed in; this module uses its
``host_buffer`` / ``device_buffer`` / ``forward_round`` / ``backward_round`` / ``mover`` and
``resident``), the exchanges' buffers stay in host memory; the exchanges and their order are
the unstaged path's.

Every rank must apply the same propagations in the same order (collectives over the job's data
plane, through :class:`~hpcgnn.comm.tensor_parallel.TPComm`).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from hpcgnn.comm.tensor_parallel import TPComm, TPLayout, column_bounds


class TPRun:
    """What one rank needs to run :class:`TPPropagate`: the layout and its exchanges, the
    propagation matrix, the rounds and coefficients, time/volume accounting and, on the
    staged path, the :class:`~hpcgnn.engine.tensor_staging.DeviceStage` (``stage``; None
    unstaged)."""

    def __init__(self, tp: TPComm, layout: TPLayout, prop, pipeline: bool, stage=None):
        self.tp, self.layout, self.prop, self.pipeline = tp, layout, prop, pipeline
        self.stage = stage
        self._aggregate_s = 0.0
        self._spans: list = []          # CUDA (start, end) event pairs of chunk aggregations
        self.edge_columns = 0
        self.alltoalls = 0
        self.record = True

    def reset(self) -> None:
        self._aggregate_s, self._spans, self.edge_columns, self.alltoalls = 0.0, [], 0, 0

    @property
    def aggregate_s(self) -> float:
        """Seconds of chunk aggregation since :meth:`reset`: host time on the CPU; on CUDA the
        device time between each chunk's events, resolved here (once per epoch: it waits for
        the last of them) instead of a synchronisation per chunk."""
        if self._spans:
            self._spans[-1][1].synchronize()
            self._aggregate_s += sum(s.elapsed_time(e) for s, e in self._spans) / 1e3
            self._spans = []
        return self._aggregate_s

    def _agg(self, seconds: float, columns: int = 0, start=None) -> None:
        """Count one chunk's aggregation: ``seconds`` of host time, or, with ``start`` (a CUDA
        event recorded on the compute stream before its kernels), the device time from
        ``start`` to now (an end event of the same kind, recorded here)."""
        if not self.record:
            return
        self.edge_columns += columns
        if start is None:
            self._aggregate_s += seconds
            return
        end = type(start)(enable_timing=True)
        end.record()
        self._spans.append((start, end))

    def _collective(self, count: int = 1) -> None:
        if self.record:
            self.alltoalls += count


def _start_all(run: TPRun, starts: list):
    """Start the exchanges ``starts`` (callables) now (pipelined) or lazily, one by one."""
    if run.pipeline:
        return [s() for s in starts]
    return list(starts)


def _finish(handles: list, i: int):
    h = handles[i]
    if callable(h):
        h = handles[i] = h()
    return h.finish()


def _drive(handles: list, i: int) -> None:
    """Let MPI progress the next outstanding exchange (non-blocking test)."""
    if 0 <= i < len(handles) and not callable(handles[i]):
        handles[i].test()


def _post(run: TPRun, handles: list, i: int, start) -> None:
    """Append the ``i``-th exchange of a sequence: started now (pipelined) or run to completion
    now (not pipelined); then let the previous one progress."""
    handles.append(start() if run.pipeline else start)
    if not run.pipeline:
        _finish(handles, i)
    _drive(handles, i - 1)


class _LaggedPosts:
    """The gathers of the last round on the staged path, each posted (:func:`_post`) one chunk
    late: chunk ``i``'s host rows are still being copied from the device when it is handed in,
    so :meth:`add` waits only for the copies issued before the previous chunk's
    (:meth:`DeviceMover.settle`) and posts that one, while the device works on this chunk;
    :meth:`finish` posts the rest. Every rank posts the same exchanges in the same order."""

    def __init__(self, run: TPRun, handles: list, mover):
        self.run, self.handles, self.mover = run, handles, mover
        self._queue: list = []

    def add(self, i: int, start) -> None:
        self._queue.append((i, start, self.mover.mark()))
        if len(self._queue) > 1:
            self._post_oldest()

    def finish(self) -> None:
        while self._queue:
            self._post_oldest()

    def _post_oldest(self) -> None:
        i, start, mark = self._queue.pop(0)
        self.mover.settle(mark)
        _post(self.run, self.handles, i, start)


def _finish_all(handles: list, n: int, run: TPRun) -> None:
    """Complete the ``n`` exchanges of a sequence (2 all-to-alls counted: split and gather)."""
    for i in range(n):
        _finish(handles, i)
    run._collective(2)


class TPPropagate(torch.autograd.Function):
    """``TPPropagate.apply(h_rows, edge_weight, run, k, c, alpha)``: vertex-layout rows
    [n_i, C] -> split -> ``Z_r = c A Z_(r-1) + alpha Z_0`` for r = 1..k on the column slice ->
    gather -> [n_i, C]. ``edge_weight`` [E + V] (attention) or None (the matrix's own weights);
    its gradient is this rank's partial sum over its columns. Chunked and pipelined as the
    module docstring says; backward runs the mirror image."""

    @staticmethod
    def forward(ctx, h, edge_weight, run: TPRun, k: int, c: float, alpha: float):
        if run.stage is not None:
            return _staged_forward(ctx, h, edge_weight, run, k, c, alpha)
        lay, prop, tp = run.layout, run.prop, run.tp
        h = h.detach().contiguous()
        width = int(h.shape[1])
        w = int(np.diff(column_bounds(width, lay.size))[lay.rank])
        n = lay.num_chunks
        cb = lay.chunk_bounds
        z0 = h.new_zeros((lay.num_nodes, w))
        out = h.new_zeros((lay.num_own, width))
        splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.split_transfer(j), h, z0, "split"))
                                  for j in range(n)])
        gathers = []
        need_saved = edge_weight is not None and ctx.needs_input_grad[1]
        saved = []
        prev = z0
        for r in range(1, k + 1):
            nxt = h.new_empty((lay.num_nodes, w))
            for j in range(n):
                if r == 1:
                    _finish(splits, j)
                    _drive(splits, j + 1)
                a, b = int(cb[j]), int(cb[j + 1])
                t0 = time.perf_counter()
                rows = nxt[a:b]
                prop.forward_rows(a, b, prev, rows, edge_weight)
                if c != 1.0:
                    rows.mul_(c)
                if alpha:
                    rows.add_(z0[a:b], alpha=alpha)
                e0, e1 = prop.edge_range(a, b)
                run._agg(time.perf_counter() - t0, (e1 - e0) * w)
                if r == k:
                    start = (lambda j=j, nxt=nxt: tp.start_to_rows(lay.gather_transfer(j), nxt, width, out, "gather"))
                    _post(run, gathers, j, start)
            if need_saved:
                saved.append(prev)
            prev = nxt
        _finish_all(gathers, n, run)
        ctx.run, ctx.k, ctx.c, ctx.alpha, ctx.width, ctx.w = run, k, c, alpha, width, w
        ctx.saved_z = saved
        ctx.save_for_backward(edge_weight if edge_weight is not None else None)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.run.stage is not None:
            return _staged_backward(ctx, grad_out)
        run, k, c, alpha, width, w = ctx.run, ctx.k, ctx.c, ctx.alpha, ctx.width, ctx.w
        (edge_weight,) = ctx.saved_tensors
        lay, prop, tp = run.layout, run.prop, run.tp
        n, cb = lay.num_chunks, lay.chunk_bounds
        g_out = grad_out.detach().contiguous()
        gk = g_out.new_zeros((lay.num_nodes, w))
        rev = list(range(n - 1, -1, -1))
        splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.gather_transfer(j), g_out, gk, "split"))
                                  for j in rev])
        g0 = g_out.new_zeros((lay.num_nodes, w))        # gradient of Z_0
        grad_h = g_out.new_zeros((lay.num_own, width))
        grad_w = None
        if edge_weight is not None and ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(edge_weight)
        gathers = []
        for r in range(k, 0, -1):
            gprev = g0 if r == 1 else g_out.new_zeros((lay.num_nodes, w))
            for i, j in enumerate(rev):
                if r == k:
                    _finish(splits, i)
                    _drive(splits, i + 1)
                a, b = int(cb[j]), int(cb[j + 1])
                t0 = time.perf_counter()
                g_rows = gk[a:b] * c if c != 1.0 else gk[a:b]
                prop.backward_rows(j, g_rows, gprev, edge_weight)
                if alpha:
                    g0[a:b].add_(gk[a:b], alpha=alpha)
                if grad_w is not None:
                    prop.edge_grad_rows(a, b, g_rows, ctx.saved_z[r - 1], grad_w)
                e0, e1 = prop.edge_range(a, b)
                run._agg(time.perf_counter() - t0, (e1 - e0) * w)
                if r == 1:
                    start = (lambda j=j: tp.start_to_rows(lay.split_transfer(j), g0, width, grad_h, "gather"))
                    _post(run, gathers, i, start)
            gk = gprev
        _finish_all(gathers, n, run)
        ctx.saved_z = None
        return grad_h, grad_w, None, None, None, None


def _staged_forward(ctx, h, edge_weight, run: TPRun, k: int, c: float, alpha: float):
    """:meth:`TPPropagate.forward` on the staged path: ``h`` and the output on the compute
    device, the rounds through ``run.stage``; the exchanges' buffers in host memory, the
    slices between them on the device when the stage is resident (else in host memory). The
    exchanges and their order are the unstaged path's (same collectives, same overlap)."""
    lay, tp, st = run.layout, run.tp, run.stage
    res = st.resident
    h = h.detach().contiguous()
    width = int(h.shape[1])
    w = int(np.diff(column_bounds(width, lay.size))[lay.rank])
    n, v = lay.num_chunks, lay.num_nodes
    need_saved = edge_weight is not None and ctx.needs_input_grad[1]
    z0 = st.host_buffer("z0", (v, w), h.dtype, zero=True)          # the split's target
    # resident: Z_0 kept on the device from the first round's rows (later rounds' teleport and
    # GAT's saved Z_0)
    z0d = st.device_buffer("z0", (v, w), h.dtype, zero=True) if res and (k > 1 or need_saved) else None
    out = h.new_zeros((lay.num_own, width))
    splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.split_transfer(j), h, z0, "split"))
                              for j in range(n)])
    gathers, saved = [], []
    posts = _LaggedPosts(run, gathers, st.mover)
    prev, prev_dev = z0, False
    for r in range(1, k + 1):
        tag = f"z{r}" if need_saved else f"z{2 - r % 2}"
        nxt_dev = res and r < k                 # the last round's rows go to the gather (host)
        nxt = st.device_buffer(tag, (v, w), h.dtype) if nxt_dev else st.host_buffer(tag, (v, w), h.dtype)

        def before_load(j, first=r == 1):
            if first:
                _finish(splits, j)
                _drive(splits, j + 1)

        def after_store(j, last=r == k, nxt=nxt):
            if last:                        # posted once chunk j's rows are in host memory
                posts.add(j, lambda j=j: tp.start_to_rows(lay.gather_transfer(j), nxt, width, out, "gather"))

        if r == 1:
            st.forward_round(run, prev, nxt, None, c, alpha, edge_weight, before_load, after_store,
                             nxt_dev=nxt_dev, capture=z0d)
        else:
            st.forward_round(run, prev, nxt, z0d if res else z0, c, alpha, edge_weight, before_load, after_store,
                             prev_dev=prev_dev, nxt_dev=nxt_dev, z0_dev=res)
        if need_saved:
            saved.append((z0d, True) if r == 1 and res else (prev, prev_dev))
        prev, prev_dev = nxt, nxt_dev
    posts.finish()
    _finish_all(gathers, n, run)
    ctx.run, ctx.k, ctx.c, ctx.alpha, ctx.width, ctx.w = run, k, c, alpha, width, w
    ctx.saved_z = saved
    ctx.save_for_backward(edge_weight if edge_weight is not None else None)
    return out


def _staged_backward(ctx, grad_out):
    """:meth:`TPPropagate.backward` on the staged path (see :func:`_staged_forward`)."""
    run, k, c, alpha, width, w = ctx.run, ctx.k, ctx.c, ctx.alpha, ctx.width, ctx.w
    (edge_weight,) = ctx.saved_tensors
    lay, tp, st = run.layout, run.tp, run.stage
    res = st.resident
    n, v = lay.num_chunks, lay.num_nodes
    g_out = grad_out.detach().contiguous()
    gk = st.host_buffer("gk", (v, w), g_out.dtype, zero=True)       # the split's target
    rev = list(range(n - 1, -1, -1))
    splits = _start_all(run, [(lambda j=j: tp.start_to_cols(lay.gather_transfer(j), g_out, gk, "split"))
                              for j in rev])
    g0h = st.host_buffer("g0", (v, w), g_out.dtype, zero=True)      # the gather's source
    g0 = st.device_buffer("g0", (v, w), g_out.dtype, zero=True) if res else g0h
    grad_h = g_out.new_zeros((lay.num_own, width))
    grad_w = None
    if edge_weight is not None and ctx.needs_input_grad[1]:
        grad_w = torch.zeros_like(edge_weight)
    gathers = []
    posts = _LaggedPosts(run, gathers, st.mover)
    gk_dev = False
    for r in range(k, 0, -1):
        if r == 1:
            gprev = g0
        elif res:
            gprev = st.device_buffer(f"g{1 + r % 2}", (v, w), g_out.dtype, zero=True)
        else:
            gprev = st.host_buffer(f"g{1 + r % 2}", (v, w), g_out.dtype, zero=True)

        def before_chunk(i, j, first=r == k):
            if first:
                _finish(splits, i)
                _drive(splits, i + 1)

        def after_flush(i, j, last=r == 1):
            if last:                        # posted once every gradient of chunk j's rows is in g0
                posts.add(i, lambda j=j: tp.start_to_rows(lay.split_transfer(j), g0h, width, grad_h, "gather"))

        x_saved, x_dev = ctx.saved_z[r - 1] if grad_w is not None else (None, False)
        st.backward_round(run, gk, gprev, g0, c, alpha, edge_weight, x_saved, grad_w, before_chunk, after_flush,
                          gk_dev=gk_dev, gprev_dev=res, g0_dev=res, x_dev=x_dev,
                          g0_host=g0h if res and r == 1 else None)
        gk, gk_dev = gprev, res
    posts.finish()
    _finish_all(gathers, n, run)
    ctx.saved_z = None
    return grad_h, grad_w, None, None, None, None
