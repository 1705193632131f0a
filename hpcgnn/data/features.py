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
