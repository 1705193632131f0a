"""Bounded-memory layer-wise inference (hpcgnn.engine.inference) against today's unchunked path.

The reference runs ``model.layer_forward`` over one block holding the whole graph, as the
minibatch engine's evaluation did before chunking. A second vertex range plays the halo of a
partition: its rows are filled per layer from the reference's own outputs, so chunking and halo
handling are checked in one process; tests/engine/test_inference_mpi.py checks 1/2/4 real ranks.
"""
import numpy as np
import pytest
import torch

from hpcgnn.comm.halo import HaloPlan, HaloRounds
from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.engine.inference import auto_rows, chunk_block, layerwise_inference
from hpcgnn.nn.models import build_model
from hpcgnn.sampling.block import Block


def _graph(n=400, m=2400, seed=0):
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, n, m), rng.integers(0, n, m)
    indptr, indices, _ = build_symmetric_csr(src, dst, n)
    return indptr, indices


def _reference(model, indptr, indices, x, scale):
    """Per-layer outputs over the whole graph (today's path: one block, layer_forward)."""
    n = x.shape[0]
    block = Block(n, n, torch.from_numpy(indptr), torch.from_numpy(indices))
    kw = {"src_scale": scale, "dst_scale": scale} if scale is not None else {}
    outs, h = [], x
    with torch.no_grad():
        for l in range(model.num_layers):
            h = model.layer_forward(l, block, h, **kw)
            outs.append(h)
    return outs


class SimulatedHalo(HaloRounds):
    """The halo of a one-process "partition": rows come from the reference's per-layer inputs
    (what the owners would send), split into rounds by HaloRounds' own mapping."""

    def __init__(self, num_solid, num_halo, rounds, layer_rows):
        plan = HaloPlan(num_solid=num_solid, num_halo=num_halo, send_index=np.zeros(0, np.int64),
                        send_counts=np.zeros(2, np.int64), recv_counts=np.array([0, num_halo]))
        super().__init__(None, plan, rounds)
        self.layer_rows, self.layer = layer_rows, 0

    def round_rows(self, solid_rows, k):
        rows = self.layer_rows[self.layer][self.round_of == k]
        if k == self.rounds - 1:
            self.layer += 1
        return rows

    def all_rows(self, solid_rows):
        self.layer += 1
        return self.layer_rows[self.layer - 1]


def _owner_rows(model, ref, x, scale, s):
    """Per layer, the halo rows the owners send: the conv's source_rows (SAGE/GCN) or the
    layer input itself (GAT)."""
    out = []
    with torch.no_grad():
        for l, conv in enumerate(model.layers):
            h = (x if l == 0 else ref[l - 1])[s:]
            if model.arch == "gcn":
                out.append(conv.source_rows(h, scale[s:]).numpy())
            elif model.arch == "sage":
                out.append(conv.source_rows(h).numpy())
            else:
                out.append(h.numpy())
    return out


SOLID = 250


def _partition_case(arch: str, rounds: int, dropout: float):
    """A 3-layer model on the 24-feature graph, its whole-graph reference outputs and a
    "partition": solid = vertices [0, SOLID), halo = the rest (all of them, a superset is fine),
    served by a SimulatedHalo in ``rounds`` rounds. Returns ``(model, ref, halo, run)``, ``run(rows)``
    being layerwise_inference over the partition. Widths shrink and grow so both projection
    orders run (SAGE/GCN project first when out < in)."""
    indptr, indices = _graph()
    n, s = indptr.size - 1, SOLID
    torch.manual_seed(0)
    model = build_model(arch, 24, 32 if arch != "gat" else 8, 5, 3, heads=3, dropout=dropout).eval()
    x = torch.randn(n, 24)
    deg = torch.from_numpy(np.diff(indptr)).float()
    scale = (deg + 1).rsqrt() if arch == "gcn" else None
    ref = _reference(model, indptr, indices, x, scale)
    halo = SimulatedHalo(s, n - s, rounds, _owner_rows(model, ref, x, scale, s))

    def run(rows):
        return layerwise_inference(model, indptr[:s + 1], indices[:indptr[s]], x[:s].clone(), halo,
                                   rows=rows, gcn_scale=None if scale is None else scale[:s])
    return model, ref, halo, run


@pytest.mark.parametrize("arch", ["sage", "gcn", "gat"])
@pytest.mark.parametrize("rows,rounds", [(1, 1), (37, 3), (400, 1), (0, 7)])
def test_chunked_equals_whole_graph(arch, rows, rounds):
    model, ref, halo, run = _partition_case(arch, rounds, dropout=0.5)
    s = SOLID
    model.train()   # must be switched to eval inside and restored
    out = run(rows)
    assert model.training
    assert halo.layer == 3
    want = ref[-1][:s]
    assert out.shape == want.shape
    assert torch.equal(out.argmax(1), want.argmax(1))
    rel = (out - want).abs().max() / want.abs().max()
    assert rel <= 1e-5, float(rel)


@pytest.mark.parametrize("arch,builds", [("sage", 1), ("gcn", 1), ("gat", 0)])
def test_edge_groups_are_built_once_and_only_for_streamed_layers(arch, builds, monkeypatch):
    """The streamed aggregation's edge groups are built at the first SAGE/GCN layer and reused
    by every later one; a GAT model (its layers exchange their halo at once) builds none."""
    from hpcgnn.engine import inference

    calls = []
    real = inference._EdgeGroups.build

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(inference._EdgeGroups, "build", staticmethod(counting))
    indptr, indices = _graph()
    n = indptr.size - 1
    torch.manual_seed(0)
    model = build_model(arch, 24, 8, 5, 3, heads=2, dropout=0.0).eval()
    x = torch.randn(n, 24)
    deg = torch.from_numpy(np.diff(indptr)).float()
    scale = (deg + 1).rsqrt() if arch == "gcn" else None
    ref = _reference(model, indptr, indices, x, scale)
    s = 250
    halo = SimulatedHalo(s, n - s, 2, _owner_rows(model, ref, x, scale, s))
    out = layerwise_inference(model, indptr[:s + 1], indices[:indptr[s]], x[:s].clone(), halo,
                              rows=64, gcn_scale=None if scale is None else scale[:s])
    assert len(calls) == builds
    assert torch.allclose(out, ref[-1][:s], rtol=1e-5, atol=1e-5)


