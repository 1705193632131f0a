"""The job's data plane: :func:`make_communicator` picks the implementation of
:class:`~hpcgnn.comm.communicator.Communicator` for ``runtime.backend`` and the compute device
(:func:`~hpcgnn.comm.communicator.choose_backend`) and builds it once per job:
:class:`~hpcgnn.comm.communicator_mpi.MpiCommunicator` or
:class:`~hpcgnn.comm.communicator_torch.TorchCommunicator`.
"""
from __future__ import annotations

import torch

from hpcgnn.comm.communicator import Communicator, choose_backend
from hpcgnn.comm.communicator_mpi import MpiCommunicator
from hpcgnn.comm.communicator_torch import TorchCommunicator
from hpcgnn.errors import InputError


def make_communicator(rt, backend: str, device: torch.device | str = "cpu") -> Communicator:
    """The data plane for ``runtime.backend`` = ``backend`` on compute ``device`` (collective:
    a torch.distributed backend initialises its process group on every rank). One per job:
    the communicator is kept on ``rt`` and the same one is returned to later callers (a second,
    different backend in one job is an InputError). NCCL takes one rank per GPU: where ranks
    share one (more ranks than GPUs on a node), ``auto`` carries the data plane with mpi4py
    instead and ``nccl`` is an InputError on every rank."""
    name = choose_backend(backend, str(device))
    if name == "nccl" and rt.size > 1:
        shared = rt.shared_gpus(device)        # collective; the same answer on every rank
        if shared:
            if backend == "nccl":
                gpu, ranks = max(shared.items(), key=lambda kv: kv[1])
                raise InputError(f"runtime.backend = 'nccl' but {ranks} ranks share GPU {gpu} (more ranks than "
                                 "GPUs): NCCL takes one rank per GPU; use 'auto' or 'mpi4py' (host buffers), or "
                                 "as many GPUs as ranks")
            name = "mpi4py"
    have = getattr(rt, "data_plane", None)
    if have is not None:
        if have.name != name:
            raise InputError(f"runtime.backend: this job's data plane is already {have.name!r}, "
                             f"cannot switch to {name!r}")
        return have
    if name == "mpi4py":
        comm = MpiCommunicator(rt.comm)
    else:
        used = rt.init_torch_distributed(name, str(device))
        dev = torch.device("cuda", torch.cuda.current_device()) if used == "nccl" else torch.device("cpu")
        comm = TorchCommunicator(used, rt.rank, rt.size, dev)
    rt.data_plane = comm
    return comm
