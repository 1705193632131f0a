"""Tensor-parallel pieces in one process: the chunk layout's de-duplicated split groups, the
propagation matrix, and the chunked split -> k rounds -> gather Function against dense torch."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from toygraph import toy_graph  # noqa: E402

from hpcgnn.comm.tensor_parallel import TPComm, TPLayout, column_bounds  # noqa: E402
from hpcgnn.engine.chunk_schedule import chunk_bounds  # noqa: E402
from hpcgnn.comm.tp_propagate import TPPropagate, TPRun  # noqa: E402
from hpcgnn.engine.tensor_staging import DeviceStage  # noqa: E402
from hpcgnn.nn.decoupled import Propagation  # noqa: E402


@pytest.fixture(scope="module")
def graph():
    return toy_graph(150, 5.0, num_features=6, num_classes=5, seed=11)


@pytest.mark.parametrize("parts,chunks", [(1, 1), (3, 1), (3, 4), (4, 7)])
def test_layout_splits_each_vertex_once_before_its_first_use(graph, parts, chunks):
    ip, ix = graph.indptr, graph.indices
    cb = chunk_bounds(ip, chunks)
    lays = [TPLayout.build(ip, ix, cb, parts, r) for r in range(parts)]
    lay = lays[0]
    v = graph.num_nodes
    # the union of the ranks' vertex sets is every vertex exactly once, near V/P each
    own = np.concatenate([l.own_ids for l in lays])
    assert np.array_equal(np.sort(own), np.arange(v))
    sizes = np.array([l.num_own for l in lays])
    assert sizes.max() - sizes.min() <= max(1, lay.num_chunks)
    if lay.num_chunks == 1:   # one chunk: contiguous equal blocks
        for r, l in enumerate(lays):
            assert np.array_equal(l.own_ids, np.arange(r * v // parts, (r + 1) * v // parts))
    # split groups: disjoint, cover V, and every source of chunk j (self included) arrives by split j
    sent = np.zeros(v, dtype=np.int64)
    arrived = np.zeros(v, dtype=bool)
    for j in range(lay.num_chunks):
        tr = lay.split_transfer(j)
        ids = tr.ids.numpy()
        sent[ids] += 1
        arrived[ids] = True
        a, b = cb[j], cb[j + 1]
        need = np.unique(np.concatenate([ix[ip[a]:ip[b]], np.arange(a, b)]))
        assert arrived[need].all()
        # grouped by owner, each owner's rows are its own local positions
        owners = lay.owner[ids]
        assert np.all(np.diff(owners) >= 0) and np.array_equal(np.bincount(owners, minlength=parts), tr.counts)
        for r, l in enumerate(lays):
            mine = l.split_transfer(j)
            assert np.array_equal(l.own_ids[mine.local.numpy()], ids[owners == r])
    assert np.all(sent == 1)
    # gathers: chunk j's destinations, to their owners
    for j in range(lay.num_chunks):
        tr = lay.gather_transfer(j)
        assert np.array_equal(np.sort(tr.ids.numpy()), np.arange(cb[j], cb[j + 1]))


@pytest.mark.parametrize("chunks", [1, 4, 7])
def test_layout_is_independent_of_the_first_read_slice(graph, chunks, monkeypatch):
    import hpcgnn.comm.tensor_parallel as tpm

    cb = chunk_bounds(graph.indptr, chunks)
    ref = TPLayout.build(graph.indptr, graph.indices, cb, 3, 1)
    for size in (1, 7, 100):
        monkeypatch.setattr(tpm, "LAYOUT_SLICE", size)
        lay = TPLayout.build(graph.indptr, graph.indices, cb, 3, 1)
        for name in ("split_order", "split_bounds", "deal", "owner", "local_pos", "own_ids", "gather_perm"):
            assert np.array_equal(getattr(lay, name), getattr(ref, name)), (size, name)


@pytest.mark.parametrize("kind", ["gcn", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_propagation_weights_are_the_rounded_float64_ones_in_any_slices(graph, kind, dtype, monkeypatch):
    import hpcgnn.nn.decoupled as dec

    deg = np.diff(graph.indptr).astype(np.float64)
    ip, ix = dec.with_self_loops(graph.indptr, graph.indices)
    s = 1.0 / np.sqrt(deg + 1.0) if kind == "gcn" else 1.0 / (deg + 1.0)
    w64 = s[ix] * np.repeat(s, np.diff(ip)) if kind == "gcn" else np.repeat(s, np.diff(ip))
    want = torch.from_numpy(w64).to(dtype)     # computed whole in float64, then rounded
    for size in (1, 5, 64, 1 << 20):
        monkeypatch.setattr(dec, "WEIGHT_SLICE", size)
        assert torch.equal(Propagation(graph.indptr, graph.indices, kind, dtype=dtype).weight, want), size


def test_column_bounds_are_within_one():
    for width, size in [(7, 4), (47, 4), (3, 4), (16, 2)]:
        w = np.diff(column_bounds(width, size))
        assert w.sum() == width and w.max() - w.min() <= 1


def _dense_adj(graph, kind):
    v = graph.num_nodes
    a = torch.zeros(v, v, dtype=torch.float64)
    dst = np.repeat(np.arange(v), np.diff(graph.indptr))
    a[dst, graph.indices] = 1.0
    a += torch.eye(v, dtype=torch.float64)
    deg = torch.from_numpy(np.diff(graph.indptr)).double() + 1
    if kind == "gcn":
        s = deg.rsqrt()
        return s[:, None] * a * s[None, :]
    return a / deg[:, None]


@pytest.mark.parametrize("kind", ["gcn", "mean"])
def test_propagation_matrix_is_normalised_adjacency(graph, kind):
    p = Propagation(graph.indptr, graph.indices, kind, dtype=torch.float64)
    assert torch.allclose(p.dense(), _dense_adj(graph, kind), atol=1e-12)


@pytest.mark.parametrize("chunks,pipeline,staged", [(1, True, None), (5, True, None), (5, False, None),
                                                    (1, True, "auto"), (5, True, "auto"), (5, False, "torch")])
@pytest.mark.parametrize("kind", ["gcn", "attention"])
def test_propagate_forward_backward_equal_dense_torch(graph, chunks, pipeline, staged, kind):
    """Unstaged, and staged through the CPU as the device (``DeviceStage``; backend 'torch' runs
    the torch operators CUDA runs), against dense float64 torch."""
    torch.manual_seed(0)
    v, width, k, c, alpha = graph.num_nodes, 5, 3, 0.9 * 0.8, 0.2
    cb = chunk_bounds(graph.indptr, chunks)
    lay = TPLayout.build(graph.indptr, graph.indices, cb, 1, 0)
    prop = Propagation(graph.indptr, graph.indices, kind, cb, dtype=torch.float64)
    stage = None if staged is None else DeviceStage(prop, "cpu", backend=staged)
    run = TPRun(TPComm(None, lay), lay, prop, pipeline, stage)
    h_full = torch.randn(v, width, dtype=torch.float64)
    h = h_full[torch.from_numpy(lay.own_ids)].clone().requires_grad_(True)
    weight = None
    if kind == "attention":
        el = torch.randn(v, dtype=torch.float64, requires_grad=True)
        er = torch.randn(v, dtype=torch.float64, requires_grad=True)
        weight = prop.attention(el, er)
        assert torch.allclose(torch.zeros(v, dtype=torch.float64).index_add_(
            0, torch.from_numpy(np.repeat(np.arange(v), np.diff(prop.indptr))), weight.detach()),
            torch.ones(v, dtype=torch.float64))
    out = TPPropagate.apply(h, weight, run, k, c, alpha)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    # dense reference in plain torch (global order)
    h_ref = h_full.clone().requires_grad_(True)
    if kind == "attention":
        el_r, er_r = el.detach().clone().requires_grad_(True), er.detach().clone().requires_grad_(True)
        dst = torch.from_numpy(np.repeat(np.arange(v), np.diff(prop.indptr)))
        src = torch.from_numpy(prop.indices)
        e = torch.nn.functional.leaky_relu(el_r[src] + er_r[dst], 0.2)
        scores = torch.full((v, v), float("-inf"), dtype=torch.float64).index_put((dst, src), e)
        a = torch.softmax(scores, dim=1)
    else:
        a = _dense_adj(graph, "gcn")
    z = h_ref
    for _ in range(k):
        z = c * (a @ z) + alpha * h_ref
    own = torch.from_numpy(lay.own_ids)
    assert torch.allclose(out.detach(), z.detach()[own], atol=1e-10)
    g_full = torch.zeros_like(z).index_copy(0, own, g)
    (z * g_full).sum().backward()
    assert torch.allclose(h.grad, h_ref.grad[own], atol=1e-10)
    if kind == "attention":
        assert torch.allclose(el.grad, el_r.grad, atol=1e-10)
        assert torch.allclose(er.grad, er_r.grad, atol=1e-10)
    # four layout collectives per call, one MPI exchange per chunk and direction
    assert run.alltoalls == 4
    assert run.tp.stats.calls == {"split": 2 * lay.num_chunks, "gather": 2 * lay.num_chunks}
    if stage is not None:
        # every round loads the chunks' rows once each (reused between consecutive chunks), and
        # the device never held more than one chunk's buffers and temporaries
        counts = stage.counter.as_dict()
        row = width * 8
        assert counts["h2d_rows_bytes"] == k * stage.rows_loaded * row + (
            k * stage.rows_loaded * row if kind == "attention" else 0)
        assert counts["h2d_rows_nodedup_bytes"] >= counts["h2d_rows_bytes"]
        assert counts["d2h_out_bytes"] == k * v * row
        # the row terms of the estimate's per-chunk working set (estimate.tensor_device_bytes)
        # with the plan's actual buffer rows and the largest chunk
        dst = int(np.diff(cb).max())
        bound = ((3 + (2 if kind == "attention" else 0)) * stage.capacity + 5 * dst) * row
        assert 0 < stage.meter.peak_bytes <= bound, (stage.meter.peak_bytes, bound)
