"""native/spmm.cpp kernels against pure-torch references (index_add / scatter)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nn_blocks import edge_dst, random_block  # noqa: E402

from hpcgnn.native import spmm  # noqa: E402

# (num_src, num_dst, nnz, zero_rows): includes zero-degree destinations, an empty edge
# set, an empty destination set and a block with a feature row wider than one chunk.
SHAPES = [(40, 25, 300, 5), (7, 7, 0, 0), (5, 0, 0, 0), (300, 200, 3000, 17), (1, 1, 4, 0)]


def np_(t):
    return t.numpy()


def ref_sum(block, x, w=None, scale=None):
    msg = x[block.indices] * (1 if w is None else w.unsqueeze(1))
    out = torch.zeros(block.num_dst, x.shape[1], dtype=x.dtype).index_add_(0, edge_dst(block), msg)
    return out if scale is None else out * scale.unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [1, 13, 47, 64, 100, 150])  # partial chunks: 0-15 vectors + tail
def test_spmm_sum_matches_index_add(shape, dim, dtype):
    ns, nd, nnz, zr = shape
    b = random_block(ns, nd, nnz, seed=dim, zero_rows=zr)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ns, dim, generator=g, dtype=dtype)
    w = torch.rand(b.indices.shape[0], generator=g, dtype=dtype)
    scale = torch.rand(nd, generator=g, dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    out = torch.full((nd, dim), float("nan"), dtype=dtype)  # every row must be written
    spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(x), np_(out))
    torch.testing.assert_close(out, ref_sum(b, x), **tol)
    spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(x), np_(out), np_(w), None, np_(scale))
    torch.testing.assert_close(out, ref_sum(b, x, w, scale), **tol)
    col = torch.rand(ns, generator=g, dtype=dtype)   # per-source factor (mean/GCN backward)
    spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(x), np_(out), None, None, None, np_(col))
    torch.testing.assert_close(out, ref_sum(b, x * col.unsqueeze(1)), **tol)
    # weights read through an index (the transpose's edge ids): w[perm[j]] for edge j
    perm = torch.randperm(b.indices.shape[0], generator=g)
    spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(x), np_(out), np_(w), np_(perm))
    torch.testing.assert_close(out, ref_sum(b, x, w[perm]), **tol)
    if zr and nnz:
        assert (out[:zr] == 0).all()


def plain_loop_sum(block, x, scale=None):
    """out[v] = scale[v] * (((0 + x[u_0]) + x[u_1]) + ...) over v's edges in CSR order, every
    operation rounded in x's dtype: the order the kernels promise. Vectorised over rows: step
    k adds every row's k-th edge."""
    deg = block.indptr[1:] - block.indptr[:-1]
    acc = torch.zeros(block.num_dst, x.shape[1], dtype=x.dtype)
    for k in range(int(deg.max()) if deg.numel() else 0):
        rows = torch.nonzero(deg > k).flatten()
        acc[rows] = acc[rows] + x[block.indices[block.indptr[rows] + k]]
    return acc if scale is None else acc * scale.unsqueeze(1)


@pytest.mark.parametrize("dim", [1, 7, 8, 9, 15, 47, 48, 100, 127, 128, 129, 200, 256])
def test_spmm_sum_is_the_plain_loop_bitwise(dim):
    """Every float32 chunk form (full 128-wide rows, 8-wide vectors plus a tail that re-reads
    the chunk's last 8 columns, rows narrower than 8) adds the same terms in the same order.
    (Weighted terms are compared with a tolerance above: the AVX2 copy may fuse w * x + acc.)"""
    b = random_block(300, 200, 3000, seed=dim, zero_rows=17)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, dim, generator=g)
    scale = torch.rand(200, generator=g)
    out = torch.full((200, dim), float("nan"))
    spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(x), np_(out))
    assert torch.equal(out, plain_loop_sum(b, x))
    spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(x), np_(out), None, None, np_(scale))
    assert torch.equal(out, plain_loop_sum(b, x, scale))


