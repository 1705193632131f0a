"""Import a graph from plain files: an edge list, a feature matrix, labels, splits.

``--dataset files --edges E --features X.npy --labels Y.npy [--train T --val V --test T]``

* edges: ``.csv``/``.tsv``/``.txt`` (two integer columns per line separated by
  commas, tabs or spaces; ``#`` starts a comment), optionally gzipped
  (``.csv.gz``), ``.npy`` (integer array of shape (E, 2) or (2, E)) or ``.npz``
  (arrays ``src`` and ``dst``, or ``edges`` of shape (E, 2)). Edges are taken
  as undirected.
* features: ``.npy`` float/int matrix (N, F), finite.
* labels: ``.npy`` integer vector (N,), classes ``0..C-1`` or -1 for
  unlabelled; C = ``num_classes`` or max label + 1.
* splits: ``.npy`` bool mask of length N or integer index array; absent
  splits are empty.

Also provides the chunked text-number reader shared with the OGB importer.
"""
from __future__ import annotations

import gzip
import re
from contextlib import nullcontext
import warnings
from pathlib import Path

import numpy as np

from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.data.graph import Graph
from hpcgnn.errors import InputError
from hpcgnn.progress import Progress

TEXT_CHUNK_BYTES = 64 << 20
_SEPARATORS = bytes.maketrans(b",\t;\r", b"    ")
_COMMENT = re.compile(rb"#[^\n]*")


