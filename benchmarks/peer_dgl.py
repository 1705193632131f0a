"""DGL peer of the benchmarks (issue 13), run by ``.venv-dgl/bin/python`` (``make peer-dgl``).

    .venv-dgl/bin/python -I benchmarks/peer_dgl.py {fullgraph,minibatch} --graph FILE.h5 [options]

Times DGL on the benchmark's own graph file (read with h5py: ``indptr``/``indices`` in-edge CSR,
``features``, ``labels``, ``train_mask``; docs/formats.md) with the model of
``make bench-fullgraph`` / ``make bench-minibatch``: GraphSAGE with ``SAGEConv(..., "mean")``
layers, ReLU + dropout between them, cross-entropy over the training vertices, Adam.

- ``fullgraph``: one full-batch epoch = forward over the whole graph + backward + Adam step.
- ``aggregate``: the aggregation kernel alone, ``update_all(copy_u, mean)`` over the whole graph on
  random ``[N, width]`` rows for each of ``--widths``: forward and backward seconds (fastest of
  ``--epochs`` repetitions after the first).
- ``minibatch``: ``NeighborSampler(fanouts)`` (first fanout = input layer, as hpcgnn's),
  ``DataLoader(batch_size, shuffle=True, num_workers=0)``; input features gathered by the
  loader's ``input_nodes``.

Epoch times: every epoch's wall seconds, the first being warm-up; ``epoch_s`` is the fastest of
the others, ``epoch_mean_s`` their mean. Per-phase seconds (fastest epoch's phases are not
separated from the others: ``phases_min_s`` = per-phase minimum over the timed epochs) are
recorded with ``time.perf_counter`` around each step (CPU: every op is synchronous).
``--profile-ops N`` runs one more epoch under ``torch.profiler`` and reports its N largest ops
by self CPU time. Prints one JSON object on the last line of stdout; progress goes to stderr.

This file runs under a different torch (2.2) than hpcgnn's and must import nothing from
hpcgnn; ``-I`` keeps this directory off ``sys.path``. ``THP_MEM_ALLOC_ENABLE`` is taken from the
environment (the caller sets it, as hpcgnn does).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

GRAPH_FORMAT = "hpcgnn-graph"


def read_graph_h5(path: str) -> dict:
    """Arrays of an hpcgnn graph file (numpy): indptr, indices, features, labels, train_mask.

    Raises ValueError naming the file and what is wrong when it is not an hpcgnn graph file.
    """
    import h5py

    with h5py.File(path, "r") as f:
        fmt = f.attrs.get("format")
        if isinstance(fmt, bytes):
            fmt = fmt.decode()
        if fmt != GRAPH_FORMAT:
            raise ValueError(f"{path}: format attribute is {fmt!r}, expected {GRAPH_FORMAT!r}")
        missing = [k for k in ("indptr", "indices", "features", "labels", "train_mask") if k not in f]
        if missing:
            raise ValueError(f"{path}: missing dataset(s) {', '.join(missing)}")
        out = {k: f[k][()] for k in ("indptr", "indices", "features", "labels", "train_mask")}
        out["num_classes"] = int(f.attrs["num_classes"])
    n = out["indptr"].shape[0] - 1
    if out["features"].shape[0] != n or out["labels"].shape[0] != n or out["indices"].shape[0] != out["indptr"][-1]:
        raise ValueError(f"{path}: inconsistent sizes (indptr gives {n} vertices, {out['indptr'][-1]} edges)")
    return out


def _epoch_stats(times: list[float], phases: list[dict]) -> dict:
    timed = times[1:] if len(times) > 1 else times
    tp = phases[1:] if len(phases) > 1 else phases
    keys = sorted({k for p in tp for k in p})
    return {"epoch_s": float(min(timed)), "epoch_mean_s": float(np.mean(timed)), "first_epoch_s": float(times[0]),
            "epochs_s": [float(t) for t in times],
            "phases_min_s": {k: float(min(p.get(k, 0.0) for p in tp)) for k in keys},
            "phases_mean_s": {k: float(np.mean([p.get(k, 0.0) for p in tp])) for k in keys}}


def _model(torch, dglnn, dims: list[int], dropout: float):
    class SAGE(torch.nn.Module):
        """SAGEConv(mean) stack, ReLU + dropout between layers (hpcgnn's GNN)."""

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(dglnn.SAGEConv(a, b, "mean") for a, b in zip(dims[:-1], dims[1:]))
            self.dropout = torch.nn.Dropout(dropout)

        def forward(self, graphs, h):
            for i, (layer, g) in enumerate(zip(self.layers, graphs)):
                h = layer(g, h)
                if i < len(self.layers) - 1:
                    h = self.dropout(torch.relu(h))
            return h

    return SAGE()


class _Phases:
    """Seconds per named phase of one epoch."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.s[name] = self.s.get(name, 0.0) + now - self.t
        self.t = now


def _top_ops(torch, run_epoch, n: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_epoch()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "total_s": e.cpu_time_total / 1e6,
             "calls": int(e.count)} for e in rows]


def _aggregate_times(torch, dgl, g, args) -> dict:
    """{width: {"fwd_s", "bwd_s"}}: mean aggregation over ``g`` (fastest repetition after the first)."""
    import dgl.function as fn

    gen = torch.Generator().manual_seed(args.seed)
    out = {}
    for width in args.widths:
        x = torch.randn(g.num_nodes(), width, generator=gen, requires_grad=True)
        fwd, bwd = [], []
        for _ in range(max(2, args.epochs)):
            t = time.perf_counter()
            with g.local_scope():
                g.srcdata["h"] = x
                g.update_all(fn.copy_u("h", "m"), fn.mean("m", "o"))
                o = g.dstdata["o"]
            fwd.append(time.perf_counter() - t)
            grad = torch.ones_like(o)
            t = time.perf_counter()
            o.backward(grad)
            bwd.append(time.perf_counter() - t)
            x.grad = None
        out[str(width)] = {"fwd_s": min(fwd[1:]), "bwd_s": min(bwd[1:])}
    return out


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import dgl
    import dgl.nn as dglnn
    import torch.nn.functional as F

    t0 = time.perf_counter()
    data = read_graph_h5(args.graph)
    n = data["indptr"].shape[0] - 1
    indptr = torch.from_numpy(data["indptr"])
    src = torch.from_numpy(data["indices"])
    dst = torch.repeat_interleave(torch.arange(n), indptr[1:] - indptr[:-1])
    g = dgl.graph((src, dst), num_nodes=n)
    x = torch.from_numpy(data["features"])
    y = torch.from_numpy(data["labels"])
    train = torch.from_numpy(np.flatnonzero(data["train_mask"]).astype(np.int64))
    load_s = time.perf_counter() - t0
    dims = [x.shape[1]] + [args.hidden] * (args.layers - 1) + [data["num_classes"]]
    torch.manual_seed(args.seed)
    dgl.seed(args.seed)
    model = _model(torch, dglnn, dims, args.dropout)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model.train()

    if args.mode == "aggregate":
        return {"peer": "dgl", "mode": "aggregate", "dgl": dgl.__version__, "torch": torch.__version__,
                "threads": args.threads, "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", ""), "num_nodes": n,
                "num_edges": int(src.shape[0]), "widths": _aggregate_times(torch, dgl, g, args)}
    if args.mode == "fullgraph":
        graphs = [g] * args.layers
        y_train = y[train]

        def epoch() -> dict:
            ph = _Phases()
            opt.zero_grad(set_to_none=True)
            logits = model(graphs, x)
            ph.lap("forward")
            loss = F.cross_entropy(logits[train], y_train)
            loss.backward()
            ph.lap("backward")
            opt.step()
            ph.lap("optimizer")
            return ph.s
        iterations = 1
    else:
        sampler = dgl.dataloading.NeighborSampler(args.fanouts)
        loader = dgl.dataloading.DataLoader(g, train, sampler, batch_size=args.batch_size, shuffle=True,
                                            drop_last=False, num_workers=0)
        iterations = len(loader)

        def epoch() -> dict:
            ph = _Phases()
            for input_nodes, output_nodes, blocks in loader:
                ph.lap("sample")
                h = x[input_nodes]
                yb = y[output_nodes]
                ph.lap("gather")
                logits = model(blocks, h)
                ph.lap("forward")
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(logits, yb)
                loss.backward()
                ph.lap("backward")
                opt.step()
                ph.lap("optimizer")
            return ph.s

    times, phases = [], []
    for e in range(args.epochs):
        t = time.perf_counter()
        phases.append(epoch())
        times.append(time.perf_counter() - t)
        print(f"peer_dgl {args.mode}: epoch {e} {times[-1]:.3f} s", file=sys.stderr, flush=True)
    out = _epoch_stats(times, phases)
    if args.profile_ops:
        out["top_ops"] = _top_ops(torch, epoch, args.profile_ops)
    out.update(peer="dgl", mode=args.mode, dgl=dgl.__version__, torch=torch.__version__, threads=args.threads,
               thp=os.environ.get("THP_MEM_ALLOC_ENABLE", ""), python=platform.python_version(),
               num_nodes=n, num_edges=int(src.shape[0]), num_train=int(train.shape[0]), iterations=iterations,
               dims=dims, dropout=args.dropout, lr=args.lr, load_s=load_s)
    if args.mode == "minibatch":
        out.update(fanouts=args.fanouts, batch_size=args.batch_size)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="peer_dgl.py", description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("fullgraph", "minibatch", "aggregate"))
    p.add_argument("--graph", required=True, help="hpcgnn graph file (HDF5)")
    p.add_argument("--epochs", type=int, default=4, help="epochs (the first is warm-up)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--fanouts", default="5,10,15", help="minibatch: comma-separated, input layer first")
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--widths", default="47,100,128,256", help="aggregate: comma-separated row widths")
    p.add_argument("--profile-ops", type=int, default=0, metavar="N",
                   help="one more epoch under torch.profiler: its N largest ops by self CPU time")
    args = p.parse_args(argv)
    args.fanouts = [int(f) for f in args.fanouts.split(",") if f]
    args.widths = [int(w) for w in args.widths.split(",") if w]
    if args.epochs < 1 or args.layers < 1 or len(args.fanouts) != args.layers and args.mode == "minibatch":
        p.error(f"--epochs {args.epochs}, --layers {args.layers}, --fanouts {args.fanouts}: expected epochs >= 1 "
                "and one fanout per layer")
    try:
        out = run(args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"peer_dgl: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
