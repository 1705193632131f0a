"""Per-candidate predictions: each rank's peak host and device memory, bytes sent per epoch and
the epoch time from a cost model with a machine's :class:`~hpcgnn.plan.calibrate.Calibration`.

Memory comes from the engines' coarse terms, :mod:`hpcgnn.engine.estimate` (the figures
``hpcgnn train``'s pre-run check reads): :func:`~hpcgnn.engine.estimate.estimate_rank_memory`
(every engine's ``memory_terms``, upper bounds) with the calibrated ``baseline``, on a CUDA
device split into what lives on the GPU and what stays in host memory
(:func:`~hpcgnn.engine.estimate.host_device_peak`); this module adds them up per node.

Time (seconds per training epoch, evaluation not included) is the slowest rank's sum of

* ``agg``: aggregation, gathered bytes (edges x width x 4, forward and where needed backward)
  over the SpMM rate at that width (:meth:`Calibration.agg_rate`);
* ``gemm``: dense layers, 2 x rows x in x out flops per GEMM (forward, and weight + input
  gradients in backward) over the GEMM rate;
* ``elem``: elementwise passes over the tensors kept for backward, over the stream rate;
* ``move``: rows gathered or scattered between buffers (offload transfers, sampled inputs,
  HEC lookups and fills, gradient flushes) over the gather rate (host-to-device rate on CUDA);
* ``comm``: bytes this rank sends (halo rows, layout all-to-alls, AEP pushes, gradient
  allreduce) over the all-to-all rate, plus the latency of every collective;
* ``overhead``: small-kernel launches (per iteration, per chunk) times the per-op overhead.

Halo bytes (:attr:`Prediction.halo_bytes_per_epoch`): what every rank together sends per
training epoch to bring vertex rows where they are needed, the figure the run file measures
per halo mode: the full graph's forward rows and their gradients (``halo_fwd_bytes +
halo_adjoint_bytes``; in steady state for the cache: a cached hidden row every S + 1 epochs,
pipelined every S, uncached rows and every layer-0 row not cached every epoch; each layer the
rows the exact exchange sends, :func:`halo_width`), the AEP pushes (``aep_bytes_sent``), the exact
minibatch fetch (``bytes_sent``), the tensor engine's split/gather all-to-alls (``bytes_sent``
less ``allreduce_bytes``). The gradient allreduce is not halo traffic.

Node-wide rates are shared by the ``ranks_per_node`` ranks of a node (all work of a rank is
charged at rate / ranks_per_node). Time models are :data:`TIME_MODELS` (engine -> function);
an engine without one is reported, not ranked.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from hpcgnn.engine.estimate import F32, I64, SAVED_PER_LAYER, expected_distinct, layer_widths

# small torch operations per layer per chunk (offload) / per layer per iteration (minibatch) /
# per layer per epoch (full graph), forward and backward together: counted from the engines'
# code paths, used only with the calibrated per-op overhead
OPS_PER_LAYER = 60


@dataclass
class Prediction:
    """What the estimator says about one candidate on one topology (bytes, seconds)."""

    host_peak: int = 0                 # largest rank's peak resident bytes
    host_node: int = 0                 # bytes of the fullest node (its ranks' peaks summed)
    device_peak: int = 0               # largest rank's device bytes (0 on cpu)
    device_terms: dict = field(default_factory=dict)   # that rank's device terms (cuda)
    device_largest: tuple = ("", 0)
    device_shrink: str = ""
    worst_rank: int = 0
    terms: dict = field(default_factory=dict)      # the worst rank's memory terms
    largest: tuple = ("", 0)
    shrink: str = ""
    bytes_per_epoch: float = 0.0       # bytes sent by the busiest rank per epoch
    halo_bytes_per_epoch: float = 0.0  # halo-mode bytes sent per training epoch, all ranks (module text)
    epoch_s: float = math.nan
    parts: dict = field(default_factory=dict)      # the slowest rank's time by component
    notes: list = field(default_factory=list)


# ---- shapes ----------------------------------------------------------------------------------

def store_shapes(meta) -> list[dict]:
    """Every partition's sizes (:func:`hpcgnn.engine.estimate.part_shapes`) of the store, with
    ``cut_frac``: the fraction of edges whose endpoints are on different partitions."""
    from hpcgnn.engine.estimate import part_shapes

    cut = 2 * meta.edge_cut / max(meta.num_edges, 1)
    return [{**part_shapes(meta.path, p), "cut_frac": cut, "part_id": p} for p in range(meta.num_parts)]


def scaled_shapes(meta, shapes: list[dict], ranks: int) -> list[dict]:
    """Partition sizes for ``ranks`` partitions extrapolated from a store of ``meta.num_parts``.

    Solid vertices, edges and training vertices divide evenly (times the store's max/mean
    imbalance). Cut edges per rank follow the random-partition scaling of the store's cut
    fraction c(N) = c(P) (1 - 1/N) / (1 - 1/P) (with P = 1: 1 - 1/N, an upper bound), and halo
    vertices = cut edges x the store's distinct-halo-per-cut-edge ratio (random model
    :func:`~hpcgnn.engine.estimate.expected_distinct` when the store has no cut). ``file_bytes`` keeps the store's bytes per
    solid vertex, edge and halo vertex. Exact when ``ranks == meta.num_parts``."""
    p = meta.num_parts
    if ranks == p:
        return shapes
    v, e = meta.num_nodes, meta.num_edges
    ns = np.array([s["num_solid"] for s in shapes], float)
    ne = np.array([s["num_edges"] for s in shapes], float)
    nh = np.array([s["num_halo"] for s in shapes], float)
    imb_v, imb_e = ns.max() / max(ns.mean(), 1), ne.max() / max(ne.mean(), 1)
    train = sum(s["num_train"] for s in shapes)
    other = sum(s["file_bytes"] for s in shapes) - 8 * ne.sum() - 24 * nh.sum()
    per_solid = other / max(ns.sum(), 1)
    cut_frac_p = 2 * meta.edge_cut / max(e, 1)                  # directed edges crossing parts
    cut_frac = cut_frac_p * (1 - 1 / ranks) / (1 - 1 / p) if p > 1 else (1 - 1 / ranks)
    cut_frac = min(cut_frac, 1 - 1 / ranks)
    ns_n, ne_n = v / ranks * imb_v, e / ranks * imb_e
    cut_rank = ne_n * cut_frac
    if p > 1 and cut_frac_p > 0:
        ratio = nh.sum() / (cut_frac_p * e)
        nh_n = min(v - ns_n, cut_rank * ratio)
    else:
        nh_n = expected_distinct(v - ns_n, cut_rank)
    s = {"num_solid": int(ns_n), "num_halo": int(nh_n), "num_edges": int(ne_n),
         "num_train": int(math.ceil(train / ranks * imb_v)),
         "file_bytes": int(per_solid * ns_n + 8 * ne_n + 24 * nh_n), "cut_frac": float(cut_frac)}
    return [dict(s) for _ in range(ranks)]


def plan_meta(meta, ranks: int):
    """The store's metadata as the estimate reads it, with ``num_parts = ranks``."""
    return SimpleNamespace(path=meta.path, num_parts=ranks, num_nodes=meta.num_nodes,
                           num_edges=meta.num_edges, num_features=meta.num_features,
                           num_classes=meta.num_classes)


