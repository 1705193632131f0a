"""The low-memory partition path: 32-bit topology, METIS library choice and fallback,
METIS' on-disk levels, and the per-step peak memory recorded in meta.h5."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.data.graph import read_graph, read_topology
from hpcgnn.errors import InputError
from hpcgnn.partition import balance as bal
from hpcgnn.partition import metis as metis_mod
from hpcgnn.partition.memory import StepMeter, format_table
from hpcgnn.partition.metis import choose_library, load_library, part_graph_kway
from hpcgnn.partition.methods import metis_weights
from hpcgnn.partition.store import (META_DATASETS, META_FILE, STEP_DATASETS, part_file_name,
                                    read_meta)
from hpcgnn.partition.writer import renumber, write_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mpiutil import clean_env  # noqa: E402

TOLERANCE = 1.05
STEPS = ["read", "prepare", "assign", "read_data", "write", "total"]


def _available(name: str) -> bool:
    try:
        load_library(name)
        return True
    except RuntimeError:
        return False


LIBS = [pytest.param(name, marks=pytest.mark.skipif(not _available(name), reason=f"{name} not installed"))
        for name in metis_mod.LIBRARIES]


def partition(graph, out, *extra) -> int:
    return main(["partition", str(graph), "--out", str(out), "--quiet", *map(str, extra)])


def store_part(directory) -> np.ndarray:
    """The assignment (part of every original ID) a store encodes."""
    meta = read_meta(directory)
    part = np.empty(meta.num_nodes, dtype=np.int64)
    part[meta.new_to_orig()] = np.repeat(np.arange(meta.num_parts), np.diff(meta.part_offsets))
    return part


# ---------------------------------------------------------------- 32-bit topology and writer

def test_read_topology_int32_equals_int64(graph_files):
    ip64, ix64, tr64 = read_topology(graph_files["plain"])
    ip32, ix32, tr32 = read_topology(graph_files["plain"], np.int32)
    assert ix64.dtype == np.int64 and ix32.dtype == np.int32 and ip32.dtype == np.int64
    assert np.array_equal(ix64, ix32) and np.array_equal(ip64, ip32) and np.array_equal(tr64, tr32)
    with pytest.raises(ValueError, match="int64 or int32"):
        read_topology(graph_files["plain"], np.int16)


def test_read_topology_int32_reports_bad_ids_in_blocks(make_graph_file):
    """An ID outside [0, n) is reported before the narrowing cast, even one that int32 would wrap."""
    path = make_graph_file(n=300, intra=1500, inter=20, seed=4)
    for bad in (300, 2**32 + 5, -3):
        with h5py.File(path, "r+") as f:
            f["indices"][17] = bad
        with pytest.raises(InputError, match=rf"'indices' holds vertex ID {bad}, expected IDs in \[0, 300\)"):
            read_topology(path, np.int32)
        with pytest.raises(InputError, match=rf"holds vertex ID {bad}"):
            read_topology(path, np.int64)


def test_native_extract_part_int32_equals_int64(graph_files):
    from hpcgnn.native import partition as native

    g = read_graph(graph_files["plain"])
    part = np.random.default_rng(0).integers(0, 3, g.num_nodes)
    new_to_orig, orig_to_new, offsets = renumber(part, 3)
    for p in range(3):
        rows = new_to_orig[offsets[p]:offsets[p + 1]]
        a = native.extract_part(g.indptr, g.indices, rows, orig_to_new, offsets, p)
        b = native.extract_part(g.indptr, g.indices.astype(np.int32), rows, orig_to_new, offsets, p)
        for x, y in zip(a[:5], b[:5]):
            assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y)
        assert a[5] == b[5]
    with pytest.raises(TypeError):  # no unsafe conversion of other index types
        native.extract_part(g.indptr, g.indices.astype(np.float64), new_to_orig[:offsets[1]], orig_to_new,
                            offsets, 0)


@pytest.mark.parametrize("method, parts", [("metis", 4), ("random", 3), ("contiguous", 2)])
def test_low_memory_store_equals_int64_reference(graph_files, tmp_path, method, parts):
    """`hpcgnn partition` (topology read as int32, one step at a time) writes the same store as
    write_store on the int64 graph with the same assignment: every partition file byte for
    byte, and every dataset and attribute of meta.h5 but the step measurements."""
    g_path = graph_files["plain"]
    assert partition(g_path, tmp_path / "low", "--parts", parts, "--method", method, "--seed", 5) == 0
    low = read_meta(tmp_path / "low")
    graph = read_graph(g_path)
    assert graph.indices.dtype == np.int64
    ref = tmp_path / "ref"
    write_store(ref, graph, store_part(tmp_path / "low"), parts, method=method, seed=5,
                constraints=json.loads(low.attrs["constraints"]), source_graph=low.attrs["source_graph"],
                source_hash=low.attrs["source_hash"],
                metis_options={k: low.attrs[k] for k in ("ufactor", "niter", "metis_ondisk") if k in low.attrs},
                metis_library=low.attrs.get("metis_library"), progress=False)
    for p in range(parts):
        assert (tmp_path / "low" / part_file_name(p)).read_bytes() == (ref / part_file_name(p)).read_bytes()
    with h5py.File(tmp_path / "low" / META_FILE, "r") as a, h5py.File(ref / META_FILE, "r") as b:
        assert sorted(a) == sorted(b) == sorted([*META_DATASETS, *STEP_DATASETS])
        for name in META_DATASETS:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name][()], b[name][()])
        skip = {"steps"}
        assert {k: v for k, v in a.attrs.items() if k not in skip} == \
               {k: v for k, v in b.attrs.items() if k not in skip}
    assert json.loads(low.attrs["steps"]) == (STEPS if method == "metis" else
                                              [s for s in STEPS if s != "prepare"])
    assert [s["name"] for s in read_meta(ref).steps] == ["write", "total"]


# ---------------------------------------------------------------- METIS libraries

@pytest.mark.parametrize("name", LIBS)
def test_each_library_balances_three_constraints(graph_files, name):
    library = load_library(name)
    g = read_graph(graph_files["skewed"])
    vwgt, used = metis_weights(g.indptr, g.train_mask, ("vertices", "train", "edges"), library.idx_dtype)
    assert vwgt.dtype == library.idx_dtype and used == ("vertices", "train", "edges")
    ix = g.indices.astype(library.idx_dtype)
    part, cut = part_graph_kway(g.indptr, ix, 4, vwgt, seed=3, library=library)
    again, _ = part_graph_kway(g.indptr, ix, 4, vwgt, seed=3, library=library)
    assert part.dtype == np.int64 and np.array_equal(part, again)
    assert cut == bal.edge_cut(g.indptr, g.indices, part)
    assert max(bal.balance(part, 4, g.degree(), g.train_mask).values()) <= TOLERANCE


def test_libraries_find_cuts_of_the_same_quality(cora_graph):
    """The int32 METIS 5.2.1 and the int64 METIS 5.1.0 cut Cora within 5 % of each other on
    average over parts and seeds (products-like: docs/benchmarks.md)."""
    if not (_available("cmeel-metis") and _available("pymetis")):
        pytest.skip("needs both libraries")
    g = read_graph(cora_graph)
    cuts = {}
    for name in metis_mod.LIBRARIES:
        library = load_library(name)
        vwgt, _ = metis_weights(g.indptr, g.train_mask, ("vertices", "train", "edges"), library.idx_dtype)
        cuts[name] = np.mean([part_graph_kway(g.indptr, g.indices, k, vwgt, seed=s, library=library)[1]
                              for k in (4, 8) for s in range(3)])
    assert abs(cuts["cmeel-metis"] / cuts["pymetis"] - 1) < 0.05, cuts


def test_choose_library_by_size(monkeypatch):
    if _available("cmeel-metis"):
        assert choose_library("auto", 1000, 10_000).name == "cmeel-metis"
        # Too many edges for 32-bit indices: auto moves to the 64-bit build, a request fails.
        assert choose_library("auto", 1000, 2**31).name == "pymetis"
        with pytest.raises(RuntimeError, match="cannot index"):
            choose_library("cmeel-metis", 1000, 2**31)
        assert not load_library("cmeel-metis").fits(800_000_000, 1000, ncon=3)
    assert load_library("pymetis").fits(2**40, 2**40)


def test_auto_falls_back_to_pymetis_without_cmeel(graph_files, tmp_path, monkeypatch, capsys):
    def missing():
        raise RuntimeError("cmeel-metis is not installed (pip install cmeel-metis)")

    load_library.cache_clear()
    monkeypatch.setattr(metis_mod, "_load_cmeel", missing)
    try:
        assert load_library("auto").name == "pymetis"
        assert partition(graph_files["plain"], tmp_path / "s", "--parts", 2) == 0
        meta = read_meta(tmp_path / "s")
        assert meta.attrs["metis_library"].startswith("METIS 5.1.0 from pymetis")
        assert json.loads(meta.attrs["tool_versions"])["METIS"] == meta.attrs["metis_library"]
        capsys.readouterr()
        for args, message in [(["--metis-library", "cmeel-metis"], "cmeel-metis is not installed"),
                              (["--metis-ondisk"], "--metis-ondisk needs METIS 5.2 (cmeel-metis)")]:
            assert partition(graph_files["plain"], tmp_path / "t", "--parts", 2, *args) == 2
            err = capsys.readouterr().err
            assert err.startswith("hpcgnn: error: ") and err.count("\n") == 1 and message in err, err
            assert not (tmp_path / "t").exists()
    finally:
        monkeypatch.undo()
        load_library.cache_clear()


@pytest.mark.parametrize("name", LIBS)
def test_metis_library_is_recorded_and_reproducible(graph_files, tmp_path, name):
    g_path = graph_files["plain"]
    assert partition(g_path, tmp_path / "s", "--parts", 3, "--seed", 2, "--metis-library", name) == 0
    meta = read_meta(tmp_path / "s")
    library = load_library(name)
    assert meta.attrs["metis_library"] == library.describe()
    g = read_graph(g_path)
    vwgt, _ = metis_weights(g.indptr, g.train_mask, ("vertices", "train", "edges"), library.idx_dtype)
    expect, _ = part_graph_kway(g.indptr, g.indices, 3, vwgt, seed=2, library=library)
    assert np.array_equal(store_part(tmp_path / "s"), expect)  # partition p is METIS' part p


def test_header_facts_parse_the_options_enum():
    text = """#define IDXTYPEWIDTH 32
