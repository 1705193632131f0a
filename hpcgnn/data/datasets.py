"""Dataset names understood by ``hpcgnn prepare --dataset NAME``, and how each is built.

``open_dataset(name, options)`` resolves a name to its importer or generator,
interprets the options that apply to it (raw strings from the command line
or Python values) and returns a :class:`~hpcgnn.data.graph.Graph` (importers that read
their input whole) or a :class:`~hpcgnn.data.build.GraphSource` (generators and OGB's binary
layout: streamed to disk in bounded memory by :func:`hpcgnn.data.build.write_graph_stream`);
``load_dataset`` always returns a Graph. An option that does not apply to the dataset is an
error rather than silently ignored.

Names:
  cora, citeseer, pubmed, planetoid:<name>   Planetoid pickles in ROOT/<name>/ (or ROOT/)
  ogb                                         OGB node-property dataset in ROOT (CSV or binary layout)
  files                                       plain edge list / .npy files
  rmat                                        R-MAT generator (Graph500 parameters)
  sbm                                         planted-class stochastic block model
  products-like                               SBM with the ogbn-products shape (x --scale) and about
                                              its difficulty (feature and edge flips, README.md)
  papers-like                                 citation-like graph with the ogbn-papers100M shape
                                              (x --scale) and a stated difficulty
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpcgnn.data.build import GraphSource, materialize
from hpcgnn.data.graph import Graph
from hpcgnn.errors import InputError

PLANETOID_NAMES = ("cora", "citeseer", "pubmed")
SYNTHETIC_OPTIONS = ("nodes", "edges", "features", "classes", "train", "val", "test", "seed", "feature_noise")


@dataclass(frozen=True)
class DatasetKind:
    """One family of dataset names: what it accepts and how it is built."""

    name: str
    summary: str
    options: tuple[str, ...]
    build: Callable[[str, dict, bool], "Graph | GraphSource"]


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _int(options: dict, key: str, default: int | None = None, minimum: int | None = None) -> int | None:
    v = options.get(key)
    if v is None:
        return default
    try:
        out = int(v)
        if isinstance(v, float) and v != out:
            raise ValueError
    except (TypeError, ValueError):
        raise InputError(f"{_flag(key)} is {v!r}, expected an integer") from None
    if minimum is not None and out < minimum:
        raise InputError(f"{_flag(key)} is {out}, expected >= {minimum}")
    return out


def _float(options: dict, key: str, default: float) -> float:
    v = options.get(key)
    if v is None:
        return default
    try:
        return float(v)
    except (TypeError, ValueError):
        raise InputError(f"{_flag(key)} is {v!r}, expected a number") from None


def _count_or_fraction(options: dict, key: str, default):
    """An int (vertex count) or float (fraction): strings with '.', 'e' or '/' are fractions."""
    v = options.get(key)
    if v is None:
        return default
    if isinstance(v, (int, float)):
        return v
    text = str(v).strip()
    try:
        return float(text) if any(ch in text.lower() for ch in ".e") else int(text)
    except ValueError:
        raise InputError(f"{_flag(key)} is {text!r}, expected a fraction (e.g. 0.1) or a vertex count") from None


def _root(options: dict, name: str) -> Path:
    root = options.get("root")
    if root is None:
        raise InputError(f"--dataset {name} needs --root DIR")
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: --root directory not found")
    return root


def _build_planetoid(name: str, options: dict, progress: bool) -> Graph:
    from hpcgnn.data.planetoid import load_planetoid

    dataset = name.split(":", 1)[1] if name.startswith("planetoid:") else name.lower()
    if not dataset:
        raise InputError("--dataset planetoid:<name> needs a name, e.g. planetoid:cora")
    root = _root(options, name)
    directory = root / dataset
    if not directory.is_dir() and (root / f"ind.{dataset}.x").is_file():
        directory = root
    return load_planetoid(directory, dataset)


def _build_ogb(name: str, options: dict, progress: bool) -> "Graph | GraphSource":
    from hpcgnn.data.ogb import is_binary_layout, load_ogb, ogb_binary_source

    root = _root(options, name)
    if is_binary_layout(root):
        return ogb_binary_source(root, split=options.get("split"))
    return load_ogb(root, split=options.get("split"), progress=progress)


def _build_files(name: str, options: dict, progress: bool) -> Graph:
    from hpcgnn.data.plain import load_files

    for key in ("edges", "features", "labels"):
        if options.get(key) is None:
            raise InputError(f"--dataset files needs {_flag(key)} FILE")
    return load_files(options["edges"], options["features"], options["labels"],
                      train=options.get("train"), val=options.get("val"), test=options.get("test"),
                      num_nodes=_int(options, "num_nodes", minimum=1),
                      num_classes=_int(options, "num_classes", minimum=1), progress=progress)


def _synthetic_common(options: dict) -> dict:
    return {
        "nodes": _int(options, "nodes", 10_000, 1),
        "edges": _int(options, "edges", None, 0),
        "features": _int(options, "features", 32, 1),
        "classes": _int(options, "classes", 8, 1),
        "train": _count_or_fraction(options, "train", 0.1),
        "val": _count_or_fraction(options, "val", 0.1),
        "test": _count_or_fraction(options, "test", 0.8),
        "feature_noise": _float(options, "feature_noise", 1.0),
        "seed": _int(options, "seed", 0),
    }


def _build_sbm(name: str, options: dict, progress: bool) -> GraphSource:
    from hpcgnn.data.synthetic import SbmParams, sbm_source

    common = _synthetic_common(options)
    if common["edges"] is None:
        common["edges"] = 10 * common["nodes"]
    params = SbmParams(**common, p_in=_float(options, "p_in", 0.7),
                       degree_skew=_float(options, "degree_skew", 0.6),
                       feature_flip=_float(options, "feature_flip", 0.0), edge_flip=_float(options, "edge_flip", 0.0))
    return sbm_source(params, name="sbm")


def _build_rmat(name: str, options: dict, progress: bool) -> GraphSource:
    from hpcgnn.data.synthetic import RmatParams, rmat_source

    common = _synthetic_common(options)
    if common["edges"] is None:
        common["edges"] = 10 * common["nodes"]
    params = RmatParams(**common, noise=_float(options, "noise", 0.0))
    return rmat_source(params, name="rmat")


def _build_products_like(name: str, options: dict, progress: bool) -> GraphSource:
    from hpcgnn.data.synthetic import PRODUCTS_DIFFICULTY, products_like_params, sbm_source

    difficulty = {key: _float(options, key, default) for key, default in PRODUCTS_DIFFICULTY.items()}
    params = products_like_params(scale=_float(options, "scale", 1.0), seed=_int(options, "seed", 0), **difficulty)
    return sbm_source(params, name="products-like")


def _build_papers_like(name: str, options: dict, progress: bool) -> GraphSource:
    from hpcgnn.data.synthetic import papers_like_source

    return papers_like_source(scale=_float(options, "scale", 1.0), seed=_int(options, "seed", 0))


KINDS = (
    DatasetKind("planetoid", "Planetoid pickles: cora, citeseer, pubmed or planetoid:<name> (ROOT/<name>/)",
                ("root",), _build_planetoid),
    DatasetKind("ogb", "OGB node-property dataset in ROOT (raw/*.csv.gz or raw/data.npz, split/<name>/)",
                ("root", "split"), _build_ogb),
    DatasetKind("files", "plain files: --edges, --features, --labels [--train --val --test]",
                ("edges", "features", "labels", "train", "val", "test", "num_nodes", "num_classes"),
                _build_files),
    DatasetKind("rmat", "R-MAT generator (Graph500 a,b,c,d = .57,.19,.19,.05)",
                SYNTHETIC_OPTIONS + ("noise",), _build_rmat),
    DatasetKind("sbm", "planted-class stochastic block model with skewed degrees",
                SYNTHETIC_OPTIONS + ("p_in", "degree_skew", "feature_flip", "edge_flip"), _build_sbm),
    DatasetKind("products-like", "SBM with the ogbn-products shape (2.45M vertices, 61.9M edges) x --scale",
                ("scale", "seed", "p_in", "degree_skew", "feature_noise", "feature_flip", "edge_flip"),
                _build_products_like),
    DatasetKind("papers-like", "citation-like graph with the ogbn-papers100M shape (111M vertices, "
                "1.62G edges) x --scale", ("scale", "seed"), _build_papers_like),
)


def resolve(name: str) -> DatasetKind:
    """The kind of dataset ``name`` names; InputError listing the choices otherwise."""
    key = name.strip()
    if key.lower() in PLANETOID_NAMES or key.startswith("planetoid:"):
        key = "planetoid"
    for kind in KINDS:
        if kind.name == key:
            return kind
    choices = ", ".join([*PLANETOID_NAMES, "planetoid:<name>", *(k.name for k in KINDS if k.name != "planetoid")])
    raise InputError(f"--dataset {name!r} is unknown, expected one of: {choices}")


def dataset_options() -> tuple[str, ...]:
    """Every option name any dataset accepts (the command line defines these)."""
    seen: dict[str, None] = {}
    for kind in KINDS:
        seen.update(dict.fromkeys(kind.options))
    return tuple(seen)


def open_dataset(name: str, options: dict, progress: bool = False) -> "Graph | GraphSource":
    """Dataset ``name`` from ``options`` (keys as in :func:`dataset_options`, None = unset): a
    Graph, or a GraphSource for the streamed datasets."""
    kind = resolve(name)
    for key, value in options.items():
        if value is not None and key in dataset_options() and key not in kind.options:
            raise InputError(f"{_flag(key)} does not apply to --dataset {name} (it takes: "
                             f"{', '.join(_flag(k) for k in kind.options)})")
    return kind.build(name.strip(), options, progress)


def load_dataset(name: str, options: dict, progress: bool = False) -> Graph:
    """Dataset ``name`` as an in-memory Graph (:func:`open_dataset`, sources materialised)."""
    out = open_dataset(name, options, progress)
    return materialize(out, progress) if isinstance(out, GraphSource) else out
