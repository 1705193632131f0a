"""hpcgnn.nn.precision: bf16 products of the linear layers, float32 everything else."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hpcgnn.nn.models import build_model
from hpcgnn.nn.precision import Linear, set_precision


def test_fp32_is_plain_linear_with_the_same_state_dict():
    torch.manual_seed(0)
    a = Linear(7, 5)
    torch.manual_seed(0)
    b = nn.Linear(7, 5)
    x = torch.randn(11, 7)
    assert torch.equal(a(x), b(x)) and a.state_dict().keys() == b.state_dict().keys()


def test_bf16_rounds_the_operands_and_returns_float32_with_float32_gradients():
    torch.manual_seed(1)
    lin = set_precision(nn.Sequential(Linear(64, 9)), "bf16")[0]
    x = torch.randn(33, 64, requires_grad=True)
    y = lin(x)
    assert y.dtype == torch.float32
    want = torch.nn.functional.linear(x.detach().bfloat16(), lin.weight.detach().bfloat16(),
                                      lin.bias.detach().bfloat16()).float()
    assert torch.equal(y.detach(), want)
    exact = torch.nn.functional.linear(x.detach(), lin.weight.detach(), lin.bias.detach())
    assert 0 < float((y.detach() - exact).abs().max()) < 0.05 * float(exact.abs().max())
    y.sum().backward()
    assert x.grad.dtype == lin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.grad, x.detach().sum(0).expand(9, 64), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("arch", ["sage", "gcn", "gat"])
def test_set_precision_reaches_every_linear_of_a_model_and_back(arch):
    model = build_model(arch, 12, 8, 3, 2, heads=2, dropout=0.0, seed=0)
    lins = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert lins and all(isinstance(m, Linear) for m in lins)
    assert all(m.compute_dtype is torch.bfloat16 for m in lins if set_precision(model, "bf16"))
    assert all(m.compute_dtype is None for m in lins if set_precision(model, "fp32"))
    with pytest.raises(ValueError, match="precision must be one of"):
        set_precision(model, "fp16")


def _dense_block(n: int = 60, nnz: int = 600, seed: int = 3):
    """A full-graph-like block (every source a destination, 10 edges a row on average, a few
    rows without in-edges): the shape :func:`bf16_gather_pays` serves."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from nn_blocks import random_block
    return random_block(n, n, nnz, seed=seed, zero_rows=4)


def test_bf16_mean_gathers_the_rounded_rows_and_rounds_the_mean_once():
    from hpcgnn.nn.aggregate import aggregate_mean, aggregate_mean_bf16, bf16_gather_pays
    b = _dense_block()
    x = torch.randn(60, 100, requires_grad=True)
    assert bf16_gather_pays(b, x)
    xc = x.detach().bfloat16()
    out = aggregate_mean_bf16(b, x, xc)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, aggregate_mean(b, xc.float()).bfloat16())   # float32 sums, one rounding
    g = torch.randn(60, 100).bfloat16()
    out.backward(g)
    xf = x.detach().clone().requires_grad_(True)
    aggregate_mean(b, xf).backward(g.float())                             # the float32 adjoint of the same g
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, xf.grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="xc must be"):
        aggregate_mean_bf16(b, x, xc.float())


@pytest.mark.parametrize("in_dim,out_dim", [(16, 32), (100, 128)])
def test_bf16_sage_layer_on_a_dense_block_matches_float32(in_dim, out_dim):
    from hpcgnn.nn.conv import SAGEConv
    b = _dense_block()
    torch.manual_seed(4)
    conv = SAGEConv(in_dim, out_dim)
    x = torch.randn(60, in_dim, requires_grad=True)
    ref = conv(b, x)
    ref.square().sum().backward()
    gx, gw = x.grad.clone(), conv.lin_neigh.weight.grad.clone()
    x.grad = None
    conv.zero_grad()
    set_precision(conv, "bf16")
    out = conv(b, x)                    # the bf16-gather path (every source a destination)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
    out.square().sum().backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, gx, rtol=5e-2, atol=5e-2 * float(gx.abs().max()))
    torch.testing.assert_close(conv.lin_neigh.weight.grad, gw, rtol=5e-2, atol=5e-2 * float(gw.abs().max()))


@pytest.mark.parametrize("num_dst", [50, 80])    # with halo rows; every source a destination
def test_bf16_sage_layer_with_halo_rows_is_the_single_rounding_form_bitwise(num_dst):
    """The destinations' rounded rows come from the mean's autograd function (their gradient
    added into the input's in place) instead of a slice of a gradient-carrying copy of all rows:
    the same output and the same float32 gradients, bit for bit."""
    from hpcgnn.nn.aggregate import aggregate_mean_bf16, bf16_gather_pays
    from hpcgnn.nn.conv import SAGEConv
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from nn_blocks import random_block
    b = random_block(80, num_dst, 900, seed=6, zero_rows=3)      # 11 edges a source
    torch.manual_seed(5)
    conv = set_precision(SAGEConv(40, 48), "bf16")
    x = torch.randn(80, 40, requires_grad=True)
    assert bf16_gather_pays(b, x) and not conv.projects_first(b)
    out = conv(b, x)
    out.square().sum().backward()
    got = (out.detach(), x.grad.clone(), conv.lin_neigh.weight.grad.clone(), conv.lin_self.weight.grad.clone())
    x.grad = None
    conv.zero_grad()
    hc = x.to(torch.bfloat16)                                      # the form before: one copy, sliced
    ref = conv._joint_product(hc[:b.num_dst], aggregate_mean_bf16(b, x, hc)).float()
    ref.square().sum().backward()
    want = (ref.detach(), x.grad, conv.lin_neigh.weight.grad, conv.lin_self.weight.grad)
    for a, w in zip(got, want):
        assert torch.equal(a, w)
