"""The MPI process runtime every engine runs in.

``Runtime.start()`` reads rank and size from mpi4py (no ssh, no file
rendezvous), refuses a launcher mismatch (a world of size 1 while the
launcher's variables say more), sets torch and OpenMP threads per rank from the
cores and ranks on the node, and installs the failure policy:

* an :class:`~hpcgnn.errors.InputError` raised on **every** rank (after
  :meth:`Runtime.agree`) prints one line on rank 0 and exits 2 everywhere;
* any other exception on any rank prints one message naming the rank and
  ends every rank through ``MPI_Abort`` instead of leaving the others waiting.

``init_torch_distributed`` optionally brings up ``torch.distributed`` (gloo on
CPU, nccl on GPU, ccl when ``oneccl_bindings_for_pytorch`` imports).
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
from dataclasses import dataclass

from hpcgnn.errors import EXIT_INPUT, InputError

LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")


def _launcher_size() -> tuple[str, int] | None:
    for var in LAUNCHER_SIZE_VARS:
        value = os.environ.get(var)
        if value and value.isdigit() and int(value) > 1:
            return var, int(value)
    return None


@dataclass
class Runtime:
    """One rank's view of the job. ``comm`` is an mpi4py communicator."""

    comm: object
    rank: int
    size: int
    local_rank: int
    local_size: int
    threads: int

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, threads: int = 0, comm=None) -> "Runtime":
        """Initialise MPI (via mpi4py), check the launcher, set threads per rank.

        ``threads`` = 0 means cores on the node // ranks on the node (at least 1);
        HPCGNN_THREADS overrides it.
        """
        from mpi4py import MPI

        comm = comm if comm is not None else MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        expected = _launcher_size()
        if size == 1 and expected is not None and comm is MPI.COMM_WORLD:
            var, n = expected
            print(f"hpcgnn: error: {var}={n} but MPI.COMM_WORLD has size 1: the job was started "
                  f"with a launcher of another MPI (use {os.path.join(sys.prefix, 'bin', 'mpiexec')} "
                  "or 'srun --mpi=pmi2')", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_INPUT)
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank, local_size = node.Get_rank(), node.Get_size()
        node.Free()
        env_threads = os.environ.get("HPCGNN_THREADS")
        if env_threads:
            threads = int(env_threads)
        if threads <= 0:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            # under srun the affinity mask may already be per task; never divide below 1
            cores = max(cores or 1, 1)
            threads = max(1, cores // local_size) if cores >= local_size else 1
        rt = cls(comm=comm, rank=rank, size=size, local_rank=local_rank,
                 local_size=local_size, threads=threads)
        rt.set_threads(threads)
        return rt

    def set_threads(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        try:
            from hpcgnn import native
            native.set_threads(threads)
        except ImportError:
            pass
        self.threads = threads

    # ---- failure policy -------------------------------------------------
    def agree(self, error: str | None) -> None:
        """Collective: if any rank passes an error message, every rank raises InputError.

        The message of the lowest failing rank is raised everywhere, so every
        rank exits 2 with the same line and none is left waiting.
        """
        errors = self.comm.allgather(error)
        first = next((e for e in errors if e), None)
        if first is not None:
            raise InputError(first)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)

    @contextlib.contextmanager
    def guard(self):
        """Run a rank's main body under the failure policy (see module docstring).

        An InputError is expected to be raised on every rank (use :meth:`agree`
        for checks whose outcome may differ between ranks); it exits 2. Any
        other exception aborts the whole job with exit code 1.
        """
        try:
            yield self
        except InputError as exc:
            if self.is_root or self.size == 1:
                print(f"hpcgnn: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_INPUT)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - the job must not hang
            tb = traceback.format_exc()
            print(f"hpcgnn: rank {self.rank}/{self.size} on {socket.gethostname()} failed: "
                  f"{exc.__class__.__name__}: {exc}\n{tb}", file=sys.stderr, flush=True)
            if self.size > 1:
                self.abort(1)
            raise SystemExit(1)

    # ---- torch.distributed ----------------------------------------------
    def init_torch_distributed(self, backend: str = "auto", device: str = "cpu") -> str:
        """Initialise torch.distributed over this job; returns the backend used.

        ``auto``: nccl for CUDA devices, ccl when oneccl_bindings_for_pytorch
        imports, else gloo. The rendezvous address comes from rank 0 over MPI.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_backend()
        backend = resolve_backend(backend, device)
        if self.is_root:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            addr = socket.gethostbyname(socket.gethostname()) if self.size > 1 else "127.0.0.1"
        else:
            port, addr = None, None
        addr, port = self.comm.bcast((addr, port), root=0)
        os.environ.update(MASTER_ADDR=str(addr), MASTER_PORT=str(port),
                          RANK=str(self.rank), WORLD_SIZE=str(self.size))
        dist.init_process_group(backend=backend, rank=self.rank, world_size=self.size)
        return backend

    def finish(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def ccl_available() -> bool:
    """True when Intel's oneCCL bindings for PyTorch import (optional backend)."""
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: str = "cpu") -> str:
    """The torch.distributed backend for ``backend`` ('auto', 'gloo', 'nccl', 'ccl', 'mpi')."""
    import torch.distributed as dist

    if backend == "auto":
        if device.startswith("cuda"):
            return "nccl"
        return "ccl" if ccl_available() else "gloo"
    if backend == "ccl" and not ccl_available():
        raise InputError("runtime.backend = 'ccl' but oneccl_bindings_for_pytorch is not installed")
    if backend == "mpi" and not dist.is_mpi_available():
        raise InputError("runtime.backend = 'mpi' but this torch build has no MPI backend")
    if backend == "nccl" and not dist.is_nccl_available():
        raise InputError("runtime.backend = 'nccl' but this torch build has no NCCL (CPU-only torch?)")
    return backend
