"""Autograd wrappers (hpcgnn.nn.aggregate): values and gradients vs references, both backends."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nn_blocks import dense_adjacency, edge_dst, random_block  # noqa: E402

from hpcgnn.nn import aggregate as agg  # noqa: E402
from hpcgnn.nn import aggregate_gat as gat  # noqa: E402

BLOCKS = [(30, 20, 150, 4), (6, 6, 0, 0), (12, 9, 40, 9), (25, 25, 90, 0)]


def _block(shape, seed=0):
    return random_block(*shape[:3], seed=seed, zero_rows=shape[3])


@pytest.mark.parametrize("shape", BLOCKS)
def test_sum_and_mean_gradcheck_float64(shape):
    b = _block(shape)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b.num_src, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(b.num_edges, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(b.num_dst, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x, w: agg.aggregate_sum(b, x, w, row_scale=scale, backend="native"),
                                    (x, w), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x: agg.aggregate_mean(b, x, backend="native"), (x,), fast_mode=True)


@pytest.mark.parametrize("shape", BLOCKS)
def test_mean_equals_dense_reference_and_zero_rows_are_zero(shape):
    b = _block(shape, seed=1)
    x = torch.randn(b.num_src, 5, dtype=torch.float64)
    a = dense_adjacency(b)
    deg = a.sum(1, keepdim=True)
    want = torch.where(deg > 0, (a @ x) / deg.clamp(min=1), torch.zeros(()))
    for backend in ("native", "torch"):
        torch.testing.assert_close(agg.aggregate_mean(b, x, backend=backend), want)
    zero = b.in_degree() == 0
    assert (agg.aggregate_mean(b, x)[zero] == 0).all()


@pytest.mark.parametrize("shape", BLOCKS)
@pytest.mark.parametrize("self_loop", [True, False])
def test_gat_aggregate_gradcheck_float64(shape, self_loop):
    b = _block(shape, seed=2)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(b.num_src, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    el = torch.randn(b.num_src, 2, generator=g, dtype=torch.float64, requires_grad=True)
    er = torch.randn(b.num_dst, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda z, el, er: gat.gat_aggregate(b, z, el, er, 0.2, self_loop=self_loop, backend="native"), (z, el, er),
        fast_mode=True)


def _values_and_grads(fn, inputs, seed=0):
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], g, allow_unused=True,
                                materialize_grads=True)
    return [out.detach(), *grads]


@pytest.mark.parametrize("shape", BLOCKS)
def test_native_float32_matches_torch_backend(shape):
    """The forced pure-torch path (used on CUDA) and the kernels agree in values and gradients."""
    b = _block(shape, seed=3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(b.num_src, 70, generator=g, requires_grad=True)
    w = torch.rand(b.num_edges, generator=g, requires_grad=True)
    z = torch.randn(b.num_src, 4, 8, generator=g, requires_grad=True)
    el = torch.randn(b.num_src, 4, generator=g, requires_grad=True)
    er = torch.randn(b.num_dst, 4, generator=g, requires_grad=True)
    cases = [
        (lambda be: (lambda x, w: agg.aggregate_sum(b, x, w, backend=be)), (x, w)),
        (lambda be: (lambda x: agg.aggregate_mean(b, x, backend=be)), (x,)),
        (lambda be: (lambda z, el, er: gat.gat_aggregate(b, z, el, er, 0.2, backend=be)), (z, el, er)),
        (lambda be: (lambda z, el, er: gat.gat_aggregate(b, z, el, er, 0.1, self_loop=False, backend=be)),
         (z, el, er)),
    ]
    for make, inputs in cases:
        native = _values_and_grads(make("native"), inputs)
        ref = _values_and_grads(make("torch"), inputs)
        for a, c in zip(native, ref):
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_edge_softmax_and_logits_against_reference():
    b = _block((30, 20, 150, 4), seed=4)
    g = torch.Generator().manual_seed(3)
    el = torch.randn(b.num_src, 3, generator=g, dtype=torch.float64)
    er = torch.randn(b.num_dst, 3, generator=g, dtype=torch.float64)
    s = gat.gat_edge_logits(b, el, er, 0.2)
    torch.testing.assert_close(s, torch.nn.functional.leaky_relu(el[b.indices] + er[edge_dst(b)], 0.2))
    alpha = gat.edge_softmax(b, s)
    sums = torch.zeros(b.num_dst, 3, dtype=torch.float64).index_add_(0, edge_dst(b), alpha)
    torch.testing.assert_close(sums, (b.in_degree() > 0).double().unsqueeze(1).expand(-1, 3))
    ref = gat.edge_softmax(b, s, backend="torch")
    torch.testing.assert_close(alpha, ref)


def test_wrong_row_count_and_backend_are_rejected():
    b = _block((30, 20, 150, 4))
    with pytest.raises(ValueError, match="num_src=30"):
        agg.aggregate_sum(b, torch.randn(29, 4))
    with pytest.raises(ValueError, match="backend"):
        agg.aggregate_sum(b, torch.randn(30, 4), backend="cuda")
    with pytest.raises(ValueError, match="native"):
        agg.aggregate_sum(b, torch.randn(30, 4).half(), backend="native")
    # 'auto' falls back to the torch path for dtypes the kernels lack
    x = torch.randn(30, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(agg.aggregate_sum(b, x).float(), agg.aggregate_sum(b, x.float()), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_empty_blocks_give_empty_or_zero_outputs_and_gradients(backend):
    empty = random_block(0, 0, 0, seed=0)
    x = torch.zeros(0, 3, 4, requires_grad=True)
    for out in (agg.aggregate_mean(empty, x, backend=backend),
                gat.gat_aggregate(empty, x, torch.zeros(0, 3), torch.zeros(0, 3), backend=backend)):
        assert out.shape == (0, 3, 4)
        out.sum().backward()
    no_edges = random_block(5, 3, 0, seed=0)
    x = torch.randn(5, 7, requires_grad=True)
    out = agg.aggregate_sum(no_edges, x, backend=backend)
    out.sum().backward()
    assert out.shape == (3, 7) and (out == 0).all() and (x.grad == 0).all()
    z = torch.randn(5, 2, 3, requires_grad=True)
    el, er = torch.randn(5, 2, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    out = gat.gat_aggregate(no_edges, z, el, er, backend=backend)   # only the self edge: out = z[:3]
    torch.testing.assert_close(out, z[:3].detach())


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_gather_rows_equals_index_select_with_invalid_rows_zero(backend):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(500, 37, generator=g)
    index = torch.randint(0, 800, (2000,), generator=g)          # >= 500: "halo", zero rows
    got = agg.gather_rows(x, index, 500, backend=backend)
    want = x[index.clamp(max=499)].clone()
    want[index >= 500] = 0
    assert torch.equal(got, want)
    inside = index[index < 500]
    assert torch.equal(agg.gather_rows(x, inside, backend=backend), x[inside])
    assert agg.gather_rows(x, index[:0], 500, backend=backend).shape == (0, 37)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("shape", BLOCKS)
@pytest.mark.parametrize("use", ["both", "agg", "dst"])
def test_sum_with_dst_equals_sum_and_slice_bitwise(shape, use, backend):
    """aggregate_sum_with_dst: the same values as (aggregate_sum, x[:num_dst]) and, with one
    gradient buffer, bitwise the gradient autograd builds from the slice and the sum (float32),
    also when only one of the two outputs is used; on either kernel path."""
    b = _block(shape, seed=3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(b.num_src, 7, generator=gen, requires_grad=True)
    scale = torch.rand(b.num_dst, generator=gen)
    ga, gd = torch.randn(b.num_dst, 7, generator=gen), torch.randn(b.num_dst, 7, generator=gen)

    def run(fused):
        x.grad = None
        if fused:
            a, d = agg.aggregate_sum_with_dst(b, x, row_scale=scale, backend=backend)
        else:
            a, d = agg.aggregate_sum(b, x, row_scale=scale, backend=backend), x[:b.num_dst]
        loss = {"both": (a * ga).sum() + (d * gd).sum(), "agg": (a * ga).sum(), "dst": (d * gd).sum()}[use]
        loss.backward()
        return a.detach(), d.detach(), x.grad.clone()

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)
    if b.num_src:
        assert torch.autograd.gradcheck(
            lambda x: agg.aggregate_sum_with_dst(b, x, row_scale=scale.double(), backend=backend),
            (x.detach().double().requires_grad_(),), fast_mode=True)
