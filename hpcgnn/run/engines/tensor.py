"""The NeutronTP tensor-parallel full-graph engine: config section ``[tensor]``.

Every rank holds the whole topology and ``D/P`` columns of every vertex's propagated embedding;
NN layers run on ``~V/P`` vertices with full rows (see :mod:`hpcgnn.engine.tensor`).
"""
from __future__ import annotations

from hpcgnn.errors import InputError
from hpcgnn.run.config import Key, nonneg
from hpcgnn.run.engines.registry import EngineSpec
from hpcgnn.units import parse_size

MODES = ("decoupled", "coupled")
DEVICE_MEMORY_HELP = ("device memory budget per rank for tensor.chunks = 'auto': 'auto' (90 % of the "
                      "GPU's memory; none on the CPU, where auto chunks = 1), a fraction in (0, 1] of "
                      "the GPU's memory, or a size such as '2GiB' (the only form on the CPU)")
AUTO_FRACTION = 0.9


def device_budget(value, device_type: str, device_total: int | None) -> int | None:
    """``tensor.device_memory`` -> bytes (None: no budget: ``'auto'`` on the CPU). A fraction
    needs a GPU (``device_total``); on the CPU it is an InputError naming the key."""
    what = "tensor.device_memory"
    if isinstance(value, bool):
        raise InputError(f"{what} = {value!r}: expected {DEVICE_MEMORY_HELP}")
    if isinstance(value, str) and value.strip().lower() == "auto":
        value = AUTO_FRACTION if device_type == "cuda" else None
        if value is None:
            return None
    if isinstance(value, (int, float)):
        if not 0 < value <= 1:
            raise InputError(f"{what} = {value!r}: a number is a fraction in (0, 1] of the GPU's memory; "
                             "give a size as a string such as '2GiB'")
        if device_type != "cuda" or device_total is None:
            raise InputError(f"{what} = {value!r}: a fraction of the device's memory needs train.device = "
                             "'cuda'; on the CPU give a size such as '2GiB'")
        return int(float(value) * device_total)
    return parse_size(value, what)


def valid_device_memory(value) -> bool:
    """Whether ``tensor.device_memory`` has a valid form (config check; fractions are checked
    against the device at start-up)."""
    try:
        device_budget(value, "cuda", 1 << 30)
        return True
    except InputError:
        return False

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
    "chunks": Key((int, str), 1, "destination-contiguous chunks of the aggregation, same order on "
                  "every rank; split/gather per chunk, overlapped with chunk compute; 'auto': the "
                  "smallest count whose per-chunk device working set fits tensor.device_memory",
                  lambda x: x == "auto" or (isinstance(x, int) and not isinstance(x, bool) and x > 0),
                  "an integer > 0 or 'auto'"),
    "device_memory": Key((str, int, float), "auto", DEVICE_MEMORY_HELP, lambda x: valid_device_memory(x),
                         "'auto', a fraction in (0, 1] or a size such as '2GiB'"),
    "staged": Key(bool, False, "stream the aggregation's chunks through the compute device from host "
                  "memory (always on with train.device = 'cuda'; true on the CPU runs the same path "
                  "with the CPU as the device)"),
    "pipeline": Key(bool, True, "chunked: start every chunk's split/gather without waiting "
                    "(non-blocking all-to-alls); false = each one completes before the next step"),
}


def validate(cfg, label: str) -> None:
    """Coupled mode is a plain GCN/SAGE stack: one aggregation per layer, no teleport, no GAT.
    (``train.precision`` applies to the linear maps as in the other engines.)"""
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
    memory_terms="hpcgnn.engine.memory_tensor:tensor_terms",
    validate=validate,
    safe_on_resume=("tensor.pipeline", "tensor.staged"),
)
