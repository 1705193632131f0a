"""`make bench-papers SCALE=S`: an ogbn-papers100M-shaped graph end to end, wall time and peak memory per stage.

Stages (each a child process, timed (wall, and CPU seconds of all its processes: less
sensitive than wall time to other jobs on the machine), with the largest process's peak RSS from ``wait4``: the
command's own or, for ``partition``, its KaMinPar child's, whichever is larger; for the MPI
stages the largest rank's):

* ``prepare``: ``hpcgnn prepare --dataset papers-like --scale S --feature-dtype D`` (``--feature-dtype``,
  default float16) with its default memory budget (external sort of the edges when the graph
  exceeds it);
* ``partition``: ``hpcgnn partition --parts RANKS --method M`` (``--partition-method``, default
  auto: METIS where its modelled memory fits the default budget, else KaMinPar; the choice is
  recorded);
* ``train``: ``--epochs`` epochs of the minibatch engine on RANKS ranks with
  ``inputs/papers-sage.toml`` (GraphSAGE, 3 layers of 256, fanouts 15,10,5 from the seeds,
  batch 1000 per rank, HEC and AEP) and the sampled evaluation after the last epoch; the run
  file gives the epoch and evaluation seconds (slowest rank) and every rank's peak RSS
  (``peak_process_rss_bytes``: the whole process, loading the partition included) and the phase
  in which its last epoch's peak was reached;
* ``infer``: ``hpcgnn infer RUN --what predictions --vertices test --method M`` on RANKS ranks
  (``--infer-method``, default sampled: the test vertices' rows only, one batch at a time);
  every rank's peak RSS from the output file.

Prints a table (per-rank peaks and their sum for the MPI stages) and writes ``--out`` (HDF5,
:mod:`benchmarks.results_file` layout, format ``hpcgnn-bench-papers``: one group per stage with
``wall_s``, ``cpu_s``, ``peak_rss_bytes``, ``rc``, ``command``; ``train`` and ``infer`` also
``peak_rss_bytes_per_rank`` and ``peak_rss_bytes_sum``; root attributes ``scale``, ``ranks``,
``num_vertices``, ``num_edges`` (directed), ...) after every stage, so that a run stopped from
outside keeps the stages that finished. The graph file and the store are removed at the end
unless ``--keep-data``.

``--fit A.h5 B.h5 ...`` reads result files of several scales and prints, for each stage's time and
peak, the least-squares fit ``cost = a + c * E`` (E directed edges; papers-like's vertex count
grows in proportion, so a separate per-vertex term is not identifiable and is folded into ``c``;
the per-vertex figure ``c * E / V`` is printed beside it) and its projection to papers100M
(S = 1): each single-process stage's peak on one node, and per rank at ``--project-ranks`` ranks
for the MPI stages, whose per-rank cost is fitted against the edges per rank (E / RANKS).

    python -m benchmarks.papers --scale S [--ranks 4] [--epochs 1] [--feature-dtype float16] [--infer-method sampled] [--out runs/bench/papers-sS.h5]
        [--set KEY=VALUE ...] [--keep-data] [--reuse]
    python -m benchmarks.papers --fit runs/bench/papers-s0.01.h5 runs/bench/papers-s0.05.h5
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import h5py
import numpy as np

from benchmarks.launch import ROOT, find_mpiexec
from benchmarks.scale import run_step

WHO = "bench-papers"
FORMAT = "hpcgnn-bench-papers"
STAGES = ("prepare", "partition", "train", "infer")
MPI_STAGES = ("train", "infer")
# ogbn-papers100M (S = 1): vertices and directed edges (the symmetrised graph without self-loops)
PAPERS_VERTICES = 111_059_956
PAPERS_EDGES = 3_231_371_744
GiB = float(1 << 30)


# ---- one run ------------------------------------------------------------------------------------
def _stage_rows(stages: dict, info: dict) -> dict:
    """The HDF5 groups of the stages so far (see the module docstring)."""
    out = {}
    for name, s in stages.items():
        g = {"wall_s": float(s["wall_s"]), "cpu_s": float(s["cpu_s"]), "peak_rss_bytes": float(s["peak_rss_bytes"]),
             "rc": int(s["rc"]), "command": s["command"]}
        g.update(info.get(name, {}))
        out[name] = g
    return out


def _graph_size(graph: Path) -> tuple[int, int]:
    """(vertices, directed edges) of a graph file, from its dataset shapes."""
    import h5py

    with h5py.File(graph, "r") as f:
        return int(f["indptr"].shape[0]) - 1, int(f["indices"].shape[0])


def _train_info(run_dir: Path) -> dict:
    """Epoch and evaluation seconds (slowest rank; the epochs summed), every rank's peak RSS and
    where the last epoch's peak was reached, accuracies."""
    from hpcgnn.run.runfile import read_run

    r = read_run(run_dir)
    t, c = r["timings"], r["counters"]
    peaks = c.get("peak_process_rss_bytes", c.get("peak_rss_bytes"))
    per_rank = np.nanmax(np.asarray(peaks, dtype=np.float64), axis=0)
    evals = np.asarray(t.get("eval", np.full((1, 1), np.nan)), dtype=np.float64)
    evals = evals[np.isfinite(evals).any(axis=1)]          # the evaluated epochs
    info = {"epoch_s": float(np.nansum(np.nanmax(t["epoch"], axis=1))),
            "eval_s": float(np.nansum(np.nanmax(evals, axis=1))) if evals.size else float("nan"),
            "epochs": int(np.asarray(t["epoch"]).shape[0]),
            "peak_rss_bytes_per_rank": per_rank, "peak_rss_bytes_sum": float(per_rank.sum())}
    phase = r.get("labels", {}).get("peak_rss_phase")
    if phase is not None:
        info["peak_rss_phase"] = " ".join(str(p) for p in np.asarray(phase)[-1])   # per rank
    for m in ("val_acc", "test_acc"):
        v = np.asarray(r["metrics"].get(m, []), dtype=np.float64)
        if v.size and np.isfinite(v).any():
            info[m] = float(v[np.isfinite(v)][-1])
    return info


