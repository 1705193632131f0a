"""`make check-gpu-all`: every GPU check of the project in one command, within a time budget.

    python -m tools.gpu_session [--out runs/gpu-session] [--work DIR] [--budget 540]
        [--deadline UNIX_SECONDS] [--steps check,units,aggregate,scale] [--scale 0.25]
        [--archive FILE.tar.gz]

For a machine lent by the hour (or by the minute): the steps run one after another, most
important first, each as a child process with its output in ``OUT/<step>.log`` and a timeout of
what is left of ``--budget`` seconds, so that the command ends in time and keeps what finished:

* ``check``: ``make check-gpu``'s driver (:mod:`tools.gpu_check`: every engine and mode on
  CUDA at 1 and 2 ranks against the CPU, Cora), its CPU references beside the device runs;
* ``units``: ``pytest -m cuda tests`` without the driver's own test (which ``check`` covers): the
  device aggregation against the native kernels, its device memory, deterministic bits, the
  mover, the HEC and the device placement on CUDA;
* ``aggregate``: :mod:`benchmarks.aggregate` on the GPU (the torch path and
  ``train.deterministic``, time and device memory);
* ``scale``: :mod:`benchmarks.scale` at products-like ``--scale`` on 2 ranks sharing the GPU,
  one epoch per engine (minibatch, full graph in memory, tensor) and two of the offloaded full
  graph and of the cached and pipelined halo: epoch time, per-rank peak device memory and the
  pre-run device estimate beside it; its graph and stores go to ``--work``.

A step starts only while at least its minimum seconds (:data:`MIN_S`) are left, else it is
``skipped (no time left)``; the time ends ``--budget`` seconds after the start or at
``--deadline`` (a Unix time, e.g. taken before the set-up that precedes the session: ``make
check-gpu-all`` builds the project first), whichever is first. The ``check`` and ``scale`` steps
are told the step's deadline less :data:`WRAP_UP_S`, so that they stop starting runs in time and
keep their rows (each writes its file after every run). A step killed at its timeout takes every process it
started along (:func:`benchmarks.launch.kill_tree`). Prints each step's last lines and a
summary table; writes ``OUT/gpu-session.h5`` (format ``hpcgnn-bench-gpu-session``: per step
``status``, ``rc``, ``wall_s``, ``log``) and, with ``--archive``, one ``.tar.gz`` of ``OUT``'s
logs, tables and files without the runs' work folders (one file to carry back from a node,
written whatever the steps did). Exit 0 when every step that ran passed, 1 otherwise. Without
a CUDA GPU: one line, exit 0, nothing run.
"""
from __future__ import annotations

import argparse
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.launch import run_logged

FORMAT = "hpcgnn-bench-gpu-session"
STEPS = ("check", "units", "aggregate", "scale")
# the least time (s) worth starting a step with; less than that left: skipped
# (scale: its products-like 0.25 steps took 84 s on an H200, docs/gpu.md)
MIN_S = {"check": 120.0, "units": 30.0, "aggregate": 20.0, "scale": 150.0}
WRAP_UP_S = 15.0        # of the check and scale steps' time: for their last file write and exit
# the scale step's engines, most wanted first (it stops starting them at the deadline)
SCALE_ENGINES = ("minibatch", "fullgraph", "tensor", "offload", "cached")
TAIL_LINES = 40


def step_command(step: str, args, out: Path, work: Path, deadline: float | None = None) -> list[str]:
    """The child command of ``step`` (run from the repository root with this interpreter);
    ``deadline``: the Unix time by which the step must be done."""
    py = [sys.executable]
    if step == "check":
        until = [] if deadline is None else ["--deadline", f"{deadline - WRAP_UP_S:.0f}"]
        return py + ["-m", "tools.gpu_check", "--out", str(out / "gpu-check"), *until]
    if step == "units":
        return py + ["-m", "pytest", "-q", "-m", "cuda", "tests", "-k", "not test_cuda_mode_matches_the_cpu",
                     "-p", "no:cacheprovider", f"--junitxml={out / 'cuda-tests.xml'}"]
    if step == "aggregate":
        return py + ["-m", "benchmarks.aggregate", "--device", "cuda", "--out", str(out / "aggregate.h5")]
    if step == "scale":
        until = [] if deadline is None else ["--deadline", f"{deadline - WRAP_UP_S:.0f}"]
        return py + ["-m", "benchmarks.scale", "--scale", f"{args.scale:g}", "--ranks", "2", "--epochs", "1",
                     "--engines", ",".join(SCALE_ENGINES), "--device", "cuda", "--out", str(out / "scale.h5"),
                     "--work", str(work / f"scale-s{args.scale:g}"), *until]
    raise ValueError(f"unknown step {step!r}")


