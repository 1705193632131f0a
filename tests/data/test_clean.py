"""Native symmetric-CSR construction against the original numpy implementation."""
from __future__ import annotations

import numpy as np
import pytest

from hpcgnn.data.clean import SymmetricCsrBuilder, build_symmetric_csr
from hpcgnn.errors import InputError


def reference_symmetric_csr(src, dst, num_nodes):
    """The numpy body build_symmetric_csr had before the native kernel (kept as the reference)."""
    src = np.asarray(src, dtype=np.int64).ravel()
    dst = np.asarray(dst, dtype=np.int64).ravel()
    loops = src == dst
    n_loops = int(loops.sum())
    s, d = src[~loops], dst[~loops]
    keys = np.concatenate([d * num_nodes + s, s * num_nodes + d])
    n_directed = keys.size
    keys = np.unique(keys)
    dup = n_directed - keys.size
    rows = keys // num_nodes
    indices = keys - rows * num_nodes
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num_nodes), out=indptr[1:])
    return indptr, indices, {"self_loops_removed": 2 * n_loops, "duplicates_removed": int(dup)}


def random_edges(rng, n, m, loop_frac=0.05, dup_frac=0.2):
    """Random edges with planted self-loops and duplicates (both orientations)."""
    src = rng.integers(0, n, m)
    dst = rng.integers(0, n, m)
    loops = rng.random(m) < loop_frac
    dst[loops] = src[loops]
    k = int(dup_frac * m)
    pick = rng.integers(0, m, k)
    flip = rng.random(k) < 0.5
    src2 = np.where(flip, dst[pick], src[pick])
    dst2 = np.where(flip, src[pick], dst[pick])
    order = rng.permutation(m + k)
    return np.concatenate([src, src2])[order], np.concatenate([dst, dst2])[order]


def assert_same(got, want):
    assert got[0].dtype == np.int64 and got[1].dtype == np.int64
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]


@pytest.mark.parametrize("n,m,seed", [(1, 0, 0), (1, 5, 1), (2, 10, 2), (7, 60, 3), (300, 2000, 4),
                                      (5000, 40000, 5), (100_000, 20_000, 6)])
def test_native_equals_numpy_reference(n, m, seed):
    rng = np.random.default_rng(seed)
    src, dst = random_edges(rng, n, m)
    want = reference_symmetric_csr(src, dst, n)
    assert_same(build_symmetric_csr(src, dst, n), want)
    # streamed in uneven chunks through the accumulator: identical result
    builder = SymmetricCsrBuilder(n, reserve=src.size // 2)
    cuts = np.sort(rng.integers(0, src.size + 1, 5))
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, src.size]):
        builder.add(src[a:b], dst[a:b])
    assert builder.num_added == src.size
    assert_same(builder.finish(), want)


def test_result_is_canonical_and_thread_independent():
    from hpcgnn.native import graph as native_graph

    rng = np.random.default_rng(7)
    src, dst = random_edges(rng, 2000, 50_000)
    before = native_graph.max_threads()
    try:
        native_graph.set_threads(1)
        one = build_symmetric_csr(src, dst, 2000)
        native_graph.set_threads(3)
        two = build_symmetric_csr(src, dst, 2000)
    finally:
        native_graph.set_threads(before)
    assert_same(one, two)
    indptr, indices, _ = one
    rows = np.repeat(np.arange(2000), np.diff(indptr))
    assert not np.any(rows == indices)                                     # no self-loops
    key = rows * 2000 + indices
    assert np.all(np.diff(key) > 0)                                        # sorted rows, no duplicates
    np.testing.assert_array_equal(np.sort(indices * 2000 + rows), key)     # symmetric


def test_accepts_other_integer_dtypes():
    src = np.array([0, 1, 2], dtype=np.int32)
    dst = np.array([1, 2, 2], dtype=np.uint16)
    assert_same(build_symmetric_csr(src, dst, 3), reference_symmetric_csr(src, dst, 3))


@pytest.mark.parametrize("src,dst,msg", [
    ([0, -3], [1, 1], "source vertex ID -3 is out of range, expected [0, 4)"),
    ([0, 1], [1, 4], "destination vertex ID 4 is out of range, expected [0, 4)"),
])
def test_out_of_range_ids_name_the_value(src, dst, msg):
    with pytest.raises(InputError, match=r"^myfile\.csv: " + msg.replace("[", r"\[").replace(")", r"\)")):
        build_symmetric_csr(np.array(src), np.array(dst), 4, where="myfile.csv")
    builder = SymmetricCsrBuilder(4, where="myfile.csv")
    with pytest.raises(InputError, match="out of range"):
        builder.add(np.array(src), np.array(dst))


def test_native_kernel_validates_on_its_own():
    from hpcgnn.native import graph as native_graph

    with pytest.raises(ValueError, match="source vertex ID 9 .* out of range"):
        native_graph.symmetric_csr(np.array([0, 9]), np.array([1, 1]), 5)
    acc = native_graph.EdgeAccumulator(5)
    with pytest.raises(ValueError, match="destination vertex ID -1"):
        acc.add(np.array([0]), np.array([-1]))


def test_rejects_mismatched_lengths_and_float_ids():
    with pytest.raises(InputError, match="3 sources but 2 destinations"):
        build_symmetric_csr(np.array([0, 1, 2]), np.array([1, 2]), 3)
    with pytest.raises(InputError, match="dtype float64, expected integers"):
        build_symmetric_csr(np.array([0.5]), np.array([1.0]), 3)
