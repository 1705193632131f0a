"""`make check-gpu`: every engine and mode on CUDA against the same run on the CPU (docs/gpu.md).

    python -m tools.gpu_check [--out runs/gpu-check] [--ranks 1,2] [--modes M,...]
        [--epochs 4] [--graph cora|sbm:N] [--rtol 1e-4] [--set key=value ...] [--device cuda|cpu]
        [--jobs J] [--deadline UNIX_SECONDS]

For each mode (:data:`MODES`) and rank count, ``hpcgnn train`` runs under ``mpiexec -n K`` twice
on the same partition store (Cora imported from ``inputs/data/cora``, or a small synthetic SBM
graph), once with ``train.device = "cuda"`` (``K`` ranks share the visible GPUs) and once on the
CPU (``runtime.backend = "mpi4py"``): dropout off, same seed, so the two loss curves differ only
by floating-point summation order. ``infer`` runs ``hpcgnn infer`` on the device and on the CPU
from the same CPU-trained checkpoint and compares the logits. ``comm-nccl`` (1 rank: one GPU
cannot host two NCCL ranks) and ``comm-gloo`` (2 ranks sharing the GPU through the host) run the
in-memory full-graph mode with that ``runtime.backend`` against its CPU run.

**Tolerance** (``--rtol``, default 1e-4): the largest ``|loss_dev - loss_cpu| / |loss_cpu|`` over
the epochs (for ``infer``: ``max |logits_dev - logits_cpu| / max |logits_cpu|``). float32 with
dropout off: CPU and GPU kernels add in other orders (BLAS blocking, GPU atomics), ~1e-7 relative
per operation; the same reordering between 1 rank and 2 offloaded ranks stays within 1e-5 after 4
epochs (tests/engine/test_fullgraph_cli.py), so 1e-4 leaves a 10x margin and still catches a
wrong kernel, a stale halo row or TF32 GEMMs (10-bit mantissa, ~1e-3 per product; the runs set
``NVIDIA_TF32_OVERRIDE=0`` and PyTorch's default keeps TF32 off).

Table: mode, ranks, backend, epoch seconds (median over epochs 2.., slowest rank; ``infer``: the
command's wall seconds), peak device memory (largest rank, MiB), host-to-device MiB per epoch
(all ranks), loss max deviation, status: ``ok``, ``DEVIATES`` (above ``--rtol``), ``FAILED`` (the
one-line error; the check continues) or ``skipped``. Each row's line is printed when it is done and the file is written again
after every row, so that what finished is kept if the check is stopped; the whole table is
printed at the end. Written with both loss curves
to ``OUT/gpu-check.h5`` (:mod:`benchmarks.results_file`, format ``hpcgnn-bench-gpu-check``);
each run's log and run directory stay in ``OUT/work``. Exit 0 when every row is ``ok`` or
``skipped``, 1 otherwise. Without a CUDA GPU (``--device cuda``) one line, exit 0.

**Concurrency** (``--jobs J``, default one per 4 usable cores, at most 4): the CPU reference
runs need no GPU, so with ``J > 1`` they all start at once on ``J - 1`` workers while the device
runs go one after another; every run then gets ``cores / (2 J)`` threads a rank
(``HPCGNN_THREADS``), the same for a row's two runs. On a 16-core GPU node this about halves the
check's wall time (the device time a lent machine is charged for); on 2 cores it stays serial.

**Deadline** (``--deadline``, a Unix time): for a machine lent by the minute. No run starts
after it (its rows are ``skipped``, "no time left") and no run may last beyond it (its timeout is
cut to what is left), so the check ends by then with its file written.

``--device cpu`` is a self-check of this driver on a machine without a GPU: the "device" runs are
CPU runs too (identical curves expected), ``comm-nccl`` is skipped.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.launch import child_env, find_mpiexec, python_command, run_logged
from hpcgnn.runtime import usable_cpus

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-4
FORMAT = "hpcgnn-bench-gpu-check"


@dataclass(frozen=True)
class Mode:
    """One row family of the check: ``sets`` on top of :data:`COMMON`; ``ref`` names the mode whose
    CPU run is the reference (default: itself); ``ranks`` limits the rank counts; ``backend`` is the
    device run's ``runtime.backend``; ``infer``: compare ``hpcgnn infer`` from ``ref``'s checkpoint."""
    summary: str
    sets: tuple = ()
    ref: str | None = None
    ranks: tuple | None = None
    backend: str = "mpi4py"
    infer: bool = False


MINIBATCH = ("train.engine=minibatch", "model.arch=sage", "minibatch.batch_size=16", "minibatch.fanouts=[10, 10]",
             "minibatch.halo=hec", "minibatch.push_delay=1", "minibatch.push_limit=2000", "minibatch.cache_lines=1000000",
             "minibatch.cache_lifespan=2", "minibatch.eval=full", "store.device_memory=0.3", "store.overlap=true")
FULLGRAPH = ("train.engine=fullgraph", "model.arch=gcn", "fullgraph.offload=false")
MODES: dict[str, Mode] = {
    "minibatch-hec-aep-tiered": Mode("minibatch, HEC + AEP halo, tiered store (30% of rows on the device)",
                                     MINIBATCH),
    "minibatch-hec-aep-device": Mode("the same with store.device_memory = auto: every feature row and HEC line "
                                     "on the device", MINIBATCH + ("store.device_memory=auto",)),
    "fullgraph-memory": Mode("full graph in device memory, exact halo", FULLGRAPH),
    "fullgraph-offload-dedup": Mode("full graph offloaded (HongTu): 4 chunks, 2 per batch, dedup",
                                    FULLGRAPH + ("fullgraph.offload=true", "fullgraph.chunks=4",
                                                 "fullgraph.batch_chunks=2", "fullgraph.dedup=true")),
    "fullgraph-cached-pipelined": Mode("full graph, cached + pipelined halo (S=2), 8 KiB device tier",
                                       FULLGRAPH + ("fullgraph.halo=cached", "fullgraph.staleness=2",
                                                    "fullgraph.pipeline=true",
                                                    "fullgraph.cache_device_memory=8KiB")),
    "tensor-decoupled-chunked": Mode("tensor parallel, decoupled (k=4), 4 pipelined chunks, staged",
                                     ("train.engine=tensor", "model.arch=gcn", "tensor.mode=decoupled",
                                      "tensor.k=4", "tensor.alpha=0.1", "tensor.chunks=4", "tensor.staged=true",
                                      "tensor.pipeline=true")),
    "tensor-decoupled-streamed": Mode("the same with a 1 KiB device budget: not resident, every round "
                                      "streams its chunks, their CSRs and host-built transposes",
                                      ("train.engine=tensor", "model.arch=gcn", "tensor.mode=decoupled",
                                       "tensor.k=4", "tensor.alpha=0.1", "tensor.chunks=4", "tensor.staged=true",
                                       "tensor.pipeline=true", "tensor.device_memory=1KiB")),
    "infer": Mode("hpcgnn infer (logits) from the minibatch run's CPU checkpoint",
                  ref="minibatch-hec-aep-tiered", infer=True),
    "comm-nccl": Mode("full graph in memory, runtime.backend = nccl", FULLGRAPH, ref="fullgraph-memory",
                      ranks=(1,), backend="nccl"),
    "comm-gloo": Mode("full graph in memory, runtime.backend = gloo (host path, GPU shared)", FULLGRAPH,
                      ref="fullgraph-memory", ranks=(2,), backend="gloo"),
}
COMMON = ("model.dropout=0", "model.hidden=16", "model.layers=2", "train.lr=0.01", "train.weight_decay=5e-4",
          "train.seed=0", "train.eval_every=0", "train.checkpoint_every=0", "output.keep_checkpoints=1")


@dataclass
class Run:
    """One finished (or failed) subprocess: its run directory or output file, wall seconds, error."""
    path: Path
    wall_s: float
    error: str = ""
    extra: dict = field(default_factory=dict)


def no_cuda_reason() -> str:
    """'' when PyTorch sees a CUDA GPU; else the one-line reason."""
    try:
        import torch
    except ImportError as exc:
        return f"PyTorch does not import in {sys.executable} ({exc})"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA GPU visible to PyTorch {torch.__version__} ({build}) in {sys.executable}"
    return ""


def error_line(text: str) -> str:
    """The one line that says why a child failed: hpcgnn's own error line, else the last
    exception line, else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if re.search(r"\w", ln)]
    for pat in (r"^hpcgnn: error: ", r"^hpcgnn: rank \d+/\d+ .*failed: ", r"^[A-Za-z_.]*(Error|Exception)\b.*"):
        hits = [ln for ln in lines if re.match(pat, ln)]
        if hits:
            return hits[-1]
    return lines[-1] if lines else "no output"