def run_step(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """(exit code, wall seconds) of ``cmd`` with its output in ``log``; killed with its process
    group after ``timeout`` seconds (exit code 124 then)."""
    rc, wall = run_logged(cmd, log, timeout)
    return (124 if rc is None else rc), wall


def status_of(rc: int | None) -> str:
    """A step's status from its exit code (None: not started)."""
    if rc is None:
        return "skipped (no time left)"
    return {0: "ok", 124: "TIMED OUT"}.get(rc, f"FAILED (exit {rc})")


def session(args) -> list[dict]:
    """Run the steps within the budget: one dict per step (name, status, rc, wall_s, log)."""
    out, work = Path(args.out), Path(args.work) if args.work else Path(args.out) / "work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget
    if args.deadline:
        deadline = min(deadline, args.deadline)
    rows = []
    for step in args.steps:
        left = deadline - time.time()
        log = out / f"{step}.log"
        row = {"step": step, "rc": None, "wall_s": None, "log": str(log)}
        rows.append(row)
        if left < MIN_S[step]:
            row["status"] = status_of(None)
            print(f"gpu-session: {step}: skipped, {left:.0f} s left (needs {MIN_S[step]:.0f})", flush=True)
            continue
        print(f"gpu-session: {step} (at most {left:.0f} s) ...", flush=True)
        row["rc"], row["wall_s"] = run_step(step_command(step, args, out, work, deadline), log, left)
        row["status"] = status_of(row["rc"])
        lines = log.read_text(errors="replace").splitlines()
        print("\n".join(lines[-TAIL_LINES:]), flush=True)
        print(f"gpu-session: {step}: {row['status']} in {row['wall_s']:.0f} s", flush=True)
    return rows


def write_archive(out: Path, path: Path) -> Path:
    """``path`` (.tar.gz): everything under ``out`` but the runs' ``work`` folders and the
    archive itself (and its temporaries), named relative to ``out``'s parent; written
    atomically (:func:`hpcgnn.fileio.atomic_file`)."""
    from hpcgnn.fileio import atomic_file

    out, path = Path(out), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def keep(info: tarfile.TarInfo):
        return None if "work" in Path(info.name).parts[1:] else info

    with atomic_file(path) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for item in sorted(out.iterdir()):
            if item.resolve() != path.resolve() and not item.name.startswith(f".{path.name}."):
                tar.add(item, arcname=str(Path(out.name) / item.name), filter=keep)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_session", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu-session", help="output folder (logs, tables, HDF5 files)")
    p.add_argument("--work", default=None, help="folder for large inputs (default: OUT/work)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all steps together")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="Unix time by which every step is done (the earlier of it and the budget)")
    p.add_argument("--archive", default=None, help="also write the results (no work folders) to this .tar.gz")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, in order: {', '.join(STEPS)}")
    p.add_argument("--scale", type=float, default=0.25, help="products-like scale of the scale step")
    args = p.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in args.steps if s not in STEPS]
    if bad:
        p.error(f"--steps: unknown {', '.join(bad)}; expected some of {', '.join(STEPS)}")
    if not args.budget > 0 or not args.scale > 0:
        p.error("--budget and --scale must be > 0")
    from tools.gpu_check import no_cuda_reason

    reason = no_cuda_reason()
    if reason:
        print(f"gpu-session: {reason}; nothing to check")
        return 0
    try:
        return _run(args)
    finally:
        if args.archive:
            print(f"gpu-session: results archived in {write_archive(Path(args.out), Path(args.archive))}", flush=True)


def _run(args) -> int:
    """The steps, the session's file and its summary; the exit code."""
    t0 = time.perf_counter()
    rows = session(args)
    import torch

    from benchmarks.results_file import write_results

    attrs = {"budget_s": args.budget, "wall_s": time.perf_counter() - t0, "scale": args.scale,
             "torch": torch.__version__, "torch_cuda": torch.version.cuda or "", "gpu": torch.cuda.get_device_name(0),
             "python": sys.version.split()[0], "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path = Path(args.out) / "gpu-session.h5"
    write_results(path, {"steps": [{k: v for k, v in r.items() if v is not None} for r in rows]}, attrs, FORMAT)
    print(f"\ngpu-session: {attrs['gpu']}, PyTorch {attrs['torch']}, {attrs['wall_s']:.0f} s of {args.budget:.0f}")
    for r in rows:
        wall = "-" if r["wall_s"] is None else f"{r['wall_s']:.0f} s"
        print(f"  {r['step']:<10} {wall:>7}  {r['status']}")
    print(f"gpu-session: written to {path}")
    return 0 if all(r["rc"] in (0, None) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
