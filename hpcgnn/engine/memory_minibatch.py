"""The minibatch engine's memory (:mod:`hpcgnn.engine.minibatch`) as coarse terms, in bytes.

A step's frontiers are modelled, not sampled: the batch's seeds, then per hop the expected
distinct vertices of its draws (``min(fanout, the partition's average degree)`` per destination)
uniform over the rank's local rows (over the whole graph with ``minibatch.halo = "exact"``):
an upper bound, since a partition's neighbourhoods overlap more than uniform draws do (by the
most on deep samples of a clustered graph, where the measured first step decides).

* ``activations`` (the step; device memory): per layer ``l`` its input rows ``R_l x w_l``, the
  destinations' aggregate ``R_l+1 x w_l`` (GAT instead its projected sources ``R_l x w_l+1`` and
  :data:`GAT_EDGE_COPIES` float32 per sampled edge and head) and :data:`DST_COPIES` tensors of
  the destinations at the output width; on a GPU also every sampled edge's CSR entries
  (:data:`EDGE_BYTES`; on the CPU they are host arrays, not the device's);
* ``eval``: layer-wise inference (``minibatch.eval = "full"``): :data:`EVAL_ROWS` solid rows and
  two halo rows at the widest layer, one chunk of temporaries and the partition's edges twice
  (int64), GAT its input over every local row; sampled (``"sampled"``): a batch of
  ``minibatch.eval_batch_size`` seeds on frontiers over the whole graph, the step's form
  without gradients, plus the fetched input three times (served, received, assembled);
* ``hec`` (``minibatch.halo = "hec"``): the lines an epoch can write (``min(cs, halo rows,
  steps x (ranks - 1) x push_limit)``) at every layer's input width; ``hec_directory`` the tag
  directory (allocated whole at construction);
* ``store`` (the CPU's tiered store): its device tier is a host buffer with a row table;
  ``store_rows`` on CUDA: the tier on the GPU.

Training steps, evaluation and the optimizer step never overlap: the largest counts.
"""
from __future__ import annotations

import math

from hpcgnn.engine.estimate import F32, I64, MemoryEstimate, expected_distinct, keep_largest, sizes

DST_COPIES = {"sage": 1, "gcn": 1, "gat": 1}   # output-width tensors per destination row and layer
GAT_EDGE_COPIES = 2                            # logits and attention
EDGE_BYTES = 3 * I64                           # a sampled edge's CSR entries and its source slot
EVAL_ROWS = 4                                  # solid-row tensors of a layer-wise inference layer
ACT_SHRINK = "minibatch.batch_size or minibatch.fanouts"


def frontier(cfg, meta, s: dict, exact: bool, batch: int) -> tuple[list, list]:
    """``(rows, edges)``: expected input rows of every layer (``rows[layers]``: the seeds) and
    sampled edges of every layer's block."""
    ns, nh, ne, nl, _ = sizes(cfg, meta, s)
    pool = max(int(meta.num_nodes), nl) if exact else nl
    avg = ne / max(ns, 1)
    draws = [avg if f < 0 else min(f, avg) for f in cfg.minibatch.fanouts]
    rows = [float(min(batch, max(ns, 1)))]
    for f in reversed(draws):
        rows.append(min(pool, rows[-1] + expected_distinct(pool, rows[-1] * f)))
    rows = rows[::-1]
    return rows, [rows[l + 1] * f for l, f in enumerate(draws)]


def step_bytes(cfg, widths: list, rows: list, edges: list, csr: bool) -> int:
    """Bytes of one step's layer tensors on frontiers ``rows`` / ``edges`` (see the module);
    ``csr``: with the sampled blocks' CSR entries."""
    arch, heads = cfg.model.arch, int(cfg.model.heads)
    total = 0.0
    for l in range(len(widths) - 1):
        wi, wo = widths[l], widths[l + 1]
        total += rows[l] * wi + DST_COPIES[arch] * rows[l + 1] * wo
        total += rows[l] * wo + GAT_EDGE_COPIES * edges[l] * heads if arch == "gat" else rows[l + 1] * wi
    return int(total * F32 + (sum(edges) * EDGE_BYTES if csr else 0))


