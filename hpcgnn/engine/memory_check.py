"""The memory checks of ``hpcgnn train``: the coarse estimate's pre-run refusal and the
measured first step's stop (terms: :mod:`hpcgnn.engine.estimate`).

**Before the run**, :func:`check_memory` (host, per node) and :func:`check_device_memory` (per
device) refuse, in one line naming the largest term, the setting that shrinks it and the opt-out
(``runtime.memory_check = false``), only what is **clearly** over the limit: when the
estimate's floor (:meth:`~hpcgnn.engine.estimate.MemoryEstimate.floor`: the measured and exactly
counted terms plus the modelled ones over :data:`~hpcgnn.engine.estimate.CLEAR_FACTOR`, no
margin) exceeds it. Nothing has been read but the partitions' sizes then, and no run file exists.

**The measured first step**: :class:`FirstStepCheck` wraps the run's
:class:`~hpcgnn.engine.hooks.TrainHooks`. Around the first training step this job runs (every
engine calls ``before_step`` / ``after_step`` on every rank; the full-graph and tensor engines'
step is the epoch's training, the minibatch engine's one batch) it reads, on every rank:

* host: the resident set before the step (``before``) and the high-water mark after it
  (``peak``, :func:`hpcgnn.run.memory.peak_rss_bytes`);
* device: ``torch.cuda.memory_allocated`` before and ``max_memory_allocated`` after on CUDA, on
  the CPU the rank's :class:`~hpcgnn.run.memory.DeviceMemoryMeter` (what it holds, its peak).

Projection rule (bytes): ``projected = before + (peak - before) x (1 + spread) + pending``,
``spread`` = :data:`STEP_SPREAD` for the minibatch engine (later batches draw other frontiers)
and 0 for engines whose step is the epoch's whole training; ``pending`` = what the step did not
exercise, from the coarse terms: the evaluation's excess over the step (``eval`` over
``activations``) and the HEC rows the epoch may still write (``hec``). When the ranks of a node
project more host memory than the node's limit (the pre-run check's), or the ranks of a device
more than its limit, every rank raises the same one-line InputError (exit 2): the epoch's row,
its checkpoint and its evaluation are never written, and the run file says ``failed`` with that
line. ``runtime.memory_check = false`` skips the check.
"""
from __future__ import annotations

import socket

from hpcgnn.engine.estimate import CUDA_CONTEXT, MemoryEstimate, device_type, estimate_device_memory, \
    estimate_rank_memory, store_auto_bytes
from hpcgnn.engine.hooks import TrainHooks
from hpcgnn.errors import InputError

STEP_SPREAD = {"minibatch": 0.5}


class FirstStepCheck(TrainHooks):
    """The hooks ``inner`` plus the first step's memory check (see the module). ``host`` /
    ``device``: the pre-run estimates with their limits (:func:`check_memory`,
    :func:`check_device_memory`; ``device`` None: no device limit). Every hook and attribute
    of ``inner`` is passed through. :meth:`attach` gives it the engine's meter before the
    first step."""

    def __init__(self, inner: TrainHooks, cfg, rt, host, device=None):
        self.inner, self.cfg, self.rt, self.host, self.dev = inner, cfg, rt, host, device
        self.meter = None
        self.before: tuple | None = None
        self.done = not cfg.runtime.memory_check or host is None or host.limit is None

    def __getattr__(self, name):       # anything else the inner hooks have (their own state)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def wants_layer_inputs(self):
        return self.inner.wants_layer_inputs

    @property
    def wants_exchanges(self):
        return self.inner.wants_exchanges

    def attach(self, engine) -> None:
        self.meter = engine.timer.memory

    def _device_now(self) -> int:
        if self.meter.cuda:
            import torch

            return int(torch.cuda.memory_allocated(self.meter.device))
        return int(self.meter.current)

    def before_step(self, epoch: int, step: int) -> None:
        self.inner.before_step(epoch, step)
        if not self.done and self.before is None and self.meter is not None:
            from hpcgnn.run.memory import rss_bytes

            self.before = (rss_bytes(), self._device_now())

    def after_step(self, epoch: int, step: int, loss: float, seeds: int, model) -> None:
        self.inner.after_step(epoch, step, loss, seeds, model)
        if not self.done and self.before is not None:
            self.done = True
            self.check()

    def layer_input(self, engine, epoch: int, step: int, layer: int, frontier, h) -> None:
        self.inner.layer_input(engine, epoch, step, layer, frontier, h)

    def after_epoch(self, epoch: int, engine) -> None:
        self.inner.after_epoch(epoch, engine)

    @staticmethod
    def project(before: int, peak: int, spread: float, pending: int) -> int:
        """The epoch's projected peak from the first step's (the module's rule)."""
        return int(before + max(peak - before, 0) * (1.0 + spread) + max(pending, 0))

    @staticmethod
    def pending(where: dict, phases: dict) -> int:
        """Bytes the first step did not exercise: evaluation beyond the step, the HEC rows."""
        return int(max(phases.get("eval", 0) - phases.get("activations", 0), 0) + where.get("hec", 0))

    def check(self) -> None:
        """Collective: measure, project and stop every rank when a node or a device will not hold
        the epoch (one line, exit 2)."""
        from hpcgnn.run.memory import peak_rss_bytes

        rt, cfg, host = self.rt, self.cfg, self.host
        spread = STEP_SPREAD.get(cfg.train.engine, 0.0)
        peak = peak_rss_bytes()
        on_host = not self.meter.cuda             # the CPU: the device's phases are the host's
        proj = self.project(self.before[0], peak, spread, self.pending(host.terms, host.phases) if on_host else 0)
        dev_peak = int(self.meter.peak_bytes)
        dev_proj = self.project(self.before[1], dev_peak, spread, self.pending(self.dev.terms, self.dev.phases)) \
            if self.dev is not None else 0
        name = socket.gethostname()
        largest = host.largest()
        rows = rt.comm.allgather((name, rt.rank, proj, peak, largest, host.shrink.get(largest[0], ""),
                                  self.dev is not None and (rt.rank, dev_proj, self.dev.largest(),
                                                            self.dev.shrink.get(self.dev.largest()[0], ""),
                                                            self.dev.limit, self.dev.gpu)))
        mine = [r for r in rows if r[0] == name]
        need, error = sum(r[2] for r in mine), None
        if need > host.limit:
            worst = max(mine, key=lambda r: r[2])
            error = refusal(f"train: stopped after the first step: it measured a peak of {worst[3] >> 20} MiB on "
                            f"rank {worst[1]}, and the epoch's projected peak memory of the {len(mine)} ranks on "
                            f"{name}", need, host.limit, host.limit_source, *worst[4], worst[1], worst[5])
        dev_rows = [r[6] for r in rows if r[6]]
        worst_dev = device_overcommit(dev_rows) if dev_rows else None
        if error is None and worst_dev is not None:
            error = device_refusal(worst_dev, self.dev.limit_source,
                                   "projects a peak, from its measured first step, that")
        rt.agree(error)


