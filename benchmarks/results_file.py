"""The HDF5 file every ``make bench-*`` writes its figures to (one layout for all of them).

Layout: root attribute ``format`` (``hpcgnn-bench-<name>``) and the run's attributes (``attrs``:
strings and numbers as they are, anything else as JSON); then ``results``: a dict is a group, a
list of dicts numbered groups (``00``, ``01``, ...), a string or number an attribute, any other
list or array a dataset (strings as UTF-8), None nothing. Written atomically (a temporary name, then a rename).
"""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np


def _put(group, d: dict) -> None:
    for k, v in d.items():
        k = str(k).replace("/", "_")          # a name with "/" would be a path in HDF5
        if isinstance(v, dict):
            _put(group.require_group(k), v)
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            sub = group.require_group(k)
            for i, item in enumerate(v):
                _put(sub.require_group(f"{i:02d}"), item)
        elif isinstance(v, str):
            group.attrs[k] = str(v)
        elif isinstance(v, (bool, int, float, np.integer, np.floating)):
            group.attrs[k] = v
        elif v is None:
            continue
        else:
            a = np.asarray(v)
            if a.dtype.kind == "U":                  # strings: HDF5 variable-length UTF-8
                a = a.astype(object)
                group.create_dataset(k, data=a, dtype=h5py.string_dtype())
            else:
                group.create_dataset(k, data=a)


def write_results(path: str | Path, results: dict, attrs: dict, fmt: str) -> None:
    """Write ``results`` and the root ``attrs`` to ``path`` (see the module docstring) with
    root attribute ``format`` = ``fmt``; the parent folder is created."""
    from hpcgnn.fileio import atomic_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = fmt
            for k, v in attrs.items():
                f.attrs[k] = str(v) if isinstance(v, str) else (  # numpy strings as str: h5py needs that
                    v if isinstance(v, (int, float, bool, np.integer, np.floating)) else json.dumps(v))
            _put(f, results)
