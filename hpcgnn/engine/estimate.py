"""A rank's memory as a few coarse structural terms, checked before the run and against its
measured first step (:mod:`hpcgnn.engine.memory_check`).

Every engine states its memory next to itself, as the ``memory_terms`` of its spec
(:mod:`hpcgnn.run.engines.registry`; :mod:`hpcgnn.engine.memory_minibatch`,
:mod:`~hpcgnn.engine.memory_fullgraph`, :mod:`~hpcgnn.engine.memory_tensor`): named byte terms
built from the partition's sizes and the config, each a product of rows, a width and a constant
per architecture, with the setting that shrinks it. This module holds what they share:

* :class:`MemoryEstimate`: host terms (``terms``, resident bytes of the process) and device
  terms (``device``: on a GPU what lives there, on the CPU the tensors
  :class:`hpcgnn.run.memory.DeviceMemoryMeter` counts as the engine's device);
* the terms every engine has: ``baseline`` (the process before any graph data, measured in the
  calling process), ``partition`` (the partition file's arrays as loaded, the edges as local ids
  in place of the file's global ones, and the halo plan), ``model_state`` (values, gradients, Adam's two moments and the allreduce's
  flat buffer: five float32 copies of every parameter of the model the engine builds, counted
  on torch's meta device; bf16 also the linear layers' bfloat16 copies), ``optimizer_step``
  (Adam's temporaries and the allreduce's transient copy: at most three float32 copies of the
  parameters) and ``margin`` (:data:`HOST_MARGIN` of the modelled terms plus
  :data:`HOST_FLOOR`; on the device :data:`DEVICE_MARGIN` of its modelled terms); on CUDA
  ``cuda_context``, ``cuda_libraries`` and, with ``train.deterministic``, ``deterministic``
  (the deterministic SpMM's slice of edge rows: at most ``SEGMENT_SPMM_ELEMENTS`` floats);
* the entry points: :func:`estimate_rank_memory` (host and device terms of one rank),
  :func:`estimate_device_memory` (the device's alone), :func:`host_device_peak` and
  :func:`store_auto_bytes`.

The checks that read the terms (the pre-run refusal of what is clearly over the limit, the stop
after a measured first step) are :mod:`hpcgnn.engine.memory_check`'s.

The estimate is an upper bound of the measured peak within :data:`CLEAR_FACTOR` (tested per
engine on Cora and a 20k-vertex SBM, tests/engine/test_estimate.py). ``hpcgnn plan``,
``hpcgnn inspect STORE --config``, ``store.device_memory = 'auto'`` (:func:`store_auto_bytes`)
and the tensor engine's ``tensor.chunks = 'auto'`` read the same terms.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcgnn.errors import InputError

F32 = 4
I64 = 8
BF16 = 2
# tensors kept per layer for backward, in units of the layer's rows x width (the time model's
# elementwise passes read it too)
SAVED_PER_LAYER = 6
MODEL_COPIES = 5           # values, gradients, exp_avg, exp_avg_sq, the allreduce's flat buffer
STEP_COPIES = 3            # Adam's temporaries, or the allreduce's copy: at most 3 float32 copies
MODEL_SHRINK = "model.hidden or model.layers (the parameters' count)"
HOST_MARGIN = 0.25         # of the modelled host terms: the allocator's slack, the kernels' buffers
HOST_FLOOR = 224 << 20     # torch's compute libraries and thread pools, resident from the first operator
DEVICE_MARGIN = 0.25       # of the device terms
CLEAR_FACTOR = 2.0         # the terms overstate a measured peak by at most this much
CUDA_CONTEXT = 600 << 20   # a CUDA context and torch's kernels on the GPU
CUDA_LIBRARIES = 64 << 20  # the cuBLAS / cuBLASLt workspaces, when not measured
# measured or counted exactly, not modelled
EXACT = ("baseline", "partition", "model_state", "hec_directory", "store_rows", "cuda_context", "cuda_libraries")


@dataclass
class MemoryEstimate:
    """Named byte terms of one rank's peak: ``terms`` in host memory (``total`` their sum),
    ``device`` on the compute device; ``shrink[name]`` the setting that makes a term smaller."""

    part_id: int
    terms: dict = field(default_factory=dict)
    shrink: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)
    params: int = 0                              # the model's parameter count
    limit: int | None = None                     # set by the pre-run checks: the bytes allowed,
    limit_source: str = ""                       # where that figure comes from,
    node_ranks: int = 1                          # the ranks sharing it (host: per node)
    gpu: str = ""                                # and the GPU's identity (device, CUDA)
    phases: dict = field(default_factory=dict)   # terms of phases that never overlap, before
                                                 # all but the largest were zeroed

    @property
    def total(self) -> int:
        return int(sum(self.terms.values()))

    def floor(self) -> int:
        """A lower bound of the peak: the exact terms and the modelled ones / CLEAR_FACTOR (the
        margin left out)."""
        return int(sum(v if k in EXACT else v / CLEAR_FACTOR for k, v in self.terms.items() if k != "margin"))

    def largest(self) -> tuple[str, int]:
        name = max((k for k in self.terms if k not in ("baseline", "cuda_context", "margin")),
                   key=lambda k: self.terms[k], default="baseline")
        return name, int(self.terms.get(name, 0))

    def add(self, name: str, nbytes: float, shrink: str, device: bool = False) -> None:
        """Add ``nbytes`` to term ``name`` of the host (or the ``device``) with its setting."""
        where = self.device if device else self.terms
        where[name] = int(where.get(name, 0) + max(float(nbytes), 0.0))
        self.shrink.setdefault(name, shrink)


def keep_largest(where: dict, names: tuple, phases: dict) -> None:
    """Phases that never overlap: zero all of ``names`` in ``where`` but the largest (kept,
    with the others' sizes, in ``phases``)."""
    have = [k for k in names if k in where]
    phases.update({k: int(where[k]) for k in have})
    keep = max(have, key=lambda k: where[k], default=None)
    for k in have:
        if k != keep:
            where[k] = 0


def part_shapes(store: str | Path, part_id: int) -> dict:
    """Sizes of one partition from its file's dataset shapes (reads no array data but the
    training mask): num_solid, num_halo, num_edges, num_train, file_bytes (all datasets)."""
    import h5py

    from hpcgnn.partition.store import part_file_name

    path = Path(store) / part_file_name(part_id)
    try:
        with h5py.File(path, "r") as f:
            file_bytes = sum(int(np.prod(f[k].shape)) * f[k].dtype.itemsize for k in f.keys()
                             if isinstance(f[k], h5py.Dataset))
            a, tm = f.attrs, f["train_mask"]
            return {"num_solid": int(a["num_solid"]), "num_halo": int(a["num_halo"]),
                    "num_edges": int(f["indices"].shape[0]), "file_bytes": int(file_bytes),
                    "num_train": int(np.count_nonzero(tm[()])) if tm.shape[0] else 0}
    except (OSError, KeyError) as exc:
        raise InputError(f"{path}: cannot read the partition's sizes ({exc})") from None


def expected_distinct(pool: int, draws: float) -> float:
    """Expected distinct vertices among ``draws`` uniform picks from ``pool``."""
    return 0.0 if pool <= 0 else pool * -math.expm1(-draws / pool)


def layer_widths(cfg, in_dim: int, num_classes: int) -> list[int]:
    """Input width of every layer, then the output width."""
    m = cfg.model
    hid = m.hidden * (m.heads if m.arch == "gat" else 1)
    return [in_dim] + [hid] * (m.layers - 1) + [num_classes]


def sizes(cfg, meta, s: dict):
    """(solid, halo, edges, local rows, layer widths) of partition shapes ``s``."""
    ns, nh, ne = int(s["num_solid"]), int(s["num_halo"]), int(s["num_edges"])
    return ns, nh, ne, ns + nh, layer_widths(cfg, int(meta.num_features), int(meta.num_classes))


@functools.lru_cache(maxsize=256)
def _built_param_sizes(kind: str, in_dim: int, hidden: int, num_classes: int, layers: int,
                       heads: int, variant: str) -> tuple:
    """``(numel, in a bf16-capable linear layer)`` per parameter of a model built on torch's
    meta device; ``kind``: an arch of build_model, or the tensor engine's ``decoupled`` /
    ``decoupled-attention`` / ``coupled``."""
    import torch

    from hpcgnn.nn.precision import Linear

    with torch.device("meta"):
        if kind.startswith("decoupled"):
            from hpcgnn.nn.decoupled import DecoupledModel

            model = DecoupledModel(in_dim, hidden, num_classes, layers, 0.0, attention=kind == "decoupled-attention")
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
    """``(numel, in a linear layer)`` of every parameter of the model ``cfg``'s engine builds
    (:func:`hpcgnn.nn.models.build_model`, or the tensor engine's ``DecoupledModel`` /
    ``CoupledModel``), built on the meta device so the count cannot drift from the model."""
    m = cfg.model
    kind = m.arch
    if cfg.train.engine == "tensor":
        kind = cfg.tensor.mode + ("-attention" if m.arch == "gat" and cfg.tensor.mode == "decoupled" else "")
    return _built_param_sizes(kind, int(in_dim), int(m.hidden), int(num_classes), int(m.layers),
                              int(m.heads), str(m.gat_variant))


def model_terms(cfg, meta, est: MemoryEstimate, device: str) -> None:
    """``model_state`` and ``optimizer_step``: on the CPU all host memory; on CUDA the device
    keeps four copies and Adam's temporaries (one copy, foreach), the host the allreduce's
    buffer and its transient copy."""
    ps = model_param_sizes(cfg, meta.num_features, meta.num_classes)
    est.params = n = int(sum(k for k, _ in ps))
    bf16 = sum(k for k, lin in ps if lin) * BF16 if cfg.train.precision == "bf16" else 0
    if device == "cuda":
        est.add("model_state", n * F32 * (MODEL_COPIES - 1) + bf16, MODEL_SHRINK, device=True)
        est.add("optimizer_step", n * F32, MODEL_SHRINK, device=True)
        est.add("model_state", n * F32 * (2 if meta.num_parts > 1 else 1), MODEL_SHRINK)
    else:
        est.add("model_state", n * F32 * MODEL_COPIES + bf16, MODEL_SHRINK)
        est.add("optimizer_step", n * F32 * STEP_COPIES, MODEL_SHRINK)


def device_type(cfg) -> str:
    """``train.device`` as ``cuda`` / ``cpu`` (``auto``: cuda when torch sees a GPU)."""
    dev = cfg.train.device
    if dev == "auto":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
    return dev


def estimate_rank_memory(cfg, meta, part_id: int, baseline_bytes: int, shapes: dict | None = None,
                         device: str | None = None, store_available: int | None = None,
                         libraries: int | None = None) -> MemoryEstimate:
    """Rank ``part_id``'s peak on ``device`` (default ``train.device``): host terms (the
    baseline, the partition, the engine's ``memory_terms``, the model, the margin) and device
    terms (the engine's, the model's on CUDA, the CUDA context and libraries, the margin).
    ``store_available``: the device bytes ``store.device_memory = 'auto'`` may use."""
    from hpcgnn.run.engines.registry import engine_spec, resolve

    dev = device or device_type(cfg)
    s = shapes if shapes is not None else (part_shapes(meta.path, part_id) if cfg.train.engine != "tensor" else {})
    # (the tensor engine replaces ``partition`` with its own vertex rows)
    est = MemoryEstimate(part_id)
    est.add("baseline", baseline_bytes, "nothing (the interpreter, torch, MPI)")
    if s:
        ns, nh, ne, nl, _ = sizes(cfg, meta, s)
        # the file's arrays with the edges' global ids replaced by local ones as they are read
        # (int32 for the minibatch engine when every local id fits), local degree, halo plan
        narrow = cfg.train.engine == "minibatch" and nl <= np.iinfo(np.int32).max
        est.add("partition", s["file_bytes"] - ne * I64 + ne * (4 if narrow else I64) + 2 * nl * I64,
                "more partitions (hpcgnn partition --parts)")
    model_terms(cfg, meta, est, dev)
    resolve(engine_spec(cfg.train.engine).memory_terms)(cfg, meta, s, est, dev, store_available)
    if dev == "cuda" and cfg.train.deterministic:   # the deterministic SpMM's gathered edge rows
        from hpcgnn.nn.aggregate import SEGMENT_SPMM_ELEMENTS

        edges = max(int(s.get("num_edges", 0)) if s else (int(meta.num_edges) + int(meta.num_nodes)), 1)
        width = max(layer_widths(cfg, int(meta.num_features), int(meta.num_classes)))
        est.add("deterministic", min(edges * width, max(SEGMENT_SPMM_ELEMENTS, edges)) * F32,
                "set train.deterministic = false (its SpMM gathers a slice of edge rows)", device=True)
    modelled = sum(v for k, v in est.terms.items() if k not in EXACT)
    est.add("margin", HOST_MARGIN * modelled + HOST_FLOOR, "what shrinks the other terms")
    if est.device:
        est.add("margin", DEVICE_MARGIN * sum(v for k, v in est.device.items() if k not in EXACT),
                "what shrinks the other terms", device=True)
    if dev == "cuda":
        est.add("cuda_libraries", CUDA_LIBRARIES if libraries is None else libraries,
                "nothing (the CUDA math libraries' workspaces)", device=True)
        est.add("cuda_context", CUDA_CONTEXT, "nothing (the CUDA context and torch's kernels)", device=True)
    return est


def estimate_device_memory(cfg, meta, part_id: int, shapes: dict | None = None, device: str | None = None,
                           store_available: int | None = None, libraries: int | None = None) -> MemoryEstimate:
    """Rank ``part_id``'s device terms (:func:`estimate_rank_memory`'s ``device``) as a
    :class:`MemoryEstimate` of their own (``terms``: the device's)."""
    est = estimate_rank_memory(cfg, meta, part_id, 0, shapes, device, store_available, libraries)
    return MemoryEstimate(part_id, dict(est.device), est.shrink, {}, est.params,
                          phases=dict(est.phases) if (device or device_type(cfg)) == "cuda" else {})


def host_device_peak(cfg, meta, s: dict, est: MemoryEstimate, ranks: int, device: str) -> tuple[int, int]:
    """``(host, device)`` peak bytes of ``est`` (made for ``device``): the host terms' sum, and
    the device terms' on CUDA (0 on the CPU, where the device is host memory)."""
    return est.total, (int(sum(est.device.values())) if device == "cuda" else 0)


def describe(est: MemoryEstimate) -> str:
    """One line: total and terms (GiB)."""
    terms = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in est.terms.items() if v)
    return f"rank {est.part_id}: {est.total / 2**30:.2f} GiB ({terms})"


def store_auto_bytes(cfg, meta, part_id: int, free: int, shapes: dict | None = None,
                     libraries: int | None = None) -> int:
    """Device bytes ``store.device_memory = 'auto'`` gives the store on rank ``part_id``:
    ``free`` minus every other device term (the estimate with an empty store), at least 0."""
    est = estimate_device_memory(cfg, meta, part_id, shapes, "cuda", store_available=0, libraries=libraries)
    return max(int(free) - est.total, 0)
