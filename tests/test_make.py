"""The README's two commands as make plans them on a fresh checkout (dry runs, no set-up done)."""
from __future__ import annotations

import os
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
    steps = ["-m venv .venv", "pip install -q --disable-pip-version-check torch==2.13.0",
             "pip install -q --disable-pip-version-check numpy h5py pymetis cmeel-metis mpi4py mpich "
             "matplotlib pytest",
             "setup.py -q build_ext --inplace", "mkdir -p data",
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
    assert any("--normalize-features row --out data/cora-rownorm.h5" in line for line in lines)
    cuda = _plan(tmp_path, "install", f"TORCH={CUDA_TORCH}")
    assert _pip_installs(cuda) == [["--upgrade", "pip"], CUDA_TORCH.split(), DEPS]


CUDA_TORCH = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
DEPS = "numpy h5py pymetis cmeel-metis mpi4py mpich matplotlib pytest pybind11 setuptools wheel".split()
PIP = "-m pip install -q --disable-pip-version-check"


def _pip_installs(lines):
    """The arguments of each `python -m pip install` in ``lines`` (the fixed options removed),
    except the editable install of hpcgnn itself (no dependencies, no index)."""
    calls = [[a for a in line.split(PIP, 1)[1].split() if a != "\\"] for line in lines if PIP in line]
    editable = [c for c in calls if "-e" in c]
    assert all(c == ["--no-build-isolation", "--no-deps", "-e", "."] for c in editable), editable
    return [c for c in calls if "-e" not in c]


def _fake_python(tmp_path):
    """A `python3` whose `-m venv DIR` makes DIR/bin/python a program that only logs its
    arguments (one line per call) to ``log``: `make install` then runs every recipe for real,
    without downloading anything."""
    log = tmp_path / "calls.log"
    logger = tmp_path / "logger"
    logger.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{log}'\n")
    python3 = tmp_path / "python3"
    python3.write_text(f"#!/bin/sh\n[ \"$1 $2\" = '-m venv' ] || exit 1\n"
                       f"mkdir -p \"$3/bin\" && cp '{logger}' \"$3/bin/python\"\n")
    for f in (logger, python3):
        f.chmod(0o755)
    return python3, log


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("flock") is None,
                    reason="make or flock is not installed")
def test_install_runs_torch_alone_with_its_index_and_again_when_torch_changes(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "setup.py").write_text("")
    python3, log = _fake_python(tmp_path)

    def install(torch=None, dry=False):
        log.write_text("")
        args = ["make", *(["-n"] if dry else []), "install", f"PYTHON3={python3}"]
        args += [f"TORCH={torch}"] if torch else []
        proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "HPCGNN_NATIVE_ARCH"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return _pip_installs(proc.stdout.splitlines()) if dry else \
            _pip_installs("python " + line for line in log.read_text().splitlines())

    # A fresh venv: pip, then torch alone from its index, then the rest from PyPI.
    assert install(CUDA_TORCH) == [["--upgrade", "pip"], CUDA_TORCH.split(), DEPS]
    calls = log.read_text().splitlines()
    assert any("setup.py -q build_ext --inplace" in c for c in calls)
    assert (tmp_path / ".venv" / ".native-stamp").exists()
    assert install(CUDA_TORCH) == []                                 # nothing changed: no set-up
    # Another TORCH on the existing venv: the dry run plans, and make runs, the torch step only.
    assert install("torch==2.13.0", dry=True) == [["torch==2.13.0"]]
    assert install("torch==2.13.0") == [["torch==2.13.0"]]
    assert [c for c in log.read_text().splitlines() if "build_ext" in c]   # (a no-op rebuild check)
    assert install() == []                                           # the default is the same TORCH
    assert install(CUDA_TORCH) == [CUDA_TORCH.split()]               # and back again
    stamps = sorted(p.name for p in (tmp_path / ".venv").glob(".torch-*"))
    assert len(stamps) == 1 and (tmp_path / ".venv" / stamps[0]).read_text() == CUDA_TORCH + "\n"
    # setup.py changed: the other packages again, torch not.
    (tmp_path / "setup.py").write_text("# changed\n")
    assert install(CUDA_TORCH) == [DEPS]
