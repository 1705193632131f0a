"""Memory as a measured quantity: a process's resident set, its peak per phase, and the memory
a node offers its ranks. Sizes are in bytes.

* :func:`rss_bytes` / :func:`peak_rss_bytes`: ``VmRSS`` / ``VmHWM`` of ``/proc/self/status``.
* :func:`reset_peak_rss`: resets the high-water mark to the current RSS (``/proc/self/clear_refs``,
  Linux >= 4.0); where that is refused, peaks are cumulative since process start, and
  :class:`DeviceMemoryMeter` says so (``resettable``).
* :class:`DeviceMemoryMeter`: the one meter of a rank: the peak RSS and device memory of one
  epoch and the phase in which each was reached, read at the end of every timed phase (device
  memory: CUDA's allocator on a GPU, the engine's device-placed tensors on the CPU).
* :func:`device_free_bytes`: a CUDA device's free and total memory (``torch.cuda.mem_get_info``).
* :func:`node_available_bytes`: memory the ranks of this node may use: the smallest of the
  kernel's ``MemAvailable`` plus what this job's ranks already hold, a cgroup v2/v1 limit, and
  SLURM's ``--mem`` / ``--mem-per-cpu``.
* :func:`memory_budget`: the bytes of a ``--memory-budget`` option, or a fraction of what the
  node has available.
"""
from __future__ import annotations

import contextlib
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


class DeviceMemoryMeter:
    """The one memory meter of a rank: peak host RSS and peak device bytes of one epoch, with the
    phase in which each was reached (the :class:`~hpcgnn.run.timer.PhaseTimer` owns it and calls
    :meth:`after` at the end of every phase; the engines count their device buffers in it).

    Device bytes: on CUDA ``torch.cuda.max_memory_allocated`` since :meth:`start` (the only place
    that resets CUDA's peak; it does not synchronise). On the CPU, explicit accounting of the
    tensors an engine places on its compute device: :meth:`hold` / :meth:`release` count
    long-lived buffers, :meth:`scope` counts tensors registered with :meth:`track` plus every
    tensor autograd saves inside it (each storage once) and releases them on exit.

    ``result()`` -> ``peak_rss_bytes`` / ``peak_rss_phase``, and ``peak_device_bytes`` /
    ``peak_device_phase`` (on CUDA also under the names ``peak_cuda_bytes`` / ``peak_cuda_phase``),
    and ``peak_process_rss_bytes``: the process's high-water mark since it started, set-up
    included (resetting the kernel's mark for each epoch also resets what ``/usr/bin/time`` and
    ``wait4`` report, so the meter reads the mark before every reset and keeps the largest);
    ``peak_process_device_bytes`` likewise for the device: the largest device peak since the
    meter was made (on CUDA since the process started: its first reset is the meter's), set-up
    included, read before every reset.
    ``rss=False``: a meter for device accounting only, which never resets the RSS mark (an
    engine's own meter beside the timer's, so the rank's process peak stays whole).
    """

    def __init__(self, device="cpu", rss: bool = True):
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.rss = bool(rss)
        self.resettable = True
        self.current = 0
        self.peak = 0
        self.process_peak = 0
        self.process_dev_peak = 0
        self._seen: list[set] = []
        self.start()

    # ---- the epoch ------------------------------------------------------------------------
    def start(self) -> None:
        """A new epoch: reset the RSS high-water mark (kept in the process peak first; not with
        ``rss=False``), the device peak (to what is held now)."""
        self.process_peak = max(self.process_peak, peak_rss_bytes())
        self.process_dev_peak = max(self.process_dev_peak, self.peak_bytes)
        self.resettable = reset_peak_rss() if self.rss else False
        self.peak_rss = peak_rss_bytes()
        self.rss_phase = "start"
        self.peak = self.current
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak_dev = self.peak_bytes
        self.dev_phase = "start"

    reset = start

    def after(self, phase: str) -> None:
        """A phase ended: note the peaks reached since the last call and where."""
        hwm = peak_rss_bytes()
        if hwm > self.peak_rss:
            self.peak_rss, self.rss_phase = hwm, phase
        peak = self.peak_bytes
        if peak > self.peak_dev:
            self.peak_dev, self.dev_phase = peak, phase

    def result(self) -> dict:
        self.process_peak = max(self.process_peak, peak_rss_bytes())
        out = {"peak_rss_bytes": float(self.peak_rss), "peak_rss_phase": self.rss_phase,
               "peak_process_rss_bytes": float(self.process_peak)}
        self.process_dev_peak = max(self.process_dev_peak, self.peak_bytes)
        out.update(peak_device_bytes=float(self.peak_dev), peak_device_phase=self.dev_phase,
                   peak_process_device_bytes=float(self.process_dev_peak))
        if self.cuda:
            out.update(peak_cuda_bytes=float(self.peak_dev), peak_cuda_phase=self.dev_phase)
        return out

    # ---- device accounting (the CPU as the device) -----------------------------------------
    def _add(self, nbytes: int) -> None:
        self.current += int(nbytes)
        self.peak = max(self.peak, self.current)

    def hold(self, nbytes: int) -> None:
        """Count a buffer that stays resident until :meth:`release`."""
        self._add(nbytes)

    def release(self, nbytes: int) -> None:
        self.current -= int(nbytes)

    def track(self, *tensors) -> None:
        """Count tensors living until the enclosing :meth:`scope` ends (each storage once)."""
        for t in tensors:
            if t is None:
                continue
            seen = self._seen[-1] if self._seen else None
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if seen is not None:
                if key in seen:
                    continue
                seen.add(key)
            self._add(st.nbytes())

    @contextlib.contextmanager
    def scope(self):
        """Count tensors tracked or saved for backward inside; release them on exit."""
        import torch

        start = self.current
        self._seen.append(set())

        def pack(t):
            self.track(t)
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            self._seen.pop()
            self.current = start

    @property
    def peak_bytes(self) -> int:
        """Peak device bytes since :meth:`start` (CUDA: the allocator's; CPU: the accounting)."""
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self.peak)


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