# ---- memory ----------------------------------------------------------------------------------

def estimate_memory(cfg, meta, shapes: list[dict], topo, cal, pred: Prediction) -> None:
    """Fill ``pred``'s memory fields: the largest rank's peak and terms, the fullest node."""
    from hpcgnn.engine.estimate import estimate_device_memory, estimate_rank_memory, host_device_peak, store_auto_bytes

    pm = plan_meta(meta, topo.ranks)
    hosts, devs, ests, dev_ests = [], [], [], []
    auto = isinstance(cfg.store.device_memory, str) and cfg.store.device_memory.strip().lower() == "auto"
    for r, s in enumerate(shapes):
        est = estimate_rank_memory(cfg, pm, r, cal.baseline_rss, shapes=s, device=topo.device)
        host, _ = host_device_peak(cfg, meta, s, est, topo.ranks, topo.device)
        hosts.append(int(host))
        ests.append(est)
        if topo.device == "cuda":
            # the device estimate of train's pre-run check; store.device_memory = 'auto' gets
            # what the GPU has left after the other terms
            avail = store_auto_bytes(cfg, pm, r, topo.device_memory, s) if auto else None
            dev_est = estimate_device_memory(cfg, pm, r, s, "cuda", store_available=avail)
            devs.append(int(dev_est.total))
            dev_ests.append(dev_est)
        else:
            devs.append(0)
    worst = int(np.argmax(hosts))
    pred.host_peak = hosts[worst]
    pred.device_peak = max(devs)
    if dev_ests:
        d = dev_ests[int(np.argmax(devs))]
        pred.device_terms = dict(d.terms)
        pred.device_largest = d.largest()
        pred.device_shrink = d.shrink.get(pred.device_largest[0], "")
    rpn = topo.ranks_per_node
    pred.host_node = int(max(sum(hosts[i:i + rpn]) for i in range(0, len(hosts), rpn)))
    pred.worst_rank = worst
    pred.terms = dict(ests[worst].terms)
    pred.largest = ests[worst].largest()
    pred.shrink = ests[worst].shrink.get(pred.largest[0], "")


