"""GAT's differentiable operators over a :class:`~hpcgnn.sampling.block.Block`: per-edge and
per-node attention logits (:func:`gat_edge_logits`, :func:`gat_node_logits`), the softmax over a
destination's in-edges (:func:`edge_softmax`), the attention-weighted aggregation of H heads
(:func:`aggregate_heads`) and the whole GAT aggregation (:func:`gat_aggregate`).

Backends (``backend=``: ``"native"``, ``"torch"``, ``"auto"``), ``deterministic`` and the
block conventions are those of :mod:`hpcgnn.nn.aggregate`, whose helpers and torch-path CSR
operators these build on: the native path runs the OpenMP kernels of ``native/spmm.cpp``
(no atomics), the torch path CSR SpMM / SDDMM / segment reductions with extra memory O(nnz H)
plus O(V H D) rows.
"""
from __future__ import annotations

import torch

from hpcgnn.native import spmm as _spmm
from hpcgnn.nn.aggregate import (_check_rows, _csr, _det_scope, _device_csr, _edge_dst, _np, _transpose, _use_native,
                                  csr_sddmm, csr_spmm, edge_ids, segment_sum)
from hpcgnn.nn.dropout import dropout


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
