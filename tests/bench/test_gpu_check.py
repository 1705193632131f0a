"""`make check-gpu` (tools/gpu_check.py) and the wheels for it (tools/gpu_wheels.py).

Without a GPU: the one-line exit of `make check-gpu`, the driver's self-check (`--device cpu`:
the checked runs are CPU runs too, so the curves must agree exactly) with its table and HDF5
file, its comparison and failure logic, and the pip commands of the wheel script. The `cuda`
tests run each engine and mode for real on a GPU (pytest -m cuda) and are skipped without one.
"""
from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from mpiutil import ROOT, clean_env, python

from tools import gpu_check as gc
from tools import gpu_wheels


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _driver(out, *args, timeout=240):
    return subprocess.run([*python(), "-m", "tools.gpu_check", "--out", str(out), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=clean_env())


# --- without a GPU --------------------------------------------------------------------------

def _make_without_a_gpu(target: str, runs) -> list[str]:
    """``make TARGET RUNS=runs`` on a machine without a GPU: exit 0, nothing on stderr, one line
    saying so; its output lines."""
    proc = subprocess.run(["make", "--no-print-directory", target, f"RUNS={runs}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("check-gpu: no CUDA GPU visible to PyTorch"), lines
    return lines


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_check_gpu_without_a_gpu_is_one_line_and_exit_0(tmp_path):
    if _cuda():
        pytest.skip("a CUDA GPU is visible: make check-gpu would run the check")
    lines = _make_without_a_gpu("check-gpu", tmp_path)
    assert lines[0].endswith("; nothing to check") and not (tmp_path / "gpu-check").exists()
    # no interpreter set up yet (a fresh checkout): nvidia-smi decides, nothing is installed
    if shutil.which("nvidia-smi") is None:
        proc = subprocess.run(["make", "--no-print-directory", "check-gpu", f"VENV={tmp_path}/venv"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=clean_env())
        assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1, proc.stdout + proc.stderr
        assert "no CUDA GPU (nvidia-smi lists none" in proc.stdout and not (tmp_path / "venv").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_check_gpu_all_without_a_gpu_is_one_line_and_exit_0(tmp_path):
    if _cuda():
        pytest.skip("a CUDA GPU is visible: make check-gpu-all would run the session")
    _make_without_a_gpu("check-gpu-all", tmp_path)
    assert not any(tmp_path.iterdir())
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_session", "--out", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env())
    assert proc.returncode == 0 and proc.stdout.startswith("gpu-session: no CUDA GPU visible"), proc.stdout
    assert proc.stdout.count("\n") == 1 and not (tmp_path / "s").exists()


def test_concurrency_defaults():
    assert [gc.default_jobs(c) for c in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    assert gc.run_threads(1, 16) == 0                       # serial: the runtime's own choice
    assert gc.run_threads(4, 16) == 2 and gc.run_threads(4, 2) == 1


def test_driver_without_a_gpu_is_one_line_and_exit_0(tmp_path):
    if _cuda():
        pytest.skip("a CUDA GPU is visible")
    proc = _driver(tmp_path, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("\n") == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("gpu-check: no CUDA GPU visible") and not (tmp_path / "gpu-check.h5").exists()


def test_self_check_on_the_cpu_writes_the_table_and_file(tmp_path):
    """Also the concurrent path (--jobs 2: the CPU reference beside the device run, each with the
    threads of run_threads)."""
    proc = _driver(tmp_path, "--device", "cpu", "--graph", "sbm:200", "--epochs", "2", "--ranks", "1",
                   "--modes", "fullgraph-offload-dedup,comm-nccl", "--jobs", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("mode "):].splitlines()
    assert table[2].split()[:3] == ["fullgraph-offload-dedup", "1", "mpi4py"] and table[2].split()[-2:] == [
        "0.00e+00", "ok"]
    assert table[3].split()[:3] == ["comm-nccl", "1", "nccl"] and table[3].endswith("skipped")
    assert table[4].strip() == "nccl needs CUDA"
    with h5py.File(tmp_path / "gpu-check.h5", "r") as f:
        assert f.attrs["format"] == "hpcgnn-bench-gpu-check" and f.attrs["rtol"] == 1e-4
        assert f.attrs["device"] == "cpu" and f.attrs["epochs"] == 2
        r, s = f["rows/00"], f["rows/01"]
        assert r.attrs["mode"] == "fullgraph-offload-dedup" and r.attrs["status"] == "ok" and r.attrs["ranks"] == 1
        cpu, dev = r["loss_cpu"][()], r["loss_device"][()]
        assert cpu.shape == (2,) and np.all(np.isfinite(cpu))
        assert np.array_equal(cpu, dev) and r.attrs["loss_max_dev"] == 0.0   # CPU against CPU: bitwise
        assert r.attrs["h2d_bytes_per_epoch"] > 0 and r.attrs["peak_device_bytes"] > 0 and r.attrs["epoch_s"] > 0
        assert r.attrs["peak_device_setup_bytes"] >= r.attrs["peak_device_bytes"]      # set-up included
        ratio = r.attrs["estimate_ratio"]
        # for calibration: the estimate's terms per rank and where each epoch's peak was reached
        terms = json.loads(r.attrs["estimated_device_terms"])
        assert len(terms) == 1 and sum(terms[0].values()) > 0 and "cuda_context" not in terms[0]
        phases = json.loads(r.attrs["peak_device_phase"])
        assert len(phases) == 2 and all(len(row) == 1 and row[0] for row in phases)
        assert s.attrs["status"] == "skipped" and "loss_max_dev" not in s.attrs
    # the run files the row came from
    from hpcgnn.run.runfile import read_run
    ref = read_run(tmp_path / "work" / "ref-fullgraph-offload-dedup-cpu-mpi4py-1")
    assert np.array_equal(ref["metrics"]["loss"], cpu) and ref["attrs"]["fullgraph_mode"] == "offload"
    threads = gc.run_threads(2, gc.usable_cpus())
    assert threads >= 1 and json.loads(ref["attrs"]["rank_threads"]) == [threads]
    # est/peak: the device run's recorded pre-run estimate over its measured peak
    dev_run = read_run(tmp_path / "work" / "dev-fullgraph-offload-dedup-cpu-mpi4py-1")
    assert json.loads(dev_run["attrs"]["rank_threads"]) == [threads]
    est = json.loads(dev_run["attrs"]["estimated_peak_device_bytes"])[0]
    assert ratio == pytest.approx(est / np.nanmax(dev_run["counters"]["peak_device_bytes"]))


def test_a_failing_run_is_failed_with_its_error_and_exit_1(tmp_path):
    proc = _driver(tmp_path, "--device", "cpu", "--graph", "sbm:200", "--epochs", "1", "--ranks", "1",
                   "--modes", "fullgraph-memory", "--set", "train.lr=-1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gpu-check: 1 rows, 1 failed" in proc.stdout
    with h5py.File(tmp_path / "gpu-check.h5", "r") as f:
        row = f["rows/00"]
        assert row.attrs["status"] == "FAILED"
        assert row.attrs["error"].startswith("CPU reference run: exit 2: hpcgnn: error: ")
        assert "train.lr = -1" in row.attrs["error"]


def test_deviation_status_and_error_line():
    assert gc.deviation([2.0, 1.0], [2.0, 1.0]) == 0.0
    assert gc.deviation([2.0, 1.0002], [2.0, 1.0]) == pytest.approx(2e-4)
    assert gc.deviation([2.0], [2.0, 1.0]) == float("inf")            # a curve cut short
    assert gc.deviation([2.0, float("nan")], [2.0, 1.0]) == float("inf")
    assert gc.row_status(5e-5, 1e-4, "") == ("ok", "")
    status, why = gc.row_status(2e-4, 1e-4, "")
    assert status == "DEVIATES" and why == "loss deviates from the CPU run by 0.0002 (rtol 0.0001)"
    assert gc.row_status(float("inf"), 1e-4, "")[0] == "DEVIATES"
    assert gc.row_status(None, 1e-4, "exit 1: boom") == ("FAILED", "exit 1: boom")
    log = "mpiexec -n 2 ...\nTraceback (most recent call last):\n  File x\nRuntimeError: CUDA error: out of memory\n"
    assert gc.error_line(log) == "RuntimeError: CUDA error: out of memory"
    log += "hpcgnn: rank 1/2 on gpu7 failed: RuntimeError: CUDA error: out of memory\nAbort(1) on node 1\n"
    assert gc.error_line(log) == "hpcgnn: rank 1/2 on gpu7 failed: RuntimeError: CUDA error: out of memory"
    assert gc.error_line("x\nhpcgnn: error: config: train.lr = -1, expected > 0\n") == \
        "hpcgnn: error: config: train.lr = -1, expected > 0"
    assert gc.error_line("\n\n") == "no output"


def test_logits_deviation_and_table(tmp_path):
    ref = np.array([[1.0, -4.0], [0.5, 2.0]], dtype=np.float32)
    for name, a in (("ref", ref), ("dev", ref + np.float32(4e-4)), ("short", ref[:1])):
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            f["logits"] = a
    assert gc.logits_deviation(tmp_path / "dev.h5", tmp_path / "ref.h5") == pytest.approx(1e-4, rel=1e-3)
    assert gc.logits_deviation(tmp_path / "short.h5", tmp_path / "ref.h5") == float("inf")
    rows = [{"mode": "fullgraph-memory", "ranks": 2, "backend": "gloo", "epoch_s": 0.5, "peak_device_bytes": 3 * 2 ** 20,
             "h2d_bytes_per_epoch": None, "loss_max_dev": 2e-4, "status": "DEVIATES", "error": "loss deviates"}]
    lines = gc.format_table(rows).splitlines()
    assert lines[2].split() == ["fullgraph-memory", "2", "gloo", "0.500", "3.0", "-", "-", "2.00e-04", "DEVIATES"]
    assert lines[3] == "    loss deviates"
    rows[0]["estimate_ratio"] = 1.234
    assert gc.format_table(rows).splitlines()[2].split()[5] == "1.23"


def test_estimate_ratio_names_the_rank_furthest_from_one():
    peaks = np.array([[100.0, 400.0], [120.0, 380.0]])          # epochs x ranks: rank peaks 120, 400
    assert gc.estimate_ratio("[150, 380]", peaks) == pytest.approx(1.25)   # 1.25 beats 0.95
    assert gc.estimate_ratio("[126, 200]", peaks) == pytest.approx(0.5)    # an estimate that fell short
    assert gc.estimate_ratio("[null, 200]", peaks) == pytest.approx(0.5)
    assert gc.estimate_ratio(None, peaks) is None and gc.estimate_ratio("[1, 2]", None) is None


# --- the wheels for a machine without a package index --------------------------------------

def test_wheel_download_commands_pin_this_venvs_versions(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_wheels.py"), "download", "--dry-run",
                           "--dest", str(tmp_path / "w"), "--freeze-from", sys.executable],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cmds = [line.split() for line in proc.stdout.splitlines()]
    assert len(cmds) == len(gpu_wheels.PACKAGES) and not (tmp_path / "w").exists()
    for cmd, name in zip(cmds, gpu_wheels.PACKAGES):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        assert cmd[-3:] == ["-d", str(tmp_path / "w"), f"{name}=={importlib.metadata.version(name).split('+')[0]}"]
        assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
        assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"
        assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"] == [
            "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    assert {"mpich", "mpi4py", "pymetis", "cmeel-metis", "pybind11"} <= set(gpu_wheels.PACKAGES)


def test_wheel_install_takes_only_what_is_missing_from_the_folder(tmp_path):
    names = ["mpi4py-4.1.2-cp312-cp312-manylinux1_x86_64.whl", "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl",
             "cmeel_metis-5.2.1.1-0-py3-none-manylinux_2_28_x86_64.whl", "pymetis-2025.2.2-cp312-cp312-x.whl"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    no_mpi = gpu_wheels.install_command("py", tmp_path, probe=lambda py, code: "mpi4py" not in code)
    assert no_mpi == ["py", "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
                      "--ignore-installed", str(tmp_path / names[0]), str(tmp_path / names[1])]
    assert gpu_wheels.install_command("py", tmp_path, probe=lambda py, code: True) is None
    with pytest.raises(SystemExit, match=r"no wheel for cmeel, cmeel-gklib \(run"):
        gpu_wheels.install_command("py", tmp_path, probe=lambda py, code: "cmeel" not in code)
    # this venv has every package: nothing to install, nothing run
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_wheels.py"), "install", "--dry-run",
                           "--wheels", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.endswith("has every package; nothing to install\n"), proc.stdout


# --- on a GPU: each engine and mode on CUDA against the CPU (pytest -m cuda) ---------------

@pytest.fixture(scope="module")
def cuda_rows(tmp_path_factory):
    """One ``make check-gpu`` driver run of every mode at 1 and 2 ranks on a 400-vertex SBM graph
    (prepared, partitioned and trained on the CPU once for all of them): {(mode, ranks): row}."""
    if not _cuda():
        pytest.skip("no CUDA GPU")
    out = tmp_path_factory.mktemp("gpu-check")
    proc = _driver(out, "--graph", "sbm:400", "--epochs", "3", "--ranks", "1,2", timeout=1800)
    with h5py.File(out / "gpu-check.h5", "r") as f:
        rows = {(str(r.attrs["mode"]), int(r.attrs["ranks"])): dict(r.attrs) for r in f["rows"].values()}
    return proc, rows


@pytest.mark.cuda
@pytest.mark.parametrize("mode", list(gc.MODES))
def test_cuda_mode_matches_the_cpu(cuda_rows, mode):
    proc, rows = cuda_rows
    ranks = gc.MODES[mode].ranks or (1, 2)
    for k in ranks:
        r = rows[(mode, k)]
        assert r["status"] == "ok", (mode, k, r.get("error"), proc.stdout[-3000:])
        assert r["loss_max_dev"] <= 1e-4
        assert "infer" == mode or "cuda" in r.get("devices", "cuda")


def test_rows_after_the_deadline_are_skipped_and_each_row_is_kept_when_done(tmp_path):
    """--deadline: a row measured while time is left is reported (its line printed, the file
    written) at once; the rows after the deadline are skipped with "no time left", none run."""
    import time
    from types import SimpleNamespace

    args = SimpleNamespace(modes=["fullgraph-memory", "fullgraph-offload-dedup"], ranks=[1], device="cpu",
                           rtol=1e-4, timeout=900.0, deadline=time.time() + 3600)
    measured, reported = [], []

    def measure(name, k, row):
        measured.append(name)
        args.deadline = time.time() - 1          # the first row used up the time
        return 0.0, ""

    rows = gc._rows(args, [(m, 1) for m in args.modes], measure, lambda rows: reported.append(len(rows)))
    assert measured == ["fullgraph-memory"] and reported == [1]
    assert [r["status"] for r in rows] == ["ok", "skipped"]
    assert rows[1]["error"] == "no time left (--deadline)"
    assert gc.run_timeout(args) < 0 and gc.launch(["train"], 1, tmp_path / "x.log", -1.0, None)[1] == \
        "no time left (--deadline)"
