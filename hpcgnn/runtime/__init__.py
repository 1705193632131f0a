"""The MPI process runtime every engine runs in, one job per module:

* :mod:`~hpcgnn.runtime.rank` - :class:`Runtime`, one rank's view of the job: MPI's start, threads
  per rank, the failure policy (one line and exit 2 for input errors, ``MPI_Abort`` otherwise),
  ``torch.distributed``;
* :mod:`~hpcgnn.runtime.process` - process tuning: huge pages, sleeping when oversubscribed,
  keeping freed host memory, the launcher's world size;
* :mod:`~hpcgnn.runtime.gpu` - GPU placement: the CUDA device of a node-local rank, shared GPUs;
* :mod:`~hpcgnn.runtime.child` - the launcher and environment of a child MPI job started from
  this process.

The names other modules use are importable from ``hpcgnn.runtime`` itself.
"""
from hpcgnn.runtime.child import (CHILD_KEEP_PREFIXES, CHILD_STRIP_PREFIXES, LAUNCHER_MCA_PREFIXES, find_mpiexec,
                                  fresh_world_env, mpi_library)
from hpcgnn.runtime.gpu import DeviceChoice, choose_cuda_device, gpu_identity, shared_gpus
from hpcgnn.runtime.process import (HEAVY_YIELD_VAR, HYDRA_LOCAL_SIZE_VAR, LAUNCHER_SIZE_VARS, RETAIN_TOP_PAD,
                                    prefer_huge_pages, retain_freed_host_memory, usable_cpus,
                                    yield_when_oversubscribed)
from hpcgnn.runtime.rank import (ERROR_WAIT_S, PEER_FAILURE_DELAY_S, WRITE_ERRNOS, Runtime, is_peer_failure,
                                 write_failure_message)

__all__ = ["CHILD_KEEP_PREFIXES", "CHILD_STRIP_PREFIXES", "LAUNCHER_MCA_PREFIXES", "find_mpiexec", "fresh_world_env",
           "mpi_library", "DeviceChoice", "choose_cuda_device", "gpu_identity", "shared_gpus", "HEAVY_YIELD_VAR",
           "HYDRA_LOCAL_SIZE_VAR", "LAUNCHER_SIZE_VARS", "RETAIN_TOP_PAD", "prefer_huge_pages",
           "retain_freed_host_memory", "usable_cpus", "yield_when_oversubscribed", "ERROR_WAIT_S",
           "PEER_FAILURE_DELAY_S", "WRITE_ERRNOS", "Runtime", "is_peer_failure", "write_failure_message"]
