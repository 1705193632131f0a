"""The exact full-graph engine (HongTu offload as an option): config section ``[fullgraph]``."""
from __future__ import annotations

from hpcgnn.engine.registry import EngineSpec
from hpcgnn.run.config import Key, positive

KEYS = {
    "offload": Key(bool, False, "keep layer data in host memory and stream chunks (HongTu)"),
    "chunks": Key(int, 1, "chunks per partition when offloading", positive, "> 0"),
    "batch_chunks": Key(int, 1, "chunks scheduled together (deduplication scope)", positive, "> 0"),
    "dedup": Key(bool, True, "deduplicate host-to-device transfers"),
    "order": Key(str, "cost", "chunk order: 'cost' (HongTu cost model) or 'natural'",
                 choices=("cost", "natural")),
    "recompute": Key(str, "auto", "backward: 'recompute' from a checkpoint, 'cache' the "
                     "aggregation, or 'auto' (recompute GAT, cache GCN/SAGE)",
                     choices=("auto", "recompute", "cache")),
}

SPEC = EngineSpec(
    name="fullgraph",
    summary="exact full-graph training, one partition per rank; HongTu host offload with chunks",
    section="fullgraph",
    keys=KEYS,
    factory="hpcgnn.engine.fullgraph:make_engine",
    memory_terms="hpcgnn.engine.estimate:fullgraph_terms",
)
