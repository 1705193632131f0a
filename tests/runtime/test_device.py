"""GPU placement (choose_cuda_device, a pure function: no GPU needed), resolve_device on the CPU,
and the failure hooks of Runtime.guard in one process (COMM_SELF)."""
from __future__ import annotations

import pytest
import torch

from hpcgnn.errors import InputError
from hpcgnn.run.config import load_config
from hpcgnn.runtime import DeviceChoice, choose_cuda_device


@pytest.fixture(scope="module")
def rt():
    from mpi4py import MPI

    from hpcgnn.runtime import Runtime

    return Runtime.start(threads=1, comm=MPI.COMM_SELF)


# ---- choose_cuda_device -------------------------------------------------------------
def test_one_gpu_per_local_rank_when_every_rank_sees_the_node():
    # mpiexec on a 4-GPU node: distinct devices, nobody shares
    got = [choose_cuda_device(r, 4, 4, {}) for r in range(4)]
    assert [c.index for c in got] == [0, 1, 2, 3]
    assert not any(c.shared for c in got)
    assert got[2].how == "node-local rank 2 of 4, 4 visible GPU(s)"
    # more GPUs than ranks: the first ones
    assert [choose_cuda_device(r, 2, 8, {}).index for r in range(2)] == [0, 1]


def test_cuda_visible_devices_is_honoured_through_the_visible_count():
    # CUDA_VISIBLE_DEVICES=2,3 on every rank: torch sees 2 devices, indices are relative to them
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert [choose_cuda_device(r, 2, 2, env).index for r in range(2)] == [0, 1]


def test_fewer_gpus_than_local_ranks_are_shared_round_robin():
    got = [choose_cuda_device(r, 4, 2, {}) for r in range(4)]
    assert [c.index for c in got] == [0, 1, 0, 1]
    assert all(c.shared for c in got)
    assert got[0].how == "4 ranks on the node share 2 visible GPU(s) round-robin"
    # one GPU, two ranks (a workstation): both use it and say so
    assert choose_cuda_device(1, 2, 1, {}) == DeviceChoice(
        0, True, "2 ranks on the node share 1 visible GPU(s) round-robin")


def test_slurm_gpus_per_task_binding_uses_index_0():
    # srun --gpus-per-task=1: every task sees exactly its own GPU (CUDA_VISIBLE_DEVICES differs
    # per task, or is "0" everywhere under a device cgroup)
    for r in range(4):
        c = choose_cuda_device(r, 4, 1, {"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": str(r)})
        assert (c.index, c.shared) == (0, False), c
        assert "SLURM_GPUS_PER_TASK=1" in c.how
    # a typed request ("a100:2"), two GPUs per task: the first of its own
    assert choose_cuda_device(3, 4, 2, {"SLURM_GPUS_PER_TASK": "a100:2"}).index == 0


def test_gpus_per_task_set_but_all_node_gpus_visible_is_no_binding():
    # mpiexec inside `sbatch --gpus-per-task=1 --ntasks-per-node=4`: the batch environment says 1
    # per task, yet every rank sees the job's 4 GPUs on the node -> node-local rank
    env = {"SLURM_GPUS_PER_TASK": "1", "SLURM_JOB_GPUS": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert [choose_cuda_device(r, 4, 4, env).index for r in range(4)] == [0, 1, 2, 3]
    # SLURM_JOB_GPUS alone (batch step) is no per-task binding either: one visible GPU is shared
    assert choose_cuda_device(1, 2, 1, {"SLURM_JOB_GPUS": "0,1"}).shared


def test_slurm_gpu_bind_of_a_step_uses_index_0():
    # srun --gres=gpu:4 --gpu-bind=single:1: the step has 4 GPUs on the node, the task sees 1
    env = {"SLURM_STEP_GPUS": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "2"}
    assert choose_cuda_device(2, 4, 1, env) == DeviceChoice(
        0, False, "SLURM binds 1 of the step's 4 GPUs on the node to this task")
    # the step's GPUs all visible (no binding): node-local rank
    env = {"SLURM_STEP_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert [choose_cuda_device(r, 2, 2, env).index for r in range(2)] == [0, 1]


def test_no_visible_device_is_an_input_error_naming_cuda_visible_devices():
    with pytest.raises(InputError, match=r"no CUDA device is visible to this rank "
                                         r"\(CUDA_VISIBLE_DEVICES=''\)"):
        choose_cuda_device(0, 1, 0, {"CUDA_VISIBLE_DEVICES": ""})


# ---- resolve_device ---------------------------------------------------------------
def _cfg(device):
    return load_config(None, ["data.partitions=x", f"train.device={device}"])


def test_resolve_device_cpu_records_the_choice_on_the_runtime(rt):
    from hpcgnn.engine.device import resolve_device

    rt.device = rt.device_choice = None
    assert resolve_device(_cfg("cpu"), rt) == torch.device("cpu")
    assert (rt.device, rt.device_choice) == ("cpu", None)
    if not torch.cuda.is_available():
        assert resolve_device(_cfg("auto"), rt) == torch.device("cpu")
    rt.device = None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_resolve_device_cuda_without_cuda_is_an_input_error(rt):
    from hpcgnn.engine.device import resolve_device

    with pytest.raises(InputError, match="train.device = 'cuda' but torch sees no CUDA device"):
        resolve_device(_cfg("cuda"), rt)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resolve_device_cuda_sets_the_current_device(rt):
    from hpcgnn.engine.device import resolve_device

    dev = resolve_device(_cfg("cuda"), rt)
    assert dev.type == "cuda" and torch.cuda.current_device() == dev.index
    assert rt.device == str(dev) and rt.device_choice.index == dev.index
    rt.device = rt.device_choice = None


# ---- failure hooks ------------------------------------------------------------------
def test_guard_runs_failure_hooks_before_leaving(rt, capsys):
    seen = []
    rt.on_failure(seen.append)
    with pytest.raises(SystemExit) as exc:
        with rt.guard():
            raise InputError("model.hidden = 0, expected > 0")
    assert exc.value.code == 2 and seen == ["model.hidden = 0, expected > 0"]
    assert capsys.readouterr().err.strip() == "hpcgnn: error: model.hidden = 0, expected > 0"

    rt.on_failure(seen.append)
    with pytest.raises(SystemExit) as exc:
        with rt.guard():
            raise RuntimeError("boom\nsecond line")
    assert exc.value.code == 1 and seen[-1] == "rank 0: RuntimeError: boom second line"
    assert "Traceback" in capsys.readouterr().err

    # a hook that fails is reported in one line and the exit is unchanged; hooks run once
    def broken(_message):
        raise OSError("disk full")

    rt.on_failure(broken)
    with pytest.raises(SystemExit) as exc:
        with rt.guard():
            raise SystemExit(3)
    assert exc.value.code == 3 and rt.failure_hooks == []
    assert "hpcgnn: warning: rank 0: could not record the failure (OSError: disk full)" \
        in capsys.readouterr().err

    # a clean exit runs none; a removed hook never runs
    rt.on_failure(seen.append)
    with rt.guard():
        pass
    rt.remove_failure_hook(seen.append)
    with pytest.raises(SystemExit):
        with rt.guard():
            raise InputError("x")
    assert len(seen) == 2
