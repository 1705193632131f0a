"""The README's two commands as make plans them on a fresh checkout (dry runs, no set-up done)."""
from __future__ import annotations

import shutil
import subprocess

import pytest
from mpiutil import ROOT


def _plan(tmp_path, *targets):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "setup.py").write_text("")
    proc = subprocess.run(["make", "-n", *targets], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # e.g. "Circular data <- data/cora.h5 dependency dropped"
    return [line.strip() for line in proc.stdout.splitlines()]


def _index(lines, needle):
    return next(i for i, line in enumerate(lines) if needle in line)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_demo_plan_on_a_fresh_checkout(tmp_path):
    lines = _plan(tmp_path, "demo")
    steps = ["-m venv .venv", "pip install -q --disable-pip-version-check torch==2.13.0 numpy h5py pymetis "
             "mpi4py mpich pytest", "setup.py -q build_ext --inplace", "mkdir -p data",
             "prepare --dataset cora --root inputs/data --out data/cora.h5",
             "partition data/cora.h5 --parts 2", "inspect data/cora-metis-2",
             ".venv/bin/mpiexec -n 2 .venv/bin/python -m hpcgnn train", "report runs/demo"]
    positions = [_index(lines, s) for s in steps]
    assert positions == sorted(positions)
    assert not any("synthetic-small" in line for line in lines)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_test_and_data_plans_on_a_fresh_checkout(tmp_path):
    lines = _plan(tmp_path, "test")
    assert _index(lines, "build_ext") < _index(lines, "-m pytest -q tests")
    lines = _plan(tmp_path, "data")
    assert _index(lines, "mkdir -p data") < _index(lines, "--out data/cora.h5")
    assert any("--out data/synthetic-small.h5" in line for line in lines)
    cuda = _plan(tmp_path, "install", "TORCH=torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
    assert any("torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 numpy" in line for line in cuda)