# ---- time ------------------------------------------------------------------------------------

class _Cost:
    """Accumulates one rank's seconds by component with the shared node-wide rates."""

    def __init__(self, cal, share: int, device: str):
        self.cal, self.share, self.device = cal, max(share, 1), device
        self.parts = {"agg": 0.0, "gemm": 0.0, "elem": 0.0, "move": 0.0, "comm": 0.0, "overhead": 0.0}
        self.sent = 0.0
        self.halo = 0.0     # of ``sent``: halo-mode bytes (rows and their gradients, pushes, layouts)

    def agg(self, edges: float, width: float, times: int = 1) -> None:
        self.parts["agg"] += times * edges * width * F32 / (self.cal.agg_rate(width) / self.share)

    def gemm(self, rows: float, a: float, b: float, times: int = 1) -> None:
        self.parts["gemm"] += times * 2.0 * rows * a * b / (self.cal.gemm_flops / self.share)

    def elem(self, nbytes: float) -> None:
        self.parts["elem"] += nbytes / (self.cal.stream / self.share)

    def move(self, nbytes: float, host_device: bool = False) -> None:
        rate = self.cal.h2d if (host_device and self.device == "cuda") else self.cal.gather / self.share
        self.parts["move"] += nbytes / rate

    def comm(self, nbytes: float, calls: int = 1, halo: bool = True) -> None:
        """``nbytes`` sent in ``calls`` blocking collectives; ``halo``: halo-mode traffic (not the
        gradient allreduce)."""
        self.sent += nbytes
        self.halo += nbytes if halo else 0.0
        self.parts["comm"] += nbytes / self.cal.alltoall + calls * self.cal.alltoall_latency_s

    def overlapped(self, nbytes: float) -> None:
        """``nbytes`` of halo rows sent in the background (a pipelined exchange): no time."""
        self.sent += nbytes
        self.halo += nbytes

    def ops(self, count: float) -> None:
        self.parts["overhead"] += count * self.cal.op_overhead_s

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))


def _lin_count(arch: str) -> int:
    return 2 if arch == "sage" else 1


def _agg_width(arch: str, w_in: int, w_out: int) -> tuple[int, bool]:
    """(width aggregated, projected first) of a layer: SAGE/GCN project before aggregating when
    that narrows the rows; GAT aggregates its projection."""
    if arch == "gat":
        return w_out, True
    return (w_out, True) if w_out < w_in else (w_in, False)


def _param_bytes(cfg, widths) -> int:
    """float32 bytes of the parameters of the model ``cfg``'s engine builds (input width
    ``widths[0]``, ``widths[-1]`` classes): the memory estimate's exact count."""
    from hpcgnn.engine.estimate import model_param_sizes

    return int(sum(n for n, _ in model_param_sizes(cfg, widths[0], widths[-1])) * F32)


