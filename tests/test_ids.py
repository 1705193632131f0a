"""Sets of integer IDs (hpcgnn.ids): equal to np.unique on the mask path and the sort path, with
and without the inverse, for every dtype the callers pass; bad input refused."""
from __future__ import annotations

import numpy as np
import pytest

from hpcgnn import ids
from hpcgnn.ids import unique_ids


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int16])
@pytest.mark.parametrize("n,high", [(1, 1), (7, 3), (5000, 1000), (5000, 10 ** 6), (300, 10 ** 9)])
def test_equals_np_unique(dtype, n, high):
    high = min(high, np.iinfo(dtype).max)
    rng = np.random.default_rng(n + high)
    a = rng.integers(0, high, n).astype(dtype)
    want, inv = np.unique(a, return_inverse=True)
    got = unique_ids(a)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    got2, ginv = unique_ids(a, return_inverse=True)
    assert np.array_equal(got2, want) and np.array_equal(ginv, inv.reshape(-1)) and ginv.dtype == np.int64
    assert np.array_equal(unique_ids(a.reshape(-1, 1), bound=high + 5), want)   # any shape, a wider bound


def test_both_paths_are_taken_and_agree(monkeypatch):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 50_000, 2000)
    dense = unique_ids(a, return_inverse=True)
    monkeypatch.setattr(ids, "MASK_RANGE_FLOOR", 0)
    monkeypatch.setattr(ids, "MASK_RANGE_PER_ID", 1)           # range 25x the IDs: the sort
    sparse = unique_ids(a, return_inverse=True)
    assert all(np.array_equal(x, y) for x, y in zip(dense, sparse))
    assert np.array_equal(dense[0], np.unique(a))


def test_empty_and_negative():
    got = unique_ids(np.zeros(0, np.int32))
    assert got.shape == (0,) and got.dtype == np.int64
    u, inv = unique_ids([], return_inverse=True)
    assert u.shape == inv.shape == (0,)
    with pytest.raises(ValueError, match=r"IDs must be >= 0, got -2"):
        unique_ids([3, -2])
