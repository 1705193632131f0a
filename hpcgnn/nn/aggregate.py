"""Differentiable aggregation over a :class:`~hpcgnn.sampling.block.Block`.

A block is a CSR over destinations: the in-edges of destination ``v`` are
``indices[indptr[v]:indptr[v+1]]`` (source rows), edge id = position in ``indices``.
Every operator takes source rows ``x`` of shape ``[num_src, ...]`` and returns
destination rows ``[num_dst, ...]``.

Backends (``backend=``):

* ``"native"``: the OpenMP kernels of ``native/spmm.cpp`` (CPU, float32/float64). Forward
  gathers along the CSR; backward gathers along the block's cached transpose
  (``block.transpose()``), so neither direction uses atomics and results are bitwise
  identical for any thread count.
* ``"torch"``: the device path (docs/kernels.md): torch's sparse CSR kernels (SpMM
  ``torch.addmm`` (:func:`sparse_dense_mm`): cuSPARSE on CUDA, MKL/native on the CPU; SDDMM
  ``torch.sparse.sampled_addmm``) and CSR segment reductions (``torch.segment_reduce``), with
  custom autograd Functions whose backward runs on the block's transposed CSR. No operator
  materialises one row per edge (an ``[nnz, D]`` temporary): extra memory is O(nnz) (O(nnz H)
  for GAT's H heads) plus O(V D) rows, and no operator uses atomics (run-to-run identical
  results on CUDA too). The CSR tensors of a block and of its transpose are built once per
  device and cached on the block (:meth:`~hpcgnn.sampling.block.Block.sparse_csr`). Used for
  CUDA tensors and for dtypes the kernels do not handle.
* ``"auto"`` (default): native for CPU float32/float64 tensors, torch otherwise.

``deterministic=True`` (``train.deterministic``, a layer's ``deterministic`` attribute) runs
every torch-path operator under ``torch.use_deterministic_algorithms(True)``, scoped to the
operator; an autograd Function keeps the flag for its backward. On CUDA the SpMM then runs as a
gather and a CSR segment sum per slice of columns (:func:`_spmm_by_segments`): cuSPARSE's SpMM
differs run to run even in torch's deterministic mode (an H200, torch 2.11). The native kernels are
deterministic anyway (no atomics, bitwise identical for any thread count) and ignore it.

Parameters that are not differentiated (block structure, ``row_scale``) are treated as
constants. The structure tensors of a block must be on the same device as ``x``.

This module holds the backend dispatch and shared helpers, the torch path's CSR operators
(SpMM, SDDMM, segment sums), the weighted sum and mean aggregations (float32/float64 and
SAGE's bfloat16 mean), row gathers and a micro-benchmark timer; GAT's attention operators,
built on these, are :mod:`hpcgnn.nn.aggregate_gat`.
"""
from __future__ import annotations

import contextlib
import time

import torch

from hpcgnn.native import spmm as _spmm

BACKENDS = ("auto", "native", "torch")
_NATIVE_DTYPES = (torch.float32, torch.float64)


def kernel_options(owner) -> dict:
    """The aggregation keywords ``backend`` and ``deterministic`` (``train.kernels``,
    ``train.deterministic``) of an object that carries them as attributes: a conv layer, the
    tensor engine's propagation and device stage."""
    return {"backend": owner.backend, "deterministic": owner.deterministic}


@contextlib.contextmanager
def _det_scope(deterministic: bool):
    """torch's deterministic algorithms for the duration of one operator, when ``deterministic``
    (torch's switch is process-wide: it is restored at once)."""
    if not deterministic or torch.are_deterministic_algorithms_enabled():
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


# ---- helpers -------------------------------------------------------------------------------

