"""Training configuration: TOML file + ``--set key=value`` overrides, every key validated.

The schema is :func:`schema`: section -> key -> :class:`Key`, made of the core sections
(:data:`CORE_SCHEMA`: data, model, train, output, runtime) and one section per registered
engine (:mod:`hpcgnn.run.engines.registry`), each declared and cross-checked by its engine. Unknown
sections or keys, wrong types and out-of-range values raise InputError naming the file and the
dotted key. The resolved configuration is a plain nested dict (written
verbatim into the run file) wrapped in :class:`Config` for attribute access:
``cfg.train.lr``.
"""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcgnn.errors import InputError
from hpcgnn.run import stop as _stop
from hpcgnn.run.engines.registry import ENGINE_NAMES
from hpcgnn.store import budget as _store_budget


@dataclass(frozen=True)
class Key:
    """One configuration key: type, default, validity check and help.

    ``aliases``: other names the key loads under (a config file or ``--set`` may use either;
    the resolved configuration holds the key's own name only). ``engines``: the values of
    ``train.engine`` that read a core-section key (empty: every engine; an engine's own
    section is read by that engine)."""

    type: type | tuple
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None
    expect: str = ""          # what `check` requires, for the error message
    choices: tuple = ()
    aliases: tuple = ()
    engines: tuple = ()


def positive(x) -> bool:
    return x > 0


def nonneg(x) -> bool:
    return x >= 0


def _valid_size(x) -> bool:
    """A size such as '16GiB' (hpcgnn.units.parse_size)."""
    from hpcgnn.errors import InputError
    from hpcgnn.units import parse_size

    try:
        parse_size(x, "size")
        return True
    except (InputError, ValueError, TypeError):
        return False


