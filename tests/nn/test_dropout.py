"""Native dropout: the mask's statistics, its adjoint, seeding, thread independence, fallbacks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcgnn.native import dropout as native
from hpcgnn.nn.dropout import Dropout, NativeDropout, dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_keep_fraction(p, dtype):
    x = torch.rand(1000, 1000, dtype=dtype) + 1.0      # no zeros in x
    torch.manual_seed(0)
    y = dropout(x, p)
    kept = y != 0
    n = x.numel()
    # binomial: the kept count is within 5 standard deviations of n (1 - p)
    assert abs(int(kept.sum()) - n * (1 - p)) < 5 * (n * p * (1 - p)) ** 0.5
    assert torch.equal(y[kept], x[kept] * torch.tensor(1 / (1 - p), dtype=dtype))
    # no structure along rows or columns: every row keeps about 1 - p of its elements
    assert (kept.to(torch.float64).mean(1) - (1 - p)).abs().max() < 0.1


def test_backward_is_the_same_mask_and_gradcheck():
    x = torch.randn(50, 7, dtype=torch.float64, requires_grad=True)
    y = NativeDropout.apply(x, 0.4, 1234)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    mask = (y != 0).to(torch.float64)
    assert torch.equal(gx, g * mask / 0.6)
    assert torch.autograd.gradcheck(lambda t: NativeDropout.apply(t, 0.4, 1234), (x,))


def test_seeded_by_torch_rng_and_replayed_by_its_state():
    x = torch.randn(300, 40)
    torch.manual_seed(7)
    a = dropout(x, 0.5)
    torch.manual_seed(7)
    b = dropout(x, 0.5)
    c = dropout(x, 0.5)
    assert torch.equal(a, b) and not torch.equal(b, c)
    state = torch.get_rng_state()
    d = dropout(x, 0.5)
    torch.set_rng_state(state)
    assert torch.equal(d, dropout(x, 0.5))


def test_same_mask_for_any_thread_count():
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    outs = []
    before = native.max_threads()
    try:
        for t in (1, 2, 3):
            native.set_threads(t)
            out = np.empty_like(x)
            native.dropout(x, out, 0.3, 99)
            outs.append(out)
    finally:
        native.set_threads(before)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    inplace = x.copy()
    native.dropout(inplace, inplace, 0.3, 99)       # out may be x
    assert np.array_equal(inplace, outs[0])


def test_module_modes_edges_and_errors():
    x = torch.randn(20, 5)
    m = Dropout(0.5)
    assert repr(m) == "Dropout(p=0.5)"
    m.eval()
    assert m(x) is x
    m.train()
    assert not torch.equal(m(x), x)
    assert dropout(x, 0.0) is x and torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    assert dropout(x.to(torch.bfloat16), 0.5).dtype == torch.bfloat16     # torch's path
    assert dropout(x.t(), 0.5).shape == (5, 20)                           # non-contiguous input
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Dropout(1.5)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        native.dropout(x.numpy(), x.numpy().copy(), 1.0, 0)
    with pytest.raises(ValueError, match="float32 or float64"):
        native.dropout(np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64), 0.5, 0)
    with pytest.raises(ValueError, match="as many elements"):
        native.dropout(np.zeros(4, dtype=np.float32), np.zeros(3, dtype=np.float32), 0.5, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu_dropout_equals_relu_then_dropout_and_its_gradient(dtype):
    from hpcgnn.nn.dropout import relu_dropout

    x = torch.randn(3001, 17, dtype=dtype)
    x[0, :3] = torch.tensor([0.0, -0.0, float("nan")], dtype=dtype)
    grad = torch.randn_like(x)
    results = []
    for fused in (True, False):
        torch.manual_seed(5)
        xi = x.clone().requires_grad_(True)
        out = relu_dropout(xi, 0.3) if fused else dropout(torch.relu(xi), 0.3)
        out.backward(grad)
        results.append((out.detach(), xi.grad))
    (o1, g1), (o2, g2) = results
    assert torch.equal(o1.nan_to_num(-7), o2.nan_to_num(-7))   # same mask, same RNG draw
    keep = ~torch.isnan(x)                                     # NaN: torch's relu grad passes it
    assert torch.equal(g1[keep], g2[keep])
    assert float((o1 == 0).double().mean()) > 0.5               # ReLU zeros about half, dropout 30 % more
    torch.manual_seed(5)
    assert torch.equal(relu_dropout(x, 0.3, training=False).nan_to_num(-7), torch.relu(x).nan_to_num(-7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu_dropout_backward_is_zero_where_the_output_is_not_positive(dtype):
    """The branch-free backward: g * scale where out > 0, +0 elsewhere even for NaN/inf g."""
    from hpcgnn.native import dropout as native_dropout

    n = 4099
    out = torch.randn(n, dtype=dtype)
    out[:4] = torch.tensor([0.0, -0.0, -1.0, 2.0], dtype=dtype)
    g = torch.randn(n, dtype=dtype)
    g[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), 3.0], dtype=dtype)
    gi = torch.empty_like(g)
    native_dropout.relu_dropout_backward(g.numpy(), out.numpy(), gi.numpy(), 0.5)
    want = torch.where(out > 0, g * 2.0, torch.zeros((), dtype=dtype))
    assert torch.equal(gi, want) and not torch.signbit(gi[out <= 0]).any()


def _saved_bytes(fn, x):
    """(output, bytes of the distinct storages autograd saves while ``fn(x)`` runs)."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(seen.values())


