"""Checkpoints: atomic write, pruning, hash check, and a writer killed mid-write."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from hpcgnn.errors import InputError
from hpcgnn.run.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint

HASH = "12" * 32


@pytest.fixture(scope="module")
def rt():
    from mpi4py import MPI

    from hpcgnn.runtime import Runtime

    return Runtime.start(threads=1, comm=MPI.COMM_SELF)


def test_round_trip_keep_and_hash(tmp_path, rt):
    assert load_latest_checkpoint(tmp_path, HASH) is None
    for e in (1, 2, 3):
        save_checkpoint(tmp_path, e, {"content_hash": HASH, "w": torch.full((3,), float(e)),
                                      "rng": {"a": [1, 2]}}, rt, keep=2)
    assert [e for e, _ in list_checkpoints(tmp_path)] == [2, 3]
    state = load_latest_checkpoint(tmp_path, HASH)
    assert state["epoch"] == 3 and torch.equal(state["w"], torch.full((3,), 3.0))
    assert state["rng"] == {"a": [1, 2]}
    with pytest.raises(InputError, match="partition store"):
        load_latest_checkpoint(tmp_path, "ff" * 32)
    # an unreadable newest file is skipped in favour of the previous one
    (tmp_path / "checkpoints" / "ckpt-000004.pt").write_bytes(b"garbage")
    assert load_latest_checkpoint(tmp_path, HASH)["epoch"] == 3


def test_writer_killed_mid_write_keeps_old_checkpoint(tmp_path):
    """The writer SIGKILLs itself while torch.save streams the new file: the old one survives."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from mpi4py import MPI
        from hpcgnn.runtime import Runtime
        from hpcgnn.run.checkpoint import save_checkpoint

        class KillWhilePickled:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)

        rt = Runtime.start(threads=1, comm=MPI.COMM_SELF)
        save_checkpoint({str(tmp_path)!r}, 1, {{"content_hash": {HASH!r}, "w": torch.ones(4)}}, rt, keep=3)
        big = torch.arange(2_000_000, dtype=torch.float32)
        save_checkpoint({str(tmp_path)!r}, 2, {{"content_hash": {HASH!r}, "big": big, "z": KillWhilePickled()}},
                        rt, keep=3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "ckpt-000001.pt" in files and "ckpt-000002.pt" not in files
    assert any(f.startswith(".ckpt-000002.pt.") and f.endswith(".tmp") for f in files)  # partial file left
    state = load_latest_checkpoint(tmp_path, HASH)
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(4))