def _threads_ok(x) -> bool:
    """runtime.threads: an int >= 0, or a non-empty list of ints >= 1 (its length is checked
    against the world size at start-up, :meth:`hpcgnn.runtime.Runtime.configured_threads`)."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(x, list):
        return len(x) > 0 and all(is_int(v) and v >= 1 for v in x)
    return is_int(x) and x >= 0


CORE_SCHEMA: dict[str, dict[str, Key]] = {
    "data": {
        "partitions": Key(str, "", "partition directory written by `hpcgnn partition`"),
        "verify": Key(bool, True, "re-hash this rank's partition file at start-up"),
    },
    "model": {
        "arch": Key(str, "sage", "GNN architecture", choices=("sage", "gat", "gcn")),
        "hidden": Key(int, 256, "hidden width (per head for GAT)", positive, "> 0"),
        "layers": Key(int, 3, "number of GNN layers", positive, "> 0"),
        "heads": Key(int, 4, "attention heads (GAT)", positive, "> 0"),
        "dropout": Key(float, 0.5, "dropout probability", lambda x: 0 <= x < 1, "in [0, 1)"),
        "gat_variant": Key(str, "distgnn", "GAT form: 'distgnn' (projection+bias+ReLU before "
                           "attention, DistGNN-MB eq. 2) or 'standard'", choices=("distgnn", "standard")),
    },
    "train": {
        "engine": Key(str, "minibatch", "training engine; its own keys are in the section of its name "
                      "(docs/choosing-an-engine.md)",
                      choices=ENGINE_NAMES),
        "epochs": Key(int, 10, "training epochs", positive, "> 0"),
        "lr": Key(float, 0.006, "Adam learning rate", lambda x: 0 < x <= 1e30, "> 0 and <= 1e30 (Adam applies it as a float32 scalar)"),
        "weight_decay": Key(float, 0.0, "Adam weight decay", lambda x: 0 <= x <= 1e30, ">= 0 and <= 1e30 (Adam applies it as a float32 scalar)"),
        "seed": Key(int, 0, "seed for initialisation, sampling and data order", nonneg, ">= 0"),
        "grad_reduce": Key(str, "mean", "minibatch gradient allreduce: mean (each rank weighted by its "
                           "samples in the step) or sum over ranks",
                           choices=("mean", "sum"), engines=("minibatch",)),
        "eval_every": Key(int, 1, "evaluate every N epochs (0 = only at the end)", nonneg, ">= 0"),
        "checkpoint_every": Key(int, 0, "checkpoint every N epochs (0 = only at the end)",
                                nonneg, ">= 0"),
        "stop_signals": Key(list, list(_stop.DEFAULT_STOP_SIGNALS), "signals that end the run after the "
                            "epoch in progress, with its checkpoint, and exit 75 so that --resume or a "
                            "requeued job continues it (a batch system's time limit, preemption or "
                            "--signal; docs/runs.md); [] = such a signal kills the rank at once",
                            _stop.valid_stop_signals,
                            f"a list of distinct signal names from {', '.join(_stop.STOP_SIGNALS)}"),
        "device": Key(str, "cpu", "compute device: cpu, cuda, or auto", choices=("cpu", "cuda", "auto")),
        "precision": Key(str, "fp32", "products of the linear layers: fp32, or bf16 (bfloat16 GEMMs with "
                         "float32 accumulation, parameters and everything else float32; opt-in, "
                         "hpcgnn.nn.precision)", choices=("fp32", "bf16")),
        "kernels": Key(str, "auto", "aggregation kernels: auto (native on the CPU, torch on CUDA), native "
                       "(the OpenMP kernels, CPU only) or torch (sparse CSR SpMM/SDDMM and segment "
                       "reductions, no per-edge rows; docs/kernels.md)", choices=("auto", "native", "torch")),
        "deterministic": Key(bool, False, "torch kernels: run the aggregation under torch's deterministic "
                             "algorithms (docs/kernels.md; the native kernels always are)"),
    },
    "output": {
        "dir": Key(str, "runs/default", "run directory (HDF5 run file, checkpoints)"),
        "keep_checkpoints": Key(int, 2, "checkpoints kept on disk", positive, "> 0"),
        "flush_seconds": Key(float, 1.0, "rewrite the run file after an epoch once its last rewrite is this "
                             "many seconds old (0 = after every epoch); always after the first and last "
                             "epoch, before each checkpoint and when a run fails",
                             lambda x: 0 <= x <= 1e9, ">= 0 and <= 1e9"),
    },
    "runtime": {
        "threads": Key((int, list), 0, "torch/OpenMP threads per rank (0 = cores per node / ranks per "
                       "node), or a list with one count per rank, e.g. [1, 2] (unequal rank speeds on one "
                       "machine, docs/rapa.md)", lambda x: _threads_ok(x),
                       "an integer >= 0 or a list of integers >= 1, one per rank"),
        "backend": Key(str, "mpi4py", "what carries the data plane (halo, AEP, fetch, gradient "
                       "allreduce ...): 'mpi4py' (host buffers, the CPU default), a torch.distributed "
                       "backend 'gloo', 'nccl' (CUDA only), 'ccl' (CPU, oneCCL bindings), or 'auto' "
                       "(nccl with CUDA and one rank per GPU, else ccl when it imports, else mpi4py); "
                       "MPI stays the launcher",
                       choices=("mpi4py", "auto", "gloo", "nccl", "ccl")),
        "host_memory": Key(str, "release", "what freed host memory does: 'release' (glibc's "
                           "default: large blocks go back to the system) or 'retain' (kept for "
                           "reuse: fewer page faults, more peak memory)", choices=("release", "retain")),
        "memory_check": Key(bool, True, "refuse to start what is clearly over the memory a node or device "
                            "offers, and stop after the first step what its measured peak projects over it"),
        "memory_limit": Key(str, "", "memory the ranks of one node may use, e.g. '64GiB' "
                            "('' = detect: MemAvailable, cgroup limit, SLURM --mem)"),
        "device_memory_limit": Key(str, "", "device memory one rank may use, e.g. '16GiB' ('' = detect: "
                                   "the GPU's free memory on CUDA, no limit on the CPU; a size on the CPU "
                                   "applies to the tensors the engine places on its device)",
                                   lambda x: x == "" or _valid_size(x), "'' or a size such as '16GiB'"),
    },
    "store": {   # the in-memory vertex data store (feature/graph store) of every engine (docs/store.md)
        "device_memory": Key((str, int, float), "auto", _store_budget.HELP,
                             _store_budget.valid_device_memory,
                             "'auto', a fraction in [0, 1] or a size such as '6GiB'"),
        "hotness": Key(str, "degree", "row ranking of the minibatch engine: 'degree' (in-degree) or "
                       "'presample' (access frequency of pre-sampled minibatches); the full-pass engines "
                       "(fullgraph, tensor) read every row every pass and always place by degree",
                       choices=("degree", "presample"), engines=("minibatch",)),
        "presample": Key(int, 16, "minibatches per pre-sampling pass of the minibatch engine (the "
                         "solver runs two: ranking and hit-rate prediction)", positive, "> 0",
                         engines=("minibatch",)),
        "overlap": Key(bool, True, "minibatch engine: read the next minibatch's rows on a gather "
                       "thread (GPU: pinned staging and a side-stream copy) and sample the one after it "
                       "there (the loader) while the current one computes (from 4 threads a rank)",
                       engines=("minibatch",)),
        "features": Key(str, "memory", "how a rank holds its partition's feature rows: 'memory' reads "
                        "them into its heap; 'mmap' maps them from the partition file (read-only), so its "
                        "resident memory holds the rows it touches and the OS page cache serves the rest",
                        choices=("memory", "mmap"), engines=("minibatch", "fullgraph")),
    },
}


CORE_SECTION_HELP = {
    "data": "the partition store a run trains on",
    "model": "the GNN: architecture, widths, depth",
    "train": "the training loop: engine, epochs, optimizer, device, checkpoints",
    "output": "the run directory: run file and checkpoints",
    "runtime": "processes: threads, the data plane's backend, memory limits",
    "store": "the vertex data store: features and topology over device and host memory",
}


def section_help(section: str) -> str:
    """One line on what ``section`` configures (an engine's section: its engine's summary)."""
    from hpcgnn.run.engines.registry import engine_specs

    for spec in engine_specs():
        if spec.section == section:
            return f"read when train.engine = \"{spec.name}\": {spec.summary}"
    return CORE_SECTION_HELP[section]


def schema() -> dict[str, dict[str, Key]]:
    """Every section: the core ones, then each registered engine's."""
    from hpcgnn.run.engines.registry import engine_specs

    out = dict(CORE_SCHEMA)
    for spec in engine_specs():
        if spec.section:
            out[spec.section] = dict(spec.keys)
    return out


