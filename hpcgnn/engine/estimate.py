"""A rank's resident memory, estimated before a run from the store's metadata and the config.

:func:`estimate_rank_memory` adds up named terms (bytes), each with the setting that shrinks it:

* ``baseline``: the process before any graph data (Python, torch, MPI, native kernels) -
  measured in the calling process (:func:`hpcgnn.run.memory.rss_bytes` once those are imported);
* ``partition``: the partition file's arrays as loaded, plus the local CSR copy and the halo plan;
* minibatch engine: ``store`` (a tiered store's device tier when it is host memory, see
  :func:`store_terms`), ``hec`` (per layer: lines x width, lines = min(cs, halo vertices, rows the
  AEP can deliver in an epoch), plus the tag directory, which is O(cs)), ``activations`` (the sampled frontiers: expected distinct
  vertices of each hop, times the widths, times the tensors kept for backward) and ``eval`` (the
  bounded layer-wise inference: three solid-row buffers at the widest layer, one halo round and
  one chunk, see :mod:`hpcgnn.engine.inference`);
* full-graph engine: ``activations`` (every layer's input over solid + halo rows and the tensors
  kept for backward; with ``fullgraph.offload`` the host-resident layer data and cached
  aggregates, then the larger of a forward batch of chunks and one layer's backward host
  gradients beside its batch, :func:`offload_phase_bytes`) and, offloaded, ``chunks`` (the
  chunks' own CSRs, transposes and transfer plan);
* every engine: ``model_state`` (the parameters, their gradients, Adam's two moments and the
  gradient allreduce's flat float32 buffer: five float32 copies of every parameter, counted on
  the model the engine builds, see :func:`model_param_sizes`; in bfloat16 also the bfloat16
  copies of the linear layers that forward keeps for backward) and ``optimizer_step`` (the
  larger of the temporaries of torch's Adam step, :func:`adam_step_bytes`, and of the gradient
  allreduce, :func:`allreduce_step_bytes`).

The peak is ``baseline + partition`` + the terms held throughout + ``max(training, evaluation,
optimizer step)``: the minibatch engine keeps only the largest of ``activations``, ``eval`` and
``optimizer_step``, the tensor engine the largest of ``setup`` (its construction's transient:
the store's CSR, freed before the first epoch), ``activations`` and ``optimizer_step`` (and adds
``kernels`` and ``heap``, see :func:`tensor_terms`); the
full-graph engine adds the step (its ``activations`` include layer data resident for the whole
run). The figures are checked against measured peaks in tests/engine/test_estimate.py and
docs/benchmarks.md.

The tensor engine's device sizing lives here too, for the estimate and the engine alike:
:func:`tensor_device_bytes` (the working set of ``k`` chunks), :func:`auto_chunks` (the count
that fits a budget) and :func:`tensor_chunk_count` (``tensor.chunks`` as a count). The budget
itself, ``tensor.device_memory`` in bytes, is :func:`hpcgnn.run.engines.tensor.device_budget`:
the config's key check needs it, and run/ sits below this layer.

The compute device has its own estimate, :func:`estimate_device_memory` (named terms: the
store's device rows, the model, per engine activations / HECs / chunks / halo buffers, the CUDA
context), checked before the first epoch by :func:`check_device_memory` against the GPU's free
memory or ``runtime.device_memory_limit`` (one line naming the largest term and its setting,
exit 2 on every rank), and sizing ``store.device_memory = 'auto'`` (:func:`store_auto_bytes`).
On the CPU its terms are what :class:`hpcgnn.run.memory.DeviceMemoryMeter` counts; with
``sample`` (the pre-run check) the minibatch frontiers are those of a few minibatches sampled
from the partition and the tensor chunk is sized from the real chunks (measured on 2 ranks of
Cora, tests/engine/test_device_memory.py: full graph GCN/GAT 1.00, minibatch 1.00-1.17, tensor
1.00 of the meter's peak). Without it (``hpcgnn plan``, no store) the uniform frontier model and
:func:`tensor_device_bytes` are upper bounds (minibatch up to 2x on clustered graphs, the tensor
chunk 2-3x); ``tensor.chunks = 'auto'`` sizes with that bound.

This module is the project's one memory estimator, used through its public names:
``hpcgnn train``'s pre-run refusal (:func:`check_memory`), ``hpcgnn inspect STORE --config``
(:func:`estimate_rank_memory`), the engines (the tensor engine's chunk sizing, the full graph's
:func:`layer_widths`) and ``hpcgnn plan`` (:mod:`hpcgnn.plan.estimator`: its memory figures are
:func:`estimate_rank_memory` split by :func:`host_device_peak`; its time model reads
:func:`layer_widths`, :func:`expected_distinct` and :func:`model_param_sizes`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError

F32 = 4
F64 = 8
I64 = 8
BF16 = 2
# Tensors kept per layer for backward, in units of the layer's (rows x width): input, aggregate,
# two linear outputs, their sum, the activation (native dropout keeps no mask) and the gradients.
SAVED_PER_LAYER = 6
# float32 copies of every parameter held for the whole run: the values, their gradients, Adam's
# exp_avg and exp_avg_sq, and GradientAllreduce's flat buffer (hpcgnn/comm/allreduce.py)
MODEL_COPIES = 5
MODEL_SHRINK = "model.hidden or model.layers (the parameters' count)"
# resident bytes torch's CPU compute libraries and thread pools add at the first operators, after
# the baseline was measured (a Linear forward/backward and an Adam step: 88 MB, torch 2.x, 2 cores)
TORCH_KERNELS = 88_000_000
# the tensor engine's RSS beyond the bytes its terms count (freed blocks the allocator keeps,
# fragmentation, per-thread arenas): HEAP_SLACK of the counted graph and epoch bytes plus
# HEAP_FLOOR (products-like 0.04 / 0.25 on 2 ranks: the epoch peaks of one setting differ by
# up to 6 % between ranks, and RSS at an epoch's start exceeds the held terms by 0.02-0.24 GB)
HEAP_SLACK = 0.05
HEAP_FLOOR = 32 << 20
CUDA_CONTEXT = 600 << 20       # bytes a CUDA context and torch's kernels occupy on the GPU
# bytes the CUDA math libraries keep allocated through torch's allocator once used (the cuBLAS and
# cuBLASLt workspaces): measured at run time (hpcgnn.run.memory.cuda_library_bytes); this without a
# GPU (an H200 with torch 2.11: 50-65 MiB above the tensors in every Cora row of make check-gpu)
CUDA_LIBRARIES = 64 << 20
# device bytes per edge of the in-memory full graph's block on CUDA (torch kernels): the int64
# indices, the transpose's int64 destinations (built on the host, copied once) and the float32
# ones both sparse CSR tensors (forward and transpose) share as values; GAT also the transpose's
# int64 edge ids (SAGE and GCN drop them: Block.drop_edge_ids) and the int64 destination of every
# edge
DEVICE_BLOCK_EDGE_BYTES = 2 * I64 + F32
SAMPLED_BATCHES = 8            # minibatches the device estimate samples (minibatch_sampled_sizes)
_ESTIMATE_STREAM = 11          # seed stream of the estimate's own sampling


@dataclass
class MemoryEstimate:
    """Named byte terms of one rank's peak; ``total`` = their sum; ``shrink[name]`` says which
    setting makes a term smaller."""

    part_id: int
    terms: dict = field(default_factory=dict)
    shrink: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)   # GPU bytes not in ``terms`` (tensor engine on CUDA)
    params: int = 0                              # the model's parameter count (values)
    phases: dict = field(default_factory=dict)   # terms of phases that never overlap, before
                                                 # all but the largest were zeroed

    @property
    def total(self) -> int:
        return int(sum(self.terms.values()))

    def largest(self) -> tuple[str, int]:
        name = max((k for k in self.terms if k not in ("baseline", "cuda_context")),
                   key=lambda k: self.terms[k], default=None)
        if name is None:
            name = next(iter(self.terms), "baseline")
        return name, int(self.terms.get(name, 0))


def part_shapes(store: str | Path, part_id: int) -> dict:
    """Sizes of one partition from its file's dataset shapes (reads no array data):
    num_solid, num_halo, num_edges, num_train, file_bytes (all datasets as loaded)."""
    import h5py

    from hpcgnn.partition.store import part_file_name

    path = Path(store) / part_file_name(part_id)
    try:
        with h5py.File(path, "r") as f:
            file_bytes = sum(int(np.prod(f[k].shape)) * f[k].dtype.itemsize for k in f.keys()
                             if isinstance(f[k], h5py.Dataset))
            a = f.attrs
            shapes = {"num_solid": int(a["num_solid"]), "num_halo": int(a["num_halo"]),
                      "num_edges": int(f["indices"].shape[0]), "file_bytes": int(file_bytes)}
            tm = f["train_mask"]
            shapes["num_train"] = int(np.count_nonzero(tm[()])) if tm.shape[0] else 0
    except (OSError, KeyError) as exc:
        raise InputError(f"{path}: cannot read the partition's sizes ({exc})") from None
    return shapes


def expected_distinct(pool: int, draws: float) -> float:
    """Expected distinct vertices among ``draws`` uniform picks from ``pool``."""
    if pool <= 0:
        return 0.0
    return pool * -math.expm1(-draws / pool)


def layer_widths(cfg, in_dim: int, num_classes: int) -> list[int]:
    """Input width of every layer, then the output width."""
    m = cfg.model
    hid = m.hidden * (m.heads if m.arch == "gat" else 1)
    return [in_dim] + [hid] * (m.layers - 1) + [num_classes]


@functools.lru_cache(maxsize=256)
def _built_param_sizes(kind: str, in_dim: int, hidden: int, num_classes: int, layers: int,
                       heads: int, variant: str) -> tuple:
    """``(numel, in a bf16-capable linear layer)`` per parameter of a model built on torch's
    meta device (shapes only, no memory); ``kind``: an arch of build_model, or the tensor
    engine's ``decoupled`` / ``decoupled-attention`` / ``coupled``."""
    import torch

    from hpcgnn.nn.precision import Linear

    with torch.device("meta"):
        if kind.startswith("decoupled"):
            from hpcgnn.nn.decoupled import DecoupledModel

            model = DecoupledModel(in_dim, hidden, num_classes, layers, 0.0,
                                   attention=kind == "decoupled-attention")
        elif kind == "coupled":
            from hpcgnn.nn.decoupled import CoupledModel

            model = CoupledModel(in_dim, hidden, num_classes, layers, 0.0)
        else:
            from hpcgnn.nn.models import build_model

            model = build_model(kind, in_dim, hidden, num_classes, layers, heads, 0.0,
                                **({"gat_variant": variant} if kind == "gat" else {}))
    linear = {id(p) for mod in model.modules() if isinstance(mod, Linear) for p in mod.parameters()}
    return tuple((int(p.numel()), id(p) in linear) for p in model.parameters())


def model_param_sizes(cfg, in_dim: int, num_classes: int) -> tuple:
    """``(numel, in a linear layer)`` of every parameter of the model ``cfg``'s engine builds,
    in the optimizer's order: :func:`hpcgnn.nn.models.build_model` (minibatch, full graph: arch,
    hidden, layers, heads, gat_variant) or the tensor engine's ``DecoupledModel`` (attention
    vectors for GAT) / ``CoupledModel``, built on the meta device, so the count cannot drift
    from the model. Every rank holds all of them (the tensor engine replicates its MLP too)."""
    m = cfg.model
    kind = m.arch
    if cfg.train.engine == "tensor":
        kind = cfg.tensor.mode + ("-attention" if m.arch == "gat" and cfg.tensor.mode == "decoupled" else "")
    return _built_param_sizes(kind, int(in_dim), int(m.hidden), int(num_classes), int(m.layers),
                              int(m.heads), str(m.gat_variant))


def model_state_bytes(sizes, precision: str = "fp32", copies: int = MODEL_COPIES) -> int:
    """Bytes of ``copies`` float32 copies of the parameters ``sizes`` (:func:`model_param_sizes`;
    :data:`MODEL_COPIES`: values, gradients, Adam's two moments, the allreduce buffer); with
    ``precision = "bf16"`` also the bfloat16 copy of every linear layer's weight and bias that
    forward makes (kept for backward: 2 bytes each, measured +0.5x the float32 weights)."""
    b = copies * sum(n for n, _ in sizes) * F32
    if precision == "bf16":
        b += sum(n for n, lin in sizes if lin) * BF16
    return int(b)


def adam_step_bytes(sizes, weight_decay: float, device: str) -> int:
    """Peak bytes of the temporaries of one Adam step (:class:`hpcgnn.nn.optim.Adam`, which
    runs ``torch.optim.Adam``'s default implementation; float32 parameters ``sizes`` in the
    optimizer's order).

    CPU: the per-parameter loop (torch's default off CUDA is not foreach): parameter ``i``
    holds its weight-decayed gradient (``weight_decay != 0``), ``sqrt(exp_avg_sq)`` and the
    new denominator while the previous parameter's denominator is still referenced:
    ``max_i (n[i-1] + (2 + decay) n[i])`` floats (measured with torch 2.13: exactly that,
    e.g. 2x the parameters for SAGE's two equal weights with decay, 3x for a GCN/GAT weight).
    CUDA: the foreach implementation: one list of parameter-sized temporaries at a time
    (the decayed gradients, then the square roots): ``n`` floats."""
    ns = [n for n, _ in sizes]
    if device == "cuda":
        return int(sum(ns) * F32)
    per = 3 if weight_decay else 2
    return int(max((prev + per * n for prev, n in zip([0] + ns[:-1], ns)), default=0) * F32)


def allreduce_step_bytes(sizes, ranks: int) -> int:
    """Bytes of the gradient allreduce's transient copy of its flat buffer on ``ranks`` ranks
    (0 on one rank): MPICH's reduction buffer (measured half the buffer on 2 ranks, counted
    whole) or, with torch.distributed from a GPU, the buffer copied back to the host."""
    return int(sum(n for n, _ in sizes) * F32) if ranks > 1 else 0


