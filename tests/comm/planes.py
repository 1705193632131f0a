"""The data planes the comm tests run their exchanges on, inside an ``mpiexec`` job.

``data_plane("mpi4py")`` wraps ``MPI.COMM_WORLD``; ``data_plane("gloo")`` brings up
torch.distributed's gloo group over the same ranks (rendezvous on a free local port chosen by
rank 0, sent over MPI: every rank runs on this machine) and wraps it. Collective."""
from __future__ import annotations

import socket


def data_plane(backend: str):
    from mpi4py import MPI

    from hpcgnn.comm.communicator_mpi import MpiCommunicator
    from hpcgnn.comm.communicator_torch import TorchCommunicator

    comm = MPI.COMM_WORLD
    if backend == "mpi4py":
        return MpiCommunicator(comm)
    import torch.distributed as dist

    if not dist.is_initialized():
        port = None
        if comm.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                rank=comm.Get_rank(), world_size=comm.Get_size())
    return TorchCommunicator(backend, comm.Get_rank(), comm.Get_size(), "cpu")


def close_planes() -> None:
    """Tear down the gloo group (if any) before MPI finalises: collective."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
