"""Training configuration: TOML file + ``--set key=value`` overrides, every key validated.

The schema is :data:`SCHEMA`: section -> key -> :class:`Key`. Unknown sections
or keys, wrong types and out-of-range values raise InputError naming the file
and the dotted key. The resolved configuration is a plain nested dict (written
verbatim into the run file) wrapped in :class:`Config` for attribute access:
``cfg.train.lr``.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcgnn.errors import InputError


@dataclass(frozen=True)
class Key:
    """One configuration key: type, default, validity check and help."""

    type: type | tuple
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None
    expect: str = ""          # what `check` requires, for the error message
    choices: tuple = ()


def _pos(x) -> bool:
    return x > 0


def _nonneg(x) -> bool:
    return x >= 0


def _fanouts(x) -> bool:
    return len(x) >= 1 and all(isinstance(v, int) and (v == -1 or v > 0) for v in x)


SCHEMA: dict[str, dict[str, Key]] = {
    "data": {
        "partitions": Key(str, "", "partition directory written by `hpcgnn partition`"),
        "verify": Key(bool, True, "re-hash this rank's partition file at start-up"),
    },
    "model": {
        "arch": Key(str, "sage", "GNN architecture", choices=("sage", "gat", "gcn")),
        "hidden": Key(int, 256, "hidden width (per head for GAT)", _pos, "> 0"),
        "layers": Key(int, 3, "number of GNN layers", _pos, "> 0"),
        "heads": Key(int, 4, "attention heads (GAT)", _pos, "> 0"),
        "dropout": Key(float, 0.5, "dropout probability", lambda x: 0 <= x < 1, "in [0, 1)"),
        "gat_variant": Key(str, "distgnn", "GAT form: 'distgnn' (projection+bias+ReLU before "
                           "attention, DistGNN-MB eq. 2) or 'standard'", choices=("distgnn", "standard")),
    },
    "train": {
        "engine": Key(str, "minibatch", "training engine", choices=("minibatch", "fullgraph")),
        "epochs": Key(int, 10, "training epochs", _pos, "> 0"),
        "lr": Key(float, 0.006, "Adam learning rate", _pos, "> 0"),
        "weight_decay": Key(float, 0.0, "Adam weight decay", _nonneg, ">= 0"),
        "seed": Key(int, 0, "seed for initialisation, sampling and data order", _nonneg, ">= 0"),
        "grad_reduce": Key(str, "mean", "gradient allreduce: mean or sum over ranks",
                           choices=("mean", "sum")),
        "eval_every": Key(int, 1, "evaluate every N epochs (0 = only at the end)", _nonneg, ">= 0"),
        "checkpoint_every": Key(int, 0, "checkpoint every N epochs (0 = only at the end)",
                                _nonneg, ">= 0"),
        "device": Key(str, "cpu", "compute device: cpu, cuda, or auto", choices=("cpu", "cuda", "auto")),
        "debug_record": Key(bool, False, "tests: write per-step losses, parameter checksums, AEP "
                            "pushes/receives and layer inputs to RUN/debug/rank-*.h5"),
        "debug_kill": Key(list, [], "tests: [rank, epoch, step] makes that rank SIGKILL itself "
                          "before that step (failure handling)",
                          lambda x: len(x) == 0 or (len(x) == 3 and all(
                              isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)),
                          "[] or [rank, epoch, step] (integers >= 0)"),
    },
    "minibatch": {
        "batch_size": Key(int, 1000, "seed vertices per rank per iteration", _pos, "> 0"),
        "fanouts": Key(list, [5, 10, 15], "neighbours sampled per layer, input side first; -1 = all",
                       _fanouts, "a list of positive integers or -1"),
        "eval": Key(str, "full", "evaluation: 'full' (layer-wise, all neighbours) or 'sampled'",
                    choices=("full", "sampled")),
        "eval_rows": Key(int, 0, "full evaluation: destination rows per chunk (0 = as many as keep "
                         "one chunk's temporaries within 256 MiB)", _nonneg, ">= 0"),
        "eval_halo_rounds": Key(int, 0, "full evaluation: halo exchanges per layer, each with a part of "
                                "the halo rows (0 = as many as keep one round within 256 MiB)",
                                _nonneg, ">= 0"),
        "halo": Key(str, "hec", "halo neighbours: 'hec' (historical embeddings + AEP), 'off' "
                    "(dropped), 'exact' (fetched synchronously each minibatch)",
                    choices=("hec", "off", "exact")),
        "delay": Key(int, 1, "AEP delay d in iterations", _pos, ">= 1"),
        "nc": Key(int, 2000, "AEP: most vertices pushed per destination per layer per iteration",
                  _pos, "> 0"),
        "cs": Key(int, 1_000_000, "HEC lines per layer", _pos, "> 0"),
        "ls": Key(int, 2, "HEC life span in receive steps (layers > 0)", _nonneg, ">= 0"),
        "reset_cache_each_epoch": Key(bool, True, "clear the HECs at the start of every epoch"),
    },
    "fullgraph": {
        "offload": Key(bool, False, "keep layer data in host memory and stream chunks (HongTu)"),
        "chunks": Key(int, 1, "chunks per partition when offloading", _pos, "> 0"),
        "batch_chunks": Key(int, 1, "chunks scheduled together (deduplication scope)", _pos, "> 0"),
        "dedup": Key(bool, True, "deduplicate host-to-device transfers"),
        "order": Key(str, "cost", "chunk order: 'cost' (HongTu cost model) or 'natural'",
                     choices=("cost", "natural")),
        "recompute": Key(str, "auto", "backward: 'recompute' from a checkpoint, 'cache' the "
                         "aggregation, or 'auto' (recompute GAT, cache GCN/SAGE)",
                         choices=("auto", "recompute", "cache")),
    },
    "output": {
        "dir": Key(str, "runs/default", "run directory (HDF5 run file, checkpoints)"),
        "keep_checkpoints": Key(int, 2, "checkpoints kept on disk", _pos, "> 0"),
    },
    "runtime": {
        "threads": Key(int, 0, "torch/OpenMP threads per rank (0 = cores per node / ranks per node)",
                       _nonneg, ">= 0"),
        "backend": Key(str, "mpi4py", "collectives: mpi4py, or a torch.distributed backend",
                       choices=("mpi4py", "auto", "gloo", "nccl", "ccl")),
        "memory_check": Key(bool, True, "refuse to start when the ranks of a node are estimated to "
                            "need more memory than it offers"),
        "memory_limit": Key(str, "", "memory the ranks of one node may use, e.g. '64GiB' "
                            "('' = detect: MemAvailable, cgroup limit, SLURM --mem)"),
    },
}


class Config:
    """Attribute view of a resolved configuration: ``cfg.section.key``."""

    def __init__(self, data: dict):
        self._data = data
        for section, values in data.items():
            setattr(self, section, _Section(values))

    def to_dict(self) -> dict:
        return json.loads(json.dumps(self._data))

    def to_json(self) -> str:
        return json.dumps(self._data, sort_keys=True)


class _Section:
    def __init__(self, values: dict):
        self.__dict__.update(values)

    def __repr__(self):
        return repr(self.__dict__)


def _coerce(where: str, key: Key, value):
    if key.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok_type = isinstance(value, key.type) and not (key.type is int and isinstance(value, bool))
    if not ok_type:
        raise InputError(f"{where} = {value!r} has type {type(value).__name__}, "
                         f"expected {getattr(key.type, '__name__', key.type)}")
    if key.choices and value not in key.choices:
        raise InputError(f"{where} = {value!r}, expected one of {', '.join(map(repr, key.choices))}")
    if key.check is not None and not key.check(value):
        raise InputError(f"{where} = {value!r}, expected {key.expect}")
    return value


def _parse_override(text: str):
    """Parse ``key=value``; the value is TOML (bare words are strings)."""
    if "=" not in text:
        raise InputError(f"--set {text!r}: expected section.key=value")
    name, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return name.strip(), value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML config (or none), apply overrides, validate every key, fill defaults."""
    raw: dict = {}
    label = str(path) if path else "config"
    if path:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"{p}: config file not found")
        try:
            raw = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{p}: not valid TOML ({exc})") from None
    for text in overrides:
        name, value = _parse_override(text)
        if name.count(".") != 1:
            raise InputError(f"--set {name}: expected section.key")
        section, key = name.split(".")
        raw.setdefault(section, {})[key] = value
    resolved: dict = {}
    for section, values in raw.items():
        if section not in SCHEMA:
            raise InputError(f"{label}: unknown section [{section}], expected one of "
                             f"{', '.join(SCHEMA)}")
        if not isinstance(values, dict):
            raise InputError(f"{label}: '{section}' must be a table")
        for key in values:
            if key not in SCHEMA[section]:
                raise InputError(f"{label}: unknown key {section}.{key}; known keys: "
                                 f"{', '.join(SCHEMA[section])}")
    for section, keys in SCHEMA.items():
        resolved[section] = {}
        for key, spec in keys.items():
            value = raw.get(section, {}).get(key, spec.default)
            resolved[section][key] = _coerce(f"{label}: {section}.{key}", spec, value)
    if not resolved["data"]["partitions"]:
        raise InputError(f"{label}: data.partitions is not set (a partition directory; "
                         "use --set data.partitions=DIR)")
    return Config(resolved)