def model_terms(cfg, meta, est: MemoryEstimate, on_device: bool = False) -> None:
    """``model_state`` and ``optimizer_step`` (see the module docstring) of the model ``cfg``'s
    engine builds; ``on_device``: the parameters, gradients, moments and Adam's temporaries
    are in GPU memory (tensor engine on CUDA, ``est.device['nn']``), the host keeps the
    allreduce's buffer and its copy."""
    sizes = model_param_sizes(cfg, meta.num_features, meta.num_classes)
    est.params = int(sum(n for n, _ in sizes))
    ar = allreduce_step_bytes(sizes, int(meta.num_parts))
    if on_device:
        est.terms["model_state"] = model_state_bytes(sizes, "fp32", 1)
        est.terms["optimizer_step"] = ar
    else:
        dev = "cuda" if cfg.train.device == "cuda" else "cpu"
        est.terms["model_state"] = model_state_bytes(sizes, cfg.train.precision)
        est.terms["optimizer_step"] = max(ar, adam_step_bytes(sizes, cfg.train.weight_decay, dev))
    est.shrink["model_state"] = MODEL_SHRINK
    est.shrink["optimizer_step"] = MODEL_SHRINK


def _keep_largest(est: MemoryEstimate, names: tuple) -> None:
    """Phases that never overlap: zero all of ``names`` but the largest (the first on a tie)."""
    have = [k for k in names if k in est.terms]
    est.phases.update({k: int(est.terms[k]) for k in have})
    if have:
        keep = max(have, key=lambda k: est.terms[k])
        for k in have:
            if k != keep:
                est.terms[k] = 0


# appended to a pre-run reader's refusal of a partition file's topology (the engine's load would
# refuse the file too, on its part_hash, but only after the check)
CORRUPT_PARTITION = " (the file is corrupt or was modified; partition the graph again)"


def _partition_file(meta, part_id: int) -> str:
    from hpcgnn.partition.store import part_file_name

    return str(Path(meta.path) / part_file_name(part_id))


def _checked_indptr(f, meta, part_id: int) -> np.ndarray:
    """The partition file's ``indptr`` (open h5py file ``f``), checked
    (:func:`hpcgnn.data.graph.check_row_pointer`: one offset per solid vertex and one more)."""
    from hpcgnn.data.graph import check_row_pointer

    ns = int(meta.part_offsets[part_id + 1]) - int(meta.part_offsets[part_id])
    indptr = np.asarray(f["indptr"][()], dtype=np.int64)
    check_row_pointer(_partition_file(meta, part_id), indptr, f["indices"].shape[0], ns, CORRUPT_PARTITION)
    return indptr


def _checked_indices(edges: np.ndarray, meta, part_id: int) -> np.ndarray:
    """``edges`` (global vertex IDs read from a partition file's ``indices``), checked to lie in
    ``[0, num_nodes)`` (:func:`hpcgnn.data.graph.check_vertex_ids`)."""
    from hpcgnn.data.graph import check_vertex_ids

    check_vertex_ids(_partition_file(meta, part_id), edges, int(meta.num_nodes), CORRUPT_PARTITION)
    return edges


def estimate_rank_memory(cfg, meta, part_id: int, baseline_bytes: int,
                         shapes: dict | None = None) -> MemoryEstimate:
    """Peak resident bytes of rank ``part_id`` for ``cfg`` on the store ``meta``."""
    from hpcgnn.run.engines.registry import engine_spec, resolve

    s = shapes or part_shapes(meta.path, part_id)
    ns, nh, ne = s["num_solid"], s["num_halo"], s["num_edges"]
    nl = ns + nh
    est = MemoryEstimate(part_id)
    est.terms["baseline"] = int(baseline_bytes)
    # the file's arrays + the local-id copy of the edges + local degree + the halo plan
    est.terms["partition"] = int(s["file_bytes"] + ne * I64 + nl * I64 + nh * I64)
    est.shrink["partition"] = "more partitions (hpcgnn partition --parts)"
    resolve(engine_spec(cfg.train.engine).memory_terms)(cfg, meta, s, est)
    return est


def _sizes(cfg, meta, s: dict):
    """(solid, halo, edges, local rows, layer widths, layers, widest) of partition shapes ``s``."""
    ns, nh, ne = s["num_solid"], s["num_halo"], s["num_edges"]
    widths = layer_widths(cfg, meta.num_features, meta.num_classes)
    return ns, nh, ne, ns + nh, widths, cfg.model.layers, max(widths)


def hec_bytes(cfg, meta, s: dict) -> tuple[int, int]:
    """(embedding rows, tag directory) bytes of a rank's HECs (``minibatch.halo = "hec"``), for
    partition shapes ``s``. Embedding rows exist only for lines written (at most min(cs, halo),
    growing by doubling); the tag directory (native/cache.cpp) lives in host memory, allocated
    and filled at construction: a hash table of the next power of two >= 2 cs entries (16 bytes
    each) and three int64 per ring slot (tag, clock, storage row)."""
    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    mb = cfg.minibatch
    iters = math.ceil(max(s["num_train"], 1) / mb.batch_size)
    lines = min(mb.cache_lines, nh, iters * max(meta.num_parts - 1, 0) * mb.push_limit)
    table = 16
    while table < 2 * mb.cache_lines:
        table *= 2
    return int(lines * sum(widths[:layers]) * F32), int((table * 2 * I64 + mb.cache_lines * 3 * I64) * layers)


def hec_capacity_bytes(cfg, meta, s: dict) -> int:
    """Bytes of a rank's HEC rows at capacity (``min(cs, halo)`` lines per layer input): what
    :func:`hpcgnn.store.rank.build_rank_store` places beside the feature rows (0 without HECs)."""
    if cfg.train.engine != "minibatch" or cfg.minibatch.halo != "hec":
        return 0
    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    return int(min(cfg.minibatch.cache_lines, nh) * sum(widths[:layers]) * F32)


def hec_device_bytes(cfg, meta, s: dict, budget: int | None, feature_bytes: int) -> int:
    """Device bytes of a rank's HEC rows on CUDA for a store ``budget`` (None: unlimited): all of
    them when the budget holds every feature row and every HEC at capacity (the store's
    all-on-device case, :func:`hpcgnn.store.rank.build_rank_store`); otherwise the placement
    shares the budget between feature rows and HEC rows, and the HECs get at most what the
    feature rows leave (``store.device_memory = 'auto'`` asks for both: its budget is what the
    device has left, up to the feature rows and the HECs at capacity). The tag directory is
    host memory."""
    rows, _ = hec_bytes(cfg, meta, s)
    capacity = hec_capacity_bytes(cfg, meta, s)
    if budget is None or budget >= feature_bytes + capacity:
        return rows
    return int(min(rows, max(0, budget - min(budget, feature_bytes))))


def minibatch_terms(cfg, meta, s: dict, est: MemoryEstimate) -> None:
    """The minibatch engine's terms (``hec``, ``activations``, ``eval``) for partition shapes ``s``."""
    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    mb = cfg.minibatch
    if mb.halo == "hec":
        est.terms["hec"] = int(sum(hec_bytes(cfg, meta, s)))
        est.shrink["hec"] = "minibatch.cache_lines (HEC lines per layer)"
    # a step's live set, the tensors minibatch_device_activations counts (on the CPU the
    # engine's device is host memory), on the expected frontiers of uniform draws (an upper bound)
    est.terms["activations"] = minibatch_device_activations(cfg, meta, s)
    est.shrink["activations"] = "minibatch.batch_size or minibatch.fanouts"
    store_terms(cfg, meta, s, est)
    if mb.eval == "full":
        est.terms["eval"] = minibatch_eval_bytes(cfg, s, widths)
        est.shrink["eval"] = "minibatch.eval_rows / minibatch.eval_halo_rounds (or minibatch.eval = 'sampled')"
    else:
        est.terms["eval"] = minibatch_sampled_eval_bytes(cfg, meta, s)
        est.shrink["eval"] = "minibatch.eval_batch_size or minibatch.fanouts (or minibatch.eval = 'full')"
    # the sampled frontiers, the optimizer step's temporaries and evaluation do not overlap
    model_terms(cfg, meta, est)
    _keep_largest(est, ("activations", "eval", "optimizer_step"))


