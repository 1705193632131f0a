"""Memory as a measured quantity: a process's resident set, its peak per phase, and the memory
a node offers its ranks. Sizes are in bytes.

* :func:`rss_bytes` / :func:`peak_rss_bytes`: ``VmRSS`` / ``VmHWM`` of ``/proc/self/status``.
* :func:`reset_peak_rss`: resets the high-water mark to the current RSS (``/proc/self/clear_refs``,
  Linux >= 4.0); where that is refused, peaks are cumulative since process start, and
  :class:`PeakMonitor` says so (``resettable``).
* :class:`PeakMonitor`: the peak RSS (and CUDA memory) of one epoch and the phase in which it was
  reached, read at the end of every timed phase.
* :func:`node_available_bytes`: memory the ranks of this node may use: the smallest of the
  kernel's ``MemAvailable`` plus what this job's ranks already hold, a cgroup v2/v1 limit, and
  SLURM's ``--mem`` / ``--mem-per-cpu``.
"""
from __future__ import annotations

import os
from pathlib import Path


def _proc_kib(path: str, key: str) -> int | None:
    """The kB figure of line ``key:`` in a /proc file such as /proc/self/status or /proc/meminfo."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _status_kib(key: str) -> int | None:
    return _proc_kib("/proc/self/status", key)


def rss_bytes() -> int:
    """Current resident set size of this process (0 where /proc is missing)."""
    v = _status_kib("VmRSS")
    return 0 if v is None else v * 1024


def peak_rss_bytes() -> int:
    """High-water mark of the resident set since start or the last :func:`reset_peak_rss`."""
    v = _status_kib("VmHWM")
    if v is None:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return v * 1024


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMonitor:
    """Peak host RSS and CUDA memory of one epoch, with the phase where each peak happened.

    ``start()`` at the beginning of an epoch; ``after(phase)`` when a phase ends (the timer calls
    it); ``result()`` -> dict with ``peak_rss_bytes``, ``peak_rss_phase``, and on a GPU
    ``peak_cuda_bytes`` / ``peak_cuda_phase`` (``torch.cuda.max_memory_allocated``).
    """

    def __init__(self, cuda_device=None):
        self.cuda_device = cuda_device
        self.resettable = True
        self.start()

    def start(self) -> None:
        self.resettable = reset_peak_rss()
        self.peak_rss = peak_rss_bytes()
        self.rss_phase = "start"
        self.peak_cuda = 0
        self.cuda_phase = ""
        if self.cuda_device is not None:
            import torch

            torch.cuda.reset_peak_memory_stats(self.cuda_device)
            self.peak_cuda = int(torch.cuda.max_memory_allocated(self.cuda_device))
            self.cuda_phase = "start"

    def after(self, phase: str) -> None:
        hwm = peak_rss_bytes()
        if hwm > self.peak_rss:
            self.peak_rss, self.rss_phase = hwm, phase
        if self.cuda_device is not None:
            import torch

            peak = int(torch.cuda.max_memory_allocated(self.cuda_device))
            if peak > self.peak_cuda:
                self.peak_cuda, self.cuda_phase = peak, phase

    def result(self) -> dict:
        out = {"peak_rss_bytes": float(self.peak_rss), "peak_rss_phase": self.rss_phase}
        if self.cuda_device is not None:
            out.update(peak_cuda_bytes=float(self.peak_cuda), peak_cuda_phase=self.cuda_phase)
        return out


# ---- what a node offers ------------------------------------------------------------------

def _meminfo_kib(key: str) -> int | None:
    return _proc_kib("/proc/meminfo", key)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return v if v < (1 << 60) else None


def cgroup_limit_bytes() -> tuple[int, int] | None:
    """(limit, current usage) of this process's memory cgroup, or None when unlimited/unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, rel = parts
        if hier == "0" and controllers == "":   # cgroup v2
            base = Path("/sys/fs/cgroup") / rel.lstrip("/")
            limit, cur = _read_int(base / "memory.max"), _read_int(base / "memory.current")
        elif "memory" in controllers.split(","):   # cgroup v1
            base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            limit, cur = _read_int(base / "memory.limit_in_bytes"), _read_int(base / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None:
            return limit, cur or 0
    return None


def slurm_limit_bytes(env=None) -> int | None:
    """This node's share of a SLURM allocation's memory (``--mem`` or ``--mem-per-cpu``), if any."""
    env = os.environ if env is None else env
    per_node = env.get("SLURM_MEM_PER_NODE")
    if per_node and per_node.isdigit() and int(per_node) > 0:
        return int(per_node) << 20
    per_cpu = env.get("SLURM_MEM_PER_CPU")
    cpus = env.get("SLURM_CPUS_ON_NODE")
    if per_cpu and per_cpu.isdigit() and cpus and cpus.isdigit():
        return (int(per_cpu) * int(cpus)) << 20
    return None


def node_available_bytes(held_by_job: int = 0, env=None) -> tuple[int, str]:
    """(bytes the ranks of this node may use in all, where that figure comes from).

    ``held_by_job``: what this job's ranks on the node already hold (their RSS), added back to
    the kernel's MemAvailable because the estimate being checked includes it.
    """
    avail = _meminfo_kib("MemAvailable")
    best = (avail * 1024 + held_by_job, "MemAvailable") if avail is not None else (1 << 62, "unknown")
    cg = cgroup_limit_bytes()
    if cg is not None and cg[0] - cg[1] + held_by_job < best[0]:
        best = (cg[0] - cg[1] + held_by_job, "cgroup memory limit")
    sl = slurm_limit_bytes(env)
    if sl is not None and sl < best[0]:
        best = (sl, "SLURM memory allocation")
    return best