def eval_bytes(cfg, meta, s: dict) -> int:
    """The evaluation's peak (see the module)."""
    from hpcgnn.engine.inference import DEFAULT_CHUNK_BYTES

    ns, nh, ne, nl, widths = sizes(cfg, meta, s)
    mb, wmax = cfg.minibatch, max(widths)
    if mb.eval == "full":
        ev = (EVAL_ROWS * ns + 2 * nh) * wmax * F32 + min(DEFAULT_CHUNK_BYTES, 6 * ns * wmax * F32) + 2 * ne * I64
        return int(ev + (2 * nl * wmax * F32 if cfg.model.arch == "gat" else 0))
    rows, edges = frontier(cfg, meta, s, True, int(mb.eval_batch_size or mb.batch_size))
    return int(step_bytes(cfg, widths, rows, edges, True) + 3 * rows[0] * widths[0] * F32)


def hec_bytes(cfg, meta, s: dict) -> tuple[int, int]:
    """``(rows, directory)`` bytes of the HECs: the lines an epoch can write at every layer's
    input width; the tag directory (a hash table of the next power of two >= 2 cs entries of 16
    bytes, three int64 per ring slot) per layer."""
    ns, nh, ne, nl, widths = sizes(cfg, meta, s)
    mb, layers = cfg.minibatch, int(cfg.model.layers)
    steps = math.ceil(max(s.get("num_train", ns), 1) / mb.batch_size)
    lines = min(mb.cache_lines, nh, steps * max(meta.num_parts - 1, 0) * mb.push_limit)
    table = 1 << max(4, (2 * int(mb.cache_lines) - 1).bit_length())
    return int(lines * sum(widths[:layers]) * F32), int((table * 2 * I64 + mb.cache_lines * 3 * I64) * layers)


def hec_capacity_bytes(cfg, meta, s: dict) -> int:
    """Bytes of the HEC rows at capacity (``min(cs, halo)`` lines at every layer's input width):
    what the store places beside the feature rows on a GPU (0 without HECs)."""
    if cfg.train.engine != "minibatch" or cfg.minibatch.halo != "hec":
        return 0
    ns, nh, ne, nl, widths = sizes(cfg, meta, s)
    return int(min(cfg.minibatch.cache_lines, nh) * sum(widths[:cfg.model.layers]) * F32)


def minibatch_terms(cfg, meta, s: dict, est: MemoryEstimate, device: str, store_available: int | None) -> None:
    """The minibatch engine's host and device terms for partition shapes ``s`` on ``device``."""
    from hpcgnn.store.budget import resolve_budget

    ns, nh, ne, nl, widths = sizes(cfg, meta, s)
    mb = cfg.minibatch
    cuda = device == "cuda"
    rows, edges = frontier(cfg, meta, s, mb.halo == "exact", int(mb.batch_size))
    est.add("activations", step_bytes(cfg, widths, rows, edges, cuda), ACT_SHRINK, device=True)
    shrink = ("minibatch.eval_rows / minibatch.eval_halo_rounds (or minibatch.eval = 'sampled')" if mb.eval == "full"
              else "minibatch.eval_batch_size or minibatch.fanouts (or minibatch.eval = 'full')")
    est.add("eval", eval_bytes(cfg, meta, s), shrink, device=cuda)
    if mb.halo == "hec":
        lines, directory = hec_bytes(cfg, meta, s)
        est.add("hec", lines, "minibatch.cache_lines (HEC lines per layer)", device=cuda)
        est.add("hec_directory", directory, "minibatch.cache_lines (HEC lines per layer)")
    feature_bytes = ns * int(meta.num_features) * F32
    budget = resolve_budget(cfg.store.device_memory, feature_bytes, device, store_available,
                            hec_capacity_bytes(cfg, meta, s))
    if cuda:
        est.add("store_rows", feature_bytes if budget is None else min(budget, feature_bytes),
                "lower store.device_memory", device=True)
        keep_largest(est.device, ("activations", "eval", "optimizer_step"), est.phases)
    else:
        if budget and budget < feature_bytes:
            est.add("store", budget + ns * I64, "store.device_memory (the device tier; on the CPU a host buffer)")
        est.terms["activations"] = est.device["activations"]   # the CPU's device is host memory
        keep_largest(est.terms, ("activations", "eval", "optimizer_step"), est.phases)