@pytest.mark.parametrize("dim", [31, 64, 65, 128])
def test_float64_spmm_sum_is_the_plain_loop_bitwise(dim):
    """float64 chunks are 64 wide: rows of one chunk (64), full chunks plus a partial one."""
    b = random_block(300, 200, 3000, seed=dim, zero_rows=17)
    x = torch.randn(300, dim, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = torch.full((200, dim), float("nan"), dtype=torch.float64)
    spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(x), np_(out))
    assert torch.equal(out, plain_loop_sum(b, x))


@pytest.mark.parametrize("dim", [1, 7, 9, 47, 100, 128, 129, 256])
def test_spmm_sum_bf16_is_the_float32_kernel_on_the_widened_rows(dim):
    """bfloat16 rows (int16 bit patterns) give bitwise the float32 kernel's result on the same
    rows widened, with a row scale and with a column scale (the mean and its adjoint)."""
    b = random_block(300, 200, 3000, seed=dim, zero_rows=17)
    g = torch.Generator().manual_seed(3)
    xb = torch.randn(300, dim, generator=g).bfloat16()
    bits, xf = xb.view(torch.int16).numpy(), xb.float()
    scale, col = torch.rand(200, generator=g), torch.rand(300, generator=g)
    out, ref = torch.full((200, dim), float("nan")), torch.empty(200, dim)
    for kw in ({}, {"row_scale": np_(scale)}, {"col_scale": np_(col)}):
        spmm.spmm_sum_bf16(np_(b.indptr), np_(b.indices), bits, np_(out), **kw)
        spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(xf), np_(ref), **kw)
        assert torch.equal(out, ref), kw
    with pytest.raises(ValueError, match="int16"):
        spmm.spmm_sum_bf16(np_(b.indptr), np_(b.indices), np_(xf), np_(out))
    with pytest.raises(ValueError, match="outside"):
        spmm.spmm_sum_bf16(np_(b.indptr), np_(b.indices + 300), bits, np_(out))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hd,dtype", [
    ((1, 5), torch.float64), ((4, 16), torch.float64), ((3, 70), torch.float64),   # double: 32-wide chunks
    ((3, 32), torch.float32), ((5, 8), torch.float32), ((2, 64), torch.float32),   # heads grouped per chunk
    ((20, 4), torch.float32), ((4, 12), torch.float32), ((2, 100), torch.float32)])  # last two: per head
def test_spmm_heads_and_sddmm_match_reference(shape, hd, dtype):
    ns, nd, nnz, zr = shape
    h, d = hd
    b = random_block(ns, nd, nnz, seed=3, zero_rows=zr)
    g = torch.Generator().manual_seed(2)
    m = b.indices.shape[0]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    z = torch.randn(ns, h, d, generator=g, dtype=dtype)
    alpha = torch.randn(m, h, generator=g, dtype=dtype)
    ids = edge_dst(b)

    def ref(a, self_w=None):
        out = torch.zeros(nd, h, d, dtype=dtype).index_add_(0, ids, z[b.indices] * a.unsqueeze(2))
        if self_w is not None:
            out[:self_w.shape[0]] += self_w.unsqueeze(2) * z[:self_w.shape[0]]
        return out

    out = torch.full((nd, h, d), float("nan"), dtype=dtype)
    spmm.spmm_heads(np_(b.indptr), np_(b.indices), np_(alpha), np_(z), np_(out))
    torch.testing.assert_close(out, ref(alpha), **tol)
    perm = torch.randperm(m, generator=g)
    spmm.spmm_heads(np_(b.indptr), np_(b.indices), np_(alpha), np_(z), np_(out), np_(perm))
    torch.testing.assert_close(out, ref(alpha[perm]), **tol)
    # self term on the first rows (GAT self loop; fewer rows than out in the transposed use)
    self_w = torch.randn(max(nd - 2, 0), h, generator=g, dtype=dtype)
    spmm.spmm_heads(np_(b.indptr), np_(b.indices), np_(alpha), np_(z), np_(out), None, np_(self_w))
    torch.testing.assert_close(out, ref(alpha, self_w), **tol)
    a = torch.randn(nd, h, d, generator=g, dtype=dtype)
    dots = torch.full((m, h), float("nan"), dtype=dtype)
    self_dots = torch.full((max(nd - 2, 0), h), float("nan"), dtype=dtype)
    spmm.sddmm_heads(np_(b.indptr), np_(b.indices), np_(a), np_(z), np_(dots), np_(self_dots))
    torch.testing.assert_close(dots, (a[ids] * z[b.indices]).sum(-1), **tol)
    torch.testing.assert_close(self_dots, (a[:nd - 2] * z[:nd - 2]).sum(-1) if nd >= 2 else self_dots, **tol)