#define METIS_VER_MAJOR 5
#define METIS_VER_MINOR 2
#define METIS_VER_SUBMINOR 1
#define METIS_NOPTIONS 40
typedef enum {
  METIS_OPTION_PTYPE,
  METIS_OPTION_OBJTYPE,   /* a comment naming METIS_OPTION_FAKE */
  METIS_OPTION_SEED,

  METIS_OPTION_ONDISK
} moptions_et;
"""
    assert metis_mod._header_facts(text) == (32, "5.2.1", 40, {"PTYPE": 0, "OBJTYPE": 1, "SEED": 2, "ONDISK": 3})
    with pytest.raises(RuntimeError, match="lacks"):
        metis_mod._header_facts("#define IDXTYPEWIDTH 64\n")


@pytest.mark.skipif(not _available("cmeel-metis"), reason="cmeel-metis not installed")
def test_ondisk_gives_the_same_partition_and_leaves_nothing(graph_files, tmp_path):
    """METIS writes levels of 128 MiB or more only (checked by hand on products-like at scale 0.25:
    the same store, docs/benchmarks.md); here the scratch directory and working directory."""
    g = read_graph(graph_files["skewed"])
    library = load_library("cmeel-metis")
    vwgt, _ = metis_weights(g.indptr, g.train_mask, ("vertices", "train", "edges"), library.idx_dtype)
    cwd = os.getcwd()
    (tmp_path / "scratch").mkdir()
    in_ram, cut = part_graph_kway(g.indptr, g.indices, 4, vwgt, seed=1, library=library)
    on_disk, cut_disk = part_graph_kway(g.indptr, g.indices, 4, vwgt, seed=1, library=library,
                                        ondisk=tmp_path / "scratch")
    assert np.array_equal(in_ram, on_disk) and cut == cut_disk
    assert os.getcwd() == cwd and list((tmp_path / "scratch").iterdir()) == []
    with pytest.raises(ValueError, match="cannot keep"):
        part_graph_kway(g.indptr, g.indices, 4, vwgt, library=load_library("pymetis"), ondisk=tmp_path)
    # Through the command: the same partition files, the option recorded.
    assert partition(graph_files["skewed"], tmp_path / "a", "--parts", 4, "--no-metis-ondisk") == 0
    assert partition(graph_files["skewed"], tmp_path / "b", "--parts", 4) == 0    # on by default
    for p in range(4):
        assert (tmp_path / "a" / part_file_name(p)).read_bytes() == (tmp_path / "b" / part_file_name(p)).read_bytes()
    assert (read_meta(tmp_path / "a").attrs["metis_ondisk"], read_meta(tmp_path / "b").attrs["metis_ondisk"]) == (0, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "scratch"]


# ---------------------------------------------------------------- per-step memory

def test_steps_are_recorded_in_meta(graph_files, tmp_path, capsys):
    assert main(["partition", str(graph_files["plain"]), "--parts", "2", "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    meta = read_meta(tmp_path / "s")
    steps = meta.steps
    assert [s["name"] for s in steps] == STEPS == json.loads(meta.attrs["steps"])
    assert all(s["seconds"] >= 0 and s["peak_rss"] > 0 for s in steps)
    assert steps[-1]["seconds"] == pytest.approx(sum(s["seconds"] for s in steps[:-1]))
    assert steps[-1]["peak_rss"] == max(s["peak_rss"] for s in steps[:-1])
    # The printed table: one row per step.
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["step", "wall", "s"])
    assert [line.split()[0] for line in lines[head + 1:head + 1 + len(STEPS)]] == STEPS
    with h5py.File(tmp_path / "s" / META_FILE, "r") as f:
        for name, dtype in STEP_DATASETS.items():
            assert f[name].dtype == np.dtype(dtype) and f[name].shape == (len(STEPS),)


def test_recorded_peak_is_the_process_peak(make_graph_file, tmp_path):
    """In a fresh process the recorded total is exact: the process high-water mark (never
    reset) read after the command returns; each step's figure is at least what it must hold.

    (VmHWM, not wait4's ru_maxrss: a child's ru_maxrss also counts the parent's resident size
    at the fork, here the test runner's.)"""
    n, features = 60_000, 256
    path = make_graph_file("big.h5", n=n, intra=300_000, inter=3_000, features=features, seed=7)
    feature_bytes = n * features * 4
    script = ("import sys; from hpcgnn.cli import main; from hpcgnn.partition.memory import high_water_mark; "
              "rc = main(sys.argv[1:]); print(high_water_mark()); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", script, "partition", str(path), "--parts", "2",
                           "--out", str(tmp_path / "s"), "--quiet"], env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    process_peak = int(proc.stdout.split()[-1])
    steps = {s["name"]: s for s in read_meta(tmp_path / "s").steps}
    total = steps["total"]
    assert total["exact"] and 0 <= process_peak - total["peak_rss"] <= 4 << 20, (process_peak, steps)
    # read_data hashes the features in 16 MiB blocks of a memory map, never holding them whole;
    # write holds a partition's rows (about half the features), the one before it and the
    # hashing thread's copy of it, and at most 16 MiB of mapped pages: about 1.5 x, not the
    # whole graph's features as well (2.5 x).
    assert steps["read_data"]["peak_rss"] - steps["assign"]["peak_rss"] < 0.5 * feature_bytes
    assert 0.4 * feature_bytes < steps["write"]["peak_rss"] - steps["assign"]["peak_rss"] < 2 * feature_bytes


def test_step_meter_separates_steps(tmp_path):
    """A step that allocates 256 MiB is exact and far above a later step that holds 32 MiB."""
    script = tmp_path / "meter.py"
    script.write_text("""
import json, sys, time
import numpy as np
from hpcgnn.partition.memory import StepMeter
with StepMeter(interval=0.005) as meter:
    with meter.step("big"):
        a = np.ones(256 << 17)          # 256 MiB, touched
        del a
    with meter.step("small"):
        b = np.ones(32 << 17)           # 32 MiB
        time.sleep(0.1)
        del b
    with meter.step("idle"):
        time.sleep(0.05)
print(json.dumps([r.__dict__ for r in meter.records()]))
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    rec = {r["name"]: r for r in json.loads(proc.stdout)}
    assert list(rec) == ["big", "small", "idle", "total"]
    assert rec["big"]["exact"] and not rec["small"]["exact"] and not rec["idle"]["exact"]
    assert rec["big"]["peak_rss"] - rec["idle"]["peak_rss"] > 200 << 20
    assert rec["small"]["peak_rss"] - rec["idle"]["peak_rss"] > 24 << 20
    assert rec["total"]["peak_rss"] == rec["big"]["peak_rss"] and rec["total"]["exact"]


def test_format_table_marks_sampled_figures():
    meter = StepMeter()
    meter.close()
    from hpcgnn.partition.memory import StepRecord

    text = format_table([StepRecord("read", 1.25, 3 << 30, True), StepRecord("write", 2.0, 1 << 30, False),
                         StepRecord("total", 3.25, 3 << 30, True)])
    lines = text.splitlines()
    assert lines[1].split() == ["read", "1.2", "3.00"] and lines[2].split() == ["write", "2.0", "~1.00"]
    assert "sampled" in lines[-1]
