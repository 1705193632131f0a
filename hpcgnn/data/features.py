"""Feature transforms of `hpcgnn prepare --normalize-features`.

``row``: every row divided by its sum; rows that sum to 0 are left as they are. This is the
transform the Planetoid/GCN results are published with (Kipf & Welling's ``preprocess_features``,
PyG's ``NormalizeFeatures``) and is meant for non-negative features such as Planetoid's
bag-of-words counts: features with negative entries are refused (their row sums can be 0 or
close to it, and dividing by them is no normalisation). On non-negative features it equals
PyG's ``NormalizeFeatures`` in every version (older: divide by the row sum clamped to >= 1;
since 2.3 the global minimum, here 0, is subtracted first), since a non-zero row sum of
Planetoid's 0/1 features is at least 1.

The transform works in place, a block of rows at a time: at ogbn-products size (2.45M x 100
float32, 0.98 GB) it needs a few MB beyond the feature matrix itself. Row sums are accumulated
in float64 and the quotient rounded once to float32.
"""
from __future__ import annotations

import numpy as np

from hpcgnn.errors import InputError

NORMALIZATIONS = ("none", "row")
BLOCK_ELEMENTS = 1 << 22          # rows per block: about 16 MB of float32 features


def _block_rows(x: np.ndarray, block_elements: int) -> int:
    return max(1, block_elements // max(1, x.shape[1]))


def first_negative(x: np.ndarray, block_elements: int = BLOCK_ELEMENTS) -> tuple[int, float] | None:
    """(row, value) of the first negative entry of 2-D ``x`` in row order, or None."""
    rows = _block_rows(x, block_elements)
    for start in range(0, x.shape[0], rows):
        blk = x[start:start + rows]
        if blk.size and blk.min() < 0:
            r, c = np.argwhere(blk < 0)[0]
            return start + int(r), float(blk[r, c])
    return None


def row_normalize_(x: np.ndarray, block_elements: int = BLOCK_ELEMENTS) -> np.ndarray:
    """Divide every row of the float32 C-contiguous 2-D ``x`` by its sum, in place; rows summing
    to 0 stay as they are. Returns ``x``."""
    if x.ndim != 2 or x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError("row_normalize_: expected a writeable C-contiguous float32 matrix")
    rows = _block_rows(x, block_elements)
    for start in range(0, x.shape[0], rows):
        blk = x[start:start + rows]
        s = blk.sum(axis=1, dtype=np.float64, keepdims=True)
        s[s == 0] = 1.0
        np.divide(blk, s, out=blk, casting="same_kind")
    return x


def normalize_features(features: np.ndarray, method: str, where: str = "features") -> np.ndarray:
    """``features`` transformed by ``method`` (one of :data:`NORMALIZATIONS`).

    ``row`` works in place when ``features`` is a writeable C-contiguous float32 array (what the
    importers and generators return) and on a float32 copy otherwise. ``where`` names the input in
    the one-line error for negative features.
    """
    if method not in NORMALIZATIONS:
        raise InputError(f"--normalize-features is {method!r}, expected one of: {', '.join(NORMALIZATIONS)}")
    if method == "none":
        return features
    x = features
    if x.ndim != 2:
        raise InputError(f"{where}: features have shape {x.shape}, expected (N, F)")
    bad = first_negative(x)
    if bad is not None:
        raise InputError(f"{where}: features hold negative values (first at row {bad[0]}: {bad[1]:.6g}); "
                         "--normalize-features row expects non-negative features such as "
                         "bag-of-words counts")
    if x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.writeable:
        x = np.array(x, dtype=np.float32, order="C")
    return row_normalize_(x)


# ---------------------------------------------------------------- stored feature dtypes

FEATURE_DTYPES = ("float32", "float16", "bfloat16")
FLOAT16_MAX = 65504.0


def stored_dtype(name: str) -> np.dtype:
    """The HDF5/numpy dtype features of dtype ``name`` (one of :data:`FEATURE_DTYPES`) are stored
    as: bfloat16 has no HDF5 type and is stored as its raw uint16 bit patterns."""
    if name not in FEATURE_DTYPES:
        raise InputError(f"--feature-dtype is {name!r}, expected one of: {', '.join(FEATURE_DTYPES)}")
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def encode_features(x: np.ndarray, name: str, where: str = "features", row0: int = 0) -> np.ndarray:
    """Float32 rows ``x`` as stored for dtype ``name``: float32 unchanged, float16 rounded to
    nearest, bfloat16 rounded to nearest even (torch's rounding) and returned as its uint16 bit
    patterns. A finite value that float16 cannot hold is an InputError naming ``where`` and the
    row (``row0`` = the first row's index)."""
    x = np.asarray(x, dtype=np.float32)
    if name == "float32":
        return x
    if name == "float16":
        big = np.abs(x) > FLOAT16_MAX
        if big.any():
            r, c = np.argwhere(big)[0]
            raise InputError(f"{where}: feature {float(x[r, c]):.6g} at row {row0 + int(r)} does not fit float16 "
                             f"(largest {FLOAT16_MAX:g}); use --feature-dtype float32 or bfloat16")
        return x.astype(np.float16)
    if name == "bfloat16":
        u = np.ascontiguousarray(x).view(np.uint32)
        rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
        return (rounded >> np.uint32(16)).astype(np.uint16)
    raise InputError(f"--feature-dtype is {name!r}, expected one of: {', '.join(FEATURE_DTYPES)}")


def decode_features(raw: np.ndarray, name: str) -> np.ndarray:
    """Stored feature rows ``raw`` of dtype ``name`` as float32 (exact: every float16 and
    bfloat16 value is a float32 value)."""
    if name == "bfloat16":
        return (np.asarray(raw, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.asarray(raw, dtype=np.float32)