@pytest.mark.parametrize("shape", SHAPES)
def test_segment_sum_and_edge_logits(shape):
    ns, nd, nnz, zr = shape
    b = random_block(ns, nd, nnz, seed=4, zero_rows=zr)
    g = torch.Generator().manual_seed(3)
    m, h = b.indices.shape[0], 3
    vals = torch.randn(m, h, generator=g)
    out = torch.full((nd, h), float("nan"))
    spmm.segment_sum(np_(b.indptr), np_(vals), np_(out))
    torch.testing.assert_close(out, torch.zeros(nd, h).index_add_(0, edge_dst(b), vals))
    # through the transpose: per-source sums
    t_ptr, t_idx, t_eid = spmm.csr_transpose(np_(b.indptr), np_(b.indices), ns)
    out_src = torch.full((ns, h), float("nan"))
    spmm.segment_sum(t_ptr, np_(vals), np_(out_src), t_eid)
    torch.testing.assert_close(out_src, torch.zeros(ns, h).index_add_(0, b.indices, vals))
    el, er = torch.randn(ns, h, generator=g), torch.randn(nd, h, generator=g)
    s = torch.empty(m, h)
    spmm.gat_edge_logits(np_(b.indptr), np_(b.indices), np_(el), np_(er), 0.2, np_(s))
    torch.testing.assert_close(s, torch.nn.functional.leaky_relu(el[b.indices] + er[edge_dst(b)], 0.2))