def _infer_info(path: Path) -> dict:
    """Rows written, inference seconds and every rank's peak RSS (before rank 0's writing)."""
    import h5py

    with h5py.File(path, "r") as f:
        per_rank = np.asarray(f.attrs["peak_rss_bytes"], dtype=np.float64)
        return {"rows": int(f["predictions"].shape[0]), "inference_s": float(f.attrs["inference_seconds"]),
                "peak_rss_bytes_per_rank": per_rank, "peak_rss_bytes_sum": float(per_rank.sum())}


def _previous_stage(out: Path, name: str) -> tuple[dict, dict]:
    """(stage row, info) of stage ``name`` as a finished earlier run wrote it to ``out``."""
    with h5py.File(out, "r") as f:
        if f.attrs.get("format") != FORMAT or name not in f or int(f[name].attrs["rc"]) != 0:
            raise SystemExit(f"{WHO}: --reuse: {out} holds no finished stage {name!r}")
        g = f[name]
        row = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in g.attrs.items()}
        row.update({k: g[k][()] for k in g})
    stage = {k: row.pop(k) for k in ("wall_s", "cpu_s", "peak_rss_bytes", "rc", "command")}
    return stage, row


def run_bench(args) -> int:
    from benchmarks.results_file import write_results
    from hpcgnn.partition.store import read_meta

    out = Path(args.out)
    work = Path(args.work) if args.work else out.with_name(out.stem + "-work")
    work.mkdir(parents=True, exist_ok=True)
    hpcgnn = [sys.executable, "-m", "hpcgnn"]
    mpi = [find_mpiexec() or "mpiexec", "-n", str(args.ranks), sys.executable, "-m", "hpcgnn"]
    graph, store = work / "papers-like.h5", work / f"papers-like-{args.ranks}"
    run_dir, preds = work / "run", work / "test-predictions.h5"
    stages: dict[str, dict] = {}
    info: dict[str, dict] = {}
    attrs = {"scale": float(args.scale), "ranks": int(args.ranks), "epochs": int(args.epochs), "seed": int(args.seed),
             "config": "inputs/papers-sage.toml", "sets": " ".join(args.sets),
             "feature_dtype": args.feature_dtype, "infer_method": args.infer_method,
             "partition_method": args.partition_method,
             "host": os.uname().nodename, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def stage(name: str, cmd: list[str]) -> bool:
        print(f"{WHO}: {name} ...", flush=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        s = run_step(cmd, work / f"{name}.log", args.timeout)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)     # the stage's processes, reaped
        s["cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        s["command"] = " ".join(str(c) for c in cmd)
        stages[name] = s
        if s["rc"] != 0:
            print(f"{WHO}: {name} failed (exit {s['rc']}):\n{s['tail']}", flush=True)
        else:
            first = next((ln for ln in s["tail"].splitlines() if ln.startswith(("wrote", "method auto"))), "")
            if first:
                print(f"  {first[:240]}", flush=True)
        write_results(out, _stage_rows(stages, info), attrs, FORMAT)
        return s["rc"] == 0

    sets = [a for kv in [f"train.epochs={args.epochs}", f"train.eval_every={args.epochs}", *args.sets]
            for a in ("--set", kv)]
    if args.reuse:
        for name in ("prepare", "partition"):
            stages[name], info[name] = _previous_stage(out, name)
        with h5py.File(out, "r") as f:
            attrs["num_vertices"], attrs["num_edges"] = int(f.attrs["num_vertices"]), int(f.attrs["num_edges"])
        if not graph.is_file() or not store.is_dir():
            raise SystemExit(f"{WHO}: --reuse: {graph} or {store} is missing (run with --keep-data first)")
    ok = args.reuse or stage("prepare", hpcgnn + ["prepare", "--dataset", "papers-like", "--scale", f"{args.scale:g}", "--seed",
                                    str(args.seed), "--feature-dtype", args.feature_dtype, "--out", str(graph),
                                    "--force"])
    if ok and not args.reuse:
        attrs["num_vertices"], attrs["num_edges"] = _graph_size(graph)
        lines = stages["prepare"]["tail"].splitlines()
        at = next((i for i, ln in enumerate(lines) if ln.startswith("wrote")), len(lines))
        # the summary: the "wrote" line and its indented continuation lines, as one line
        block = lines[at:at + 1] + [ln.strip() for ln in lines[at + 1:] if ln.startswith("  ")][:3]
        info["prepare"] = {"summary": "; ".join(block)}
    ok = ok and (args.reuse or stage("partition", hpcgnn + ["partition", str(graph), "--parts", str(args.ranks), "--method",
                                             args.partition_method,
                                             "--seed", str(args.seed), "--out", str(store), "--force", "--quiet"]))
    if ok and not args.reuse:
        meta = read_meta(store)
        info["partition"] = {"method": str(meta.method), "method_choice": str(meta.attrs.get("method_choice", "")),
                             "edge_cut_ratio": meta.edge_cut / max(meta.num_edges // 2, 1),
                             **{f"balance_{k}": float(v) for k, v in meta.balance.items()}}
    ok = ok and stage("train", mpi + ["train", "--config", str(ROOT / "inputs" / "papers-sage.toml"), "--set",
                                      f"data.partitions={store}", "--set", f"output.dir={run_dir}", "--force"] + sets)
    if ok:
        info["train"] = _train_info(run_dir)
    ok = ok and stage("infer", mpi + ["infer", str(run_dir), "--what", "predictions", "--vertices", "test",
                                      "--method", args.infer_method,
                                      "--out", str(preds), "--force"])
    if ok:
        info["infer"] = _infer_info(preds)
    rows = _stage_rows(stages, info)
    write_results(out, rows, attrs, FORMAT)
    print_table(out, attrs, rows)
    if not args.keep_data:
        graph.unlink(missing_ok=True)
        shutil.rmtree(store, ignore_errors=True)
    return 0 if ok else 1


def print_table(out: Path, attrs: dict, rows: dict) -> None:
    v, e = attrs.get("num_vertices"), attrs.get("num_edges")
    size = f"{v:,} vertices, {e:,} directed edges" if v is not None else "graph not made"
    print(f"\n{WHO}: papers-like scale {attrs['scale']:g} ({size}), {attrs['ranks']} ranks ({out})")
    print(f"{'stage':<10} {'wall s':>8} {'cpu s':>8} {'peak GiB':>9} {'sum GiB':>8}  per-rank peak GiB / notes")
    for name, r in rows.items():
        per = r.get("peak_rss_bytes_per_rank")
        total = f"{r['peak_rss_bytes_sum'] / GiB:>8.2f}" if per is not None else f"{'-':>8}"
        notes = []
        if per is not None:
            notes.append(" ".join(f"{x / GiB:.2f}" for x in per))
        if name == "partition" and "method" in r:
            notes.append(f"{r['method']}, cut {100 * r['edge_cut_ratio']:.1f} %")
        if name == "train" and "epoch_s" in r:
            where = " ".join(dict.fromkeys(r.get("peak_rss_phase", "?").split()))
            notes.append(f"epoch {r['epoch_s']:.1f} s, eval {r['eval_s']:.1f} s, peak in {where}"
                         + (f", test {100 * r['test_acc']:.1f} %" if "test_acc" in r else ""))
        if name == "infer" and "rows" in r:
            notes.append(f"{r['rows']:,} test rows, inference {r['inference_s']:.1f} s")
        if r["rc"] != 0:
            notes.append(f"exit {r['rc']}")
        print(f"{name:<10} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['peak_rss_bytes'] / GiB:>9.2f} {total}  "
              f"{'; '.join(notes)}")
    print("wall s: the command, start-up included; cpu s: its processes' CPU seconds; peak GiB: its largest process (MPI stages: the largest rank); "
          "sum GiB: the ranks' peaks summed")


# ---- fit and projection -------------------------------------------------------------------------
def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares ``y = a + c * x``: (a, c); with two points the line through them."""
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, c), *_ = np.linalg.lstsq(A, y, rcond=None)
    return float(a), float(c)


def read_points(paths: list[str]) -> list[dict]:
    """Per result file: scale, ranks, V, E and each finished stage's wall and CPU seconds and
    peaks (the largest process's, the largest rank's), plus the epoch and evaluation seconds. A
    stage that did not finish is said on stderr and left out (its quantities are not fitted)."""
    import h5py

    points = []
    for p in paths:
        with h5py.File(p, "r") as f:
            if f.attrs.get("format") != FORMAT or "num_edges" not in f.attrs:
                raise SystemExit(f"{WHO}: {p}: not a finished bench-papers result file")
            pt = {"path": p, "scale": float(f.attrs["scale"]), "ranks": int(f.attrs["ranks"]),
                  "V": float(f.attrs["num_vertices"]), "E": float(f.attrs["num_edges"])}
            for s in STAGES:
                if s not in f or int(f[s].attrs["rc"]) != 0:
                    print(f"{WHO}: {p}: stage {s} did not finish: left out of the fit", file=sys.stderr)
                    continue
                g = f[s]
                pt[f"{s}.wall_s"] = float(g.attrs["wall_s"])
                pt[f"{s}.cpu_s"] = float(g.attrs.get("cpu_s", np.nan))
                pt[f"{s}.peak"] = float(g.attrs["peak_rss_bytes"])
                if "peak_rss_bytes_per_rank" in g:
                    pt[f"{s}.rank_peak"] = float(np.max(g["peak_rss_bytes_per_rank"][()]))
            if "train.wall_s" in pt:
                pt["epoch_s"] = float(f["train"].attrs["epoch_s"])
                pt["eval_s"] = float(f["train"].attrs["eval_s"])
            if "infer.wall_s" in pt:
                pt["infer_s"] = float(f["infer"].attrs["inference_s"])
        points.append(pt)
    return sorted(points, key=lambda q: q["E"])


def fit_and_project(points: list[dict], ranks_at: list[int]) -> list[dict]:
    """One row per quantity: its fit ``a + c * x`` (x = E for single-process stages and totals,
    E / RANKS for a rank's peak and for the MPI stages' times) and the projection to S = 1."""
    E = np.array([p["E"] for p in points])
    V = np.array([p["V"] for p in points])
    P = np.array([p["ranks"] for p in points], dtype=np.float64)
    rows = []

    def add(label, key, per_rank, unit):
        y = np.array([p.get(key, np.nan) for p in points])
        if not np.all(np.isfinite(y)):      # a stage that did not finish, a file without cpu_s
            return
        x = E / P if per_rank else E
        a, c = fit_line(x, y)
        row = {"quantity": label, "unit": unit, "a": a, "c_per_edge": c, "c_per_vertex": c * float(np.mean(E / V)),
               "per_rank": per_rank, "measured": y.tolist()}
        if per_rank:
            row["at_ranks"] = {int(k): a + c * PAPERS_EDGES / k for k in ranks_at}
        else:
            row["s1"] = a + c * PAPERS_EDGES
        rows.append(row)

    for s in ("prepare", "partition"):
        add(f"{s} wall", f"{s}.wall_s", False, "s")
        add(f"{s} cpu", f"{s}.cpu_s", False, "s")
        add(f"{s} peak", f"{s}.peak", False, "B")
    add("train epoch", "epoch_s", True, "s")
    add("sampled eval", "eval_s", True, "s")
    add("train peak/rank", "train.rank_peak", True, "B")
    add("infer (compute)", "infer_s", True, "s")
    add("infer peak/rank", "infer.rank_peak", True, "B")
    return rows


def print_fit(points: list[dict], rows: list[dict], ranks_at: list[int]) -> None:
    print(f"{WHO}: fit cost = a + c*x over {len(points)} scales "
          + ", ".join(f"S={p['scale']:g} (V={p['V']:.3g}, E={p['E']:.3g}, {p['ranks']} ranks)" for p in points)
          + ("; two points: the line through them, no residual" if len(points) == 2 else ""))
    print(f"projection to papers100M: V={PAPERS_VERTICES:,}, E={PAPERS_EDGES:,} directed edges")
    head = " ".join(f"{'P=' + str(k):>9}" for k in ranks_at)
    print(f"{'quantity':<17} {'x':>5} {'a':>9} {'c per edge':>11} {'c per vertex':>13} {'S=1 (1 node)':>13} {head}")
    for r in rows:
        gib = r["unit"] == "B"
        f = (lambda v: f"{v / GiB:.2f} GiB") if gib else (lambda v: f"{v:.1f} s")
        per_e = f"{r['c_per_edge']:.2f} B" if gib else f"{r['c_per_edge'] * 1e9:.1f} ns"
        per_v = f"{r['c_per_vertex']:.1f} B" if gib else f"{r['c_per_vertex'] * 1e6:.2f} us"
        s1 = f(r["s1"]) if "s1" in r else "-"
        at = " ".join(f"{f(r['at_ranks'][k]):>9}" for k in ranks_at) if "at_ranks" in r else ""
        print(f"{r['quantity']:<17} {'E/P' if r['per_rank'] else 'E':>5} {f(r['a']):>9} {per_e:>11} {per_v:>13} "
              f"{s1:>13} {at}")
    print("x: E = directed edges of the graph, E/P = per rank (fitted at the measured rank count); "
          "a: the fixed part (start-up, interpreter, torch, model); c per vertex = c * E / V")


# ---- command line -------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.papers", description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=None, help="papers-like scale S, 0 < S <= 1")
    p.add_argument("--ranks", type=int, default=4, help="partitions = training and inference ranks (default 4)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--feature-dtype", default="float16", choices=("float32", "float16", "bfloat16"),
                   help="prepare's --feature-dtype (default float16: half of papers100M's float32 bytes "
                        "in every stage)")
    p.add_argument("--partition-method", default="auto", choices=("auto", "metis", "kaminpar"),
                   help="partition's --method (default auto: METIS where its modelled memory fits the "
                        "budget); one method at every scale keeps a fit of the partition stage meaningful")
    p.add_argument("--infer-method", default="sampled", choices=("sampled", "full"),
                   help="infer's --method for the test vertices (default sampled: one batch's memory; full "
                        "holds [solid rows x hidden] per layer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results file (default runs/bench/papers-sS.h5)")
    p.add_argument("--work", default=None, help="work directory (default: beside --out)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per stage")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the training run (repeatable)")
    p.add_argument("--keep-data", action="store_true", help="keep the graph file and the partition store")
    p.add_argument("--reuse", action="store_true",
                   help="keep the prepare and partition stages of the run that wrote --out with --keep-data "
                        "(their figures, graph file and store) and run train and infer again")
    p.add_argument("--fit", nargs="+", metavar="FILE.h5", help="fit and project from these result files instead")
    p.add_argument("--project-ranks", type=int, nargs="+", default=[4, 16, 64])
    args = p.parse_args(argv)
    if args.fit:
        points = read_points(args.fit)
        if len({pt["E"] for pt in points}) < 2:
            p.error("--fit: needs result files of at least two scales")
        print_fit(points, fit_and_project(points, args.project_ranks), args.project_ranks)
        return 0
    if args.scale is None or not 0 < args.scale <= 1:
        p.error("--scale: expected 0 < S <= 1")
    if args.ranks < 1:
        p.error("--ranks: expected >= 1")
    if args.out is None:
        args.out = f"runs/bench/papers-s{args.scale:g}.h5"
    return run_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