def default_jobs(cores: int) -> int:
    """``--jobs`` when not given: one per 4 cores, 1 to 4 (serial on a 2-core machine)."""
    return max(1, min(4, cores // 4))


def run_threads(jobs: int, cores: int) -> int:
    """Threads a rank of every run gets with ``jobs`` concurrent runs of up to 2 ranks on
    ``cores`` CPUs; 0 (the runtime's own choice) when the check is serial."""
    return 0 if jobs <= 1 else max(1, cores // (2 * jobs))


def launch(args: list[str], ranks: int, log: Path, timeout: float, mpiexec: str | None,
           threads: int = 0) -> tuple[float, str]:
    """Run ``python -m hpcgnn ARGS`` on ``ranks`` ranks from the repository root with its output
    in ``log`` (``threads`` > 0: that many a rank, ``HPCGNN_THREADS``): (wall seconds, '' or the
    one-line error)."""
    if mpiexec is None and ranks > 1:
        return 0.0, "no mpiexec found (beside the interpreter, in the MPICH wheel or on PATH)"
    if timeout <= 0:
        return 0.0, "no time left (--deadline)"
    cmd = ([mpiexec, "-n", str(ranks)] if mpiexec else []) + [*python_command(), "-m", "hpcgnn", *args]
    env = child_env(NVIDIA_TF32_OVERRIDE="0", **({"HPCGNN_THREADS": str(threads)} if threads > 0 else {}))
    rc, wall = run_logged(cmd, log, timeout, env)
    if rc is None:
        return wall, f"timed out after {timeout:g} s (log {log})"
    return wall, "" if rc == 0 else f"exit {rc}: {error_line(log.read_text())}"


def train_sets(mode: Mode, store: Path, run: Path, device: str, backend: str, epochs: int,
               extra: list[str]) -> list[str]:
    """The ``--set`` arguments of one training run. On the CPU a stated device size of 1 TiB, so
    that the pre-run device estimate is made and recorded there too (on CUDA it always is, against
    the GPU's free memory): the table's ``est/peak``."""
    stated = ["runtime.device_memory_limit=1TiB"] if device == "cpu" else []
    sets = [*COMMON, *mode.sets, f"data.partitions={store}", f"output.dir={run}", f"train.device={device}",
            f"runtime.backend={backend}", f"train.epochs={epochs}", *stated, *extra]
    return [a for s in sets for a in ("--set", s)]


def run_figures(run_dir: Path) -> dict:
    """Loss curve and the table's figures of one run file."""
    import numpy as np

    from hpcgnn.run.runfile import read_run

    r = read_run(run_dir)
    if r["attrs"].get("status") != "finished":
        raise RuntimeError(f"{run_dir}: run status {r['attrs'].get('status')!r}, expected 'finished'")
    c, epoch = r["counters"], r["timings"]["epoch"]
    steady = epoch[1:] if epoch.shape[0] > 1 else epoch
    peak = next((c[k] for k in ("peak_cuda_bytes", "peak_device_bytes") if k in c and np.nanmax(c[k]) > 0), None)
    if "h2d_bytes" in c:                  # the offloaded engine's total (rows + cache + gradients)
        h2d = c["h2d_bytes"]
    elif "store_h2d_bytes" in c:          # the vertex data store's reads onto the device
        h2d = c["store_h2d_bytes"]
    else:
        keys = [k for k in c if re.fullmatch(r"h2d_\w+_bytes", k) and "nodedup" not in k]
        h2d = sum(c[k] for k in keys) if keys else None
    labels = r.get("labels", {})
    whole = c.get("peak_process_device_bytes")    # set-up included
    terms = r["attrs"].get("estimated_device_terms")
    phases = labels.get("peak_cuda_phase", labels.get("peak_device_phase"))
    return {"estimate_ratio": estimate_ratio(r["attrs"].get("estimated_peak_device_bytes"), peak),
            # per rank, for calibrating the estimate: its terms and the phase of each epoch's peak
            "estimated_device_terms": terms,      # JSON as the run file has it (read_run decodes text)
            "peak_device_phase": None if phases is None else json.dumps(np.asarray(phases).tolist()),
            "loss": np.asarray(r["metrics"]["loss"], dtype=np.float64),
            "epoch_s": float(np.median(np.nanmax(steady, axis=1))),
            "peak_device_bytes": None if peak is None else float(np.nanmax(peak)),
            "peak_device_setup_bytes": None if whole is None or not np.nanmax(whole) > 0 else float(np.nanmax(whole)),
            "h2d_bytes_per_epoch": None if h2d is None else float(np.nanmean(np.nansum(h2d, axis=1))),
            "devices": sorted({str(d) for d in np.asarray(labels["device"]).ravel()}) if "device" in labels else []}


def estimate_ratio(estimates, peaks) -> float | None:
    """The pre-run device estimate over the measured peak, for the rank where it is furthest from 1
    (a ratio below 1: the estimate fell short). ``estimates``: the run file's
    ``estimated_peak_device_bytes`` (JSON list per rank, None where none was made); ``peaks``:
    ``[epochs, ranks]`` measured device peaks (:func:`hpcgnn.run.memory.estimate_against_peak`).
    None when either is missing."""
    import math

    from hpcgnn.run.memory import estimate_against_peak

    ratios = [r["ratio"] for r in estimate_against_peak(estimates, peaks) if r["ratio"]]
    return max(ratios, key=lambda x: abs(math.log(x))) if ratios else None


def deviation(got, ref) -> float:
    """Largest relative deviation ``|got - ref| / |ref|`` of two loss curves (inf when their
    lengths differ or either is not finite)."""
    import numpy as np

    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape or got.size == 0 or not (np.isfinite(got).all() and np.isfinite(ref).all()):
        return float("inf")
    return float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)))