def check_readable(path: Path, what: str) -> Path:
    """Raise InputError unless ``path`` is an existing readable file."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: {what} file not found")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected the {what} file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what} file ({exc.strerror or exc})") from None
    return path


def _diagnose_line(text: bytes, columns: int | None, dtype, line_offset: int, comments: bool) -> str:
    """Describe the first line that is not ``columns`` numbers of ``dtype`` (slow path, errors only)."""
    conv = int if np.dtype(dtype).kind in "iu" else float
    for i, raw in enumerate(text.split(b"\n")):
        body = raw.split(b"#", 1)[0] if comments else raw
        fields = body.translate(_SEPARATORS).split()
        if not fields:
            continue
        try:
            [conv(f) for f in fields]
        except ValueError:
            shown = raw.decode("utf-8", "replace").strip()[:60]
            kind = "integers" if conv is int else "numbers"
            return f"line {line_offset + i + 1} is not {kind}: {shown!r}"
        if columns is not None and len(fields) != columns:
            return f"line {line_offset + i + 1} has {len(fields)} columns, expected {columns}"
    return "malformed numbers"


def _fields_per_line(text: bytes) -> np.ndarray:
    """Number of whitespace-separated fields on each non-blank line of ``text`` (vectorised).

    Bytes <= 32 count as separators (the parse rejects stray control bytes).
    """
    if not text.endswith(b"\n"):
        text += b"\n"
    b = np.frombuffer(text, dtype=np.uint8)
    space = b <= 32
    starts = ~space
    starts[1:] &= space[:-1]
    seen = np.cumsum(starts, dtype=np.int64 if b.size >= 2**31 else np.int32)
    counts = np.diff(seen[np.flatnonzero(b == 10)], prepend=0)
    return counts[counts > 0]


def _line_blocks(text):
    """Yield blocks of whole lines (the last one may lack its newline) of about TEXT_CHUNK_BYTES."""
    tail = b""
    while True:
        block = text.read(TEXT_CHUNK_BYTES)
        if not block:
            if tail:
                yield tail
            return
        data = tail + block
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        if cut:
            yield data[:cut]


def _parse_block(path: Path, data: bytes, dtype, columns: int | None, comments: bool, line_offset: int):
    """(values (rows, columns) or None for a blank block, columns) of one block of whole lines."""
    text = _COMMENT.sub(b"", data) if comments and b"#" in data else data
    text = text.translate(_SEPARATORS)
    counts = _fields_per_line(text)
    if not counts.size:
        return None, columns
    if columns is None:
        columns = int(counts[0])
    if np.any(counts != columns):
        raise InputError(f"{path}: {_diagnose_line(data, columns, dtype, line_offset, comments)}")
    try:
        s = text.decode("ascii")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file of numbers (non-ASCII bytes after line {line_offset})") from None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            values = np.fromstring(s, dtype=dtype, sep=" ")
        except (ValueError, DeprecationWarning):
            values = None
    if values is None or values.size != int(counts.sum()):
        raise InputError(f"{path}: {_diagnose_line(data, columns, dtype, line_offset, comments)}")
    return values.reshape(-1, columns), columns


def read_text_matrix(path: Path, dtype, columns: int | None = None, comments: bool = False,
                     what: str = "data", progress: bool = False) -> np.ndarray:
    """Parse a (gzipped) text file of numbers, one row per line, into an array (rows, columns).

    Fields are separated by commas, tabs, semicolons or spaces; blank lines are
    skipped; with ``comments`` a ``#`` starts a comment. ``columns=None``
    takes the width of the first row; every row must have that width. Reads
    blocks of about TEXT_CHUNK_BYTES and parses each with one vectorised
    ``np.fromstring`` call. Raises InputError naming the file and the first
    bad line.
    """
    path = check_readable(path, what)
    parts: list[np.ndarray] = []
    lines_done = 0
    try:
        with open(path, "rb") as raw, \
                (gzip.GzipFile(fileobj=raw, mode="rb") if path.name.endswith(".gz") else nullcontext(raw)) as text, \
                Progress(f"read {path.name}", total=path.stat().st_size, enabled=progress) as bar:
            for data in _line_blocks(text):
                values, columns = _parse_block(path, data, dtype, columns, comments, lines_done)
                if values is not None:
                    parts.append(values)
                lines_done += data.count(b"\n")
                bar.update(raw.tell() - bar.done)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise InputError(f"{path}: cannot read the {what} file ({exc.__class__.__name__}: {exc})") from None
    if not parts:
        return np.zeros((0, columns or 0), dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def load_npy(path: Path, what: str) -> np.ndarray:
    """``np.load`` of a .npy file (no pickles) with one-line errors."""
    path = check_readable(path, what)
    try:
        a = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InputError(f"{path}: not a readable .npy array for the {what} ({str(exc).splitlines()[0]})") from None
    if not isinstance(a, np.ndarray):
        raise InputError(f"{path}: holds an .npz archive, expected a single .npy array for the {what}")
    return a


def _integral(a: np.ndarray, path: Path, what: str) -> np.ndarray:
    if a.dtype.kind in "iu":
        return a.astype(np.int64, copy=False)
    if a.dtype.kind == "f" and np.all(np.isfinite(a)) and np.all(a == np.round(a)):
        return a.astype(np.int64)
    raise InputError(f"{path}: {what} have dtype {a.dtype} with non-integer values, expected integers")


def read_edges(path: Path, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) int64 from an edge-list file (see module docstring)."""
    path = check_readable(path, "edge list")
    name = path.name.lower()
    if name.endswith(".npy"):
        a = _integral(load_npy(path, "edge list"), path, "edge IDs")
        if a.ndim == 2 and a.shape[1] == 2:
            return a[:, 0], a[:, 1]
        if a.ndim == 2 and a.shape[0] == 2:
            return a[0], a[1]
        raise InputError(f"{path}: edge array has shape {a.shape}, expected (E, 2) or (2, E)")
    if name.endswith(".npz"):
        try:
            archive = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InputError(f"{path}: not a readable .npz archive ({str(exc).splitlines()[0]})") from None
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise InputError(f"{path}: holds a single .npy array, expected an .npz archive")
        with archive:
            keys = set(archive.files)
            try:
                if {"src", "dst"} <= keys:
                    src = _integral(archive["src"], path, "'src' IDs").ravel()
                    dst = _integral(archive["dst"], path, "'dst' IDs").ravel()
                    if src.shape != dst.shape:
                        raise InputError(f"{path}: 'src' has {src.size} entries but 'dst' has {dst.size}")
                    return src, dst
                if "edges" in keys:
                    a = _integral(archive["edges"], path, "'edges' IDs")
                    if a.ndim != 2 or a.shape[1] != 2:
                        raise InputError(f"{path}: 'edges' has shape {a.shape}, expected (E, 2)")
                    return a[:, 0], a[:, 1]
            except (ValueError, OSError, EOFError) as exc:
                raise InputError(f"{path}: corrupt array in archive ({str(exc).splitlines()[0]})") from None
        raise InputError(f"{path}: archive has arrays {sorted(keys)}, expected 'src' and 'dst', or 'edges'")
    if re.search(r"\.(csv|tsv|txt|edges|el)(\.gz)?$", name):
        a = read_text_matrix(path, np.int64, columns=2, comments=True, what="edge list", progress=progress)
        return a[:, 0], a[:, 1]
    raise InputError(f"{path}: unknown edge-list format, expected .csv, .tsv, .txt, .npy or .npz")


def check_features(features: np.ndarray, path, num_nodes: int | None = None) -> np.ndarray:
    """float32 (N, F) features; InputError on wrong shape, dtype or non-finite values."""
    if features.ndim != 2 or features.dtype.kind not in "biuf":
        raise InputError(f"{path}: features have shape {features.shape} and dtype {features.dtype}, "
                         "expected a 2-D numeric array (N, F)")
    if num_nodes is not None and features.shape[0] != num_nodes:
        raise InputError(f"{path}: features have {features.shape[0]} rows, expected {num_nodes} (one per vertex)")
    features = np.ascontiguousarray(features, dtype=np.float32)
    finite = np.isfinite(features).all(axis=1)
    if not finite.all():
        raise InputError(f"{path}: features hold NaN or inf (first at row {int(np.argmin(finite))})")
    return features


