"""Models and propagation of the tensor-parallel engine (NeutronTP, :mod:`hpcgnn.engine.tensor`).

**Decoupled models** ("predict then propagate", APPNP/SGC form, NeutronTP eqs. 7-9):
``H = MLP(X)`` on vertex rows (dropout on the input and after every hidden ReLU), then ``k``
rounds of linear propagation

    Z_0 = H,    Z_k = gamma (1 - alpha) A Z_(k-1) + alpha Z_0

with ``A`` one of (``model.arch``):

* ``gcn``:  ``D~^-1/2 (A + I) D~^-1/2`` (GCN's symmetric normalisation with self loops, full-graph
  degrees, :func:`hpcgnn.nn.conv.gcn_norm`);
* ``sage``: ``D~^-1 (A + I)`` (mean over the in-neighbours and the vertex itself);
* ``gat``:  attention, **precomputed before aggregation** from the MLP output: one head,
  ``a_uv = softmax_u(LeakyReLU(a_src . h_u + a_dst . h_v))`` over ``N(v) + {v}`` (GAT's score is
  separable, so each rank computes the two scalars of its own vertices and an allgather of
  ``2 V`` scalars lets every rank compute ``a`` for all edges; the attention vectors are
  trained, their gradient comes back by the adjoint, a reduce of ``2 V`` partial sums). The
  same ``a`` serves all ``k`` rounds (NeutronTP section 4.1.1; a restricted GAT).

**Coupled model** (``tensor.mode = "coupled"``, for comparison): a plain GCN/SAGE stack, one
aggregation with ``A`` per layer between the linear maps (applied before the aggregation when
they shrink the width, as :class:`hpcgnn.nn.conv.GCNConv`), so a split and a gather surround every
layer. With ``model.arch = "gcn"`` it is Kipf & Welling's GCN.

:class:`Propagation` holds ``A`` as a CSR over destinations with explicit self loops and its
transpose(s), and applies it to row ranges (chunks) with the native kernels
(:mod:`hpcgnn.native` ``spmm_sum`` / ``sddmm_heads``): forward gathers along the CSR, backward
along the transpose, no atomics, results independent of the thread count.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from hpcgnn.ids import unique_ids
from hpcgnn.native import spmm as _spmm
from hpcgnn.nn.dropout import Dropout
from hpcgnn.nn.precision import Linear

PROPAGATIONS = {"gcn": "gcn", "sage": "mean", "gat": "attention"}


def with_self_loops(indptr: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CSR with each row's own vertex appended after its in-edges (int64)."""
    v = int(indptr.shape[0] - 1)
    new_indptr = indptr.astype(np.int64) + np.arange(v + 1, dtype=np.int64)
    new_indices = np.empty(int(indices.shape[0]) + v, dtype=np.int64)
    self_pos = new_indptr[1:] - 1
    keep = np.ones(new_indices.shape[0], dtype=bool)
    keep[self_pos] = False
    new_indices[keep] = indices
    new_indices[self_pos] = np.arange(v, dtype=np.int64)
    return new_indptr, new_indices


WEIGHT_SLICE = 1 << 20   # edges per slice of Propagation's float64 weight computation


def _row_slices(indptr: np.ndarray, per: int) -> list[tuple[int, int]]:
    """Consecutive row ranges ``(a, b)`` covering all rows, each of at most ``per`` edges plus
    those of its first row."""
    v = int(indptr.shape[0] - 1)
    cuts = np.searchsorted(indptr, np.arange(per, int(indptr[-1]), per, dtype=np.int64), side="right") - 1
    bounds = np.unique(np.concatenate(([0], cuts, [v])).astype(np.int64))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


