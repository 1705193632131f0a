"""Graph file integrity: `hpcgnn partition` refuses a graph file whose datasets do not match their
recorded hashes, or (files without them) whose CSR breaks the format's invariants, in one line
naming the file and the dataset, before writing anything; and an unwritable or failing output
is a one-line error too."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.data.graph import HASH_ATTR, check_topology, dataset_hash
from hpcgnn.errors import InputError
from hpcgnn.partition import writer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mpiutil import clean_env, run_cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def partition(graph, out, *extra) -> int:
    return main(["partition", str(graph), "--out", str(out), "--parts", "2", "--quiet", *map(str, extra)])


def flip(path: Path, kind: str, keep_hashes: bool = True) -> int:
    """Flip one low bit of one 'indices' entry in place so that the ID stays in range and is no
    self-loop, and a row is no longer sorted (``unsorted``) or the graph no longer symmetric
    while every row stays sorted (``asymmetric``). Returns the row (destination) changed."""
    with h5py.File(path, "r+") as f:
        ip, ix = f["indptr"][()], f["indices"][()]
        n = ip.shape[0] - 1
        rows = np.repeat(np.arange(n), np.diff(ip))
        first, last = np.zeros(ix.shape[0], bool), np.zeros(ix.shape[0], bool)
        first[ip[:-1][np.diff(ip) > 0]] = True
        last[ip[1:][np.diff(ip) > 0] - 1] = True
        prev = np.where(first, -1, np.roll(ix, 1))
        nxt = np.where(last, n, np.roll(ix, -1))
        for bit in range(12):
            x = ix ^ (1 << bit)
            ok = (x < n) & (x != rows)
            ok &= ((x < prev) | (x > nxt)) if kind == "unsorted" else ((x > prev) & (x < nxt))
            if ok.any():
                k = int(np.argmax(ok))
                f["indices"][k] = x[k]
                if not keep_hashes:
                    del f.attrs[HASH_ATTR]
                return int(rows[k])
    raise AssertionError(f"no {kind} bit flip found")


@pytest.fixture
def copy(cora_graph, tmp_path):
    """A private copy of the Cora graph file in an otherwise empty directory."""
    path = tmp_path / "cora.h5"
    shutil.copyfile(cora_graph, path)
    return path


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcgnn: error: "), err
    return lines[0]


def test_writer_records_every_datasets_hash(copy):
    with h5py.File(copy) as f:
        recorded = json.loads(f.attrs[HASH_ATTR])
        assert set(recorded) == {"indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask"}
        for name, digest in recorded.items():
            assert dataset_hash(name, f[name][()]) == digest


@pytest.mark.parametrize("kind", ["unsorted", "asymmetric"])
def test_bit_flip_refused_by_the_recorded_hash(copy, tmp_path, capsys, kind):
    flip(copy, kind)
    assert partition(copy, tmp_path / "out") == 2
    assert one_error(capsys) == (f"hpcgnn: error: {copy}: dataset 'indices' does not match the file's recorded "
                                 f"content hash (the file is corrupt or was modified; run hpcgnn prepare again)")
    assert [p.name for p in tmp_path.iterdir()] == ["cora.h5"]


@pytest.mark.parametrize("kind, message", [("unsorted", "dataset 'indices' is not sorted within row {v} "),
                                           ("asymmetric", "dataset 'indices' is not symmetric: vertex ")])
def test_bit_flip_refused_by_the_invariants_without_hashes(copy, tmp_path, capsys, kind, message):
    """A file written before the hashes were recorded gets the invariant checks."""
    v = flip(copy, kind, keep_hashes=False)
    assert partition(copy, tmp_path / "out") == 2
    assert one_error(capsys).startswith(f"hpcgnn: error: {copy}: " + message.format(v=v))
    assert [p.name for p in tmp_path.iterdir()] == ["cora.h5"]


def test_corrupt_file_in_a_real_process(copy, tmp_path):
    flip(copy, "asymmetric")
    proc = run_cli(["partition", copy, "--parts", "2", "--out", tmp_path / "out"], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [f"hpcgnn: error: {copy}: dataset 'indices' does not match the file's "
                                        f"recorded content hash (the file is corrupt or was modified; run hpcgnn "
                                        f"prepare again)"]
    assert [p.name for p in tmp_path.iterdir()] == ["cora.h5"]


def test_corrupt_features_refused(copy, tmp_path, capsys):
    with h5py.File(copy, "r+") as f:
        f["features"][5, 7] = np.float32(f["features"][5, 7] + 1)
    assert partition(copy, tmp_path / "out") == 2
    assert f"{copy}: dataset 'features' does not match the file's recorded content hash" in one_error(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["cora.h5"]


def test_intact_files_partition(copy, tmp_path):
    assert partition(copy, tmp_path / "a") == 0
    with h5py.File(copy, "r+") as f:       # as written before the hashes were recorded
        del f.attrs[HASH_ATTR]
    assert partition(copy, tmp_path / "b") == 0


@pytest.mark.parametrize("edges, message", [
    ([(0, 1), (1, 0), (2, 2)], "holds a self-loop at vertex 2"),
    ([(0, 1), (0, 1), (1, 0)], "is not sorted within row 1"),
    ([(0, 1), (1, 2), (2, 0)], r"is not symmetric \(an edge u -> v has no v -> u"),   # degrees all equal
    ([(0, 1), (1, 0), (0, 2)], "is not symmetric: vertex 0 has 1 in-edges but is the source of 2 edges"),
])
def test_check_topology(edges, message):
    src, dst = np.array(edges).T
    order = np.lexsort((src, dst))
    indptr = np.zeros(4, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=3), out=indptr[1:])
    for dtype in (np.int64, np.int32):
        with pytest.raises(InputError, match=f"^g.h5: dataset 'indices' {message}"):
            check_topology("g.h5", indptr, src[order].astype(dtype), block=2)
    check_topology("g.h5", np.array([0, 2, 3, 4]), np.array([1, 2, 0, 0]), block=1)   # symmetric


def test_write_failure_is_one_line_and_leaves_nothing(copy, tmp_path, capsys, monkeypatch):
    real = writer._write_part

    def full(path, data, attrs, *args, **kwargs):
        if attrs["part_id"] == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data, attrs, *args, **kwargs)

    monkeypatch.setattr(writer, "_write_part", full)
    assert partition(copy, tmp_path / "out") == 2
    assert one_error(capsys) == f"hpcgnn: error: {tmp_path / 'out'}: cannot write (No space left on device (ENOSPC))"
    assert [p.name for p in tmp_path.iterdir()] == ["cora.h5"]


def test_unwritable_output_directory(cora_graph):
    """A read-only --out parent is refused up front in one line (root ignores permissions, so
    as root the command runs as user nobody)."""
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a directory unwritable")
        prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        probe = subprocess.run([*prefix, sys.executable, "-c", "import hpcgnn.cli"], capture_output=True,
                               env=clean_env(), cwd="/")
        if probe.returncode != 0:
            pytest.skip(f"user nobody cannot run this checkout's Python: {probe.stderr.decode()[-200:]}")
    work = Path(tempfile.mkdtemp(prefix="hpcgnn-test-ro."))   # pytest's tmp_path is private to root
    try:
        work.chmod(0o755)
        graph = work / "cora.h5"
        shutil.copyfile(cora_graph, graph)
        graph.chmod(0o644)
        ro = work / "ro"
        ro.mkdir(mode=0o555)
        ro.chmod(0o555)
        cmd = [*prefix, sys.executable, "-m", "hpcgnn", "partition", str(graph), "--parts", "2",
               "--out", str(ro / "store")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env(), cwd="/")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.splitlines() == [
            f"hpcgnn: error: {ro}: output directory is not writable (Permission denied (EACCES))"]
        assert list(ro.iterdir()) == []
    finally:
        shutil.rmtree(work, ignore_errors=True)
