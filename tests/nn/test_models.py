"""Layers and models (hpcgnn.nn.conv / models) against dense-adjacency references."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nn_blocks import dense_adjacency, random_block  # noqa: E402

from hpcgnn.errors import InputError  # noqa: E402
from hpcgnn.nn.conv import GATConv, GCNConv, SAGEConv  # noqa: E402
from hpcgnn.nn.models import build_model  # noqa: E402
from hpcgnn.sampling.block import Block  # noqa: E402

IN, HID, CLS, HEADS = 12, 8, 5, 3
ARCHS = [("sage", "distgnn"), ("gcn", "distgnn"), ("gat", "distgnn"), ("gat", "standard")]


def chain(seed: int = 0):
    """Three blocks 60 -> 40 -> 25 -> 10 (destinations = prefix), with zero-degree rows."""
    sizes = [60, 40, 25, 10]
    return [random_block(sizes[i], sizes[i + 1], 6 * sizes[i + 1], seed=seed + i, zero_rows=2)
            for i in range(3)]


# ---- dense references (float64) -------------------------------------------------------------

def ref_sage(conv: SAGEConv, block, h):
    a = dense_adjacency(block)
    deg = a.sum(1, keepdim=True)
    mean = torch.where(deg > 0, a @ h / deg.clamp(min=1), torch.zeros(()))
    wn, ws = conv.lin_neigh.weight.double(), conv.lin_self.weight.double()
    return mean @ wn.T + h[:block.num_dst] @ ws.T + conv.lin_self.bias.double()


def ref_gcn(conv: GCNConv, block, h, src_scale, dst_scale):
    a = dense_adjacency(block)
    nd = block.num_dst
    agg = a @ (src_scale.unsqueeze(1) * h) + src_scale[:nd].unsqueeze(1) * h[:nd]
    return dst_scale.unsqueeze(1) * agg @ conv.lin.weight.double().T + conv.bias.double()


def ref_gat(conv: GATConv, block, h):
    nd, H, D = block.num_dst, conv.heads, conv.out_dim
    z = h @ conv.fc.weight.double().T
    if conv.fc.bias is not None:
        z = z + conv.fc.bias.double()
    z = z.view(-1, H, D)
    if conv.project_activation:
        z = torch.relu(z)
    el = (z * conv.attn_src.double()).sum(-1)                  # [ns, H]
    er = (z[:nd] * conv.attn_dst.double()).sum(-1)             # [nd, H]
    e = torch.nn.functional.leaky_relu(er[:, None, :] + el[None, :, :], conv.negative_slope)  # [nd, ns, H]
    count = dense_adjacency(block)
    if conv.self_loop:
        count[torch.arange(nd), torch.arange(nd)] += 1
    w = count[:, :, None] * torch.exp(e - e.max(1, keepdim=True).values)
    s = w.sum(1, keepdim=True)
    alpha = torch.where(s > 0, w / s.clamp(min=1e-300), torch.zeros(()))
    out = torch.einsum("vuh,uhd->vhd", alpha, z)
    if conv.bias is not None:
        out = out + conv.bias.double().view(1, H, D)
    return out


def ref_layer(model, l, block, h):
    conv = model.layers[l]
    last = l == model.num_layers - 1
    if isinstance(conv, SAGEConv):
        out = ref_sage(conv, block, h)
    elif isinstance(conv, GCNConv):
        out = ref_gcn(conv, block, h, block.src_scale.double(), block.dst_scale.double())
    else:
        out = ref_gat(conv, block, h)
        out = out.mean(1) if last else out.flatten(1)
    return out if last else torch.relu(out)


def with_global_scales(blocks, seed=0):
    """Give every block GCN scales from made-up 'full-graph' degrees (not the block's own)."""
    g = torch.Generator().manual_seed(seed)
    for b in blocks:
        deg = torch.randint(0, 30, (b.num_src,), generator=g).float()
        b.src_scale = (deg + 1).rsqrt()
        b.dst_scale = b.src_scale[:b.num_dst].clone()
    return blocks


# ---- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,variant", ARCHS)
def test_model_equals_dense_reference(arch, variant):
    blocks = with_global_scales(chain())
    model = build_model(arch, IN, HID, CLS, 3, HEADS, 0.5, gat_variant=variant, seed=1).eval()
    x = torch.randn(60, IN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(blocks, x)
        h = x.double()
        for l, b in enumerate(blocks):
            h = ref_layer(model, l, b, h)
        torch.testing.assert_close(got.double(), h, atol=1e-5, rtol=1e-5)
        assert got.shape == (10, CLS)
        # float64 end to end: the kernels are exact up to summation order
        got64 = model.double()(blocks, x.double())
        torch.testing.assert_close(got64, h, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("arch", ["sage", "gcn", "gat"])
def test_widths_and_layer_forward_composition(arch):
    blocks = with_global_scales(chain(3))
    model = build_model(arch, IN, HID, CLS, 3, HEADS, 0.0, seed=0)
    hid = HID * HEADS if arch == "gat" else HID
    assert model.in_dims == [IN, hid, hid] and model.num_layers == 3 and len(model.layers) == 3
    x = torch.randn(60, IN)
    h = x
    for l, b in enumerate(blocks):
        h = model.layer_forward(l, b, h)
        assert h.shape == (b.num_dst, CLS if l == 2 else hid)
    torch.testing.assert_close(h, model(blocks, x), atol=0, rtol=0)


def test_gcn_scales_from_arguments_attributes_and_local_degrees():
    b = random_block(30, 20, 120, seed=5, zero_rows=3)
    conv = GCNConv(6, 4)
    x = torch.randn(30, 6)
    s_src, s_dst = torch.rand(30) + 0.1, torch.rand(20) + 0.1
    with torch.no_grad():
        by_args = conv(b, x, s_src, s_dst)
        torch.testing.assert_close(by_args.double(), ref_gcn(conv, b, x.double(), s_src.double(), s_dst.double()),
                                   atol=1e-5, rtol=1e-5)
        b.src_scale, b.dst_scale = s_src, s_dst
        torch.testing.assert_close(conv(b, x), by_args, atol=0, rtol=0)
        plain = random_block(30, 20, 120, seed=5, zero_rows=3)     # no attributes: block-local degrees
        a = dense_adjacency(plain)
        local_src = (a.sum(0) + 1).rsqrt()
        local_dst = (a.sum(1) + 1).rsqrt()
        torch.testing.assert_close(conv(plain, x).double(), ref_gcn(conv, plain, x.double(), local_src, local_dst),
                                   atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="src_scale"):
            conv(plain, x, torch.ones(29), torch.ones(20))


def test_deterministic_init_and_seed_leaves_global_rng_alone():
    for arch in ("sage", "gcn", "gat"):
        a = build_model(arch, IN, HID, CLS, seed=7)
        torch.manual_seed(123)
        before = torch.rand(3)
        torch.manual_seed(123)
        b = build_model(arch, IN, HID, CLS, seed=7)
        assert torch.equal(torch.rand(3), before)                 # seed= used a forked RNG
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(va, vb)
        c = build_model(arch, IN, HID, CLS, seed=8)
        assert any(not torch.equal(va, vc) for va, vc in zip(a.state_dict().values(), c.state_dict().values()))
        torch.manual_seed(3)
        d = build_model(arch, IN, HID, CLS)
        torch.manual_seed(3)
        e = build_model(arch, IN, HID, CLS)
        assert all(torch.equal(vd, ve) for vd, ve in zip(d.state_dict().values(), e.state_dict().values()))


def test_training_forward_is_reproducible_and_uses_dropout():
    blocks = chain(4)
    x = torch.randn(60, IN)
    for arch in ("sage", "gat"):
        model = build_model(arch, IN, HID, CLS, 3, HEADS, 0.5, attn_dropout=0.3, seed=0).train()
        torch.manual_seed(11)
        a = model(blocks, x)
        torch.manual_seed(11)
        b = model(blocks, x)
        assert torch.equal(a, b)
        model.eval()
        assert not torch.allclose(a, model(blocks, x))


class RecordingHooks:
    """Records (l, h.shape, block) and replaces the last source rows with constants,
    dropping the edges from the first source (as the minibatch engine does for misses)."""

    def __init__(self, widths):
        self.calls, self.widths, self.replaced = [], widths, []

    def before_layer(self, l, h, block):
        self.calls.append((l, tuple(h.shape), block.num_src, block.num_dst))
        rows = torch.arange(block.num_src - 3, block.num_src)
        hist = torch.full((3, h.shape[1]), 0.25)
        self.replaced.append(hist)
        h = h.index_copy(0, rows, hist)                 # out of place: no grad into replaced rows
        keep = torch.ones(block.num_src, dtype=torch.bool)
        keep[0] = False
        return h, block.drop_sources(keep)


@pytest.mark.parametrize("arch", ["sage", "gcn", "gat"])
def test_hooks_called_per_layer_and_replacements_take_effect(arch):
    blocks = chain(5)
    model = build_model(arch, IN, HID, CLS, 3, HEADS, 0.0, seed=2)
    x = torch.randn(60, IN, requires_grad=True)
    hooks = RecordingHooks(model.in_dims)
    out = model(blocks, x, hooks=hooks)
    assert [c[0] for c in hooks.calls] == [0, 1, 2]
    for (l, shape, ns, nd), b, w in zip(hooks.calls, blocks, model.in_dims):
        assert shape == (b.num_src, w) and (ns, nd) == (b.num_src, b.num_dst)
    # the same computation spelled out with layer_forward
    h = x
    for l, b in enumerate(blocks):
        h = h.index_copy(0, torch.arange(b.num_src - 3, b.num_src), torch.full((3, h.shape[1]), 0.25))
        keep = torch.ones(b.num_src, dtype=torch.bool)
        keep[0] = False
        h = model.layer_forward(l, b.drop_sources(keep), h)
    torch.testing.assert_close(out, h, atol=0, rtol=0)
    out.sum().backward()
    assert (x.grad[-3:] == 0).all() and x.grad.abs().sum() > 0   # replaced inputs get no gradient


@pytest.mark.parametrize("arch,variant", ARCHS)
def test_torch_backend_model_matches_native(arch, variant):
    """The pure-torch path (the one CUDA tensors take) gives the same values and gradients."""
    blocks = with_global_scales(chain(6))
    x = torch.randn(60, IN)
    results = []
    for backend in ("native", "torch"):
        model = build_model(arch, IN, HID, CLS, 3, HEADS, 0.0, gat_variant=variant, backend=backend, seed=3)
        out = model(blocks, x)
        out.square().sum().backward()
        results.append([out.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_single_vertex_probe_block_like_the_engines():
    probe = Block(1, 1, torch.tensor([0, 1]), torch.tensor([0]))
    for arch in ("sage", "gcn", "gat"):
        model = build_model(arch, IN, HID, CLS, 2, HEADS, seed=0).eval()
        with torch.no_grad():
            assert model([probe, probe], torch.zeros(1, IN)).shape == (1, CLS)


@pytest.mark.parametrize("kwargs,match", [
    (dict(arch="mlp"), "model.arch"),
    (dict(hidden=0), "model.hidden"),
    (dict(num_layers=0), "model.layers"),
    (dict(heads=0), "model.heads"),
    (dict(dropout=1.0), "model.dropout"),
    (dict(gat_variant="v2"), "model.gat_variant"),
])
def test_build_model_rejects_bad_values(kwargs, match):
    args = dict(arch="gat", in_dim=IN, hidden=HID, num_classes=CLS)
    args.update(kwargs)
    with pytest.raises(InputError, match=match):
        build_model(**args)


def test_sage_aggregates_first_on_blocks_with_many_more_sources():
    """A sampled block (many sources, few destinations) aggregates at the input width and
    projects the destinations only; a square block with many edges projects first. Both are the
    same function."""
    conv = SAGEConv(64, 16)
    torch.manual_seed(0)
    sampled = random_block(900, 60, 600, seed=1)
    square = random_block(300, 300, 6000, seed=2)
    assert not conv.projects_first(sampled) and conv.projects_first(square)
    assert not SAGEConv(16, 64).projects_first(square)          # widening: never
    for blk in (sampled, square):
        h = torch.randn(blk.num_src, 64, dtype=torch.float64)
        conv64 = SAGEConv(64, 16).double()
        conv64.load_state_dict(conv.state_dict())
        deg = (blk.indptr[1:] - blk.indptr[:-1]).clamp(min=1).unsqueeze(1).double()
        mean = torch.zeros(blk.num_dst, 64, dtype=torch.float64).index_add_(
            0, torch.repeat_interleave(torch.arange(blk.num_dst), blk.indptr[1:] - blk.indptr[:-1]),
            h[blk.indices]) / deg
        want = conv64.lin_self(h[:blk.num_dst]) + conv64.lin_neigh(mean)
        torch.testing.assert_close(conv64(blk, h), want, rtol=1e-10, atol=1e-10)


def test_sage_backward_keeps_destination_rows_not_all_source_rows():
    """What a layer keeps for backward does not pin its input: once the caller drops a sampled
    block's [num_src, in] input, only destination-sized tensors remain."""
    import weakref

    conv = SAGEConv(32, 32)
    blk = random_block(5000, 100, 400, seed=3)
    leaf = torch.randn(blk.num_src, 32, requires_grad=True)
    h = leaf * 1.0                       # a non-leaf input, as between layers
    ref = weakref.ref(h)
    out = conv(blk, h)
    del h
    assert ref() is None                 # the source rows were freed after the forward
    out.sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("projects", [False, True])
def test_sage_given_its_own_rows_apart_keeps_no_exchanged_input(backend, projects):
    """A full-graph SAGE layer given its own rows apart (``h_dst``: the rows before the halo
    exchange, which the caller keeps anyway): the exchanged ``[num_src, in]`` input is not kept
    for backward (aggregating first: freed once aggregated, as it is without ``h_dst`` too, where
    both kernel paths keep a copy of the own rows, ``aggregate_sum_with_dst``; projecting first:
    ``h_dst`` and a copy of the halo rows are kept, where the merged projection keeps all of ``h``), and the output and every gradient
    equal that layer's within 1e-5 (the weight gradient sums its rows in two parts when
    projecting first). Through :meth:`GNN.layer_forward` too, which passes
    ``h_dst`` to SAGE only."""
    import weakref

    blk = random_block(5000 if not projects else 1300, 1000, 8000, seed=7)
    torch.manual_seed(0)
    model = build_model("sage", 32, 32 if not projects else 8, 8, num_layers=2, dropout=0.0, backend=backend)
    conv = model.layers[0]
    assert conv.projects_first(blk) == projects
    nh = blk.num_src - 1000
    solid0, halo0, g = torch.randn(1000, 32), torch.randn(nh, 32), torch.randn(1000, conv.out_dim)
    got = []
    for apart in (True, False):
        model.zero_grad(set_to_none=True)
        s, hl = solid0.clone().requires_grad_(True), halo0.clone().requires_grad_(True)
        solid = s * 1.0                              # a layer's output, kept by its caller
        h = torch.cat([solid, hl * 1.0])             # the exchanged rows: solid then halo
        ref = weakref.ref(h)
        out = model.layer_forward(0, blk, h, h_dst=solid if apart else None)
        del h
        freed = ref() is None
        out.backward(g)
        got.append((out.detach(), s.grad, hl.grad, conv.lin_self.weight.grad, conv.lin_neigh.weight.grad, freed))
    assert got[0][5]
    assert got[1][5] != projects
    for a, b in zip(got[0][:5], got[1][:5]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    gcn = build_model("gcn", 32, 32, 8, num_layers=2, dropout=0.0, backend=backend)
    h = torch.randn(blk.num_src, 32)
    torch.testing.assert_close(gcn.layer_forward(1, blk, h, h_dst=h[:1000]), gcn.layer_forward(1, blk, h),
                               rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("arch,variant", ARCHS)
def test_a_layer_from_its_projection_equals_its_forward(backend, arch, variant):
    """The projection split the in-memory full graph exchanges (``conv.projection`` row-wise on
    the solid and on the halo rows apart, as each owner computes it, then
    :meth:`GNN.layer_forward_from_projection`): output and every gradient (the rows', each
    parameter's) equal :meth:`GNN.layer_forward` on the joined rows within 1e-5, in the last
    layer (GAT's heads averaged) and a hidden one (ReLU + dropout off); and
    ``exchanges_projection`` says whether the full graph exchanges it: SAGE and GAT when
    narrower than the input, GCN always (its source rows), as ``exchanged_width`` says."""
    from hpcgnn.nn.conv import exchanged_width, gcn_norm

    blk = random_block(700, 300, 2400, seed=5)
    nh = blk.num_src - blk.num_dst
    deg = torch.randint(0, 9, (blk.num_src,))
    for layers, l, width in ((2, 1, 24), (3, 1, 4)):
        torch.manual_seed(1)
        model = build_model(arch, 16, width, CLS, num_layers=layers, heads=HEADS, dropout=0.0,
                            gat_variant=variant, backend=backend)
        conv = model.layers[l]
        heads = HEADS if arch == "gat" else 1
        out_dim = CLS if l == layers - 1 else width
        assert conv.exchanges_projection == (arch == "gcn" or heads * out_dim < conv.in_dim)
        width_sent = exchanged_width(arch, conv.in_dim, out_dim, heads)
        assert width_sent == (min(conv.in_dim, out_dim) if arch == "gcn" else
                              heads * out_dim if heads * out_dim < conv.in_dim else None)
        kw = {"src_scale": gcn_norm(deg), "dst_scale": gcn_norm(deg[:blk.num_dst])} if arch == "gcn" else {}
        solid0, halo0 = torch.randn(blk.num_dst, conv.in_dim), torch.randn(nh, conv.in_dim)
        got = []
        for split in (True, False):
            model.zero_grad(set_to_none=True)
            s, hl = solid0.clone().requires_grad_(True), halo0.clone().requires_grad_(True)
            if split:
                pk = {"src_scale": kw["src_scale"][:blk.num_dst]} if arch == "gcn" else {}
                hk = {"src_scale": kw["src_scale"][blk.num_dst:]} if arch == "gcn" else {}
                p = torch.cat([conv.projection(s, **pk), conv.projection(hl, **hk)])
                assert width_sent is None or p.shape[1] == width_sent
                out = model.layer_forward_from_projection(l, blk, p, h_dst=s, **kw)
            else:
                out = model.layer_forward(l, blk, torch.cat([s, hl]), **kw)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
            got.append([out.detach(), s.grad, hl.grad] + [q.grad for q in conv.parameters()])
        for a, b in zip(*got):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reads its own rows: h_dst is required"):
        build_model("sage", 16, 4, CLS, num_layers=2).layer_forward_from_projection(1, blk, torch.zeros(700, CLS))


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_sage_projecting_first_shares_one_gradient_buffer_bit_for_bit(backend):
    """A SAGE layer that projects first (the destinations a prefix of more source rows): its
    output and every gradient equal, bit for bit, those of the unmerged formula (projection of
    all rows, the own rows as a slice), and its backward makes no zero-filled source-sized
    buffer for the slice (no ``slice_backward``, which the unmerged formula runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    blk = random_block(300, 120, 4000, seed=5)
    torch.manual_seed(0)
    conv = SAGEConv(32, 8, backend=backend)
    assert conv.projects_first(blk)
    h0 = torch.randn(300, 32)
    g = torch.randn(120, 8)
    got = []
    for merged in (True, False):
        conv.zero_grad(set_to_none=True)
        h = h0.clone().requires_grad_(True)
        x = h * 1.0                     # a non-leaf input, as between layers
        out = conv(blk, x) if merged else conv.combine(blk, conv.source_rows(x), x[:blk.num_dst])
        ops = Ops()
        with ops:
            out.backward(g)
        got.append((out.detach(), h.grad, conv.lin_neigh.weight.grad, conv.lin_self.weight.grad, ops.names))
    for a, b in zip(got[0][:4], got[1][:4]):
        assert torch.equal(a, b)
    assert "slice_backward" not in got[0][4] and "slice_backward" in got[1][4]


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_gat_logits_give_the_projection_one_gradient_buffer(backend):
    """A GAT layer's source and destination logits (``gat_node_logits``) equal the two per-head
    dot products of the unmerged formula (``el`` of every projected source row, ``er`` of the
    slice of destination rows): the same output bit for bit and the same gradients; and its
    backward builds the projection's logit gradient in one buffer, with no zero-filled
    buffer of the projection's size for the slice (the unmerged formula's ``slice_backward``;
    a GAT backward measured 3.1 -> 2.15 such tensors above its start, docs/plan.md)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.names.append((func.__name__.split(".")[0], tuple(getattr(out, "shape", ()))))
            return out

    blk = random_block(300, 120, 4000, seed=7)
    torch.manual_seed(0)
    conv = GATConv(32, 8, heads=4, backend=backend)
    h0 = torch.randn(300, 32)
    g = torch.randn(120, 4, 8)
    got = []
    for merged in (True, False):
        conv.zero_grad(set_to_none=True)
        h = h0.clone().requires_grad_(True)
        x = h * 1.0                     # a non-leaf input, as between layers
        if merged:
            out = conv(blk, x)
        else:
            z = conv.projection(x).view(-1, 4, 8)
            out = conv.combine(blk, z, (z * conv.attn_src).sum(-1), z[:blk.num_dst])
        ops = Ops()
        with ops:
            out.backward(g)
        got.append((out.detach(), h.grad, conv.fc.weight.grad, conv.attn_src.grad, conv.attn_dst.grad, ops.names))
    assert torch.equal(got[0][0], got[1][0])
    for a, b in zip(got[0][1:5], got[1][1:5]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    z_sized = ("slice_backward", (300, 4, 8))      # the slice's zero-filled [num_src, H, D]
    assert z_sized not in got[0][5] and z_sized in got[1][5]