def test_hidden_layer_output():
    indptr, indices = _graph()
    n = indptr.size - 1
    torch.manual_seed(1)
    model = build_model("sage", 16, 20, 4, 3, dropout=0.0)
    x = torch.randn(n, 16)
    ref = _reference(model, indptr, indices, x, None)
    halo = SimulatedHalo(n, 0, 1, [np.zeros((0, 16), np.float32)] * 3)
    out = layerwise_inference(model, indptr, indices, x, halo, rows=64, num_layers=2)
    assert out.shape == (n, 20)
    assert torch.allclose(out, ref[1], rtol=1e-5, atol=1e-6)


def test_chunk_block_is_a_view_with_optional_self_loops():
    indptr, indices = _graph(50, 200)
    ip, ix = torch.from_numpy(indptr), torch.from_numpy(indices)
    b = chunk_block(ip, ix, 50, 10, 20)
    assert (b.num_src, b.num_dst) == (50, 10)
    assert b.indices.data_ptr() == ix[indptr[10]:].data_ptr()       # no copy of the edges
    s = chunk_block(ip, ix, 50, 10, 20, self_loops=True)
    for i in range(10):
        row = s.indices[s.indptr[i]:s.indptr[i + 1]].tolist()
        assert row == indices[indptr[10 + i]:indptr[11 + i]].tolist() + [10 + i]


def test_auto_rows_bounded_by_budget():
    model = build_model("sage", 100, 256, 47, 3)
    rows = auto_rows(model, 600_000, 30_000_000, budget_bytes=256 << 20)
    assert 1024 <= rows < 600_000
    assert auto_rows(model, 500, 10_000) == 500


@pytest.mark.parametrize("arch", ["sage", "gcn", "gat"])
def test_chunks_never_wait_for_the_device(arch):
    """Chunk bounds, the chunks' edges per halo round and the self loops come from the host:
    with the device's aggregation kernels (``backend="torch"``, CUDA's), the calls that would
    wait for a GPU (values read back, value-sized outputs) are the same with 1 chunk and with
    50 (the per-layer reads of the halo exchange only), and none is a value read or a boolean
    mask."""
    from host_reads import HostReads

    indptr, indices = _graph()
    n, s = indptr.size - 1, 250
    torch.manual_seed(0)
    model = build_model(arch, 12, 8, 5, 2, heads=2, dropout=0.0, backend="torch").eval()
    x = torch.randn(n, 12)
    scale = (torch.from_numpy(np.diff(indptr)).float() + 1).rsqrt() if arch == "gcn" else None
    ref = _reference(model, indptr, indices, x, scale)
    seen, outs = {}, {}
    for rows in (s, 5):
        halo = SimulatedHalo(s, n - s, 3, _owner_rows(model, ref, x, scale, s))
        with HostReads() as reads:
            outs[rows] = layerwise_inference(model, indptr[:s + 1], indices[:indptr[s]], x[:s].clone(), halo,
                                             rows=rows, gcn_scale=None if scale is None else scale[:s])
        seen[rows] = reads.names
    assert torch.allclose(outs[5], outs[s], rtol=1e-5, atol=1e-6)
    assert seen[5] == seen[s], (len(seen[5]), len(seen[s]))
    assert not {"__int__", "__bool__", "item", "bool_index", "repeat_interleave"} & set(seen[5]), seen[5]


@pytest.mark.parametrize("arch", ["sage", "gcn", "gat"])
def test_chunks_hold_one_chunks_tensors_at_a_time(arch, monkeypatch):
    """When a chunk's aggregation (or its SAGE update, its GAT combination) starts, no earlier
    chunk's block or output rows are still referenced: on a GPU each would be one more chunk's
    worth of device memory (the full evaluation at products-like 0.25, 2 ranks: peak RSS 2.04 /
    2.08 -> 1.92 / 1.97 GiB SAGE, 2.17 / 2.33 -> 2.08 / 2.09 GiB GAT 4 x 32)."""
    import weakref

    from hpcgnn.engine import inference
    from hpcgnn.nn import aggregate
    from hpcgnn.nn.conv import GATConv, SAGEConv

    earlier: list[weakref.ref] = []
    alive: list[int] = []

    def starting():
        alive.append(sum(r() is not None for r in earlier))

    def tracked(fn, *, check=True, keep=None):
        def run(*args, **kwargs):
            if check:
                starting()
            if keep is not None:
                earlier.append(weakref.ref(args[keep]))
            return fn(*args, **kwargs)
        return run

    _, _, _, run = _partition_case(arch, 3, dropout=0.0)
    monkeypatch.setattr(inference, "_store_rows", tracked(inference._store_rows, check=False, keep=1))
    monkeypatch.setattr(aggregate, "aggregate_sum", tracked(aggregate.aggregate_sum, keep=0))
    monkeypatch.setattr(SAGEConv, "update", tracked(SAGEConv.update))
    monkeypatch.setattr(GATConv, "combine", tracked(GATConv.combine, keep=1))
    run(37)
    assert len(alive) > 10 and max(alive) == 0, alive
