"""The tensor-parallel engine's memory (:mod:`hpcgnn.engine.tensor`) as coarse terms, in bytes,
and its device sizing. ``V`` / ``E`` are the graph's vertices / edges (``ev = E + V`` with the
self loops), ``P`` the ranks, ``C/P`` the columns of a rank's feature-layout slice.

* ``partition``: the rank's ~V/P vertex rows (features, labels, masks);
* ``topology`` (replicated on every rank): the propagation CSR with self loops and its weights,
  the layout (six int64 per vertex) and what backward builds and keeps: the transpose, or per
  chunk its sources, CSR and transpose (:data:`CHUNK_EDGE_I64` int64 per edge, two per source);
* ``setup``: the construction's transient beyond them (the store's CSR, read whole, and the
  matrix being built: :data:`SETUP_EDGE_BYTES` per edge and four int64 per vertex);
* ``activations``: the ``[V, C/P]`` slices (:data:`SLICES`, GAT also its k saved rounds), the
  MLP's tensors on the rank's rows (the input, two per hidden layer and three of the widest
  aggregation), GAT's four per-edge tensors; staged on the CPU also one chunk
  (:func:`tensor_device_bytes`);
* on the device (staged): ``nn`` (the MLP's rows and the model), ``chunk`` (one chunk's working
  set: the row buffer and the gathered sources, two destination-row tensors, at ``C/P``
  columns; GAT the saved round's sources twice more; off the CPU its topology copied over)
  and, resident, ``resident`` (:func:`resident_device_bytes`).

Set-up, the epoch and the optimizer step never overlap: the largest counts.
"""
from __future__ import annotations

from hpcgnn.engine.estimate import (F32, I64, MODEL_COPIES, MemoryEstimate, expected_distinct, keep_largest,
                                    model_param_sizes)
from hpcgnn.errors import InputError

SLICES = 4                    # [V, C/P] slices at backward's peak
CHUNK_EDGE_I64 = 3            # per edge and chunking: its CSR entry, transpose and edge id
SETUP_EDGE_BYTES = 3 * I64    # the store's CSR, the matrix's indices and a mask per edge
TORCH_CSR_EDGE_BYTES = 5 * 8 + 2 * 4   # the torch path's per-edge tensors of a chunk on a GPU


