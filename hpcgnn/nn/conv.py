"""GNN layers over a :class:`~hpcgnn.sampling.block.Block`: SAGE (mean), GCN, GAT.

Every layer maps source rows ``h`` [num_src, in_dim] to destination rows. Destinations
are the first ``num_dst`` sources, so ``h[:num_dst]`` is each destination's own input.
Layers do not apply the between-layer activation/dropout: :class:`hpcgnn.nn.models.GNN`
does. Linear maps are applied before the aggregation when they shrink the width
(``out < in``) and after it otherwise, so aggregation runs at the smaller width (both orders
are the same function: aggregation is linear); SAGE aggregates first anyway on a block with
many more sources than destinations (:meth:`SAGEConv.projects_first`).

Layers whose aggregation is linear and parameter-free (SAGE, GCN: ``cacheable``) also expose
the split that host-offloaded training (:mod:`hpcgnn.engine.offload`) caches and recomputes
around: ``forward(block, h) == update(aggregate(block, h), h[:num_dst])``, with
``aggregate_adjoint`` the transpose of ``aggregate``.

Every layer also splits at its projection, which the in-memory full-graph engine exchanges
instead of the layer's input when it is narrower (:attr:`SAGEConv.exchanges_projection`):
``forward(block, h) == forward_from_projection(block, projection(h), h[:num_dst])``, with
``projection`` row-wise, so each rank projects its own rows and sends the result. GCN's
projection is its source rows (the input scaled by the source scale, projected first when
narrower), which it always exchanges: the receiver then holds no scaled copy of all its rows
(:func:`exchanged_width`).

**GCN normalisation** (one definition, :func:`gcn_norm`, used by training, evaluation and
inference): a GCN layer scales by ``(degree + 1)^-1/2`` (the ``+ 1`` is the self loop) the degrees
of the graph the layer runs on: a sampled block's own degrees in minibatch training
(:func:`gcn_block_norm`: source out-degree, destination in-degree in the block, DGL's
``GraphConv(norm="both")`` on a block), and the whole graph's in full-neighbour evaluation,
inference and full-graph training, whose block is the whole graph (the graph is symmetric, so
in- = out-degree = the partition's ``local_degree()``; a destination chunk or a partition is a
piece of that block, not a block of its own). docs/engines.md has the measured alternative.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hpcgnn.nn.aggregate import (aggregate_mean, aggregate_mean_bf16, aggregate_sum, aggregate_sum_adjoint,
                                  aggregate_sum_with_dst, bf16_gather_pays, dst_rows, kernel_options, mean_scale)
from hpcgnn.nn.aggregate_gat import gat_aggregate, gat_node_logits
from hpcgnn.nn.precision import Linear, linear

GAT_VARIANTS = ("distgnn", "standard")


def sage_projects_first(in_dim: int, out_dim: int, num_src: int, num_dst: int, num_edges: int) -> bool:
    """The rule of :meth:`SAGEConv.projects_first` from shapes alone (the memory estimate uses
    it too): project first when that shrinks the width and the extra rows it projects cost less
    than the narrower aggregation saves (see there)."""
    if out_dim >= in_dim:
        return False
    return (num_src - num_dst) * in_dim * out_dim <= 8 * num_edges * (in_dim - out_dim)


def exchanges_projection(in_dim: int, out_dim: int, heads: int = 1) -> bool:
    """Whether a layer's projection (``heads x out_dim`` wide; 1 head for SAGE and GCN) is
    narrower than its input, so that the in-memory full graph exchanges it instead of the input
    (SAGE's and GAT's ``exchanges_projection``; the memory estimate uses it too)."""
    return heads * out_dim < in_dim


def exchanged_width(arch: str, in_dim: int, out_dim: int, heads: int = 1) -> int | None:
    """The width of what a full-graph layer ``l >= 1`` with an exact halo exchanges instead of
    its input (the layers' ``exchanges_projection`` and ``projection``), None when it exchanges
    its input: GCN always its source rows, ``min(in, out)`` wide; SAGE and GAT their
    projection (``heads x out_dim``) when it is narrower (:func:`exchanges_projection`)."""
    if arch == "gcn":
        return min(in_dim, out_dim)
    return heads * out_dim if exchanges_projection(in_dim, out_dim, heads) else None


class _ProjectWithDst(torch.autograd.Function):
    """``(h W^T, h[:num_dst])`` with one gradient buffer for ``h``: backward computes
    ``g_z W`` (``[num_src, in]``, what the projection's own backward makes) and adds the
    destinations' gradient into its first rows in place, where taking ``h[:num_dst]`` apart
    would also fill a zero ``[num_src, in]`` buffer for the slice's gradient (the same sums:
    adding a zero is exact). For a float32 projection without bias (SAGE's ``lin_neigh``)."""

    @staticmethod
    def forward(ctx, h, weight, num_dst):
        ctx.save_for_backward(h, weight)
        ctx.num_dst = int(num_dst)
        return F.linear(h, weight), h[:num_dst]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_z, grad_dst):
        h, weight = ctx.saved_tensors
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            if grad_z is None:
                grad_h = h.new_zeros(h.shape)
            else:
                grad_h = grad_z.mm(weight)
            if grad_dst is not None:
                grad_h[:ctx.num_dst] += grad_dst
        if ctx.needs_input_grad[1] and grad_z is not None:
            grad_w = grad_z.t().mm(h)
        return grad_h, grad_w, None


class _ProjectApart(torch.autograd.Function):
    """``h W^T`` [num_src, out] for source rows ``h`` whose first rows the caller also holds
    apart (``h_dst`` [num_dst, in], the same values, kept by the caller anyway): backward's
    weight gradient is ``g_z[:num_dst]^T h_dst + g_z[num_dst:]^T h[num_dst:]``, so this keeps
    ``h_dst`` and a copy of the other rows, not ``h``: ``[num_dst, in]`` less until backward.
    The input gradient ``g_z W`` is ``h``'s, all rows (``h_dst`` gets its own from the layer's
    self term). For a float32 projection without bias (SAGE's ``lin_neigh``)."""

    @staticmethod
    def forward(ctx, h, h_dst, weight):
        nd = h_dst.shape[0]
        rest = h[nd:].clone() if ctx.needs_input_grad[2] else None
        ctx.save_for_backward(h_dst if ctx.needs_input_grad[2] else None, rest, weight)
        return F.linear(h, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_z):
        h_dst, rest, weight = ctx.saved_tensors
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_h = grad_z.mm(weight)
        if ctx.needs_input_grad[2]:
            nd = h_dst.shape[0]
            grad_w = torch.addmm(grad_z[:nd].t().mm(h_dst), grad_z[nd:].t(), rest)
        return grad_h, None, grad_w


class SAGEConv(nn.Module):
    """GraphSAGE-mean (DistGNN-MB eq. 1 without the activation):
    ``out_v = W_n · mean_{u in N(v)} h_u + W_s · h_v + b``; mean over no neighbours = 0."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, backend: str = "auto",
                 deterministic: bool = False):
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.backend, self.deterministic = backend, deterministic
        self.lin_neigh = Linear(in_dim, out_dim, bias=False)
        self.lin_self = Linear(in_dim, out_dim, bias=bias)

    @property
    def project_first(self) -> bool:
        """Whether ``lin_neigh`` runs before the aggregation (it shrinks the width)."""
        return self.out_dim < self.in_dim

    def source_rows(self, h: torch.Tensor) -> torch.Tensor:
        """What the aggregation reads from source rows ``h``: ``lin_neigh(h)`` when
        :attr:`project_first`, else ``h`` itself. Row-wise, so it may be computed in row chunks."""
        return self.lin_neigh(h) if self.project_first else h

    def combine(self, block, src: torch.Tensor, h_dst: torch.Tensor) -> torch.Tensor:
        """Output rows of ``block``'s destinations from ``src = source_rows(h)`` [num_src, ...]
        and the destinations' own input rows ``h_dst`` [num_dst, in_dim]."""
        return self.update(aggregate_mean(block, src, **kernel_options(self)), h_dst)

    def update(self, neigh: torch.Tensor, h_dst: torch.Tensor, projected: bool | None = None) -> torch.Tensor:
        """Output rows from the neighbour mean ``neigh`` and the destinations' own rows ``h_dst``.

        ``neigh`` is the mean of :meth:`source_rows` (already through ``lin_neigh`` when
        ``projected``, default :attr:`project_first`). Unprojected, ``lin_neigh`` accumulates
        into ``lin_self``'s output inside one GEMM (``addmm``): no separate pass adding two
        [rows, out_dim] tensors. Row-wise, so it may be computed in row chunks."""
        projected = self.project_first if projected is None else projected
        cd = self.lin_self.compute_dtype
        if cd is not None and not projected:
            return self._joint_product(h_dst.to(cd), neigh.to(cd)).to(neigh.dtype)
        out = self.lin_self(h_dst)
        if projected:
            return out + neigh
        return torch.addmm(out, neigh, self.lin_neigh.weight.t())

    def projects_first(self, block) -> bool:
        """Whether :meth:`forward` runs ``lin_neigh`` before the aggregation on ``block``: when
        it shrinks the width (:attr:`project_first`) and projecting the sources that are not
        destinations costs less than the narrower aggregation saves. A GEMM row costs about
        ``in x out`` units and a gathered edge value 4-9 units on the development CPU (75 GFLOPS
        GEMMs against 17-35 GB/s of row gathers; 8 is used), so a sampled block or a partition
        with a large halo aggregates first; it then also keeps destination-sized tensors for
        backward instead of all source rows. A block whose sources are its destinations (one
        rank's full graph) projects first as before."""
        return sage_projects_first(self.in_dim, self.out_dim, block.num_src, block.num_dst, block.num_edges)

    def forward(self, block, h: torch.Tensor, h_dst: torch.Tensor | None = None) -> torch.Tensor:
        """Output rows [num_dst, out_dim] from source rows ``h`` [num_src, in_dim].

        ``h_dst``: the destinations' own rows held apart from ``h`` (the same values as
        ``h[:num_dst]``, e.g. a full-graph layer's rows before their halo exchange). A layer
        that aggregates first then keeps ``h_dst`` for its weight gradient instead of a view
        of ``h``, so ``h`` is freed once aggregated: a whole ``[num_src, in_dim]`` tensor less
        until backward where the caller keeps ``h_dst`` anyway (dropout keeps its output); one
        that projects first keeps ``h_dst`` and a copy of the other rows (:class:`_ProjectApart`):
        ``[num_dst, in_dim]`` less."""
        if self.projects_first(block):
            lin = self.lin_neigh
            if block.num_dst < h.shape[0] and h.dim() == 2 and lin.bias is None and lin.compute_dtype is None \
                    and h.dtype == lin.weight.dtype and torch.is_grad_enabled() \
                    and (h.requires_grad or lin.weight.requires_grad):
                if h_dst is not None and h_dst.shape[0] == block.num_dst:
                    # the caller keeps the destinations' rows: keep them, not all of h
                    return self.combine(block, _ProjectApart.apply(h, h_dst, lin.weight), h_dst)
                # the destinations' own rows are a prefix of h: one gradient buffer for both uses
                src, h_dst = _ProjectWithDst.apply(h, lin.weight, block.num_dst)
                return self.combine(block, src, h_dst)
            return self.combine(block, self.source_rows(h), dst_rows(block, h))
        cd = self.lin_self.compute_dtype
        if cd == torch.bfloat16 and bf16_gather_pays(block, h, self.backend):
            return self._forward_bf16_gather(block, h)
        if h_dst is not None and h_dst.shape[0] == block.num_dst and block.num_dst < h.shape[0]:
            return self.update(aggregate_mean(block, h, **kernel_options(self)), h_dst, projected=False)
        # h is both the aggregated rows and the destinations' own: one gradient buffer for both
        neigh, h_dst = aggregate_sum_with_dst(block, h, row_scale=mean_scale(block, h.dtype), **kernel_options(self))
        return self.update(neigh, h_dst, projected=False)

    def _forward_bf16_gather(self, block, h: torch.Tensor) -> torch.Tensor:
        """The unprojected layer with bfloat16 products whose neighbour mean gathers the rows
        already rounded to bfloat16 for the product (:func:`aggregate_mean_bf16`: half the bytes
        per edge, float32 sums; the mean is rounded once where the float32 path rounds it
        before its product too). One GEMM over ``[h_dst | neigh]`` as in :meth:`update`."""
        # the gather's rounded copy takes no gradient: the mean's autograd function also returns
        # the destinations' rounded rows and adds their gradient into h's in place (no slice of a
        # gradient-carrying copy: no zero-filled gradient of h's shape, no sum of two of them)
        with torch.no_grad():
            hc = h.to(torch.bfloat16)
        neigh, h_dst = aggregate_mean_bf16(block, h, hc, with_dst=True)
        return self._joint_product(h_dst, neigh).to(h.dtype)

    def _joint_product(self, h_dst: torch.Tensor, neigh: torch.Tensor) -> torch.Tensor:
        """``lin_self(h_dst) + lin_neigh(neigh)`` for lower-precision operands (both in the
        compute dtype): one GEMM over ``[h_dst | neigh]`` and ``[W_s | W_n]`` (one rounding pass of
        the weights, no separate sum); the result stays in the compute dtype."""
        cd = h_dst.dtype
        w = torch.cat([self.lin_self.weight, self.lin_neigh.weight], 1).to(cd)
        b = None if self.lin_self.bias is None else self.lin_self.bias.to(cd)
        return F.linear(torch.cat([h_dst, neigh], 1), w, b)

    # ---- the cache split (see the module docstring) ---------------------------------------
    cacheable = True
    update_needs_dst = True   # update reads the destinations' own rows (lin_self)
    edge_weighted = False     # no per-edge weights: backward needs no transpose edge ids

    def aggregate(self, block, h: torch.Tensor) -> torch.Tensor:
        """Parameter-free, linear: the neighbour mean of ``h`` at the input width [num_dst, in_dim]."""
        return aggregate_mean(block, h, **kernel_options(self))

    def update_from_aggregate(self, agg: torch.Tensor, h_dst: torch.Tensor | None) -> torch.Tensor:
        """The rest of the layer: ``forward(block, h) == update_from_aggregate(aggregate(block, h),
        h[:num_dst])``."""
        return self.update(agg, h_dst, projected=False)

    def aggregate_adjoint(self, block, grad_agg: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the source rows of :meth:`aggregate` [num_src, in_dim]."""
        return aggregate_sum_adjoint(block, grad_agg * mean_scale(block, grad_agg.dtype).unsqueeze(1),
                                     **kernel_options(self))

    # ---- the projection split (see the module docstring) -------------------------------------
    @property
    def exchanges_projection(self) -> bool:
        """Whether :meth:`projection` is narrower than the input (``lin_neigh`` shrinks the width):
        a full-graph layer then exchanges that instead of its input."""
        return exchanged_width("sage", self.in_dim, self.out_dim) is not None

    def projection(self, h: torch.Tensor) -> torch.Tensor:
        """``lin_neigh(h)`` [rows, out_dim], row-wise: what the aggregation reads."""
        return self.lin_neigh(h)

    def forward_from_projection(self, block, p: torch.Tensor, h_dst: torch.Tensor) -> torch.Tensor:
        """Output rows [num_dst, out_dim] from the sources' :meth:`projection` ``p`` [num_src,
        out_dim] and the destinations' own input rows ``h_dst`` [num_dst, in_dim]."""
        return self.update(aggregate_mean(block, p, **kernel_options(self)), h_dst, projected=True)


def gcn_norm(degree) -> torch.Tensor:
    """The GCN scale of vertices of ``degree`` (numpy or torch integers) in the graph a layer runs
    on: ``(degree + 1)^-1/2``, float32 (rounded once from float64), on ``degree``'s device. The
    only place the normalisation is computed (see the module docstring)."""
    d = torch.as_tensor(degree).to(torch.float64)
    return (d + 1.0).rsqrt().to(torch.float32)


def gcn_block_norm(block) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's own GCN scales (minibatch training, sampled evaluation): :func:`gcn_norm` of
    every source's out-degree in the block [num_src] and every destination's in-degree
    [num_dst]. On the whole graph's block these are :func:`gcn_norm` of the full degrees."""
    out_deg = torch.bincount(block.indices, minlength=block.num_src)
    return gcn_norm(out_deg), gcn_norm(block.in_degree())


class GCNConv(nn.Module):
    """GCN with self-loop (Kipf & Welling), normalisation supplied by the caller:

    ``out_v = dst_scale[v] * ( sum_{u in N(v)} src_scale[u] h_u + src_scale[v] h_v ) · W + b``

    With ``src_scale = dst_scale = (deg + 1)^-1/2`` of the full graph's degrees this is
    ``D~^-1/2 (A + I) D~^-1/2 H W + b``. ``forward(block, h, src_scale, dst_scale)`` takes the
    scales (float [num_src] / [num_dst], constants) from its arguments, else from optional
    ``block.src_scale`` / ``block.dst_scale`` attributes, else the block's own degrees
    (:func:`gcn_block_norm`, the minibatch engine's training; see the module docstring).
    """

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, backend: str = "auto",
                 deterministic: bool = False):
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.backend, self.deterministic = backend, deterministic
        self.lin = Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None

    def forward(self, block, h: torch.Tensor, src_scale: torch.Tensor | None = None,
                dst_scale: torch.Tensor | None = None) -> torch.Tensor:
        src_scale = src_scale if src_scale is not None else getattr(block, "src_scale", None)
        dst_scale = dst_scale if dst_scale is not None else getattr(block, "dst_scale", None)
        if src_scale is None or dst_scale is None:
            d_src, d_dst = gcn_block_norm(block)
            src_scale = d_src if src_scale is None else src_scale
            dst_scale = d_dst if dst_scale is None else dst_scale
        if tuple(src_scale.shape) != (block.num_src,) or tuple(dst_scale.shape) != (block.num_dst,):
            raise ValueError(f"GCNConv: src_scale/dst_scale must have shapes ({block.num_src},)/"
                             f"({block.num_dst},), got {tuple(src_scale.shape)}/{tuple(dst_scale.shape)}")
        return self._from_source_rows(block, self.source_rows(h, src_scale), dst_scale)

    def _from_source_rows(self, block, y: torch.Tensor, dst_scale: torch.Tensor) -> torch.Tensor:
        dst_scale = dst_scale.detach().to(device=y.device, dtype=y.dtype)
        # y is both the aggregated rows and the self loop's: one gradient buffer for both
        agg, y_dst = aggregate_sum_with_dst(block, y, row_scale=dst_scale, **kernel_options(self))
        # the self loop added into the aggregate in place: y_dst is not kept for backward (its
        # factor is a constant), so neither it nor a third [num_dst, w] tensor outlives this line
        out = agg.addcmul_(y_dst, dst_scale.unsqueeze(1))
        del agg, y_dst
        return self._update(out)

    @property
    def project_first(self) -> bool:
        """Whether ``lin`` runs before the aggregation (it shrinks the width)."""
        return self.out_dim < self.in_dim

    def source_rows(self, h: torch.Tensor, src_scale: torch.Tensor) -> torch.Tensor:
        """``y = (lin(h) if project_first else h) * src_scale`` [num_src, width]: what the
        aggregation (and the self loop) reads. Row-wise, so it may be computed in row chunks."""
        if self.project_first:
            h = self.lin(h)
        return h * src_scale.detach().to(device=h.device, dtype=h.dtype).unsqueeze(1)

    def combine(self, block, y: torch.Tensor, y_dst: torch.Tensor, dst_scale: torch.Tensor) -> torch.Tensor:
        """Output rows of ``block``'s destinations from ``y = source_rows(h, src_scale)``, the
        destinations' own rows of ``y`` (``y_dst``, the self loop) and ``dst_scale`` [num_dst]."""
        dst_scale = dst_scale.detach().to(device=y.device, dtype=y.dtype)
        agg = aggregate_sum(block, y, row_scale=dst_scale, **kernel_options(self))
        return self._update(agg.addcmul_(y_dst, dst_scale.unsqueeze(1)))

    def _update(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output from ``out`` = the scaled neighbour sum plus the self loop (a
        tensor of the layer's own, which nothing else reads: the bias goes into it in place
        when the product came first; else the product and the bias are one GEMM)."""
        if not self.project_first:
            return linear(self.lin, out, self.bias)
        return out if self.bias is None else out.add_(self.bias)

    # ---- the cache split (see the module docstring) ---------------------------------------
    cacheable = True
    update_needs_dst = False
    edge_weighted = False     # the scales are per vertex: backward needs no transpose edge ids

    def aggregate(self, block, h: torch.Tensor, src_scale: torch.Tensor, dst_scale: torch.Tensor) -> torch.Tensor:
        """Parameter-free, linear: ``dst_scale * (sum_u src_scale[u] h_u + src_scale[v] h_v)`` at the
        input width [num_dst, in_dim]."""
        s_src = src_scale.to(h.dtype).unsqueeze(1)
        s_dst = dst_scale.to(h.dtype)
        y = h * s_src
        agg = aggregate_sum(block, y, row_scale=s_dst, **kernel_options(self))
        return agg.addcmul_(dst_rows(block, y), s_dst.unsqueeze(1))     # no [num_dst, in_dim] temporaries

    def update_from_aggregate(self, agg: torch.Tensor, h_dst: torch.Tensor | None = None) -> torch.Tensor:
        """``lin(agg) + bias``: ``forward(block, h, s, d) == update_from_aggregate(aggregate(block, h, s, d))``."""
        out = self.lin(agg)
        return out if self.bias is None else out + self.bias

    def aggregate_adjoint(self, block, grad_agg: torch.Tensor, src_scale: torch.Tensor,
                          dst_scale: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the source rows of :meth:`aggregate` [num_src, in_dim]."""
        g = grad_agg * dst_scale.to(grad_agg.dtype).unsqueeze(1)
        gx = aggregate_sum_adjoint(block, g, **kernel_options(self))
        gx[:block.num_dst] += g
        return gx * src_scale.to(grad_agg.dtype).unsqueeze(1)

    # ---- the projection split (see the module docstring) -------------------------------------
    @property
    def exchanges_projection(self) -> bool:
        """Always: :meth:`projection` (the source rows) is no wider than the input, and a
        full-graph layer that exchanges it instead holds no scaled copy of all its rows."""
        return exchanged_width("gcn", self.in_dim, self.out_dim) is not None

    def projection(self, h: torch.Tensor, src_scale: torch.Tensor) -> torch.Tensor:
        """:meth:`source_rows` of ``h`` with ``src_scale`` [rows] of the same rows."""
        return self.source_rows(h, src_scale)

    def forward_from_projection(self, block, y: torch.Tensor, src_scale: torch.Tensor | None = None,
                                dst_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Output rows [num_dst, out_dim] from the sources' :meth:`projection` ``y`` [num_src,
        out_dim] (``src_scale`` was applied there; ``dst_scale`` [num_dst] as in :meth:`forward`)."""
        if dst_scale is None:
            raise ValueError("GCNConv.forward_from_projection: dst_scale is required")
        return self._from_source_rows(block, y, dst_scale)


class GATConv(nn.Module):
    """Multi-head graph attention; returns [num_dst, heads, out_dim].

    variant ``"distgnn"`` (DistGNN-MB eq. 2): ``z = ReLU(W h + b)`` (ReLU only when
    ``project_activation``; the model turns it off in the last layer so logits can be
    negative), attention on z, ``out_v = sum_u alpha_uv z_u``; no output bias.
    variant ``"standard"`` (Velickovic et al., DGL GATConv): ``z = W h``,
    ``out_v = sum_u alpha_uv z_u + b``.
    Both: ``alpha_uv = softmax_u(LeakyReLU(a_src·z_u + a_dst·z_v))`` with one weight W shared by
    sources and destinations, per-head vectors a_src/a_dst, the destination itself among its
    neighbours when ``self_loop`` (GAT paper, N(v) ∪ {v}), and dropout ``attn_dropout`` on
    alpha in training.
    """

    def __init__(self, in_dim: int, out_dim: int, heads: int = 4, variant: str = "distgnn",
                 negative_slope: float = 0.2, attn_dropout: float = 0.0, self_loop: bool = True,
                 project_activation: bool = True, bias: bool = True, backend: str = "auto",
                 deterministic: bool = False):
        super().__init__()
        if variant not in GAT_VARIANTS:
            raise ValueError(f"GATConv: variant must be one of {GAT_VARIANTS}, got {variant!r}")
        self.in_dim, self.out_dim, self.heads, self.variant = in_dim, out_dim, heads, variant
        self.negative_slope, self.attn_dropout, self.self_loop = negative_slope, attn_dropout, self_loop
        self.project_activation = project_activation and variant == "distgnn"
        self.backend, self.deterministic = backend, deterministic
        self.fc = Linear(in_dim, heads * out_dim, bias=bias and variant == "distgnn")
        self.attn_src = nn.Parameter(torch.empty(1, heads, out_dim))
        self.attn_dst = nn.Parameter(torch.empty(1, heads, out_dim))
        self.bias = nn.Parameter(torch.zeros(heads * out_dim)) if bias and variant == "standard" else None
        gain = nn.init.calculate_gain("relu")
        nn.init.xavier_normal_(self.fc.weight, gain=gain)
        nn.init.xavier_normal_(self.attn_src, gain=gain)
        nn.init.xavier_normal_(self.attn_dst, gain=gain)
        if self.fc.bias is not None:
            nn.init.uniform_(self.fc.bias, -1 / math.sqrt(in_dim), 1 / math.sqrt(in_dim))

    def source_rows(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z [num_src, heads, out_dim], el [num_src, heads])``: the projected rows and their
        source attention logits. Row-wise, so they may be computed in row chunks."""
        z = self.projection(h).view(-1, self.heads, self.out_dim)
        return z, (z * self.attn_src).sum(-1)

    def combine(self, block, z: torch.Tensor, el: torch.Tensor, z_dst: torch.Tensor,
                self_loop: bool | None = None) -> torch.Tensor:
        """[num_dst, heads, out_dim] from ``(z, el) = source_rows(h)`` and the destinations' own
        rows of ``z``. ``self_loop=False`` overrides the layer's setting for a block that already
        holds each destination's self edge explicitly (destinations that are not a prefix)."""
        return self._attend(block, z, el, (z_dst * self.attn_dst).sum(-1), self_loop)

    def _attend(self, block, z: torch.Tensor, el: torch.Tensor, er: torch.Tensor,
                self_loop: bool | None = None) -> torch.Tensor:
        """:meth:`combine` from the source and destination logits ``el`` / ``er``."""
        out = gat_aggregate(block, z, el, er, self.negative_slope,
                            self_loop=self.self_loop if self_loop is None else self_loop,
                            attn_dropout=self.attn_dropout, training=self.training, **kernel_options(self))
        if self.bias is not None:
            out = out + self.bias.view(1, self.heads, self.out_dim)
        return out

    def forward(self, block, h: torch.Tensor) -> torch.Tensor:
        return self.forward_from_projection(block, self.projection(h))

    # ---- the projection split (see the module docstring) -------------------------------------
    @property
    def exchanges_projection(self) -> bool:
        """Whether :meth:`projection` (``heads x out_dim`` wide) is narrower than the input."""
        return exchanged_width("gat", self.in_dim, self.out_dim, self.heads) is not None

    def projection(self, h: torch.Tensor) -> torch.Tensor:
        """The projected rows ``z`` of :meth:`source_rows`, flattened: [rows, heads * out_dim]."""
        z = self.fc(h)
        return torch.relu(z) if self.project_activation else z

    def forward_from_projection(self, block, z: torch.Tensor) -> torch.Tensor:
        """[num_dst, heads, out_dim] from the sources' :meth:`projection` ``z`` [num_src,
        heads * out_dim]; the source logits are computed here from ``z`` (row-wise)."""
        z = z.view(-1, self.heads, self.out_dim)
        # both logits from z, their gradient to z in one buffer (gat_node_logits)
        return self._attend(block, z, *gat_node_logits(z, self.attn_src, self.attn_dst, block.num_dst))

    cacheable = False   # softmax over the in-edges: offloaded training recomputes the layer
    edge_weighted = True    # attention weights per edge: backward reads the transpose's edge ids


def halo_exchange_shape(arch: str, layer: int, in_dim: int, out_dim: int, heads: int = 1) -> tuple[bool, int]:
    """What the in-memory full graph's halo exchange sends at layer ``layer`` of an ``arch``
    model whose layer is ``in_dim -> out_dim`` (``heads`` x ``out_dim`` for GAT), the one rule of
    the exact exchange, the halo cache and the estimates of both: ``(True, w)``, its projection
    ``w`` wide (:func:`exchanged_width`: GCN's source rows, a SAGE or GAT projection narrower
    than the input) at a layer ``l >= 1``; else ``(False, in_dim)``, its input (layer 0: the
    partition's features, which never change)."""
    if layer > 0:
        w = exchanged_width(arch, in_dim, out_dim, heads)
        if w is not None:
            return True, int(w)
    return False, int(in_dim)


def halo_exchange_width(conv, layer: int) -> tuple[bool, int]:
    """:func:`halo_exchange_shape` of ``conv``, layer ``layer`` of a model."""
    arch = "gcn" if isinstance(conv, GCNConv) else "gat" if isinstance(conv, GATConv) else "sage"
    return halo_exchange_shape(arch, layer, conv.in_dim, conv.out_dim, getattr(conv, "heads", 1))
