"""The rates of this machine the cost model needs, measured by a short micro-benchmark and cached
in a JSON file keyed by host name (so a plan does not re-measure; ``--recalibrate`` does).

Rates (node-wide: measured with all of the node's cores; :mod:`hpcgnn.plan.estimator` shares
them among the ranks of a node):

* ``agg``: the project's native SpMM (``native/spmm.cpp``, the kernel every CPU aggregation
  uses) on a uniform random graph (60k vertices, 2M edges), per row width: gathered bytes
  (edges x width x 4) per second; interpolated in log(width) between the measured widths;
* ``gemm_flops``: float32 ``torch.mm`` of [8192, 256] x [256, 256], flop/s;
* ``stream``: a 64 MiB ``copy_``, bytes read + written per second (elementwise passes);
* ``gather``: ``index_select`` of 1M random 128-wide rows, bytes gathered per second (row moves:
  offload transfers on a CPU, sampled inputs, the HEC);
* ``op_overhead_s``: seconds of one small torch operation (Python + dispatch): per-op cost of
  many small kernels (chunks, iterations);
* ``alltoall``: bytes per second per rank and latency (s) of ``MPI.Alltoall`` between 2 ranks of
  this node, measured by a child ``mpiexec -n 2`` (mpi4py); where that cannot run, the
  documented defaults :data:`DEFAULT_ALLTOALL` (``alltoall_source`` says which);
* ``h2d``: host-to-device bytes per second for CUDA offload: :data:`DEFAULT_H2D` (PCIe 4 x16,
  not measured on a machine without a GPU);
* ``baseline_rss``: resident bytes of a process with torch, the engines and the kernels
  imported (the memory estimate's ``baseline`` term).

File format: ``{"format": "hpcgnn-calibration", "version": 1, "hosts": {HOST: {...}}}``.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcgnn.errors import InputError

FORMAT = "hpcgnn-calibration"
VERSION = 1
AGG_WIDTHS = (16, 48, 128)
# Used when no 2-rank MPI job can be started: shared-memory MPICH on one node moves a few GB/s
# per rank; 30 us per small all-to-all.
DEFAULT_ALLTOALL = (2.0e9, 30e-6)
DEFAULT_H2D = 20e9


@dataclass
class Calibration:
    """Measured rates of one host (units in the module docstring)."""

    host: str
    cores: int
    agg: dict                      # width (int) -> gathered bytes/s
    gemm_flops: float
    stream: float
    gather: float
    op_overhead_s: float
    alltoall: float
    alltoall_latency_s: float
    alltoall_source: str
    baseline_rss: int
    h2d: float = DEFAULT_H2D
    measured_at: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def agg_rate(self, width: float) -> float:
        """Gathered bytes/s of an aggregation ``width`` columns wide (log-linear between the
        measured widths, clamped at the ends)."""
        pts = sorted((int(w), float(r)) for w, r in self.agg.items())
        w = max(float(width), 1.0)
        if w <= pts[0][0]:
            return pts[0][1]
        for (w0, r0), (w1, r1) in zip(pts, pts[1:]):
            if w == w1:
                return r1
            if w < w1:
                t = (math.log(w) - math.log(w0)) / (math.log(w1) - math.log(w0))
                return math.exp((1 - t) * math.log(r0) + t * math.log(r1))
        return pts[-1][1]

    def to_json(self) -> dict:
        d = asdict(self)
        d["agg"] = {str(k): float(v) for k, v in self.agg.items()}
        return d

    @classmethod
    def from_json(cls, d: dict, where: str) -> "Calibration":
        names = {f for f in cls.__dataclass_fields__}
        need = names - {"h2d", "measured_at", "seconds", "extra"}
        missing = sorted(need - set(d))
        if missing:
            raise InputError(f"{where}: calibration entry lacks {', '.join(missing)}")
        try:
            d = {k: v for k, v in d.items() if k in names}
            d["agg"] = {int(k): float(v) for k, v in d["agg"].items()}
            c = cls(**d)
            rates = [c.gemm_flops, c.stream, c.gather, c.alltoall, c.h2d, *c.agg.values()]
        except (TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{where}: calibration entry is malformed ({exc})") from None
        if not c.agg or any(not (isinstance(r, (int, float)) and r > 0) for r in rates):
            raise InputError(f"{where}: calibration rates must be positive numbers (agg, gemm_flops, "
                             "stream, gather, alltoall, h2d)")
        if c.op_overhead_s < 0 or c.alltoall_latency_s < 0 or c.baseline_rss < 0:
            raise InputError(f"{where}: op_overhead_s, alltoall_latency_s and baseline_rss must be >= 0")
        return c


def default_path() -> Path:
    """``$HPCGNN_CALIBRATION``, else ``~/.cache/hpcgnn/calibration.json``."""
    env = os.environ.get("HPCGNN_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "hpcgnn" / "calibration.json"


def read_file(path: Path) -> dict:
    """The hosts table of a calibration file ({} when the file does not exist)."""
    if not path.exists():
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a readable calibration file ({exc})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("hosts"), dict):
        raise InputError(f"{path}: 'format' is not {FORMAT!r} with a 'hosts' table")
    if d.get("version") != VERSION:
        raise InputError(f"{path}: calibration version {d.get('version')!r}, expected {VERSION} "
                         "(delete it or run with --recalibrate)")
    return d["hosts"]


def write_file(path: Path, hosts: dict) -> None:
    """Write the hosts table atomically (temporary name, then rename)."""
    from hpcgnn.fileio import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, "hosts": hosts},
                                  indent=1, sort_keys=True) + "\n")


def load_or_measure(path: Path | None, recalibrate: bool = False, log=print) -> Calibration:
    """This host's calibration from ``path`` (default :func:`default_path`); measured and added
    to the file when missing or with ``recalibrate``."""
    path = Path(path) if path else default_path()
    host = socket.gethostname()
    hosts = read_file(path)
    if host in hosts and not recalibrate:
        return Calibration.from_json(hosts[host], f"{path} [{host}]")
    log(f"calibrating {host} (micro-benchmark, about 10-20 s) ...")
    cal = measure()
    hosts[host] = cal.to_json()
    write_file(path, hosts)
    log(f"calibration of {host} written to {path} ({cal.seconds:.1f} s)")
    return cal


# ---- the micro-benchmark ---------------------------------------------------------------------

def measure(seed: int = 0) -> Calibration:
    """Run the micro-benchmark in this process (all cores) and return the rates."""
    import numpy as np

    import hpcgnn.engine.fullgraph  # noqa: F401 - the baseline includes what a rank imports
    import hpcgnn.engine.minibatch  # noqa: F401
    import hpcgnn.native  # noqa: F401
    from hpcgnn.native import spmm
    from hpcgnn.nn.aggregate import best_time
    from hpcgnn.plan.topology import this_machine_cores
    from hpcgnn.run.memory import rss_bytes

    baseline = rss_bytes()
    import torch

    t_start = time.perf_counter()
    cores = this_machine_cores()
    old_t, old_n = torch.get_num_threads(), spmm.max_threads()
    torch.set_num_threads(cores)
    spmm.set_threads(cores)
    rng = np.random.default_rng(seed)
    try:
        n, e = 60_000, 2_000_000            # mean degree 33 (ogbn-products: 50)
        dst = np.sort(rng.integers(0, n, e))
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
        indices = rng.integers(0, n, e).astype(np.int64)
        agg = {}
        for w in AGG_WIDTHS:
            x = rng.standard_normal((n, w), dtype=np.float32)
            out = np.empty_like(x)
            spmm.spmm_sum(indptr, indices, x, out)           # warm-up (page faults)
            agg[w] = e * w * 4 / best_time(lambda: spmm.spmm_sum(indptr, indices, x, out), 3)
        a, b = torch.randn(8192, 256), torch.randn(256, 256)
        torch.mm(a, b)
        gemm = 2 * 8192 * 256 * 256 / best_time(lambda: torch.mm(a, b), 5)
        src = torch.ones(16 << 20)
        dst_t = torch.zeros_like(src)
        dst_t.copy_(src)
        stream = 2 * src.numel() * 4 / best_time(lambda: dst_t.copy_(src), 10)
        table = torch.randn(n, 128)
        idx = torch.from_numpy(rng.integers(0, n, 1 << 20))
        gout = table.index_select(0, idx)
        gather = idx.numel() * 128 * 4 / best_time(lambda: torch.index_select(table, 0, idx, out=gout), 3)
        small = torch.ones(8)
        reps = 2000
        op = best_time(lambda: [small.add(1.0) for _ in range(reps)], 3) / reps
        a = b = src = dst_t = table = gout = None          # freed before the all-to-all
    finally:
        torch.set_num_threads(old_t)
        spmm.set_threads(old_n)
    bw, lat, source = measure_alltoall()
    return Calibration(host=socket.gethostname(), cores=cores, agg=agg, gemm_flops=gemm, stream=stream,
                       gather=gather, op_overhead_s=op, alltoall=bw, alltoall_latency_s=lat,
                       alltoall_source=source, baseline_rss=int(baseline),
                       measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       seconds=time.perf_counter() - t_start)


def measure_alltoall(timeout: float = 120.0) -> tuple[float, float, str]:
    """(bytes/s per rank, latency s, source) of ``MPI.Alltoall`` between 2 ranks of this node,
    from a child ``mpiexec -n 2`` (this interpreter's launcher, :func:`hpcgnn.runtime.find_mpiexec`,
    in a fresh MPI world); the defaults when that fails or when there is no launcher."""
    from hpcgnn.runtime import find_mpiexec, fresh_world_env

    mpiexec = find_mpiexec()
    if mpiexec is None:
        return (*DEFAULT_ALLTOALL, "default (no mpiexec for this python)")
    try:
        proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "hpcgnn.plan.calibrate", "--alltoall-child"],
                              capture_output=True, text=True, timeout=timeout, env=fresh_world_env())
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
        d = json.loads(proc.stdout.strip().splitlines()[-1])
        return float(d["bytes_per_s"]), float(d["latency_s"]), "measured (mpiexec -n 2, mpi4py Alltoall)"
    except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as exc:
        return (*DEFAULT_ALLTOALL, f"default ({type(exc).__name__}: {str(exc)[:80]})")


def _alltoall_child() -> None:
    """Child of :func:`measure_alltoall`: rank 0 prints one JSON line."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.size
    per = 4 << 20                                   # bytes to each peer
    sbuf = np.ones(per * p // 4, dtype=np.float32)
    rbuf = np.empty_like(sbuf)
    best = float("inf")
    for _ in range(8):
        comm.Barrier()
        t = time.perf_counter()
        comm.Alltoall(sbuf, rbuf)
        best = min(best, comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    s1, r1 = np.ones(p, dtype=np.float64), np.empty(p, dtype=np.float64)
    reps = 200
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        comm.Alltoall(s1, r1)
    lat = comm.allreduce((time.perf_counter() - t) / reps, op=MPI.MAX)
    if comm.rank == 0:
        # bytes each rank sends to the others per second
        print(json.dumps({"bytes_per_s": per * (p - 1) / max(best - lat, 1e-9), "latency_s": lat}))


if __name__ == "__main__":
    if sys.argv[1:] == ["--alltoall-child"]:
        _alltoall_child()
    else:
        cal = measure()
        print(json.dumps(cal.to_json(), indent=1))
