"""Starting a child MPI job from this process (a bench driver, ``hpcgnn plan``'s calibration): the
launcher of this interpreter's MPI (:func:`find_mpiexec`), the child's environment, a fresh world
rather than a rank of the surrounding job (:func:`fresh_world_env`), and the MPI library's name for
the record (:func:`mpi_library`)."""
from __future__ import annotations

import os
import sys
from typing import Mapping

# launcher variables of a surrounding MPI job or SLURM step: a child must start a fresh world
CHILD_STRIP_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCALNRANKS", "SLURM_")
# ... except a user's own MCA settings of Open MPI and PMIx (a site's transport, a container's
# shared-memory workaround: OMPI_MCA_btl_vader_single_copy_mechanism=none), which a child needs
# as much as the job does; the ones Open MPI's launcher sets for its ranks are its job's, not
# the user's (Open MPI 4.1's mpiexec sets these prefixes and names).
CHILD_KEEP_PREFIXES = ("OMPI_MCA_", "PMIX_MCA_")
LAUNCHER_MCA_PREFIXES = ("OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_MCA_initial_wdir",
                         "OMPI_MCA_mpi_oversubscribe", "OMPI_MCA_shmem_RUNTIME_QUERY_hint",
                         "OMPI_MCA_prte_", "PMIX_MCA_mca_base_component_show_load_errors")


def find_mpiexec() -> str | None:
    """The launcher of this interpreter's MPI: beside the interpreter (a venv with the MPICH
    wheel), the MPICH wheel's own, then ``mpiexec`` on PATH; None when there is none."""
    import shutil
    from pathlib import Path

    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    try:
        from importlib import metadata
        for f in metadata.distribution("mpich").files or ():
            if f.name == "mpiexec":
                return str(f.locate())
    except Exception:  # noqa: BLE001 - no MPICH wheel: PATH decides
        pass
    return shutil.which("mpiexec")


def fresh_world_env(environ: Mapping[str, str] | None = None) -> dict:
    """The environment of a child ``mpiexec`` started from this process (``environ``, default
    ``os.environ``): a fresh MPI world (no variables of a surrounding job or SLURM step,
    :data:`CHILD_STRIP_PREFIXES`, but the user's own Open MPI and PMIx MCA settings,
    :data:`CHILD_KEEP_PREFIXES`, kept); for Open MPI in a container: as root, told that root is meant
    (its ``mpiexec`` refuses to start otherwise), and with neither ``ssh`` nor ``rsh`` installed,
    given ``false`` as its remote agent (it aborts at start-up looking for one even when every
    rank runs on this node; a user's own ``OMPI_MCA_plm_rsh_agent`` is kept); and Open MPI binds
    nothing (``OMPI_MCA_hwloc_base_binding_policy=none``, a user's own kept): by default it binds
    a job of one or two ranks to cores 0 and 1, so that several jobs started side by side (a
    bench's concurrent runs) would all share those two cores."""
    import shutil

    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if not k.startswith(CHILD_STRIP_PREFIXES)
           or (k.startswith(CHILD_KEEP_PREFIXES) and not k.startswith(LAUNCHER_MCA_PREFIXES))}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    agent = environ.get("OMPI_MCA_plm_rsh_agent")
    if agent is not None:
        env["OMPI_MCA_plm_rsh_agent"] = agent
    elif not (shutil.which("ssh") or shutil.which("rsh")):
        env["OMPI_MCA_plm_rsh_agent"] = "false"
    env["OMPI_MCA_hwloc_base_binding_policy"] = environ.get("OMPI_MCA_hwloc_base_binding_policy", "none")
    return env


def mpi_library() -> str:
    """The MPI library this process runs on, for the record: the first line of
    ``MPI_Get_library_version`` (whitespace collapsed) and mpi4py's vendor, e.g.
    ``MPICH Version: 5.0.2 (mpi4py vendor MPICH 5.0.2)``. NUL characters are dropped (Open MPI
    4.1's string ends in one, which an HDF5 string attribute refuses)."""
    from mpi4py import MPI

    text = MPI.Get_library_version().replace("\x00", " ")
    first = " ".join((text.strip().splitlines() or [""])[0].split())
    name, version = MPI.get_vendor()
    return f"{first} (mpi4py vendor {name} {'.'.join(str(v) for v in version)})"
