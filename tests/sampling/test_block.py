"""Block: transpose round trip, drop_sources against a reference, degrees, device moves."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcgnn.native import spmm as native_spmm
from hpcgnn.sampling.block import Block, _transpose_torch


def random_block(num_dst, num_src, max_deg, seed):
    rng = np.random.default_rng(seed)
    deg = rng.integers(0, max_deg + 1, size=num_dst)
    indptr = np.zeros(num_dst + 1, dtype=np.int64)
    np.cumsum(deg, out=indptr[1:])
    indices = rng.integers(0, num_src, size=int(indptr[-1]), dtype=np.int64)  # repeats allowed
    return Block(num_src, num_dst, torch.from_numpy(indptr), torch.from_numpy(indices))


def edges_of(block):
    """[(dst, src, eid)] in edge-id order."""
    out = []
    for i in range(block.num_dst):
        for e in range(int(block.indptr[i]), int(block.indptr[i + 1])):
            out.append((i, int(block.indices[e]), e))
    return out


@pytest.mark.parametrize("shape", [(5, 9, 4), (300, 700, 12), (3000, 5000, 30)])
def test_transpose_round_trip(shape):
    block = random_block(*shape, seed=sum(shape))
    t_indptr, t_indices, t_eid = block.transpose()
    assert t_indptr.shape == (block.num_src + 1,) and t_indptr[0] == 0
    assert t_indptr[-1] == block.num_edges
    # t_eid is a permutation, rows = sources, increasing edge id inside a row
    assert torch.equal(torch.sort(t_eid).values, torch.arange(block.num_edges))
    src_of_row = torch.repeat_interleave(torch.arange(block.num_src), t_indptr.diff())
    assert torch.equal(block.indices[t_eid], src_of_row)
    assert torch.equal(block.edge_dst()[t_eid], t_indices)
    for s in range(0, block.num_src, max(1, block.num_src // 50)):
        seg = t_eid[t_indptr[s]:t_indptr[s + 1]]
        assert torch.all(seg[1:] > seg[:-1])
    # rebuilding the forward CSR from the transpose gives the block back
    order = torch.argsort(t_eid)
    rebuilt_src = src_of_row[order]
    rebuilt_dst = t_indices[order]
    assert torch.equal(rebuilt_src, block.indices)
    assert torch.equal(torch.bincount(rebuilt_dst, minlength=block.num_dst), block.in_degree())
    # the device-agnostic torch path gives the same result; the result is cached
    ref = _transpose_torch(block.indptr, block.indices, block.num_src, block.edge_dst())
    for a, b in zip(ref, (t_indptr, t_indices, t_eid)):
        assert torch.equal(a, b)
    assert block.transpose()[0] is t_indptr


def test_transpose_same_with_one_and_two_threads():
    block = random_block(20_000, 30_000, 10, seed=1)
    before = native_spmm.max_threads()
    try:
        native_spmm.set_threads(1)
        one = Block(block.num_src, block.num_dst, block.indptr, block.indices).transpose()
        native_spmm.set_threads(2)
        two = Block(block.num_src, block.num_dst, block.indptr, block.indices).transpose()
    finally:
        native_spmm.set_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_drop_sources_matches_reference():
    block = random_block(40, 120, 9, seed=4)
    keep = torch.from_numpy(np.random.default_rng(0).random(120) < 0.6)
    dropped = block.drop_sources(keep)
    assert (dropped.num_src, dropped.num_dst) == (block.num_src, block.num_dst)
    ref_indptr, ref_indices = [0], []
    for i in range(block.num_dst):
        row = block.indices[block.indptr[i]:block.indptr[i + 1]].tolist()
        ref_indices += [s for s in row if keep[s]]
        ref_indptr.append(len(ref_indices))
    assert dropped.indptr.tolist() == ref_indptr
    assert dropped.indices.tolist() == ref_indices
    assert dropped.in_degree().tolist() == np.diff(ref_indptr).tolist()
    assert torch.equal(block.drop_sources(torch.ones(120, dtype=torch.bool)).indices, block.indices)
    none = block.drop_sources(torch.zeros(120, dtype=torch.bool))
    assert none.num_edges == 0 and torch.equal(none.indptr, torch.zeros(41, dtype=torch.int64))
    with pytest.raises(ValueError, match="keep_src_mask"):
        block.drop_sources(torch.ones(119, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep_src_mask"):
        block.drop_sources(torch.ones(120, dtype=torch.int64))


def test_degree_shape_checks_and_to():
    block = random_block(7, 10, 5, seed=2)
    assert block.in_degree().tolist() == block.indptr.diff().tolist()
    assert [d for d, _, _ in edges_of(block)] == block.edge_dst().tolist()
    block.transpose()
    moved = block.to("cpu")
    assert moved is block
    meta = block.to("meta")                       # the cached transpose travels with the block
    assert meta.device.type == "meta" and meta.num_src == block.num_src
    assert all(t.device.type == "meta" for t in meta.transpose())
    with pytest.raises(ValueError, match="prefix"):
        Block(3, 4, torch.zeros(5, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="indptr"):
        Block(4, 3, torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    bad = Block(4, 2, torch.tensor([0, 1, 2]), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="num_src"):
        bad.transpose()


def test_streamed_copy_takes_the_host_transpose_built_once(monkeypatch):
    """Block.streamed_copy (a chunk streamed to the device for one use): its transpose is the
    host block's, sorted once on the host however many copies ask for it, and the bytes of
    every copy (the CSR at once, the transpose when asked) are reported. The CPU stands in for
    the device."""
    from hpcgnn.sampling import block as block_mod

    host = random_block(40, 70, 6, seed=3)
    sorts = []
    real = block_mod._spmm.csr_transpose

    def counting(*args):
        sorts.append(1)
        return real(*args)

    monkeypatch.setattr(block_mod._spmm, "csr_transpose", counting)
    counted = []
    csr_bytes = host.indptr.nbytes + host.indices.nbytes
    t_bytes = (host.num_src + 1 + 2 * host.num_edges) * 8
    for use in range(3):
        copy = host.streamed_copy("cpu", count=counted.append)
        assert counted[-1] == csr_bytes and torch.equal(copy.indices, host.indices)
        got = copy.transpose()
        assert counted[-1] == t_bytes and len(counted) == 2 * (use + 1)
        for a, b in zip(got, host.transpose()):
            assert torch.equal(a, b)
        assert copy.transpose() is got                  # cached on the copy for its backward
    assert len(sorts) == 1                              # one sort, on the host, for all uses


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_block_without_transpose_edge_ids_runs_unweighted_backward_and_refuses_weighted(backend):
    """``Block.drop_edge_ids`` (the full graph's block of a SAGE or GCN model): the transpose
    keeps its indices and drops its edge ids, in copies too (``to``; ``meta`` stands in for a
    device); the unweighted aggregation's gradient equals the full block's bit for bit on both
    kernel paths, and a weighted one stops with a RuntimeError instead of summing in the wrong
    order."""
    from hpcgnn.nn.aggregate import aggregate_sum

    full = random_block(300, 500, 12, seed=9)
    lean = Block(full.num_src, full.num_dst, full.indptr, full.indices)
    lean.drop_edge_ids()
    t_full, t_lean = full.transpose(), lean.transpose()
    assert t_lean[2] is None and torch.equal(t_lean[0], t_full[0]) and torch.equal(t_lean[1], t_full[1])
    moved = lean.to("meta")
    assert moved.transpose()[2] is None and moved.transpose()[1].device.type == "meta"
    x0, g = torch.randn(full.num_src, 16), torch.randn(full.num_dst, 16)
    grads = []
    for blk in (full, lean):
        x = x0.clone().requires_grad_(True)
        aggregate_sum(blk, x, backend=backend).backward(g)
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    w = torch.rand(full.num_edges, requires_grad=True)
    x = x0.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="edge ids"):
        aggregate_sum(lean, x, w, backend=backend).backward(g)


def test_both_sparse_directions_share_one_tensor_of_ones():
    """The torch path's adjacency and its transpose (``Block.sparse_csr``) read one values
    tensor (4 bytes an edge, not 8), each with the right shape and pattern: dense products
    equal the dense adjacency's and its transpose's."""
    blk = random_block(40, 70, 6, seed=4)
    fwd, bwd = blk.sparse_csr("cpu", torch.float32), blk.sparse_csr("cpu", torch.float32, transpose=True)
    assert fwd.values().data_ptr() == bwd.values().data_ptr()
    assert fwd.shape == (40, 70) and bwd.shape == (70, 40)
    dense = torch.zeros(40, 70).index_put_((blk.edge_dst(), blk.indices), torch.ones(blk.num_edges), accumulate=True)
    x, g = torch.randn(70, 5), torch.randn(40, 5)
    torch.testing.assert_close(fwd @ x, dense @ x)
    torch.testing.assert_close(bwd @ g, dense.t() @ g)
    assert blk.sparse_csr("cpu", torch.float64).values().dtype == torch.float64
