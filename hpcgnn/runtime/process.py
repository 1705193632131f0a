"""Process tuning of a rank, before and around MPI's start: the launcher's world size
(:func:`_launcher_size`), integer settings from the environment, transparent huge pages for torch's
CPU tensors (:func:`prefer_huge_pages`), sleeping instead of spinning when the node is
oversubscribed (:func:`yield_when_oversubscribed`) and keeping freed host memory mapped
(:func:`retain_freed_host_memory`)."""
from __future__ import annotations

import os

from hpcgnn.errors import InputError

# In order of authority: the variables of the launcher that started this
# process come first; SLURM_NTASKS (the allocation's) only counts when no MPI
# launcher variable is set (e.g. `python ...` straight in an sbatch script).
LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")


def _launcher_size() -> tuple[str, int] | None:
    """(variable, world size) announced by the launcher when it says more than 1 rank."""
    for var in LAUNCHER_SIZE_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return (var, int(value)) if int(value) > 1 else None
    return None


def _env_int(name: str, minimum: int) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.lstrip("-").isdigit() or int(value) < minimum:
        raise InputError(f"environment variable {name}={value!r}: expected an integer >= {minimum}")
    return int(value)


def prefer_huge_pages() -> bool:
    """Let torch's CPU allocator back tensors of >= 2 MiB with transparent huge pages.

    Sets ``THP_MEM_ALLOC_ENABLE=1`` unless the user set it (``=0`` turns it off); torch reads
    it once, at its first CPU allocation, so call this before any tensor exists. Random row
    gathers (aggregation, halo packing) then miss the TLB far less: a one-rank products-like
    full-graph epoch took 0.83-1.02 s instead of 1.29-1.57 s on the development VM
    (docs/benchmarks.md). Returns whether huge pages are requested.
    """
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return os.environ["THP_MEM_ALLOC_ENABLE"] == "1"


# MPICH's control variable for its busy-wait loops: 1 = sleep (nanosleep) where they would
# otherwise call sched_yield, which under Linux's scheduler barely gives the core away to the
# process that must progress.
HEAVY_YIELD_VAR = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
# Hydra's (MPICH's mpiexec) count of this job's ranks on this node; set before MPI_Init.
HYDRA_LOCAL_SIZE_VAR = "MPI_LOCALNRANKS"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; all of the machine's where there is no
    mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return max(os.cpu_count() or 1, 1)  # pragma: no cover - not Linux


def yield_when_oversubscribed(environ: dict | None = None, cpus: int | None = None) -> bool:
    """Make MPICH's waiting ranks sleep instead of spin when the node has more ranks than CPUs.

    Under MPICH's ``mpiexec`` (Hydra states the node's rank count in ``MPI_LOCALNRANKS``) with
    more ranks on the node than this process may run on (``cpus``, default its affinity mask),
    sets ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` unless the user set it (``=0`` keeps spinning).
    MPICH reads it in ``MPI_Init``: call before mpi4py's ``MPI`` is imported (the CLI does, and
    :meth:`Runtime.start`). Spinning ranks otherwise take the cores the working ranks need:
    the 20 training jobs of tests/engine/test_backend_parity.py on 4 ranks of 2 cores took
    348 s spinning and 68 s sleeping (docs/benchmarks.md). Other launchers are left alone
    (srun binds ranks to their own cores; Open MPI yields by itself when oversubscribed).
    Returns whether the variable is 1 afterwards."""
    env = os.environ if environ is None else environ
    local = env.get(HYDRA_LOCAL_SIZE_VAR, "").strip()
    if cpus is None:
        cpus = usable_cpus()
    if local.isdigit() and int(local) > max(int(cpus), 1):
        env.setdefault(HEAVY_YIELD_VAR, "1")
    return env.get(HEAVY_YIELD_VAR, "").strip() == "1"


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
RETAIN_TOP_PAD = 512 << 20


def retain_freed_host_memory() -> None:
    """``runtime.host_memory = "retain"``: keep memory that freed tensors return in the process
    (glibc ``mallopt``: large blocks from the heap instead of their own mappings, no trimming,
    the heap grown 512 MiB at a time), so the next iteration's large tensors reuse pages that
    are already mapped instead of faulting fresh ones in. On the development VM a fresh 61 MB
    buffer cost about 60 ms of page faults; a 1-rank bf16 minibatch epoch on products-like 0.04
    took 0.95 s instead of 1.30 s with 15 % more peak memory (docs/dgl.md). Applies to
    allocations made after the call. InputError where the C library has no ``mallopt`` (not
    glibc)."""
    import ctypes

    from hpcgnn.errors import InputError

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        raise InputError("runtime.host_memory = 'retain' needs glibc's mallopt, which this C "
                         "library does not have (use 'release')") from None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) and \
        mallopt(_M_TOP_PAD, RETAIN_TOP_PAD)
    if not ok:
        raise InputError("runtime.host_memory = 'retain': the C library refused the mallopt "
                         "settings (use 'release')")
