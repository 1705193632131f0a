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
"""
from __future__ import annotations

import contextlib
import mmap
import time
import warnings

import torch

from hpcgnn.native import spmm as _spmm
from hpcgnn.nn.dropout import dropout

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


# ---- GAT building blocks -------------------------------------------------------------------

class _EdgeLogits(torch.autograd.Function):
    """s[e, h] = LeakyReLU(el[src_e, h] + er[dst_e, h])."""

    @staticmethod
    def forward(ctx, block, el, er, slope):
        el, er = el.contiguous(), er.contiguous()
        out = el.new_empty(int(block.indices.shape[0]), el.shape[1])
        ip, ix = _csr(block)
        _spmm.gat_edge_logits(ip, ix, _np(el), _np(er), float(slope), out.numpy())
        ctx.block, ctx.slope = block, float(slope)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (s,) = ctx.saved_tensors
        block = ctx.block
        # LeakyReLU' from the output's sign (slope >= 0: s > 0 exactly when the input is > 0).
        g = torch.where(s > 0, grad, grad * ctx.slope).contiguous()
        grad_el = grad_er = None
        if ctx.needs_input_grad[2]:
            grad_er = g.new_empty(block.num_dst, g.shape[1])
            _spmm.segment_sum(_np(block.indptr), _np(g), grad_er.numpy(), None)
        if ctx.needs_input_grad[1]:
            t_ptr, _, t_eid = _transpose(block)
            grad_el = g.new_empty(block.num_src, g.shape[1])
            _spmm.segment_sum(t_ptr, _np(g), grad_el.numpy(), edge_ids(t_eid))
        return None, grad_el, grad_er, None


class _NodeLogits(torch.autograd.Function):
    """``(el, er) = ((z * a_src).sum(-1), (z[:num_dst] * a_dst).sum(-1))`` with both logits'
    gradient to ``z`` written into one new [num_src, H, D] buffer (autograd would make one for
    ``el``, a zero-filled one for the slice ``z[:num_dst]`` and their sum: two more tensors of
    ``z``'s size alive in a GAT layer's backward)."""

    @staticmethod
    def forward(ctx, z, a_src, a_dst, num_dst):
        el = (z * a_src).sum(-1)
        er = (z[:num_dst] * a_dst).sum(-1)
        ctx.num_dst = num_dst
        ctx.save_for_backward(z, a_src, a_dst)
        return el, er

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_el, g_er):
        z, a_src, a_dst = ctx.saved_tensors
        nd = ctx.num_dst
        g_el = torch.zeros(z.shape[:2], dtype=z.dtype, device=z.device) if g_el is None else g_el
        g_er = torch.zeros((nd, z.shape[1]), dtype=z.dtype, device=z.device) if g_er is None else g_er
        grad_z = grad_src = grad_dst = None
        # the vectors' gradients first, as autograd forms them (their temporaries are gone before
        # z's gradient exists), then z's in one buffer
        if ctx.needs_input_grad[1]:
            grad_src = (g_el.unsqueeze(-1) * z).sum(0, keepdim=True)
        if ctx.needs_input_grad[2]:
            grad_dst = (g_er.unsqueeze(-1) * z[:nd]).sum(0, keepdim=True)
        if ctx.needs_input_grad[0]:
            grad_z = g_el.unsqueeze(-1) * a_src
            grad_z[:nd].addcmul_(g_er.unsqueeze(-1), a_dst)     # no [num_dst, H, D] temporary
        return grad_z, grad_src, grad_dst, None


def gat_node_logits(z: torch.Tensor, attn_src: torch.Tensor, attn_dst: torch.Tensor,
                    num_dst: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GAT's per-vertex attention logits: ``el = (z * attn_src).sum(-1)`` [num_src, H] and
    ``er = (z[:num_dst] * attn_dst).sum(-1)`` [num_dst, H] for z [num_src, H, D] and
    attn_src / attn_dst [1, H, D] (the destinations are the first sources). Same values as the
    two expressions; with a gradient, backward builds z's in one buffer."""
    if not torch.is_grad_enabled() or not (z.requires_grad or attn_src.requires_grad or attn_dst.requires_grad):
        return (z * attn_src).sum(-1), (z[:num_dst] * attn_dst).sum(-1)
    return _NodeLogits.apply(z, attn_src, attn_dst, int(num_dst))