def logits_deviation(got_file: Path, ref_file: Path) -> float:
    """``max |got - ref| / max |ref|`` of two ``hpcgnn infer`` logits files (inf on a shape mismatch)."""
    import h5py
    import numpy as np

    with h5py.File(got_file, "r") as g, h5py.File(ref_file, "r") as r:
        a, b = np.asarray(g["logits"], dtype=np.float64), np.asarray(r["logits"], dtype=np.float64)
    if a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), np.finfo(np.float64).tiny))


def row_status(dev: float | None, rtol: float, error: str) -> tuple[str, str]:
    """(status, error) of a row: FAILED with the error, DEVIATES above ``rtol``, else ok."""
    if error:
        return "FAILED", error
    if dev is None:
        return "FAILED", "no deviation was measured"
    if not dev <= rtol:
        return "DEVIATES", f"loss deviates from the CPU run by {dev:.3g} (rtol {rtol:g})"
    return "ok", ""


def prepare_graph(graph: str, work: Path, ranks: list[int], timeout: float, mpiexec) -> dict[int, Path]:
    """{K: partition store} of ``graph`` (cora or sbm:N) for each K, made in ``work`` (SystemExit
    with the one-line error when that fails: nothing can be checked)."""
    f = work / "graph.h5"
    if graph == "cora":
        args = ["prepare", "--dataset", "cora", "--root", str(ROOT / "inputs" / "data")]
    else:
        n = int(graph.split(":", 1)[1])
        args = ["prepare", "--dataset", "sbm", "--nodes", str(n), "--edges", str(5 * n), "--features", "16",
                "--classes", "4", "--train", "0.3", "--val", "0.1", "--test", "0.2", "--seed", "0"]
    _, err = launch(args + ["--out", str(f), "--force"], 1, work / "prepare.log", timeout, None)
    stores = {}
    for k in ranks:
        if not err:
            stores[k] = work / f"parts-{k}"
            _, err = launch(["partition", str(f), "--parts", str(k), "--seed", "0", "--out", str(stores[k]),
                             "--force"], 1, work / f"partition-{k}.log", timeout, None)
    if err:
        raise SystemExit(f"gpu-check: preparing the {graph} graph failed: {err}")
    return stores