def ref_softmax(b, logits, self_logits=None):
    """torch.softmax over a padded [num_dst, max_degree (+1 self), H] layout (-inf padding)."""
    ids = edge_dst(b)
    m, h = logits.shape
    pos = torch.arange(m) - b.indptr[ids]
    width = int(b.in_degree().max()) if b.num_dst and m else 0
    dense = torch.full((b.num_dst, width + 1, h), float("-inf"), dtype=logits.dtype)
    dense = dense.index_put((ids, pos), logits)
    if self_logits is not None:
        dense = dense.index_put((torch.arange(b.num_dst), torch.full((b.num_dst,), width)), self_logits)
    p = torch.nan_to_num(torch.softmax(dense, 1), nan=0.0)  # all -inf rows: no edges
    self_alpha = None if self_logits is None else p[:, width]
    return p[ids, pos], self_alpha


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_self", [False, True])
def test_edge_softmax_forward_backward(shape, with_self):
    ns, nd, nnz, zr = shape
    b = random_block(ns, nd, nnz, seed=5, zero_rows=zr)
    g = torch.Generator().manual_seed(4)
    m, h = b.indices.shape[0], 2
    logits = (torch.randn(m, h, generator=g, dtype=torch.float64) * 30).requires_grad_()  # large: needs max-shift
    sl = (torch.randn(nd, h, generator=g, dtype=torch.float64) * 30).requires_grad_() if with_self else None
    ref_a, ref_sa = ref_softmax(b, logits, sl)
    alpha = torch.empty(m, h, dtype=torch.float64)
    sa = torch.empty(nd, h, dtype=torch.float64) if with_self else None
    spmm.edge_softmax(np_(b.indptr), logits.detach().numpy(), np_(alpha),
                      None if sl is None else sl.detach().numpy(), None if sa is None else np_(sa))
    torch.testing.assert_close(alpha, ref_a.detach(), atol=1e-12, rtol=1e-10)
    if with_self:
        torch.testing.assert_close(sa, ref_sa.detach(), atol=1e-12, rtol=1e-10)
    # backward against autograd through the reference
    ga = torch.randn(m, h, generator=g, dtype=torch.float64)
    gsa = torch.randn(nd, h, generator=g, dtype=torch.float64) if with_self else None
    loss = (ref_a * ga).sum() + ((ref_sa * gsa).sum() if with_self else 0)
    inputs = [logits] + ([sl] if with_self else [])
    if not loss.requires_grad:  # nothing to differentiate (no edges, no destinations)
        assert m == 0 and (nd == 0 or not with_self)
        return
    want = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
    got = torch.empty(m, h, dtype=torch.float64)
    got_self = torch.empty(nd, h, dtype=torch.float64) if with_self else None
    spmm.edge_softmax_backward(np_(b.indptr), np_(alpha), np_(ga), np_(got),
                               None if sa is None else np_(sa), None if gsa is None else np_(gsa),
                               None if got_self is None else np_(got_self))
    if m:
        torch.testing.assert_close(got, want[0], atol=1e-12, rtol=1e-10)
    if with_self:
        torch.testing.assert_close(got_self, want[1], atol=1e-12, rtol=1e-10)
    # softmax rows sum to one (with the self edge), empty rows have nothing
    sums = torch.zeros(nd, h, dtype=torch.float64).index_add_(0, edge_dst(b), alpha)
    if with_self:
        sums += sa
    deg = b.in_degree()
    want_sum = torch.ones(nd, h, dtype=torch.float64) if with_self else (deg > 0).double().unsqueeze(1).expand(nd, h)
    torch.testing.assert_close(sums, want_sum)


@pytest.mark.parametrize("shape", SHAPES + [(2000, 1500, 200_000, 3)])
def test_csr_transpose_is_stable_counting_sort(shape):
    ns, nd, nnz, zr = shape
    b = random_block(ns, nd, nnz, seed=6, zero_rows=zr)
    t_ptr, t_idx, t_eid = spmm.csr_transpose(np_(b.indptr), np_(b.indices), ns)
    order = np.argsort(b.indices.numpy(), kind="stable")
    np.testing.assert_array_equal(t_eid, order)
    np.testing.assert_array_equal(t_idx, edge_dst(b).numpy()[order])
    np.testing.assert_array_equal(t_ptr, np.concatenate([[0], np.cumsum(np.bincount(b.indices.numpy(), minlength=ns))]))


def test_results_are_bitwise_identical_for_any_thread_count():
    b = random_block(3000, 2000, 60_000, seed=7, zero_rows=2)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3000, 96, generator=g)
    w = torch.rand(60_000, generator=g)
    old = spmm.max_threads()
    sums, transposes = [], []
    try:
        for t in (1, 2, 3):
            spmm.set_threads(t)
            out = torch.empty(2000, 96)
            spmm.spmm_sum(np_(b.indptr), np_(b.indices), np_(x), np_(out), np_(w))
            sums.append(out)
            transposes.append(np.concatenate(spmm.csr_transpose(np_(b.indptr), np_(b.indices), 3000)))
    finally:
        spmm.set_threads(old)
    assert all(torch.equal(sums[0], s) for s in sums[1:])
    assert all(np.array_equal(transposes[0], t) for t in transposes[1:])