def gat_edge_logits(block, el: torch.Tensor, er: torch.Tensor, negative_slope: float = 0.2, *,
                    backend: str = "auto", deterministic: bool = False) -> torch.Tensor:
    """[nnz, H] attention logits ``LeakyReLU(el[src] + er[dst])``; el [num_src, H], er [num_dst, H]."""
    _check_rows(block, el, "gat_edge_logits")
    if negative_slope < 0:
        raise ValueError(f"negative_slope must be >= 0, got {negative_slope}")
    if _use_native(el, backend):
        return _EdgeLogits.apply(block, el, er.to(el.dtype), negative_slope)
    return _EdgeLogitsTorch.apply(block, el, er.to(el.dtype), negative_slope, bool(deterministic))


class _EdgeLogitsTorch(torch.autograd.Function):
    """:class:`_EdgeLogits` on the torch path: [nnz, H] gathers forward; backward sums the
    edge gradients per destination (CSR segments) and per source (the cached transpose's
    segments), no atomics. Memory O(nnz H)."""

    @staticmethod
    def forward(ctx, block, el, er, slope, deterministic):
        ip, ix = _device_csr(block, el.device)
        with _det_scope(deterministic):
            pre = el.index_select(0, ix) + er.index_select(0, _edge_dst(block).to(el.device))
            out = torch.nn.functional.leaky_relu(pre, slope)
        ctx.block, ctx.slope, ctx.deterministic = block, float(slope), deterministic
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (s,) = ctx.saved_tensors
        block = ctx.block
        g = torch.where(s > 0, grad, grad * ctx.slope)
        grad_el = grad_er = None
        det = ctx.deterministic
        if ctx.needs_input_grad[2]:
            grad_er = segment_sum(_device_csr(block, g.device)[0], g, block.num_dst, det)
        if ctx.needs_input_grad[1]:
            t_ptr, _, t_eid = _device_csr(block, g.device, transpose=True)
            grad_el = segment_sum(t_ptr, g.index_select(0, edge_ids(t_eid)), block.num_src, det)
        return None, grad_el, grad_er, None, None


class _EdgeSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, logits):
        logits = logits.contiguous()
        alpha = torch.empty_like(logits)
        _spmm.edge_softmax(_np(block.indptr), _np(logits), alpha.numpy(), None, None)
        ctx.block = block
        ctx.save_for_backward(alpha)
        return alpha

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (alpha,) = ctx.saved_tensors
        out = torch.empty_like(alpha)
        _spmm.edge_softmax_backward(_np(ctx.block.indptr), _np(alpha), _np(grad), out.numpy(), None, None, None)
        return None, out


class _EdgeSoftmaxSelf(torch.autograd.Function):
    """Softmax over each destination's in-edges plus one self edge (logit self_logits[v])."""

    @staticmethod
    def forward(ctx, block, logits, self_logits):
        logits, self_logits = logits.contiguous(), self_logits.contiguous()
        alpha, self_alpha = torch.empty_like(logits), torch.empty_like(self_logits)
        _spmm.edge_softmax(_np(block.indptr), _np(logits), alpha.numpy(), _np(self_logits), self_alpha.numpy())
        ctx.block = block
        ctx.save_for_backward(alpha, self_alpha)
        return alpha, self_alpha

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, self_grad):
        alpha, self_alpha = ctx.saved_tensors
        grad = torch.zeros_like(alpha) if grad is None else grad
        self_grad = torch.zeros_like(self_alpha) if self_grad is None else self_grad
        out, self_out = torch.empty_like(alpha), torch.empty_like(self_alpha)
        _spmm.edge_softmax_backward(_np(ctx.block.indptr), _np(alpha), _np(grad), out.numpy(),
                                    _np(self_alpha), _np(self_grad), self_out.numpy())
        return None, out, self_out


class _EdgeSoftmaxTorch(torch.autograd.Function):
    """Edge softmax on the torch path (optionally with one self edge per destination, logit
    ``self_logits[v]``): per-destination max and sums by CSR segment reductions, no atomics.
    Memory O(nnz H)."""

    @staticmethod
    def forward(ctx, block, logits, self_logits, deterministic):
        ip, _ = _device_csr(block, logits.device)
        dst = _edge_dst(block).to(logits.device)
        nd = block.num_dst
        with _det_scope(deterministic):
            if logits.shape[0]:
                m = torch.segment_reduce(logits, "max", offsets=ip, axis=0)
            else:
                m = logits.new_full((nd, logits.shape[1]), float("-inf"))
            if self_logits is not None:
                m = torch.maximum(m, self_logits)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp(logits - m.index_select(0, dst))
            s = segment_sum(ip, p, nd, deterministic)
            self_alpha = None
            if self_logits is not None:
                p_self = torch.exp(self_logits - m)
                s = s + p_self
                self_alpha = p_self / s
            alpha = p / s.index_select(0, dst)
        ctx.block, ctx.deterministic = block, deterministic
        ctx.save_for_backward(alpha, self_alpha)
        return alpha if self_alpha is None else (alpha, self_alpha)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, self_grad=None):
        alpha, self_alpha = ctx.saved_tensors
        block = ctx.block
        grad = torch.zeros_like(alpha) if grad is None else grad
        ip, _ = _device_csr(block, alpha.device)
        dot = segment_sum(ip, alpha * grad, block.num_dst, ctx.deterministic)
        grad_self = None
        if self_alpha is not None:
            self_grad = torch.zeros_like(self_alpha) if self_grad is None else self_grad
            dot = dot + self_alpha * self_grad
            grad_self = self_alpha * (self_grad - dot)
        out = alpha * (grad - dot.index_select(0, _edge_dst(block).to(alpha.device)))
        return None, out, grad_self, None


