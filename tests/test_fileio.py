"""hpcgnn.fileio: atomic writers name their temporaries after the writer (host, pid) and remove
the stale ones that killed writers left beside the same output, with one warning line; never
another output's, never a live writer's. Real kills: a Python writer and `hpcgnn partition`."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hpcgnn.fileio import _host, atomic_dir, atomic_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpiutil import clean_env, run_cli  # noqa: E402

HEX = "0123456789ab"


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def temp(directory: Path, output: str, host: str, pid: int, suffix: str = ".tmp", age_s: float = 0) -> str:
    """Create a writer-named temporary of ``output`` (a file; a directory for ``.old``)."""
    name = f".{output}.{host}.{pid}.{HEX}{suffix}"
    make(directory, name, age_s)
    return name


def make(directory: Path, name: str, age_s: float = 0) -> str:
    path = directory / name
    if name.endswith(".old"):
        path.mkdir()
        (path / "x").write_text("previous output")
    else:
        path.write_text("partial")
    if age_s:
        t = time.time() - age_s
        if path.is_dir():
            os.utime(path / "x", (t, t))
        os.utime(path, (t, t))
    return name


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "stale temporar" in line]


def test_temporaries_record_host_and_pid_and_vanish(tmp_path):
    pattern = rf"\.out\.h5\.{re.escape(_host())}\.{os.getpid()}\.[0-9a-f]{{12}}\.tmp"
    out = tmp_path / "out.h5"
    with atomic_file(out) as tmp:
        assert re.fullmatch(pattern, tmp.name) and tmp.parent == tmp_path
        tmp.write_text("a")
    with pytest.raises(RuntimeError):
        with atomic_file(out) as tmp:
            raise RuntimeError("writer failed")
    d = tmp_path / "d"
    for _ in range(2):      # the second replaces d through a ".old" directory
        with atomic_dir(d) as tmp:
            assert re.fullmatch(pattern.replace("out\\.h5", "d"), tmp.name)
            (tmp / "f").write_text("b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "out.h5"]
    assert out.read_text() == "a" and (d / "f").read_text() == "b"


def test_only_stale_temporaries_of_this_output_are_removed(tmp_path, capsys):
    host, dead = _host(), dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [
            temp(tmp_path, "out.h5", host, dead),                              # a dead writer's
            temp(tmp_path, "out.h5", host, dead, ".old"),                      # its replaced directory
            make(tmp_path, ".out.h5.ab_cd123.tmp"),                            # old naming (no writer)
            make(tmp_path, ".out.h5.zz9yy8xx.old"),
            temp(tmp_path, "out.h5", "far-away", 77, age_s=2 * 86400),         # another host's, 2 days
        ]
        if Path("/proc/self/stat").exists():   # this pid, but the temporary predates this process
            stale.append(temp(tmp_path, "out.h5", host, os.getpid(), ".old", age_s=10 * 86400))
        kept = [
            temp(tmp_path, "out.h5", host, live.pid),                          # a live writer's
            make(tmp_path, f".out.h5.{host}.{os.getpid()}.{'f' * 12}.tmp"),    # this process's
            temp(tmp_path, "out.h5", "far-away", 77, ".old", age_s=3600),      # another host's, recent
            temp(tmp_path, "out.h52", host, dead),                             # output out.h52
            temp(tmp_path, "out.h5.x", host, dead),                            # output out.h5.x
            make(tmp_path, ".out.h5.x.ab_cd123.tmp"),                          # out.h5.x, old naming
            make(tmp_path, ".out.h5.notes"), make(tmp_path, "out.h5.bak"),
        ]
        out = tmp_path / "out.h5"
        with atomic_file(out) as tmp:
            tmp.write_text("new")
    finally:
        live.kill()
        live.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["out.h5"])
    assert out.read_text() == "new"
    err = capsys.readouterr().err
    assert err.splitlines() == [f"hpcgnn: warning: removed {len(stale)} stale temporaries of interrupted "
                                f"earlier writes to {out}: {', '.join(sorted(stale))}"]


WRITER = """
import sys, time
from hpcgnn.fileio import atomic_file
with atomic_file(sys.argv[1]) as tmp:
    tmp.write_text("partial")
    print(tmp.name, flush=True)
    time.sleep(60)
"""


def test_killed_writer_temporary_removed_by_the_next_writer(tmp_path, capsys):
    """A live writer's temporary survives another write to the same output; once the writer is
    killed, the next write removes it and says so."""
    out = tmp_path / "run.h5"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, text=True,
                             env=clean_env())
    try:
        name = child.stdout.readline().strip()
        assert name.startswith(".run.h5.") and (tmp_path / name).exists()
        with atomic_file(out) as tmp:
            tmp.write_text("1")
        assert (tmp_path / name).exists() and capsys.readouterr().err == ""
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    with atomic_file(out) as tmp:
        tmp.write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"] and out.read_text() == "2"
    assert warnings(capsys.readouterr().err) == [
        f"hpcgnn: warning: removed 1 stale temporary of an interrupted earlier write to {out}: {name}"]


def test_infer_writer_removes_a_dead_writers_temporary(tmp_path, capsys):
    """`hpcgnn infer` writes its output with write_rows (atomic_file on rank 0)."""
    import h5py
    from mpi4py import MPI

    from hpcgnn.run.rows_file import write_rows

    out = tmp_path / "pred.h5"
    stale = temp(tmp_path, "pred.h5", _host(), dead_pid())
    other = temp(tmp_path, "pred2.h5", _host(), dead_pid())
    rt = SimpleNamespace(is_root=True, comm=MPI.COMM_SELF)
    ids = np.arange(5, dtype=np.int64)[::-1].copy()
    write_rows(rt, out, ids, ids.astype(np.float32)[:, None] * 2, 5, "logits", {"what": "logits"})
    with h5py.File(out) as f:
        assert np.array_equal(f["logits"][:, 0], np.arange(5) * 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other, "pred.h5"])
    assert warnings(capsys.readouterr().err) == [
        f"hpcgnn: warning: removed 1 stale temporary of an interrupted earlier write to {out}: {stale}"]


def test_killed_partition_leftover_removed_by_the_next_run(cora_graph, tmp_path):
    """SIGKILL `hpcgnn partition` while it writes its store: the next run to the same --out removes
    the partial temporary directory and says so in one line."""
    out = tmp_path / "store"
    args = ["partition", str(cora_graph), "--parts", 16, "--method", "random", "--out", str(out), "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "hpcgnn", *map(str, args)], env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while not any(p.name.startswith(".store.") for p in tmp_path.iterdir()):
            assert proc.poll() is None, f"partition ended before its temporary appeared: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "no temporary directory appeared"
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and re.fullmatch(rf"\.store\.{re.escape(_host())}\.{proc.pid}\.[0-9a-f]{{12}}\.tmp",
                                           left[0]), left
    done = run_cli(args, timeout=120)
    assert done.returncode == 0, done.stderr
    assert warnings(done.stderr) == [
        f"hpcgnn: warning: removed 1 stale temporary of an interrupted earlier write to {out}: {left[0]}"]
    assert [p.name for p in tmp_path.iterdir()] == ["store"] and (out / "meta.h5").exists()
