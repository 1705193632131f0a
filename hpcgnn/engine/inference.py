"""Bounded-memory layer-wise full-neighbour inference over one rank's partition: the one
algorithm behind the minibatch engine's evaluation (``minibatch.eval = "full"``) and
`hpcgnn infer` (minibatch and fullgraph checkpoints). :func:`partition_inference` is their
shared entry (halo plan and rounds, GCN scales, features on the device);
:func:`layerwise_inference` the algorithm. The full-graph engine evaluates with its own
training forward (same layers, unchunked; the results agree up to floating-point order).

Every layer runs over all in-neighbours of all solid vertices (exact full-graph inference), in
memory that does not grow with the halo:

* **SAGE and GCN** (aggregation is a sum): the owners apply the layer's row-wise
  ``source_rows`` (the projection when it shrinks the width, GCN's source scale) to their solid
  rows; the halo rows of that result arrive in ``halo.rounds`` collectives
  (:class:`~hpcgnn.comm.halo.HaloRounds`), and each round's contribution is summed into a
  [num_solid, width] accumulator and freed. A layer holds its input and output (solid rows
  only; the output overwrites the accumulator chunk by chunk when their widths agree), the
  accumulator, one round of halo rows and one destination chunk's temporaries.
* **GAT** (softmax over all in-edges): the layer's halo rows are exchanged at once and its
  input is materialised over solid + halo rows; destinations still run in chunks.

Destinations are processed in chunks of at most ``rows`` rows. A chunk ``[a, b)`` is a slice of
the partition's CSR (no copy) whose destinations are source rows ``a .. b-1`` rather than a
prefix, so the destinations' own rows go to the conv's ``combine`` explicitly and a GAT self
loop becomes an explicit edge of the chunk. Results equal the unchunked whole-block path up to
the order of floating-point sums.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hpcgnn.sampling.block import Block

DEFAULT_CHUNK_BYTES = 256 << 20   # one chunk's temporaries with the automatic row budget
MIN_AUTO_ROWS = 1024


def layer_row_bytes(gat: bool, d_in: int, d_out: int, heads: int, avg_degree: float) -> int:
    """Bytes of temporaries per destination row of a chunk for one layer (``d_out``: a GAT
    head's width). SAGE/GCN: the aggregate at the width it runs, the two linear outputs, their
    sum and the activation; GAT: the per-edge logits and attention (three [edges, heads] arrays
    per row's ``avg_degree + 1`` edges) and the per-head output twice."""
    if gat:
        per_row = 3 * heads * (avg_degree + 1) + 2 * heads * d_out + 8
    else:
        per_row = min(d_in, d_out) + max(d_in, d_out) + 4 * d_out
    return int(per_row * 4)


def chunk_row_bytes(model, avg_degree: float) -> int:
    """Bytes of temporaries per destination row of a chunk at the model's most expensive layer
    (:func:`layer_row_bytes`; at least 1)."""
    from hpcgnn.nn.conv import GATConv

    return max([1] + [layer_row_bytes(isinstance(conv, GATConv), int(conv.in_dim), int(conv.out_dim),
                                      int(getattr(conv, "heads", 1)), avg_degree) for conv in model.layers])


def auto_rows(model, num_solid: int, num_edges: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The default row budget: as many rows as keep one chunk's temporaries within
    ``budget_bytes`` (at least MIN_AUTO_ROWS, at most ``num_solid``)."""
    avg = num_edges / max(num_solid, 1)
    rows = budget_bytes // chunk_row_bytes(model, avg)
    return int(max(1, min(max(num_solid, 1), max(MIN_AUTO_ROWS, rows))))


def chunk_block(indptr: torch.Tensor, indices: torch.Tensor, num_src: int, begin: int, end: int,
                self_loops: bool = False, bounds: tuple[int, int] | None = None) -> Block:
    """Block of destinations ``begin .. end-1`` (local rows) over all ``num_src`` local rows.

    The CSR is a view of the partition's (``indptr`` [num_solid + 1], ``indices`` [nnz]); with
    ``self_loops`` every destination also gets the edge from its own row (appended last).
    ``bounds``: ``(indptr[begin], indptr[end])`` known on the host (a device ``indptr`` is then
    not read back); nothing here waits for the device when it is given.
    """
    lo, hi = (int(indptr[begin]), int(indptr[end])) if bounds is None else (int(bounds[0]), int(bounds[1]))
    ptr = indptr[begin:end + 1] - lo
    idx = indices[lo:hi]
    if self_loops:
        n, m = end - begin, hi - lo
        steps = torch.arange(n + 1, dtype=ptr.dtype, device=ptr.device)
        new_ptr = ptr + steps
        new_idx = torch.empty(m + n, dtype=idx.dtype, device=idx.device)
        # edge j of row r moves to j + r; row r's self loop is its last slot, new_ptr[r + 1] - 1
        row = torch.repeat_interleave(steps[:-1], ptr[1:] - ptr[:-1], output_size=m)
        new_idx[torch.arange(m, dtype=ptr.dtype, device=ptr.device) + row] = idx
        new_idx[new_ptr[1:] - 1] = torch.arange(begin, end, dtype=idx.dtype, device=idx.device)
        ptr, idx = new_ptr, new_idx
    return Block(num_src, end - begin, ptr, idx)


def _rowwise(fn: Callable, h: torch.Tensor, rows: int, device=None):
    """``fn(h)`` computed in row chunks of ``rows`` into preallocated outputs (a tensor or a
    tuple of tensors), so no temporary of ``fn`` is larger than one chunk's; with ``device``
    each chunk of ``h`` is copied there first (``h`` streamed, not copied whole)."""
    n = h.shape[0]
    outs = None
    for a in range(0, n, rows):
        b = min(n, a + rows)
        res = fn(_on(h[a:b], device))
        single = isinstance(res, torch.Tensor)
        res = (res,) if single else tuple(res)
        if outs is None:
            outs = tuple(r.new_empty((n,) + tuple(r.shape[1:])) for r in res)
        for o, r in zip(outs, res):
            o[a:b] = r
    if outs is None:  # no rows
        res = fn(_on(h[:0], device))
        single = isinstance(res, torch.Tensor)
        outs = (res,) if single else tuple(res)
    return outs[0] if single else outs


COMPUTE_DTYPE = torch.float32
"""The dtype every layer computes in: layer-0 input rows held in half precision (a float16 or
bfloat16 feature store) are cast chunk by chunk, on the device (:func:`_on`)."""


def _on(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` (None: where it is), in :data:`COMPUTE_DTYPE` (input rows held in
    half precision are copied in that precision and cast there)."""
    t = t if device is None else t.to(device)
    return t if t.dtype == COMPUTE_DTYPE else t.to(COMPUTE_DTYPE)


def _host_rows(t: torch.Tensor) -> np.ndarray:
    """Host numpy rows of ``t`` in its dtype (bfloat16 as its uint16 bit patterns): what a
    halo exchange sends, so half-precision input rows travel at 2 bytes a value."""
    t = t.detach().cpu().contiguous()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def _rows_tensor(rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_host_rows`: received numpy rows as a tensor of ``dtype``."""
    t = torch.from_numpy(rows)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


@dataclass(eq=False)
class _Csr:
    """A forward-only bipartite CSR for the aggregation kernels (no prefix convention, so a
    destination chunk may have more rows than the round of sources it reads)."""

    num_src: int
    num_dst: int
    indptr: torch.Tensor
    indices: torch.Tensor


def auto_rounds(comm, num_halo: int, width: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Collective: halo rounds such that one round of ``width``-wide float32 rows fits in
    ``budget_bytes`` on every rank (the largest halo decides; same value on all ranks).
    ``comm``: the data plane (a :class:`~hpcgnn.comm.communicator.Communicator`) or None."""
    need = max(1, -(-int(num_halo) * int(width) * 4 // int(budget_bytes)))
    if comm is not None and comm.size > 1:
        need = int(comm.allreduce_(torch.tensor([need], dtype=torch.int64), op="max")[0])
    return need


def max_width(model) -> int:
    """The widest row any layer reads or writes (GAT hidden layers: heads x out_dim)."""
    from hpcgnn.nn.conv import GATConv

    w = 1
    for l, conv in enumerate(model.layers):
        w = max(w, int(conv.in_dim), _layer_width(model, l))
        if isinstance(conv, GATConv):
            w = max(w, conv.heads * conv.out_dim)
    return w


@torch.no_grad()
def partition_inference(model, part, comm, features: torch.Tensor, device, *, rows: int = 0,
                        halo_rounds: int = 0, plan=None, csr=None,
                        num_layers: int | None = None) -> torch.Tensor:
    """Collective: exact full-neighbour output of the model's first ``num_layers`` layers (default
    all: the logits) for the solid rows of ``part`` [num_solid, width], on ``device``; the halo
    rows travel through ``comm``, the data plane (a
    :class:`~hpcgnn.comm.communicator.Communicator`, None on one process).

    ``features`` [num_solid, in_dim]: the solid rows' input (any device; when elsewhere, host
    rows of a tiered or host-only store, its rows are streamed to ``device`` chunk by chunk
    where the first layer works row-wise, copied whole only where it aggregates them
    unprojected: :func:`layerwise_inference`); ``rows``: destination rows per chunk (0 = :func:`auto_rows`);
    ``halo_rounds``: collectives per layer for the halo rows (0 = :func:`auto_rounds`, the
    same on every rank); ``plan``: the partition's :class:`~hpcgnn.comm.halo.HaloPlan` (built,
    collectively, when None); ``csr``: the partition's (indptr, local indices) (default
    ``part.local_csr()``). GCN layers scale by :func:`~hpcgnn.nn.conv.gcn_norm` of the full
    graph's degrees (the whole graph is the block evaluation runs on: hpcgnn.nn.conv's
    docstring)."""
    from hpcgnn.comm.halo import ExactHalo, HaloPlan
    from hpcgnn.nn.conv import GCNConv, gcn_norm

    if plan is None:
        plan = HaloPlan.from_partition(part, comm)
    rounds = halo_rounds or auto_rounds(comm, part.num_halo, max_width(model))
    halo = ExactHalo(comm, plan).rounds(rounds)
    gcn_scale = None
    if any(isinstance(conv, GCNConv) for conv in model.layers):
        gcn_scale = gcn_norm(part.local_degree()[:part.num_solid])
    indptr, local_indices = part.local_csr() if csr is None else csr
    return layerwise_inference(model, indptr, local_indices, features, halo, rows=rows,
                               gcn_scale=gcn_scale, num_layers=num_layers, device=device)


@torch.no_grad()
def layerwise_inference(model, indptr: np.ndarray, indices: np.ndarray, x_solid: torch.Tensor,
                        halo, *, rows: int = 0, gcn_scale: torch.Tensor | None = None,
                        num_layers: int | None = None, device=None) -> torch.Tensor:
    """Output of the model's first ``num_layers`` layers (default all) for the solid rows.

    ``x_solid`` [num_solid, in_dim]: layer-0 input of the solid rows (float32, or a feature
    store's float16 / bfloat16 rows: cast chunk by chunk where they are computed on, and sent
    to the other ranks in that precision); ``indptr``
    [num_solid + 1] / ``indices`` (local ids, halo rows after the solid ones): the partition's
    CSR over solid destinations; ``halo``: a :class:`~hpcgnn.comm.halo.HaloRounds` of the
    partition (collective calls: every rank runs the same layers); ``rows``: destination rows
    per chunk (0 = :func:`auto_rows`); ``gcn_scale`` [num_solid]: the solid rows'
    :func:`~hpcgnn.nn.conv.gcn_norm` of their full-graph degrees (GCN layers). ``device``: where
    the layers run (default ``x_solid``'s device); when ``x_solid`` lives elsewhere its rows
    are copied there in chunks of ``rows`` as the first layer reads them (GCN, projecting SAGE,
    GAT's projection), whole only for an unprojected SAGE aggregation. Returns [num_solid, width
    of the last layer run] on ``device``; the model runs in eval mode and its mode is restored
    afterwards.
    """
    from hpcgnn.nn.aggregate import kernel_options
    from hpcgnn.nn.conv import GATConv, GCNConv, SAGEConv

    device = x_solid.device if device is None else torch.device(device)
    num_solid = int(x_solid.shape[0])
    ip_host = np.ascontiguousarray(indptr, dtype=np.int64)
    ip = torch.from_numpy(ip_host).to(device)
    ix = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)).to(device)
    if rows <= 0:
        rows = auto_rows(model, num_solid, int(ix.shape[0]))
    layers = model.num_layers if num_layers is None else int(num_layers)
    if not 1 <= layers <= model.num_layers:
        raise ValueError(f"num_layers must be in 1..{model.num_layers}, got {layers}")
    if gcn_scale is not None:
        gcn_scale = gcn_scale.to(device=device, dtype=COMPUTE_DTYPE)
    chunks = [(a, min(num_solid, a + rows)) for a in range(0, num_solid, rows)]
    edges = None          # the streamed aggregation's edge groups: built at the first SAGE/GCN layer
    deg = (ip[1:] - ip[:-1]).to(COMPUTE_DTYPE)
    inv_deg = torch.where(deg > 0, 1.0 / deg.clamp(min=1), torch.zeros_like(deg))

    was_training = model.training
    model.eval()
    try:
        h = x_solid
        for l in range(layers):
            conv = model.layers[l]
            final = l == model.num_layers - 1
            if isinstance(conv, GATConv):
                out = _gat_layer(model, l, conv, h, halo, ip, ix, ip_host, rows, chunks, final)
            elif isinstance(conv, (SAGEConv, GCNConv)):
                if isinstance(conv, GCNConv):
                    if gcn_scale is None:
                        raise ValueError("layerwise_inference: GCN layers need gcn_scale")
                    src = torch.empty(num_solid, conv.out_dim if conv.project_first else conv.in_dim,
                                      dtype=COMPUTE_DTYPE, device=device)
                    for a, b in chunks:
                        src[a:b] = conv.source_rows(_on(h[a:b], device), gcn_scale[a:b])
                wire = None        # rows sent to the halo, when narrower than src (half-precision input)
                if not isinstance(conv, GCNConv):
                    src = _rowwise(conv.source_rows, h, rows, device) if conv.project_first else _on(h, device)
                    if not conv.project_first:
                        wire = h if h.dtype != src.dtype else None
                        h = src
                if edges is None:
                    edges = _EdgeGroups.build(ip_host, indices, num_solid, halo, chunks, device)
                acc = _aggregate_streamed(src, halo, ip, ix, edges, chunks, kernel_options(conv), wire=wire)
                wire = None
                out = None
                for a, b in chunks:
                    if isinstance(conv, SAGEConv):
                        res = conv.update(acc[a:b] * inv_deg[a:b].unsqueeze(1), _on(h[a:b], device))
                    else:
                        ds = gcn_scale[a:b].unsqueeze(1)
                        res = acc[a:b] * ds + src[a:b] * ds
                        if not conv.project_first:
                            res = conv.lin(res)
                        if conv.bias is not None:
                            res = res + conv.bias
                    out = _store_rows(out, res, a, b, num_solid, model, final, reuse=acc)
                    res = None          # one chunk's rows at a time, not two across chunks
                if out is None:
                    out = torch.empty((0, _layer_width(model, l)), dtype=COMPUTE_DTYPE, device=device)
                del acc, src
            else:
                raise ValueError(f"layerwise_inference: unsupported layer {type(conv).__name__}")
            h = out
        return h
    finally:
        model.train(was_training)


@dataclass(eq=False)
class _EdgeGroups:
    """Where every in-edge of the solid destinations reads its source during the streamed
    aggregation, fixed for all layers: ``group`` [nnz] (int16) is 0 for a solid source and
    k + 1 for a halo source arriving in round k, ``remap`` [num_local] the source's row in
    its group's buffer (device tensors); ``counts`` [chunks, rounds + 1] (host) the edges of
    each destination chunk per group and ``bounds`` [chunks, 2] (host) each chunk's edge range.
    Built once on the host, so the chunk loop never reads the device back."""

    group: torch.Tensor
    remap: torch.Tensor
    counts: np.ndarray
    bounds: np.ndarray

    @staticmethod
    def build(ip_host: np.ndarray, indices, num_solid: int, halo, chunks: list, device) -> "_EdgeGroups":
        num_local = num_solid + int(halo.num_halo)
        groups = int(halo.rounds) + 1
        local_group = np.zeros(num_local, dtype=np.int16)
        local_group[num_solid:] = np.asarray(halo.round_of, dtype=np.int16) + 1
        edge_group = local_group[np.asarray(indices)]
        del local_group
        bounds = np.array([(ip_host[a], ip_host[b]) for a, b in chunks], dtype=np.int64).reshape(-1, 2)
        counts = np.zeros((len(chunks), groups), dtype=np.int64)
        for c, (lo, hi) in enumerate(bounds):
            counts[c] = np.bincount(edge_group[lo:hi], minlength=groups)[:groups]
        remap = np.arange(num_local, dtype=np.int64)
        remap[num_solid:] = halo.row_in_round
        return _EdgeGroups(torch.from_numpy(edge_group).to(device), torch.from_numpy(remap).to(device),
                           counts, bounds)


def _aggregate_streamed(src: torch.Tensor, halo, ip: torch.Tensor, ix: torch.Tensor,
                        edges: _EdgeGroups, chunks: list, kernels: dict | None = None,
                        wire: torch.Tensor | None = None) -> torch.Tensor:
    """[num_solid, width]: for every solid destination the sum of ``src`` rows over all its
    in-edges, the halo sources' rows arriving round by round from their owners (aggregation
    ``kernels``: the layer's backend and determinism, :func:`hpcgnn.nn.aggregate.kernel_options`).
    ``chunks``: the destination row ranges; ``edges``: the edges' groups (:class:`_EdgeGroups`).
    A chunk's edges of one group are selected with ``nonzero_static`` at the count the host
    knows, so no chunk waits for the device. ``wire``: ``src``'s rows as held in a narrower
    dtype (half-precision features, which ``src`` is the exact cast of): the halo rows travel
    in it and are cast on arrival."""
    from hpcgnn.nn.aggregate import aggregate_sum

    num_solid = ip.shape[0] - 1
    acc = torch.zeros(num_solid, src.shape[1], dtype=src.dtype, device=src.device)
    src_np = None
    sent = src if wire is None else wire
    for g in range(halo.rounds + 1):
        if g == 0:
            x = src
        else:
            if src_np is None:
                src_np = _host_rows(sent)
            x = _rows_tensor(halo.round_rows(src_np, g - 1), sent.dtype).reshape(-1, src.shape[1])
            x = x.to(src.device, src.dtype)          # cast on arrival (exact)
        if x.shape[0] == 0:
            continue
        for c, (a, b) in enumerate(chunks):
            lo, hi = (int(v) for v in edges.bounds[c])
            n = int(edges.counts[c, g])
            if n == 0:
                continue
            if n == hi - lo:                 # every edge of the chunk reads this group
                blk = _Csr(int(x.shape[0]), b - a, ip[a:b + 1] - lo, edges.remap[ix[lo:hi]])
            else:
                keep = edges.group[lo:hi] == g
                kept = torch.zeros(hi - lo + 1, dtype=torch.int64, device=src.device)
                torch.cumsum(keep, 0, out=kept[1:])
                sel = ix[lo:hi][torch.nonzero_static(keep, size=n).squeeze(1)]   # n is known: no wait
                blk = _Csr(int(x.shape[0]), b - a, kept[ip[a:b + 1] - lo], edges.remap[sel])
                del keep, sel
            acc[a:b] += aggregate_sum(blk, x, **(kernels or {}))
            blk = kept = None            # one chunk's edges at a time, not two across chunks
        del x
    return acc


def _gat_layer(model, l: int, conv, h: torch.Tensor, halo, ip, ix, ip_host: np.ndarray, rows: int,
               chunks: list, final: bool) -> torch.Tensor:
    """One GAT layer over solid destinations with the halo input rows materialised
    (``ip_host``: the CSR's indptr on the host, the chunks' edge bounds)."""
    num_solid = int(h.shape[0])     # h: float32, or half-precision input rows (sent as they are)
    halo_rows = _rows_tensor(halo.all_rows(_host_rows(h)), h.dtype)
    h_local = torch.cat([h, halo_rows.reshape(-1, h.shape[1]).to(h.device)])
    del halo_rows
    num_local = int(h_local.shape[0])
    z, el = _rowwise(conv.source_rows, h_local, rows, ip.device)   # streamed when h is elsewhere
    del h_local
    out = None
    for a, b in chunks:
        blk = chunk_block(ip, ix, num_local, a, b, self_loops=conv.self_loop, bounds=(ip_host[a], ip_host[b]))
        res = conv.combine(blk, z, el, z[a:b], self_loop=False)
        res = res.mean(1) if final else res.flatten(1)
        out = _store_rows(out, res, a, b, num_solid, model, final)
        blk = res = None                 # one chunk's block and rows at a time
    if out is None:
        out = torch.empty((0, _layer_width(model, l)), dtype=COMPUTE_DTYPE, device=ip.device)
    return out



def _store_rows(out, res: torch.Tensor, a: int, b: int, num_solid: int, model, final: bool,
                reuse: torch.Tensor | None = None) -> torch.Tensor:
    """Write destination rows ``a:b`` of a layer's output (ReLU + dropout unless ``final``) into
    ``out`` [num_solid, width], allocated at the first chunk; returns ``out``. ``reuse``: a
    [num_solid, ...] buffer whose rows ``a:b`` the caller has read for the last time when it
    writes them (the layer's aggregate): it becomes ``out`` when its shape and type fit, so a
    layer holds one solid-row buffer less."""
    if not final:
        res = model.dropout.forward_relu(res)
    if out is None:
        fits = reuse is not None and tuple(reuse.shape) == (num_solid, res.shape[1]) and \
            reuse.dtype == res.dtype and reuse.device == res.device
        out = reuse if fits else res.new_empty((num_solid, res.shape[1]))
    out[a:b] = res
    return out


def _layer_width(model, l: int) -> int:
    """Output width of layer ``l`` as the next layer (or the caller) sees it."""
    from hpcgnn.nn.conv import GATConv

    conv = model.layers[l]
    if isinstance(conv, GATConv):
        return conv.out_dim if l == model.num_layers - 1 else conv.out_dim * conv.heads
    return conv.out_dim


@torch.no_grad()
def sampled_inference(model, fetch, ids: np.ndarray, batch_size: int, rt, device, *, device_block=None,
                      num_layers: int | None = None, argmax: bool = False) -> torch.Tensor:
    """Collective: DistDGL-style sampled inference of the solid local ids ``ids`` of this rank:
    their neighbourhoods sampled over the whole graph with ``fetch``'s fanouts and their input
    rows pulled from the owners (``fetch``: the rank's :class:`~hpcgnn.comm.exact_fetch.ExactFetch`,
    whose fanout count is the number of layers run), in batches of ``batch_size`` seeds per rank
    (:func:`~hpcgnn.engine.batches.equalised_batches`: every rank takes part in every batch's
    collectives). Returns, on the host, the output of the model's first ``num_layers`` layers
    (default all: the logits) [len(ids), width] float32, or with ``argmax`` its argmax
    [len(ids)] int64.

    Every batch samples with ``(epoch, step) = (-1, 0)``: a vertex's neighbours at each hop are a
    function of (seed, hop, vertex), so a row does not depend on the batch size or on which other
    vertices are computed. Memory: one batch's blocks and input rows (its three-hop frontier), not
    the partition's layer outputs. ``device_block``: how a sampled host block goes to ``device``
    (default ``block.to(device)``)."""
    from hpcgnn.engine.batches import batch_bounds, equalised_batches
    from hpcgnn.upload import upload

    layers = len(fetch.fanouts)
    if num_layers is not None and num_layers != layers:
        raise ValueError(f"sampled_inference: fetch samples {layers} hops, {num_layers} layers asked")
    on_device = device_block or (lambda b: b.to(device))
    ids = np.asarray(ids, dtype=np.int64)
    m, sizes = equalised_batches(ids.size, batch_size, rt)
    bounds = batch_bounds(sizes) if m else np.zeros(1, np.int64)
    out = None
    begin = fetch.part.solid_begin
    for k in range(m):
        seeds = ids[bounds[k]:bounds[k + 1]]
        batch = fetch.sample(seeds + begin, -1, 0)
        x = fetch.fetch_features(batch.frontiers[0])
        if seeds.size:
            h = upload(torch.from_numpy(x), device)
            for l, block in enumerate(batch.blocks):
                h = model.layer_forward(l, on_device(block), h)
            h = (h.argmax(dim=1) if argmax else h).cpu()
            if out is None:
                out = h.new_empty((ids.size,) + tuple(h.shape[1:]))
            out[bounds[k]:bounds[k + 1]] = h
            del h
        del x, batch   # the next batch's buffers without this one's
    if out is None:    # no seeds on this rank: the width of the rows asked for
        width = () if argmax else (_output_width(model, layers),)
        out = torch.empty((0,) + width, dtype=torch.int64 if argmax else torch.float32)
    return out


def _output_width(model, num_layers: int) -> int:
    """Width of the output of the model's first ``num_layers`` layers."""
    return _layer_width(model, num_layers - 1)
