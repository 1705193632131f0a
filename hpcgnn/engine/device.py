"""The compute device of a rank: :func:`resolve_device` (``train.device``; one GPU per
node-local rank)."""
from __future__ import annotations

import torch

from hpcgnn.errors import InputError


def resolve_device(cfg, rt=None) -> torch.device:
    """cfg.train.device -> torch.device ('auto' = cuda if available); for CUDA one GPU per rank.

    The GPU comes from the node-local rank (``rt.local_rank`` / ``rt.local_size``, the MPI
    shared-memory communicator's) by :func:`hpcgnn.runtime.choose_cuda_device`, which honours
    ``CUDA_VISIBLE_DEVICES`` and SLURM's GPU binding, and is made the current CUDA device
    (``torch.cuda.set_device``) so that ``torch.cuda.synchronize()`` (PhaseTimer), NCCL and
    every allocation without an explicit index use it. With ``rt`` the choice is kept on
    ``rt.device`` / ``rt.device_choice`` (the run file records it per rank and epoch,
    ``labels/device``); when the ranks of rank 0's node share GPUs, rank 0 says so (once per run, however often
    this is called).
    Not collective: an InputError here is the calling rank's.
    """
    import os

    from hpcgnn.runtime import choose_cuda_device

    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    choice = None
    if want == "cuda":
        if not torch.cuda.is_available():
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise InputError("train.device = 'cuda' but torch sees no CUDA device"
                             + (f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""))
        local_rank, local_size = (rt.local_rank, rt.local_size) if rt is not None else (0, 1)
        choice = choose_cuda_device(local_rank, local_size, torch.cuda.device_count(), os.environ)
        device = torch.device("cuda", choice.index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if rt is not None:
        said = getattr(rt, "device_choice", None) is not None   # the check before the engine chose already
        rt.device, rt.device_choice = str(device), choice
        if choice is not None and choice.shared and rt.rank == 0 and not said:
            from hpcgnn.run.console import warn

            warn(f"{choice.how} (rank 0 uses {device}): give each rank its own GPU for full speed")
    return device