def edge_softmax(block, logits: torch.Tensor, self_logits: torch.Tensor | None = None, *,
                 backend: str = "auto", deterministic: bool = False):
    """Softmax of ``logits`` [nnz, H] over the in-edges of each destination.

    With ``self_logits`` [num_dst, H] every destination also has a self edge in the
    softmax; returns ``(alpha [nnz, H], self_alpha [num_dst, H])`` then, else ``alpha``.
    """
    if _use_native(logits, backend):
        if self_logits is None:
            return _EdgeSoftmax.apply(block, logits)
        return _EdgeSoftmaxSelf.apply(block, logits, self_logits.to(logits.dtype))
    return _EdgeSoftmaxTorch.apply(block, logits, None if self_logits is None else self_logits.to(logits.dtype),
                                   bool(deterministic))


class _SpmmHeads(torch.autograd.Function):
    """out[v, h] = sum_e alpha[e, h] z[src_e, h] (+ self_alpha[v, h] z[v, h])."""

    @staticmethod
    def forward(ctx, block, alpha, z, self_alpha):
        alpha, z = alpha.contiguous(), z.contiguous()
        self_alpha = None if self_alpha is None else self_alpha.contiguous()
        out = z.new_empty(block.num_dst, z.shape[1], z.shape[2])
        ip, ix = _csr(block)
        _spmm.spmm_heads(ip, ix, _np(alpha), _np(z), out.numpy(), None, _np(self_alpha))
        ctx.block = block
        ctx.save_for_backward(alpha, z, self_alpha)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        alpha, z, self_alpha = ctx.saved_tensors
        block = ctx.block
        g = grad.contiguous()
        grad_alpha = grad_z = grad_self = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
            grad_alpha = alpha.new_empty(alpha.shape)
            grad_self = None if self_alpha is None else self_alpha.new_empty(self_alpha.shape)
            ip, ix = _csr(block)
            _spmm.sddmm_heads(ip, ix, _np(g), _np(z), grad_alpha.numpy(), _np(grad_self))
        if ctx.needs_input_grad[2]:
            t_ptr, t_idx, t_eid = _transpose(block)
            grad_z = z.new_empty(z.shape)
            # transposed rows are sources; the self term of source row u < num_dst reads g[u]
            _spmm.spmm_heads(t_ptr, t_idx, _np(alpha), _np(g), grad_z.numpy(), edge_ids(t_eid), _np(self_alpha))
        return None, grad_alpha, grad_z, grad_self


def aggregate_heads(block, alpha: torch.Tensor, z: torch.Tensor, self_alpha: torch.Tensor | None = None, *,
                    backend: str = "auto", deterministic: bool = False) -> torch.Tensor:
    """``out[v, h] = sum_{e=(u->v)} alpha[e, h] * z[u, h]`` (+ ``self_alpha[v, h] * z[v, h]``).

    alpha [nnz, H], z [num_src, H, D], self_alpha [num_dst, H] or None. Returns [num_dst, H, D].
    """
    _check_rows(block, z, "aggregate_heads")
    nd = block.num_dst
    if z.dim() != 3 or alpha.shape != (block.indices.shape[0], z.shape[1]) or (
            self_alpha is not None and self_alpha.shape != (nd, z.shape[1])):
        raise ValueError(f"aggregate_heads: expected alpha [nnz, H], z [num_src, H, D], self_alpha [num_dst, H]; "
                         f"got {tuple(alpha.shape)}, {tuple(z.shape)}, "
                         f"{None if self_alpha is None else tuple(self_alpha.shape)}")
    if _use_native(z, backend):
        return _SpmmHeads.apply(block, alpha.to(z.dtype), z, None if self_alpha is None else self_alpha.to(z.dtype))
    return _HeadsTorch.apply(block, alpha.to(z.dtype), z, None if self_alpha is None else self_alpha.to(z.dtype),
                             bool(deterministic))


