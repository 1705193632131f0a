"""Candidate settings for a plan: the user's configuration with the engine and its key settings
replaced, one variant generator per engine.

Extension point: :data:`VARIANTS` maps an engine name of :mod:`hpcgnn.run.engines.registry` to a
generator of ``(label, overrides)``; a registered engine without one is proposed once with its
defaults. Variants that exist only when an engine spec declares a key (e.g. a cached-halo mode
``fullgraph.halo = "cached"``) are proposed when the spec has that key and choice.
Every candidate is resolved with :func:`hpcgnn.run.config.load_config`, so it is a valid
configuration (a combination an engine refuses is kept, with the refusal as its reason).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hpcgnn.errors import InputError

DEFAULT_CHUNKS = (2, 4, 8, 16)


@dataclass
class Candidate:
    """One proposed setting: ``overrides`` (dotted key -> value) applied to the user's config;
    ``cfg`` the resolved configuration (None when invalid, ``invalid`` says why)."""

    label: str
    engine: str
    overrides: dict
    cfg: object = None
    invalid: str = ""
    notes: list = field(default_factory=list)
    model_change: str = ""         # non-empty: trains another model than the configured one


def _spec_has(engine: str, key: str, choice=None) -> bool:
    from hpcgnn.run.engines.registry import engine_spec

    keys = engine_spec(engine).keys
    if key not in keys:
        return False
    return choice is None or not keys[key].choices or choice in keys[key].choices


def minibatch_variants(base, chunks):
    """DistGNN-MB with the historical embedding cache, and with the exact synchronous halo."""
    yield "minibatch hec", {"minibatch.halo": "hec"}
    yield "minibatch exact", {"minibatch.halo": "exact"}


def fullgraph_variants(base, chunks):
    """Exact full-graph in memory, offloaded with k chunks, and the cached-halo and pipelined
    modes where the engine declares them (``fullgraph.halo = "cached"``, ``fullgraph.pipeline``)."""
    exact = {}
    if _spec_has("fullgraph", "halo", "exact"):
        exact["fullgraph.halo"] = "exact"
    if _spec_has("fullgraph", "pipeline"):
        exact["fullgraph.pipeline"] = False
    yield "fullgraph in-memory", {"fullgraph.offload": False, "fullgraph.chunks": 1, **exact}
    for k in chunks:
        yield f"fullgraph offload k={k}", {"fullgraph.offload": True, "fullgraph.chunks": int(k),
                                           "fullgraph.batch_chunks": 1, **exact}
    if _spec_has("fullgraph", "halo", "cached"):
        yield "fullgraph cached-halo", {"fullgraph.offload": False, "fullgraph.chunks": 1,
                                        "fullgraph.halo": "cached", "fullgraph.pipeline": False}
    if _spec_has("fullgraph", "pipeline") and _spec_has("fullgraph", "staleness"):
        yield "fullgraph pipelined-halo", {"fullgraph.offload": False, "fullgraph.chunks": 1,
                                           "fullgraph.halo": "exact", "fullgraph.pipeline": True,
                                           "fullgraph.staleness": max(int(getattr(base.fullgraph, "staleness", 1)), 1)}


def tensor_variants(base, chunks):
    """NeutronTP decoupled (a decoupled model: NN layers, then k propagation rounds) and
    coupled (the configured GCN/SAGE stack, a split and a gather around every layer)."""
    yield "tensor decoupled", {"tensor.mode": "decoupled", "tensor.chunks": 1}
    yield "tensor coupled", {"tensor.mode": "coupled", "tensor.chunks": 1, "tensor.k": 0,
                             "tensor.alpha": 0.0, "tensor.gamma": 1.0}


VARIANTS = {"minibatch": minibatch_variants, "fullgraph": fullgraph_variants, "tensor": tensor_variants}


def toml_value(v) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def _decoupled(cfg) -> bool:
    return cfg.train.engine == "tensor" and cfg.tensor.mode == "decoupled"


def _model_change(base, cfg) -> str:
    """Why ``cfg`` trains another model than ``base`` ('' when it trains the same one): the
    decoupled tensor mode (NN layers, then propagation) against a message-passing stack."""
    if cfg is None or _decoupled(cfg) == _decoupled(base):
        return ""
    if _decoupled(cfg):
        return "a decoupled model (NN layers, then propagation), not the configured stack"
    return "the configured stack instead of the config's decoupled model"


def propose(config: str | Path, overrides: list[str], store: str | Path,
            chunks=DEFAULT_CHUNKS, engines=None) -> list[Candidate]:
    """Candidates for ``config`` (+ ``--set`` ``overrides``) on ``store``: every registered
    engine's variants (``engines`` restricts them), each resolved and validated."""
    from hpcgnn.run.engines.registry import ENGINE_NAMES
    from hpcgnn.run.config import load_config

    base = load_config(config, [*overrides, f"data.partitions={store}"])
    names = list(engines) if engines else list(ENGINE_NAMES)
    for n in names:
        if n not in ENGINE_NAMES:
            raise InputError(f"--engines {n!r}: expected some of {', '.join(ENGINE_NAMES)}")
    out = []
    for name in names:
        gen = VARIANTS.get(name)
        variants = list(gen(base, chunks)) if gen else [(name, {})]
        for label, ov in variants:
            ov = {"train.engine": name, **ov}
            c = Candidate(label, name, ov)
            sets = [*overrides, f"data.partitions={store}"] + [f"{k}={toml_value(v)}" for k, v in ov.items()]
            try:
                c.cfg = load_config(config, sets)
            except InputError as exc:
                c.invalid = str(exc)
            c.model_change = _model_change(base, c.cfg)
            if gen is None:
                c.notes.append(f"no variant generator for engine {name!r} (hpcgnn/plan/proposer.py VARIANTS)")
            out.append(c)
    return out
