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
