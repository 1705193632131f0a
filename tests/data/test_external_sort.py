"""Bounded-memory preparation: the external edge sort and the streamed graph file equal the
in-memory build; budgets too small, 32-bit IDs for too many vertices and a full disk are one
line and exit 2 with nothing left behind."""
from __future__ import annotations

import re

import h5py
import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.data.build import write_graph_stream
from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.data.external_sort import SymmetricEdgeSorter, min_sort_bytes, sort_plan
from hpcgnn.data.graph import index_dtype_for, read_graph
from hpcgnn.data.synthetic import SbmParams, generate_sbm, sbm_source
from hpcgnn.errors import InputError

SBM = ["--dataset", "sbm", "--nodes", "3000", "--edges", "30000", "--features", "6", "--classes", "4",
       "--seed", "3"]
DATASETS = ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask")


def edges_with_loops_and_duplicates(n=2500, m=30000, seed=0):
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, n, m), rng.integers(0, n, m)
    src[:400] = dst[:400]                                          # self-loops
    return np.concatenate([src, dst[:6000]]), np.concatenate([dst, src[:6000]])   # reversed duplicates


@pytest.mark.parametrize("budget", [min_sort_bytes(), 200_000, 1 << 30])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sorter_equals_the_in_memory_build(tmp_path, budget, dtype):
    src, dst = edges_with_loops_and_duplicates()
    indptr, indices, stats = build_symmetric_csr(src, dst, 2500)
    sorter = SymmetricEdgeSorter(2500, budget, tmp_path)
    for lo in range(0, src.shape[0], 2777):
        sorter.add(src[lo:lo + 2777], dst[lo:lo + 2777].astype(np.int32))
    out = sorter.finish(dtype)
    assert np.array_equal(out.indptr, indptr) and out.stats == stats
    got = out.indices[0:out.indices.size]
    assert got.dtype == dtype and np.array_equal(got, indices)
    assert [p.name for p in tmp_path.iterdir()] == ["indices.bin"]     # runs removed once merged
    if budget == min_sort_bytes():      # a budget that forces many runs and several merge passes
        assert sort_plan(budget).fan_in == 2 and out.runs >= 20 and out.merge_passes >= 3
    if budget == 1 << 30:
        assert out.runs == 0


def test_sorter_refuses_ids_out_of_range(tmp_path):
    sorter = SymmetricEdgeSorter(10, min_sort_bytes(), tmp_path, where="e.npz")
    with pytest.raises(InputError, match=r"e\.npz: destination vertex ID 10 is out of range, expected \[0, 10\)"):
        sorter.add(np.array([1, 2]), np.array([3, 10]))


def test_prepare_under_a_tiny_budget_equals_the_in_memory_graph(tmp_path, capsys):
    out = tmp_path / "g.h5"
    assert main(["prepare", *SBM, "--memory-budget", "400KB", "--out", str(out)]) == 0
    line = " ".join(capsys.readouterr().out.split())   # the summary's lines as one
    m = re.search(r"edges sorted on disk in (\d+) runs, (\d+) merge passes memory budget 390\.62 KiB "
                  r"\(given\), peak RSS [0-9.]+ MiB", line)
    assert m and int(m.group(1)) >= 3, line
    assert "indices int32" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.h5"]        # no temporaries left
    ref = generate_sbm(SbmParams(nodes=3000, edges=30000, features=6, classes=4, seed=3))
    g = read_graph(out)
    for name in DATASETS:
        assert np.array_equal(getattr(g, name), getattr(ref, name)), name
    assert g.meta["self_loops_removed"] == ref.meta["self_loops_removed"]
    assert g.meta["duplicates_removed"] == ref.meta["duplicates_removed"]
    with h5py.File(out) as f:
        assert f["indices"].dtype == np.int32 and f.attrs["feature_dtype"] == "float32"
        assert f["indices"].chunks is None and f["features"].chunks is None     # contiguous
    # the same graph sorted in memory, stored with int64 IDs: same content
    out64 = tmp_path / "g64.h5"
    assert main(["prepare", *SBM, "--index-dtype", "int64", "--out", str(out64)]) == 0
    g64 = read_graph(out64)
    assert all(np.array_equal(getattr(g, k), getattr(g64, k)) for k in DATASETS)