def alias_names(keys: dict[str, Key]) -> dict[str, str]:
    """Alias -> key name of one section's keys."""
    return {alias: name for name, spec in keys.items() for alias in spec.aliases}


def canonical_names(stored: dict) -> dict:
    """A copy of a stored configuration (a run file's or a checkpoint's ``config``, section ->
    key -> value) with every alias renamed to its key's name: a run file written before a key
    was renamed reads as one written after."""
    sections = schema()
    out = {}
    for section, values in (stored or {}).items():
        names = alias_names(sections.get(section, {})) if isinstance(values, dict) else {}
        out[section] = ({names.get(k, k): v for k, v in values.items()} if isinstance(values, dict)
                        else values)
    return out


def key_engines(section: str, key: Key) -> tuple[str, ...]:
    """The values of ``train.engine`` that read ``section``'s ``key``: an engine's own section
    is read by that engine; a core key by those in ``key.engines``, or by every engine."""
    from hpcgnn.run.engines.registry import engine_specs

    owners = tuple(spec.name for spec in engine_specs() if spec.section == section)
    return owners or key.engines or ENGINE_NAMES


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


def _finite(value) -> bool:
    """False for a float (or a list holding one) that is nan or +-inf: TOML parses ``inf`` and
    ``nan`` as floats, and no key has a use for them."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _coerce(where: str, key: Key, value):
    """``value`` of ``key`` checked (type, finiteness, choices, range); ints widen to float.
    Raises InputError naming ``where`` (the file and dotted key) and the value."""
    if key.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok_type = isinstance(value, key.type) and not (key.type is int and isinstance(value, bool))
    if not ok_type:
        raise InputError(f"{where} = {value!r} has type {type(value).__name__}, "
                         f"expected {getattr(key.type, '__name__', key.type)}")
    if not _finite(value):
        raise InputError(f"{where} = {value!r}, expected a finite number")
    if key.choices and value not in key.choices:
        raise InputError(f"{where} = {value!r}, expected one of {', '.join(map(repr, key.choices))}")
    if key.check is not None and not key.check(value):
        raise InputError(f"{where} = {value!r}, expected {key.expect}")
    return value


def parse_override(text: str):
    """Parse ``key=value``; the value is TOML (bare words are strings)."""
    if "=" not in text:
        raise InputError(f"--set {text!r}: expected section.key=value")
    name, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return name.strip(), value


def _canonical_keys(label: str, raw: dict, sections: dict) -> None:
    """Rename every alias in ``raw`` (section -> key -> value) to its key's name, in place;
    an unknown section or key, or a key given under two of its names, is an InputError."""
    for section, values in raw.items():
        if section not in sections:
            raise InputError(f"{label}: unknown section [{section}], expected one of "
                             f"{', '.join(sections)}")
        if not isinstance(values, dict):
            raise InputError(f"{label}: '{section}' must be a table")
        names = alias_names(sections[section])
        for key in list(values):
            if key in names:
                if names[key] in values:
                    raise InputError(f"{label}: {section}.{key} and {section}.{names[key]} are the "
                                     f"same setting ({key} is the older name); give it once")
                values[names[key]] = values.pop(key)
            elif key not in sections[section]:
                raise InputError(f"{label}: unknown key {section}.{key}; known keys: "
                                 f"{', '.join(sections[section])}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML config (or none), apply overrides, validate every key, fill defaults.

    A key may be named by any of its names (:attr:`Key.aliases`) in the file and in an
    override; an override replaces the file's value whichever name either uses."""
    raw: dict = {}
    label = str(path) if path else "config"
    sections = schema()
    if path:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"{p}: config file not found")
        try:
            raw = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{p}: not valid TOML ({exc})") from None
        _canonical_keys(label, raw, sections)
    for text in overrides:
        name, value = parse_override(text)
        if name.count(".") != 1:
            raise InputError(f"--set {name}: expected section.key")
        section, key = name.split(".")
        one = {section: {key: value}}
        _canonical_keys(f"--set {name}", one, sections)
        for key, value in one[section].items():
            raw.setdefault(section, {})[key] = value
    resolved: dict = {}
    for section, keys in sections.items():
        resolved[section] = {}
        for key, spec in keys.items():
            value = raw.get(section, {}).get(key, spec.default)
            resolved[section][key] = _coerce(f"{label}: {section}.{key}", spec, value)
    if not resolved["data"]["partitions"]:
        raise InputError(f"{label}: data.partitions is not set (a partition directory; "
                         "use --set data.partitions=DIR)")
    cfg = Config(resolved)
    from hpcgnn.run.engines.registry import engine_spec

    spec = engine_spec(cfg.train.engine)
    if spec.validate is not None:
        spec.validate(cfg, label)
    return cfg


def check_backend(cfg) -> str:
    """The data-plane backend ``cfg.runtime.backend`` gives on ``cfg.train.device`` on this
    machine ('auto' device = cuda when torch sees one, as ``hpcgnn.engine.device.resolve_device``
    decides), or the one-line InputError of an impossible pair (nccl on the CPU, ccl with CUDA or
    not importable). What ``train`` and ``infer`` check on every rank before any data is read."""
    from hpcgnn.comm.communicator import choose_backend

    device = cfg.train.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return choose_backend(cfg.runtime.backend, device)
