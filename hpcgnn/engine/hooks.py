"""Observers of training, kept out of the engines' hot paths.

:class:`TrainHooks` does nothing; the engines call it at a few points (before and after each
iteration, with each layer's input when :attr:`TrainHooks.wants_layer_inputs`, after each epoch).
:func:`make_hooks` gives a run its hooks: the no-op ones, or those of a Python file outside the
package that ``HPCGNN_TRAIN_HOOKS`` names (the seam through which the test suite installs its
instrumentation, tests/debug_hooks.py).
"""
from __future__ import annotations

import os

import numpy as np

from hpcgnn.errors import InputError

HOOKS_VAR = "HPCGNN_TRAIN_HOOKS"


class TrainHooks:
    """No-op observer. ``wants_layer_inputs`` / ``wants_exchanges``: whether the engine should
    call :meth:`layer_input` and keep a record of its embedding pushes (costly; tests only)."""

    wants_layer_inputs = False
    wants_exchanges = False

    def before_step(self, epoch: int, step: int) -> None:
        """Before iteration ``step`` (0-based) of ``epoch``."""

    def after_step(self, epoch: int, step: int, loss: float, seeds: int, model) -> None:
        """After the optimizer step of iteration ``step``: its local loss (NaN when the rank had
        no seeds) and seed count."""

    def layer_input(self, engine, epoch: int, step: int, layer: int, frontier: np.ndarray, h) -> None:
        """Layer ``layer``'s input rows ``h`` of the local vertices ``frontier`` (as the model sees
        them, after any cache replacement)."""

    def after_epoch(self, epoch: int, engine) -> None:
        """After the epoch has been logged (before its checkpoint)."""


def make_hooks(cfg, rt, out) -> TrainHooks:
    """The hooks of a training run. Where the environment variable ``HPCGNN_TRAIN_HOOKS`` names a
    Python file, that file is loaded (once per call) and its ``make_hooks(cfg, rt, out)`` gives the
    hooks, a :class:`TrainHooks`; else the no-op :class:`TrainHooks`. A file that is missing, or
    that defines no such function or returns something else, is an InputError naming the variable
    and the file."""
    path = os.environ.get(HOOKS_VAR, "")
    if not path:
        return TrainHooks()
    import importlib.util

    expected = "expected a Python file whose make_hooks(cfg, rt, out) returns a TrainHooks"
    if not os.path.isfile(path):
        raise InputError(f"{HOOKS_VAR}={path}: no such file; {expected}")
    spec = importlib.util.spec_from_file_location("hpcgnn_train_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    factory = getattr(module, "make_hooks", None)
    hooks = factory(cfg, rt, out) if callable(factory) else None
    if not isinstance(hooks, TrainHooks):
        raise InputError(f"{HOOKS_VAR}={path}: {expected}")
    return hooks
