"""The machine a plan is made for: ranks, how many share a node, and the memory each may use.

Sizes are bytes. ``device`` is ``"cpu"`` (the compute runs in host memory: device memory is not
a separate budget) or ``"cuda"`` (one GPU per rank with ``device_memory`` bytes each).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

from hpcgnn.errors import InputError


@dataclass(frozen=True)
class Topology:
    """ranks: MPI ranks of the run; ranks_per_node: ranks sharing one node's cores, memory
    bandwidth and ``host_memory``; cores: cores per node; device_memory: bytes per GPU (0 on cpu)."""

    host: str
    ranks: int
    ranks_per_node: int
    cores: int
    host_memory: int
    host_memory_source: str
    device: str = "cpu"
    device_memory: int = 0

    def __post_init__(self):
        if self.ranks < 1:
            raise InputError(f"--ranks {self.ranks}: expected a positive number of ranks")
        if not 1 <= self.ranks_per_node <= self.ranks:
            raise InputError(f"--ranks-per-node {self.ranks_per_node}: expected 1 .. --ranks ({self.ranks})")
        if self.host_memory <= 0:
            raise InputError(f"--host-memory {self.host_memory}: expected a positive size")
        if self.device not in ("cpu", "cuda"):
            raise InputError(f"device {self.device!r}: expected 'cpu' or 'cuda'")

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.ranks_per_node)


def this_machine_cores() -> int:
    """Cores this process may run on (:func:`hpcgnn.runtime.usable_cpus`)."""
    from hpcgnn.runtime import usable_cpus

    return usable_cpus()


def build_topology(ranks: int, ranks_per_node: int | None, host_memory: str | None,
                   device: str, device_memory: str | None) -> Topology:
    """The topology from command-line values: ``host_memory`` / ``device_memory`` are sizes such
    as ``"24GiB"`` (None: this machine's available memory; 80 GiB per GPU); ``ranks_per_node``
    None = all ranks on one node (a workstation)."""
    from hpcgnn.run.memory import node_available_bytes
    from hpcgnn.units import parse_size

    if host_memory:
        hm, src = parse_size(host_memory, "--host-memory"), "--host-memory"
    else:
        hm, src = node_available_bytes()
    dm = 0
    if device == "cuda":
        dm = parse_size(device_memory, "--device-memory") if device_memory else 80 << 30
    return Topology(host=socket.gethostname(), ranks=int(ranks),
                    ranks_per_node=int(ranks_per_node or ranks), cores=this_machine_cores(),
                    host_memory=int(hm), host_memory_source=src, device=device, device_memory=int(dm))