def minibatch_eval_bytes(cfg, s: dict, widths: list, row_bytes: int | None = None, device: bool = False) -> int:
    """Bytes the layer-wise full inference of the minibatch engine's evaluation holds at its
    largest layer (engine/inference.py): a round of halo rows (the rounds as
    :func:`~hpcgnn.engine.inference.auto_rounds` makes them from this rank's halo, or
    ``minibatch.eval_halo_rounds``; in host memory the rows sent and received, on the ``device``
    the received rows only: the host data plane selects and sends from a host copy), one
    destination chunk's temporaries (``row_bytes`` per destination row, default ``6 x`` the
    widest layer's floats; the automatic chunk stays within ``DEFAULT_CHUNK_BYTES``), the edge
    groups and remap, and the layer's input, projected rows, accumulator and output over the
    solid rows (GAT: its input materialised over the halo)."""
    from hpcgnn.engine.inference import DEFAULT_CHUNK_BYTES

    ns, nh, ne = s["num_solid"], s["num_halo"], s["num_edges"]
    nl, wmax, mb = ns + nh, max(widths), cfg.minibatch
    if row_bytes is None:
        row_bytes = 6 * wmax * F32
    chunk = min(DEFAULT_CHUNK_BYTES if mb.eval_rows == 0 else mb.eval_rows * row_bytes, ns * row_bytes)
    rounds = mb.eval_halo_rounds or max(1, -(-nh * wmax * F32 // DEFAULT_CHUNK_BYTES))
    rnd = -(-nh // max(rounds, 1)) * wmax * F32 * (1 if device else 2)
    ev = rnd + chunk + ne * 2 + nl * I64
    if cfg.model.arch == "gat":          # GAT materialises the layer input over the halo
        ev += 3 * ns * wmax * F32 + nl * wmax * F32 * 2
    else:                                # input, projected rows, accumulator, output
        ev += ns * F32 * _widest_inference_layer(widths)
    return int(ev)


def inference_chunk_row_bytes(cfg, widths: list, avg_degree: float) -> int:
    """Bytes of temporaries per destination row of an inference chunk at the most expensive
    layer, :func:`hpcgnn.engine.inference.layer_row_bytes` of the layers of widths ``widths``
    (``model.arch`` / ``model.heads`` of ``cfg``; a hidden GAT layer's width is its heads'
    outputs), what :func:`~hpcgnn.engine.inference.chunk_row_bytes` gives the built model."""
    from hpcgnn.engine.inference import layer_row_bytes

    gat, heads, last = cfg.model.arch == "gat", int(cfg.model.heads), len(widths) - 2
    return max([1] + [layer_row_bytes(gat, int(widths[l]), int(widths[l + 1]) // (heads if gat and l < last else 1),
                                      heads, avg_degree) for l in range(len(widths) - 1)])


def inference_device_csr_bytes(num_solid: int, num_edges: int) -> int:
    """Bytes layer-wise inference (engine/inference.py) copies to a GPU besides what the host
    ``eval`` term counts: the partition's CSR (indptr and int64 indices) and the solid rows'
    degree and inverse degree (float32)."""
    return int((num_solid + 1 + num_edges) * I64 + 2 * num_solid * F32)


def _widest_inference_layer(widths: list) -> int:
    """Floats per solid row of the layer-wise inference's widest SAGE/GCN layer
    (:func:`_inference_row_widths` of each layer of ``widths``)."""
    return max(_inference_row_widths(widths[l], widths[l + 1]) for l in range(len(widths) - 1))


def _inference_row_widths(w_in: int, w_out: int) -> int:
    """Floats per solid row that one SAGE/GCN layer of the layer-wise inference holds
    (engine/inference.py): its input; projecting first (``w_out < w_in``), the projected rows
    and their accumulator, which becomes the output; else the accumulator at ``w_in`` and the
    output, which is the accumulator when the widths agree."""
    if w_out < w_in:
        return w_in + 2 * w_out
    return 2 * w_in + (w_out if w_out != w_in else 0)


def store_terms(cfg, meta, s: dict, est: MemoryEstimate) -> None:
    """The minibatch store's host-memory term ``store`` (docs/store.md): on the CPU a tiered
    store's device tier is a separate host buffer (its budget, at most the features, plus a row
    table of int64 per solid row); host-only and device-only stores use the partition's array
    in place, and on a GPU the device tier is not host memory."""
    from hpcgnn.store.budget import resolve_budget

    ns = s["num_solid"]
    feature_bytes = ns * meta.num_features * F32
    dev = "cuda" if cfg.train.device == "cuda" else "cpu"
    budget = resolve_budget(cfg.store.device_memory, feature_bytes, dev)
    if dev == "cuda" or budget is None or budget == 0 or budget >= feature_bytes:
        return
    est.terms["store"] = int(budget + ns * I64)
    est.shrink["store"] = "store.device_memory (the device tier; on the CPU a host buffer)"


def offload_recomputes(cfg) -> bool:
    """Whether the offloaded engine recomputes its layers in backward (``fullgraph.recompute =
    "recompute"``, or GAT, whose edge softmax is not cacheable: engine/offload.resolve_modes)
    instead of caching their aggregates in host memory."""
    return cfg.fullgraph.recompute == "recompute" or cfg.model.arch == "gat"


@dataclass(frozen=True)
class OffloadUnitRows:
    """Rows of the offloaded engine's transfer plan that size its device batch (one layer pass,
    :func:`hpcgnn.engine.chunk_schedule.build_transfer_plan`): ``capacity`` the device row
    buffer (the largest unit's distinct sources, ``TransferPlan.capacity``); ``first`` the rows
    of the first unit, which a forward pass loads before anything computes, ``first_halo`` the
    halo rows among them (layer 0 gathers those apart from the store's); ``enter`` the most rows
    a later unit loads in forward (those the unit before it did not hold, requested while that
    one computes); ``last`` / ``last_halo`` / ``leave`` the same for a recomputing backward,
    which runs the units in reverse (the last unit's rows; the most rows another unit loads:
    those the unit after it does not hold); ``chunk`` the most sources of one chunk (the rows
    it gathers from the buffer)."""

    capacity: int
    first: int
    first_halo: int
    enter: int
    last: int
    last_halo: int
    leave: int
    chunk: int


def offload_expected_rows(cfg, nl: int, nh: int, ne: int) -> OffloadUnitRows:
    """:class:`OffloadUnitRows` of the uniform model: a chunk's ``ne / chunks`` edges draw their
    sources uniformly from the ``nl`` local rows, ``nh`` of them halo rows (a chunk of
    destinations reaches most of the partition's rows when the graph has no locality; validated
    by `make bench-plan`, docs/plan.md); a unit is ``batch_chunks`` chunks (one without
    ``fullgraph.dedup``) and loads its whole source set (consecutive units share nothing)."""
    fg = cfg.fullgraph
    k = max(int(fg.chunks), 1)
    if k == 1:
        return OffloadUnitRows(nl, nl, nh, 0, nl, nh, 0, nl)
    per_unit = min(int(fg.batch_chunks), k) if fg.dedup else 1
    unit = int(min(nl, expected_distinct(nl, ne * per_unit / k)))
    halo = int(unit * nh / max(nl, 1))
    chunk = int(min(nl, expected_distinct(nl, ne / k)))
    return OffloadUnitRows(unit, unit, halo, unit, unit, halo, unit, chunk)


def offload_phase_bytes(cfg, meta, s: dict, rows: OffloadUnitRows | None = None) -> tuple[list[int], list[int]]:
    """``(forward, backward)``: bytes on the compute device of one unit of chunks of each
    layer's forward and backward pass (offloaded full graph, engine/offload.py over
    engine/chunk_stream.py: a row buffer of a unit's sources, the chunks of the unit one at a
    time), with ``rows`` (:class:`OffloadUnitRows`; the uniform model's,
    :func:`offload_expected_rows`, when None), ``w`` / ``wo`` the layer's input / output width and
    a chunk's destinations ``dst`` = solid rows / chunks:

    * forward: the row buffer beside the larger of the first unit's rows as they arrive (first
      x w; layer 0 also their halo rows, gathered apart) and a chunk's compute: the next unit's
      rows, requested while it computes, and the chunk's gathered sources ((enter + chunk) x w),
      the destinations' temporaries (``SAVED_PER_LAYER`` x dst at the wider width); GAT also the
      chunk's projection and its product with the attention vectors (2 x chunk x the projection's
      width: heads x classes in the last layer) and per-edge logits and attention (3 x edges x
      heads), GCN its scaled or projected sources (chunk x the wider width);
    * backward, cached aggregates (SAGE, GCN): the gradient buffer and the aggregation's adjoint
      over the chunk's sources ((capacity + chunk) x w, not in layer 0, whose input needs no
      gradient) and the destinations' temporaries;
    * backward, recomputed (GAT; SAGE and GCN with ``fullgraph.recompute = "recompute"``): the
      reloaded row buffer and, after layer 0, the gradient buffer (capacity x w each), beside
      the larger of the last unit's rows as they arrive (last x w; layer 0 also their halo
      rows) and a chunk's compute: the next unit's rows, the gathered sources and, after layer
      0, their gradient ((leave + chunk [+ chunk]) x w), GAT's recomputed projection, its
      product with the attention vectors and their gradient (3 x chunk x the projection's
      width) and the per-edge terms twice, GCN's projected sources and their gradient (2 x
      chunk x the narrower width), the destinations' temporaries; the cached backward of a GCN
      layer after layer 0 also a chunk's scaled sources.

    The rows are :func:`offload_sampled_rows`' (the engine's plan) in the pre-run device check.
    Each pass was traced on the CPU with :class:`hpcgnn.bench.alloc_trace.AllocationTracker`
    around the engine's layer passes, counting what would be device memory on a GPU (docs/plan.md:
    products-like 0.25, 2 ranks, SAGE, GCN, GAT 2 x 32, 100-64-47, 16 chunks, one and four a
    batch, caching and recomputing): the largest pass reads 1.00-1.11x of the traced one, GAT
    1.19-1.21x."""
    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    fg = cfg.fullgraph
    k = max(fg.chunks, 1)
    r = rows if rows is not None else offload_expected_rows(cfg, nl, nh, ne)
    dst, edges = ns / k, ne / k
    gat, recompute = cfg.model.arch == "gat", offload_recomputes(cfg)
    heads = int(cfg.model.heads) if gat else 0
    fwd, bwd = [], []
    edge = 3 * edges * heads
    gcn = cfg.model.arch == "gcn"
    for l in range(layers):
        w, wo = widths[l], widths[l + 1]
        temps = SAVED_PER_LAYER * dst * max(w, wo)
        # a chunk's source-side tensors besides its gathered rows: GAT's projection, GCN's
        # scaled (or projected) sources; backward also their gradients
        pw = wo * heads if gat and l == layers - 1 else wo    # GAT's last layer: heads x classes
        # (GAT: the projection and the logits' product with the attention vectors)
        proj = 2 * r.chunk * pw if gat else (r.chunk * max(w, wo) if gcn else 0)
        # the first unit's rows arrive before anything computes (layer 0: the store's rows and,
        # apart, the halo rows); later units' rows arrive while a chunk computes
        first = r.first + (r.first_halo if l == 0 else 0)
        fwd.append(r.capacity * w + max(first * w, (r.enter + r.chunk) * w + temps + proj + (edge if gat else 0)))
        if recompute:
            # the input's gradient: a gradient buffer, and the chunk's; the last unit's rows
            # arrive before anything computes, others while a chunk computes
            gbuf = r.capacity * w if l > 0 else 0
            grads = r.chunk * w if l > 0 else 0
            extra = 3 * r.chunk * pw if gat else (2 * r.chunk * min(w, wo) if gcn else 0)
            last = r.last + (r.last_halo if l == 0 else 0)
            bwd.append(r.capacity * w + gbuf + max(last * w, (r.leave + r.chunk) * w + grads + extra + temps
                                                   + 2 * edge))
        else:
            extra = r.chunk * max(w, wo) if gcn else 0
            bwd.append(((r.capacity + r.chunk) * w + extra if l > 0 else 0) + temps)
    return [int(b * F32) for b in fwd], [int(b * F32) for b in bwd]


def offload_batch_bytes(cfg, meta, s: dict, rows: OffloadUnitRows | None = None) -> int:
    """Bytes of one unit of chunks on the compute device (offloaded full graph): the largest
    pass of :func:`offload_phase_bytes`."""
    fwd, bwd = offload_phase_bytes(cfg, meta, s, rows)
    return max(fwd + bwd)


def offload_sampled_rows(cfg, meta, part_id: int) -> OffloadUnitRows:
    """:class:`OffloadUnitRows` of the engine's transfer plan for rank ``part_id``'s partition
    (offloaded full graph), counted on the partition: the engine's chunks
    (:func:`hpcgnn.engine.chunk_schedule.chunk_bounds`, edge-balanced destination ranges),
    grouped as the engine groups them (one chunk a unit without ``fullgraph.dedup``; else
    ``fullgraph.batch_chunks`` chunks a batch in the schedule
    :func:`~hpcgnn.engine.chunk_schedule.choose_schedule` picks), a unit's rows its destinations
    and the distinct sources of their edges. Reads the partition's ``indptr`` and one chunk's
    ``indices`` at a time with a mark per vertex of the graph, keeping the sources of the
    current and the previous unit; in the ``cost`` order, which may group and order chunks
    otherwise than the natural order, it keeps every chunk's source list (int64, the chunks'
    sources summed) and builds the engine's schedule from them, as the engine does at its start
    (products-like 1.0, 16 chunks: 2.6-2.9 s and about 500 MiB per rank, freed before the engine)."""
    from hpcgnn.engine.chunk_schedule import Chunk, choose_schedule, chunk_bounds, natural_schedule
    from hpcgnn.partition.store import open_partition_file

    fg = cfg.fullgraph
    first_id = int(meta.part_offsets[part_id])
    with open_partition_file(meta.path, part_id, meta) as f:
        indptr = _checked_indptr(f, meta, part_id)
        bounds = chunk_bounds(indptr, max(int(fg.chunks), 1))
        n = bounds.shape[0] - 1
        step = max(1, min(int(fg.batch_chunks), n)) if fg.dedup else 1
        mark = np.zeros(int(meta.num_nodes), dtype=bool)          # a unit's rows
        chunk_mark = np.zeros(int(meta.num_nodes), dtype=bool)    # a chunk's

        def chunk_sources(c: int) -> np.ndarray:
            """Chunk ``c``'s destinations and its edges' sources (global IDs, sorted)."""
            b, e = int(bounds[c]), int(bounds[c + 1])
            edges = _checked_indices(np.asarray(f["indices"][int(indptr[b]):int(indptr[e])], dtype=np.int64),
                                     meta, part_id)
            chunk_mark[edges] = True
            chunk_mark[first_id + b:first_id + e] = True
            src = np.flatnonzero(chunk_mark)
            chunk_mark[src] = False
            return src

        if fg.order == "natural" or n <= 1:
            groups, sources = natural_schedule(n, step).batches, chunk_sources
        else:                          # the engine's choice between the natural and greedy orders
            chunks = [Chunk(c, int(bounds[c]), int(bounds[c + 1]), chunk_sources(c), np.zeros(1, np.int64),
                            np.zeros(0, np.int64)) for c in range(n)]
            schedule, _ = choose_schedule(chunks, step, fg.order, int(meta.num_nodes),
                                          int(meta.num_features) * F32)
            groups, sources = schedule.batches, (lambda c: chunks[c].src)
        capacity = first = first_halo = enter = leave = widest = 0
        halo_of = lambda rows: int(rows.shape[0]) - int(np.count_nonzero(  # noqa: E731
            (rows >= first_id) & (rows < first_id + ns)))
        prev = np.zeros(0, dtype=np.int64)
        ns = int(meta.part_offsets[part_id + 1]) - first_id
        for u, g in enumerate(groups):
            for c in g:
                src = sources(c)
                widest = max(widest, int(src.shape[0]))
                mark[src] = True
            cur = np.flatnonzero(mark)
            mark[cur] = False
            # rows shared with the previous unit stay in their slots (with dedup)
            shared = 0
            if fg.dedup:
                mark[prev] = True
                shared = int(np.count_nonzero(mark[cur]))
                mark[prev] = False
            capacity = max(capacity, int(cur.shape[0]))
            if u == 0:
                first, first_halo = int(cur.shape[0]), halo_of(cur)
            else:
                enter = max(enter, int(cur.shape[0]) - shared)
                leave = max(leave, int(prev.shape[0]) - shared)
            prev = cur
    return OffloadUnitRows(capacity, first, first_halo, enter, int(prev.shape[0]), halo_of(prev), leave, widest)


def offload_host_gradient_bytes(cfg, meta, s: dict) -> list[int]:
    """Bytes of host gradients live in each layer's backward (offloaded full graph): the
    gradient of the layer's output rows (the logits' for the last layer, else the next layer's
    input gradient over every local row, whose solid rows it passes on) and, except in layer 0,
    the gradient of its input over every local row (engine/offload._backward_layer)."""
    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    return [int(((ns if l == layers - 1 else nl) * widths[l + 1] + (nl * widths[l] if l > 0 else 0)) * F32)
            for l in range(layers)]


def fullgraph_terms(cfg, meta, s: dict, est: MemoryEstimate) -> None:
    """The full-graph engine's terms (``activations``; offloaded also ``chunks``; the model's
    ``model_state`` and ``optimizer_step``, added: ``activations`` holds layer data resident
    for the whole run)."""
    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    fg = cfg.fullgraph
    x0 = nl * widths[0] * F32
    # SAGE keeps its aggregate and the fused ReLU + dropout output per layer, with two
    # gradients in flight; GCN/GAT also the scaled or projected source rows and the linear
    # output (bench-plan, docs/plan.md: SAGE 3 x 256 in memory was +35 % with six)
    saved = 4 if cfg.model.arch == "sage" else SAVED_PER_LAYER
    per_layer = [nl * widths[l] * F32 + saved * ns * max(widths[l], widths[l + 1]) * F32
                 for l in range(layers)]
    if fg.offload:
        # host-resident for the run (engine/offload.py): layer 0's input (x0: the store's
        # solid rows and the halo rows), every hidden layer's input over solid + halo rows,
        # the logits of the solid rows and, caching, the solid rows' aggregates; then the
        # larger of a forward pass's batch of chunks and a backward pass's host gradients
        # beside its batch (on a GPU the batches are device memory, here host memory)
        hidden = sum(nl * widths[l] * F32 for l in range(1, layers)) + ns * widths[layers] * F32
        agg = 0 if offload_recomputes(cfg) else sum(ns * widths[l] * F32 for l in range(layers))
        fwd, bwd = offload_phase_bytes(cfg, meta, s)
        step = max(fwd + [g + b for g, b in zip(offload_host_gradient_bytes(cfg, meta, s), bwd)])
        est.terms["activations"] = int(x0 + hidden + agg + step)
        est.shrink["activations"] = ("more ranks (hpcgnn partition --parts): the host-resident rows "
                                     "are the partition's, chunks do not shrink them")
        # the chunks' own topology: their CSRs (local IDs), source lists, transposes (indices;
        # edge IDs for GAT only, Block.drop_edge_ids) and transfer-plan slots, about four int64
        # per edge, five with GAT
        est.terms["chunks"] = int((5 if cfg.model.arch == "gat" else 4) * ne * I64)
        est.shrink["chunks"] = "more ranks (hpcgnn partition --parts)"
    else:
        sage = cfg.model.arch == "sage" and layers >= 2
        bf16 = cfg.train.precision == "bf16"
        if sage:
            act = sage_in_memory_bytes(ns, nl, ne, widths, layers, bf16, cached=fg.halo == "cached")
        elif cfg.model.arch == "gcn" and layers >= 2:
            act = gcn_in_memory_bytes(ns, nl, ne, widths, layers, bf16, cached=fg.halo == "cached")
        else:
            act = int(x0 + sum(per_layer))
        est.terms["activations"] = act
        est.shrink["activations"] = ("more ranks (hpcgnn partition --parts); on a GPU also "
                                     "fullgraph.offload = true with fullgraph.chunks (host memory "
                                     "holds the rows then)") if cfg.train.device != "cuda" else \
            "fullgraph.offload = true with fullgraph.chunks"
    if fg.halo == "cached" or fg.pipeline:
        # halo cache (cache/halo.py): both tiers hold at most every halo row of every layer,
        # in the width the exchange sends (fullgraph_halo_width: the input or the projection),
        # within fullgraph.cache_memory; a pipelined layer l >= 1 keeps one message in flight:
        # receive buffers of all its halo rows and the rows being sent (rows alone on the wire)
        from hpcgnn.run.engines.fullgraph import cache_bytes

        hw = [fullgraph_halo_width(cfg, widths, l)[1] for l in range(layers)]
        if fg.halo == "cached":
            full = nh * sum(hw) * F32
            budget = cache_bytes(fg.cache_memory, "fullgraph.cache_memory")
            est.terms["halo_cache"] = int(full if budget is None else min(full, budget))
            est.shrink["halo_cache"] = "fullgraph.cache_memory"
        if fg.pipeline:
            wire = 2 if fg.halo_precision == "bf16" else F32     # bytes a value on the wire
            est.terms["halo_pipeline"] = int(sum(2 * nh * hw[l] * wire for l in range(1, layers)))
            est.shrink["halo_pipeline"] = "fullgraph.pipeline = false"
    model_terms(cfg, meta, est)


def sage_in_memory_bytes(ns: int, nl: int, ne: int, widths: list[int], layers: int, bf16: bool = False,
                         cached: bool = False) -> int:
    """SAGE on the in-memory full-graph engine (engine/fullgraph.py ``InMemoryFullGraph``).

    Layer 0's aggregate is computed once at start-up, after which the feature rows of the halo
    are released: ``ns x w0`` twice (own rows, aggregate), after a start-up transient of all
    ``nl`` feature rows beside the feature store's ``ns`` and the aggregate. With a halo cache
    (``cached``; its tiers and messages are terms of their own) layer 0 runs every pass on its
    fetched halo rows instead: it keeps its own rows and, projecting first, a copy of the ``nh x
    w0`` halo rows (else its ``ns x w0`` neighbour mean), and its forward holds the exchanged
    ``nl x w0`` input and its ``nl x w1`` projection at once. Each later layer keeps ``ns x (w_l
    + w_l+1)`` for backward (the neighbour mean and the ReLU+dropout output; its own rows are
    the previous layer's output, given apart from the exchanged input,
    :meth:`hpcgnn.nn.conv.SAGEConv.forward`), or, when it projects first
    (``SAGEConv.projects_first``: few halo rows), ``ns x 2 w_l+1`` and a copy of the ``nh x
    w_l`` halo rows (in bfloat16 its rounded copy of the input instead, the transient below);
    a layer with ``w_l+1 < w_l`` exchanges its projection (exact or cached alike) and keeps only
    ``ns x 2 w_l+1``
    (:func:`sage_kept_input`). One layer at a
    time also holds its exchanged input (the received ``nh x w_l`` halo rows and the ``nl x
    w_l`` tensor they join) or in backward its gradient and the ``ns x w_l`` part of it that
    goes to the solid rows (``2 nl x w_l+1`` for an exchanged projection); in bfloat16 (``bf16``:
    ``train.precision = "bf16"``) also that input rounded to bfloat16, which the layer's gather
    and product read (2 bytes a value; at products-like 1.0 on 4 ranks, 0.28 GiB per rank,
    which covers the measured bf16 peaks, 0.14-0.16 GiB above float32's, docs/benchmarks.md).
    Plus the transpose of the local graph that backward's aggregation reads (one int64 per edge:
    its edge ids are dropped, :meth:`hpcgnn.sampling.block.Block.drop_edge_ids`).
    """
    from hpcgnn.nn.conv import exchanges_projection, sage_projects_first

    nh = nl - ns
    kept = (2 * widths[0] + widths[1]) * ns * F32
    transient = 0
    start = (nl + 2 * ns) * widths[0] * F32
    if cached:
        rest = nh if sage_projects_first(widths[0], widths[1], nl, ns, ne) else ns
        kept = ((ns + rest) * widths[0] + ns * widths[1]) * F32
        transient, start = nl * (widths[0] + widths[1]) * F32, 0
    for l in range(1, layers):
        wi, wo = widths[l], widths[l + 1]
        projection = exchanges_projection(wi, wo)     # exchanged instead of the input
        kept += (sage_kept_input(ns, nh, ne, wi, wo) +
                 (2 if projection or sage_projects_first(wi, wo, nl, ns, ne) else 1) * ns * wo) * F32
        if projection:              # nl x wo, and its gradient
            transient = max(transient, 2 * nl * wo * F32)
        else:
            # forward: the received halo rows and the joined nl x w_l input; backward: the
            # input's gradient and the exchange's solid-row part of it
            transient = max(transient, (nl + max(ns, nh)) * wi * F32 + (nl * wi * BF16 if bf16 else 0))
    return int(max(start, kept + transient) + ne * I64)


def gcn_in_memory_bytes(ns: int, nl: int, ne: int, widths: list[int], layers: int, bf16: bool = False,
                        cached: bool = False) -> int:
    """GCN on the in-memory full-graph engine, any halo mode.

    Layer 0's aggregate is computed once at start-up from every local feature row: beside the
    ``nl x w0`` rows and the feature store's ``ns x w0``, their scaled ``nl x w0`` copy and the
    ``ns x w0`` aggregate (the self loop goes into it in place,
    :meth:`hpcgnn.nn.conv.GCNConv.aggregate`), after which the halo's feature rows are
    released. With a halo cache (``cached``; its tiers and messages are terms of their own)
    layer 0 runs every pass on its fetched halo rows instead, its forward holding the joined
    ``nl x w0`` input and its scaled copy at once. Kept for backward: layer 0's aggregate (its product's input) and ReLU+dropout
    output, ``ns x (w0 + w1)``; each later layer its aggregate (the product's input, the self
    loop added in place) and output, ``ns x (w_l + w_l+1)``, or ``2 ns x w_l+1`` when it
    projects first. Every layer ``l >= 1`` exchanges its source rows, ``wp = min(w_l, w_l+1)``
    wide (:func:`hpcgnn.nn.conv.exchanged_width`: each rank scales, or projects and scales, its
    own rows), so one layer at a time also holds, forward, the exchanged ``nl x wp`` rows and
    the destinations' own ``ns x wp`` (the self loop), or backward the ``nl x wp`` gradient and
    two ``ns x wp`` (the exchange's solid rows, the scale's). In bfloat16 each product also
    keeps its input rounded (``ns x w_l``, 2 bytes a value). Plus the transpose of the local
    graph that backward's aggregation reads (one int64 per edge) and the two degree scales.
    Against every torch allocation of a native-kernel epoch (``python -m
    hpcgnn.bench.alloc_trace``) and the peak RSS: docs/plan.md (products-like 0.25 1.17x of the
    peak RSS, 1.0 1.22x, a 60k-vertex SBM 0.97-0.99x)."""
    start = 2 * (nl + ns) * widths[0] * F32
    kept = ns * (widths[0] + widths[1]) * (F32 + (BF16 if bf16 else 0))
    transient = 0
    if cached:
        start, transient = 0, 2 * nl * widths[0] * F32
    for l in range(1, layers):
        wi, wo = widths[l], widths[l + 1]
        wp = min(wi, wo)
        kept += (2 * ns * wo if wo < wi else ns * (wi + wo)) * F32 + (ns * wi * BF16 if bf16 else 0)
        transient = max(transient, (nl + 2 * ns) * wp * F32)
    return int(max(start, kept + transient) + ne * I64 + 2 * nl * F32)


def model_host_bytes(est: MemoryEstimate, ranks: int) -> int:
    """The model's bytes that stay in host memory when it trains on a GPU: the gradient
    allreduce's flat float32 buffer and, on more than one rank, its transient host copy
    (:func:`allreduce_step_bytes`)."""
    return int(est.params * F32 * (2 if ranks > 1 else 1))


def device_split(cfg, meta, s: dict, est: MemoryEstimate, ranks: int | None = None) -> int:
    """Bytes of ``est`` on the GPU when ``train.device`` is CUDA, without the CUDA context: the
    minibatch engine keeps its partition's features, HECs, activations and the model
    (parameters, gradients, Adam's moments and step) there; full graph in memory the partition,
    its activations and the model; offloaded only one batch of chunks
    (:func:`offload_batch_bytes`), the chunks' topology and the model. Host memory keeps the
    rest, the partition as loaded and :func:`model_host_bytes` (``ranks``: the job's, default
    the store's). The tensor engine's terms are host memory on a GPU too (the replicated
    topology, the feature-layout slices): its device part is what :func:`tensor_terms` recorded
    in ``est.device`` (the NN layers and one chunk)."""
    t = est.terms
    if cfg.train.engine == "tensor":
        return int(est.device.get("nn", 0) + est.device.get("chunk", 0))
    host_model = model_host_bytes(est, meta.num_parts if ranks is None else ranks)
    if cfg.train.engine == "fullgraph" and cfg.fullgraph.offload:
        model = t.get("model_state", 0) + t.get("optimizer_step", 0) - host_model
        return int(t.get("chunks", 0) + offload_batch_bytes(cfg, meta, s) + max(model, 0))
    return int(max(sum(v for k, v in t.items() if k != "baseline") - host_model, 0))


def host_device_peak(cfg, meta, s: dict, est: MemoryEstimate, ranks: int, device: str) -> tuple[int, int]:
    """``(host, device)`` peak bytes of the rank ``est`` estimates (partition shapes ``s``, a job
    of ``ranks`` ranks on ``device``): on the CPU ``(est.total, 0)``; on CUDA the device holds
    :func:`device_split` plus :data:`CUDA_CONTEXT`, the host the baseline, the partition as
    loaded and :func:`model_host_bytes` (offloaded full graph and the tensor engine: all of
    ``est``, their layer data and topology are host-resident)."""
    if device != "cuda":
        return est.total, 0
    on_dev = device_split(cfg, meta, s, est, ranks)
    on_host = cfg.train.engine == "tensor" or (cfg.train.engine == "fullgraph" and cfg.fullgraph.offload)
    host = est.total if on_host else \
        est.terms["baseline"] + est.terms.get("partition", 0) + model_host_bytes(est, ranks)
    return host, on_dev + CUDA_CONTEXT


def describe(est: MemoryEstimate) -> str:
    """One line: total and terms (GiB)."""
    terms = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in est.terms.items() if v)
    return f"rank {est.part_id}: {est.total / 2**30:.2f} GiB ({terms})"


def check_memory(cfg, meta, rt) -> MemoryEstimate:
    """Collective: refuse (InputError on every rank) when the ranks of a node are estimated to
    need more host memory than the node offers them (on a GPU the host part of the estimate,
    :func:`host_device_peak`; the device's is :func:`check_device_memory`) (``runtime.memory_limit``, else what
    :func:`hpcgnn.run.memory.node_available_bytes` finds); ``runtime.memory_check = false``
    skips the refusal. Returns this rank's estimate."""
    import socket

    from hpcgnn.run.memory import node_available_bytes, rss_bytes
    from hpcgnn.units import fmt_bytes, parse_size

    error, est, need_host = None, None, 0
    try:
        est = estimate_rank_memory(cfg, meta, rt.rank, rss_bytes())
        # on a GPU only the host part counts here (the device's is check_device_memory's)
        need_host = est.total if _device_type(cfg) != "cuda" else \
            host_device_peak(cfg, meta, part_shapes(meta.path, rt.rank), est, rt.size, "cuda")[0]
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    host = socket.gethostname()
    rows = rt.comm.allgather((host, rt.rank, need_host, rss_bytes(), est.largest(),
                              est.shrink.get(est.largest()[0], "")))
    mine = [r for r in rows if r[0] == host]
    need = sum(r[2] for r in mine)
    held = sum(r[3] for r in mine)
    if cfg.runtime.memory_limit:
        avail, source = parse_size(cfg.runtime.memory_limit, "runtime.memory_limit"), "runtime.memory_limit"
    else:
        avail, source = node_available_bytes(held)
    error = None
    if cfg.runtime.memory_check and need > avail:
        worst = max(mine, key=lambda r: r[4][1])
        name, size = worst[4]
        error = (f"estimated peak memory of the {len(mine)} ranks on {host} is {fmt_bytes(need)}, "
                 f"more than the {fmt_bytes(avail)} available ({source}); largest term: {name} "
                 f"{fmt_bytes(size)} on rank {worst[1]}, shrink it with {worst[5] or 'more nodes'} "
                 "(`hpcgnn inspect STORE --config FILE` shows the estimate; "
                 "runtime.memory_check = false skips this check)")
    rt.agree(error)
    return est


def tensor_terms(cfg, meta, s: dict, est: MemoryEstimate) -> None:
    """The tensor-parallel engine's terms (:mod:`hpcgnn.engine.tensor`), attributed from peak RSS
    traces (products-like 0.04 and 0.25 on 2 ranks; GCN, SAGE, GAT decoupled, GCN and SAGE
    coupled; 1 and 16 chunks, staged or not: the total is 1.07-1.23x the measured epoch peak):

    * ``partition``: the rank's own ~V/P vertex rows (features, labels, masks);
    * ``topology``, held from set-up to the end: the propagation CSR with self loops (int64) and
      its float32 weights (not GAT's: its weights are made per epoch), the layout (~6 V int64)
      and what the first backward builds and keeps: unstaged with one chunk the matrix's
      transpose; unstaged chunks, each chunk's sources, transposed CSR and edge ids
      (:meth:`~hpcgnn.nn.decoupled.Propagation.chunk_transpose`); staged, each chunk's CSR with
      local sources, the transfer plan's slots and rows (built in set-up) and each chunk block's
      transpose; GAT also the matrix's transpose (its score gradients). Chunk sources:
      :func:`_tensor_chunk_sources` (uniform draws, an upper bound);
    * ``setup``: the construction's peak beyond ``partition`` and ``topology`` (0 when below):
      the store's CSR (read whole, freed before the first epoch) with either the layout's
      first-read pass (chunked only; bounded: 26 bytes per edge of one slice of
      :data:`~hpcgnn.comm.tensor_parallel.LAYOUT_SLICE` edges) or the propagation matrix being
      built (its CSR, the layout, four per-vertex temporaries, the self loops' edge mask, GCN's
      and SAGE's float32 weights with their float64 temporaries of one slice of rows,
      :data:`~hpcgnn.nn.decoupled.WEIGHT_SLICE` edges: two per edge for GCN, one for SAGE);
    * ``activations``, the epoch at backward's peak: on the rank's rows the MLP's saved tensors
      (the dropped-out input, two per hidden layer, the output) and three more of the widest
      aggregation (the output, its gradient, the gradient reaching the NN layers; coupled
      ``max(hidden, C)`` wide); the ``[V, C/P]`` feature-layout slices (four in backward: the
      output gradient, two round gradients and the adjoint's buffer; GAT also the k saved
      rounds) and GAT's four per-edge float32 tensors (logits, attention, their gradient, a
      chunk's edge products); staged on the CPU, one chunk's working set (its sources' buffer
      and, with more than one chunk, their gathered rows; three destination-row temporaries;
      GAT also the saved round's source rows and the chunk's edge products, 8 bytes per edge);
    * ``kernels``: torch's compute libraries, resident from the first operator on, after the
      baseline was measured (:data:`TORCH_KERNELS`);
    * ``heap``: the allocator's slack (:data:`HEAP_SLACK` of the counted graph and
      epoch bytes plus :data:`HEAP_FLOOR`).

    The MLP is replicated, not split: every rank holds all its parameters (``model_state``,
    ``optimizer_step``; on CUDA only the allreduce's host buffer and its copy, the rest is in
    ``est.device['nn']``). On CUDA every term here is host memory (:func:`host_device_peak`). Set-up and the epoch never overlap, and the epoch's tensors are freed
    before the optimizer step: the largest of ``setup``, ``activations`` and ``optimizer_step``
    counts."""
    v, e = int(meta.num_nodes), int(meta.num_edges)
    parts = max(int(meta.num_parts), 1)
    t = cfg.tensor
    m = cfg.model
    rows = -(-v // parts)
    est.terms["partition"] = int(rows * (meta.num_features * F32 + I64 + 3))
    est.shrink["partition"] = "more ranks"
    ev = e + v
    chunks = max(1, min(tensor_chunk_count(cfg, meta, parts), v))
    staged = t.staged or cfg.train.device == "cuda"
    srcs = _tensor_chunk_sources(v, e, chunks)     # sum over chunks of their source rows
    prop_csr = (v + 1 + ev) * I64                  # the propagation matrix with self loops
    topo = prop_csr + 6 * v * I64                  # + the layout: owner, positions, orders
    if m.arch != "gat":
        topo += ev * F32                           # its fixed weights
    if staged:                                     # chunk CSRs (local sources), sources, the plan's
        topo += (3 * ev + 6 * srcs + v + 2 * chunks) * I64   # slots and rows, the blocks' transposes
    elif chunks > 1:                               # the chunks' sources, transposes, edge ids
        topo += (2 * ev + 2 * srcs + chunks) * I64
    if (not staged and chunks == 1) or m.arch == "gat":   # the whole matrix's transpose: the
        topo += (v + 1 + 2 * ev) * I64             # unchunked backward's, GAT's score gradients'
    est.terms["topology"] = int(topo)
    est.shrink["topology"] = "nothing (replicated by design; a smaller graph or more memory per rank)"
    from hpcgnn.comm.tensor_parallel import LAYOUT_SLICE
    from hpcgnn.nn.decoupled import WEIGHT_SLICE

    store_csr = (v + 1 + e) * I64
    # the layout's first-read pass (chunked only): its mask and per slice of edges the masks,
    # fresh sources and their minimum
    layout_pass = (v + 26 * min(e, LAYOUT_SLICE)) if chunks > 1 else 0
    # the propagation matrix being built: per vertex its degrees, scales, row lengths and self
    # loops' positions; adding the self loops, a mask per edge; then GCN's and SAGE's weights
    # (float32) with, per slice of rows, their float64 temporaries (two per edge for GCN, one
    # for SAGE; a slice holds WEIGHT_SLICE edges plus its first row's: counted as twice that)
    tmp64 = {"gcn": 2, "sage": 1}.get(m.arch, 0)
    build_tmp = 4 * v * I64 + max(ev, (ev * F32 + tmp64 * min(ev, 2 * WEIGHT_SLICE) * F64) if tmp64 else 0)
    setup_peak = store_csr + max(layout_pass, est.terms["partition"] + prop_csr + 6 * v * I64 + build_tmp)
    est.terms["setup"] = int(max(setup_peak - est.terms["partition"] - topo, 0))
    est.shrink["setup"] = "more memory per rank (the store's CSR is read whole on every rank)"
    c = meta.num_classes
    hid = m.hidden
    cols = _tensor_cols(cfg, meta, parts)
    k = (t.k or m.layers) if t.mode == "decoupled" else 1
    slices = 4 + (k if m.arch == "gat" else 0)
    nn_bytes, chunk_bytes = tensor_device_bytes(cfg, meta, parts, chunks, cfg.train.device)
    act = slices * v * cols * F32
    if cfg.train.device != "cuda":
        # saved: the dropped-out input, two per hidden layer (decoupled: the linear's output and
        # the ReLU + dropout's; coupled: the aggregate plus bias and the ReLU + dropout's), the
        # output; then the output, its gradient and the gradient reaching the NN layers
        wide = c if t.mode == "decoupled" else max(hid, c)
        act += rows * (meta.num_features + 2 * (m.layers - 1) * hid + c + 3 * wide) * F32
        if staged:                                 # the CPU is the device: one chunk's working set
            src = min(v, -(-srcs // chunks))       # (its sources' buffer and, chunked, their
            gathered = 1 if chunks == 1 else 2     # gathered rows; three destination-row temporaries)
            act += cols * F32 * (gathered * src + 3 * -(-v // chunks))
            if m.arch == "gat":                    # backward's saved-round sources, the chunk's edge
                act += 2 * src * cols * F32 + -(-ev // chunks) * I64   # products
    else:
        est.device.update(nn=int(nn_bytes), chunk=int(chunk_bytes), chunks=int(chunks))
    if m.arch == "gat":
        act += 4 * ev * F32                        # at backward's peak: logits, attention, their
                                                   # gradient and a chunk's edge products
    est.terms["activations"] = int(act)
    est.shrink["activations"] = "more ranks (the feature-layout slices are V x C/P)"
    model_terms(cfg, meta, est, on_device=cfg.train.device == "cuda")
    _keep_largest(est, ("setup", "activations", "optimizer_step"))
    est.terms["kernels"] = TORCH_KERNELS
    est.shrink["kernels"] = "nothing (torch's own)"
    counted = sum(est.terms[name] for name in ("partition", "topology", "setup", "activations"))
    est.terms["heap"] = int(HEAP_SLACK * counted + HEAP_FLOOR)
    est.shrink["heap"] = "what shrinks the other terms (the allocator's share of them)"


def _tensor_chunk_sources(v: int, e: int, chunks: int) -> int:
    """Source rows summed over ``chunks`` destination chunks (``e`` edges without self loops):
    ``v`` for one chunk, else per chunk its ``v / chunks`` destinations plus the expected distinct
    vertices of ``e / chunks`` uniform draws (an upper bound: locality shrinks it; products-like
    measured 0.77-0.79 of it)."""
    if chunks <= 1:
        return int(v)
    per = min(v, -(-v // chunks) + expected_distinct(v, e / chunks))
    return int(math.ceil(per * chunks))


def _tensor_cols(cfg, meta, parts: int) -> int:
    """Columns of a rank's feature-layout slice (the widest aggregation)."""
    c, hid = meta.num_classes, cfg.model.hidden
    return -(-c // parts) if cfg.tensor.mode == "decoupled" else -(-max(hid, c) // parts)


# Bytes per edge that the torch aggregation path (hpcgnn.nn.aggregate, CUDA's) adds to a block's
# own CSR on the device: the edge-to-destination map (int64), the transpose's destinations and
# edge ids (2 x int64), the values of the forward and transposed sparse tensors (2 x float32) and,
# while the transpose is built (a stable sort), the sort's values and indices (2 x int64).
TORCH_CSR_EDGE_BYTES = 5 * 8 + 2 * 4


def tensor_device_bytes(cfg, meta, parts: int, chunks: int, device: str, resident: bool = False) -> tuple[int, int]:
    """``(nn, chunk)``: bytes on the compute device of the tensor engine's staged path
    (:class:`hpcgnn.engine.tensor.DeviceStage`) with ``chunks`` chunks on ``parts`` ranks.

    ``nn``: the NN layers on the rank's ~V/P rows (the ``activations`` rows term) or, after
    backward, Adam's temporaries (:func:`adam_step_bytes`), and the parameters of the model
    the engine builds (:func:`model_param_sizes`) with their gradients and Adam moments.
    ``chunk``: one chunk on the device: its sources (destinations plus the expected distinct
    in-neighbours of (E+V)/chunks edge draws, all V with one chunk) x C/P columns three times
    (row buffer, prefetched rows, gathered rows; backward: gradient buffer, A^T g, flushed
    rows; GAT twice more) and five destination-row temporaries; off the CPU also the chunk's
    CSR, weights and slots (copied to the device) and the torch backend's per-edge tensors
    (:data:`TORCH_CSR_EDGE_BYTES`: the edge-to-destination map, the transpose, the sparse
    tensors' values and the transient of the transpose's sort; CSR SpMM makes no
    ``[edges, C/P]`` message rows). ``resident``: the chunks' CSRs, slots and transposes are
    the resident term's (:func:`resident_device_bytes`), not the chunk's: only the sparse
    tensors' values, made per use, remain per edge."""
    m = cfg.model
    v, e = int(meta.num_nodes), int(meta.num_edges)
    f, c, hid = int(meta.num_features), int(meta.num_classes), int(m.hidden)
    rows = -(-v // max(parts, 1))
    sizes = model_param_sizes(cfg, f, c)
    step = adam_step_bytes(sizes, cfg.train.weight_decay, "cuda" if device == "cuda" else "cpu")
    nn_bytes = max(rows * (f + (2 * m.layers + 2) * hid + 2 * c) * F32, step) + \
        model_state_bytes(sizes, "fp32", MODEL_COPIES - 1)
    k = max(1, min(int(chunks), v))
    cols = _tensor_cols(cfg, meta, parts)
    dst = -(-v // k)
    edges = -(-(e + v) // k)
    src = v if k == 1 else min(v, dst + expected_distinct(v, e / k))
    per = cols * F32 * (3 * src + 5 * dst)
    if m.arch == "gat":
        per += 2 * src * cols * F32 + 2 * edges * F32
    if device != "cpu" and resident:    # the topology is the resident term's
        per += 2 * edges * F32
    elif device != "cpu":               # copied to the device (the CPU uses the host arrays)
        per += edges * (2 * I64 + F32) + (dst + 1) * I64 + src * I64
        per += edges * TORCH_CSR_EDGE_BYTES + (src + 1) * I64
    return int(nn_bytes), int(per)


def tensor_stage_rows(meta, chunks: int) -> dict:
    """The staged path's chunks as :class:`hpcgnn.engine.tensor.DeviceStage` cuts them from the
    store's topology (with self loops, :func:`~hpcgnn.engine.chunk_schedule.chunk_bounds` of
    ``chunks``, the de-duplicated natural transfer plan): ``capacity`` (rows of the device
    buffer), per chunk ``dst`` / ``src`` rows and ``identity`` (its sources are the buffer's
    prefix, no gathered copy), ``enter`` (most rows entering one unit), ``edges`` (per chunk,
    self loops included). Reads the whole topology (what the engine holds on every rank)."""
    from hpcgnn.engine.chunk_schedule import build_chunks, build_transfer_plan, chunk_bounds, natural_schedule
    from hpcgnn.nn.decoupled import with_self_loops
    from hpcgnn.partition.store import read_store_topology

    indptr, indices = read_store_topology(meta.path, meta)
    bounds = chunk_bounds(indptr, chunks)
    ip, ix = with_self_loops(indptr, indices)
    del indices
    cs = build_chunks(ip, ix, bounds)
    plan = build_transfer_plan(cs, natural_schedule(len(cs), 1), int(meta.num_nodes), dedup=True)
    ident = {}
    for u in plan.units:
        for c, sl in zip(u.chunks, u.chunk_slots):
            ident[c] = bool(np.array_equal(sl, np.arange(sl.shape[0])))
    return {"capacity": int(plan.capacity), "dst": [c.dst_end - c.dst_begin for c in cs],
            "src": [int(c.src.shape[0]) for c in cs], "identity": [ident[c.index] for c in cs],
            "edges": [int(c.num_edges) for c in cs],
            "enter": max((int(u.enter.shape[0]) for u in plan.units), default=0)}


def tensor_rank_cols(cfg, meta, parts: int, part_id: int) -> int:
    """Columns of rank ``part_id``'s feature-layout slice (:func:`_tensor_cols` is the widest)."""
    from hpcgnn.comm.tensor_parallel import column_bounds

    c, hid = int(meta.num_classes), int(cfg.model.hidden)
    width = c if cfg.tensor.mode == "decoupled" else max(hid, c)
    return int(np.diff(column_bounds(width, parts))[part_id])


def tensor_stage_bytes(cfg, meta, parts: int, part_id: int, rows: dict, resident: bool) -> int:
    """Peak bytes of one chunk's working set on the staged path, from the real chunks ``rows``
    (:func:`tensor_stage_rows`) at rank ``part_id``'s columns; what
    :class:`hpcgnn.run.memory.DeviceMemoryMeter` counts on the CPU, in row units of ``cols``
    float32: forward, the row buffer (``capacity``), the arriving rows, the chunk's output
    (``dst``) and its gathered sources (``src``, none when they are the buffer's prefix);
    backward, the gradient buffer, the destinations' gradient rows and their scaled copy
    (``c != 1``; resident: the whole [V] slice they are read from), ``A^T g`` (``src``) and for
    GAT the reloaded input rows (buffer and gathered sources)."""
    t = cfg.tensor
    cols = tensor_rank_cols(cfg, meta, parts, part_id)
    v = int(meta.num_nodes)
    cap = rows["capacity"]
    scaled = t.gamma * (1.0 - t.alpha) != 1.0
    gat = cfg.model.arch == "gat" and t.mode == "decoupled"
    peak = cap + rows["enter"]
    for dst, src, ident in zip(rows["dst"], rows["src"], rows["identity"]):
        fwd = cap + dst + (0 if ident else src)
        g = v if resident else dst
        bwd = cap + g + (dst if scaled else 0) + src
        if gat:
            bwd += cap + (cap if ident else src)
        peak = max(peak, fwd, bwd)
    return int(peak * cols * F32)


def resident_device_bytes(num_nodes: int, num_edges: int, chunks: int, cols: int, k: int, attention: bool) -> int:
    """Bytes the tensor engine's staged path keeps on the device when resident
    (:class:`hpcgnn.engine.tensor.DeviceStage` with ``resident``): the chunks' CSRs, slots and
    edge weights (``num_edges`` includes the self loops) with room for their transposes, and the
    ``[V, cols]`` float32 slices (Z_0 and two round buffers, or Z_0..Z_k for GAT's saved rounds;
    three gradient slices)."""
    v, ev = int(num_nodes), int(num_edges)
    topo = (2 * (v + int(chunks)) + 6 * ev) * I64 + ev * F32
    slices = (k + 1 if attention else 3) + 3
    return int(topo + slices * v * int(cols) * F32)


def tensor_resident_bytes(cfg, meta, parts: int, chunks: int, device: str, part_id: int | None = None) -> int:
    """Bytes the resident staged path keeps on the device (0 when it streams): the engine is
    resident when a device budget exists (``tensor.device_memory``) and the NN layers, one chunk
    (:func:`tensor_device_bytes`) and :func:`hpcgnn.engine.tensor.resident_device_bytes` fit it
    (``_fits_resident``). On CUDA all of :func:`resident_device_bytes`; on the CPU the ``[V, cols]``
    slices it holds (the topology stays in the host arrays)."""
    from hpcgnn.run.engines.tensor import device_budget

    t = cfg.tensor
    try:
        budget = device_budget(t.device_memory, device, None)
    except InputError:
        return 0
    if budget is None:
        return 0
    k = (t.k or cfg.model.layers) if t.mode == "decoupled" else 1
    att = cfg.model.arch == "gat" and t.mode == "decoupled"
    v, ev = int(meta.num_nodes), int(meta.num_edges) + int(meta.num_nodes)
    res = resident_device_bytes(v, ev, chunks, _tensor_cols(cfg, meta, parts), k, att)
    if sum(tensor_device_bytes(cfg, meta, parts, chunks, device)) + res > budget:
        return 0
    if device == "cuda":
        return int(res)
    cols = _tensor_cols(cfg, meta, parts) if part_id is None else tensor_rank_cols(cfg, meta, parts, part_id)
    return int(((k + 1 if att else 3) + 3) * v * cols * F32)


def auto_chunks(cfg, meta, parts: int, budget: int | None, device: str) -> tuple[int, int, int]:
    """``(chunks, nn_bytes, chunk_bytes)``: the smallest chunk count whose device working set
    (:func:`tensor_device_bytes`: the NN part plus one chunk) fits ``budget`` bytes (None: 1
    chunk; :func:`hpcgnn.run.engines.tensor.device_budget` reads it from the config).
    InputError naming ``tensor.device_memory`` when even one destination row per chunk does
    not fit."""
    from hpcgnn.units import fmt_bytes

    def need(k):
        return tensor_device_bytes(cfg, meta, parts, k, device)

    if budget is None:
        return (1, *need(1))
    v = max(int(meta.num_nodes), 1)
    nn_b, ch_b = need(v)
    if nn_b + ch_b > budget:
        raise InputError(f"tensor.device_memory = {cfg.tensor.device_memory!r} ({fmt_bytes(budget)}) is too small "
                         f"for tensor.chunks = 'auto': even one destination row per chunk needs "
                         f"{fmt_bytes(nn_b + ch_b)} on the device (NN layers {fmt_bytes(nn_b)}, chunk "
                         f"{fmt_bytes(ch_b)}); give more device memory or more ranks")
    lo, hi = 1, v
    while lo < hi:                      # the working set shrinks as the chunk count grows
        mid = (lo + hi) // 2
        if sum(need(mid)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return (lo, *need(lo))


def tensor_chunk_count(cfg, meta, parts: int, device_total: int | None = None) -> int:
    """``tensor.chunks`` as a count: the number, or for ``'auto'`` what :func:`auto_chunks`
    picks for ``tensor.device_memory`` (1 when no budget can be resolved here: the CPU's
    ``'auto'``, a fraction without the GPU's size)."""
    t = cfg.tensor
    if t.chunks != "auto":
        return int(t.chunks)
    from hpcgnn.run.engines.tensor import device_budget

    try:
        budget = device_budget(t.device_memory, cfg.train.device, device_total)
        return auto_chunks(cfg, meta, parts, budget, cfg.train.device)[0]
    except InputError:
        return 1


# ---- the compute device's memory -------------------------------------------------------------

DEVICE_SHRINK = {
    "store_rows": "lower store.device_memory",
    "model_state": f"shrink {MODEL_SHRINK}",
    "optimizer_step": f"shrink {MODEL_SHRINK}",
    "hec": "lower minibatch.cache_lines",
    "activations": None,            # per engine, below
    "eval": "set minibatch.eval_rows / minibatch.eval_halo_rounds",
    "backward": "set fullgraph.offload = true with fullgraph.chunks, or more ranks",
    "deterministic": "set train.deterministic = false (its SpMM gathers a slice of edge rows)",
    "cuda_libraries": "nothing (the CUDA math libraries' workspaces; CUBLAS_WORKSPACE_CONFIG sizes cuBLAS's)",
    "topology": "more ranks (hpcgnn partition --parts)",
    "chunks": "more ranks (hpcgnn partition --parts)",
    "chunk": "raise tensor.chunks (or tensor.chunks = 'auto' with tensor.device_memory)",
    "resident": "lower tensor.device_memory (the staged path streams its slices when they do not fit)",
    "nn": "more ranks (the NN rows are V/P)",
    "halo_cache": "lower fullgraph.cache_memory / fullgraph.cache_device_memory",
    "halo_pipeline": "set fullgraph.pipeline = false",
    "cuda_context": "nothing (the CUDA context and torch's kernels)",
}


def _cuda_available() -> bool:
    """Whether torch sees a GPU (without one, ``train.device = 'cuda'`` is the engine's error,
    raised once the run has started and recorded in its run file)."""
    import torch

    return torch.cuda.is_available()


def _device_type(cfg) -> str:
    """``train.device`` as ``cuda`` / ``cpu`` (``auto``: cuda when torch sees a GPU)."""
    dev = cfg.train.device
    if dev == "auto":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
    return dev


def estimate_device_memory(cfg, meta, part_id: int, shapes: dict | None = None, device: str | None = None,
                           store_available: int | None = None, sample: bool = False,
                           libraries: int | None = None) -> MemoryEstimate:
    """Peak bytes on rank ``part_id``'s compute device, as named terms (``shrink``: the setting
    that makes each smaller). ``device``: ``cuda`` or ``cpu`` (default ``train.device``); on the
    CPU the terms are the tensors the engine places on its device, what
    :class:`hpcgnn.run.memory.DeviceMemoryMeter` counts there (``activations`` / ``chunk``; the
    store's rows, the model and the topology stay where the host estimate counts them).

    Terms: ``store_rows`` (the feature store's device tier: its budget, at most the rank's feature
    rows; ``'auto'`` with ``store_available`` bytes: that, else every row), ``model_state``
    (values, gradients, Adam's moments; bf16 copies), ``optimizer_step`` (the foreach Adam's
    temporaries) and per engine: minibatch ``hec`` and the largest of ``activations`` (the
    sampled frontiers), ``eval`` and the step; full graph in memory ``activations``, the local
    block's ``topology``, ``backward`` (:func:`fullgraph_device_backward`) and a
    cached/pipelined halo's buffers; offloaded ``chunks`` (their topology) and ``activations``
    (one batch of chunks); tensor ``nn`` (the NN layers on the rank's rows) and ``chunk`` (one
    chunk's working set, :func:`tensor_device_bytes`); on CUDA ``cuda_context``,
    ``cuda_libraries`` (``libraries`` bytes, measured by
    :func:`hpcgnn.run.memory.cuda_library_bytes`; default :data:`CUDA_LIBRARIES`) and with
    ``train.deterministic`` ``deterministic`` (:func:`deterministic_spmm_bytes`); when the
    staged tensor path is resident (:func:`tensor_resident_bytes`) also ``resident``. ``sample``: measure instead of model (reads the store): the minibatch
    frontiers of :func:`minibatch_sampled_sizes` (not in the exact halo mode, which samples the
    whole graph), the tensor chunk of :func:`tensor_stage_rows`
    (on the CPU; CUDA keeps the :func:`tensor_device_bytes` bound), the offloaded batch's
    unit rows of :func:`offload_sampled_rows`."""
    from hpcgnn.store.budget import resolve_budget

    dev = device or _device_type(cfg)
    eng = cfg.train.engine
    out = MemoryEstimate(part_id)
    if eng == "tensor":
        parts = max(int(meta.num_parts), 1)
        chunks = tensor_chunk_count(cfg, meta, parts)
        staged = cfg.tensor.staged or dev == "cuda"
        sizes = model_param_sizes(cfg, meta.num_features, meta.num_classes)
        nn_b, chunk_b = tensor_device_bytes(cfg, meta, parts, chunks, dev)
        model = model_state_bytes(sizes, cfg.train.precision, MODEL_COPIES - 1)
        if dev == "cuda":
            rows = -(-int(meta.num_nodes) // parts)
            feature_bytes = rows * int(meta.num_features) * F32
            budget = resolve_budget(cfg.store.device_memory, feature_bytes, dev, store_available)
            out.terms["store_rows"] = int(feature_bytes if budget is None else min(budget, feature_bytes))
            out.terms["nn"] = int(nn_b - model_state_bytes(sizes, "fp32", MODEL_COPIES - 1))
            out.terms["model_state"] = int(model)
        if staged:
            resident = tensor_resident_bytes(cfg, meta, parts, chunks, dev, part_id)
            if resident and dev == "cuda":        # the chunks' topology is counted as resident
                chunk_b = tensor_device_bytes(cfg, meta, parts, chunks, dev, resident=True)[1]
            if sample and dev != "cuda":          # the real chunks (tensor_device_bytes: a bound)
                chunk_b = tensor_stage_bytes(cfg, meta, parts, part_id, tensor_stage_rows(meta, chunks), resident > 0)
            out.terms["chunk"] = int(chunk_b)
            if resident:
                out.terms["resident"] = int(resident)
    else:
        s = shapes or part_shapes(meta.path, part_id)
        host = estimate_rank_memory(cfg, meta, part_id, 0, s)
        ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
        t = host.terms
        if dev == "cuda":
            feature_bytes = ns * int(meta.num_features) * F32
            budget = resolve_budget(cfg.store.device_memory, feature_bytes, dev, store_available,
                                    hec_capacity_bytes(cfg, meta, s))
            out.terms["store_rows"] = int(feature_bytes if budget is None else min(budget, feature_bytes))
            sizes = model_param_sizes(cfg, meta.num_features, meta.num_classes)
            out.terms["model_state"] = model_state_bytes(sizes, cfg.train.precision, MODEL_COPIES - 1)
            out.terms["optimizer_step"] = adam_step_bytes(sizes, cfg.train.weight_decay, "cuda")
        if eng == "minibatch":
            # the exact mode samples over the whole graph, which the partition's sampler cannot
            # reproduce: its frontiers stay the whole-graph model's
            sampled = minibatch_sampled_sizes(cfg, meta, part_id) if sample and cfg.minibatch.halo != "exact" else None
            out.terms["activations"] = minibatch_device_activations(cfg, meta, s, sampled)
            if dev == "cuda":
                if cfg.minibatch.halo == "hec":   # rows on the device only where the store puts them
                    hec = hec_device_bytes(cfg, meta, s, budget, feature_bytes)
                    if hec:
                        out.terms["hec"] = hec
                if host.phases.get("eval") and cfg.minibatch.eval == "sampled":
                    out.terms["eval"] = minibatch_sampled_eval_bytes(cfg, meta, s, device=True)
                elif host.phases.get("eval"):   # layer-wise: plus the CSR and degree scales it copies there
                    # the chunk's temporaries as the inference sizes them, not the host's bound
                    rb = inference_chunk_row_bytes(cfg, widths, ne / max(ns, 1))
                    ev = minibatch_eval_bytes(cfg, s, widths, rb, device=True) + inference_device_csr_bytes(ns, ne)
                    if out.terms["store_rows"] >= feature_bytes and cfg.model.arch != "gat" and \
                            _inference_row_widths(widths[0], widths[1]) == _widest_inference_layer(widths):
                        ev -= ns * widths[0] * F32    # layer 0's input: the store's device rows
                    out.terms["eval"] = int(ev)
                _keep_largest(out, ("activations", "eval", "optimizer_step"))
            out.shrink["activations"] = "lower minibatch.batch_size or minibatch.fanouts"
        elif cfg.fullgraph.offload:
            rows = offload_sampled_rows(cfg, meta, part_id) if sample else None
            out.terms["activations"] = offload_batch_bytes(cfg, meta, s, rows)
            out.shrink["activations"] = "raise fullgraph.chunks or lower fullgraph.batch_chunks"
            if dev == "cuda":
                out.terms["chunks"] = int(t.get("chunks", 0))
        else:
            out.terms["activations"] = fullgraph_device_activations(cfg, meta, s)
            out.shrink["activations"] = "set fullgraph.offload = true with fullgraph.chunks, or more ranks"
            if dev == "cuda":       # the block's CSR and the torch path's per-edge tensors
                per_edge = DEVICE_BLOCK_EDGE_BYTES + (2 * I64 if cfg.model.arch == "gat" else 0)
                out.terms["topology"] = int((ns + 1) * I64 + ne * per_edge + (nl + 1) * I64)
                out.terms["backward"] = fullgraph_device_backward(cfg, meta, s)
                if cfg.model.arch == "sage" and out.terms["store_rows"] >= feature_bytes:
                    # layer 0's own rows are the store's device rows (counted there), not a copy;
                    # with a halo cache too, whose exchanged layer-0 input is not kept (its own
                    # rows are given apart: SAGEConv.forward's h_dst)
                    out.terms["activations"] -= ns * widths[0] * F32
                if cfg.model.arch != "gat" and cfg.fullgraph.halo == "cached" and widths[1] < widths[0]:
                    # layer 0 projects first: its aggregate is w1 wide, not w0
                    out.terms["activations"] -= ns * (widths[0] - widths[1]) * F32
                # the cache's tiers are on the device; the pipeline's messages in flight only
                # when the data plane moves device buffers (NCCL), else in host memory
                from hpcgnn.comm.communicator import moves_device_buffers

                device_plane = moves_device_buffers(cfg.runtime.backend, dev)
                for k in ("halo_cache", "halo_pipeline"):
                    if t.get(k) and (k == "halo_cache" or device_plane):
                        out.terms[k] = int(t[k])
    if dev == "cuda" and cfg.train.deterministic:
        if eng == "tensor":
            edges = -(-(int(meta.num_edges) + int(meta.num_nodes)) // max(chunks, 1))
            width = _tensor_cols(cfg, meta, parts)
        else:
            edges, width = ne, wmax
        out.terms["deterministic"] = deterministic_spmm_bytes(edges, width)
    if dev == "cuda":
        out.terms["cuda_libraries"] = int(CUDA_LIBRARIES if libraries is None else libraries)
        out.terms["cuda_context"] = CUDA_CONTEXT
    for k in out.terms:
        out.shrink.setdefault(k, DEVICE_SHRINK.get(k) or "more ranks")
    return out


def minibatch_frontier_rows(cfg, meta, s: dict, exact: bool | None = None,
                            batch: int | None = None) -> list[float]:
    """Expected rows of every sampled layer's input (``rows[l]``, ``rows[layers]`` = the batch):
    the batch, then each hop adds the expected distinct vertices of its fanout's draws, uniform
    over the rank's local vertices, or with ``exact`` over the whole graph (DistDGL-style
    sampling: ``minibatch.halo = "exact"`` (the default of ``exact``), sampled evaluation);
    ``batch``: seeds per batch (default: a training minibatch's). An
    upper bound: a partition's neighbourhoods overlap more than uniform draws do (products-like
    0.25, 2 ranks, fanouts 5, 10, 15: 1.7x / 1.4x the sampled layer-0 / layer-1 rows)."""
    ns, nl = s["num_solid"], s["num_solid"] + s["num_halo"]
    mb = cfg.minibatch
    if exact is None:
        exact = mb.halo == "exact"
    pool = max(int(meta.num_nodes), nl) if exact else nl
    seeds = (min(mb.batch_size, max(s.get("num_train", ns), 1)) if batch is None else batch)
    rows = [float(min(seeds, max(ns, 1)))]
    for f in reversed(_fanout_draws(cfg, s)):
        rows.append(min(pool, rows[-1] + expected_distinct(pool, rows[-1] * f)))
    return rows[::-1]


def _fanout_draws(cfg, s: dict) -> list[float]:
    """Expected neighbours a destination draws at each layer: its fanout, at most the partition's
    average degree (all of them for ``-1``)."""
    avg = s["num_edges"] / max(s["num_solid"], 1)
    return [avg if f < 0 else min(f, avg) for f in cfg.minibatch.fanouts]


def minibatch_expected_sizes(cfg, meta, s: dict, exact: bool | None = None,
                             batch: int | None = None) -> tuple[list, list]:
    """``(rows, edges)`` of an expected minibatch, as :func:`minibatch_sampled_sizes` gives a
    sampled one: :func:`minibatch_frontier_rows` and each layer's destinations times its draws."""
    rows = minibatch_frontier_rows(cfg, meta, s, exact, batch)
    return rows, [rows[l + 1] * f for l, f in enumerate(_fanout_draws(cfg, s))]


def minibatch_sampled_eval_bytes(cfg, meta, s: dict, device: bool = False) -> int:
    """Bytes of one batch of the sampled evaluation (``minibatch.eval = "sampled"``, of
    ``minibatch.eval_batch_size`` seeds,
    :meth:`hpcgnn.engine.minibatch.MinibatchEngine._predict_sampled`) on frontiers sampled over
    the whole graph (:func:`minibatch_frontier_rows` with ``exact``), the larger of its two
    phases: the feature fetch (:meth:`hpcgnn.comm.exact_fetch.ExactFetch.fetch_features`: the
    rows this rank serves, the rows it receives and the assembled input, each about the
    frontier's ``rows[0] x w0``) and the forward without autograd (the input, then at the
    widest layer its input, its aggregate and the two products of its update; GAT: its
    projected sources, its output and the per-edge logits and attention); plus the
    sampled blocks' CSRs and the fetch's per-edge requests (three int64 an edge). ``device``: what
    a GPU holds of it, the forward's tensors and the blocks' CSRs (the fetch's buffers are host
    memory)."""
    _, _, _, _, widths, layers, _ = _sizes(cfg, meta, s)
    mb = cfg.minibatch   # an evaluation batch: minibatch.eval_batch_size seeds, 0 = 10 x batch_size
    rows, edges = minibatch_expected_sizes(cfg, meta, s, exact=True,
                                           batch=int(mb.eval_batch_size or 10 * mb.batch_size))
    gat = cfg.model.arch == "gat"
    x0 = rows[0] * widths[0] * F32

    def held(l: int) -> float:          # layer l's tensors beside the fetched input
        wi, wo, n_src, n_dst = widths[l], widths[l + 1], rows[l], rows[l + 1]
        inp = n_src * wi if l else 0
        if gat:                          # the projected sources, the output, per-edge logits
            return (inp + (n_src + n_dst) * wo + 2 * edges[l] * cfg.model.heads) * F32
        return (inp + n_dst * (wi + 2 * wo)) * F32

    layer = max(held(l) for l in range(layers))
    if device:
        return int(x0 + layer + sum(edges) * I64)
    return int(max(3 * x0, x0 + layer) + 3 * sum(edges) * I64)


def minibatch_sampled_sizes(cfg, meta, part_id: int, batches: int = SAMPLED_BATCHES) -> list:
    """``(rows, edges)`` of up to ``batches`` minibatches of ``minibatch.batch_size`` seeds
    sampled on rank ``part_id``'s partition with the engine's sampler (:class:`NeighborSampler`,
    ``minibatch.fanouts``; seeds drawn from the training vertices by a fixed stream of
    ``train.seed``): ``rows[l]`` input rows of layer ``l`` (``rows[layers]``: the seeds),
    ``edges[l]`` the sampled edges of layer ``l``'s block. Reads the partition's topology and
    training mask only (no features); the first ``min(batches, steps of an epoch)`` batches."""
    from hpcgnn.partition.store import local_ids, open_partition_file
    from hpcgnn.sampling.neighbor import NeighborSampler
    from hpcgnn.seeding import numpy_rng, stream_seed

    b, e = int(meta.part_offsets[part_id]), int(meta.part_offsets[part_id + 1])
    with open_partition_file(meta.path, part_id, meta) as f:
        indptr = _checked_indptr(f, meta, part_id)
        glob = _checked_indices(np.asarray(f["indices"][()], dtype=np.int64), meta, part_id)
        halo = np.asarray(f["halo_ids"][()], dtype=np.int64)
        train = np.flatnonzero(np.asarray(f["train_mask"][()], dtype=bool)).astype(np.int64)
    ns = e - b
    local = local_ids(glob, b, e, halo)
    outside = (glob < b) | (glob >= e)
    if np.any(local[outside] >= ns + halo.size) or np.any(halo[local[outside] - ns] != glob[outside]) \
            or np.any(train >= ns):
        raise InputError(f"{_partition_file(meta, part_id)}: indices names a vertex that is neither solid nor "
                         f"in halo_ids, or train_mask is not one flag per solid vertex{CORRUPT_PARTITION}")
    mb = cfg.minibatch
    size = min(int(mb.batch_size), int(train.size))
    if size == 0:
        return []
    sampler = NeighborSampler(indptr, local, ns, list(mb.fanouts),
                              seed=stream_seed(cfg.train.seed, _ESTIMATE_STREAM, part_id), num_local=ns + halo.size)
    rng = numpy_rng(cfg.train.seed, _ESTIMATE_STREAM, part_id)
    out = []
    for i in range(min(int(batches), -(-int(train.size) // size))):
        seeds = np.sort(rng.choice(train, size=size, replace=False))
        batch = sampler.sample(seeds, epoch=0, step=i)
        out.append(([int(x.shape[0]) for x in batch.frontiers], [int(bl.num_edges) for bl in batch.blocks]))
    return out


def minibatch_device_activations(cfg, meta, s: dict, sampled: list | None = None) -> int:
    """Bytes a minibatch step keeps on the device for backward: the gathered input rows and,
    per layer, what it saves: projecting first (:func:`hpcgnn.nn.conv.sage_projects_first`, SAGE)
    the projected sources and two destination tensors at the output width, else the
    aggregate at the input width and two at the output width (GAT: also the projected sources
    and the per-edge logits and attention per head); plus the block's CSR (int64 per edge and
    destination). What :class:`hpcgnn.run.memory.DeviceMemoryMeter` counts on the CPU.
    ``sampled``: :func:`minibatch_sampled_sizes` (the largest of those batches counts), else
    the expected frontiers of uniform draws (:func:`minibatch_expected_sizes`)."""
    widths = _sizes(cfg, meta, s)[4]
    sampled = sampled or [minibatch_expected_sizes(cfg, meta, s)]
    return int(max(_minibatch_step_bytes(cfg, widths, rows, edges) for rows, edges in sampled))


def _minibatch_step_bytes(cfg, widths: list, rows: list, edges: list) -> float:
    """:func:`minibatch_device_activations` of one batch: ``rows[l]`` input rows of layer ``l``,
    ``edges[l]`` its block's edges. A GAT layer's backward also holds, beside its saved
    projection ``z`` [n_src, wo], two more of its size: the aggregation's gradient to ``z`` and
    the logits' (:func:`hpcgnn.nn.aggregate.gat_node_logits`, one buffer for both; the trace
    of products-like 0.25, layer 0: ``python -m hpcgnn.bench.alloc_trace``); the largest
    layer's counts, once."""
    from hpcgnn.nn.conv import sage_projects_first

    arch = cfg.model.arch
    total = rows[0] * widths[0] * F32
    gat_backward = 0.0
    for l in range(cfg.model.layers):
        wi, wo = widths[l], widths[l + 1]
        n_src, n_dst, n_e = rows[l], rows[l + 1], edges[l]
        if arch == "sage" and sage_projects_first(wi, wo, int(n_src), int(n_dst), int(n_e)):
            saved = (n_src + 2 * n_dst) * wo * F32
        elif arch == "gat":
            saved = (n_src * wo + 2 * n_dst * wo) * F32 + 2 * n_e * cfg.model.heads * F32
            gat_backward = max(gat_backward, 2 * n_src * wo * F32)
        else:
            saved = n_dst * (wi + 2 * wo) * F32
        total += saved + (n_e + n_dst + 1) * I64
    return total + gat_backward


def fullgraph_halo_width(cfg, widths: list[int], l: int) -> tuple[bool, int]:
    """What the full graph's halo exchange sends at layer ``l`` of ``cfg``'s model with layer
    widths ``widths``, exact or cached alike (:func:`hpcgnn.nn.conv.halo_exchange_shape`, the one
    rule): ``(True, w)`` its ``w`` wide projection (GCN's source rows, ``min(w_l, w_l+1)``; a
    SAGE projection ``w_l+1``, a GAT one ``heads x`` the per-head output, when narrower than the
    input), else ``(False, w_l)`` its input: layer 0 (its halo rows are the partition's) and the
    offloaded engine (it exchanges its host-resident inputs) always."""
    from hpcgnn.nn.conv import halo_exchange_shape

    m = cfg.model
    if cfg.fullgraph.offload:
        return False, int(widths[l])
    heads = m.heads if m.arch == "gat" else 1
    out = widths[l + 1] if m.arch != "gat" or l == m.layers - 1 else m.hidden
    return halo_exchange_shape(m.arch, l, widths[l], out, heads)


def fullgraph_projection_width(cfg, widths: list[int], l: int) -> int | None:
    """The width of the projection layer ``l`` of the in-memory full graph exchanges instead of
    its input (``InMemoryFullGraph.exchange_projection``; :func:`fullgraph_halo_width`), None
    when it exchanges its input."""
    projection, w = fullgraph_halo_width(cfg, widths, l)
    return w if projection else None


def sage_kept_input(ns: int, nh: int, ne: int, wi: int, wo: int, exact: bool = True) -> int:
    """Values a SAGE layer ``l >= 1`` of the in-memory full graph keeps of its exchanged input
    for backward, ``w_l = wi -> w_l+1 = wo`` (float32; its own rows are given apart, the previous
    layer's output, kept anyway: :meth:`hpcgnn.nn.conv.SAGEConv.forward`): none when it exchanges
    its projection (``exact``: the exchange's rule applies, and ``wo < wi``); else its ``ns x wi`` neighbour
    mean when it aggregates first, or a copy of the ``nh x wi`` halo rows when it projects first
    (:func:`~hpcgnn.nn.conv.sage_projects_first`). The one rule of the device estimate
    (:func:`fullgraph_kept_inputs`) and the host one (:func:`sage_in_memory_bytes`)."""
    from hpcgnn.nn.conv import exchanges_projection, sage_projects_first

    if exact and exchanges_projection(wi, wo):
        return 0
    return nh * wi if sage_projects_first(wi, wo, ns + nh, ns, ne) else ns * wi


def fullgraph_kept_inputs(cfg, meta, s: dict) -> list[int]:
    """Values each layer ``l >= 1`` of the in-memory full graph keeps of its input for backward
    (index ``l - 1``): none when it exchanges its projection (:func:`fullgraph_projection_width`:
    the projection's input is the previous layer's output, kept anyway); for GCN its ``ns x
    w_l`` aggregate, the product's input (the scaled rows are not kept: their factor is a
    constant), or when it projects first nothing (exchanged, in every halo mode); for SAGE :func:`sage_kept_input` (in bfloat16, whose projection is not merged, the
    exchanged rows of a layer that projects first); else (GAT) the exchanged ``nl x w_l`` rows."""
    from hpcgnn.nn.conv import sage_projects_first

    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    sage = cfg.model.arch == "sage"
    bf16 = cfg.train.precision == "bf16"

    def kept(l: int) -> int:
        exchanged = fullgraph_projection_width(cfg, widths, l) is not None
        if cfg.model.arch == "gcn":
            if widths[l + 1] < widths[l]:       # projects first: the product's input
                return 0 if exchanged else nl * widths[l]
            return ns * widths[l]               # the aggregate, the product's input
        if exchanged:
            return 0
        if not sage or (bf16 and sage_projects_first(widths[l], widths[l + 1], nl, ns, ne)):
            return nl * widths[l]
        return sage_kept_input(ns, nh, ne, widths[l], widths[l + 1], exact=False)
    return [kept(l) for l in range(1, layers)]


def fullgraph_device_activations(cfg, meta, s: dict) -> int:
    """Bytes the in-memory full-graph engine keeps on the device for backward: layer 0's input
    (a cacheable layer 0, SAGE or GCN without a halo cache, aggregates the features once and
    keeps only that ``ns x w0`` aggregate, SAGE also the own rows; else every local row and the
    aggregate), each hidden
    layer's ``ns x w`` output (ReLU + dropout) and what each later layer keeps of its exchanged
    input (:func:`fullgraph_kept_inputs`), the degree scales; GAT also two per-edge tensors and two destination logits per head and
    layer, every layer's projected rows over all ``nl`` local rows and the received halo
    feature rows (measured: 1.00 of the meter's peak on 2 ranks of Cora). What
    :class:`hpcgnn.run.memory.DeviceMemoryMeter` counts on the CPU."""
    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    cacheable = cfg.model.arch in ("sage", "gcn") and cfg.fullgraph.halo != "cached"
    # SAGE's update reads the destinations' own rows too (lin_self): they stay as well
    if cacheable:
        act = (2 if cfg.model.arch == "sage" else 1) * ns * widths[0]
    else:                  # GAT projects every local row first; else rows and their aggregate
        act = (nl if cfg.model.arch == "gat" else nl + ns) * widths[0]
    act += sum(ns * widths[l + 1] for l in range(layers - 1))
    act += sum(fullgraph_kept_inputs(cfg, meta, s))
    act = act * F32 + nl * F32
    if cfg.model.arch == "gat":
        # per layer: two per-edge tensors per head, the projected rows z over every local row
        # (heads x the layer's output; the last layer's heads x classes) and two per-destination
        # logits per head; layer 0 also keeps the received halo feature rows
        h = cfg.model.heads
        act += 2 * ne * h * F32 * layers + nh * widths[0] * F32
        act += sum(nl * (widths[l + 1] if l < layers - 1 else h * widths[-1]) + 2 * ns * h
                   for l in range(layers)) * F32
    return int(act)


def deterministic_spmm_bytes(edges: int, width: int) -> int:
    """Bytes of the gathered ``[edges, columns]`` slice of one deterministic CUDA SpMM
    (:func:`hpcgnn.nn.aggregate._spmm_by_segments`, ``train.deterministic``): at most
    ``SEGMENT_SPMM_ELEMENTS`` floats, one column when ``edges`` exceeds that."""
    from hpcgnn.nn.aggregate import SEGMENT_SPMM_ELEMENTS

    edges, width = max(int(edges), 1), max(int(width), 1)
    return int(min(edges * width, max(SEGMENT_SPMM_ELEMENTS, edges)) * F32)


def fullgraph_device_backward(cfg, meta, s: dict) -> int:
    """Bytes the in-memory full graph's backward allocates on the device beside what forward
    kept (:func:`fullgraph_device_activations`), at its largest layer ``l >= 1`` (layer 0's
    input, the features, needs no gradient): the gradient of the layer's exchanged input
    ``nl x w_l`` (GAT twice; SAGE gets its own rows apart and GCN reads them through the scaled
    sources: once), the transposed SpMM's ``nl x w_{l+1}`` output, the saved ``ns x w_l``
    aggregate and the ``ns x classes`` logits; a layer that exchanges its projection
    (:func:`fullgraph_projection_width`, ``wp`` wide) the transposed SpMM's ``nl x wp`` output,
    two ``ns x wp`` gradients (scaled, and the solid rows' of the exchange), its input's
    ``ns x w_l`` gradient and the logits. Less what the later layers kept of their inputs
    (:func:`fullgraph_kept_inputs`), whose backward has ended and freed it; GAT also three
    gradients of per-edge tensors per head. Measured against every torch allocation of a CPU
    epoch with ``train.kernels = "torch"`` (``python -m hpcgnn.bench.alloc_trace``, docs/plan.md
    and docs/gpu.md): products-like SAGE 100-64-64-47 at 0.25 peaks in the last layer's backward
    (its projection exchanged), this term 1.00 of it there; the whole estimate 1.07 / 1.06 of
    the traced peak (ranks 0 / 1), GCN 1.02 / 1.02 (a 60k SBM at 128-256-256-8 1.12), SAGE
    cached + pipelined 1.02; the 20k-vertex SBM of tests/bench/test_alloc_trace.py SAGE 1.17,
    GAT 1.06, GCN 1.13 (hidden 256; 1.08 at 64), GCN cached 1.10."""
    ns, nh, ne, nl, widths, layers, wmax = _sizes(cfg, meta, s)
    grads = 2 if cfg.model.arch == "gat" else 1     # SAGE gets its own rows apart, GCN reads them through the scaled sources
    kept = fullgraph_kept_inputs(cfg, meta, s)      # kept[l - 1]: layer l's

    # GCN's product comes last in a layer's forward, so its backward runs first and frees the
    # layer's own kept input (the aggregate) before the input gradient exists (traced: a 60k
    # SBM, 128-256-256-8, peaks in layer 1's backward without it); the layer's ReLU + dropout
    # output, freed before that too, stays counted
    own = 1 if cfg.model.arch == "gcn" else 0

    def layer(l: int) -> int:
        later = sum(kept[l - own:])
        wp = fullgraph_projection_width(cfg, widths, l)
        if wp is not None:
            # the transposed SpMM's nl x wp output, the scaled gradient and the solid rows'
            # gradient of the exchange (ns x wp each), the projection's input gradient ns x w_l
            # and the logits (traced: products-like SAGE 64-47, 1.00 of its last layer's backward)
            return nl * wp + ns * (2 * wp + widths[l] + widths[-1]) - later
        return nl * (grads * widths[l] + widths[l + 1]) - later + ns * (widths[l] + widths[-1])
    out = max((layer(l) for l in range(1, layers)), default=0) * F32
    if cfg.model.arch == "gat" and layers > 1:
        out += 3 * ne * cfg.model.heads * F32   # traced: the softmax's and the logits' gradients
    return int(out)


def store_auto_bytes(cfg, meta, part_id: int, free: int, shapes: dict | None = None,
                     libraries: int | None = None) -> int:
    """Device bytes ``store.device_memory = 'auto'`` gives the store on rank ``part_id``: ``free``
    (the device's free memory or ``runtime.device_memory_limit``) minus every other device term
    (:func:`estimate_device_memory` with an empty store), at least 0."""
    est = estimate_device_memory(cfg, meta, part_id, shapes, "cuda", store_available=0, libraries=libraries)
    return max(int(free) - est.total, 0)


def device_limit(cfg, device: str, torch_device=None) -> tuple[int | None, str]:
    """``(bytes one rank may use on its device, where that figure comes from)``:
    ``runtime.device_memory_limit`` when stated; else on CUDA the GPU's free memory
    (:func:`hpcgnn.run.memory.device_free_bytes`, the CUDA context already in use); else None."""
    from hpcgnn.run.memory import device_free_bytes
    from hpcgnn.units import parse_size

    stated = cfg.runtime.device_memory_limit
    if stated:
        return parse_size(stated, "runtime.device_memory_limit"), "runtime.device_memory_limit"
    if device == "cuda":
        got = device_free_bytes(torch_device if torch_device is not None else "cuda")
        if got is not None:
            return got[0], "the GPU's free memory"
    return None, ""


def estimate_attrs(rt, host: MemoryEstimate | None, device: MemoryEstimate | None) -> dict:
    """Collective: the run file's record of the pre-run estimates, per rank (lists indexed by
    rank; None where none was made): ``estimated_peak_rss_bytes`` (:func:`check_memory`'s total)
    and ``estimated_peak_device_bytes`` (:func:`check_device_memory`'s, without the CUDA context
    term: comparable with the measured ``counters/peak_device_bytes``, which on CUDA is
    ``max_memory_allocated``), and ``estimated_device_terms`` ({term: bytes} per rank), so that
    every run shows how far the estimate is from what it measured (``make check-gpu``,
    ``bench-scale``)."""
    dev_total = None if device is None else int(device.total - device.terms.get("cuda_context", 0))
    dev_terms = None if device is None else {k: int(v) for k, v in device.terms.items() if k != "cuda_context"}
    rows = rt.comm.allgather((None if host is None else int(host.total), dev_total, dev_terms))
    return {"estimated_peak_rss_bytes": [r[0] for r in rows],
            "estimated_peak_device_bytes": [r[1] for r in rows],
            "estimated_device_terms": [r[2] for r in rows]}


def device_overcommit(rows: list[tuple]) -> tuple | None:
    """The worst over-committed device of ``rows`` (one per rank: ``(rank, need, largest,
    shrink, limit, gpu)``, ``gpu`` from :func:`hpcgnn.runtime.gpu_identity` when ``limit`` is the GPU's measured
    free memory, else ``""``): ranks that name the same GPU share its free memory, so their needs
    add up (the free memory was measured after every rank's CUDA context existed); every other
    rank stands alone against its own limit. Returns ``(ranks, need, limit, row of the neediest
    rank)`` of the device with the largest excess, None when every device holds its ranks."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[5] or ("rank", r[0]), []).append(r)
    worst = None
    for members in groups.values():
        need = sum(r[1] for r in members)
        limit = min(r[4] for r in members)
        if need > limit and (worst is None or need - limit > worst[1] - worst[2]):
            worst = ([r[0] for r in members], need, limit, max(members, key=lambda r: r[1]))
    return worst


def check_device_memory(cfg, meta, rt, torch_device=None) -> MemoryEstimate | None:
    """Collective: refuse (InputError, exit 2 on every rank) before the first epoch when a rank's
    estimated device peak (:func:`estimate_device_memory`) exceeds what its device offers
    (:func:`device_limit`), or, on CUDA, when the ranks sharing one GPU (:func:`hpcgnn.runtime.gpu_identity`)
    need more together than its free memory (:func:`device_overcommit`); ``runtime.memory_check
    = false`` skips the refusal. On CUDA each rank first picks its GPU (:func:`resolve_device`) and
    creates its context, and the free memory is read after every rank has done so. With
    ``store.device_memory = 'auto'`` also states the store's share (``rt.store_device_available``,
    read when the engine builds its store; ``k`` ranks on one GPU share its free memory in ``k``
    equal parts). Returns this rank's estimate (None when no limit
    applies)."""
    from hpcgnn.engine.device import resolve_device
    from hpcgnn.run.memory import cuda_library_bytes, device_free_bytes
    from hpcgnn.runtime import gpu_identity, shared_gpus
    from hpcgnn.units import fmt_bytes

    error, est, limit, source, gpu = None, None, None, "", ""
    try:
        dev = _device_type(cfg)
        if dev == "cuda" and not cfg.runtime.device_memory_limit and _cuda_available():
            if torch_device is None:
                torch_device = resolve_device(cfg, rt)
            device_free_bytes(torch_device)   # this rank's CUDA context, before any rank measures
            gpu = gpu_identity(torch_device)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)                           # collective: every context exists from here on
    # ranks whose free memory is this same GPU's
    sharers = shared_gpus(rt.comm.allgather(gpu)).get(gpu, 1)
    try:
        limit, source = device_limit(cfg, dev, torch_device)
        # after the free memory was read: the workspaces then count in the estimate, not as used
        libraries = None if torch_device is None else cuda_library_bytes(torch_device)
        if limit is not None:
            measured_free = dev == "cuda" and source != "runtime.device_memory_limit"
            auto = isinstance(cfg.store.device_memory, str) and cfg.store.device_memory.strip().lower() == "auto"
            store_avail = None
            if dev == "cuda" and auto:        # a GPU shared by k ranks: each store gets a k-th
                room = limit // sharers + (CUDA_CONTEXT if measured_free else 0)
                store_avail = store_auto_bytes(cfg, meta, rt.rank, room, libraries=libraries)
                rt.store_device_available = store_avail
            est = estimate_device_memory(cfg, meta, rt.rank, device=dev, store_available=store_avail, sample=True,
                                         libraries=libraries)
            if measured_free:                 # the context is already part of the used memory
                est.terms.pop("cuda_context", None)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    if limit is None:
        return None
    rows = rt.comm.allgather((rt.rank, est.total, est.largest(), est.shrink.get(est.largest()[0], ""), limit, gpu))
    error = None
    worst = device_overcommit(rows)
    if cfg.runtime.memory_check and worst is not None:
        ranks, need, lim, (rank, own, (name, size), shrink, _, _) = worst
        where = source if source == "runtime.device_memory_limit" else f"{source} (rank {rank})"
        if len(ranks) == 1:
            error = (f"train: the device needs {fmt_bytes(need)} per rank (rank {rank}; largest: "
                     f"{name.replace('_', ' ')} {fmt_bytes(size)}: {shrink}) but {where} is {fmt_bytes(lim)}")
        else:
            error = (f"train: ranks {', '.join(map(str, ranks))} share one GPU and need {fmt_bytes(need)} on it "
                     f"together (rank {rank}: {fmt_bytes(own)}; largest: {name.replace('_', ' ')} "
                     f"{fmt_bytes(size)}: {shrink}) but {where} is {fmt_bytes(lim)} (give each rank its own GPU)")
    rt.agree(error)
    return est