def _fused_against_the_two_ops(device: str, dtype=torch.float32):
    """FusedReluDropout against ``native_dropout(relu(x))`` (the two ops as F.dropout runs them
    on CUDA) from the same RNG state: outputs and input gradients bitwise, bytes kept for backward."""
    from hpcgnn.nn.dropout import FusedReluDropout

    x = torch.randn(4001, 33, dtype=dtype, device=device)
    x[0, :2] = torch.tensor([0.0, -0.0], dtype=dtype)
    grad = torch.randn_like(x)
    grad[0, 2] = float("nan")
    results = []
    for fused in (True, False):
        torch.manual_seed(11)
        xi = x.clone().requires_grad_(True)
        out, kept = _saved_bytes((lambda t: FusedReluDropout.apply(t, 0.4)) if fused
                                 else (lambda t: torch.native_dropout(torch.relu(t), 0.4, True)[0]), xi)
        out.backward(grad)
        results.append((out.detach(), xi.grad, kept))
    (o1, g1, k1), (o2, g2, k2) = results
    assert torch.equal(o1, o2)                              # the same draws
    finite = torch.isfinite(grad)            # a NaN gradient: the two ops pass 0 x NaN where dropped
    assert torch.equal(g1[finite], g2[finite]) and not torch.signbit(g1[o1 <= 0]).any()
    assert g1[0, 2] == 0 if o1[0, 2] <= 0 else torch.isnan(g1[0, 2])
    assert float((o1 == 0).double().mean()) > 0.6
    n = x.numel()
    assert k1 == n * x.element_size()                       # the output only
    assert k2 >= n * (x.element_size() + 1)                 # the ReLU output and the mask


def test_fused_relu_dropout_keeps_only_its_output_for_backward():
    _fused_against_the_two_ops("cpu")


@pytest.mark.cuda
def test_cuda_relu_dropout_is_the_two_ops_bit_for_bit_keeping_only_its_output():
    """On CUDA :func:`relu_dropout` takes the fused path: bit-identical to ``F.dropout(relu(x))``
    (same seed) and one tensor kept for backward."""
    from hpcgnn.nn.dropout import relu_dropout

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _fused_against_the_two_ops("cuda")
    x = torch.randn(2048, 64, device="cuda")
    outs = []
    for fused in (True, False):
        torch.manual_seed(3)
        xi = x.clone().requires_grad_(True)
        out = relu_dropout(xi, 0.5) if fused else torch.nn.functional.dropout(torch.relu(xi), 0.5, True)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