def run_timeout(args) -> float:
    """Seconds a run may take now: ``--timeout``, cut to what is left before ``--deadline``."""
    if not args.deadline:
        return args.timeout
    return min(args.timeout, args.deadline - time.time())


def check_attrs(args, mpiexec) -> dict:
    """The check's attributes in its file (settings, versions, the GPU)."""
    attrs = {"rtol": args.rtol, "epochs": args.epochs, "graph": args.graph, "device": args.device, "jobs": args.jobs,
             "python": sys.version.split()[0], "mpiexec": mpiexec or "", "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        import torch
        attrs.update(torch=torch.__version__, torch_cuda=torch.version.cuda or "")
        if args.device == "cuda":
            attrs["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the attributes are informative only
        pass
    return attrs


def check(args) -> tuple[list[dict], dict]:
    """Every (mode, ranks) row (see the module docstring) and the run's attributes; the file is
    written after every row."""
    work = Path(args.out) / "work"
    work.mkdir(parents=True, exist_ok=True)
    mpiexec = find_mpiexec()
    stores = prepare_graph(args.graph, work, args.ranks, run_timeout(args), mpiexec)
    threads = run_threads(args.jobs, usable_cpus())
    pool = ThreadPoolExecutor(max_workers=args.jobs - 1) if args.jobs > 1 else None
    refs: dict[tuple[str, int], Future] = {}

    def train(name: str, k: int, device: str, backend: str, role: str) -> Run:
        tag = f"{role}-{name}-{device}-{backend}-{k}"
        path = work / tag
        wall, err = launch(["train", "--config", str(work / "base.toml"), "--force",
                            *train_sets(MODES[name], stores[k], path, device, backend, args.epochs, args.set)],
                           k, work / f"{tag}.log", run_timeout(args), mpiexec, threads)
        run = Run(path, wall, err)
        if not err:
            try:
                run.extra = run_figures(path)
            except (OSError, KeyError, RuntimeError, ValueError) as exc:
                run.error = f"{type(exc).__name__}: {exc}"
        return run

    def start_reference(name: str, k: int) -> Future:
        """The CPU reference run of (name, k), started once (on the pool when there is one)."""
        if (name, k) not in refs:
            if pool is None:
                refs[(name, k)] = Future()
                refs[(name, k)].set_result(train(name, k, "cpu", "mpi4py", "ref"))
            else:
                refs[(name, k)] = pool.submit(train, name, k, "cpu", "mpi4py", "ref")
        return refs[(name, k)]

    def reference(name: str, k: int) -> Run:
        return start_reference(name, k).result()

    def measure(name: str, k: int, row: dict) -> tuple[float | None, str]:
        """(deviation, error) of one row; fills the row's figures."""
        mode = MODES[name]
        ref = reference(mode.ref or name, k)
        if ref.error:
            return None, f"CPU reference run: {ref.error}"
        if mode.infer:
            files, err, wall = {}, "", 0.0
            for role, device in (("ref", "cpu"), ("dev", args.device)):   # the device's wall time is kept
                files[role] = work / f"{role}-{name}-{device}-{k}.h5"
                wall, err = launch(["infer", str(ref.path), "--out", str(files[role]), "--device", device,
                                    "--force"], k, work / f"{role}-{name}-{device}-{k}.log", run_timeout(args),
                                   mpiexec, threads)
                if err:
                    break
            dev = None if err else logits_deviation(files["dev"], files["ref"])
            row.update(epoch_s=wall, loss_max_dev=dev)
        else:
            got = train(name, k, args.device, mode.backend, "dev")
            err, dev = got.error, None
            wrong = [d for d in got.extra.get("devices", []) if not d.startswith(args.device)]
            if not err and wrong:       # a silent fall-back to another device would compare nothing
                err = f"the run's labels/device say {', '.join(wrong)}, expected {args.device}"
            if not err:
                dev = deviation(got.extra["loss"], ref.extra["loss"])
                row.update({key: got.extra[key] for key in ("epoch_s", "peak_device_bytes", "h2d_bytes_per_epoch",
                                                            "estimate_ratio", "estimated_device_terms",
                                                            "peak_device_phase", "peak_device_setup_bytes")},
                           loss_max_dev=dev, loss_device=got.extra["loss"].tolist(),
                           loss_cpu=ref.extra["loss"].tolist(), devices=", ".join(got.extra["devices"]))
        return dev, err

    (work / "base.toml").write_text("# gpu-check: every key is passed with --set (tools/gpu_check.py)\n")
    planned = [(name, k) for name in args.modes for k in args.ranks if skip_reason(MODES[name], k, args.device) == ""]
    if pool is not None:            # every CPU reference starts now; the device rows wait for theirs
        for name, k in planned:
            start_reference(MODES[name].ref or name, k)
    attrs = check_attrs(args, mpiexec)

    def done(rows: list[dict]) -> None:
        """After each row: its line printed, the file written with every row so far."""
        print("\n".join(format_table(rows[-1:]).splitlines()[2:]), flush=True)
        write(args.out, rows, attrs)

    rows = []
    try:
        rows = _rows(args, planned, measure, done)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return rows, attrs


def skip_reason(mode: Mode, k: int, device: str) -> str:
    """Why the row (mode, k ranks) is skipped on ``device``; '' when it runs."""
    if mode.ranks and k not in mode.ranks:
        return f"runs at {', '.join(map(str, mode.ranks))} rank(s) only"
    if mode.backend == "nccl" and device != "cuda":
        return "nccl needs CUDA"
    return ""


def _rows(args, planned: list, measure, done=None) -> list[dict]:
    """The table's rows in order, the planned ones measured (``measure(name, k, row)``; none
    after ``args.deadline``); ``done(rows)`` after each measured row."""
    rows = []
    for name in args.modes:
        mode = MODES[name]
        for k in args.ranks:
            row = {"mode": name, "ranks": k, "backend": mode.backend, "device": args.device, "summary": mode.summary,
                   "epoch_s": None, "peak_device_bytes": None, "estimate_ratio": None, "h2d_bytes_per_epoch": None,
                   "loss_max_dev": None,
                   "status": "skipped", "error": ""}
            rows.append(row)
            if (name, k) not in planned:
                row["error"] = skip_reason(mode, k, args.device)
                continue
            if run_timeout(args) <= 0:
                row["error"] = "no time left (--deadline)"
                continue
            print(f"gpu-check: {name} on {k} rank(s) ...", flush=True)
            try:
                dev, err = measure(name, k, row)
            except Exception as exc:  # noqa: BLE001 - one row fails, the check goes on
                dev, err = None, f"{type(exc).__name__}: {exc}"
            row["status"], row["error"] = row_status(dev, args.rtol, err)
            if done is not None:
                done(rows)
    return rows


def format_table(rows: list[dict]) -> str:
    """The printed table: one line per row, FAILED/DEVIATES rows followed by their error."""
    from benchmarks.table import cell

    mib = 2.0 ** 20
    head = (f"{'mode':<28} {'ranks':>5} {'backend':<7} {'epoch s':>8} {'peak dev MiB':>12} {'est/peak':>8} "
            f"{'H2D MiB/ep':>10} {'loss dev':>9}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        peak, h2d = r["peak_device_bytes"], r["h2d_bytes_per_epoch"]
        lines.append(f"{r['mode']:<28} {r['ranks']:>5} {r['backend']:<7} {cell(r['epoch_s'], '.3f'):>8} "
                     f"{cell(None if peak is None else peak / mib, '.1f'):>12} {cell(r.get('estimate_ratio'), '.2f'):>8} "
                     f"{cell(None if h2d is None else h2d / mib, '.2f'):>10} {cell(r['loss_max_dev'], '.2e'):>9}  "
                     f"{r['status']}")
        if r["error"]:
            lines.append(f"    {r['error']}")
    return "\n".join(lines)


def write(out: Path, rows: list[dict], attrs: dict) -> Path:
    """``out/gpu-check.h5`` (one numbered group per row; None figures left out, inf kept)."""
    from benchmarks.results_file import write_results

    path = Path(out) / "gpu-check.h5"
    write_results(path, {"rows": [{k: v for k, v in r.items() if v is not None} for r in rows]},
                  {**attrs, "modes": json.dumps([r["mode"] for r in rows])}, FORMAT)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu-check", help="output folder (gpu-check.h5, work/)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="device of the checked runs (cpu: a self-check of this driver)")
    p.add_argument("--ranks", default="1,2", help="rank counts, comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help=f"modes, comma-separated: {', '.join(MODES)}")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--graph", default="cora", help="cora (inputs/data/cora) or sbm:N (synthetic, N vertices)")
    p.add_argument("--rtol", type=float, default=RTOL, help="largest relative loss deviation allowed")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="Unix time by which the check ends: no run starts after it, none lasts beyond it")
    p.add_argument("--jobs", type=int, default=None,
                   help="concurrent runs: the device rows one at a time beside J - 1 CPU references "
                        "(default: one per 4 usable cores, 1 to 4)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override of every run")
    p.add_argument("--probe", action="store_true", help="exit 0 when CUDA is usable, else print why and exit 1")
    args = p.parse_args(argv)
    if args.probe or args.device == "cuda":
        reason = no_cuda_reason()
        if args.probe:
            if reason:
                print(f"check-gpu: {reason}; nothing to check")
            return 1 if reason else 0
        if reason:
            print(f"gpu-check: {reason}; nothing to check")
            return 0
    try:
        args.ranks = [int(k) for k in args.ranks.split(",")]
        if any(k < 1 for k in args.ranks):
            raise ValueError
    except ValueError:
        p.error(f"--ranks {args.ranks!r}: expected positive integers, comma-separated")
    args.modes = args.modes.split(",")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {', '.join(bad)}; expected some of {', '.join(MODES)}")
    if not re.fullmatch(r"cora|sbm:[1-9]\d*", args.graph):
        p.error(f"--graph {args.graph!r}: expected cora or sbm:N")
    if args.epochs < 1 or not args.rtol > 0:
        p.error("--epochs must be >= 1 and --rtol > 0")
    if args.jobs is None:
        args.jobs = default_jobs(usable_cpus())
    elif args.jobs < 1:
        p.error(f"--jobs {args.jobs}: expected an integer >= 1")
    rows, attrs = check(args)
    path = write(args.out, rows, attrs)
    print()
    print(f"gpu-check: {attrs.get('gpu', args.device)}, PyTorch {attrs.get('torch', '?')}, {args.graph}, "
          f"{args.epochs} epochs, rtol {args.rtol:g}")
    print(format_table(rows))
    bad_rows = [r for r in rows if r["status"] not in ("ok", "skipped")]
    print(f"gpu-check: {len(rows)} rows, {len(bad_rows)} failed; written to {path}")
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