class Propagation:
    """``A`` of one graph (see the module docstring) as a self-loop CSR over destinations.

    ``kind``: ``"gcn"``, ``"mean"`` (fixed edge weights) or ``"attention"`` (weights given per
    call). ``chunk_bounds`` [n+1]: destination ranges; with more than one chunk every chunk also
    gets its own transpose (sources ``N_j``) for the chunked backward. Memory: about
    ``(E + V) * (3 int64 + 1 float)`` plus, chunked, ``sum |N_j|`` more int64.
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, kind: str, chunk_bounds=None,
                 dtype=torch.float32, backend: str = "auto", deterministic: bool = False):
        from hpcgnn.sampling.block import Block

        if kind not in ("gcn", "mean", "attention"):
            raise ValueError(f"Propagation: kind must be gcn, mean or attention, got {kind!r}")
        v = int(indptr.shape[0] - 1)
        self.num_nodes, self.kind, self.dtype = v, kind, dtype
        # the attention operators' kernels (hpcgnn.nn.aggregate: backend, deterministic)
        self.backend, self.deterministic = backend, bool(deterministic)
        deg = np.diff(indptr).astype(np.float64)
        ip, ix = with_self_loops(indptr, indices)
        self.indptr, self.indices = ip, ix
        rows = np.diff(ip)
        self.weight = None
        if kind in ("gcn", "mean"):
            # computed in float64 and rounded to ``dtype`` slice by slice of rows (about
            # WEIGHT_SLICE edges each, see _row_slices): the float64 temporaries stay bounded
            s = 1.0 / np.sqrt(deg + 1.0) if kind == "gcn" else 1.0 / (deg + 1.0)
            self.weight = torch.empty(int(ix.shape[0]), dtype=dtype)
            for a, b in _row_slices(ip, WEIGHT_SLICE):
                e0, e1 = int(ip[a]), int(ip[b])
                w = np.repeat(s[a:b], rows[a:b])
                if kind == "gcn":
                    w *= s[ix[e0:e1]]
                self.weight[e0:e1] = torch.from_numpy(w)
        self.block = Block(v, v, torch.from_numpy(ip), torch.from_numpy(ix))
        cb = np.asarray(chunk_bounds if chunk_bounds is not None else [0, v], dtype=np.int64)
        self.chunk_bounds = cb
        self._chunks: dict[int, tuple] = {}

    @property
    def num_edges(self) -> int:
        """Edges including the self loops."""
        return int(self.indices.shape[0])

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_bounds.shape[0] - 1)

    def edge_range(self, a: int, b: int) -> tuple[int, int]:
        return int(self.indptr[a]), int(self.indptr[b])

    def _rows_csr(self, a: int, b: int):
        e0, e1 = self.edge_range(a, b)
        ip = self.indptr[a:b + 1] - e0 if (a, b) != (0, self.num_nodes) else self.indptr
        return ip, self.indices[e0:e1], e0, e1

    def chunk_transpose(self, j: int):
        """(sources N_j as a tensor, t_indptr, t_indices, t_eid) of chunk ``j`` (cached)."""
        if j not in self._chunks:
            a, b = int(self.chunk_bounds[j]), int(self.chunk_bounds[j + 1])
            ip, ix, _, _ = self._rows_csr(a, b)
            src, local = unique_ids(ix, self.num_nodes, return_inverse=True)
            t = _spmm.csr_transpose(ip, local.astype(np.int64), int(src.shape[0]))
            self._chunks[j] = (torch.from_numpy(src.astype(np.int64)), *t)
        return self._chunks[j]

    def _w(self, weight):
        w = self.weight if weight is None else weight
        if w is None:
            raise ValueError("Propagation: attention propagation needs edge weights")
        return w.detach().to(self.dtype).contiguous()

    def forward_rows(self, a: int, b: int, x: torch.Tensor, out: torch.Tensor, weight=None) -> None:
        """``out[:] = A[a:b, :] x`` (out: a contiguous [b - a, w] tensor, x: [V, w])."""
        if x.shape[1] == 0 or b <= a:
            return
        ip, ix, e0, e1 = self._rows_csr(a, b)
        w = self._w(weight)[e0:e1]
        _spmm.spmm_sum(ip, ix, x.detach().contiguous().numpy(), out.numpy(), w.numpy(), None, None)

    def backward_rows(self, j: int, g_rows: torch.Tensor, out: torch.Tensor, weight=None) -> None:
        """``out += A[V_j, :]^T g_rows``: chunk ``j``'s destination rows ``g_rows`` [|V_j|, w]
        scattered to their sources (``out``: [V, w]; one chunk: the full transpose)."""
        if g_rows.shape[1] == 0:
            return
        w = self._w(weight)
        g_np = g_rows.detach().contiguous().numpy()
        if self.num_chunks == 1:
            t_ptr, t_idx, t_eid = self.block.transpose()
            tmp = torch.empty_like(out)
            _spmm.spmm_sum(t_ptr.numpy(), t_idx.numpy(), g_np, tmp.numpy(), w.numpy(), t_eid.numpy(), None)
            out.add_(tmp)
            return
        a, b = int(self.chunk_bounds[j]), int(self.chunk_bounds[j + 1])
        e0, e1 = self.edge_range(a, b)
        src, t_ptr, t_idx, t_eid = self.chunk_transpose(j)
        tmp = g_rows.new_empty((int(src.shape[0]), g_rows.shape[1]))
        _spmm.spmm_sum(t_ptr, t_idx, g_np, tmp.numpy(), w[e0:e1].contiguous().numpy(), t_eid, None)
        out.index_add_(0, src, tmp)

    def edge_grad_rows(self, a: int, b: int, g_rows: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[e] += g_rows[v - a] . x[u]`` for the edges ``e = (u -> v)`` of rows ``[a, b)``
        (``out``: [E + V], the gradient of the edge weights of ``A x``)."""
        if g_rows.shape[1] == 0 or b <= a:
            return
        ip, ix, e0, e1 = self._rows_csr(a, b)
        f = int(g_rows.shape[1])
        tmp = g_rows.new_empty((e1 - e0, 1))
        _spmm.sddmm_heads(ip, ix, g_rows.detach().contiguous().numpy().reshape(b - a, 1, f),
                          x.detach().contiguous().numpy().reshape(-1, 1, f), tmp.numpy(), None)
        out[e0:e1].add_(tmp.view(-1))

    def attention(self, el: torch.Tensor, er: torch.Tensor, negative_slope: float = 0.2) -> torch.Tensor:
        """Edge weights [E + V] ``softmax_u(LeakyReLU(el[u] + er[v]))`` over each destination's
        in-edges and itself (autograd through both scalars; el, er: [V])."""
        from hpcgnn.nn.aggregate import kernel_options
        from hpcgnn.nn.aggregate_gat import edge_softmax, gat_edge_logits

        kernels = kernel_options(self)
        logits = gat_edge_logits(self.block, el.unsqueeze(1), er.unsqueeze(1), negative_slope, **kernels)
        return edge_softmax(self.block, logits, **kernels).squeeze(1)

    def dense(self, weight=None) -> torch.Tensor:
        """``A`` as a dense [V, V] float64 matrix (tests, small graphs)."""
        w = self._w(weight).double()
        dst = torch.repeat_interleave(torch.arange(self.num_nodes), torch.from_numpy(np.diff(self.indptr)))
        out = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.float64)
        out.index_put_((dst, torch.from_numpy(self.indices)), w, accumulate=True)
        return out


