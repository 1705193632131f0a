"""The exact full-graph engine (HongTu offload as an option): config section ``[fullgraph]``."""
from __future__ import annotations

from hpcgnn.errors import InputError
from hpcgnn.run.config import Key, nonneg, positive
from hpcgnn.run.engines.registry import EngineSpec
from hpcgnn.units import parse_size

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
    "halo": Key(str, "exact", "halo rows of hidden layers: 'exact' (every layer of every epoch "
                "exchanged) or 'cached' (CaPGNN JACA cache, rows at most fullgraph.staleness "
                "epochs old; docs/capgnn.md)", choices=("exact", "cached")),
    "staleness": Key(int, 1, "the hard bound S on the age (epochs) of a cached or pipelined halo "
                     "row (0 = always fresh)", nonneg, ">= 0"),
    "pipeline": Key(bool, False, "layer l of epoch t uses halo rows sent during epoch t-1 while "
                    "epoch t's exchange runs non-blocking (PipeGCN; needs staleness >= 1)"),
    "cache_memory": Key(str, "all", "halo cache budget per rank, both tiers: 'all' (every halo "
                        "row) or a size such as '512MiB'"),
    "cache_device_memory": Key(str, "all", "of that budget, the device tier: 'all' or a size "
                               "(the rest is the host tier)"),
    "halo_precision": Key(str, "fp32", "wire format of hidden-layer forward halo rows in training: "
                          "'fp32' or 'bf16' (rounded once by the owner, 2 bytes a value; layer-0 "
                          "features, gradients and evaluation stay fp32; docs/capgnn.md)",
                          choices=("fp32", "bf16")),
}


def cache_bytes(text: str, what: str) -> int | None:
    """A cache budget key's value: None for 'all', else bytes (InputError naming ``what``)."""
    return None if str(text).strip().lower() == "all" else parse_size(text, what)


def validate(cfg, label: str) -> None:
    """The cache and the pipeline run in memory only; the pipeline needs staleness >= 1."""
    fg = cfg.fullgraph
    if fg.offload and (fg.halo == "cached" or fg.pipeline):
        raise InputError(f"{label}: fullgraph.offload = true with fullgraph.halo = {fg.halo!r} / "
                         f"fullgraph.pipeline = {str(fg.pipeline).lower()}: the halo cache and the "
                         "pipeline run in memory only (set fullgraph.offload = false or halo = 'exact', "
                         "pipeline = false)")
    if fg.offload and fg.halo_precision != "fp32":
        raise InputError(f"{label}: fullgraph.offload = true with fullgraph.halo_precision = "
                         f"{fg.halo_precision!r}: reduced-precision halo rows run in memory only (set "
                         "fullgraph.offload = false or halo_precision = 'fp32')")
    if fg.pipeline and fg.staleness < 1:
        raise InputError(f"{label}: fullgraph.staleness = {fg.staleness} with fullgraph.pipeline = true: "
                         "pipelined halo rows are one epoch old (set fullgraph.staleness >= 1)")
    cache_bytes(fg.cache_memory, f"{label}: fullgraph.cache_memory")
    cache_bytes(fg.cache_device_memory, f"{label}: fullgraph.cache_device_memory")

SPEC = EngineSpec(
    name="fullgraph",
    summary="exact full-graph training, one partition per rank; HongTu host offload with chunks",
    section="fullgraph",
    keys=KEYS,
    factory="hpcgnn.engine.fullgraph:make_engine",
    memory_terms="hpcgnn.engine.memory_fullgraph:fullgraph_terms",
    validate=validate,
    # the halo cache is soft state (never checkpointed): a resumed run may change it; so may
    # the halo rows' wire format (the checkpoint holds no halo rows)
    safe_on_resume=("fullgraph.halo", "fullgraph.staleness", "fullgraph.pipeline", "fullgraph.cache_memory",
                    "fullgraph.cache_device_memory", "fullgraph.halo_precision"),
)
