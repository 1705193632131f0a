"""The MPI process runtime every engine runs in: :class:`Runtime`, one rank's view of the job.

``Runtime.start()`` reads rank and size from mpi4py (no ssh, no file
rendezvous), refuses a launcher mismatch (a world of size 1 while the
launcher's variables say more), sets torch and OpenMP threads per rank from the
cores and ranks on the node, and installs the failure policy:

* an :class:`~hpcgnn.errors.InputError` raised on **every** rank (after
  :meth:`Runtime.agree`) prints one line on rank 0 and exits 2 everywhere;
  one raised on some ranks only prints the message naming the rank and, after
  HPCGNN_ERROR_WAIT seconds (default 10) without the other ranks, ends the job
  through ``MPI_Abort(2)``;
* any other exception on any rank prints one message naming the rank and
  ends every rank through ``MPI_Abort`` instead of leaving the others waiting;
* a rank that dies (SIGKILL, out of memory) is the launcher's to handle: MPICH's
  mpiexec and srun --kill-on-bad-exit end the other ranks.

Before a rank leaves through the failure policy it runs the hooks registered with
:meth:`Runtime.on_failure` (``RunOutput`` marks its run file ``status = "failed"`` there), so
what this process can still write is written. A rank ended from outside (SIGKILL, or the
launcher ending it after another rank's abort) runs none.

``init_torch_distributed`` brings up ``torch.distributed`` for a data plane that uses it (gloo
on CPU, nccl on GPU, ccl when ``oneccl_bindings_for_pytorch`` imports); which backend a job uses
is :func:`hpcgnn.comm.communicator.choose_backend`'s decision (the one home of that logic).
"""
from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, NoReturn

from hpcgnn.errors import EXIT_INPUT, InputError
from hpcgnn.runtime.gpu import DeviceChoice, choose_cuda_device, gpu_identity, shared_gpus
from hpcgnn.runtime.process import _env_int, _launcher_size, retain_freed_host_memory, yield_when_oversubscribed

ERROR_WAIT_S = 10.0
# A rank that sees another rank's end in a collective waits this long before it says so, so that
# the line of the rank that ended (its watcher's) comes first.
PEER_FAILURE_DELAY_S = 1.0
# OS errors that mean "an output cannot be written" (not a bug): one line, exit 2.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
                          errno.EFBIG, errno.EIO})