class _HeadsTorch(torch.autograd.Function):
    """:class:`_SpmmHeads` on the torch path: per head ``h`` one CSR SpMM with values
    ``alpha[:, h]`` (backward: one on the transpose, and an SDDMM for the gradient of alpha).
    Extra memory O(nnz H + V D) (one head's rows at a time), not O(nnz H D)."""

    @staticmethod
    def forward(ctx, block, alpha, z, self_alpha, deterministic):
        nd, heads = block.num_dst, z.shape[1]
        out = torch.stack([csr_spmm(block, z[:, h], alpha[:, h], deterministic=deterministic)
                           for h in range(heads)], 1)
        if self_alpha is not None:
            out.add_(self_alpha.unsqueeze(2) * z[:nd])
        ctx.block, ctx.deterministic = block, deterministic
        ctx.save_for_backward(alpha, z, self_alpha)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        alpha, z, self_alpha = ctx.saved_tensors
        block = ctx.block
        nd, heads, det = block.num_dst, z.shape[1], ctx.deterministic
        grad_alpha = grad_z = grad_self = None
        if ctx.needs_input_grad[1]:
            grad_alpha = torch.stack([csr_sddmm(block, grad[:, h], z[:, h], det) for h in range(heads)], 1)
        if ctx.needs_input_grad[3] and self_alpha is not None:
            grad_self = (grad * z[:nd]).sum(2)
        if ctx.needs_input_grad[2]:
            grad_z = torch.stack([csr_spmm(block, grad[:, h], alpha[:, h], transpose=True, deterministic=det)
                                  for h in range(heads)], 1)
            if self_alpha is not None:
                grad_z[:nd].add_(self_alpha.unsqueeze(2) * grad)
        return None, grad_alpha, grad_z, grad_self, None


def gat_aggregate(block, z: torch.Tensor, logits_src: torch.Tensor, logits_dst: torch.Tensor,
                  negative_slope: float = 0.2, *, self_loop: bool = True, attn_dropout: float = 0.0,
                  training: bool = False, backend: str = "auto", deterministic: bool = False) -> torch.Tensor:
    """GAT attention aggregation, [num_dst, H, D].

    ``alpha = EdgeSoftmax(LeakyReLU(logits_src[u] + logits_dst[v]))`` over the in-edges of
    ``v`` (plus the self edge ``v -> v`` when ``self_loop``; destination ``v`` is source row
    ``v``), dropout ``attn_dropout`` on alpha when ``training``, then
    ``out[v] = sum_u alpha_uv z[u]``. z [num_src, H, D], logits_src [num_src, H],
    logits_dst [num_dst, H]. Without a self loop a destination with no in-edges gets 0.
    """
    kernels = dict(backend=backend, deterministic=deterministic)
    logits = gat_edge_logits(block, logits_src, logits_dst, negative_slope, **kernels)
    if self_loop:
        nd = block.num_dst
        self_logits = torch.nn.functional.leaky_relu(logits_src[:nd] + logits_dst, negative_slope)
        alpha, self_alpha = edge_softmax(block, logits, self_logits, **kernels)
    else:
        alpha = edge_softmax(block, logits, **kernels)
    if attn_dropout > 0 and training:
        alpha = dropout(alpha, attn_dropout, True)
        if self_loop:
            self_alpha = dropout(self_alpha, attn_dropout, True)
    return aggregate_heads(block, alpha, z, self_alpha if self_loop else None, **kernels)


# ---- bandwidth measurement -----------------------------------------------------------------

