"""The training loop every engine shares: epochs, evaluation cadence, checkpoints, timing, memory
telemetry, run output and resume. An engine supplies an :class:`Engine`.

Per epoch ``e`` (1-based; a resumed run starts after its checkpoint's epoch):

1. ``engine.timer.reset()``, torch's RNG seeded from ``(seed, e, rank)``, the model in training
   mode; ``engine.train_epoch(e)`` runs the epoch's iterations and returns an :class:`EpochResult`
   (global mean loss, counters, extra timings, per-layer arrays). It runs in the timer's
   ``epoch`` phase, so every phase the engine opens is nested in ``epoch`` (its parent).
2. When due (``train.eval_every``, and always after the last epoch) ``engine.evaluate()`` in the
   ``eval`` phase (collective; global train/val/test accuracy); otherwise the accuracies are NaN.
3. One row per rank into the run file: metrics, the timer's phases plus the engine's timings,
   with every timing's parent (``timing_parents``: ``""`` for ``epoch`` and ``eval``, the
   timer's record for its phases, :attr:`EpochResult.timing_parents` for the engine's),
   counters with the epoch's memory peaks (``peak_rss_bytes`` ...).
4. ``hooks.after_epoch`` (test instrumentation), then a checkpoint when due
   (``train.checkpoint_every``, and after the last epoch) with ``engine.checkpoint_extra()``,
   refused (:func:`require_finite_state`) when a parameter or optimizer state is not finite.

A non-finite loss or gradient stops the run inside ``train_epoch``, before that step's update
(:class:`~hpcgnn.comm.allreduce.GradientAllreduce` raises TrainingDiverged on every rank).

A stop signal (``train.stop_signals``, :class:`~hpcgnn.run.stop.StopRequest`) is agreed on
before the first epoch, after each epoch's training and after each evaluation. Once one is, the
epoch in progress ends without its evaluation (the last epoch keeps it: that run finishes),
is logged and checkpointed whether or not a checkpoint is due, and :func:`fit` returns the
reason; a stop before the first epoch of the job returns before any training.

After the last epoch (or a stop) ``engine.close()`` releases the engine's communicators.

What rank 0 prints (a heartbeat while an epoch runs long, the epoch's line once it is logged) is
the ``console``'s (:class:`~hpcgnn.run.console.RunConsole`; None: nothing).
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from hpcgnn.nn.optim import Adam
from hpcgnn.run.checkpoint import restore_training_state, save_training_state
from hpcgnn.run.timer import PhaseTimer
from hpcgnn.seeding import seed_torch

SPLITS = ("train", "val", "test")


@dataclass
class EpochResult:
    """What one training epoch reports: ``loss`` (global mean over ranks), ``counters`` (per-rank
    numbers, e.g. bytes), ``timings`` (seconds, beyond the timer's phases), ``per_layer`` (name ->
    array with one value per layer), ``timing_parents`` (required for every name in ``timings``:
    the timing whose seconds include it, ``"epoch"`` for a top-level part of the epoch,
    ``"a+b"`` for a part of ``a`` and ``b`` together; see :mod:`hpcgnn.run.runfile`)."""

    loss: float
    counters: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    per_layer: dict = field(default_factory=dict)
    timing_parents: dict = field(default_factory=dict)


class Engine(ABC):
    """One engine on one rank (built collectively by the engine's
    ``make_engine(cfg, rt, out, hooks)``, see :mod:`hpcgnn.run.engines.registry`).

    Attributes the loop uses: ``model``, ``optimizer`` (parameters identical on every rank),
    ``timer`` (a :class:`~hpcgnn.run.timer.PhaseTimer` on the engine's device).
    """

    model: torch.nn.Module
    optimizer: Adam
    timer: PhaseTimer

    @abstractmethod
    def train_epoch(self, epoch: int) -> EpochResult:
        """Collective: one epoch of training (iterations, gradient allreduce, optimizer steps)."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Collective: ``{train,val,test}_acc`` over the whole graph."""

    def finish_epoch(self, result: EpochResult) -> None:
        """Called after the epoch's evaluation (when it had one), before it is logged: add what
        covers both (e.g. bytes moved by training and evaluation) to ``result``."""

    def checkpoint_extra(self, epoch: int) -> dict:
        """Engine state saved with the checkpoint after ``epoch`` (beyond model, optimizer, RNG)."""
        return {}

    def restore_extra(self, extra: dict) -> None:
        """Called on resume with the checkpoint's :meth:`checkpoint_extra`."""

    def close(self) -> None:
        """Collective: release communicators and other resources after the last epoch."""


def due(epoch: int, every: int, last: int) -> bool:
    """Whether an every-``every``-epochs action (0 = only at the end) runs after ``epoch``."""
    return epoch == last or (every > 0 and epoch % every == 0)


def require_finite_state(engine: Engine, rt, epoch: int) -> None:
    """Collective: raise TrainingDiverged on every rank when a parameter or an optimizer state
    tensor of any rank is nan or +-inf (a finite gradient times a huge learning rate can
    overflow), so that no checkpoint holds one. Run before each checkpoint only."""
    from hpcgnn.errors import TrainingDiverged

    tensors = list(engine.model.parameters()) + [
        t for state in engine.optimizer.state.values() for t in state.values()
        if isinstance(t, torch.Tensor) and t.is_floating_point()]
    ok = all(bool(torch.isfinite(t).all()) for t in tensors)
    if rt.size > 1:
        ok = all(rt.comm.allgather(ok))
    if not ok:
        raise TrainingDiverged(f"training diverged at epoch {epoch}: a parameter or optimizer state is not "
                               "finite after the optimizer step; no checkpoint was written for it (lower "
                               "train.lr, check the input features)")


def epoch_timings(timer: PhaseTimer, result: EpochResult) -> tuple[dict, dict]:
    """(seconds, parent) per timing of the epoch: the timer's phases in the order they first
    started (top level: parent ``""``), then the engine's ``result.timings`` with their declared
    parents; ValueError naming an engine timing without one."""
    missing = sorted(set(result.timings) - set(result.timing_parents))
    if missing:
        raise ValueError(f"engine timings without a parent in EpochResult.timing_parents: {missing}")
    names = [k for k in timer.parents if k in timer.seconds]
    timings = {k: timer.seconds[k] for k in names}
    parents = {k: timer.parents[k] or "" for k in names}
    timings.update(result.timings)
    parents.update({k: str(result.timing_parents[k]) for k in result.timings})
    return timings, parents


@dataclass(frozen=True)
class Stopped:
    """How :func:`fit` ended early: ``reason`` (the agreed signals, e.g. ``SIGUSR1 on every
    rank``) and ``epoch``, the last epoch trained and checkpointed (that of the resumed
    checkpoint, or 0, when the stop came before the job's first epoch)."""

    reason: str
    epoch: int


def fit(engine: Engine, cfg, rt, out, hooks=None, stop=None, console=None) -> Stopped | None:
    """Collective: train ``cfg.train.epochs`` epochs with ``engine`` (see the module docstring).
    ``stop``: the rank's :class:`~hpcgnn.run.stop.StopRequest` (None: no stop signals);
    ``console``: a :class:`~hpcgnn.run.console.RunConsole` (None: print nothing). Returns
    None when every epoch ran, else :class:`Stopped`."""
    from hpcgnn.engine.hooks import TrainHooks

    hooks = hooks or TrainHooks()
    start, extra = restore_training_state(out, engine.model, engine.optimizer)
    if start > 1:
        engine.restore_extra(extra)
    if console is not None:
        console.resumed(out.history)
    epochs = cfg.train.epochs

    def stop_reason():          # collective; the same answer on every rank
        return stop.agreed(rt) if stop is not None else None

    reason = stop_reason()
    stopped = Stopped(reason, start - 1) if reason is not None else None
    timer = engine.timer
    for epoch in range(start, epochs + 1) if stopped is None else ():
        timer.reset()
        seed_torch(cfg.train.seed, epoch, rt.rank)
        engine.model.train()
        last = epoch == epochs
        with console.epoch_running(epoch) if console is not None else contextlib.nullcontext():
            with timer.phase("epoch"):
                result = engine.train_epoch(epoch)
            metrics = {"loss": float(result.loss)}
            reason = stop_reason()
            if due(epoch, cfg.train.eval_every, epochs) and (reason is None or last):
                with timer.phase("eval"):
                    engine.model.eval()
                    try:
                        metrics.update(engine.evaluate())
                    finally:
                        engine.model.train()
                reason = reason or stop_reason()
            else:
                metrics.update({f"{s}_acc": float("nan") for s in SPLITS})
            engine.finish_epoch(result)
        timings, parents = epoch_timings(timer, result)
        mem_counters, mem_labels = timer.memory_record()
        row = out.log_epoch(epoch, metrics, timings, {**result.counters, **mem_counters}, result.per_layer,
                            labels=mem_labels, timing_parents=parents)
        if console is not None:
            console.epoch(row)
        hooks.after_epoch(epoch, engine)
        stopping = reason is not None and not last
        if due(epoch, cfg.train.checkpoint_every, epochs) or stopping:
            require_finite_state(engine, rt, epoch)
            save_training_state(out, epoch, engine.model, engine.optimizer, engine.checkpoint_extra(epoch))
        if stopping:
            stopped = Stopped(reason, epoch)
            break
    engine.close()
    return stopped