# ---- device-generic chunk operators (the staged path, :class:`hpcgnn.engine.tensor_staging.DeviceStage`) ----
def _native(t: torch.Tensor, backend: str) -> bool:
    from hpcgnn.nn.aggregate import _use_native

    return _use_native(t, backend)


def sum_adjoint(block, g: torch.Tensor, weight: torch.Tensor | None = None, *, backend: str = "auto",
                deterministic: bool = False) -> torch.Tensor:
    """``A^T g``: [num_src, d] from destination rows ``g`` [num_dst, d] of the weighted block
    ``A`` (``weight`` [nnz] or None = 1), the adjoint of
    :func:`hpcgnn.nn.aggregate.aggregate_sum` (no autograd graph). CPU float32/float64: the
    native kernel over the block's cached transpose; any other device (CUDA) or
    ``backend = "torch"``: one CSR SpMM with the block's cached transposed CSR (values
    ``weight[t_eid]``), extra memory O(nnz) (:func:`hpcgnn.nn.aggregate.csr_spmm`)."""
    g = g.detach().contiguous()
    w = None if weight is None else weight.detach().to(g.dtype).contiguous()
    if _native(g, backend):
        t_ptr, t_idx, t_eid = block.transpose()
        out = g.new_empty((block.num_src, g.shape[1]))
        _spmm.spmm_sum(t_ptr.numpy(), t_idx.numpy(), g.numpy(), out.numpy(),
                       None if w is None else w.numpy(), None if w is None else t_eid.numpy(), None)
        return out
    from hpcgnn.nn.aggregate import csr_spmm

    return csr_spmm(block, g, w, transpose=True, deterministic=deterministic)