def refusal(what: str, need: int, avail: int, source: str, name: str, size: int, rank: int, shrink: str) -> str:
    """The one line of a refusal: what needs how much against which limit, the largest term,
    the setting that shrinks it and the opt-out."""
    from hpcgnn.units import fmt_bytes

    return (f"{what} is {fmt_bytes(need)}, more than the {fmt_bytes(avail)} available ({source}); largest "
            f"term: {name} {fmt_bytes(size)} on rank {rank}, shrink it with {shrink or 'more nodes'} "
            "(`hpcgnn inspect STORE --config FILE` shows the estimate; runtime.memory_check = false "
            "skips this check)")


def node_limit(cfg, held: int) -> tuple[int, str]:
    """``(bytes the ranks of this node may use, source)``: ``runtime.memory_limit``, else
    :func:`hpcgnn.run.memory.node_available_bytes` with what the job's ranks hold (``held``)."""
    from hpcgnn.run.memory import node_available_bytes
    from hpcgnn.units import parse_size

    if cfg.runtime.memory_limit:
        return parse_size(cfg.runtime.memory_limit, "runtime.memory_limit"), "runtime.memory_limit"
    return node_available_bytes(held)


def check_memory(cfg, meta, rt) -> MemoryEstimate:
    """Collective: refuse (InputError on every rank) when the ranks of a node clearly need more
    host memory than the node offers them (the sum of their :meth:`MemoryEstimate.floor` over
    :func:`node_limit`); ``runtime.memory_check = false`` skips the refusal. Returns this
    rank's estimate, with ``limit`` / ``limit_source`` / ``node_ranks`` for the first step."""
    import socket

    from hpcgnn.run.memory import rss_bytes

    error, est = None, None
    try:
        est = estimate_rank_memory(cfg, meta, rt.rank, rss_bytes())
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    host = socket.gethostname()
    largest = est.largest()
    rows = rt.comm.allgather((host, rt.rank, est.floor(), rss_bytes(), largest, est.shrink.get(largest[0], "")))
    mine = [r for r in rows if r[0] == host]
    est.limit, est.limit_source = node_limit(cfg, sum(r[3] for r in mine))
    est.node_ranks = len(mine)
    need = sum(r[2] for r in mine)
    error = None
    if cfg.runtime.memory_check and need > est.limit:
        worst = max(mine, key=lambda r: r[4][1])
        error = refusal(f"the peak memory of the {len(mine)} ranks on {host} is clearly over the limit: at "
                        "least", need, est.limit, est.limit_source, *worst[4], worst[1], worst[5])
    rt.agree(error)
    return est


def device_limit(cfg, device: str, torch_device=None) -> tuple[int | None, str]:
    """``(bytes one rank may use on its device, source)``: ``runtime.device_memory_limit``, else
    on CUDA the GPU's free memory (the context already in use), else None."""
    from hpcgnn.run.memory import device_free_bytes
    from hpcgnn.units import parse_size

    if cfg.runtime.device_memory_limit:
        return parse_size(cfg.runtime.device_memory_limit, "runtime.device_memory_limit"), "runtime.device_memory_limit"
    if device == "cuda":
        got = device_free_bytes(torch_device if torch_device is not None else "cuda")
        if got is not None:
            return got[0], "the GPU's free memory"
    return None, ""