def _use_native(x: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    ok = x.device.type == "cpu" and x.dtype in _NATIVE_DTYPES
    if backend == "native" and not ok:
        raise ValueError(f"backend 'native' needs CPU float32/float64 tensors, got {x.device} {x.dtype}")
    return ok and backend != "torch"


def _np(t: torch.Tensor | None):
    """Zero-copy numpy view of a CPU tensor (made contiguous first if needed)."""
    return None if t is None else t.detach().contiguous().numpy()


def _csr(block):
    return _np(block.indptr), _np(block.indices)


def edge_ids(t_eid):
    """A transpose's edge ids ``t_eid`` for an edge-weighted op; a RuntimeError where the block
    dropped them (:meth:`hpcgnn.sampling.block.Block.drop_edge_ids`: a model without per-edge
    weights), never a weighted sum in the wrong order."""
    if t_eid is None:
        raise RuntimeError("an edge-weighted aggregation needs the transpose's edge ids, which this block "
                           "dropped (Block.drop_edge_ids is for models without per-edge weights: SAGE, GCN)")
    return t_eid


def _transpose(block):
    """(t_indptr, t_indices, t_eid) as numpy views; the block caches its transpose (``t_eid``
    None where it dropped them: :func:`edge_ids`)."""
    if hasattr(block, "transpose"):
        t = block.transpose()
        return _np(t[0]), _np(t[1]), _np(t[2])
    return _spmm.csr_transpose(*_csr(block), int(block.num_src))


def _edge_dst(block) -> torch.Tensor:
    """int64 [nnz]: destination row of every edge."""
    if hasattr(block, "edge_dst"):
        return block.edge_dst()
    deg = block.indptr[1:] - block.indptr[:-1]
    return torch.repeat_interleave(torch.arange(block.num_dst, device=deg.device), deg,
                                   output_size=int(block.indices.shape[0]))


def _check_rows(block, x: torch.Tensor, what: str) -> None:
    if x.shape[0] != block.num_src:
        raise ValueError(f"{what}: x has {x.shape[0]} rows, the block has num_src={block.num_src}")


def dst_rows(block, h: torch.Tensor) -> torch.Tensor:
    """The destinations' own rows ``h[:num_dst]``; ``h`` itself when every row is a destination
    (one rank's full graph), whose backward then needs no zero-filled full-size gradient buffer
    (a slice's backward writes its gradient into a fresh zero tensor of ``h``'s shape)."""
    return h if block.num_dst == h.shape[0] else h[:block.num_dst]


def mean_scale(block, dtype=torch.float32) -> torch.Tensor:
    """[num_dst] ``1 / in_degree`` (0 for destinations without in-edges)."""
    deg = (block.indptr[1:] - block.indptr[:-1]).to(dtype)
    return torch.where(deg > 0, 1.0 / deg.clamp(min=1), torch.zeros_like(deg))


# ---- weighted sum --------------------------------------------------------------------------

# ---- the torch (device) path: CSR SpMM / SDDMM / segment reductions --------------------------

def _device_csr(block, device, transpose: bool = False) -> tuple:
    """(indptr, indices) or the transpose's (t_indptr, t_indices, t_eid) on ``device``: cached on
    a :class:`~hpcgnn.sampling.block.Block`, built per call for other CSR-like objects."""
    if hasattr(block, "device_csr"):
        return block.device_csr(device, transpose)
    if not transpose:
        return block.indptr.to(device), block.indices.to(device)
    from hpcgnn.sampling.block import _transpose_torch

    ip, ix = block.indptr.to(device), block.indices.to(device)
    return _transpose_torch(ip, ix, int(block.num_src), _edge_dst(block).to(device))


def _adjacency(block, device, dtype, weight: torch.Tensor | None = None, transpose: bool = False):
    """The block's adjacency ``[num_dst, num_src]`` (or its transpose) as a torch sparse CSR tensor
    with values ``weight`` [nnz] (edge-id order; None: 1). The unweighted one is cached on the
    block; a weighted one shares the cached index tensors (the transpose's values are
    ``weight[t_eid]``, an O(nnz) gather)."""
    from hpcgnn.sampling.block import sparse_csr

    if weight is None and hasattr(block, "sparse_csr"):
        return block.sparse_csr(device, dtype, transpose)
    parts = _device_csr(block, device, transpose)
    size = (block.num_src, block.num_dst) if transpose else (block.num_dst, block.num_src)
    if weight is None:
        values = torch.ones(int(block.indices.shape[0]), dtype=dtype, device=device)
    else:
        values = weight.to(device=device, dtype=dtype)
        if transpose:
            values = values.index_select(0, edge_ids(parts[2]))
    return sparse_csr(parts[0], parts[1], values.contiguous(), size)


def csr_spmm(block, x: torch.Tensor, weight: torch.Tensor | None = None, transpose: bool = False,
             deterministic: bool = False) -> torch.Tensor:
    """``A_w x`` [num_dst, D] (``transpose``: ``A_w^T x`` [num_src, D]) for x [rows, D], one
    sparse CSR x dense product (no autograd; memory: the output only)."""
    rows = block.num_src if transpose else block.num_dst
    if x.shape[1] == 0 or block.indices.shape[0] == 0:
        return x.new_zeros(rows, x.shape[1])
    if x.dtype not in _NATIVE_DTYPES:   # the sparse kernels take float32/float64: widen, round back
        return csr_spmm(block, x.float(), weight, transpose, deterministic).to(x.dtype)
    if deterministic and x.device.type == "cuda":    # cuSPARSE's SpMM is not run-to-run identical
        return _spmm_by_segments(block, x.detach(), weight, transpose)
    a = _adjacency(block, x.device, x.dtype, None if weight is None else weight.detach(), transpose)
    with _det_scope(deterministic):
        return sparse_dense_mm(a, x.detach().contiguous())


def sparse_dense_mm(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``a @ x`` for a sparse CSR ``a`` [m, k] and a dense ``x`` [k, n]: one new [m, n] tensor and
    no other dense temporary. (``torch.sparse.mm`` adds into a zero-filled [m, n] input, a
    second output-sized allocation alive during the product; here the zero input is one
    broadcast scalar.)"""
    return torch.addmm(x.new_zeros(()).expand(a.shape[0], x.shape[1]), a, x, beta=0.0)


SEGMENT_SPMM_ELEMENTS = 1 << 25   # the [nnz, columns] gather of one column slice, at most


def _spmm_by_segments(block, x: torch.Tensor, weight: torch.Tensor | None = None,
                      transpose: bool = False, max_elements: int = SEGMENT_SPMM_ELEMENTS) -> torch.Tensor:
    """:func:`csr_spmm` that is bit-identical run to run on CUDA (``deterministic``; cuSPARSE's
    SpMM is not, measured on an H200): per slice of columns, the sources' rows gathered along
    the CSR (times the edge weights) and summed per row by ``torch.segment_reduce``, which
    adds each row's edges in order. Extra memory: one ``[nnz, columns]`` slice of at most
    ``max_elements`` elements (one column when nnz exceeds it: O(nnz)); no host reads."""
    parts = _device_csr(block, x.device, transpose)
    ip, ix = parts[0], parts[1]
    rows = block.num_src if transpose else block.num_dst
    w = None
    if weight is not None:
        w = weight.detach().to(device=x.device, dtype=x.dtype)
        if transpose:
            w = w.index_select(0, edge_ids(parts[2]))
        w = w.unsqueeze(1)
    nnz, d = int(ix.shape[0]), int(x.shape[1])
    step = max(1, min(d, int(max_elements) // max(nnz, 1)))
    out = x.new_empty(rows, d)
    for c0 in range(0, d, step):
        part = x[:, c0:c0 + step].index_select(0, ix)
        if w is not None:
            part.mul_(w)
        out[:, c0:c0 + step] = torch.segment_reduce(part, "sum", offsets=ip, axis=0)
        del part
    return out


def csr_sddmm(block, g: torch.Tensor, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """[nnz] ``g[dst_e] . x[src_e]`` per edge ``e`` (g [num_dst, D], x [num_src, D]): the sampled
    product ``torch.sparse.sampled_addmm`` on the block's pattern, O(nnz) memory (no per-edge
    rows; no autograd)."""
    nnz = int(block.indices.shape[0])
    if nnz == 0 or g.shape[1] == 0:
        return g.new_zeros(nnz)
    if g.dtype not in _NATIVE_DTYPES:
        return csr_sddmm(block, g.float(), x.float(), deterministic).to(g.dtype)
    a = _adjacency(block, g.device, g.dtype)
    with _det_scope(deterministic):
        return torch.sparse.sampled_addmm(a, g.detach().contiguous(), x.detach().t(), beta=0.0).values()


def segment_sum(indptr: torch.Tensor, data: torch.Tensor, num_segments: int,
                deterministic: bool = False) -> torch.Tensor:
    """[num_segments, *F] sums of ``data`` [n, *F] over the CSR segments ``indptr`` (empty: 0)."""
    if data.shape[0] == 0:
        return data.new_zeros((num_segments, *data.shape[1:]))
    with _det_scope(deterministic):
        return torch.segment_reduce(data, "sum", offsets=indptr, axis=0)


def _weighted_sum(block, x: torch.Tensor, weight, row_scale, native: bool, deterministic: bool) -> torch.Tensor:
    """``diag(row_scale) A_w x`` [num_dst, D] for x [num_src, D] (no autograd): the OpenMP SpMM
    (``native``) or the torch CSR product."""
    if native:
        x = x.contiguous()
        out = x.new_empty(block.num_dst, x.shape[1])
        ip, ix = _csr(block)
        _spmm.spmm_sum(ip, ix, _np(x), out.numpy(), _np(weight), None, _np(row_scale))
        return out
    out = csr_spmm(block, x, weight, deterministic=deterministic)
    if row_scale is not None:
        out.mul_(row_scale.unsqueeze(1))
    return out


def _weighted_sum_adjoint(block, g: torch.Tensor, weight, row_scale, native: bool,
                          deterministic: bool) -> torch.Tensor:
    """``A_w^T diag(row_scale) g`` [num_src, D] for g [num_dst, D] (no autograd), along the
    block's cached transpose: the native kernel scales each column as it reads it, the torch
    path scales ``g`` first."""
    if native:
        t_ptr, t_idx, t_eid = _transpose(block)
        g = g.contiguous()
        out = g.new_empty(block.num_src, g.shape[1])
        _spmm.spmm_sum(t_ptr, t_idx, _np(g), out.numpy(), _np(weight),
                       None if weight is None else edge_ids(t_eid), None, _np(row_scale))
        return out
    if row_scale is not None:
        g = g * row_scale.unsqueeze(1)
    return csr_spmm(block, g, weight, transpose=True, deterministic=deterministic)


def _weighted_sum_edge_grad(block, g: torch.Tensor, x: torch.Tensor, row_scale, native: bool,
                            deterministic: bool) -> torch.Tensor:
    """[nnz] ``row_scale[dst_e] g[dst_e] . x[src_e]``: the gradient of ``diag(row_scale) A_w x``
    with respect to the edge weights ``w`` (no autograd)."""
    if row_scale is not None:
        g = g * row_scale.unsqueeze(1)
    if not native:
        return csr_sddmm(block, g, x, deterministic)
    nnz, f = int(block.indices.shape[0]), g.shape[1]
    out = g.new_empty(nnz)
    ip, ix = _csr(block)
    _spmm.sddmm_heads(ip, ix, _np(g).reshape(block.num_dst, 1, f), _np(x).reshape(-1, 1, f),
                      out.numpy().reshape(nnz, 1))
    return out


class _Sum(torch.autograd.Function):
    """out = diag(row_scale) A_w x with A_w the weighted block adjacency, on either kernel path
    (``native``: the OpenMP SpMM; else a torch CSR SpMM forward, a CSR SpMM on the cached
    transpose for grad x and an SDDMM for grad w: extra memory O(nnz + V D))."""

    @staticmethod
    def forward(ctx, block, x, edge_weight, row_scale, native, deterministic):
        edge_weight = None if edge_weight is None else edge_weight.contiguous()
        out = _weighted_sum(block, x, edge_weight, row_scale, native, deterministic)
        ctx.block, ctx.native, ctx.deterministic = block, native, deterministic
        ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, edge_weight, row_scale)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, w, row_scale = ctx.saved_tensors
        block, native, det = ctx.block, ctx.native, ctx.deterministic
        grad_x = _weighted_sum_adjoint(block, grad_out, w, row_scale, native, det) \
            if ctx.needs_input_grad[1] else None
        grad_w = _weighted_sum_edge_grad(block, grad_out, x, row_scale, native, det) \
            if ctx.needs_input_grad[2] else None
        return None, grad_x, grad_w, None, None, None


def aggregate_sum(block, x: torch.Tensor, edge_weight: torch.Tensor | None = None, *,
                  row_scale: torch.Tensor | None = None, backend: str = "auto",
                  deterministic: bool = False) -> torch.Tensor:
    """``out[v] = row_scale[v] * sum_{edges e=(u->v)} edge_weight[e] * x[u]``.

    x: [num_src, *F]; edge_weight: [nnz] or None (1); row_scale: [num_dst] or None (1), a
    constant. Returns [num_dst, *F]. Differentiable in x and edge_weight.
    """
    _check_rows(block, x, "aggregate_sum")
    feat_shape = x.shape[1:]
    x2 = x.reshape(x.shape[0], feat_shape.numel())
    if row_scale is not None:
        row_scale = row_scale.detach().to(x.dtype)
    if edge_weight is not None:
        edge_weight = edge_weight.to(x.dtype)
    out = _Sum.apply(block, x2, edge_weight, row_scale, _use_native(x, backend), bool(deterministic))
    return out.reshape(block.num_dst, *feat_shape)


class _SumWithDst(torch.autograd.Function):
    """(diag(row_scale) A x, x[:num_dst]) with one gradient buffer for x, on either kernel path
    (``native``: the OpenMP SpMM; else the torch CSR product): backward writes
    ``A^T diag(row_scale) g`` into a new [num_src, D] tensor and adds the destinations' own
    gradient into its first rows in place (autograd would zero-fill a second [num_src, D]
    tensor for the slice's gradient and add the two: three more passes over the largest tensor
    of the layer, and one more of them alive at once)."""

    @staticmethod
    def forward(ctx, block, x, row_scale, native, deterministic):
        out = _weighted_sum(block, x, None, row_scale, native, deterministic)
        ctx.block, ctx.native, ctx.deterministic = block, native, deterministic
        ctx.save_for_backward(row_scale)
        # the destinations' rows as their own tensor when they are fewer than the sources: a
        # layer keeps them for its weight gradient, and a view would keep every source row
        # (halo rows, sampled frontiers) alive until backward
        return out, x[:block.num_dst].clone() if block.num_dst < block.num_src else x[:block.num_dst]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_dst):
        (row_scale,) = ctx.saved_tensors
        block = ctx.block
        if grad_out is None:
            grad_x = grad_dst.new_zeros(block.num_src, grad_dst.shape[1])
        else:
            grad_x = _weighted_sum_adjoint(block, grad_out, None, row_scale, ctx.native, ctx.deterministic)
        if grad_dst is not None:
            grad_x[:block.num_dst] += grad_dst
        return None, grad_x, None, None, None


def aggregate_sum_with_dst(block, x: torch.Tensor, *, row_scale: torch.Tensor | None = None,
                           backend: str = "auto", deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aggregate_sum(block, x, row_scale=row_scale), x[:num_dst])`` for a layer that reads
    both (SAGE, GCN: the neighbours and the destination's own row), x [num_src, D]. Same values;
    the gradient of ``x`` is built in one buffer (``_SumWithDst``, either kernel path)
    instead of autograd's zero-filled slice gradient plus a sum of two full-size gradients, and
    the destination rows come as their own tensor when fewer than the sources (a layer keeps
    them for backward; a view would keep all of ``x``). Without a gradient to ``x`` (a layer-0
    input) they stay a view, which keeps ``x`` until backward."""
    _check_rows(block, x, "aggregate_sum_with_dst")
    if x.dim() != 2 or not x.requires_grad or not torch.is_grad_enabled():
        return (aggregate_sum(block, x, row_scale=row_scale, backend=backend, deterministic=deterministic),
                dst_rows(block, x))
    if row_scale is not None:
        row_scale = row_scale.detach().to(x.dtype)
    return _SumWithDst.apply(block, x, row_scale, _use_native(x, backend), bool(deterministic))


def aggregate_sum_adjoint(block, g: torch.Tensor, *, backend: str = "auto",
                          deterministic: bool = False) -> torch.Tensor:
    """``A^T g``: [num_src, d] sums of destination rows ``g`` [num_dst, d] over out-edges, the
    adjoint of an unweighted :func:`aggregate_sum` (no autograd graph). The native kernel over
    the block's cached transpose (CPU float32/float64), else a CSR SpMM with the cached
    transposed CSR (torch path)."""
    g = g.detach()
    return _weighted_sum_adjoint(block, g, None, None, _use_native(g, backend), deterministic)


def gather_rows(x: torch.Tensor, index: torch.Tensor, num_valid: int | None = None, *,
                backend: str = "auto") -> torch.Tensor:
    """Rows ``x[index]`` [len(index), D] (no autograd); with ``num_valid``, rows whose index is
    ``>= num_valid`` are zero instead (and ``x`` is only read below it).

    On the CPU this is the native aggregation kernel with one edge per row (its prefetching
    gather: about 5x torch's ``index_select`` for 100-wide float32 rows gathered at random
    from a table larger than the caches, docs/benchmarks.md); elsewhere ``index_select``.
    """
    index = index.to(torch.int64)
    valid = None if num_valid is None else index < int(num_valid)
    if x.dim() == 2 and _use_native(x, backend):
        out = torch.empty(index.shape[0], x.shape[1], dtype=x.dtype)
        if valid is None:
            ip = torch.arange(index.shape[0] + 1, dtype=torch.int64)
            ix = index
        else:
            ip = torch.zeros(index.shape[0] + 1, dtype=torch.int64)
            torch.cumsum(valid, 0, out=ip[1:])
            ix = index[valid]
        _spmm.spmm_sum(_np(ip), _np(ix), _np(x), out.numpy(), None, None, None)
        return out
    if valid is None:
        return x.detach().index_select(0, index)
    out = x.detach().index_select(0, index.clamp(max=max(int(num_valid) - 1, 0)))
    out[~valid] = 0
    return out


def aggregate_mean(block, x: torch.Tensor, *, backend: str = "auto", deterministic: bool = False) -> torch.Tensor:
    """Mean of the in-neighbours' rows; 0 for destinations without in-edges. [num_dst, *F]."""
    return aggregate_sum(block, x, row_scale=mean_scale(block, x.dtype), backend=backend,
                         deterministic=deterministic)


# ---- mean over bfloat16 rows (SAGE's bf16 update) -------------------------------------------

def _bits(t: torch.Tensor):
    """int16 numpy view of a contiguous bfloat16 CPU tensor's bit patterns."""
    return t.detach().contiguous().view(torch.int16).numpy()


class _SpmmMeanBf16(torch.autograd.Function):
    """``mean_{u in N(v)} xc[u]`` rounded to bfloat16, ``xc`` = ``x`` rounded to bfloat16
    (given, detached): the gathers read 2 bytes a value instead of 4, the sums are float32.
    The gradient goes to the float32 ``x``: the incoming bfloat16 gradient is gathered along the
    transpose as it is (widening is exact), so backward equals the float32 path's on the
    same gradient. ``with_dst``: also ``xc[:num_dst]`` (a copy when fewer than the sources),
    whose gradient backward adds into the first rows of ``x``'s in place (as ``_SumWithDst``: no
    zero-filled slice gradient)."""

    @staticmethod
    def forward(ctx, block, x, xc, scale, with_dst):
        out = torch.empty(block.num_dst, xc.shape[1], dtype=torch.float32)
        ip, ix = _csr(block)
        _spmm.spmm_sum_bf16(ip, ix, _bits(xc), out.numpy(), _np(scale), None)
        ctx.block = block
        ctx.save_for_backward(scale)
        if not with_dst:
            return out.to(torch.bfloat16)
        # the destinations' rows as their own tensor when fewer than the sources (as _SumWithDst)
        nd = block.num_dst
        return out.to(torch.bfloat16), xc[:nd].clone() if nd < block.num_src else xc[:nd]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_dst=None):
        (scale,) = ctx.saved_tensors
        block = ctx.block
        grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = torch.empty(block.num_src, grad_out.shape[1], dtype=torch.float32) if grad_out is not None \
                else torch.zeros(block.num_src, grad_dst.shape[1], dtype=torch.float32)
            if grad_out is not None:
                t_ptr, t_idx, _ = _transpose(block)
                _spmm.spmm_sum_bf16(t_ptr, t_idx, _bits(grad_out.to(torch.bfloat16)), grad_x.numpy(), None,
                                    _np(scale))
            if grad_dst is not None:
                grad_x[:block.num_dst] += grad_dst
        return None, grad_x, None, None, None


