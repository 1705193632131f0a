"""On a CUDA GPU (``pytest -m cuda``; skipped without one): the device aggregation path equals
the native CPU kernels (values and gradients) for every conv and the tensor engine's operators,
needs O(nnz + V D) extra device memory (``max_memory_allocated``), and is bit-reproducible
under ``train.deterministic``. The CPU halves of these checks are tests/nn/test_aggregate_torch_path.py."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nn_blocks import random_block  # noqa: E402

from hpcgnn.nn import aggregate as agg  # noqa: E402
from hpcgnn.nn.conv import GATConv, GCNConv, SAGEConv  # noqa: E402
from hpcgnn.nn.decoupled import edge_dot, sum_adjoint  # noqa: E402
from hpcgnn.sampling.block import Block  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOL = dict(rtol=1e-5, atol=1e-5)
CUDA = "cuda"


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 GEMMs in full precision (TF32 would be ~1e-3 off the CPU)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _close(got, ref):
    torch.testing.assert_close(got.cpu(), ref.cpu(), **TOL)


@pytest.mark.parametrize("kind,kw", [("sage", {}), ("gcn", {}), ("distgnn", {}), ("standard", {}),
                                     ("standard", {"self_loop": False})])
@pytest.mark.parametrize("dims", [(6, 4), (4, 6)])
def test_every_conv_on_cuda_matches_native_on_the_cpu(kind, kw, dims):
    blk = random_block(60, 25, 400, seed=5, zero_rows=4)
    torch.manual_seed(5)
    if kind == "sage":
        native = SAGEConv(*dims, backend="native")
    elif kind == "gcn":
        native = GCNConv(*dims, backend="native")
    else:
        native = GATConv(*dims, heads=3, variant=kind, backend="native", **kw)
    dev = copy.deepcopy(native).to(CUDA)
    dev.backend = "torch"
    h = torch.randn(60, dims[0], generator=torch.Generator().manual_seed(2))
    g = torch.randn(native(blk, h).shape, generator=torch.Generator().manual_seed(3))
    results = []
    for conv, b, x in ((native, blk, h.clone()), (dev, blk.to(CUDA), h.to(CUDA))):
        x.requires_grad_(True)
        out = conv(b, x)
        out.backward(g.to(out.device))
        results.append((out.detach(), x.grad, {n: p.grad for n, p in conv.named_parameters()}))
    (o1, g1, p1), (o2, g2, p2) = results
    assert o2.device.type == torch.device(CUDA).type
    _close(o2, o1)
    _close(g2, g1)
    for name in p1:
        _close(p2[name], p1[name])


def test_sum_mean_adjoint_and_tensor_operators_on_cuda_match_native():
    blk = random_block(50, 20, 300, seed=7, zero_rows=3)
    db = blk.to(CUDA)
    gen = torch.Generator().manual_seed(1)
    x, w, g = torch.randn(50, 9, generator=gen), torch.rand(300, generator=gen), torch.randn(20, 9, generator=gen)
    _close(agg.aggregate_sum(db, x.to(CUDA), w.to(CUDA), backend="torch"), agg.aggregate_sum(blk, x, w, backend="native"))
    _close(agg.aggregate_mean(db, x.to(CUDA), backend="torch"), agg.aggregate_mean(blk, x, backend="native"))
    _close(agg.aggregate_sum_adjoint(db, g.to(CUDA), backend="torch"),
           agg.aggregate_sum_adjoint(blk, g, backend="native"))
    _close(sum_adjoint(db, g.to(CUDA), w.to(CUDA), backend="auto"), sum_adjoint(blk, g, w, backend="native"))
    _close(edge_dot(db, g.to(CUDA), x.to(CUDA), backend="auto"), edge_dot(blk, g, x, backend="native"))
    # gradients through the weighted sum
    ref = [t.clone().requires_grad_(True) for t in (x, w)]
    got = [t.to(CUDA).requires_grad_(True) for t in (x, w)]
    agg.aggregate_sum(blk, *ref, backend="native").backward(g)
    agg.aggregate_sum(db, *got, backend="torch").backward(g.to(CUDA))
    for r, o in zip(ref, got):
        _close(o.grad, r.grad)


def _weighted_pass(blk, x, w, g, mode):
    if mode == "torch":
        out = agg.aggregate_sum(blk, x, w, backend="torch")
    else:   # the replaced implementation: one gathered row per edge, index_add
        out = torch.zeros(blk.num_dst, x.shape[1], device=x.device).index_add(
            0, blk.edge_dst(), x.index_select(0, blk.indices) * w.unsqueeze(1))
    out.backward(g)


def test_device_extra_memory_is_not_one_row_per_edge():
    """One weighted aggregation, degree 50, D = 256, forward + backward on the GPU, second pass:
    the allocator's peak above the live tensors stays below a quarter of nnz * D * 4 bytes; the
    index_select/index_add formula, measured the same way, exceeds nnz * D * 4."""
    nd, ns, nnz, d = 4000, 8000, 200_000, 256
    gen = torch.Generator().manual_seed(0)
    dst = torch.sort(torch.randint(nd, (nnz,), generator=gen)).values
    ip = torch.zeros(nd + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(dst, minlength=nd), 0, out=ip[1:])
    blk = Block(ns, nd, ip, torch.randint(ns, (nnz,), generator=gen)).to(CUDA)
    x = torch.randn(ns, d, generator=gen).to(CUDA).requires_grad_(True)
    w = torch.rand(nnz, generator=gen).to(CUDA).requires_grad_(True)
    g = torch.randn(nd, d, generator=gen).to(CUDA)
    growth = {}
    for mode in ("torch", "index_select"):
        _weighted_pass(blk, x, w, g, mode)     # first pass: the block's CSR tensors, cuSPARSE handles
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _weighted_pass(blk, x, w, g, mode)
        torch.cuda.synchronize()
        growth[mode] = torch.cuda.max_memory_allocated() - base
        x.grad = w.grad = None
    per_edge_rows = nnz * d * 4
    assert growth["torch"] < 0.25 * per_edge_rows, growth
    assert growth["index_select"] > per_edge_rows, growth


def test_deterministic_device_runs_are_bit_identical():
    """train.deterministic: two forward + backward passes of GAT (edge softmax, weighted sum)
    and a weighted sum on the GPU give the same bits."""
    blk = random_block(300, 120, 6000, seed=9).to(CUDA)
    torch.manual_seed(0)
    conv = GATConv(16, 8, heads=4, variant="standard", backend="torch", deterministic=True).to(CUDA)
    h = torch.randn(300, 16, generator=torch.Generator().manual_seed(1)).to(CUDA)
    w = torch.rand(6000, generator=torch.Generator().manual_seed(2)).to(CUDA)
    runs = []
    for _ in range(2):
        conv.zero_grad(set_to_none=True)
        x = h.clone().requires_grad_(True)
        att, summed = conv(blk, x), agg.aggregate_sum(blk, x, w, backend="torch", deterministic=True)
        (att.square().sum() + summed.square().sum()).backward()
        runs.append([att.detach().cpu(), summed.detach().cpu(), x.grad.cpu()]
                    + [p.grad.cpu() for p in conv.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("projects", [False, True])
def test_full_graph_block_on_cuda_without_edge_ids_and_sage_given_its_own_rows(projects):
    """The in-memory full graph's CUDA set-up and layer (stop 39, unmeasured on a GPU until
    now): a host block that dropped its transpose's edge ids (``Block.drop_edge_ids``) copied to
    the device keeps them dropped and its two sparse directions share one tensor of ones; a
    SAGE layer on it, given its own rows apart (``h_dst``: aggregating first, or projecting
    first through ``_ProjectApart``), equals the native layer on the CPU in values and every
    gradient; and an edge-weighted aggregation on the block stops with a RuntimeError."""
    host = random_block(1300 if projects else 5000, 1000, 8000, seed=7)
    host.drop_edge_ids()
    dev = host.to(CUDA)
    assert dev.transpose()[2] is None and dev.transpose()[1].device.type == "cuda"
    fwd, bwd = dev.sparse_csr(CUDA, torch.float32), dev.sparse_csr(CUDA, torch.float32, transpose=True)
    assert fwd.values().data_ptr() == bwd.values().data_ptr()
    torch.manual_seed(0)
    conv = SAGEConv(32, 8 if projects else 32)
    assert conv.projects_first(host) == projects
    solid0, halo0 = torch.randn(1000, 32), torch.randn(host.num_src - 1000, 32)
    g = torch.randn(1000, conv.out_dim)
    got = []
    for block, device, backend in ((host, "cpu", "native"), (dev, CUDA, "torch")):
        c = copy.deepcopy(conv).to(device)
        c.backend = backend
        s = solid0.to(device).requires_grad_(True)
        hl = halo0.to(device).requires_grad_(True)
        solid = s * 1.0
        out = c(block, torch.cat([solid, hl * 1.0]), h_dst=solid)
        out.backward(g.to(device))
        got.append((out.detach(), s.grad, hl.grad, c.lin_self.weight.grad, c.lin_neigh.weight.grad))
    for a, b in zip(got[1], got[0]):
        _close(a, b)
    x = torch.randn(dev.num_src, 4, device=CUDA, requires_grad=True)
    w = torch.rand(dev.num_edges, device=CUDA, requires_grad=True)
    with pytest.raises(RuntimeError, match="edge ids"):
        agg.aggregate_sum(dev, x, w, backend="torch").backward(torch.randn(dev.num_dst, 4, device=CUDA))


@pytest.mark.parametrize("arch", ["sage", "gcn", "gat"])
def test_a_layer_from_its_exchanged_projection_on_cuda(arch):
    """The in-memory full graph's exchanged projection (this stop, unmeasured on a GPU until
    now): each rank's rows projected apart (``conv.projection`` of the solid and of the halo
    rows), joined, then ``GNN.layer_forward_from_projection`` on a CUDA block with the torch
    kernels, equals the native layer on the joined input on the CPU, in values and every
    gradient, for a last layer whose projection is narrower than its input."""
    from hpcgnn.nn.conv import gcn_norm
    from hpcgnn.nn.models import build_model

    host = random_block(1300, 1000, 8000, seed=7)
    if arch == "gat":
        host.transpose()          # GAT's backward reads the transpose's edge ids
    else:
        host.drop_edge_ids()
    dev = host.to(CUDA)
    torch.manual_seed(0)
    model = build_model(arch, 32, 16, 5, num_layers=2, heads=2, dropout=0.0)
    assert model.layers[1].exchanges_projection
    deg = torch.randint(0, 9, (host.num_src,))
    solid0, halo0 = torch.randn(1000, model.layers[1].in_dim), torch.randn(300, model.layers[1].in_dim)
    g = torch.randn(1000, 5)
    got = []
    for block, device, backend in ((host, "cpu", "native"), (dev, CUDA, "torch")):
        m = copy.deepcopy(model).to(device)
        for conv in m.layers:
            conv.backend = backend
        conv = m.layers[1]
        kw = {"src_scale": gcn_norm(deg).to(device), "dst_scale": gcn_norm(deg[:1000]).to(device)} \
            if arch == "gcn" else {}
        s, hl = solid0.to(device).requires_grad_(True), halo0.to(device).requires_grad_(True)
        if device == "cpu":
            out = m.layer_forward(1, block, torch.cat([s, hl]), **kw)
        else:
            pk = {"src_scale": kw["src_scale"][:1000]} if arch == "gcn" else {}
            hk = {"src_scale": kw["src_scale"][1000:]} if arch == "gcn" else {}
            p = torch.cat([conv.projection(s, **pk), conv.projection(hl, **hk)])
            out = m.layer_forward_from_projection(1, block, p, h_dst=s, **kw)
        out.backward(g.to(device))
        got.append([out.detach(), s.grad, hl.grad] + [q.grad for q in conv.parameters()])
    for a, b in zip(got[1], got[0]):
        _close(a, b)