def device_overcommit(rows: list[tuple]) -> tuple | None:
    """The worst over-committed device of ``rows`` (one per rank: ``(rank, need, largest,
    shrink, limit, gpu)``; ranks naming the same ``gpu`` share it, the others stand alone):
    ``(ranks, need, limit, row of the neediest rank)``, None when every device holds its ranks."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[5] or ("rank", r[0]), []).append(r)
    worst = None
    for members in groups.values():
        need, limit = sum(r[1] for r in members), min(r[4] for r in members)
        if need > limit and (worst is None or need - limit > worst[1] - worst[2]):
            worst = ([r[0] for r in members], need, limit, max(members, key=lambda r: r[1]))
    return worst


def device_refusal(worst: tuple, source: str, what: str) -> str:
    """The one line for :func:`device_overcommit`'s ``worst`` (``what``: how the need is known)."""
    ranks, need, lim, (rank, _, (name, size), shrink, _, _) = worst
    where = source if source == "runtime.device_memory_limit" else f"{source} (rank {rank})"
    who = f"rank {rank}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} (one GPU; give each rank its own)"
    return refusal(f"train: the device memory of {who} {what}", need, lim, where, name.replace("_", " "), size,
                   rank, shrink)


def check_device_memory(cfg, meta, rt, torch_device=None) -> MemoryEstimate | None:
    """Collective: refuse (InputError, exit 2 on every rank) before the first epoch when a
    device's ranks clearly need more than it offers (the floor of their device terms over
    :func:`device_limit`; ranks on one GPU share its free memory); ``runtime.memory_check =
    false`` skips the refusal. On CUDA each rank first creates its context; with
    ``store.device_memory = 'auto'`` it states the store's share (``rt.store_device_available``).
    Returns this rank's device estimate with ``limit`` / ``limit_source`` / ``gpu`` (None
    when no limit applies)."""
    from hpcgnn.engine.device import resolve_device
    from hpcgnn.run.memory import cuda_library_bytes, device_free_bytes
    from hpcgnn.runtime import gpu_identity, shared_gpus

    error, est, limit, source, gpu, dev = None, None, None, "", "", "cpu"
    try:
        dev = device_type(cfg)
        import torch

        if dev == "cuda" and not cfg.runtime.device_memory_limit and torch.cuda.is_available():
            torch_device = torch_device if torch_device is not None else resolve_device(cfg, rt)
            device_free_bytes(torch_device)   # this rank's CUDA context, before any rank measures
            gpu = gpu_identity(torch_device)
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    sharers = shared_gpus(rt.comm.allgather(gpu)).get(gpu, 1)
    try:
        limit, source = device_limit(cfg, dev, torch_device)
        libraries = None if torch_device is None else cuda_library_bytes(torch_device)
        if limit is not None:
            measured_free = dev == "cuda" and source != "runtime.device_memory_limit"
            auto = isinstance(cfg.store.device_memory, str) and cfg.store.device_memory.strip().lower() == "auto"
            avail = None
            if dev == "cuda" and auto:        # a GPU shared by k ranks: each store gets a k-th
                room = limit // sharers + (CUDA_CONTEXT if measured_free else 0)
                avail = rt.store_device_available = store_auto_bytes(cfg, meta, rt.rank, room, libraries=libraries)
            est = estimate_device_memory(cfg, meta, rt.rank, device=dev, store_available=avail, libraries=libraries)
            if measured_free:                 # the context is already part of the used memory
                est.terms.pop("cuda_context", None)
            est.limit, est.limit_source, est.gpu = limit, source, gpu
    except InputError as exc:
        error = str(exc)
    rt.agree(error)
    if limit is None:
        return None
    largest = est.largest()
    rows = rt.comm.allgather((rt.rank, est.floor(), largest, est.shrink.get(largest[0], ""), limit, gpu))
    worst = device_overcommit(rows)
    rt.agree(device_refusal(worst, source, "is clearly over the limit: at least")
             if cfg.runtime.memory_check and worst is not None else None)
    return est


def estimate_attrs(rt, host: MemoryEstimate | None, device: MemoryEstimate | None) -> dict:
    """Collective: the run file's record of the pre-run estimates per rank (None where none was
    made): ``estimated_peak_rss_bytes``, ``estimated_peak_device_bytes`` (without the CUDA
    context, comparable with ``counters/peak_device_bytes``) and ``estimated_device_terms``."""
    dev_terms = None if device is None else {k: int(v) for k, v in device.terms.items() if k != "cuda_context"}
    rows = rt.comm.allgather((None if host is None else int(host.total),
                              None if dev_terms is None else int(sum(dev_terms.values())), dev_terms))
    return {"estimated_peak_rss_bytes": [r[0] for r in rows],
            "estimated_peak_device_bytes": [r[1] for r in rows],
            "estimated_device_terms": [r[2] for r in rows]}
