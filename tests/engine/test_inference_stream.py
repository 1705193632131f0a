"""Layer-wise inference with the features elsewhere than the compute device (host rows of a
tiered or host-only store): the first layer's rows are streamed to the device in chunks of
``rows`` where it works row-wise, not copied whole, and the output is bit for bit the one of
features already on the device (the CPU stands in for both sides; every copy to the device is
recorded at ``hpcgnn.engine.inference._on``)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_inference import SimulatedHalo, _graph, _owner_rows, _reference  # noqa: E402

from hpcgnn.engine import inference  # noqa: E402
from hpcgnn.nn.models import build_model  # noqa: E402


@pytest.mark.parametrize("arch,hidden,chunked", [("gcn", 8, True), ("gat", 8, True), ("sage", 8, True),
                                                 ("sage", 32, False)])
def test_features_stream_in_chunks_and_give_the_same_output(arch, hidden, chunked, monkeypatch):
    indptr, indices = _graph()
    n, s, rows = indptr.size - 1, 250, 37
    torch.manual_seed(0)
    model = build_model(arch, 24, hidden, 5, 2, heads=2, dropout=0.0).eval()
    x = torch.randn(n, 24)
    deg = torch.from_numpy(np.diff(indptr)).float()
    scale = (deg + 1).rsqrt() if arch == "gcn" else None
    ref = _reference(model, indptr, indices, x, scale)

    def run(device):
        halo = SimulatedHalo(s, n - s, 2, _owner_rows(model, ref, x, scale, s))
        return inference.layerwise_inference(model, indptr[:s + 1], indices[:indptr[s]], x[:s].clone(), halo,
                                             rows=rows, gcn_scale=None if scale is None else scale[:s],
                                             device=device)

    whole = run(None)
    moved = []
    real = inference._on

    def spy(t, device):
        if device is not None:
            moved.append(int(t.shape[0]))
        return real(t, device)

    monkeypatch.setattr(inference, "_on", spy)
    streamed = run("cpu")
    assert torch.equal(streamed, whole)
    assert moved and sum(moved) >= s
    if chunked:      # row-wise first layer: no copy larger than one chunk of rows
        assert max(moved) <= rows, max(moved)
    else:            # an unprojected SAGE aggregation reads all its rows: one whole copy
        assert max(moved) == s
