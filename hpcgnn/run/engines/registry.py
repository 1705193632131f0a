"""The training engines ``train.engine`` may name, and where each one's parts live.

An engine is described by an :class:`EngineSpec`: its config section (keys validated by the
engine's own :class:`~hpcgnn.run.config.Key` table and cross-key check), the factory that builds
its :class:`~hpcgnn.engine.loop.Engine` for the shared training loop, and the function that
adds its terms to the memory estimate. Specs live in torch-free modules
``hpcgnn.run.engines.<name>`` (reading a config, e.g. ``hpcgnn inspect --config``, imports no
torch), beside the config schema that reads them; the engine modules (:mod:`hpcgnn.engine`, a
higher layer) are named by ``"module:function"`` strings and imported only when a run starts.

Adding an engine: a spec module with ``SPEC``, its name in :data:`ENGINE_NAMES`, a step
factory ``make_engine(cfg, rt, out, hooks)`` and a memory-terms function.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

ENGINE_NAMES = ("minibatch", "fullgraph", "tensor")


@dataclass(frozen=True)
class EngineSpec:
    """One engine.

    name            the value of ``train.engine``
    summary         one line for help and docs
    section         its config section (``[name]``); several engines may share none
    keys            section key -> :class:`~hpcgnn.run.config.Key`
    factory         ``"module:function"``: ``function(cfg, rt, out, hooks) ->``
                    :class:`~hpcgnn.engine.loop.Engine` (collective)
    memory_terms    ``"module:function"``: ``function(cfg, meta, shapes, est, device,
                    store_available)`` adds the engine's coarse named byte terms (host and
                    device, on ``device``) to a :class:`~hpcgnn.engine.estimate.MemoryEstimate`
    validate        ``validate(cfg, label)`` raises InputError on a bad combination of keys
                    (called for the configured engine only)
    safe_on_resume  dotted keys of the section that ``--resume`` may change
    """

    name: str
    summary: str
    section: str
    keys: Mapping = field(default_factory=dict)
    factory: str = ""
    memory_terms: str = ""
    validate: Callable | None = None
    safe_on_resume: tuple = ()


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine ``name`` (KeyError for an unknown one; config validation names the
    choices first)."""
    if name not in ENGINE_NAMES:
        raise KeyError(name)
    return importlib.import_module(f"hpcgnn.run.engines.{name}").SPEC


def engine_specs() -> list[EngineSpec]:
    """Every registered engine's spec, in :data:`ENGINE_NAMES` order."""
    return [engine_spec(n) for n in ENGINE_NAMES]


def resolve(target: str):
    """The object named by ``"module:attribute"``."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
