"""The in-memory full-graph runner aggregates layer 0's features once (they never change):
the same losses, gradients and logits as aggregating them every epoch, and one aggregation
in all (one process, no MPI)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))

from toygraph import toy_graph, toy_store  # noqa: E402

from hpcgnn.run.timer import PhaseTimer  #noqa: E402
from hpcgnn.engine.fullgraph import InMemoryFullGraph, build_local_graph  # noqa: E402
from hpcgnn.engine.offload import ModelLayerOps  # noqa: E402
from hpcgnn.nn.models import build_model  # noqa: E402
from hpcgnn.partition.store import load_partition, read_meta  # noqa: E402


@pytest.fixture(scope="module")
def local_graph(tmp_path_factory):
    store = toy_store(tmp_path_factory.mktemp("fglayer0") / "s", toy_graph(200, 6.0, num_features=10, seed=4), 1)
    return build_local_graph(load_partition(store, 0, read_meta(store)), None)


def _epochs(lg, arch, hidden, cache, epochs=3):
    """(losses, final gradients, eval logits, layer-0 aggregations) of ``epochs`` Adam steps."""
    model = build_model(arch, int(lg.x0.shape[1]), hidden, int(lg.labels.max()) + 1, 3, dropout=0.0, seed=1)
    calls = []
    aggregate = ModelLayerOps.aggregate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelLayerOps, "aggregate", lambda self, l, *a: calls.append(l) or aggregate(self, l, *a))
        runner = InMemoryFullGraph(model, lg, None, torch.device("cpu"), cache_layer0=cache)
        losses, grads, logits = _train(runner, model, lg, epochs)
    return losses, grads, logits, calls


def _train(runner, model, lg, epochs):
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses, n = [], float(lg.masks["train"].sum())
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        losses.append(runner.train_step(PhaseTimer(), n))
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return losses, grads, runner.predict()


@pytest.mark.parametrize("arch", ["sage", "gcn"])
def test_layer0_aggregate_cached_once_bitwise_when_aggregating_first(local_graph, arch):
    """hidden 16 > 10 features: layer 0 aggregates first either way, so caching is bitwise."""
    got, want = _epochs(local_graph, arch, 16, True), _epochs(local_graph, arch, 16, False)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert torch.equal(got[2], want[2])
    assert got[3] == [0] and want[3] == []


def test_layer0_aggregate_cached_when_projecting_first_is_the_same_function(local_graph):
    """hidden 6 < 10 features: uncached, SAGE projects then aggregates; cached, it aggregates the
    features once and projects their mean (the same linear map, other rounding)."""
    got, want = _epochs(local_graph, "sage", 6, True), _epochs(local_graph, "sage", 6, False)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=0)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert got[3] == [0]


def test_gat_layer0_is_not_cached(local_graph):
    model = build_model("gat", int(local_graph.x0.shape[1]), 8, 5, 2, heads=2, dropout=0.0, seed=1)
    assert not InMemoryFullGraph(model, local_graph, None, torch.device("cpu")).cache_agg0


def test_halo_feature_rows_are_released_once_layer0_is_aggregated(tmp_path):
    """With halo rows (2 partitions), the runner keeps only the solid feature rows after
    aggregating layer 0, hands them to the graph (the halo rows are freed), and predicts what
    the runner that keeps every row and aggregates each time predicts."""
    store = toy_store(tmp_path / "s", toy_graph(300, 6.0, num_features=10, seed=5), 2)
    meta = read_meta(store)

    def graph():
        lg = build_local_graph(load_partition(store, 0, meta), None)
        lg.x0[lg.num_solid:] = torch.randn(lg.num_local - lg.num_solid, 10,
                                           generator=torch.Generator().manual_seed(3))
        return lg

    model = build_model("sage", 10, 16, 4, 1, dropout=0.0, seed=2)   # one layer: no exchange
    lg, ref_lg = graph(), graph()
    assert lg.num_local > lg.num_solid
    runner = InMemoryFullGraph(model, lg, None, torch.device("cpu"))
    ref = InMemoryFullGraph(model, ref_lg, None, torch.device("cpu"), cache_layer0=False)
    assert runner.x0.shape[0] == lg.num_solid and ref.x0.shape[0] == lg.num_local
    runner.release_graph_inputs(lg)
    assert lg.x0 is runner.x0
    torch.testing.assert_close(runner.predict(), ref.predict(), rtol=1e-5, atol=1e-6)