DEFAULT_BUDGET_FRACTION = 0.8     # of the node's available memory


def memory_budget(text: str | None) -> tuple[int, str]:
    """(bytes, how it was chosen) of ``--memory-budget``: the size given, or
    DEFAULT_BUDGET_FRACTION of what this node has available (:func:`node_available_bytes`)."""
    from hpcgnn.units import parse_size

    if text is not None:
        return parse_size(text, "--memory-budget"), "given"
    avail, where = node_available_bytes(held_by_job=rss_bytes())
    return int(avail * DEFAULT_BUDGET_FRACTION), f"{DEFAULT_BUDGET_FRACTION:.0%} of {where}"


def device_free_bytes(device) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the CUDA device ``device`` (``torch.cuda.mem_get_info``), None
    off CUDA or without a GPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def cuda_library_bytes(device) -> int | None:
    """Device bytes the CUDA math libraries keep allocated through torch's caching allocator once
    they have run on ``device`` (the cuBLAS and cuBLASLt workspaces, per stream; cuSPARSE's
    buffers are per call and freed): ``torch.cuda.memory_allocated`` after a small linear layer
    (bias: cuBLASLt) forward and backward, a plain product (cuBLAS) and a sparse CSR product
    (cuSPARSE), less before, on the current stream. What a training epoch's
    ``max_memory_allocated`` holds beside its tensors; 0 once the libraries have run (their
    workspaces are then part of the allocated bytes already), None off CUDA or without a GPU."""
    import torch

    from hpcgnn.nn.aggregate import sparse_dense_mm
    from hpcgnn.sampling.block import sparse_csr

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    x = torch.ones(64, 64, device=device, requires_grad=True)
    lin = torch.nn.Linear(64, 64).to(device)
    lin(x).sum().backward()
    y = x.detach() @ x.detach()
    a = sparse_csr(torch.arange(65, device=device), torch.arange(64, device=device), torch.ones(64, device=device),
                   (64, 64))
    z = sparse_dense_mm(a, y)
    del x, lin, y, a, z
    torch.cuda.synchronize(device)
    return max(int(torch.cuda.memory_allocated(device)) - int(before), 0)


def estimate_against_peak(estimates: str | None, peaks) -> list[dict]:
    """Each rank's pre-run estimate beside its measured peak: ``estimates`` is a run file's
    ``estimated_peak_*_bytes`` attribute (a JSON list per rank, None where none was made),
    ``peaks`` the matching ``[epochs, ranks]`` counter. One ``{rank, estimated, measured, ratio}``
    (bytes; ``ratio`` = estimated / measured, None without a positive measurement) per rank that
    has both; ``[]`` when either is missing."""
    import json

    import numpy as np

    if not estimates or peaks is None:
        return []
    peaks = np.asarray(peaks, dtype=np.float64)
    if peaks.ndim != 2 or peaks.size == 0:
        return []
    rows = []
    for r, est in enumerate(json.loads(estimates)):
        if est is None or r >= peaks.shape[1] or not np.isfinite(peaks[:, r]).any():
            continue
        measured = float(np.nanmax(peaks[:, r]))
        rows.append({"rank": r, "estimated": int(est), "measured": measured,
                     "ratio": est / measured if measured > 0 else None})
    return rows