@pytest.mark.parametrize("dtype, dim", [(np.float32, 128), (np.float64, 64), (np.float32, 200)])
def test_large_outputs_take_the_streaming_store_path_exactly(dtype, dim):
    """Outputs of >= 64 MiB are written with streaming stores (AVX builds); values stay exact.

    Two edges per row and a power-of-two row scale make the reference exact: out[v] =
    0.5 * (X[a_v] + X[b_v]). dim 200 float32 (800-byte rows, not a multiple of 32 bytes) and
    an output that starts 4 bytes off a 32-byte boundary take the ordinary store path.
    """
    rows = (64 << 20) // (dim * np.dtype(dtype).itemsize) + 1
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, dim)).astype(dtype)
    indices = rng.integers(0, rows, 2 * rows)
    indptr = np.arange(0, 2 * rows + 1, 2, dtype=np.int64)
    scale = np.full(rows, 0.5, dtype=dtype)
    expected = (x[indices[0::2]] + x[indices[1::2]]) * dtype(0.5)
    out = np.empty_like(x)
    spmm.spmm_sum(indptr, indices, x, out, row_scale=scale)
    np.testing.assert_array_equal(out, expected)
    if dtype is np.float32 and dim == 128:  # misaligned output rows
        buf = np.empty(rows * dim + 1, dtype=dtype)
        shifted = buf[1:].reshape(rows, dim)
        spmm.spmm_sum(indptr, indices, x, shifted, row_scale=scale)
        np.testing.assert_array_equal(shifted, expected)


@pytest.mark.parametrize("dim", [128, 100, 256])   # one chunk (in registers), partial, two chunks
@pytest.mark.parametrize("bad", [-1, 3000, 2**62])
def test_source_index_outside_raises_in_any_row_task(dim, bad):
    """Each task of 64 rows checks its own edges' indices: one bad index in a middle task, with
    threads, raises ValueError (and a good graph of the same shape still computes)."""
    b = random_block(3000, 2000, 40_000, seed=dim)
    x = np.ones((3000, dim), np.float32)
    out = np.empty((2000, dim), np.float32)
    ix = np_(b.indices).copy()
    middle = int(b.indptr[1000])                                  # first edge of row 1000: task 15 of 32
    spmm.spmm_sum(np_(b.indptr), ix, x, out)
    deg = np.diff(np_(b.indptr)).astype(np.float32)
    assert np.array_equal(out, np.repeat(deg[:, None], dim, 1))
    ix[middle] = bad
    for xx in (x, x.astype(np.float64)):
        with pytest.raises(ValueError, match="outside"):
            spmm.spmm_sum(np_(b.indptr), ix, xx, out if xx.dtype == np.float32 else out.astype(np.float64))
    with pytest.raises(ValueError, match="outside"):
        spmm.spmm_sum_bf16(np_(b.indptr), ix, np.zeros((3000, dim), np.int16), out)


def test_bad_arguments_raise_value_error():
    b = random_block(10, 5, 30, seed=8)
    ip, ix = np_(b.indptr), np_(b.indices)
    x = np.zeros((10, 4), np.float32)
    out = np.zeros((5, 4), np.float32)
    with pytest.raises(ValueError, match="outside"):
        spmm.spmm_sum(ip, ix, x[:3], out)                     # sources beyond X's rows
    with pytest.raises(ValueError, match="float32 or float64"):
        spmm.spmm_sum(ip, ix, x.astype(np.float16), out)
    with pytest.raises(ValueError, match="float32"):
        spmm.spmm_sum(ip, ix, x, out.astype(np.float64))      # mixed dtypes: no silent copy
    with pytest.raises(ValueError, match="C-contiguous"):
        spmm.spmm_sum(ip, ix, x, np.zeros((4, 5), np.float32).T)  # output not contiguous
    with pytest.raises(ValueError, match="out rows"):
        spmm.spmm_sum(ip, ix, x, np.zeros((6, 4), np.float32))
    with pytest.raises(ValueError, match="int64"):
        spmm.spmm_sum(ip.astype(np.int32), ix, x, out)
    with pytest.raises(ValueError, match="indptr"):
        spmm.spmm_sum(ip[::-1].copy(), ix, x, out)
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        spmm.spmm_sum(ip, ix, x, ro)
    with pytest.raises(ValueError, match="outside"):
        spmm.csr_transpose(ip, ix, 3)
