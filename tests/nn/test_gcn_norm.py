"""GCN normalisation: one definition (hpcgnn.nn.conv's docstring) in training and evaluation.

The definition, computed here independently: a GCN layer scales by ``(degree + 1)^-1/2``
(float64, rounded once to float32) the degrees of the graph it runs on: a sampled block's own
(source out-degree, destination in-degree) in minibatch training, the whole graph's in the
full-neighbour evaluation and `hpcgnn infer`.
"""
from pathlib import Path

import h5py
import numpy as np
import torch

from hpcgnn.data.graph import read_topology
from hpcgnn.nn.conv import GCNConv
from hpcgnn.nn.models import build_model
from hpcgnn.partition.store import META_FILE, load_partition
from hpcgnn.sampling.neighbor import NeighborSampler


def definition(degree) -> torch.Tensor:
    d = np.asarray(degree, dtype=np.float64)
    return torch.from_numpy((1.0 / np.sqrt(d + 1.0)).astype(np.float32))


def scales_used(conv: GCNConv, block, h, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) scales ``conv`` applies on ``block`` when the caller passes none
    (the minibatch engine's training forward)."""
    seen = {}
    source_rows, from_source_rows = GCNConv.source_rows, GCNConv._from_source_rows

    def spy_source(self, h, src_scale):
        seen["src"] = src_scale.detach().clone()
        return source_rows(self, h, src_scale)

    def spy_from_source_rows(self, block, y, dst_scale):
        seen["dst"] = dst_scale.detach().clone()
        return from_source_rows(self, block, y, dst_scale)

    monkeypatch.setattr(GCNConv, "source_rows", spy_source)
    monkeypatch.setattr(GCNConv, "_from_source_rows", spy_from_source_rows)
    conv(block, h)
    monkeypatch.undo()
    return seen["src"], seen["dst"]


def test_training_and_evaluation_scale_by_the_one_definition(cora_graph, cora_parts, monkeypatch):
    store = cora_parts(2)
    part = load_partition(store, 0)
    indptr, indices = part.local_csr()
    torch.manual_seed(0)
    model = build_model("gcn", part.features.shape[1], 16, part.num_classes, 2, dropout=0.0)

    # training: a sampled minibatch as the engine runs it (halo last), and a block after HEC misses
    sampler = NeighborSampler(indptr, indices, part.num_solid, [10, 10], seed=3, num_local=part.num_local)
    batch = sampler.sample(torch.arange(0, part.num_solid, 7)).halo_last(part.num_solid)
    block = batch.blocks[0]
    keep = torch.rand(block.num_src) > 0.2
    keep[:block.num_dst] = True
    for blk in (block, block.drop_sources(keep)):
        h = torch.randn(blk.num_src, part.features.shape[1])
        src, dst = scales_used(model.layers[0], blk, h, monkeypatch)
        out_deg = np.bincount(blk.indices.numpy(), minlength=blk.num_src)
        assert torch.equal(src, definition(out_deg))
        assert torch.equal(dst, definition(np.diff(blk.indptr.numpy())))
        assert out_deg.max() < part.degree.max()    # a sampled block's degrees, not the graph's

    # evaluation and inference: the whole graph's degrees, from the graph file itself
    import hpcgnn.engine.inference as inference

    seen = {}
    monkeypatch.setattr(inference, "layerwise_inference", lambda *a, **kw: seen.update(kw))
    inference.partition_inference(model, part, None, torch.from_numpy(part.features), "cpu")
    g_indptr, _, _ = read_topology(cora_graph)
    with h5py.File(Path(store) / META_FILE, "r") as f:
        orig = np.asarray(f["new_to_orig"][part.solid_begin:part.solid_end])
    assert torch.equal(seen["gcn_scale"], definition(np.diff(g_indptr)[orig]))
