"""runtime.host_memory: with "retain" a freed large tensor's pages stay in the process (the next
one reuses them without page faults); with glibc's default ("release") they go back to the
system. Each case runs in its own process (mallopt settings are process-wide)."""
from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys, torch
from hpcgnn.run.memory import rss_bytes
if sys.argv[1] == "retain":
    from hpcgnn.runtime import retain_freed_host_memory
    retain_freed_host_memory()
x = torch.ones(64 << 18)          # 64 MiB, touched
held = rss_bytes()
del x
print(held - rss_bytes())         # bytes given back by the free
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")


def _given_back(mode: str) -> int:
    proc = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, timeout=120,
                          env={"THP_MEM_ALLOC_ENABLE": "0", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_retain_keeps_freed_pages_and_release_returns_them():
    assert _given_back("release") > 48 << 20      # the 64 MiB mapping went back
    assert _given_back("retain") < 8 << 20        # kept for the next tensor


def test_bad_value_is_one_line():
    from hpcgnn.errors import InputError
    from hpcgnn.run.config import load_config

    with pytest.raises(InputError, match="host_memory"):
        load_config(None, ["runtime.host_memory=keep"])


def test_training_with_retained_memory_gives_the_same_losses(cora_parts, tmp_path):
    """The allocator setting changes where freed pages go, not a single value (2 ranks)."""
    from pathlib import Path

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    import mb_support as mb
    from mpiutil import ROOT

    from hpcgnn.run.runfile import read_run

    losses = {}
    for mode in ("release", "retain"):
        run = tmp_path / mode
        proc = mb.train(2, ROOT / "inputs" / "cora-sage.toml", cora_parts(2), run, "--set", "train.epochs=2",
                        "--set", "train.eval_every=0", "--set", f"runtime.host_memory={mode}", timeout=240,
                        env={"HPCGNN_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses[mode] = read_run(run)["metrics"]["loss"]
    assert np.array_equal(losses["release"], losses["retain"])
