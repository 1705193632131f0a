"""`hpcgnn partition`: reproducible bytes, hash verification, one-line errors, atomic output."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.errors import InputError
from hpcgnn.partition import writer
from hpcgnn.partition.store import META_FILE, STEP_DATASETS, load_partition, part_file_name, read_meta

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mpiutil import run_cli  # noqa: E402


def partition(graph, out, *extra) -> int:
    return main(["partition", str(graph), "--out", str(out), "--quiet", *map(str, extra)])


def store_bytes(directory: Path) -> dict:
    """{file name: bytes}, with meta.h5's step measurements (which differ between identical
    runs, docs/formats.md) zeroed in place: everything else must be byte-identical."""
    files = {p.name: bytearray(p.read_bytes()) for p in sorted(directory.iterdir())}
    if META_FILE in files:
        with h5py.File(directory / META_FILE, "r") as f:
            for name in STEP_DATASETS:
                offset, size = f[name].id.get_offset(), f[name].id.get_storage_size()
                assert offset is not None and size == f[name].size * f[name].dtype.itemsize
                files[META_FILE][offset:offset + size] = bytes(size)
    return {name: bytes(data) for name, data in files.items()}


@pytest.mark.parametrize("method", ["metis", "random"])
def test_same_seed_gives_identical_bytes(graph_files, tmp_path, method):
    g = graph_files["plain"]
    assert partition(g, tmp_path / "a", "--parts", 3, "--method", method, "--seed", 7) == 0
    assert partition(g, tmp_path / "b", "--parts", 3, "--method", method, "--seed", 7) == 0
    a, b = store_bytes(tmp_path / "a"), store_bytes(tmp_path / "b")
    assert sorted(a) == [META_FILE] + [part_file_name(p) for p in range(3)]
    assert a == b


def test_random_different_seed_differs(graph_files, tmp_path):
    g = graph_files["plain"]
    assert partition(g, tmp_path / "a", "--parts", 3, "--method", "random", "--seed", 1) == 0
    assert partition(g, tmp_path / "b", "--parts", 3, "--method", "random", "--seed", 2) == 0
    ma, mb = read_meta(tmp_path / "a"), read_meta(tmp_path / "b")
    assert not np.array_equal(ma.new_to_orig(), mb.new_to_orig())
    assert ma.content_hash != mb.content_hash
    a, b = store_bytes(tmp_path / "a"), store_bytes(tmp_path / "b")
    assert all(a[name] != b[name] for name in a)


def test_corrupt_partition_fails_hash_check(graph_files, tmp_path):
    out = tmp_path / "s"
    assert partition(graph_files["plain"], out, "--parts", 2) == 0
    load_partition(out, 1)  # intact: verifies
    with h5py.File(out / part_file_name(1), "r+") as f:
        f["features"][0, 0] += 1.0
    with pytest.raises(InputError, match="part_hash"):
        load_partition(out, 1)
    load_partition(out, 0)


def test_partition_from_another_store_is_refused(graph_files, tmp_path):
    g = graph_files["plain"]
    assert partition(g, tmp_path / "a", "--parts", 2, "--method", "random", "--seed", 1) == 0
    assert partition(g, tmp_path / "b", "--parts", 2, "--method", "random", "--seed", 2) == 0
    os.replace(tmp_path / "b" / part_file_name(0), tmp_path / "a" / part_file_name(0))
    with pytest.raises(InputError, match="content_hash"):
        load_partition(tmp_path / "a", 0)


def test_meta_records_provenance(graph_files, tmp_path):
    out = tmp_path / "s"
    assert partition(graph_files["plain"], out, "--parts", 2, "--constraints", "vertices,edges",
                     "--ufactor", "50", "--niter", "7") == 0
    meta = read_meta(out)
    a = meta.attrs
    assert a["constraints"] == '["vertices", "edges"]' and int(a["ufactor"]) == 50 and int(a["niter"]) == 7
    assert a["source_hash"] == writer.file_sha256(graph_files["plain"])
    assert {"hpcgnn", "numpy", "h5py", "pymetis", "METIS"} <= set(__import__("json").loads(a["tool_versions"]))
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


@pytest.mark.parametrize("args, message", [
    (["--parts", "0"], "--parts 0: expected an integer in [1, 2000]"),
    (["--parts", "2001"], "--parts 2001: expected an integer in [1, 2000]"),
    (["--parts", "2", "--constraints", "vertices,bogus"], "unknown constraint 'bogus'"),
    (["--parts", "2", "--constraints", "train,train"], "listed twice"),
    (["--parts", "2", "--seed", "-1"], "--seed -1"),
    (["--parts", "2", "--ufactor", "0"], "--ufactor 0"),
    (["--parts", "2", "--niter", "0"], "--niter 0: expected an integer in [1, 1000]"),
    (["--parts", "2", "--method", "spectral"], "invalid choice: 'spectral'"),
])
def test_bad_arguments_exit_2(graph_files, tmp_path, capsys, args, message):
    out = tmp_path / "s"
    assert partition(graph_files["plain"], out, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcgnn: error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_bad_graph_files_exit_2(tmp_path, capsys):
    junk = tmp_path / "junk.h5"
    junk.write_text("not hdf5\n")
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "something-else"
    for path, message in [(tmp_path / "missing.h5", "file not found"),
                          (junk, "not a readable HDF5 file"),
                          (other, "attribute 'format' is 'something-else'"),
                          (tmp_path, "is a directory")]:
        assert partition(path, tmp_path / "s", "--parts", 2) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.h5", "other.h5"]


def test_existing_output_needs_force(graph_files, tmp_path, capsys):
    out = tmp_path / "s"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert partition(graph_files["plain"], out, "--parts", 2) == 2
    assert "already exists (pass --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert partition(graph_files["plain"], out, "--parts", 2, "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == [META_FILE, part_file_name(0), part_file_name(1)]


def test_failure_midway_leaves_nothing(graph_files, tmp_path, monkeypatch, capsys):
    """A crash while writing partition 2 leaves no output and no temporary files; --force keeps the old store."""
    real = writer._write_part

    def failing(path, data, attrs, *rest):
        if attrs["part_id"] == 2:
            raise OSError("disk full (simulated)")
        return real(path, data, attrs, *rest)

    out = tmp_path / "s"
    monkeypatch.setattr(writer, "_write_part", failing)
    assert partition(graph_files["plain"], out, "--parts", 4) == 2
    assert capsys.readouterr().err.endswith(f"hpcgnn: error: {out}: cannot write (disk full (simulated))\n")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(writer, "_write_part", real)
    assert partition(graph_files["plain"], out, "--parts", 4) == 0
    before = store_bytes(out)
    monkeypatch.setattr(writer, "_write_part", failing)
    assert partition(graph_files["plain"], out, "--parts", 4, "--method", "random", "--force") == 2
    assert capsys.readouterr().err.endswith(f"hpcgnn: error: {out}: cannot write (disk full (simulated))\n")
    assert store_bytes(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["s"]


def test_cli_subprocess_exit_code(tmp_path):
    proc = run_cli(["partition", str(tmp_path / "missing.h5"), "--parts", "2", "--out", str(tmp_path / "o")],
                   timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"hpcgnn: error: {tmp_path / 'missing.h5'}: file not found"]


def test_warns_about_partitions_without_training_vertices(make_graph_file, tmp_path, capsys):
    path = make_graph_file(n=16, intra=40, inter=4, communities=2)
    assert partition(path, tmp_path / "s", "--parts", 16, "--method", "contiguous") == 0
    err = capsys.readouterr().err
    from hpcgnn.data.graph import read_graph

    no_train = np.flatnonzero(~read_graph(path).train_mask)
    assert 1 < no_train.size < 16
    assert f"warning: partitions {', '.join(map(str, no_train[:10]))}{', ...' if no_train.size > 10 else ''} " \
           "have no training vertices" in err
    assert "have no vertices" not in err
