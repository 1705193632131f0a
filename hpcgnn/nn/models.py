"""Multi-layer GNNs over a list of blocks (one per layer), shared by both engines.

``model(blocks, x, hooks=None)`` runs layer ``l`` on ``blocks[l]``; ``x`` holds the input
rows of ``blocks[0]``'s sources, and layer ``l``'s output rows are ``blocks[l+1]``'s
sources (its destinations are the next block's sources, DGL MFG convention).

Between layers (not after the last): ReLU then dropout (DistGNN-MB eq. 1). GAT hidden
layers concatenate their heads (width ``heads * hidden``); the last GAT layer averages
its heads into the class logits.

Hooks: ``hooks.before_layer(l, h, block) -> (h, block)`` is called before every layer's
aggregation with that layer's input rows ``h`` [num_src, width] and block; the engine may
replace rows (historical embeddings: use an out-of-place ``index_copy``/``index_put`` of
detached rows), swap the block (e.g. drop edges) or record ``h``.

Engines that run layer by layer call ``model.layer_forward(l, block, h)`` (the layer plus
its activation and dropout). Dropout (:mod:`hpcgnn.nn.dropout`) draws its seed from torch's
global RNG: a recomputation must restore the RNG state to replay the same masks.
"""
from __future__ import annotations

import torch
from torch import nn

from hpcgnn.errors import InputError
from hpcgnn.nn.aggregate import BACKENDS
from hpcgnn.nn.conv import GAT_VARIANTS, GATConv, GCNConv, SAGEConv
from hpcgnn.nn.dropout import Dropout

ARCHS = ("sage", "gat", "gcn")


class GNN(nn.Module):
    """A stack of conv layers with ReLU + dropout between them; see the module docstring."""

    def __init__(self, arch: str, layers: list[nn.Module], dropout: float):
        super().__init__()
        self.arch = arch
        self.layers = nn.ModuleList(layers)
        self.dropout = Dropout(dropout)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def in_dims(self) -> list[int]:
        """Input width of each layer (the width of ``h`` seen by ``hooks.before_layer``)."""
        return [layer.in_dim for layer in self.layers]

    def layer_forward(self, l: int, block, h: torch.Tensor, h_dst: torch.Tensor | None = None,
                      **kwargs) -> torch.Tensor:
        """Layer ``l`` on ``block`` (``h``: [num_src, in_dims[l]]), then ReLU + dropout unless last.

        ``h_dst``: the destinations' own rows held apart from ``h`` (same values as
        ``h[:num_dst]``); the layers that read them (``update_needs_dst``: SAGE) keep these for
        backward instead of a view of ``h`` (:meth:`hpcgnn.nn.conv.SAGEConv.forward`); the
        others are not given it.
        ``kwargs`` go to the conv (GCN: ``src_scale``, ``dst_scale``). Returns [num_dst, width].
        """
        conv = self.layers[l]
        if h_dst is not None and getattr(conv, "update_needs_dst", False):
            kwargs["h_dst"] = h_dst
        return self._after_conv(l, conv(block, h, **kwargs))

    def layer_forward_from_projection(self, l: int, block, p: torch.Tensor, h_dst: torch.Tensor | None = None,
                                      **kwargs) -> torch.Tensor:
        """:meth:`layer_forward` from the sources' projection ``p = layers[l].projection(h)``
        [num_src, ...] (``conv.forward_from_projection``); ``h_dst`` [num_dst, in_dims[l]]: the
        destinations' own input rows, given to the layers that read them (SAGE)."""
        conv = self.layers[l]
        if getattr(conv, "update_needs_dst", False):
            if h_dst is None:
                raise ValueError(f"layer {l} ({type(conv).__name__}) reads its own rows: h_dst is required")
            kwargs["h_dst"] = h_dst
        return self._after_conv(l, conv.forward_from_projection(block, p, **kwargs))

    def _after_conv(self, l: int, out: torch.Tensor) -> torch.Tensor:
        """A conv's output made the layer's: GAT's heads averaged (last layer) or joined, then
        :meth:`between_layers`."""
        if isinstance(self.layers[l], GATConv):
            out = out.mean(1) if l == len(self.layers) - 1 else out.flatten(1)
        return self.between_layers(l, out)

    def between_layers(self, l: int, out: torch.Tensor) -> torch.Tensor:
        """What follows layer ``l``'s conv: ReLU + dropout, except after the last layer."""
        if l < len(self.layers) - 1:
            out = self.dropout.forward_relu(out)
        return out

    def forward(self, blocks, x: torch.Tensor, hooks=None) -> torch.Tensor:
        """Logits [blocks[-1].num_dst, num_classes] from input rows ``x`` [blocks[0].num_src, in_dim]."""
        if len(blocks) != len(self.layers):
            raise ValueError(f"GNN: got {len(blocks)} blocks for {len(self.layers)} layers")
        h = x
        for l, block in enumerate(blocks):
            if hooks is not None:
                h, block = hooks.before_layer(l, h, block)
            h = self.layer_forward(l, block, h)
        return h


