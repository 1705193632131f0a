"""The full-graph engine's memory (:mod:`hpcgnn.engine.fullgraph`, offloaded
:mod:`hpcgnn.engine.offload`) as coarse terms, in bytes. ``ns`` / ``nh`` / ``nl`` are the
partition's solid / halo / local rows, ``ne`` its edges, ``w_l`` layer ``l``'s input width.

In memory:

* ``activations`` (device memory; what the meter counts on the CPU): layer 0's input (SAGE and
  GCN without a halo cache aggregate the features once and keep ``ns x w0``, SAGE twice with
  its own rows; else every local row, the received halo rows and the aggregate), every later
  layer's exchanged rows ``nl x`` the width it exchanges (:func:`halo_widths`), and
  :data:`DST_COPIES` destination tensors per layer at its output width; GAT also
  :data:`GAT_EDGE_COPIES` float32 per edge, head and layer and its projection over every local
  row;
* ``backward``: the gradients of the widest later layer (``2 nl x w_l + nl x w_l+1``);
* ``topology``: the local CSR's transpose and, on CUDA, the torch path's per-edge tensors;
* ``startup`` (host, the CPU): layer 0's aggregate being built, ``(nl + 2 ns) x w0``;
* ``halo_cache`` / ``halo_pipeline``: every halo row of every layer in the width the exchange
  sends (within ``fullgraph.cache_memory``) / two messages per pipelined layer in flight (on a
  GPU device memory where the data plane moves device buffers).

Offloaded (``fullgraph.offload``): host-resident for the run, layer 0's input over every local
row, the later layers' inputs, the logits and (caching) the solid rows' aggregates, the host
gradients of a layer (``2 nl x`` the widest width) and the chunks' topology (four int64 per
edge, five with GAT); on the device one unit of chunks (``activations``): its row buffer, the
gathered sources of a chunk (``U`` and ``Uc`` rows: the expected distinct sources of
``fullgraph.batch_chunks`` chunks' edges and of one chunk's, with their destinations) at the
layer's input width, :data:`OFFLOAD_DST` destination temporaries at its output width and GAT's
per-edge tensors.
"""
from __future__ import annotations

from hpcgnn.engine.estimate import F32, I64, MemoryEstimate, expected_distinct, sizes

DST_COPIES = {"sage": 1, "gcn": 1, "gat": 1}   # destination tensors per layer kept for backward
GAT_EDGE_COPIES = 2                            # logits and attention per edge and head
OFFLOAD_DST = 3                                # a chunk's destination temporaries
ACT_SHRINK = "more ranks (hpcgnn partition --parts), or fullgraph.offload = true with fullgraph.chunks"


def halo_widths(cfg, widths: list) -> list[int]:
    """Width each layer's halo exchange sends: its input, or what it exchanges instead
    (:func:`hpcgnn.nn.conv.exchanged_width`; GAT's last layer projects to heads x classes)."""
    from hpcgnn.nn.conv import exchanged_width

    arch, last = cfg.model.arch, len(widths) - 2
    heads = [int(cfg.model.heads) if arch == "gat" and l == last else 1 for l in range(last + 1)]
    return [exchanged_width(arch, widths[l], widths[l + 1], heads[l]) or widths[l] for l in range(last + 1)]


def in_memory_activations(cfg, meta, s: dict) -> int:
    """The in-memory engine's kept tensors (``activations``, see the module)."""
    ns, nh, ne, nl, w = sizes(cfg, meta, s)
    arch, layers, heads = cfg.model.arch, len(w) - 1, int(cfg.model.heads)
    if arch in ("sage", "gcn") and cfg.fullgraph.halo != "cached":
        act = (2 if arch == "sage" else 1) * ns * w[0]
    else:
        act = (nl + (nh if arch == "gat" else ns)) * w[0]
    hw = halo_widths(cfg, w)
    act += sum(nl * hw[l] for l in range(1, layers))
    act += DST_COPIES[arch] * ns * sum(w[1:])
    if arch == "gat":
        act += layers * GAT_EDGE_COPIES * ne * heads + sum(nl * w[l + 1] * (heads if l == layers - 1 else 1)
                                                             for l in range(layers))
    return int(act * F32 + nl * F32)


