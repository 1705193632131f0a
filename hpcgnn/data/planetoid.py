"""Planetoid citation graphs (Cora, CiteSeer, PubMed) from the original pickles.

Layout (Yang et al. 2016, as shipped by kimiyoung/planetoid and tkipf/gcn):
``DIR/ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}``. The pickles are
Python 2 (loaded with ``encoding="latin1"``); ``x``/``tx``/``allx`` hold
``scipy.sparse.csr_matrix`` objects. scipy is not a dependency: a restricted
unpickler maps the scipy class to :class:`_SparseState`, which keeps the
pickled state (data, indices, indptr, _shape), and the rows are densified with
numpy. Only numpy arrays, the sparse shim, and plain containers may be
unpickled; anything else is reported as "not a Planetoid pickle".

Assembly follows Kipf's ``load_data`` / PyG's ``read_planetoid_data``:
features = [allx; tx] with the test rows moved to the IDs in ``test.index``;
train = the first len(y) vertices, val = the next 500, test = sorted
``test.index``. Test IDs missing from ``test.index`` inside its range (CiteSeer's
isolated vertices) get zero features and label -1.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.data.graph import Graph
from hpcgnn.errors import InputError

PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")
NUM_VAL = 500


class _SparseState:
    """Stand-in for a pickled scipy.sparse matrix: records its state dict."""

    def __init__(self, *args, **kwargs):
        self.state: dict = {}
        self.kind = "csr"

    def __setstate__(self, state):
        self.state = dict(state) if isinstance(state, dict) else {}


class _CsrShim(_SparseState):
    kind = "csr"

    def __setstate__(self, state):
        super().__setstate__(state)
        self.kind = "csr"


class _CscShim(_SparseState):
    def __setstate__(self, state):
        super().__setstate__(state)
        self.kind = "csc"


def _numpy_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _numpy_scalar():
    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import scalar
    return scalar


class _PlanetoidUnpickler(pickle.Unpickler):
    """Unpickler that allows only what Planetoid files contain."""

    def find_class(self, module, name):
        if module.startswith("scipy.sparse"):
            if name in ("csr_matrix", "csr_array"):
                return _CsrShim
            if name in ("csc_matrix", "csc_array"):
                return _CscShim
        elif module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            if name == "_reconstruct":
                return _numpy_reconstruct()
            if name == "scalar":
                return _numpy_scalar()
        elif module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        elif module == "collections" and name in ("defaultdict", "OrderedDict"):
            import collections

            return getattr(collections, name)
        elif module in ("__builtin__", "builtins") and name in ("list", "dict", "set", "object", "int", "tuple"):
            import builtins

            return getattr(builtins, name)
        elif module == "_codecs" and name == "encode":  # bytes in protocol-2 pickles written by Python 3
            import codecs

            return codecs.encode
        elif module in ("copy_reg", "copyreg") and name == "_reconstructor":
            import copyreg

            return copyreg._reconstructor
        raise pickle.UnpicklingError(f"unexpected class {module}.{name}")


def _load_pickle(path: Path):
    try:
        with open(path, "rb") as fh:
            return _PlanetoidUnpickler(fh, encoding="latin1").load()
    except OSError as exc:
        raise InputError(f"{path}: cannot read file ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is bad input
        raise InputError(f"{path}: not a Planetoid pickle ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _dense_features(obj, path: Path) -> np.ndarray:
    """A float32 dense matrix from a pickled sparse matrix or numpy array."""
    if isinstance(obj, np.ndarray):
        if obj.ndim != 2 or obj.dtype.kind not in "biuf":
            raise InputError(f"{path}: array of shape {obj.shape} and dtype {obj.dtype}, "
                             "expected a 2-D numeric feature matrix")
        return np.asarray(obj, dtype=np.float32)
    if not isinstance(obj, _SparseState):
        raise InputError(f"{path}: holds {type(obj).__name__}, expected a sparse feature matrix")
    st = obj.state
    try:
        rows, cols = (int(v) for v in st["_shape"])
        data = np.asarray(st["data"], dtype=np.float32)
        indices = np.asarray(st["indices"], dtype=np.int64)
        indptr = np.asarray(st["indptr"], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: sparse matrix state lacks a valid {exc} entry") from None
    outer, inner = (rows, cols) if obj.kind == "csr" else (cols, rows)
    if (indptr.shape != (outer + 1,) or indptr[0] != 0 or np.any(np.diff(indptr) < 0)
            or indptr[-1] != indices.size or data.size != indices.size):
        raise InputError(f"{path}: inconsistent sparse matrix (shape {rows}x{cols}, "
                         f"{indptr.size} row pointers, {indices.size} entries)")
    if indices.size and (indices.min() < 0 or indices.max() >= inner):
        raise InputError(f"{path}: sparse column index out of range [0, {inner})")
    dense = np.zeros((outer, inner), dtype=np.float32)
    major = np.repeat(np.arange(outer), np.diff(indptr))
    np.add.at(dense, (major, indices), data)  # duplicates sum, like scipy's todense
    return dense if obj.kind == "csr" else np.ascontiguousarray(dense.T)


def _onehot(obj, path: Path) -> np.ndarray:
    if not isinstance(obj, np.ndarray) or obj.ndim != 2 or obj.dtype.kind not in "biuf":
        shape = getattr(obj, "shape", None)
        raise InputError(f"{path}: holds {type(obj).__name__} {shape or ''}, expected a 2-D one-hot label array")
    return obj


def _labels_from_onehot(y: np.ndarray) -> np.ndarray:
    """argmax per row, -1 for all-zero rows (unlabelled)."""
    labels = np.argmax(y, axis=1).astype(np.int64)
    labels[~np.any(y != 0, axis=1)] = -1
    return labels


def _read_test_index(path: Path) -> np.ndarray:
    try:
        text = path.read_text(encoding="ascii")
    except OSError as exc:
        raise InputError(f"{path}: cannot read file ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file, expected one test vertex ID per line") from None
    tokens = text.split()
    try:
        ids = np.array([int(t) for t in tokens], dtype=np.int64)
    except ValueError:
        bad = next(t for t in tokens if not t.lstrip("-").isdigit())
        raise InputError(f"{path}: {bad!r} is not an integer vertex ID") from None
    if ids.size == 0:
        raise InputError(f"{path}: no test vertex IDs")
    if ids.min() < 0:
        raise InputError(f"{path}: negative test vertex ID {int(ids.min())}")
    if np.unique(ids).size != ids.size:
        raise InputError(f"{path}: duplicate test vertex IDs")
    return ids


def _edges_from_adjacency(obj, path: Path):
    if not isinstance(obj, dict):
        raise InputError(f"{path}: holds {type(obj).__name__}, expected a dict {{vertex: [neighbours]}}")
    try:
        keys = np.fromiter(obj.keys(), dtype=np.int64, count=len(obj))
        lengths = np.fromiter((len(v) for v in obj.values()), dtype=np.int64, count=len(obj))
        flat = np.fromiter((u for v in obj.values() for u in v), dtype=np.int64, count=int(lengths.sum()))
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"{path}: adjacency dict must map integer vertex IDs to lists of integer IDs") from None
    return np.repeat(keys, lengths), flat


def load_planetoid(directory: str | Path, name: str) -> Graph:
    """Import ``DIR/ind.<name>.*`` as a :class:`Graph` with the standard public split."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory}: Planetoid directory not found (expected ind.{name}.* files in it)")
    paths = {p: directory / f"ind.{name}.{p}" for p in PARTS}
    for p, path in paths.items():
        if not path.is_file():
            raise InputError(f"{path}: file not found (Planetoid dataset {name!r} needs ind.{name}.{{"
                             + ",".join(PARTS) + "})")
    x = _dense_features(_load_pickle(paths["x"]), paths["x"])
    tx = _dense_features(_load_pickle(paths["tx"]), paths["tx"])
    allx = _dense_features(_load_pickle(paths["allx"]), paths["allx"])
    y = _onehot(_load_pickle(paths["y"]), paths["y"])
    ty = _onehot(_load_pickle(paths["ty"]), paths["ty"])
    ally = _onehot(_load_pickle(paths["ally"]), paths["ally"])
    adjacency = _load_pickle(paths["graph"])
    test_index = _read_test_index(paths["test.index"])

    num_features = allx.shape[1]
    num_classes = ally.shape[1]
    for key, a, other in (("x", x, y), ("tx", tx, ty), ("allx", allx, ally)):
        if a.shape[1] != num_features:
            raise InputError(f"{paths[key]}: {a.shape[1]} feature columns, but allx has {num_features}")
        if a.shape[0] != other.shape[0]:
            raise InputError(f"{paths[key]}: {a.shape[0]} rows, but its labels have {other.shape[0]}")
    for key, a in (("y", y), ("ty", ty)):
        if a.shape[1] != num_classes:
            raise InputError(f"{paths[key]}: {a.shape[1]} label columns, but ally has {num_classes}")
    if tx.shape[0] != test_index.size:
        raise InputError(f"{paths['test.index']}: {test_index.size} test IDs, but tx has {tx.shape[0]} rows")

    n_all = allx.shape[0]
    test_sorted = np.sort(test_index)
    lo, hi = int(test_sorted[0]), int(test_sorted[-1])
    # Rows n_all .. n_all+span-1 are the test range [lo, hi]; IDs absent from
    # test.index (isolated vertices) stay zero / unlabelled.
    span = hi - lo + 1
    n = n_all + span
    if lo != n_all:
        raise InputError(f"{paths['test.index']}: smallest test ID is {lo}, expected {n_all} "
                         "(test vertices follow the allx rows)")
    if y.shape[0] + NUM_VAL > n_all:
        raise InputError(f"{paths['y']}: {y.shape[0]} training rows + {NUM_VAL} validation rows exceed "
                         f"the {n_all} rows of allx")

    features = np.zeros((n, num_features), dtype=np.float32)
    features[:n_all] = allx
    onehot = np.zeros((n, num_classes), dtype=ally.dtype)
    onehot[:n_all] = ally
    # tx row i belongs to vertex test_index[i] (Kipf's features[test_idx_reorder] = features[test_idx_range]).
    features[test_index] = tx
    onehot[test_index] = ty
    labels = _labels_from_onehot(onehot)

    src, dst = _edges_from_adjacency(adjacency, paths["graph"])
    indptr, indices, stats = build_symmetric_csr(src, dst, n, where=str(paths["graph"]))

    train = np.zeros(n, dtype=bool)
    val = np.zeros(n, dtype=bool)
    test = np.zeros(n, dtype=bool)
    train[: y.shape[0]] = True
    val[y.shape[0]: y.shape[0] + NUM_VAL] = True
    test[test_sorted] = True
    unlabelled_in_split = int(((train | val | test) & (labels < 0)).sum())
    for m in (train, val, test):
        m &= labels >= 0
    if not np.all(np.isfinite(features)):
        row = int(np.nonzero(~np.isfinite(features).all(axis=1))[0][0])
        raise InputError(f"{directory}: features of {name!r} hold NaN or inf (first at vertex {row})")
    meta = {
        "name": name,
        "source": {"importer": "planetoid", "name": name, "root": str(directory),
                   "split": "public", "num_val": NUM_VAL,
                   "padded_test_ids": int(span - test_index.size),
                   "unlabelled_dropped_from_splits": unlabelled_in_split},
        **stats,
    }
    return Graph(indptr, indices, features, labels, train, val, test, num_classes=num_classes, meta=meta)