def build_model(arch: str, in_dim: int, hidden: int, num_classes: int, num_layers: int = 3,
                heads: int = 4, dropout: float = 0.5, *, gat_variant: str = "distgnn",
                negative_slope: float = 0.2, attn_dropout: float = 0.0, self_loop: bool = True,
                backend: str = "auto", deterministic: bool = False, seed: int | None = None) -> GNN:
    """A ``num_layers``-layer GNN: in_dim -> hidden -> ... -> num_classes.

    arch: ``"sage"`` (mean), ``"gcn"`` or ``"gat"``. For GAT, ``hidden`` is the width per
    head (hidden layers output ``heads * hidden``) and ``gat_variant`` is ``"distgnn"`` (eq. 2:
    projection + bias + ReLU before attention; no ReLU on the last layer's projection) or
    ``"standard"``; ``self_loop``, ``negative_slope`` and ``attn_dropout`` as in
    :class:`~hpcgnn.nn.conv.GATConv`. Parameters are drawn from torch's global RNG, or from
    ``torch.manual_seed(seed)`` inside a forked RNG (global state untouched) when ``seed`` is
    given. ``backend`` and ``deterministic`` choose every layer's aggregation kernels
    (:mod:`hpcgnn.nn.aggregate`). Bad values raise :class:`~hpcgnn.errors.InputError`.
    """
    if arch not in ARCHS:
        raise InputError(f"model.arch = {arch!r}: expected one of {', '.join(ARCHS)}")
    for name, val in (("in_dim", in_dim), ("hidden", hidden), ("num_classes", num_classes),
                      ("layers", num_layers), ("heads", heads)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise InputError(f"model.{name} = {val!r}: expected an integer >= 1")
    if not 0 <= dropout < 1:
        raise InputError(f"model.dropout = {dropout!r}: expected a value in [0, 1)")
    if not 0 <= attn_dropout < 1:
        raise InputError(f"model.attn_dropout = {attn_dropout!r}: expected a value in [0, 1)")
    if gat_variant not in GAT_VARIANTS:
        raise InputError(f"model.gat_variant = {gat_variant!r}: expected one of {', '.join(GAT_VARIANTS)}")
    if backend not in BACKENDS:
        raise InputError(f"model backend = {backend!r}: expected one of {', '.join(BACKENDS)}")
    if seed is None:
        return _build(arch, in_dim, hidden, num_classes, num_layers, heads, dropout, gat_variant,
                      negative_slope, attn_dropout, self_loop, backend, deterministic)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(arch, in_dim, hidden, num_classes, num_layers, heads, dropout, gat_variant,
                      negative_slope, attn_dropout, self_loop, backend, deterministic)


def _build(arch, in_dim, hidden, num_classes, num_layers, heads, dropout, gat_variant,
           negative_slope, attn_dropout, self_loop, backend, deterministic) -> GNN:
    kernels = {"backend": backend, "deterministic": bool(deterministic)}
    layers: list[nn.Module] = []
    width = in_dim
    for l in range(num_layers):
        last = l == num_layers - 1
        out = num_classes if last else hidden
        if arch == "sage":
            layers.append(SAGEConv(width, out, **kernels))
            width = out
        elif arch == "gcn":
            layers.append(GCNConv(width, out, **kernels))
            width = out
        else:
            layers.append(GATConv(width, out, heads, gat_variant, negative_slope, attn_dropout, self_loop,
                                  project_activation=not last, **kernels))
            width = out * heads
    return GNN(arch, layers, dropout)
