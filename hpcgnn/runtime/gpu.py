"""GPU placement: which visible CUDA device a node-local rank uses (:func:`choose_cuda_device`, a pure
function of the node-local rank and size, the visible device count and the environment, honouring
``CUDA_VISIBLE_DEVICES`` and SLURM's GPU binding), and which physical GPUs several ranks share
(:func:`gpu_identity`, :func:`shared_gpus`)."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Mapping

from hpcgnn.errors import InputError

def _gpus_per_task(value: str | None) -> int | None:
    """SLURM_GPUS_PER_TASK ('[type:]count', e.g. '1' or 'a100:2') -> count; None if unset/odd."""
    last = (value or "").strip().rsplit(":", 1)[-1]
    return int(last) if last.isdigit() else None


def _gpu_ids(value: str | None) -> int | None:
    """SLURM_STEP_GPUS (GPU IDs, '0,1,3') -> how many; None if unset."""
    ids = [v for v in (value or "").split(",") if v.strip()]
    return len(ids) or None


@dataclass(frozen=True)
class DeviceChoice:
    """Which of its visible CUDA devices a rank uses (see :func:`choose_cuda_device`)."""

    index: int      # index among this process's visible devices (torch.cuda.set_device)
    shared: bool    # other ranks on the node use the same GPU (fewer GPUs than local ranks)
    how: str        # one phrase saying why, for messages


def choose_cuda_device(local_rank: int, local_size: int, visible: int,
                       env: Mapping[str, str]) -> DeviceChoice:
    """The CUDA device of node-local rank ``local_rank`` of ``local_size``; pure.

    ``visible`` is the number of devices this process sees (``torch.cuda.device_count()``,
    which already honours ``CUDA_VISIBLE_DEVICES``); ``env`` the process environment.

    * SLURM bound GPUs to this task: ``SLURM_GPUS_PER_TASK`` = g and at most g visible
      devices (``srun --gpus-per-task``), or fewer visible devices than SLURM gave the srun
      step on this node (``SLURM_STEP_GPUS``, e.g. ``--gres=gpu:4 --gpu-bind=single:1``): the
      visible devices are this task's own, use index 0. (``mpiexec`` inside an allocation
      is no srun step: its ranks see the job's GPUs and take the next rule.)
    * otherwise every local rank sees the same devices: local rank r uses r mod ``visible``;
      with fewer visible devices than local ranks they are shared round-robin (``shared``).

    InputError when no device is visible.
    """
    if visible < 1:
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        raise InputError("train.device = 'cuda' but no CUDA device is visible to this rank"
                         + (f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""))
    per_task = _gpus_per_task(env.get("SLURM_GPUS_PER_TASK"))
    if per_task and visible <= per_task:
        return DeviceChoice(0, False, f"SLURM binds {visible} GPU(s) to each task "
                                      f"(SLURM_GPUS_PER_TASK={env.get('SLURM_GPUS_PER_TASK')})")
    granted = _gpu_ids(env.get("SLURM_STEP_GPUS"))
    if granted and visible < granted:
        return DeviceChoice(0, False, f"SLURM binds {visible} of the step's {granted} GPUs on "
                                      "the node to this task")
    index = local_rank % visible
    if local_size > visible:
        return DeviceChoice(index, True, f"{local_size} ranks on the node share {visible} "
                                         "visible GPU(s) round-robin")
    return DeviceChoice(index, False, f"node-local rank {local_rank} of {local_size}, "
                                      f"{visible} visible GPU(s)")


def gpu_identity(torch_device) -> str:
    """The physical GPU behind ``torch_device``: ``host:uuid`` (the same GPU under different
    ``CUDA_VISIBLE_DEVICES`` of two ranks is one identity), ``host:cuda:i`` where torch gives no
    UUID; ``""`` off CUDA."""
    import torch

    torch_device = torch.device(torch_device)
    if torch_device.type != "cuda" or not torch.cuda.is_available():
        return ""
    index = torch_device.index if torch_device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"{socket.gethostname()}:{uuid if uuid is not None else f'cuda:{index}'}"


def shared_gpus(identities: list[str]) -> dict[str, int]:
    """``{gpu: ranks}`` of the GPUs that more than one rank uses, from every rank's
    :func:`gpu_identity` (``""``: no GPU)."""
    from collections import Counter

    return {gpu: n for gpu, n in Counter(g for g in identities if g).items() if n > 1}