def unit_rows(cfg, nl: int, ne: int) -> tuple[int, int]:
    """``(unit, chunk)``: expected distinct source rows of one unit of chunks and of one chunk."""
    fg = cfg.fullgraph
    k = max(int(fg.chunks), 1)
    per_unit = min(int(fg.batch_chunks), k) if fg.dedup else 1
    return (int(min(nl, expected_distinct(nl, ne * per_unit / k) + nl / k * per_unit)),
            int(min(nl, expected_distinct(nl, ne / k) + nl / k)))


def offload_batch_bytes(cfg, meta, s: dict) -> int:
    """One unit of chunks on the device at the largest layer (see the module)."""
    ns, nh, ne, nl, w = sizes(cfg, meta, s)
    k = max(int(cfg.fullgraph.chunks), 1)
    unit, chunk = unit_rows(cfg, nl, ne)
    heads = int(cfg.model.heads) if cfg.model.arch == "gat" else 0
    per = [(unit + chunk) * w[l] + OFFLOAD_DST * ns / k * w[l + 1]
           + 2 * GAT_EDGE_COPIES * ne / k * heads for l in range(len(w) - 1)]
    return int(max(per) * F32)


def fullgraph_terms(cfg, meta, s: dict, est: MemoryEstimate, device: str, store_available: int | None) -> None:
    """The full-graph engine's host and device terms for partition shapes ``s`` on ``device``."""
    from hpcgnn.run.engines.fullgraph import cache_bytes
    from hpcgnn.store.budget import resolve_budget

    ns, nh, ne, nl, w = sizes(cfg, meta, s)
    fg, arch, layers = cfg.fullgraph, cfg.model.arch, len(w) - 1
    cuda = device == "cuda"
    gat = arch == "gat"
    if fg.offload:
        held = nl * w[0] + sum(nl * w[l] for l in range(1, layers)) + ns * w[-1] + 2 * nl * max(w)
        if not (fg.recompute == "recompute" or gat):
            held += sum(ns * w[l] for l in range(layers))
        est.add("activations", held * F32, "more ranks (hpcgnn partition --parts): the host-resident rows "
                "are the partition's, chunks do not shrink them")
        est.add("chunks", (5 if gat else 4) * ne * I64, "more ranks (hpcgnn partition --parts)", device=cuda)
        est.add("batch", offload_batch_bytes(cfg, meta, s), "raise fullgraph.chunks or lower fullgraph.batch_chunks",
                device=True)
        if not cuda:
            est.terms["batch"] = est.device["batch"]
        return
    est.add("activations", in_memory_activations(cfg, meta, s), ACT_SHRINK, device=True)
    est.add("backward", max((2 * nl * w[l] + nl * w[l + 1] for l in range(1, layers)), default=0) * F32,
            "more ranks, or fullgraph.offload = true with fullgraph.chunks", device=cuda)
    hw = halo_widths(cfg, w)
    if fg.halo == "cached":
        full, budget = nh * sum(hw) * F32, cache_bytes(fg.cache_memory, "fullgraph.cache_memory")
        est.add("halo_cache", full if budget is None else min(full, budget),
                "fullgraph.cache_memory / fullgraph.cache_device_memory", device=cuda)
    if fg.pipeline:        # in device memory only where the data plane moves device buffers (NCCL)
        from hpcgnn.comm.communicator import moves_device_buffers

        wire = 2 if fg.halo_precision == "bf16" else F32
        est.add("halo_pipeline", sum(2 * nh * hw[l] * wire for l in range(1, layers)), "fullgraph.pipeline = false",
                device=cuda and moves_device_buffers(cfg.runtime.backend, device))
    if cuda:
        feature_bytes = ns * int(meta.num_features) * F32
        budget = resolve_budget(cfg.store.device_memory, feature_bytes, device, store_available)
        est.add("store_rows", feature_bytes if budget is None else min(budget, feature_bytes),
                "lower store.device_memory", device=True)
        est.add("topology", (ns + nl + 2) * I64 + ne * (2 * I64 + F32 + (2 * I64 if gat else 0)),
                "more ranks (hpcgnn partition --parts)", device=True)
    else:
        est.terms["activations"] = est.device["activations"]
        est.add("topology", 2 * ne * I64, "more ranks (hpcgnn partition --parts)")
        est.add("startup", max(0, (nl + 2 * ns) * w[0] * F32 - est.terms["activations"] - est.terms["backward"]),
                "more ranks (layer 0's aggregate is built from every local feature row)")
