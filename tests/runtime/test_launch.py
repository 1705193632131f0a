"""Runtime.start under real launchers: rank/size/local_size, threads per rank, the launcher guard."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mpiutil import clean_env, run_mpi

from hpcgnn.demos.hello import parse

CORES = len(os.sched_getaffinity(0))


def default_threads(ranks_on_node: int) -> int:
    """Reference for Runtime.start(threads=0) when no launcher binds ranks to CPUs."""
    return max(1, CORES // ranks_on_node)


def test_single_rank_world_uses_all_cores_and_echoes_arguments():
    # mpiutil exports OMP_NUM_THREADS=1: torch and the OpenMP kernels must be set explicitly.
    proc = run_mpi(1, ["-m", "hpcgnn.demos.hello", "--set", "a=b c"], timeout=90)
    assert proc.returncode == 0, proc.stderr
    (line,) = parse(proc.stdout)
    assert (line["rank"], line["size"], line["local_rank"], line["local_size"]) == (0, 1, 0, 1)
    assert line["threads"] == line["torch_threads"] == line["native_threads"] == default_threads(1)
    assert "argv: --set 'a=b c'" in proc.stdout


def _run_guard(env: dict) -> subprocess.CompletedProcess:
    """One process, no mpiexec, with launcher variables that announce a bigger world."""
    return subprocess.run([sys.executable, "-m", "hpcgnn.demos.hello"], capture_output=True,
                          text=True, timeout=60, env=clean_env(env))


@pytest.mark.parametrize("var", ["PMI_SIZE", "SLURM_NTASKS"])
def test_launcher_mismatch_stops_with_one_line_and_exit_2(var):
    proc = _run_guard({var: "4"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"hpcgnn: error: {var}=4 but MPI.COMM_WORLD has size 1")
    assert "mpiexec" in lines[0] and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_launcher_size_prefers_the_mpi_launcher_over_the_allocation(monkeypatch):
    from hpcgnn.runtime.process import _launcher_size

    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert _launcher_size() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")           # python straight in an sbatch script
    assert _launcher_size() == ("SLURM_NTASKS", 4)
    monkeypatch.setenv("PMI_SIZE", "1")               # `mpiexec -n 1` inside that allocation
    assert _launcher_size() is None
    monkeypatch.setenv("PMI_SIZE", "2")
    assert _launcher_size() == ("PMI_SIZE", 2)


def test_bad_thread_override_is_an_input_error(monkeypatch):
    from hpcgnn.errors import InputError
    from hpcgnn.runtime.process import _env_int

    monkeypatch.setenv("HPCGNN_THREADS", "two")
    with pytest.raises(InputError, match="HPCGNN_THREADS='two'"):
        _env_int("HPCGNN_THREADS", 1)
    monkeypatch.setenv("HPCGNN_THREADS", "0")
    with pytest.raises(InputError, match=">= 1"):
        _env_int("HPCGNN_THREADS", 1)
    monkeypatch.setenv("HPCGNN_THREADS", " 3 ")
    assert _env_int("HPCGNN_THREADS", 1) == 3
    monkeypatch.delenv("HPCGNN_THREADS")
    assert _env_int("HPCGNN_THREADS", 1) is None


def test_backend_resolution_on_a_cpu_only_torch():
    """runtime.backend's one home, hpcgnn.comm.communicator.choose_backend: auto is nccl with
    CUDA (mpi4py on a torch without NCCL), ccl on the CPU when oneCCL imports, else mpi4py;
    impossible pairs are one line."""
    import torch.distributed as dist

    from hpcgnn.comm.communicator import ccl_available, choose_backend
    from hpcgnn.errors import InputError

    if ccl_available():
        pytest.skip("oneccl_bindings_for_pytorch is installed here: 'ccl' resolves to itself")
    assert choose_backend("auto", "cpu") == "mpi4py"
    assert choose_backend("gloo", "cpu") == "gloo"
    assert choose_backend("mpi4py", "cuda:0") == "mpi4py"
    assert choose_backend("auto", "cuda:0") == ("nccl" if dist.is_nccl_available() else "mpi4py")
    with pytest.raises(InputError, match="'ccl' but oneccl_bindings_for_pytorch does not import"):
        choose_backend("ccl", "cpu")
    with pytest.raises(InputError, match="'ccl' cannot move CUDA tensors"):
        choose_backend("ccl", "cuda")
    with pytest.raises(InputError, match="'nccl' needs train.device = 'cuda'"):
        choose_backend("nccl", "cpu")
    if not dist.is_nccl_available():
        with pytest.raises(InputError, match="has no NCCL"):
            choose_backend("nccl", "cuda:0")
    with pytest.raises(InputError, match="expected one of auto, mpi4py"):
        choose_backend("mpi", "cpu")


def test_oversubscribed_mpich_ranks_sleep_while_they_wait():
    """More ranks on the node than CPUs under MPICH's mpiexec: every rank starts MPI with
    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (waiting ranks sleep instead of spinning on the cores the
    working ranks need); as many ranks as CPUs or fewer: unset; a user's own value is kept."""
    over = CORES + 1
    proc = run_mpi(over, ["-m", "hpcgnn.demos.hello"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    lines = parse(proc.stdout)
    assert len(lines) == over and {ln["mpi_yield"] for ln in lines} == {1}, proc.stdout
    proc = run_mpi(1, ["-m", "hpcgnn.demos.hello"], timeout=90)
    assert [ln["mpi_yield"] for ln in parse(proc.stdout)] == ["-"], proc.stdout
    proc = run_mpi(over, ["-m", "hpcgnn.demos.hello"], timeout=180, env={"MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"})
    assert {ln["mpi_yield"] for ln in parse(proc.stdout)} == {0}, proc.stdout


def test_yield_when_oversubscribed_reads_hydras_local_rank_count():
    from hpcgnn.runtime import HEAVY_YIELD_VAR, yield_when_oversubscribed

    env = {"MPI_LOCALNRANKS": "4"}
    assert yield_when_oversubscribed(env, cpus=2) and env[HEAVY_YIELD_VAR] == "1"
    env = {"MPI_LOCALNRANKS": "2"}
    assert not yield_when_oversubscribed(env, cpus=2) and HEAVY_YIELD_VAR not in env
    env = {}                                        # not under Hydra (srun, Open MPI, no launcher)
    assert not yield_when_oversubscribed(env, cpus=1) and env == {}
    env = {"MPI_LOCALNRANKS": "8", HEAVY_YIELD_VAR: "0"}
    assert not yield_when_oversubscribed(env, cpus=2) and env[HEAVY_YIELD_VAR] == "0"