def bf16_gather_pays(block, x: torch.Tensor, backend: str = "auto") -> bool:
    """Whether :func:`aggregate_mean_bf16` serves ``block`` and float32 ``x``: native CPU kernels,
    and each source row read at least 4 times on average (the full graph's partitions, not
    sampled blocks), so that rounding every source row once costs less than the bytes saved."""
    return (x.dtype == torch.float32 and _use_native(x, backend)
            and block.num_edges >= 4 * max(int(block.num_src), 1))


def aggregate_mean_bf16(block, x: torch.Tensor, xc: torch.Tensor, *, with_dst: bool = False):
    """bfloat16 [num_dst, F]: the in-neighbour mean of ``xc`` = ``x.to(bfloat16)`` (same shape;
    no gradient is taken through it), summed in float32 and rounded once; gradient to ``x``
    (float32). ``with_dst``: ``(mean, xc[:num_dst])``, the destinations' rounded rows as their
    own tensor whose gradient also goes to ``x``, in the same buffer (a layer with halo rows
    reads both). Native CPU kernels only (see :func:`bf16_gather_pays`)."""
    _check_rows(block, x, "aggregate_mean_bf16")
    if xc.dtype != torch.bfloat16 or xc.shape != x.shape:
        raise ValueError(f"aggregate_mean_bf16: xc must be x's shape {tuple(x.shape)} in bfloat16, "
                         f"got {tuple(xc.shape)} {xc.dtype}")
    return _SpmmMeanBf16.apply(block, x, xc.detach(), mean_scale(block, torch.float32), with_dst)


# ---- timing ----------------------------------------------------------------------------------

def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn()`` (micro-benchmarks)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
