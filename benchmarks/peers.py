"""Benchmark peers in their own virtual environments (DGL, issue 13), run as subprocesses.

A peer is a script run by another interpreter (DGL: ``.venv-dgl/bin/python``, made by
``make peer-dgl``, torch 2.2 + DGL 2.1, script :mod:`benchmarks.peer_dgl`) that prints one
JSON object on the last line of its stdout. :func:`run_peer` runs it (``-I``: isolated, nothing
of this project's environment on its ``sys.path``; ``THP_MEM_ALLOC_ENABLE=1`` as hpcgnn sets it,
unless the caller's environment says otherwise) and raises :class:`PeerError` with a one-line
reason (exit status and stderr tail, no JSON, timeout, interpreter missing) on failure;
:func:`try_peer` prints that reason and returns None so a benchmark goes on without the peer.

:func:`alternate` times hpcgnn and a peer back to back in alternating rounds and keeps the
fastest epoch of each; ratios are ``hpcgnn / peer`` epoch seconds (below 1: hpcgnn is faster).
``HPCGNN_PEER_DGL_PYTHON`` names another interpreter for the DGL peer (empty: no DGL peer).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.launch import ROOT
from hpcgnn.runtime import usable_cpus

DGL_VENV = ROOT / ".venv-dgl"
DGL_SCRIPT = Path(__file__).resolve().with_name("peer_dgl.py")
DGL_ENV = "HPCGNN_PEER_DGL_PYTHON"


class PeerError(RuntimeError):
    """A peer run failed; the message is one line naming the peer and the reason."""


def dgl_python() -> Path | None:
    """The DGL peer's interpreter: ``$HPCGNN_PEER_DGL_PYTHON`` when set (empty = none), else
    ``.venv-dgl/bin/python`` when it exists, else None (benchmarks run without the peer)."""
    if DGL_ENV in os.environ:
        value = os.environ[DGL_ENV]
        return Path(value) if value else None
    python = DGL_VENV / "bin" / "python"
    return python if python.exists() else None


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


def run_peer(python: Path | str, script: Path | str, args: list[str], timeout: float, name: str = "peer",
             env: dict | None = None) -> dict:
    """Run ``python -I script *args`` from the repository root; the JSON object on the last line
    of its stdout. Raises :class:`PeerError` (one line) when it cannot start, exits non-zero,
    runs past ``timeout`` seconds or prints no JSON object last."""
    cmd = [str(python), "-I", str(script), *[str(a) for a in args]]
    child_env = {**os.environ, "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1"), **(env or {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env, cwd=ROOT)
    except FileNotFoundError:
        raise PeerError(f"{name}: interpreter {python} not found (make peer-dgl creates it)") from None
    except PermissionError:
        raise PeerError(f"{name}: interpreter {python} is not executable") from None
    except subprocess.TimeoutExpired:
        raise PeerError(f"{name}: {Path(script).name} {' '.join(map(str, args[:1]))} ran past its "
                        f"{timeout:g} s timeout") from None
    if proc.returncode != 0:
        raise PeerError(f"{name}: {Path(script).name} failed (exit {proc.returncode}): "
                        f"{_tail(proc.stderr) or _tail(proc.stdout) or 'no output'}")
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    try:
        out = json.loads(last)
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        raise PeerError(f"{name}: {Path(script).name} printed no JSON object on its last line "
                        f"(got {last[:120]!r})")
    return out


def try_peer(*args, **kwargs) -> dict | None:
    """:func:`run_peer`, or None after printing why it failed (the benchmark goes on)."""
    try:
        return run_peer(*args, **kwargs)
    except PeerError as exc:
        print(f"{exc}; going on without it", flush=True)
        return None


def alternate(rounds: int, run_ours: Callable[[int], dict], run_theirs: Callable[[int], dict | None]
              ) -> tuple[dict, dict | None, list[dict]]:
    """``rounds`` alternating rounds (hpcgnn first); each callable gets the round number and
    returns a dict with ``epoch_s`` (the round's fastest epoch after warm-up). The peer returning
    None stops its rounds (hpcgnn's still run). Returns (hpcgnn's fastest round, the peer's
    fastest round or None, every round's {"hpcgnn_epoch_s", "peer_epoch_s"})."""
    ours, theirs, log = None, None, []
    peer_ok = True
    for i in range(max(1, rounds)):
        a = run_ours(i)
        b = run_theirs(i) if peer_ok else None
        peer_ok = b is not None
        log.append({"hpcgnn_epoch_s": a["epoch_s"], "peer_epoch_s": b["epoch_s"] if b else float("nan")})
        ours = a if ours is None or a["epoch_s"] < ours["epoch_s"] else ours
        if b is not None:
            theirs = b if theirs is None or b["epoch_s"] < theirs["epoch_s"] else theirs
    return ours, theirs, log


def run_epochs(run_dir: Path) -> dict:
    """Epoch figures of an ``hpcgnn train`` run file, like the peer's: every epoch's seconds
    (slowest rank), ``epoch_s`` the fastest after the first, ``epoch_mean_s`` their mean, and
    per-phase minimum / mean seconds (mean over ranks) over the same epochs."""
    from hpcgnn.run.runfile import read_run

    t = read_run(run_dir)["timings"]
    epochs = np.max(t["epoch"], axis=1)
    sel = slice(1, None) if epochs.size > 1 else slice(0, None)
    phases = {k: np.mean(v, axis=1)[sel] for k, v in t.items() if k not in ("epoch", "eval")}
    return {"epoch_s": float(np.min(epochs[sel])), "epoch_mean_s": float(np.mean(epochs[sel])),
            "epochs_s": [float(x) for x in epochs],
            "phases_min_s": {k: float(np.min(v)) for k, v in phases.items()},
            "phases_mean_s": {k: float(np.mean(v)) for k, v in phases.items()}}


def hpcgnn_minibatch_1rank(config: Path, store: Path, work: Path, epochs: int, seed: int, overrides: list[str],
                           timeout: float) -> Callable[[int], dict]:
    """Round callable: round ``i`` runs ``hpcgnn train`` on one rank (mpiexec -n 1; HEC mode,
    which is halo-free at one rank, as the benchmark's run "hec-1") into ``work/run-peer-hec-1-i``
    and returns :func:`run_epochs` of it."""
    from benchmarks.launch import rank_command, run_checked

    def call(i: int) -> dict:
        run_dir = work / f"run-peer-hec-1-{i}"
        cmd = rank_command(1, [
            "-m", "hpcgnn", "train",
            "--config", str(config), "--set", f"data.partitions={store}", "--set", f"output.dir={run_dir}",
            "--set", "minibatch.halo=hec", "--set", f"train.epochs={epochs}",
            "--set", f"train.eval_every={epochs}", "--set", f"train.seed={seed}", "--force"])
        run_checked(cmd + [x for s in overrides for x in ("--set", s)], work / f"run-peer-hec-1-{i}.log",
                   timeout, "benchmarks.peers")
        return run_epochs(run_dir)
    return call


def _comparison(ours: dict, theirs: dict, log: list[dict]) -> dict:
    return {"hpcgnn_epoch_s": ours["epoch_s"], "hpcgnn_epoch_mean_s": ours["epoch_mean_s"],
            "dgl_epoch_s": theirs["epoch_s"], "dgl_epoch_mean_s": theirs["epoch_mean_s"],
            "hpcgnn_over_dgl": ours["epoch_s"] / theirs["epoch_s"],
            "hpcgnn_over_dgl_mean": ours["epoch_mean_s"] / theirs["epoch_mean_s"],
            "rounds_hpcgnn_epoch_s": [r["hpcgnn_epoch_s"] for r in log],
            "rounds_dgl_epoch_s": [r["peer_epoch_s"] for r in log],
            "dgl_version": str(theirs.get("dgl", "")), "dgl_torch": str(theirs.get("torch", "")),
            "dgl_phases_min_s": theirs.get("phases_min_s", {}), "hpcgnn_phases_min_s": ours.get("phases_min_s", {}),
            "dgl_top_ops": theirs.get("top_ops", []), "hpcgnn_top_ops": ours.get("top_ops", [])}


# issue 13's targets: hpcgnn's epoch at most this fraction of DGL's
TARGETS = {"fullgraph": 0.67, "minibatch": 0.5}


def print_targets(out: dict, scale: float, precision: str) -> None:
    """The comparisons against :data:`TARGETS` as a table (fastest epochs and means)."""
    print(f"hpcgnn / DGL at products-like scale {scale:g}, hpcgnn train.precision={precision}:")
    print("  what      | hpcgnn s | DGL s   | fastest | means | target | met (fastest / means)")
    for what, c in out.items():
        t = TARGETS[what]
        print(f"  {what:<9} | {c['hpcgnn_epoch_s']:8.3f} | {c['dgl_epoch_s']:7.3f} | {c['hpcgnn_over_dgl']:6.2f}x | "
              f"{c['hpcgnn_over_dgl_mean']:4.2f}x | <= {t:.2f} | {'yes' if c['hpcgnn_over_dgl'] <= t else 'no'} / "
              f"{'yes' if c['hpcgnn_over_dgl_mean'] <= t else 'no'}", flush=True)


def write_comparisons(path: Path, out: dict, meta: dict) -> None:
    """The comparisons ``{"fullgraph" | "minibatch": comparison}`` to HDF5 ``path`` (atomically):
    one group each with the epoch seconds, ratios, every round, both sides' phases, and the
    target with whether the fastest epochs and the means meet it; ``meta`` as root attributes."""
    from benchmarks.results_file import write_results

    groups = {}
    for what, c in out.items():
        t = TARGETS[what]
        g = {k: v for k, v in c.items() if k not in ("hpcgnn_top_ops", "dgl_top_ops")}
        g.update(target=t, met_fastest=bool(c["hpcgnn_over_dgl"] <= t), met_mean=bool(c["hpcgnn_over_dgl_mean"] <= t))
        groups[what] = g
    write_results(path, groups, meta, "hpcgnn-bench-peers")


def print_comparison(what: str, c: dict) -> None:
    """One line: both fastest epochs and the ratio."""
    print(f"{what}: hpcgnn {c['hpcgnn_epoch_s']:.3f} s, DGL {c['dgl_version']} {c['dgl_epoch_s']:.3f} s per epoch "
          f"(fastest of {len(c['rounds_dgl_epoch_s'])} alternating rounds) -> hpcgnn/DGL "
          f"{c['hpcgnn_over_dgl']:.2f}x (means {c['hpcgnn_over_dgl_mean']:.2f}x)", flush=True)


def fullgraph_vs_dgl(graph_file: Path, model_args: dict, threads: int, epochs: int, rounds: int,
                     run_ours: Callable[[int], dict], timeout: float = 3600, extra: tuple = ()) -> dict | None:
    """Full-graph SAGE epochs, hpcgnn (``run_ours``) against DGL in alternating rounds; the
    comparison (:func:`_comparison`) or None without a (working) DGL peer."""
    python = dgl_python()
    if python is None:
        return None
    if model_args.get("arch", "sage") != "sage":
        print(f"DGL peer: times GraphSAGE only, not {model_args['arch']}: skipped", flush=True)
        return None
    args = ["fullgraph", "--graph", graph_file, "--epochs", epochs, "--hidden", model_args["hidden"],
            "--layers", model_args["num_layers"], "--dropout", model_args.get("dropout", 0.0), "--lr", 0.01,
            "--threads", threads, "--seed", model_args.get("seed") or 0, *extra]
    ours, theirs, log = alternate(rounds, run_ours,
                                  lambda i: try_peer(python, DGL_SCRIPT, args, timeout, name="DGL peer"))
    if theirs is None:
        return None
    c = _comparison(ours, theirs, log)
    print_comparison("full-graph SAGE, 1 process, back to back", c)
    return c


def minibatch_vs_dgl(graph_file: Path, config: Path, overrides: list[str], epochs: int, seed: int, rounds: int,
                     run_ours: Callable[[int], dict], timeout: float = 3600, extra: tuple = ()) -> dict | None:
    """Minibatch SAGE epochs at one rank (hpcgnn: ``run_ours``, one ``hpcgnn train`` per round)
    against DGL's NeighborSampler + DataLoader(num_workers=0) with the same config (model
    sizes, dropout, lr, fanouts, batch size); None without a (working) DGL peer."""
    from hpcgnn.run.config import load_config

    python = dgl_python()
    if python is None:
        return None
    cfg = load_config(config, list(overrides))
    if cfg.model.arch != "sage":
        print(f"DGL peer: times GraphSAGE only, not {cfg.model.arch}: skipped", flush=True)
        return None
    threads = usable_cpus()
    args = ["minibatch", "--graph", graph_file, "--epochs", epochs, "--hidden", cfg.model.hidden,
            "--layers", cfg.model.layers, "--dropout", cfg.model.dropout, "--lr", cfg.train.lr,
            "--fanouts", ",".join(str(f) for f in cfg.minibatch.fanouts),
            "--batch-size", cfg.minibatch.batch_size, "--threads", threads, "--seed", seed, *extra]
    ours, theirs, log = alternate(rounds, run_ours,
                                  lambda i: try_peer(python, DGL_SCRIPT, args, timeout, name="DGL peer"))
    if theirs is None:
        return None
    c = _comparison(ours, theirs, log)
    print_comparison("minibatch SAGE, 1 rank, back to back", c)
    return c


def _hpcgnn_top_ops(graph, model_args: dict, n: int) -> list[dict]:
    """hpcgnn's in-memory full-graph epoch (after one warm-up epoch) under torch.profiler: its
    ``n`` largest ops by self CPU time (native kernels appear under their autograd nodes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hpcgnn.run.timer import PhaseTimer
    from hpcgnn.engine.fullgraph import InMemoryFullGraph
    from hpcgnn.nn.models import build_model

    model = build_model(**model_args)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    runner = InMemoryFullGraph(model, graph, None, torch.device("cpu"))
    n_train = float(graph.masks["train"].sum())
    def epoch():
        opt.zero_grad(set_to_none=True)
        runner.train_step(PhaseTimer(), n_train)
        opt.step()
    epoch()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        epoch()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "total_s": e.cpu_time_total / 1e6,
             "calls": int(e.count)} for e in rows]


def aggregate_vs_dgl(graph_file: Path, store: Path, widths: list[int], reps: int, rounds: int,
                     timeout: float = 3600) -> dict | None:
    """The aggregation kernel alone (mean over in-neighbours of the whole graph, forward and
    backward, random rows of each width), hpcgnn's :func:`~hpcgnn.nn.aggregate.aggregate_mean`
    against DGL's ``update_all(copy_u, mean)`` in alternating rounds; fastest of each kept.
    {width: {hpcgnn_fwd_s, hpcgnn_bwd_s, dgl_fwd_s, dgl_bwd_s}} or None without a DGL peer."""
    import time

    import torch

    from benchmarks.fullgraph_epochs import local_graphs
    from hpcgnn.nn.aggregate import aggregate_mean
    from hpcgnn.sampling.block import Block

    python = dgl_python()
    if python is None:
        return None
    (lg,) = local_graphs(graph_file, store)
    block = Block(lg.num_local, lg.num_solid, torch.from_numpy(lg.indptr), torch.from_numpy(lg.local_indices))
    gen = torch.Generator().manual_seed(0)
    best: dict = {str(w): {} for w in widths}

    def keep(w: str, key: str, value: float) -> None:
        best[w][key] = min(best[w].get(key, float("inf")), value)
    for _ in range(max(1, rounds)):
        for w in widths:
            x = torch.randn(block.num_src, w, generator=gen, requires_grad=True)
            for _ in range(max(2, reps)):
                t = time.perf_counter()
                o = aggregate_mean(block, x)
                fwd = time.perf_counter() - t
                grad = torch.ones_like(o)
                t = time.perf_counter()
                o.backward(grad)
                bwd = time.perf_counter() - t
                x.grad = None
                keep(str(w), "hpcgnn_fwd_s", fwd)   # the first repetition builds the cached transpose:
                keep(str(w), "hpcgnn_bwd_s", bwd)   # the minimum skips it
        theirs = try_peer(python, DGL_SCRIPT, ["aggregate", "--graph", graph_file, "--epochs", reps, "--widths",
                                                ",".join(map(str, widths)), "--threads", torch.get_num_threads()],
                          timeout, name="DGL peer")
        if theirs is None:
            return None
        for w, r in theirs["widths"].items():
            keep(w, "dgl_fwd_s", r["fwd_s"])
            keep(w, "dgl_bwd_s", r["bwd_s"])
    return best


def _print_ops(who: str, ops: list[dict]) -> None:
    if ops:
        print(f"  {who}: largest ops by self CPU time (one epoch under torch.profiler)")
        for o in ops:
            print(f"    {o['self_s']:8.3f} s self {o['total_s']:8.3f} s total {o['calls']:6d} calls  {o['op']}")


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.peers``: only the DGL comparisons of the benchmarks (same graph,
    model sizes and settings as bench-fullgraph / bench-minibatch), with phases and top ops."""
    import argparse

    from benchmarks.workdir import products_like_inputs

    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=main.__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/bench/peers-work", help="work directory (graph, stores, runs)")
    p.add_argument("--scale", type=float, default=0.04)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("fullgraph", "minibatch", "aggregate"), default=None)
    p.add_argument("--widths", default="47,100,128,256", help="aggregate: row widths of the kernel comparison")
    p.add_argument("--rounds", type=int, default=3, help="alternating hpcgnn / DGL rounds (fastest kept)")
    p.add_argument("--epochs", type=int, default=0, help="epochs per round (default 4 full-graph, 8 minibatch)")
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "inputs" / "products-sage.toml"))
    p.add_argument("--set", action="append", default=[], help="minibatch train --set overrides")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="hpcgnn's train.precision in both comparisons (DGL stays float32)")
    p.add_argument("--profile-ops", type=int, default=0, metavar="N",
                   help="also one epoch of each under torch.profiler: the N largest ops (full-graph hpcgnn, "
                        "both DGL modes)")
    p.add_argument("--json", default=None, help="write both comparisons to this JSON file")
    p.add_argument("--out", default=None, help="write both comparisons (and the targets) to this HDF5 file")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    python = dgl_python()
    if python is None:
        print("no DGL peer: run `make peer-dgl` first (or set HPCGNN_PEER_DGL_PYTHON)", file=sys.stderr)
        return 2
    from hpcgnn.runtime import prefer_huge_pages

    prefer_huge_pages()  # before the first tensor, as the benchmarks and `hpcgnn train` do
    import torch

    from hpcgnn import native
    from benchmarks.fullgraph_epochs import local_graphs, time_hpcgnn
    from hpcgnn.partition.store import read_meta

    threads = usable_cpus()
    torch.set_num_threads(threads)
    native.set_threads(threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    graph_file, stores = products_like_inputs(work, args.scale, args.seed, {1}, args.timeout, "benchmarks.peers")
    extra = ("--profile-ops", args.profile_ops) if args.profile_ops else ()
    out = {}
    if args.only in (None, "fullgraph"):
        meta = read_meta(stores[1])
        model_args = dict(arch="sage", in_dim=meta.num_features, hidden=128, num_classes=meta.num_classes,
                          num_layers=3, dropout=0.0, seed=args.seed)
        (g1,) = local_graphs(graph_file, stores[1])

        def ours(_round: int) -> dict:
            r = time_hpcgnn(g1, model_args, torch.device("cpu"), args.epochs or 4, precision=args.precision)
            r.pop("grad0")
            return r
        c = fullgraph_vs_dgl(graph_file, model_args, threads, args.epochs or 4, args.rounds, ours, args.timeout, extra)
        if c is not None:
            if args.profile_ops:
                c["hpcgnn_top_ops"] = _hpcgnn_top_ops(g1, model_args, args.profile_ops)
            out["fullgraph"] = c
        del g1
    if args.precision != "fp32":
        args.set = [*args.set, f"train.precision={args.precision}"]
    if args.only in (None, "minibatch"):
        epochs = args.epochs or 8
        c = minibatch_vs_dgl(graph_file, Path(args.config), args.set, epochs, args.seed, args.rounds,
                             hpcgnn_minibatch_1rank(Path(args.config), stores[1], work, epochs, args.seed, args.set,
                                                    args.timeout), args.timeout, extra)
        if c is not None:
            out["minibatch"] = c
    if args.only == "aggregate":
        agg = aggregate_vs_dgl(graph_file, stores[1], [int(w) for w in args.widths.split(",") if w],
                               args.epochs or 10, args.rounds, args.timeout)
        if agg is None:
            return 1
        print("aggregation kernel, mean over in-neighbours of the whole graph (fastest, seconds):")
        print("  width | hpcgnn fwd | DGL fwd | ratio | hpcgnn bwd | DGL bwd | ratio")
        for w, r in agg.items():
            print(f"  {w:>5} | {r['hpcgnn_fwd_s']:10.3f} | {r['dgl_fwd_s']:7.3f} | {r['hpcgnn_fwd_s'] / r['dgl_fwd_s']:5.2f} | "
                  f"{r['hpcgnn_bwd_s']:10.3f} | {r['dgl_bwd_s']:7.3f} | {r['hpcgnn_bwd_s'] / r['dgl_bwd_s']:5.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(agg, indent=1))
        return 0
    for what, c in out.items():
        print(f"{what}: seconds per phase, minimum over the timed epochs")
        print(f"  hpcgnn: {json.dumps({k: round(v, 4) for k, v in c['hpcgnn_phases_min_s'].items()})}")
        print(f"  DGL:    {json.dumps({k: round(v, 4) for k, v in c['dgl_phases_min_s'].items()})}")
        _print_ops("hpcgnn", c["hpcgnn_top_ops"])
        _print_ops("DGL", c["dgl_top_ops"])
        print_comparison(f"{what} (scale {args.scale:g})", c)
    if out:
        print_targets(out, args.scale, args.precision)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.out and out:
        write_comparisons(Path(args.out), out, {"scale": args.scale, "precision": args.precision,
                                                "rounds": args.rounds, "threads": threads, "set": json.dumps(args.set)})
        print(f"wrote {args.out}")
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
