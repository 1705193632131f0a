"""The NeutronTP tensor-parallel full-graph engine: config section ``[tensor]``.

Every rank holds the whole topology and ``D/P`` columns of every vertex's propagated embedding;
NN layers run on ``~V/P`` vertices with full rows (see :mod:`hpcgnn.engine.tensor`).
"""
from __future__ import annotations

from hpcgnn.engine.registry import EngineSpec
from hpcgnn.errors import InputError
from hpcgnn.run.config import Key, nonneg, positive

MODES = ("decoupled", "coupled")

KEYS = {
    "mode": Key(str, "decoupled", "'decoupled': all NN layers, one split, k aggregation rounds, one "
                "gather (4 all-to-alls per epoch); 'coupled': a split and a gather around every "
                "layer's aggregation (4 x layers)", choices=MODES),
    "k": Key(int, 0, "decoupled: aggregation rounds after the NN layers (0 = model.layers)", nonneg,
             ">= 0"),
    "alpha": Key(float, 0.0, "decoupled: APPNP teleport, Z_k = gamma (1 - alpha) A Z_(k-1) + alpha Z_0",
                 lambda x: 0.0 <= x < 1.0, "in [0, 1)"),
    "gamma": Key(float, 1.0, "decoupled: edge-weight factor gamma of Z_k = gamma A Z_(k-1) (NeutronTP "
                 "eq. 9)", lambda x: 0.0 < x <= 1.0, "in (0, 1]"),
    "chunks": Key(int, 1, "destination-contiguous chunks of the aggregation, same order on every "
                  "rank; split/gather per chunk, overlapped with chunk compute", positive, "> 0"),
    "pipeline": Key(bool, True, "chunked: start every chunk's split/gather without waiting "
                    "(non-blocking all-to-alls); false = each one completes before the next step"),
}


def validate(cfg, label: str) -> None:
    """Coupled mode is a plain GCN/SAGE stack: one aggregation per layer, no teleport, no GAT."""
    t = cfg.tensor
    if t.mode == "coupled":
        if cfg.model.arch == "gat":
            raise InputError(f"{label}: model.arch = 'gat' with tensor.mode = 'coupled': attention is "
                             "precomputed only in decoupled mode (tensor.mode = 'decoupled')")
        if t.k not in (0, cfg.model.layers):
            raise InputError(f"{label}: tensor.k = {t.k} with tensor.mode = 'coupled': coupled mode "
                             f"aggregates once per layer (tensor.k = 0 or model.layers = {cfg.model.layers})")
        if t.alpha != 0.0:
            raise InputError(f"{label}: tensor.alpha = {t.alpha} with tensor.mode = 'coupled': the "
                             "teleport term is a decoupled (APPNP) setting; use tensor.alpha = 0")
        if t.gamma != 1.0:
            raise InputError(f"{label}: tensor.gamma = {t.gamma} with tensor.mode = 'coupled': gamma is "
                             "a decoupled setting; use tensor.gamma = 1")


SPEC = EngineSpec(
    name="tensor",
    summary="NeutronTP: tensor-parallel full-graph training (features split by columns, decoupled "
            "NN and aggregation, chunked pipelined split/gather)",
    section="tensor",
    keys=KEYS,
    factory="hpcgnn.engine.tensor:make_engine",
    memory_terms="hpcgnn.engine.estimate:tensor_terms",
    validate=validate,
    safe_on_resume=("tensor.pipeline",),
)