def _random_csr(num_nodes: int, num_edges: int, locality: int | None, seed: int):
    """CSR (rows = destinations) of a random graph; sources uniform, or within +-locality of the row."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.sort(torch.randint(num_nodes, (num_edges,), generator=gen)).values
    if locality:
        src = (dst + torch.randint(-locality, locality + 1, (num_edges,), generator=gen)).clamp_(0, num_nodes - 1)
    else:
        src = torch.randint(num_nodes, (num_edges,), generator=gen)
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0, out=indptr[1:])
    return indptr, src


def _empty_pages(rows: int, cols: int, huge: bool) -> tuple[torch.Tensor, object]:
    """float32 [rows, cols] on anonymous memory advised MADV_HUGEPAGE (``huge``; Linux THP in
    "madvise" or "always" mode) or MADV_NOHUGEPAGE (4 KiB pages whatever torch's allocator
    would do); returns (tensor, owner) and the owner must outlive the tensor."""
    nbytes = max(rows * cols * 4, 4)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        mm.madvise(advice)
    return torch.frombuffer(mm, dtype=torch.float32)[:rows * cols].view(rows, cols), mm


def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn()`` (micro-benchmarks)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(num_nodes: int = 1_000_000, num_edges: int = 10_000_000, dim: int = 128,
                      threads: int = 2, locality: int | None = None, repeats: int = 3,
                      seed: int = 0, hugepages: bool = False) -> dict:
    """Effective bandwidth of the native ``spmm_sum`` vs ``torch.sparse.mm`` (CSR) and a memory copy.

    Graph: ``num_edges`` edges with uniform destinations and uniform sources (``locality``
    None) or sources within ``+-locality`` of the destination. Features float32
    [num_nodes, dim]. Bytes of one SpMM = nnz*dim*4 (gathered rows) + num_nodes*dim*4
    (written) + (nnz + num_nodes + 1)*8 (indices, indptr). Copy bandwidth = 2*bytes/time of
    a ``copy_`` of a float32 tensor of max(64 MiB, X's size), at most 256 MiB (read + write),
    best of max(4 * repeats, 20). The native SpMM's ``repeats`` runs alternate with the copies
    (4 after each), so that both are measured in the same state of a shared machine; its time
    and torch's are the best of ``repeats``. Returns seconds, GB/s (1e9 bytes/s), fractions of the copy bandwidth, and
    the max abs difference between the two SpMM results. Threads are restored afterwards.
    ``hugepages`` puts the features and the output on transparent huge pages (fewer TLB
    misses on the random row gathers), else on 4 KiB pages. hpcgnn's commands run with huge
    pages for torch's large CPU tensors (:func:`hpcgnn.runtime.prefer_huge_pages`).
    """
    if min(num_nodes, num_edges, dim, threads, repeats) < 1:
        raise ValueError("measure_bandwidth: num_nodes, num_edges, dim, threads and repeats must be >= 1")
    old_torch, old_native = torch.get_num_threads(), _spmm.max_threads()
    torch.set_num_threads(threads)
    _spmm.set_threads(threads)
    try:
        indptr, indices = _random_csr(num_nodes, num_edges, locality, seed)
        x, x_owner = _empty_pages(num_nodes, dim, hugepages)
        out, out_owner = _empty_pages(num_nodes, dim, hugepages)
        x.copy_(torch.randn(num_nodes, dim, generator=torch.Generator().manual_seed(seed + 1)))
        ip, ix, xn, on = indptr.numpy(), indices.numpy(), x.numpy(), out.numpy()
        src = torch.empty(min(max(num_nodes * dim, 2**24), 2**26)).fill_(1.0)
        dst = torch.empty_like(src).fill_(0.0)
        # the SpMM and the copy alternate, so that both see the same state of a shared machine
        # (its bandwidth drifts by tens of percent within minutes on a busy VM)
        t_native = t_copy = float("inf")
        for _ in range(repeats):
            t_native = min(t_native, best_time(lambda: _spmm.spmm_sum(ip, ix, xn, on), 1))
            t_copy = min(t_copy, best_time(lambda: dst.copy_(src), 4))  # ~20 ms each: cheap to repeat
        t_copy = min(t_copy, best_time(lambda: dst.copy_(src), max(0, 20 - 4 * repeats)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
            a = torch.sparse_csr_tensor(indptr, indices, torch.ones(num_edges), (num_nodes, num_nodes),
                                        check_invariants=False)
        ref = torch.sparse.mm(a, x)
        t_torch = best_time(lambda: torch.sparse.mm(a, x), repeats)
        max_abs_diff = float((ref - out).abs().max())
        ref = a = None                                     # freed before the last figure
        copy_gbs = 2 * src.numel() * 4 / t_copy / 1e9
    finally:
        torch.set_num_threads(old_torch)
        _spmm.set_threads(old_native)
    nbytes = num_edges * dim * 4 + num_nodes * dim * 4 + (num_edges + num_nodes + 1) * 8
    native_gbs, torch_gbs = nbytes / t_native / 1e9, nbytes / t_torch / 1e9
    return {
        "num_nodes": num_nodes, "num_edges": num_edges, "dim": dim, "threads": threads,
        "locality": locality or 0, "hugepages": bool(hugepages), "bytes": nbytes,
        "native_s": t_native, "native_gbs": native_gbs, "native_frac_copy": native_gbs / copy_gbs,
        "torch_csr_s": t_torch, "torch_csr_gbs": torch_gbs, "torch_frac_copy": torch_gbs / copy_gbs,
        "copy_gbs": copy_gbs, "speedup_vs_torch": t_torch / t_native, "max_abs_diff": max_abs_diff,
    }