def test_partition_reads_int32_graph_files(tmp_path):
    g = tmp_path / "g.h5"
    assert main(["prepare", *SBM, "--out", str(g)]) == 0
    assert main(["partition", str(g), "--parts", "2", "--out", str(tmp_path / "parts"), "--quiet"]) == 0
    assert main(["inspect", str(tmp_path / "parts")]) == 0


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpcgnn: error: ") and "Traceback" not in err, err
    return lines[0]


def test_budget_too_small_for_the_vertex_arrays(tmp_path, capsys):
    out = tmp_path / "g.h5"
    assert main(["prepare", *SBM, "--memory-budget", "200KB", "--out", str(out)]) == 2
    line = one_error_line(capsys)
    assert re.search(r"--memory-budget 195\.31 KiB is too small for --dataset sbm: its 3,000 vertices need at "
                     r"least [0-9.]+ KiB \(91 bytes per vertex", line), line
    assert not list(tmp_path.iterdir())


def test_32_bit_ids_for_more_than_2_31_vertices(tmp_path):
    assert index_dtype_for(2**31, "int32") == np.int32 and index_dtype_for(2**31 + 1, "auto") == np.int64
    with pytest.raises(InputError, match=r"--index-dtype int32: 2,147,483,649 vertices do not fit 32-bit vertex "
                                         r"IDs \(at most 2,147,483,648 vertices\)"):
        index_dtype_for(2**31 + 1, "int32")


def test_32_bit_ids_refused_through_prepare(tmp_path, capsys):
    """An OGB binary dataset whose headers claim 2^31 + 1 vertices: refused before any data is read."""
    import zipfile

    root = tmp_path / "big"
    (root / "raw").mkdir(parents=True)
    (root / "split" / "time").mkdir(parents=True)
    n = 2**31 + 1

    def member(zf, name, shape, dtype, payload=b""):
        with zf.open(name + ".npy", "w", force_zip64=True) as fh:
            np.lib.format.write_array_header_2_0(fh, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                                      "shape": shape})
            fh.write(payload)

    with zipfile.ZipFile(root / "raw" / "data.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        member(zf, "edge_index", (2, 1), np.int64, np.array([[0], [1]], np.int64).tobytes())
        member(zf, "num_nodes_list", (1,), np.int64, np.array([n], np.int64).tobytes())
        member(zf, "num_edges_list", (1,), np.int64, np.array([1], np.int64).tobytes())
        member(zf, "node_feat", (n, 1), np.float32)
    with zipfile.ZipFile(root / "raw" / "node-label.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        member(zf, "node_label", (n, 1), np.float64)
    out = tmp_path / "g.h5"
    assert main(["prepare", "--dataset", "ogb", "--root", str(root), "--index-dtype", "int32",
                 "--out", str(out)]) == 2
    assert "--index-dtype int32: 2,147,483,649 vertices do not fit 32-bit vertex IDs" in one_error_line(capsys)
    assert not out.exists()


@pytest.fixture
def tmpfs(small_tmpfs):
    """A 1 MiB tmpfs (tests/conftest.py small_tmpfs)."""
    return small_tmpfs("1m")


def test_disk_full_during_the_sort_is_one_line_and_leaves_nothing(tmpfs, capsys):
    """3,000 vertices and 60,000 directed keys (480 kB per copy) overflow 1 MiB in the runs and merges."""
    out = tmpfs / "g.h5"
    args = ["prepare", "--dataset", "sbm", "--nodes", "3000", "--edges", "120000", "--features", "6",
            "--memory-budget", "400KB", "--out", str(out)]
    assert main(args) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"hpcgnn: error: {out}: cannot write (No space left on device (ENOSPC))"), line
    assert not list(tmpfs.iterdir())


def test_write_graph_stream_removes_its_scratch_on_bad_input(tmp_path):
    """An error raised while streaming (an out-of-range ID) removes the sort's runs and the output."""
    source = sbm_source(SbmParams(nodes=3000, edges=30000, features=6, classes=4, seed=3))
    good = source.edge_blocks

    def bad_edges():
        yield from good()
        yield np.array([0]), np.array([3000])

    source.edge_blocks = bad_edges
    with pytest.raises(InputError, match=r"--dataset sbm: destination vertex ID 3000 is out of range"):
        write_graph_stream(tmp_path / "g.h5", source, 400_000)
    assert not list(tmp_path.iterdir())