def _dense_layers(c: _Cost, cfg, widths, rows_out: list[float], rows_in: list[float], edges: list[float]) -> None:
    """Aggregation, GEMMs and elementwise passes of a message-passing stack: layer l has
    ``rows_in[l]`` source rows, ``rows_out[l]`` destinations and ``edges[l]`` edges; forward
    and backward (no input gradient of layer 0)."""
    arch = cfg.model.arch
    lin = _lin_count(arch)
    for l in range(cfg.model.layers):
        w_in, w_out = widths[l], widths[l + 1]
        aw, first = _agg_width(arch, w_in, w_out)
        back_agg = l > 0 or first
        c.agg(edges[l], aw, 2 if back_agg else 1)
        proj_rows = rows_in[l] if first else rows_out[l]
        c.gemm(proj_rows, w_in, w_out, 3 if l > 0 else 2)
        if lin == 2:
            c.gemm(rows_out[l], w_in, w_out, 3 if l > 0 else 2)
        if arch == "gat":
            heads = cfg.model.heads
            c.elem(edges[l] * heads * F32 * 8)       # logits, softmax and their gradients
        c.elem(SAVED_PER_LAYER * rows_out[l] * max(w_in, w_out) * F32 * 2)


def _allreduce(c: _Cost, cfg, widths, ranks: int, times: float = 1) -> None:
    pb = _param_bytes(cfg, widths)
    if ranks > 1:
        c.comm(times * pb * 2 * (ranks - 1) / ranks, calls=int(times), halo=False)
    c.elem(times * pb * 10)                          # Adam: parameters, moments, gradients


def halo_width(cfg, widths: list[int], l: int) -> int:
    """The width of the rows the full graph's halo exchange sends at layer ``l``, exact or
    cached alike (:func:`hpcgnn.nn.conv.halo_exchange_width` from the configuration): layer 0
    and the offloaded engine its input; a later layer its projection where
    :func:`hpcgnn.nn.conv.exchanged_width` says so (GCN always, SAGE and GAT when narrower)."""
    from hpcgnn.nn.conv import exchanged_width

    m = cfg.model
    if l == 0 or cfg.fullgraph.offload:
        return widths[l]
    heads = m.heads if m.arch == "gat" else 1
    out = widths[l + 1] if m.arch != "gat" or l == m.layers - 1 else m.hidden
    return exchanged_width(m.arch, widths[l], out, heads) or widths[l]


