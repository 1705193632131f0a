"""`hpcgnn infer`'s argument rules without MPI: layer numbering (1-based, default the last
hidden layer) and configurations of older run files filled with defaults."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcgnn.commands.infer import resolve_layer, run_config  # noqa: E402
from hpcgnn.errors import InputError  # noqa: E402


@pytest.mark.parametrize("what,layer,layers,want", [
    ("logits", None, 3, 3), ("predictions", None, 2, 2), ("logits", 3, 3, 3),
    ("embeddings", None, 3, 2), ("embeddings", None, 2, 1), ("embeddings", 1, 3, 1),
    ("embeddings", 3, 3, 3),
])
def test_layer_numbering(what, layer, layers, want):
    assert resolve_layer(what, layer, layers) == want


@pytest.mark.parametrize("what,layer,layers,text", [
    ("embeddings", 0, 2, "--layer 0: expected 1..2"),
    ("embeddings", 3, 2, "--layer 3: expected 1..2"),
    ("embeddings", -1, 2, "--layer -1"),
    ("embeddings", None, 1, "no hidden layer"),
    ("logits", 1, 2, "--layer 1: --what logits"),
    ("probabilities", None, 2, "--what 'probabilities'"),
])
def test_bad_layer_or_what(what, layer, layers, text):
    with pytest.raises(InputError) as exc:
        resolve_layer(what, layer, layers)
    assert text in str(exc.value) and "\n" not in str(exc.value)


def test_run_config_fills_keys_a_run_file_predates():
    cfg = run_config(json.dumps({"model": {"arch": "gcn", "layers": 3}, "train": {"engine": "fullgraph"}}),
                     "run.h5")
    assert cfg.model.arch == "gcn" and cfg.model.layers == 3 and cfg.train.engine == "fullgraph"
    assert cfg.minibatch.eval_rows == 0 and cfg.tensor.chunks >= 1   # defaults
    with pytest.raises(InputError, match="run.h5: attribute 'config' is not JSON"):
        run_config("{not json", "run.h5")