def edge_dot(block, g: torch.Tensor, x: torch.Tensor, *, backend: str = "auto",
             deterministic: bool = False) -> torch.Tensor:
    """[nnz]: ``g[dst_e] . x[src_e]`` per edge ``e`` of ``block`` (the gradient of the edge
    weights of ``aggregate_sum(block, x, w)`` for the output gradient ``g``). CPU: the native
    SDDMM kernel; any other device or ``backend = "torch"``: torch's sampled dense-dense
    product on the block's pattern (:func:`hpcgnn.nn.aggregate.csr_sddmm`), extra memory
    O(nnz), no ``[nnz, d]`` per-edge rows."""
    g, x = g.detach().contiguous(), x.detach().contiguous()
    nnz, f = block.num_edges, int(g.shape[1])
    if _native(g, backend):
        out = g.new_empty((nnz, 1))
        _spmm.sddmm_heads(block.indptr.numpy(), block.indices.numpy(), g.numpy().reshape(-1, 1, f),
                          x.numpy().reshape(-1, 1, f), out.numpy(), None)
        return out.view(-1)
    from hpcgnn.nn.aggregate import csr_sddmm

    return csr_sddmm(block, g, x, deterministic)


class DecoupledModel(nn.Module):
    """MLP ``in_dim -> hidden ... -> num_classes`` (``layers`` linear maps; dropout on the input
    and after every hidden ReLU) and, for attention, the vectors ``attn_src`` / ``attn_dst``.
    The maps are :class:`hpcgnn.nn.precision.Linear` (``train.precision``; the attention scores
    stay float32)."""

    def __init__(self, in_dim: int, hidden: int, num_classes: int, layers: int, dropout: float,
                 attention: bool = False):
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [num_classes]
        self.lins = nn.ModuleList([Linear(a, b) for a, b in zip(dims[:-1], dims[1:])])
        self.dropout = Dropout(dropout)
        self.out_dim = num_classes
        if attention:
            bound = math.sqrt(6.0 / (num_classes + 1))
            self.attn_src = nn.Parameter(torch.empty(num_classes).uniform_(-bound, bound))
            self.attn_dst = nn.Parameter(torch.empty(num_classes).uniform_(-bound, bound))
        else:
            self.attn_src = self.attn_dst = None

    @property
    def num_layers(self) -> int:
        return len(self.lins)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The NN stage on vertex rows: [n, in_dim] -> [n, num_classes]."""
        h = self.dropout(x)
        for l, lin in enumerate(self.lins):
            h = lin(h)
            if l < len(self.lins) - 1:
                h = self.dropout.forward_relu(h)
        return h

    def scores(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(el, er) [n]: the separable attention scores of rows ``h``."""
        return h @ self.attn_src, h @ self.attn_dst


class CoupledModel(nn.Module):
    """GCN/SAGE-style stack for coupled tensor parallelism: layer ``l`` is ``pre(l, h)`` (the
    linear map when it shrinks the width), one aggregation by the engine, ``post(l, agg)`` (the
    linear map otherwise, the bias, ReLU + dropout except after the last layer). The maps are
    :class:`hpcgnn.nn.precision.Linear` (``train.precision``)."""

    def __init__(self, in_dim: int, hidden: int, num_classes: int, layers: int, dropout: float):
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [num_classes]
        self.lins = nn.ModuleList([Linear(a, b, bias=False) for a, b in zip(dims[:-1], dims[1:])])
        self.biases = nn.ParameterList([nn.Parameter(torch.zeros(b)) for b in dims[1:]])
        self.dropout = Dropout(dropout)
        self.dims = dims
        self.out_dim = num_classes

    @property
    def num_layers(self) -> int:
        return len(self.lins)

    def project_first(self, l: int) -> bool:
        return self.dims[l + 1] < self.dims[l]

    def width(self, l: int) -> int:
        """Width of layer ``l``'s aggregation."""
        return self.dims[l + 1] if self.project_first(l) else self.dims[l]

    def pre(self, l: int, h: torch.Tensor) -> torch.Tensor:
        if l == 0:
            h = self.dropout(h)
        return self.lins[l](h) if self.project_first(l) else h

    def post(self, l: int, agg: torch.Tensor) -> torch.Tensor:
        out = agg if self.project_first(l) else self.lins[l](agg)
        out = out + self.biases[l]
        if l < len(self.lins) - 1:
            out = self.dropout.forward_relu(out)
        return out
