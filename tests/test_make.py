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
             "pip install -q --disable-pip-version-check numpy h5py pymetis cmeel-metis kaminpar tensorboard matplotlib pytest",
             "pip install -q --disable-pip-version-check " + " ".join(MPI_WHEEL),
             "setup.py -q build_ext --inplace", "mkdir -p data",
             "prepare --dataset cora --root inputs/data --out data/cora.h5",
             "partition data/cora.h5 --parts 2", "inspect data/cora-metis-2",
             ".venv/bin/mpiexec -n 2 .venv/bin/python -m hpcgnn train"]
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
    assert _pip_installs(cuda) == [["--upgrade", "pip"], CUDA_TORCH.split(), DEPS, MPI_WHEEL]


CUDA_TORCH = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
DEPS = "numpy h5py pymetis cmeel-metis kaminpar tensorboard matplotlib pytest pybind11 setuptools wheel".split()
# the default MPI: mpi4py's PyPI wheel and the MPICH wheel, in a step of their own
MPI_WHEEL = "--force-reinstall --no-deps --only-binary=mpi4py,mpich mpi4py mpich".split()
# MPI=system: mpi4py compiled from source (no wheel, no cached build), no MPICH wheel
MPI_SOURCE = "--no-cache-dir --force-reinstall --no-deps --no-binary=mpi4py mpi4py".split()
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

    def install(torch=None, dry=False, mpi=()):
        log.write_text("")
        args = ["make", *(["-n"] if dry else []), "install", f"PYTHON3={python3}", *mpi]
        args += [f"TORCH={torch}"] if torch else []
        proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "HPCGNN_NATIVE_ARCH"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return _pip_installs(proc.stdout.splitlines()) if dry else \
            _pip_installs("python " + line for line in log.read_text().splitlines())

    # A fresh venv: pip, then torch alone from its index, then the rest from PyPI.
    assert install(CUDA_TORCH) == [["--upgrade", "pip"], CUDA_TORCH.split(), DEPS, MPI_WHEEL]
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
    # MPI=system on the existing venv: mpi4py alone, from source with the site's mpicc, the MPICH
    # wheel removed; again for another MPICC; back to the wheel: the wheels reinstalled over it.
    mpiccs = [tmp_path / "site-mpi" / "mpicc", tmp_path / "site-mpi" / "mpicc-2"]
    mpiccs[0].parent.mkdir()
    for mpicc in mpiccs:
        mpicc.write_text("#!/bin/sh\n")
        mpicc.chmod(0o755)
    system = ["MPI=system", f"MPICC={mpiccs[0]}"]
    assert install(CUDA_TORCH, mpi=system) == [MPI_SOURCE]
    calls = log.read_text().splitlines()
    assert calls[0] == "-m pip uninstall -q -y mpich" and len(calls) >= 2
    assert install(CUDA_TORCH, mpi=system) == []
    assert install(CUDA_TORCH, mpi=["MPI=system", f"MPICC={mpiccs[1]}"]) == [MPI_SOURCE]
    assert install(CUDA_TORCH) == [MPI_WHEEL]
    assert install(CUDA_TORCH, mpi=["MPI=wheel", "MPICC=other"]) == []   # MPICC matters with MPI=system only
    stamps = sorted(p.name for p in (tmp_path / ".venv").glob(".mpi-*"))
    assert len(stamps) == 1 and (tmp_path / ".venv" / stamps[0]).read_text().split()[0] == "wheel"
    # MPI=system without the site MPI's compiler wrapper: one line, exit 2, mpi4py untouched
    log.write_text("")
    proc = subprocess.run(["make", "install", f"PYTHON3={python3}", f"TORCH={CUDA_TORCH}", "MPI=system",
                           f"MPICC={tmp_path}/no/mpicc"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and log.read_text() == ""
    assert f"MPI=system: the site MPI's compiler wrapper '{tmp_path}/no/mpicc' is not on PATH" in proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_install_with_the_site_mpi_builds_mpi4py_from_source_without_the_mpich_wheel(tmp_path):
    lines = _plan(tmp_path, "install", "MPI=system", "MPICC=/opt/site-mpi/bin/mpicc")
    installs = _pip_installs(lines)
    assert installs == [["--upgrade", "pip"], ["torch==2.13.0"], DEPS, MPI_SOURCE]
    assert not any("mpich" in a for call in installs for a in call)          # no MPICH wheel
    source = next(line for line in lines if "--no-binary=mpi4py" in line)
    assert source.startswith("env MPICC='/opt/site-mpi/bin/mpicc' .venv/bin/python -m pip install")
    assert _index(lines, "pip uninstall -q -y mpich") < _index(lines, "--no-binary=mpi4py")
    assert _index(lines, "--no-binary=mpi4py") < _index(lines, "build_ext --inplace")
    # the site MPI's launcher, not .venv's MPICH one
    demo = _plan(tmp_path, "demo", "MPI=system")
    assert any(line.startswith("mpiexec -n 2 .venv/bin/python -m hpcgnn train") for line in demo)
    assert not any(".venv/bin/mpiexec" in line for line in demo)
    # another value: make stops before doing anything
    proc = subprocess.run(["make", "--no-print-directory", "-n", "install", "MPI=bogus"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)   # (under `make test` too)
    assert proc.returncode == 2 and "MPI=bogus: expected wheel" in proc.stderr and proc.stdout == ""


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_check_gpu_on_another_interpreter_uses_only_the_prepared_wheels(tmp_path):
    """make check-gpu PYTHON=python3 (after its probe): a venv seeing python3's packages, the
    wheels from WHEELS only, native/ built for that interpreter, then the driver; no index."""
    lines = _plan(tmp_path, "check-gpu-run", "PYTHON=python3", "WHEELS=/w")
    steps = ["python3 -m venv --without-pip --system-site-packages .venv-gpu",
             ".venv-gpu/bin/python tools/gpu_wheels.py link --base-python python3",
             ".venv-gpu/bin/python tools/gpu_wheels.py install --wheels /w",
             ".venv-gpu/bin/python setup.py -q build_ext --inplace",
             ".venv-gpu/bin/python -m tools.gpu_check --out runs/gpu-check"]
    positions = [_index(lines, s) for s in steps]
    assert positions == sorted(positions)
    assert not any("pip install" in line or ".venv/" in line for line in lines)
    # the default: .venv's usual set-up, then the driver
    lines = _plan(tmp_path, "check-gpu-run", "GPU_CHECK_ARGS=--ranks 1")
    assert _index(lines, "build_ext --inplace") < _index(lines, ".venv/bin/python -m tools.gpu_check "
                                                                "--out runs/gpu-check --ranks 1")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_demo_prints_no_line_wider_than_120_and_ends_with_the_summary(tmp_path):
    """`make demo` itself (the set-up already made by this suite's `make test`; the graph, store
    and run in tmp_path): every line at most 120 characters, the run summary last."""
    from mpiutil import clean_env

    proc = subprocess.run(["make", "--no-print-directory", "demo", f"DATA={tmp_path / 'data'}",
                           f"RUNS={tmp_path / 'runs'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).replace(str(tmp_path) + "/", "").splitlines()
    assert max(len(line) for line in lines) <= 120, [line for line in lines if len(line) > 120]
    assert lines[-2].startswith("next       hpcgnn report ") and "infer" in lines[-1]
    assert any(line.startswith("best val   ") for line in lines)