def check_labels(labels: np.ndarray, path, num_nodes: int, num_classes: int | None) -> tuple[np.ndarray, int]:
    """int64 labels in [-1, C) and C; InputError naming ``path`` otherwise."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or labels.shape[0] != num_nodes:
        raise InputError(f"{path}: labels have shape {labels.shape}, expected ({num_nodes},)")
    labels = _integral(labels, Path(str(path)), "labels")
    top = int(labels.max()) if labels.size else -1
    if num_classes is None:
        num_classes = max(top + 1, 1)
    expected = f"expected -1 or a class in [0, {num_classes})"
    if labels.size and int(labels.min()) < -1:
        raise InputError(f"{path}: label {int(labels.min())} is out of range, {expected}")
    if top >= num_classes:
        raise InputError(f"{path}: label {top} is out of range, {expected}")
    return labels, int(num_classes)


def mask_from_array(a: np.ndarray, path, num_nodes: int, what: str) -> np.ndarray:
    """Bool mask (N,) from a bool mask or an integer index array."""
    a = np.asarray(a)
    if a.dtype == bool:
        if a.shape != (num_nodes,):
            raise InputError(f"{path}: {what} mask has length {a.shape[0] if a.ndim == 1 else a.shape}, "
                             f"expected {num_nodes}")
        return a.copy()
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1:
        raise InputError(f"{path}: {what} split has shape {a.shape}, expected a bool mask or a 1-D index array")
    idx = _integral(a, Path(str(path)), f"{what} indices")
    if idx.size and (idx.min() < 0 or idx.max() >= num_nodes):
        bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
        raise InputError(f"{path}: {what} index {bad} is out of range, expected [0, {num_nodes})")
    mask = np.zeros(num_nodes, dtype=bool)
    mask[idx] = True
    return mask


def check_splits(masks: dict, sources: dict, labels: np.ndarray) -> None:
    """Masks must be disjoint and select labelled vertices only."""
    names = list(masks)
    for i, a in enumerate(names):
        bad = masks[a] & (labels < 0)
        if bad.any():
            raise InputError(f"{sources[a]}: {a} split selects unlabelled vertex {int(np.argmax(bad))} (label -1)")
        for b in names[i + 1:]:
            both = masks[a] & masks[b]
            if both.any():
                raise InputError(f"{sources[b]}: {b} split overlaps the {a} split ({sources[a]}) "
                                 f"at vertex {int(np.argmax(both))}")


def load_files(edges: str | Path, features: str | Path, labels: str | Path,
               train: str | Path | None = None, val: str | Path | None = None, test: str | Path | None = None,
               num_nodes: int | None = None, num_classes: int | None = None, name: str | None = None,
               progress: bool = False) -> Graph:
    """Import plain files as a :class:`Graph` (see the module docstring for the formats)."""
    edges, features_path, labels_path = Path(edges), Path(features), Path(labels)
    x = load_npy(features_path, "features")
    if num_nodes is None:
        if x.ndim != 2:
            raise InputError(f"{features_path}: features have shape {x.shape}, expected a 2-D array (N, F)")
        num_nodes = int(x.shape[0])
    elif num_nodes < 1:
        raise InputError(f"--num-nodes is {num_nodes}, expected >= 1")
    x = check_features(x, features_path, num_nodes)
    y, num_classes = check_labels(load_npy(labels_path, "labels"), labels_path, num_nodes, num_classes)
    masks, sources = {}, {}
    for split, path in (("train", train), ("val", val), ("test", test)):
        if path is None:
            masks[split] = np.zeros(num_nodes, dtype=bool)
            sources[split] = "(none)"
        else:
            path = Path(path)
            masks[split] = mask_from_array(load_npy(path, f"{split} split"), path, num_nodes, split)
            sources[split] = path
    check_splits(masks, sources, y)
    src, dst = read_edges(edges, progress)
    indptr, indices, stats = build_symmetric_csr(src, dst, num_nodes, where=str(edges))
    meta = {
        "name": name or edges.stem.split(".")[0],
        "source": {"importer": "files", "edges": str(edges), "features": str(features_path),
                   "labels": str(labels_path),
                   "train": None if train is None else str(train), "val": None if val is None else str(val),
                   "test": None if test is None else str(test), "num_nodes": num_nodes,
                   "num_classes": num_classes, "input_edges": int(src.size)},
        **stats,
    }
    return Graph(indptr, indices, x, y, masks["train"], masks["val"], masks["test"],
                 num_classes=num_classes, meta=meta)
