"""The chunk-streaming loop (hpcgnn.engine.chunk_stream) as its two consumers drive it: the
offloaded full graph (engine/offload.py) and the tensor engine's staged rounds
(engine/tensor_staging.DeviceStage). On a GPU every tensor these loops keep alive is device memory, so
the loop holds one chunk's tensors at a time: when a chunk gathers its sources from the row
buffer, no earlier chunk's gathered sources are still referenced, and no unit's arriving rows
outlive their copy into the buffer (only the next unit's pending load may be in flight). Both
held one more chunk's or unit's worth before (products-like 0.25, batches of 4 chunks: the
forward of layer 0 traced at 741 MiB, 519 MiB now; docs/plan.md)."""
from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from toygraph import toy_graph, toy_store  # noqa: E402

from hpcgnn.engine import chunk_stream  # noqa: E402


@pytest.fixture
def lifetimes(monkeypatch):
    """Patches StreamStep.sources and the loads the stream is given (ChunkStream.forward's and
    backward's ``load``); returns the record: per sources() call, how many earlier gathered
    sources and how many arrived unit rows were still alive."""
    record = {"calls": 0, "sources_alive": [], "loaded_alive": []}
    gathered: list[weakref.ref] = []
    loaded: list[weakref.ref] = []
    sources = chunk_stream.StreamStep.sources
    forward, backward = chunk_stream.ChunkStream.forward, chunk_stream.ChunkStream.backward

    def tracked_sources(self):
        record["sources_alive"].append(sum(r() is not None for r in gathered))
        record["loaded_alive"].append(sum(r() is not None for r in loaded))
        record["calls"] += 1
        x = sources(self)
        gathered.append(weakref.ref(x))
        return x

    class Arriving:
        """A unit's pending load, whose rows are recorded when the stream takes them."""

        def __init__(self, pending):
            self.pending = pending

        def get(self):
            rows, self.pending = self.pending.get(), None
            loaded.append(weakref.ref(rows))
            return rows

    def tracked(load):
        return None if load is None else (lambda u: Arriving(load(u)))

    monkeypatch.setattr(chunk_stream.StreamStep, "sources", tracked_sources)
    monkeypatch.setattr(chunk_stream.ChunkStream, "forward",
                        lambda self, load, *a, **k: forward(self, tracked(load), *a, **k))
    monkeypatch.setattr(chunk_stream.ChunkStream, "backward",
                        lambda self, *a, load=None, **k: backward(self, *a, load=tracked(load), **k))
    return record


def _assert_one_chunk_at_a_time(record):
    assert record["calls"] > 8                              # several units, several chunks each
    assert max(record["sources_alive"]) == 0, record["sources_alive"]
    assert max(record["loaded_alive"]) == 0, record["loaded_alive"]


@pytest.mark.parametrize("arch,recompute", [("sage", "auto"), ("gcn", "recompute"), ("gat", "auto")])
def test_offloaded_passes_hold_one_chunk_at_a_time(tmp_path, lifetimes, arch, recompute):
    """A training step and a prediction of the offloaded engine, 6 chunks in batches of 2, in
    forward and (recomputing) backward."""
    from hpcgnn.engine.fullgraph import OffloadedFullGraph, build_local_graph
    from hpcgnn.engine.offload import OffloadSettings
    from hpcgnn.nn.models import build_model
    from hpcgnn.partition.store import load_partition
    from hpcgnn.run.timer import PhaseTimer

    g = toy_graph(400, 6.0, num_features=12, num_classes=5, seed=11, window=40)
    graph = build_local_graph(load_partition(toy_store(tmp_path / "s", g, 1), 0), None)
    model = build_model(arch, 12, 16, 5, 3, heads=2, dropout=0.0, seed=5)
    runner = OffloadedFullGraph(model, graph, None, "cpu", OffloadSettings(chunks=6, batch_chunks=2,
                                                                           recompute=recompute))
    runner.train_step(PhaseTimer(), float(graph.masks["train"].sum()))
    runner.predict()
    _assert_one_chunk_at_a_time(lifetimes)


@pytest.mark.parametrize("kind", ["gcn", "attention"])
def test_tensor_rounds_hold_one_chunk_at_a_time(lifetimes, kind):
    """The staged (streamed) rounds of the tensor engine's propagation, forward and backward."""
    from test_tensor_device import _propagate_epochs

    graph = toy_graph(150, 5.0, num_features=6, num_classes=5, seed=11)
    _propagate_epochs(graph, kind, 4, resident=False, epochs=1)
    _assert_one_chunk_at_a_time(lifetimes)