# What a collective raises when a peer has gone: mpi4py's MPI.Exception, gloo's lost connection.
_PEER_GONE_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def write_failure_message(exc: BaseException) -> str | None:
    """The one line for an OSError of :data:`WRITE_ERRNOS` (``PATH: No space left on device
    (ENOSPC)``), None for any other exception."""
    if not isinstance(exc, OSError) or exc.errno not in WRITE_ERRNOS:
        return None
    from hpcgnn.fileio import os_reason

    where = exc.filename if exc.filename is not None else "output"
    return f"{where}: {os_reason(exc)}"


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective, the consequence of another rank ending: mpi4py's
    ``MPI.Exception`` or a torch.distributed connection lost to a peer."""
    if type(exc).__module__.startswith("mpi4py"):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _PEER_GONE_TEXT)


def _error_wait_s() -> float:
    value = os.environ.get("HPCGNN_ERROR_WAIT", "").strip()
    try:
        return max(0.0, float(value)) if value else ERROR_WAIT_S
    except ValueError:
        return ERROR_WAIT_S


@dataclass
class Runtime:
    """One rank's view of the job. ``comm`` is an mpi4py communicator."""

    comm: object
    rank: int
    size: int
    local_rank: int
    local_size: int
    threads: int
    error_comm: object = field(default=None, repr=False)  # private duplicate for the failure policy
    # The compute device chosen by hpcgnn.engine.device.resolve_device ("cpu", "cuda:1") and,
    # for CUDA, how (a DeviceChoice); RunOutput records ``device`` per rank and epoch.
    device: str | None = None
    device_choice: DeviceChoice | None = field(default=None, repr=False)
    failure_hooks: list = field(default_factory=list, repr=False)
    # The data plane (hpcgnn.comm.data_plane.make_communicator): one per job, made by the
    # engine from runtime.backend; None until then.
    data_plane: object = field(default=None, repr=False)
    # Device bytes ``store.device_memory = 'auto'`` may give the rank's feature store on a GPU,
    # stated by the pre-run device check (hpcgnn.engine.memory_check.check_device_memory); None:
    # no figure (every row on the device).
    store_device_available: int | None = field(default=None, repr=False)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, threads: int = 0, comm=None) -> "Runtime":
        """Initialise MPI (via mpi4py), check the launcher, set threads per rank.

        ``threads`` = 0 means: the CPUs this job's ranks on the node may use (the
        union of their affinity masks) // ranks on the node, at most this rank's own
        mask, at least 1. HPCGNN_THREADS (an integer >= 1) overrides ``threads``.
        Collective over ``comm``. Before MPI starts, oversubscribed MPICH ranks are told to
        sleep while they wait (:func:`yield_when_oversubscribed`).
        """
        if "mpi4py.MPI" not in sys.modules:
            yield_when_oversubscribed()
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
        if hasattr(os, "sched_getaffinity"):
            mask = sorted(os.sched_getaffinity(0))
        else:  # pragma: no cover - not Linux
            mask = list(range(os.cpu_count() or 1))
        # Binding launchers (srun with task/affinity, Open MPI) give each rank its own
        # mask: the node's share is the union of the masks, never more than one's own.
        node_cpus = set().union(*node.allgather(mask))
        node.Free()
        env_threads = _env_int("HPCGNN_THREADS", 1)
        if env_threads is not None:
            threads = env_threads
        if threads <= 0:
            threads = max(1, min(len(mask), len(node_cpus) // local_size))
        rt = cls(comm=comm, rank=rank, size=size, local_rank=local_rank,
                 local_size=local_size, threads=threads, error_comm=comm.Dup())
        rt.set_threads(threads)
        return rt

    def configured_threads(self, setting) -> int | None:
        """This rank's thread count from ``runtime.threads``: an int (0 = keep the start-up
        choice, None is returned) or a per-rank list (entry ``rank``; ranks with unequal speed on
        one machine, docs/rapa.md). InputError (same on every rank) when a list's length is not
        the world size."""
        if isinstance(setting, (list, tuple)):
            if len(setting) != self.size:
                raise InputError(f"runtime.threads = {list(setting)} has {len(setting)} entries but the job has "
                                 f"{self.size} ranks, expected one thread count per rank")
            return int(setting[self.rank])
        return int(setting) if int(setting) > 0 else None

    def apply_settings(self, runtime_cfg) -> None:
        """A config's ``[runtime]`` section on every rank (collective), before any data is read:
        this rank's ``runtime.threads`` (:meth:`configured_threads`; HPCGNN_THREADS in the
        environment wins) and ``runtime.host_memory = "retain"`` (:func:`retain_freed_host_memory`).
        An InputError stops every rank."""
        threads = self.agree_on(lambda: self.configured_threads(runtime_cfg.threads))
        if threads and not os.environ.get("HPCGNN_THREADS"):
            self.set_threads(threads)
        if runtime_cfg.host_memory == "retain":
            self.agree_on(retain_freed_host_memory)

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
    def on_failure(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(message)`` (one line) when this rank leaves :meth:`guard` by an error.

        Runs on the failing rank only, before it exits or aborts the job; a hook that raises
        is reported in one warning line and does not change the exit.
        """
        self.failure_hooks.append(hook)

    def remove_failure_hook(self, hook: Callable[[str], None]) -> None:
        if hook in self.failure_hooks:
            self.failure_hooks.remove(hook)

    def _run_failure_hooks(self, message: str) -> None:
        hooks, self.failure_hooks = list(self.failure_hooks), []
        line = " ".join(str(message).split())
        for hook in hooks:
            try:
                hook(line)
            except Exception as exc:  # noqa: BLE001 - the failure policy must go on
                print(f"hpcgnn: warning: rank {self.rank}: could not record the failure "
                      f"({exc.__class__.__name__}: {' '.join(str(exc).split())})",
                      file=sys.stderr, flush=True)

    def agree(self, error: str | None) -> None:
        """Collective: if any rank passes an error message, every rank raises InputError.

        The message of the lowest failing rank is raised everywhere, so every
        rank exits 2 with the same line and none is left waiting.
        """
        errors = self.comm.allgather(error)
        first = next((e for e in errors if e), None)
        if first is not None:
            raise InputError(first)

    def shared_gpus(self, device) -> dict[str, int]:
        """Collective: ``{gpu: ranks}`` of the GPUs that more than one rank of the job computes
        on (every rank's :func:`gpu_identity` of its ``device``); the same on every rank."""
        return shared_gpus(self.comm.allgather(gpu_identity(device)))

    def agree_on(self, fn):
        """Collective: ``fn()`` on every rank; an InputError on any rank stops all of them with
        its message (:meth:`agree`). Returns this rank's result."""
        result, error = None, None
        try:
            result = fn()
        except InputError as exc:
            error = str(exc)
        self.agree(error)
        return result

    def abort(self, code: int = 1) -> NoReturn:
        """End every rank of the job now; does not return.

        MPICH's MPI_Abort may return to the caller once the launcher has the
        request (the launcher then kills every rank): this rank leaves at once
        with ``os._exit`` rather than running Python's exit handlers meanwhile.
        """
        sys.stdout.flush()
        sys.stderr.flush()
        # The launcher kills every rank as soon as it sees the abort, and output
        # still in its forwarding pipes is lost: give it a moment to pass on the
        # message this rank just printed.
        time.sleep(0.5)
        self.comm.Abort(code)
        os._exit(code)

    @contextlib.contextmanager
    def guard(self):
        """Run a rank's main body under the failure policy (see module docstring).

        An InputError should be raised on every rank (use :meth:`agree` for
        checks whose outcome may differ between ranks): rank 0 prints each
        distinct message once (one line after ``agree``), every rank exits 2.
        Raised on some ranks only (or a non-zero SystemExit), the job ends with
        MPI_Abort(code) after HPCGNN_ERROR_WAIT seconds. Ctrl-C aborts with 130.
        Any other exception prints its traceback naming the rank and aborts the
        job (exit 1). In every case the hooks registered with :meth:`on_failure`
        run first (once), on this rank.
        """
        try:
            yield self
        except InputError as exc:
            self._leave_with_input_error(str(exc))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if code != 0:
                self._run_failure_hooks(f"exit code {code}")
                self._exit_together(code, f"hpcgnn: exit code {code}")
            raise
        except KeyboardInterrupt:
            print(f"hpcgnn: rank {self.rank}/{self.size} interrupted", file=sys.stderr, flush=True)
            self._run_failure_hooks(f"rank {self.rank} interrupted")
            if self.size > 1:
                self.abort(130)
            raise SystemExit(130)
        except BaseException as exc:  # noqa: BLE001 - the job must not hang
            output_failure = write_failure_message(exc)
            if output_failure is not None:   # a full disk, a lost permission: as bad input
                self._leave_with_input_error(output_failure)
            if self.size > 1 and is_peer_failure(exc):
                self._peer_failed(exc)
            tb = traceback.format_exc()
            print(f"hpcgnn: rank {self.rank}/{self.size} on {socket.gethostname()} failed: "
                  f"{exc.__class__.__name__}: {exc}\n{tb}", file=sys.stderr, flush=True)
            self._run_failure_hooks(f"rank {self.rank}: {exc.__class__.__name__}: {exc}")
            if self.size > 1:
                self.abort(1)
            raise SystemExit(1)

    def _leave_with_input_error(self, message: str) -> NoReturn:
        """One line and exit 2: the failure hooks run, the ranks leaving with an error meet
        (:meth:`_exit_together`), rank 0 prints each distinct message once."""
        self._run_failure_hooks(message)
        messages = self._exit_together(EXIT_INPUT, f"hpcgnn: error: {message}")
        if messages:  # rank 0, or every rank once finish() has freed the error communicator
            for line in dict.fromkeys(messages):  # distinct messages, in rank order
                print(line, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INPUT)

    def _peer_failed(self, exc: BaseException) -> NoReturn:
        """A collective failed because another rank ended (killed, aborted): a consequence, not
        a cause. The rank that ended has its own line (its watcher's, :mod:`hpcgnn.supervisor`, or
        its failure's): this rank waits a moment so that line comes first, then says in one line,
        without a traceback (``HPCGNN_TRACEBACK=1`` prints it), that it stopped because of it,
        and ends the job."""
        first = (" ".join(str(exc).split()) or exc.__class__.__name__)[:160]
        time.sleep(PEER_FAILURE_DELAY_S)
        print(f"hpcgnn: rank {self.rank}/{self.size}: stopped because another rank ended during "
              f"communication ({exc.__class__.__name__}: {first})", file=sys.stderr, flush=True)
        if os.environ.get("HPCGNN_TRACEBACK", "").strip() in ("1", "true", "yes"):
            traceback.print_exc()
        self._run_failure_hooks(f"another rank ended during communication (seen by rank "
                                f"{self.rank}: {first})")
        self.abort(1)

    def _exit_together(self, code: int, message: str) -> list[str] | None:
        """Return once every rank is leaving with an error; else end the job.

        Ranks leaving with an error meet in a non-blocking barrier on a private
        communicator. When all of them arrive within HPCGNN_ERROR_WAIT seconds
        this returns every rank's ``message`` on rank 0 (None elsewhere) and the
        caller exits ``code`` cleanly; otherwise this rank prints ``message``
        naming itself and ends every rank with MPI_Abort(code).
        """
        if self.size == 1 or self.error_comm is None:
            return [message]
        request = self.error_comm.Ibarrier()
        deadline = time.monotonic() + _error_wait_s()
        while not request.Test():
            if time.monotonic() >= deadline:
                print(f"{message} [rank {self.rank}/{self.size} on {socket.gethostname()}; "
                      "the other ranks did not stop with it: aborting the job]",
                      file=sys.stderr, flush=True)
                self.abort(code)
            time.sleep(0.005)
        return self.error_comm.gather(message, root=0)

    # ---- torch.distributed ----------------------------------------------
    def init_torch_distributed(self, backend: str = "auto", device: str = "cpu") -> str:
        """Initialise torch.distributed over this job; returns the backend used.

        ``backend``: 'gloo', 'nccl', 'ccl', or ``auto``: nccl for CUDA devices, ccl when
        oneccl_bindings_for_pytorch imports, else gloo; an impossible pair with ``device`` is
        :func:`hpcgnn.comm.communicator.choose_backend`'s InputError. The rendezvous address comes from rank 0 over MPI:
        127.0.0.1 when every rank is on one node, else rank 0's host name
        (MASTER_ADDR, when set in the environment, wins). For nccl the CUDA
        device is the one ``resolve_device`` chose (:attr:`device`), else
        :func:`choose_cuda_device`'s. Collective.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_backend()
        from hpcgnn.comm.communicator import choose_backend

        wanted, backend = backend, choose_backend(backend, device)
        if backend == "mpi4py":   # auto on a CPU without oneCCL: torch.distributed's CPU backend
            if wanted != "auto":
                raise InputError("init_torch_distributed: 'mpi4py' is not a torch.distributed backend "
                                 "(expected auto, gloo, nccl or ccl)")
            backend = "gloo"
        from datetime import timedelta

        # Rank 0 starts the rendezvous store (listening on a free port) BEFORE the others
        # learn its address, so no rank connects early and waits out a connect-retry back-off.
        store = None
        if self.is_root:
            # Debian maps the host name to 127.0.1.1 in /etc/hosts: resolving it here
            # would hand other nodes a loopback address. They resolve the name themselves.
            addr = os.environ.get("MASTER_ADDR") or (
                "127.0.0.1" if self.local_size == self.size else socket.gethostname())
            store = dist.TCPStore(addr if addr == "127.0.0.1" else "0.0.0.0", 0, self.size, True,
                                  timedelta(seconds=300), wait_for_workers=False)
            port = store.port
        else:
            port, addr = None, None
        addr, port = self.comm.bcast((addr, port), root=0)
        if store is None:
            store = dist.TCPStore(addr, port, self.size, False, timedelta(seconds=300))
        os.environ.update(MASTER_ADDR=str(addr), MASTER_PORT=str(port),
                          RANK=str(self.rank), WORLD_SIZE=str(self.size))
        if backend == "nccl":
            import torch

            if self.device and self.device.startswith("cuda"):
                torch.cuda.set_device(torch.device(self.device))
            else:
                torch.cuda.set_device(choose_cuda_device(
                    self.local_rank, self.local_size, torch.cuda.device_count(), os.environ).index)
        dist.init_process_group(backend=backend, store=store, rank=self.rank, world_size=self.size)
        return backend

    def finish(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if self.error_comm is not None:
            self.error_comm.Free()
            self.error_comm = None