def tensor_cols(cfg, meta, parts: int) -> int:
    """Columns of the widest rank's feature-layout slice."""
    c, hid = int(meta.num_classes), int(cfg.model.hidden)
    return -(-c // parts) if cfg.tensor.mode == "decoupled" else -(-max(hid, c) // parts)


def chunk_sources(v: int, e: int, chunks: int) -> float:
    """Source rows of one of ``chunks`` destination chunks: its destinations plus the expected
    distinct vertices of its ``e / chunks`` edges (all ``v`` for one chunk)."""
    return float(v) if chunks <= 1 else min(v, -(-v // chunks) + expected_distinct(v, e / chunks))


def tensor_device_bytes(cfg, meta, parts: int, chunks: int, device: str, resident: bool = False) -> tuple[int, int]:
    """``(nn, chunk)``: device bytes of the staged path with ``chunks`` chunks on ``parts`` ranks:
    the NN layers on the rank's rows (or Adam's temporaries) with the model's four device
    copies, and one chunk's working set (see the module); ``resident``: the chunks' topology is
    the resident term's."""
    m = cfg.model
    v, e = int(meta.num_nodes), int(meta.num_edges)
    f, c, hid = int(meta.num_features), int(meta.num_classes), int(m.hidden)
    rows = -(-v // max(parts, 1))
    n = sum(k for k, _ in model_param_sizes(cfg, f, c))
    nn_bytes = max(rows * (f + (2 * m.layers + 2) * hid + 2 * c) * F32, n * F32) + (MODEL_COPIES - 1) * n * F32
    k = max(1, min(int(chunks), v))
    cols, dst, edges = tensor_cols(cfg, meta, parts), -(-v // k), -(-(e + v) // k)
    src = chunk_sources(v, e, k)
    per = cols * F32 * (2 * src + 2 * dst) + (2 * src * cols * F32 + 2 * edges * F32 if m.arch == "gat" else 0)
    if device != "cpu":
        per += 2 * edges * F32 if resident else \
            edges * (2 * I64 + F32 + TORCH_CSR_EDGE_BYTES) + (dst + 2 * src + 2) * I64
    return int(nn_bytes), int(per)


def resident_device_bytes(num_nodes: int, num_edges: int, chunks: int, cols: int, k: int, attention: bool) -> int:
    """Bytes the resident staged path keeps on the device: the chunks' CSRs, slots, weights and
    transposes (``num_edges`` with the self loops) and the ``[V, cols]`` slices (three, or
    ``k + 1`` for GAT's saved rounds, and three gradient slices)."""
    v, ev = int(num_nodes), int(num_edges)
    return int((2 * (v + int(chunks)) + 6 * ev) * I64 + ev * F32 + ((k + 1 if attention else 3) + 3) * v * cols * F32)


def auto_chunks(cfg, meta, parts: int, budget: int | None, device: str) -> tuple[int, int, int]:
    """``(chunks, nn_bytes, chunk_bytes)``: the smallest chunk count whose working set
    (:func:`tensor_device_bytes`) fits ``budget`` bytes (None: 1 chunk). InputError naming
    ``tensor.device_memory`` when even one destination row per chunk does not fit."""
    from hpcgnn.units import fmt_bytes

    def need(k):
        return tensor_device_bytes(cfg, meta, parts, k, device)

    if budget is None:
        return (1, *need(1))
    lo, hi = 1, max(int(meta.num_nodes), 1)
    if sum(need(hi)) > budget:
        nn_b, ch_b = need(hi)
        raise InputError(f"tensor.device_memory = {cfg.tensor.device_memory!r} ({fmt_bytes(budget)}) is too small "
                         f"for tensor.chunks = 'auto': even one destination row per chunk needs "
                         f"{fmt_bytes(nn_b + ch_b)} on the device (NN layers {fmt_bytes(nn_b)}, chunk "
                         f"{fmt_bytes(ch_b)}); give more device memory or more ranks")
    while lo < hi:                      # the working set shrinks as the chunk count grows
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sum(need(mid)) <= budget else (mid + 1, hi)
    return (lo, *need(lo))


def tensor_chunk_count(cfg, meta, parts: int, device_total: int | None = None) -> int:
    """``tensor.chunks`` as a count: the number, or for ``'auto'`` :func:`auto_chunks`' for
    ``tensor.device_memory`` (1 when no budget resolves here)."""
    t = cfg.tensor
    if t.chunks != "auto":
        return int(t.chunks)
    from hpcgnn.run.engines.tensor import device_budget

    try:
        return auto_chunks(cfg, meta, parts, device_budget(t.device_memory, cfg.train.device, device_total),
                           cfg.train.device)[0]
    except InputError:
        return 1


def tensor_terms(cfg, meta, s: dict, est: MemoryEstimate, device: str, store_available: int | None) -> None:
    """The tensor engine's host and device terms on ``device`` (see the module)."""
    from hpcgnn.run.engines.tensor import device_budget
    from hpcgnn.store.budget import resolve_budget

    v, e = int(meta.num_nodes), int(meta.num_edges)
    parts, t, m = max(int(meta.num_parts), 1), cfg.tensor, cfg.model
    f, c, hid = int(meta.num_features), int(meta.num_classes), int(m.hidden)
    rows, ev, cuda = -(-v // parts), e + v, device == "cuda"
    gat = m.arch == "gat" and t.mode == "decoupled"
    chunks = max(1, min(tensor_chunk_count(cfg, meta, parts), v))
    staged = t.staged or cuda
    est.terms["partition"] = int(rows * (f * F32 + I64 + 3))     # its own rows, not a partition file's
    est.shrink["partition"] = "more ranks"
    topo = (2 * v + 2 + 3 * ev) * I64 + 6 * v * I64 + (0 if gat else ev * F32)
    if staged or chunks > 1:
        topo += CHUNK_EDGE_I64 * ev * I64 + 2 * chunks * chunk_sources(v, e, chunks) * I64
    est.add("topology", topo, "nothing (replicated by design; a smaller graph or more memory per rank)")
    setup = ev * SETUP_EDGE_BYTES + 4 * v * I64 + (2 * ev * F32 if m.arch in ("gcn", "sage") else 0)
    est.add("setup", max(setup - topo, 0), "more memory per rank (the store's CSR is read whole on every rank)")
    k = (t.k or m.layers) if t.mode == "decoupled" else 1
    cols = tensor_cols(cfg, meta, parts)
    wide = c if t.mode == "decoupled" else max(hid, c)
    act = (SLICES + (k if gat else 0)) * v * cols + (4 * ev if gat else 0)
    nn_b, chunk_b = tensor_device_bytes(cfg, meta, parts, chunks, device)
    budget = None
    try:
        budget = device_budget(t.device_memory, device, None)
    except InputError:
        pass
    res = resident_device_bytes(v, ev, chunks, cols, k, gat)
    resident = staged and budget is not None and nn_b + chunk_b + res <= budget
    if not cuda:
        act += rows * (f + 2 * (m.layers - 1) * hid + c + 3 * wide)
    est.add("activations", act * F32 + (chunk_b if staged and not cuda else 0),
            "more ranks (the feature-layout slices are V x C/P)")
    if staged:
        est.add("chunk", tensor_device_bytes(cfg, meta, parts, chunks, device, resident)[1],
                "raise tensor.chunks (or tensor.chunks = 'auto' with tensor.device_memory)", device=True)
        if resident:
            est.add("resident", res if cuda else ((k + 1 if gat else 3) + 3) * v * cols * F32,
                    "lower tensor.device_memory (the staged path streams its slices when they do not fit)", device=True)
    if cuda:
        est.add("nn", nn_b - (MODEL_COPIES - 1) * est.params * F32, "more ranks (the NN rows are V/P)", device=True)
        budget = resolve_budget(cfg.store.device_memory, rows * f * F32, device, store_available)
        est.add("store_rows", rows * f * F32 if budget is None else min(budget, rows * f * F32),
                "lower store.device_memory", device=True)
    keep_largest(est.terms, ("setup", "activations", "optimizer_step"), est.phases)