def fullgraph_halo_rows(cfg, nh: int, widths: list[int]) -> tuple[float, list[float], list[float]]:
    """(cached halo rows, forward rows per layer per epoch, adjoint rows per layer per epoch) of a
    rank with ``nh`` halo rows, in steady state (see the module text). The cache admits
    ``cache_memory // (4 x the layers' halo widths)`` rows (all of them when unbounded)."""
    fg = cfg.fullgraph
    layers = cfg.model.layers
    cached = 0.0
    period = 1
    if fg.halo == "cached" and not fg.offload:
        from hpcgnn.run.engines.fullgraph import cache_bytes

        row_bytes = 4 * sum(halo_width(cfg, widths, l) for l in range(layers))
        budget = cache_bytes(fg.cache_memory, "fullgraph.cache_memory")
        cached = float(nh if budget is None else min(nh, budget // max(row_bytes, 1)))
        period = max(int(fg.staleness), 1) if fg.pipeline else int(fg.staleness) + 1
    fwd = [0.0] * layers
    if fg.halo == "cached" and not fg.offload:
        fwd[0] = nh - cached                         # layer 0: uncached rows every epoch
    for l in range(1, layers):
        fwd[l] = (nh - cached) + cached / period
    back = [0.0] + [float(nh)] * (layers - 1)
    return cached, fwd, back


def fullgraph_time(cfg, meta, s: dict, topo, cal) -> _Cost:
    """One rank of the exact full-graph engine, in memory or offloaded in k chunks."""
    widths = layer_widths(cfg, meta.num_features, meta.num_classes)
    layers = cfg.model.layers
    ns, nh, ne = s["num_solid"], s["num_halo"], s["num_edges"]
    nl = ns + nh
    c = _Cost(cal, topo.ranks_per_node, topo.device)
    _dense_layers(c, cfg, widths, [ns] * layers, [nl] * layers, [ne] * layers)
    fg = cfg.fullgraph
    pipelined = bool(getattr(fg, "pipeline", False))
    wire = 2 if getattr(fg, "halo_precision", "fp32") == "bf16" else F32   # forward bytes a value
    _, fwd_rows, back_rows = fullgraph_halo_rows(cfg, nh, widths)
    for l in range(layers):                          # halo rows forward, their gradients back
        if topo.ranks == 1:
            continue
        # the rows' width: the layer's input, or its narrower projection (the same rule with a cache)
        w = halo_width(cfg, widths, l)
        fwd = fwd_rows[l] * w * (wire if l > 0 else F32)
        if l == 0 and not fwd:
            continue
        if pipelined and l > 0:                      # overlapped with the rest of the epoch
            c.overlapped(fwd)
        else:
            c.comm(fwd, calls=1)
        if back_rows[l]:
            c.comm(back_rows[l] * w * F32, calls=1)  # gradients: always exact and blocking
    if fg.offload:
        k = max(fg.chunks, 1)
        recompute = fg.recompute == "recompute" or (fg.recompute == "auto" and cfg.model.arch == "gat")
        rows = k * expected_distinct(nl, ne / k) if k > 1 else nl       # source rows moved per layer
        for l in range(layers):
            w_in, w_out = widths[l], widths[l + 1]
            aw, _ = _agg_width(cfg.model.arch, w_in, w_out)
            c.move(rows * w_in * F32, host_device=True)          # forward: sources in
            c.move(ns * w_out * F32, host_device=True)           # outputs back to host
            if recompute:
                c.move(rows * w_in * F32, host_device=True)
                c.agg(ne, aw)
                c.gemm(rows, w_in, w_out)
            else:
                c.move(2 * ns * aw * F32, host_device=True)      # cached aggregate out and in
                c.gemm(ns, w_in, w_out)                          # UPDATE re-run
            if l > 0:
                c.move(2 * rows * w_in * F32, host_device=True)  # gradient flush: read + add
        c.ops(k * layers * OPS_PER_LAYER)
    c.ops(layers * OPS_PER_LAYER)
    _allreduce(c, cfg, widths, topo.ranks)
    return c


def minibatch_time(cfg, meta, s: dict, topo, cal) -> _Cost:
    """One rank of the DistGNN-MB engine: iterations of sampled minibatches; HEC + AEP pushes,
    or the exact halo fetched synchronously each iteration."""
    widths = layer_widths(cfg, meta.num_features, meta.num_classes)
    layers = cfg.model.layers
    mb = cfg.minibatch
    ns, nh, ne = s["num_solid"], s["num_halo"], s["num_edges"]
    nl = ns + nh
    c = _Cost(cal, topo.ranks_per_node, topo.device)
    iters = math.ceil(max(s["num_train"], 1) / mb.batch_size)
    avg = ne / max(ns, 1)
    exact = mb.halo == "exact" and topo.ranks > 1
    cut = s.get("cut_frac", nh / max(nl, 1))         # sampled neighbours owned elsewhere
    # Expected frontiers, output side first: the batches are equalised (train / iterations
    # seeds each); each hop adds the distinct new neighbours of the expandable rows. Local
    # sampling expands solid rows only (halo rows are leaves: the partition has in-edges of
    # its own vertices); the exact mode samples on the whole graph.
    pool = meta.num_nodes if exact else nl
    seeds = float(min(max(s["num_train"], 1) / iters, max(ns, 1)))
    rows, grow, fans = [seeds], [seeds], []
    for fan in reversed(list(mb.fanouts)):
        f = avg if fan < 0 else min(fan, avg)
        fans.append(f)
        new = (pool - rows[-1]) / pool * expected_distinct(pool, grow[-1] * f)
        rows.append(min(pool, rows[-1] + new))
        grow.append(rows[-1] if exact else grow[-1] + new * (1 - cut))
    # rows[l] = input rows of layer l; grow[l] = those with sampled neighbours
    rows, grow, fans = rows[::-1], grow[::-1], fans[::-1]
    edges = [grow[l + 1] * fans[l] for l in range(layers)]
    it = _Cost(cal, topo.ranks_per_node, topo.device)
    aep = _Cost(cal, topo.ranks_per_node, topo.device)       # one iteration's pushes
    _dense_layers(it, cfg, widths, rows[1:], rows[:-1], edges)
    it.move(sum(edges) * 3 * I64)                     # sampling: neighbour draws, block CSRs
    it.move(rows[0] * widths[0] * F32)                # input rows gathered
    halo_frac = cut
    fr = _store_frontiers(cfg, meta, s, topo)
    if fr is not None:
        frontier, itemsize = fr
        iters = frontier.iterations                   # every rank runs the largest count
        if mb.halo == "hec":
            # AEP: the expected rows pushed per layer (hpcgnn.plan.frontier), IDs and rows
            for l in range(layers):
                aep.comm(frontier.push_rows[l] * (widths[l] * F32 + I64), calls=1)
                it.move(rows[l] * halo_frac * widths[l] * F32)         # HEC lookups
        else:
            # the exact fetch (comm/exact_fetch.py), per hop: the remote frontier vertices'
            # IDs to their owners and a count each back, the drawn neighbours' IDs back, a
            # count exchange; then the remote input rows' IDs and rows, and a count exchange
            for l in range(layers):
                it.comm(frontier.remote[l] * 2 * I64 + frontier.remote_draws[l] * I64
                        + (topo.ranks - 1) * I64, calls=4)
                it.move(rows[l + 1] * (1 + fans[l]) * I64 * 8)
            it.comm(frontier.remote[layers] * (widths[0] * itemsize + I64) + (topo.ranks - 1) * I64, calls=3)
            it.move(2 * rows[0] * widths[0] * F32)
    elif topo.ranks > 1:
        if mb.halo == "hec":
            # AEP: the solid rows of layer l's frontier (grow[l]) that are halo elsewhere, once
            # per destination (a solid vertex has nh / ns destinations on average: the send
            # lists' total is the halo's), at most push_limit per destination; only the first
            # M - push_delay iterations push (counted apart below)
            for l in range(layers):
                push = min(mb.push_limit * (topo.ranks - 1), grow[l] * nh / max(ns, 1))
                aep.comm(push * widths[l] * F32 + push * I64, calls=1)
                it.move(rows[l] * halo_frac * widths[l] * F32)         # HEC lookups
        elif exact:
            # every hop: remote frontier vertices to their owners (counts, IDs), their sampled
            # neighbours back (counts, IDs): 4 blocking all-to-alls; then the input rows (3)
            # (comm/exact_fetch.py); every frontier vertex is requested, sorted by owner,
            # answered and merged (argsort, unique, searchsorted over frontier + neighbours)
            for l in range(layers):
                remote = rows[l + 1] * halo_frac
                it.comm(remote * I64 + remote * fans[l] * I64 * 2, calls=4)
                it.move(rows[l + 1] * (1 + fans[l]) * I64 * 8)
            it.comm(rows[0] * halo_frac * (widths[0] * F32 + I64), calls=3)
            it.move(2 * rows[0] * widths[0] * F32)     # input rows gathered by owners, put in place
    it.ops(layers * OPS_PER_LAYER)
    _allreduce(it, cfg, widths, topo.ranks)
    for k, v in it.parts.items():
        c.parts[k] += iters * v
    pushes = max(iters - mb.push_delay, 0) if mb.halo == "hec" else 0
    for k, v in aep.parts.items():
        c.parts[k] += pushes * v
    c.sent = iters * it.sent + pushes * aep.sent
    c.halo = iters * it.halo + pushes * aep.halo
    return c


def _store_frontiers(cfg, meta, s: dict, topo):
    """(:class:`~hpcgnn.plan.frontier.RankFrontiers` of the rank whose shapes are ``s``, feature
    bytes a value) when the store has one partition per rank (its own facts), else None (the
    averaged model of :func:`minibatch_time`)."""
    mb = cfg.minibatch
    if topo.ranks < 2 or "part_id" not in s or meta.num_parts != topo.ranks or mb.halo not in ("hec", "exact"):
        return None
    ranks, itemsize = _frontiers(str(meta.path), meta.num_parts, tuple(mb.fanouts), int(mb.batch_size),
                                 int(mb.push_limit), mb.halo)
    return ranks[s["part_id"]], itemsize


@functools.lru_cache(maxsize=8)
def _frontiers(store: str, parts: int, fanouts: tuple, batch_size: int, push_limit: int, halo: str):
    from hpcgnn.plan.frontier import expected_frontiers

    return expected_frontiers(store, parts, list(fanouts), batch_size, push_limit,
                              local=halo == "hec", exact=halo == "exact")


def tensor_time(cfg, meta, s: dict, topo, cal) -> _Cost:
    """One rank of the NeutronTP engine: NN layers on V/P rows with full width; the aggregation
    on all V rows with C/P (decoupled) or width/P (coupled) columns; split/gather all-to-alls."""
    v, e = meta.num_nodes, meta.num_edges
    p = topo.ranks
    m, t = cfg.model, cfg.tensor
    widths = [meta.num_features] + [m.hidden] * (m.layers - 1) + [meta.num_classes]
    rows = v / p
    ev = e + v
    c = _Cost(cal, topo.ranks_per_node, topo.device)
    frac = (p - 1) / p
    for l in range(m.layers):
        c.gemm(rows, widths[l], widths[l + 1], 3 if l > 0 else 2)
        c.elem(SAVED_PER_LAYER * rows * max(widths[l], widths[l + 1]) * F32 * 2)
    if t.mode == "decoupled":
        cols = meta.num_classes / p
        k = t.k or m.layers
        c.agg(ev, cols, 2 * k)
        c.elem(2 * k * v * cols * F32 * 3)            # teleport/scale passes of the rounds
        c.comm(4 * rows * meta.num_classes * F32 * frac, calls=4)
        c.move(4 * 2 * rows * meta.num_classes * F32)  # pack + unpack of every split/gather
        if m.arch == "gat":
            c.elem(4 * ev * F32 * 3)
    else:
        for l in range(m.layers):
            aw = min(widths[l], widths[l + 1]) / p
            times = 2 if l > 0 or widths[l + 1] < widths[l] else 1
            c.agg(ev, aw, times)
            c.comm(times * 2 * rows * aw * p * F32 * frac, calls=2 * times)
            c.move(times * 2 * 2 * rows * aw * p * F32)     # pack + unpack of every split/gather
    from hpcgnn.engine.memory_tensor import tensor_chunk_count

    c.ops(m.layers * OPS_PER_LAYER * max(tensor_chunk_count(cfg, meta, p), 1))
    _allreduce(c, cfg, widths, p)
    return c


TIME_MODELS = {"minibatch": minibatch_time, "fullgraph": fullgraph_time, "tensor": tensor_time}


def estimate(cfg, meta, shapes: list[dict], topo, cal) -> Prediction:
    """Memory and time of one resolved configuration ``cfg`` on ``topo`` (partition shapes
    ``shapes``, one per rank: :func:`scaled_shapes`)."""
    pred = Prediction()
    estimate_memory(cfg, meta, shapes, topo, cal, pred)
    model = TIME_MODELS.get(cfg.train.engine)
    if model is None:
        pred.notes.append(f"no time model for engine {cfg.train.engine!r} (hpcgnn/plan/estimator.py TIME_MODELS)")
        return pred
    per_rank = [model(cfg, meta, s, topo, cal) for s in (shapes if cfg.train.engine != "tensor" else shapes[:1])]
    slow = max(per_rank, key=lambda x: x.total)
    pred.epoch_s = slow.total
    pred.parts = dict(slow.parts)
    pred.bytes_per_epoch = float(max(x.sent for x in per_rank))
    # all ranks' halo bytes (the tensor engine's model is one rank's: the ranks send alike)
    pred.halo_bytes_per_epoch = float(sum(x.halo for x in per_rank)) * (
        topo.ranks if cfg.train.engine == "tensor" else 1)
    return pred
