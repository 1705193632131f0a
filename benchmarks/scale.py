"""`make bench-scale`: an ogbn-products-sized graph end to end, with memory measured per step.

Steps (each a child process, timed, with the child's peak RSS from ``wait4``):
prepare products-like at ``--scale`` (default 1.0) -> partition into ``--ranks`` METIS parts
(the store records its own per-step peaks) -> ``--epochs`` minibatch epochs on ``--ranks`` ranks
with ``inputs/products-sage.toml`` and a full evaluation at the end -> one full-graph epoch on
``--ranks`` ranks (``inputs/products-fullgraph.toml``: in memory on the CPU); with ``--engines``
also ``tensor`` (one epoch of the same configuration with ``train.engine = "tensor"``, decoupled GCN,
``tensor.chunks = "auto"``), ``offload`` (two epochs of it offloaded, HongTu: ``fullgraph.offload =
true``, its 16 chunks streamed with dedup) and ``cached`` (three epochs of it with CaPGNN's cached and
pipelined halo, ``fullgraph.halo = "cached"``, staleness 2: epoch 1 is the first to reuse rows, and
epoch 3 the first to send the cached rows again, whose message in flight sets its steady peak).
``--device cuda`` trains on the GPU (``train.device``), ``--set KEY=VALUE`` passes settings to every
training step; the per-rank peak device memory is recorded then. A step that the pre-run memory check
refuses is recorded with its one-line reason instead of being run into the OOM killer. Prints a
table; writes ``--out`` (HDF5: one group per step with wall seconds, peak RSS of the step, per-rank
peak RSS per epoch, epoch times, accuracy) after every step, so that a run stopped from outside
keeps the steps that finished. With ``--deadline`` (a Unix time) no step runs past it: a step's
timeout is the smaller of ``--timeout`` and the time left, and a step with no time left is not
started (recorded as skipped).

    python -m benchmarks.scale [--scale 1.0] [--ranks 4] [--epochs 3] [--out runs/bench/scale.h5]
        [--engines minibatch,fullgraph,tensor,offload,cached] [--device cuda] [--set KEY=VALUE ...]
        [--deadline UNIX_SECONDS]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.launch import ROOT, child_env, find_mpiexec

WHO = "bench-scale"
ENGINES = ("minibatch", "fullgraph", "tensor", "offload", "cached")
NOT_STARTED = -1000     # the rc recorded for a step skipped at --deadline


def run_step(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run ``cmd``; {wall_s, peak_rss_bytes (largest process of the step), rc, tail}."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=child_env(), start_new_session=True)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, 9)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
    rc = os.waitstatus_to_exitcode(status)
    tail = log.read_text()[-2000:]
    return {"wall_s": time.perf_counter() - t0, "peak_rss_bytes": float(usage.ru_maxrss * 1024),
            "rc": rc, "tail": tail}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/scale.h5")
    p.add_argument("--work", default=None, help="work directory (default: beside --out)")
    p.add_argument("--timeout", type=float, default=5400, help="seconds per step")
    p.add_argument("--engines", default="minibatch,fullgraph",
                   help=f"training steps, comma-separated: {', '.join(ENGINES)}")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="Unix time by which every step is done (steps not started then are skipped)")
    p.add_argument("--device", default=None, help="train.device of every training step (default: the configs')")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for every training step (repeatable)")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        p.error(f"--engines: unknown {', '.join(unknown)} (expected {', '.join(ENGINES)})")
    extra = [a for kv in args.sets + ([f"train.device={args.device}"] if args.device else []) for a in ("--set", kv)]
    out = Path(args.out)
    work = Path(args.work) if args.work else out.with_name(out.stem + f"-work-s{args.scale:g}")
    work.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "hpcgnn"]
    mpi = [find_mpiexec() or "mpiexec", "-n", str(args.ranks), sys.executable, "-m", "hpcgnn"]
    graph = work / "products-like.h5"
    store = work / f"products-like-metis-{args.ranks}"
    steps: dict[str, dict] = {}
    runs = {}

    def step(name, cmd):
        timeout = args.timeout if not args.deadline else min(args.timeout, args.deadline - time.time())
        if timeout <= 0:
            print(f"{WHO}: {name}: skipped, no time left before --deadline", flush=True)
            steps[name] = {"wall_s": 0.0, "peak_rss_bytes": 0.0, "rc": None, "tail": ""}
        else:
            print(f"{WHO}: {name} ...", flush=True)
            steps[name] = run_step(cmd, work / f"{name}.log", timeout)
            if steps[name]["rc"] != 0:
                print(f"{WHO}: {name} failed (exit {steps[name]['rc']}):\n{steps[name]['tail']}", flush=True)
        write_results(out, args, steps, runs)       # after every step: what finished is kept
        return steps[name]["rc"] == 0

    ok = step("prepare", py + ["prepare", "--dataset", "products-like", "--scale", f"{args.scale:g}",
                               "--seed", str(args.seed), "--out", str(graph), "--force"])
    ok = ok and step("partition", py + ["partition", str(graph), "--parts", str(args.ranks), "--seed",
                                         str(args.seed), "--out", str(store), "--force"])
    if ok:
        configs = {"minibatch": ("products-sage.toml", [f"train.epochs={args.epochs}",
                                                        f"train.eval_every={args.epochs}"]),
                   "fullgraph": ("products-fullgraph.toml", ["train.epochs=1"]),
                   "tensor": ("products-fullgraph.toml", ["train.epochs=1", "train.engine=tensor", "model.arch=gcn",
                                                          "tensor.mode=decoupled", "tensor.chunks=auto"]),
                   "offload": ("products-fullgraph.toml", ["train.epochs=2", "train.eval_every=2",
                                                           "fullgraph.offload=true", "fullgraph.dedup=true"]),
                   "cached": ("products-fullgraph.toml", ["train.epochs=3", "train.eval_every=3",
                                                          "fullgraph.halo=cached", "fullgraph.staleness=2",
                                                          "fullgraph.pipeline=true"])}
        for name in engines:
            toml, sets = configs[name]
            runs[name] = work / f"run-{name}"     # (a skipped step's older run file there is not read)
            step(name, mpi + ["train", "--config", str(ROOT / "inputs" / toml), "--set", f"data.partitions={store}",
                              "--set", f"output.dir={runs[name]}", "--force"]
                 + [a for kv in sets for a in ("--set", kv)] + extra)
    print_table(out, args, write_results(out, args, steps, runs))
    return 0 if all(s["rc"] in (0, None) for s in steps.values()) else 1


def write_results(out: Path, args, steps: dict, runs: dict) -> list[dict]:
    """Write ``out`` (HDF5, temporary name then rename) from the steps so far; the table's rows."""
    import h5py

    from hpcgnn.fileio import atomic_file
    from hpcgnn.run.memory import estimate_against_peak
    from hpcgnn.run.runfile import read_run

    rows = []
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp, h5py.File(tmp, "w") as f:
        f.attrs.update(scale=args.scale, ranks=args.ranks, epochs=args.epochs, seed=args.seed,
                       device=args.device or "", sets=" ".join(args.sets),
                       created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        for name, s in steps.items():
            g = f.create_group(name)
            # rc: the step's exit code; -1000 for a step not started (no time left before --deadline)
            g.attrs.update(wall_s=s["wall_s"], peak_rss_bytes=s["peak_rss_bytes"],
                           rc=NOT_STARTED if s["rc"] is None else s["rc"])
            refused = next((ln for ln in s["tail"].splitlines() if ln.startswith("hpcgnn: error:")), "")
            g.attrs["refused"] = refused if s["rc"] == 2 else ""
            row = {"step": name, "wall": s["wall_s"], "peak": s["peak_rss_bytes"], "rc": s["rc"],
                   "note": refused[:90] if s["rc"] == 2 else ""}
            if s["rc"] is None:
                row["note"] = "skipped: no time left before --deadline"
                g.attrs["error"] = row["note"]
            elif s["rc"] not in (0, 2):     # killed or failed: say how (the launcher's last line)
                last = [ln for ln in s["tail"].splitlines() if ln.startswith("hpcgnn: error:")]
                row["note"] = (last[-1] if last else f"exit {s['rc']}")[:90]
                g.attrs["error"] = row["note"]
            if name in runs and s["rc"] is not None and (runs[name] / "run.h5").exists() and \
                    "epoch" in read_run(runs[name])["timings"]:
                r = read_run(runs[name])
                peaks = r["counters"].get("peak_rss_bytes")
                g.create_dataset("epoch_time_s", data=np.nanmax(r["timings"]["epoch"], axis=1))
                if peaks is not None:
                    g.create_dataset("peak_rss_bytes_per_rank", data=peaks)
                    row["rank_peaks"] = np.nanmax(peaks, axis=0)
                dev = r["counters"].get("peak_device_bytes")
                if dev is not None and np.isfinite(dev).any() and np.nanmax(dev) > 0:
                    g.create_dataset("peak_device_bytes_per_rank", data=dev)
                    row["dev_peaks"] = np.nanmax(dev, axis=0)
                    whole = r["counters"].get("peak_process_device_bytes")
                    if whole is not None:            # per rank, set-up included
                        g.create_dataset("peak_process_device_bytes_per_rank", data=np.nanmax(whole, axis=0))
                est = [e["estimated"] for e in estimate_against_peak(r["attrs"].get("estimated_peak_device_bytes"), dev)]
                if est and len(est) == args.ranks:   # the pre-run device estimate of every rank
                    g.create_dataset("estimated_peak_device_bytes_per_rank", data=np.asarray(est, dtype=np.float64))
                    row["dev_est"] = est
                    terms = r["attrs"].get("estimated_device_terms")
                    if terms is not None:            # per rank {term: bytes} (JSON), for calibration
                        g.attrs["estimated_device_terms"] = terms
                phases = r.get("labels", {}).get("peak_device_phase")
                if phases is not None:               # where each rank's device peak was reached
                    g.attrs["peak_device_phase"] = json.dumps(np.asarray(phases).tolist())
                row["epoch_s"] = float(np.nanmin(np.nanmax(r["timings"]["epoch"], axis=1)))
                acc = r["metrics"].get("test_acc")
                if acc is not None and np.isfinite(acc).any():
                    row["test_acc"] = float(acc[np.isfinite(acc)][-1])
                    g.attrs["test_acc"] = row["test_acc"]
            rows.append(row)
    return rows


def print_table(out: Path, args, rows: list[dict]) -> None:
    print(f"\nbench-scale: products-like scale {args.scale:g}, {args.ranks} ranks ({out})")
    print(f"{'step':<10} {'wall s':>8} {'peak GiB':>9} {'epoch s':>8} {'test %':>7}  per-rank peak GiB (sum)")
    for r in rows:
        rp = r.get("rank_peaks")
        ranks = "" if rp is None else " ".join(f"{x / 2**30:.2f}" for x in rp) + f" ({np.nansum(rp) / 2**30:.2f})"
        print(f"{r['step']:<10} {r['wall']:>8.1f} {r['peak'] / 2**30:>9.2f} "
              f"{r.get('epoch_s', float('nan')):>8.2f} {100 * r.get('test_acc', float('nan')):>7.2f}  {ranks}"
              + (f"  {r['note']}" if r["rc"] is None else f"  exit {r['rc']} {r['note']}" if r["rc"] else ""))
        if r.get("dev_peaks") is not None:
            print(f"{'':<10} {'':>8} {'':>9} {'':>8} {'':>7}  per-rank peak device GiB: "
                  + " ".join(f"{x / 2**30:.2f}" for x in r["dev_peaks"])
                  + ("" if r.get("dev_est") is None else "; estimated: "
                     + " ".join(f"{x / 2**30:.2f}" for x in r["dev_est"])))
    print("peak GiB: the step's largest process (for training: the largest rank); epoch s: fastest epoch")


if __name__ == "__main__":
    raise SystemExit(main())
