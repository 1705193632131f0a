"""What the minibatch and full-graph engines share.

* :func:`rng_key` / :func:`seed_torch` (from :mod:`hpcgnn.seeding`): every random stream is a
  function of integers such as (seed, epoch, step, rank), so a resumed run continues exactly.
* :func:`build_model_from_config` / :func:`build_optimizer`: the model (identical initial
  parameters on every rank: seeded, then broadcast from rank 0) and Adam.
* :class:`GradientAllreduce`: one flat-buffer allreduce of all parameter gradients (mean or sum).
* :func:`allreduce_sum` / :func:`accuracy_metrics`: parallel evaluation counts reduced to global
  accuracies.
* :class:`PhaseTimer`: per-phase wall-clock seconds of one epoch and the phases' nesting.
* :func:`save_training_state` / :func:`restore_training_state`: checkpoint and resume.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import time

import numpy as np
import torch

from hpcgnn.errors import InputError
from hpcgnn.run.checkpoint import load_latest_checkpoint, save_checkpoint
from hpcgnn.seeding import numpy_rng, rng_key, seed_torch  # noqa: F401  (re-exported)

SPLITS = ("train", "val", "test")


# ---- randomness: hpcgnn.seeding (re-exported for the engines) ----------------


# ---- device, model, optimizer -----------------------------------------------
def resolve_device(cfg, rt=None) -> torch.device:
    """cfg.train.device -> torch.device ('auto' = cuda if available); for CUDA one GPU per rank.

    The GPU comes from the node-local rank (``rt.local_rank`` / ``rt.local_size``, the MPI
    shared-memory communicator's) by :func:`hpcgnn.runtime.choose_cuda_device`, which honours
    ``CUDA_VISIBLE_DEVICES`` and SLURM's GPU binding, and is made the current CUDA device
    (``torch.cuda.set_device``) so that ``torch.cuda.synchronize()`` (PhaseTimer), NCCL and
    every allocation without an explicit index use it. With ``rt`` the choice is kept on
    ``rt.device`` / ``rt.device_choice`` (the run file records it per rank and epoch,
    ``labels/device``); when the ranks of rank 0's node share GPUs, rank 0 says so once.
    Not collective: an InputError here is the calling rank's.
    """
    import os

    from hpcgnn.runtime import choose_cuda_device

    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    choice = None
    if want == "cuda":
        if not torch.cuda.is_available():
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise InputError("train.device = 'cuda' but torch sees no CUDA device"
                             + (f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""))
        local_rank, local_size = (rt.local_rank, rt.local_size) if rt is not None else (0, 1)
        choice = choose_cuda_device(local_rank, local_size, torch.cuda.device_count(), os.environ)
        device = torch.device("cuda", choice.index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if rt is not None:
        rt.device, rt.device_choice = str(device), choice
        if choice is not None and choice.shared and rt.rank == 0:
            from hpcgnn.run.output import warn

            warn(f"{choice.how} (rank 0 uses {device}): give each rank its own GPU for full speed")
    return device


def build_model_from_config(cfg, in_dim: int, num_classes: int, rt=None,
                            device: torch.device | str = "cpu", **extra) -> torch.nn.Module:
    """The configured model; parameters seeded by cfg.train.seed and broadcast from rank 0.

    ``extra`` is passed to :func:`hpcgnn.nn.models.build_model` (e.g. GCN normalisation).
    """
    from hpcgnn.nn.models import build_model
    from hpcgnn.nn.precision import set_precision

    m = cfg.model
    seed_torch(cfg.train.seed, -1)
    kwargs = dict(extra)
    if m.arch == "gat":
        kwargs.setdefault("gat_variant", m.gat_variant)
    model = build_model(m.arch, in_dim, m.hidden, num_classes, m.layers, m.heads, m.dropout, **kwargs)
    model = set_precision(model, cfg.train.precision).to(device)
    if rt is not None and rt.size > 1:
        broadcast_parameters(model, rt)
    return model


def broadcast_parameters(model: torch.nn.Module, rt) -> None:
    """Overwrite every rank's parameters and buffers with rank 0's (one flat buffer)."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors]).numpy()
    rt.comm.Bcast(flat, root=0)
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(torch.from_numpy(flat[off:off + n]).view_as(t).to(t.device, t.dtype))
            off += n


def build_optimizer(cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam with cfg.train.lr and cfg.train.weight_decay."""
    return torch.optim.Adam(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def parameter_checksum(model: torch.nn.Module) -> str:
    """sha256 (hex) of all parameters' bytes in order: equal iff parameters are bitwise equal."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---- collectives ------------------------------------------------------------
class GradientAllreduce:
    """Allreduce of all parameter gradients as one flat float32 buffer, with a divergence check.

    ``op`` = 'mean' divides the sum by the number of ranks. A parameter without a gradient
    contributes zeros, and after the call every parameter has a gradient (identical on all
    ranks). Uses mpi4py, or torch.distributed when ``use_torch_distributed`` (the caller has
    initialised it). ``bytes_per_call`` is the buffer size.

    Divergence: the buffer has one more element, the caller's local ``loss`` (0 without one).
    After the allreduce every rank holds the same buffer, so one test decides identically
    everywhere (size 1 too, with no allreduce): its sum is finite iff every element is (one
    pass; only a sum that overflows is looked at element-wise). A non-finite loss or gradient
    on any rank raises :class:`~hpcgnn.errors.TrainingDiverged` on every rank, before the
    gradients are written back and before the caller's optimizer step.
    """

    def __init__(self, model: torch.nn.Module, rt, op: str = "mean", use_torch_distributed: bool = False):
        if op not in ("mean", "sum"):
            raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {op!r}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.rt = rt
        self.op = op
        self.use_torch = use_torch_distributed
        self.numel = sum(p.numel() for p in self.params)
        self._flat = torch.zeros(self.numel + 1, dtype=torch.float32)
        self._loss = self._flat[self.numel:]     # the divergence flag: this rank's loss

    @property
    def bytes_per_call(self) -> int:
        return (self.numel + 1) * 4

    def __call__(self, loss=None, epoch: int | None = None, step: int = 0, steps: int = 1) -> None:
        """Collective: reduce the gradients, then raise TrainingDiverged on every rank if any
        rank's loss or gradient is not finite. ``loss``: this rank's loss of the step (a tensor,
        copied with the gradients, no host sync of its own; a float; or None when the rank had
        none); ``epoch``, ``step`` (0-based) of ``steps`` name the step in the error."""
        flat = self._flat
        off = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                flat[off:off + n].zero_()
            else:
                flat[off:off + n].copy_(p.grad.detach().reshape(-1))
            off += n
        if isinstance(loss, torch.Tensor):
            self._loss.copy_(loss.detach())
        else:
            self._loss.fill_(0.0 if loss is None else float(loss))
        if self.rt.size > 1:
            if self.use_torch:
                import torch.distributed as dist

                dev = self.params[0].device if self.params else torch.device("cpu")
                buf = flat.to(dev)
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
                flat.copy_(buf.cpu())
            else:
                from mpi4py import MPI

                self.rt.comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            if self.op == "mean":
                flat.div_(self.rt.size)
        # a sum over finite values is finite unless it overflows: only then look element-wise
        if not math.isfinite(flat.sum().item()) and not bool(torch.isfinite(flat).all()):
            self._diverged(epoch, step, steps)
        off = 0
        for p in self.params:
            n = p.numel()
            g = flat[off:off + n].view_as(p).to(p.device, p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            off += n

    def _diverged(self, epoch, step: int, steps: int):
        """Raise TrainingDiverged; the message depends only on the reduced buffer (same on every rank)."""
        from hpcgnn.errors import TrainingDiverged

        kind = "nan" if bool(torch.isnan(self._flat).any()) else "inf"
        where = "" if epoch is None else f" at epoch {epoch}, step {step + 1} of {steps}"
        raise TrainingDiverged(f"training diverged{where}: the loss or a gradient is not finite ({kind}); "
                               "no checkpoint was written for it (lower train.lr, check the input features)")


def allreduce_sum(rt, values) -> np.ndarray:
    """Element-wise sum over ranks of a float64 vector (one Allreduce)."""
    from mpi4py import MPI

    buf = np.ascontiguousarray(values, dtype=np.float64).copy()
    if rt.size > 1:
        rt.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return buf


def allreduce_max(rt, value: int) -> int:
    """Maximum of an integer over ranks."""
    from mpi4py import MPI

    return int(rt.comm.allreduce(int(value), op=MPI.MAX)) if rt.size > 1 else int(value)


def accuracy_metrics(rt, correct: dict[str, int], total: dict[str, int]) -> dict[str, float]:
    """Collective: ``{split}_acc`` = sum of correct / sum of total over ranks (NaN if empty)."""
    names = sorted(correct)
    sums = allreduce_sum(rt, [correct[n] for n in names] + [total[n] for n in names])
    k = len(names)
    return {f"{n}_acc": (sums[i] / sums[k + i] if sums[k + i] > 0 else float("nan"))
            for i, n in enumerate(names)}


def split_counts(pred: torch.Tensor, labels: torch.Tensor, masks: dict[str, torch.Tensor]):
    """(correct, total) per split of predictions on this rank's vertices."""
    hit = pred == labels
    correct = {k: int(hit[m].sum()) for k, m in masks.items()}
    total = {k: int(m.sum()) for k, m in masks.items()}
    return correct, total


# ---- timing ----------------------------------------------------------------
class PhaseTimer:
    """Accumulated wall-clock seconds per named phase (``with timer.phase('forward'): ...``),
    and the epoch's peak memory with the phase in which it was reached (``timer.memory``, a
    :class:`~hpcgnn.run.memory.PeakMonitor` read at the end of every phase; :meth:`reset` starts
    a new epoch for both).

    Nesting is recorded, not declared: ``parents[name]`` is the phase that was open when
    ``name`` first started (a stack of open phases; None at the top level), in the order the
    phases first started. A name has one parent: opened again under another parent (another
    depth, or inside itself), its seconds go to ``"<parent>/<name>"`` (``"top/<name>"`` at the
    top level) with that parent, so no second is ever inside two phases of one name. Seconds
    measured outside :meth:`phase` are added with :meth:`add`, which needs their parent.
    ``parents`` outlives :meth:`reset` (the nesting is the code's, not the epoch's)."""

    def __init__(self, sync_cuda: bool = False, cuda_device=None):
        from hpcgnn.run.memory import PeakMonitor

        self.seconds: dict[str, float] = {}
        self.parents: dict[str, str | None] = {}
        self._open: list[str] = []
        self.sync_cuda = sync_cuda and torch.cuda.is_available()
        self.memory = PeakMonitor(cuda_device if self.sync_cuda else None)

    @contextlib.contextmanager
    def phase(self, name: str):
        parent = self._open[-1] if self._open else None
        if self.parents.setdefault(name, parent) != parent:
            name = f"{parent or 'top'}/{name}"
            self.parents.setdefault(name, parent)
        self._open.append(name)
        if self.sync_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._open.pop()
            if self.sync_cuda:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + (time.perf_counter() - t0)
            self.memory.after(name)

    def add(self, name: str, seconds: float, *, parent: str | None) -> None:
        """Add ``seconds`` to timing ``name``, measured outside :meth:`phase`; ``parent``: the
        phase whose seconds include these (None: top level; ``"a+b"``: part of ``a`` and ``b``
        together). ValueError when ``name`` already has another parent."""
        if self.parents.setdefault(name, parent) != parent:
            raise ValueError(f"timing {name!r}: parent {parent!r} declared, {self.parents[name]!r} recorded")
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    def reset(self) -> None:
        self.seconds = {}
        self.memory.start()

    def memory_record(self) -> tuple[dict, dict]:
        """(counters, labels) of the epoch's memory peaks for :meth:`RunOutput.log_epoch`."""
        res = self.memory.result()
        counters = {k: v for k, v in res.items() if k.endswith("_bytes")}
        labels = {k: v for k, v in res.items() if k.endswith("_phase")}
        return counters, labels


# ---- checkpoint / resume ----------------------------------------------------
def save_training_state(out, epoch: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        extra: dict | None = None) -> None:
    """Collective: checkpoint model, optimizer, torch RNG and ``extra`` after ``epoch`` (1-based)."""
    state = {
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "content_hash": out.meta.content_hash,
        "config": out.cfg.to_json(),
        "engine": out.engine,
        "run_id": getattr(out, "run_id", ""),
        "extra": extra or {},
    }
    save_checkpoint(out.run_dir, epoch, state, out.rt, out.cfg.output.keep_checkpoints)


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                        where, cfg) -> None:
    """Load a checkpoint's model and optimizer state; a checkpoint that does not fit (another
    model shape) is an InputError naming ``where``, the model settings and the first mismatch."""
    from hpcgnn.run.checkpoint import load_model_state

    load_model_state(model, state["model"], where, cfg)
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise InputError(f"{where}: the checkpoint's optimizer state does not fit the model "
                         f"({' '.join(str(exc).split())[:200]})") from None


def restore_training_state(out, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict]:
    """Collective: on ``--resume`` load the newest checkpoint into model and optimizer.

    Returns (first epoch to run, the checkpoint's ``extra``); (1, {}) when not resuming or when
    there is no checkpoint yet. Run-file history after the checkpoint's epoch is dropped.
    """
    if not out.resume:
        return 1, {}
    error, state = None, None
    try:
        state = load_latest_checkpoint(out.run_dir, out.meta.content_hash)
        if state is not None and state.get("engine", out.engine) != out.engine:
            error = (f"{out.run_dir}: checkpoint was written by engine {state.get('engine')!r}, "
                     f"config says {out.engine!r}")
    except InputError as exc:
        error = str(exc)
    out.rt.agree(error)
    epochs = out.rt.comm.allgather(None if state is None else int(state["epoch"]))
    if len(set(epochs)) != 1:
        out.rt.agree("ranks see different checkpoints in the run directory "
                     f"(epochs {epochs}); is it on a shared file system?")
    if state is None:
        out.rewind(0)
        return 1, {}
    out.rt.agree_on(lambda: load_training_state(model, optimizer, state, out.run_dir, out.cfg))
    torch.set_rng_state(state["torch_rng"])
    out.rewind(int(state["epoch"]))
    return int(state["epoch"]) + 1, state.get("extra", {})
