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

from hpcgnn.engine.common import PhaseTimer  # noqa: E402
from hpcgnn.engine.fullgraph import InMemoryFullGraph, build_local_graph  # noqa: E402
from hpcgnn.nn.models import build_model  # noqa: E402
from hpcgnn.partition.store import load_partition, read_meta  # noqa: E402


@pytest.fixture(scope="module")
def local_graph(tmp_path_factory):
    store = toy_store(tmp_path_factory.mktemp("fglayer0") / "s", toy_graph(200, 6.0, num_features=10, seed=4), 1)
    return build_local_graph(load_partition(store, 0, read_meta(store)), None)


def _epochs(lg, arch, hidden, cache, epochs=3):
    """(losses, final gradients, eval logits, layer-0 aggregations) of ``epochs`` Adam steps."""
    model = build_model(arch, int(lg.x0.shape[1]), hidden, int(lg.labels.max()) + 1, 3, dropout=0.0, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    runner = InMemoryFullGraph(model, lg, None, torch.device("cpu"))
    runner.cache_agg0 = cache and runner.cache_agg0
    calls = []
    aggregate = runner.ops.aggregate
    runner.ops.aggregate = lambda l, *a: calls.append(l) or aggregate(l, *a)
    losses, n = [], float(lg.masks["train"].sum())
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        losses.append(runner.train_step(PhaseTimer(), n))
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return losses, grads, runner.predict(), calls


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
