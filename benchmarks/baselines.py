"""How hard a graph's labels are: a feature-only MLP against full-neighbour GraphSAGE.

Both models are trained full-batch in this process (no partitions, no MPI) on the graph's
train split with the same widths, dropout, optimiser and epochs; the MLP is the SAGE stack
without the neighbour term (``Linear -> ReLU -> dropout -> ... -> Linear``), so the gap
between the two is what the neighbourhoods add. Each reports its test accuracy at the
evaluation with the best validation accuracy. The products-like preset is tuned with this
(README.md, "Pipeline"):

    python -m benchmarks.baselines data/products-like.h5 [--epochs 100 --hidden 128 --layers 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hpcgnn.data.graph import Graph
from hpcgnn.errors import InputError
from hpcgnn.nn.dropout import Dropout


@dataclass(frozen=True)
class Accuracy:
    val: float     # best validation accuracy over the evaluations
    test: float    # test accuracy at that evaluation
    epoch: int     # 1-based epoch of that evaluation
    seconds: float


def _mlp(in_dim: int, hidden: int, classes: int, layers: int, dropout: float) -> nn.Sequential:
    mods: list[nn.Module] = []
    width = in_dim
    for _ in range(layers - 1):
        mods += [nn.Linear(width, hidden), nn.ReLU(), Dropout(dropout)]
        width = hidden
    return nn.Sequential(*mods, nn.Linear(width, classes))


def _fit(model: nn.Module, forward, graph: Graph, epochs: int, lr: float, eval_every: int) -> Accuracy:
    """Adam on the training rows; ``forward(rows)`` gives the logits of ``rows`` (None: every vertex)."""
    start = time.perf_counter()
    labels = torch.from_numpy(graph.labels)
    labelled = graph.labels >= 0
    train, val, test = (torch.from_numpy(np.flatnonzero(m & labelled))
                        for m in (graph.train_mask, graph.val_mask, graph.test_mask))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    best = Accuracy(-1.0, 0.0, 0, 0.0)
    for epoch in range(1, epochs + 1):
        model.train()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(forward(train), labels[train])
        loss.backward()
        opt.step()
        if epoch % eval_every == 0 or epoch == epochs:
            model.eval()
            with torch.no_grad():
                pred = forward(None).argmax(1)
            acc = [float((pred[s] == labels[s]).float().mean()) if s.numel() else 0.0 for s in (val, test)]
            if acc[0] > best.val:
                best = Accuracy(acc[0], acc[1], epoch, 0.0)
    return Accuracy(best.val, best.test, best.epoch, time.perf_counter() - start)


def mlp_vs_sage(graph: Graph, *, hidden: int = 128, layers: int = 2, dropout: float = 0.5, epochs: int = 100,
                lr: float = 0.01, eval_every: int = 5, seed: int = 0,
                models: tuple[str, ...] = ("mlp", "sage")) -> dict[str, Accuracy]:
    """{"mlp": Accuracy, "sage": Accuracy} of the two models trained on ``graph`` (see the module
    docstring); ``models`` picks which of them to train."""
    from hpcgnn.nn.models import build_model
    from hpcgnn.sampling.block import Block

    if not models or set(models) - {"mlp", "sage"}:
        raise InputError(f"--models is {','.join(models)!r}, expected mlp, sage or mlp,sage")
    if not graph.train_mask.any():
        raise InputError("the graph has no training vertices")
    for name, value in (("hidden", hidden), ("layers", layers), ("epochs", epochs), ("eval_every", eval_every)):
        if value < 1:
            raise InputError(f"--{name.replace('_', '-')} is {value}, expected >= 1")
    if layers < 2:
        raise InputError(f"--layers is {layers}, expected >= 2 (an MLP hidden layer per SAGE layer)")
    if not 0.0 <= dropout < 1.0:
        raise InputError(f"--dropout is {dropout}, expected 0 <= dropout < 1")
    if not lr > 0.0 or lr == float("inf"):
        raise InputError(f"--lr is {lr}, expected a finite value > 0")
    x = torch.from_numpy(graph.features)
    n = graph.num_nodes
    block = Block(n, n, torch.from_numpy(graph.indptr), torch.from_numpy(graph.indices))
    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = _mlp(graph.num_features, hidden, graph.num_classes, layers, dropout)
        if "mlp" in models:
            out["mlp"] = _fit(mlp, lambda rows: mlp(x if rows is None else x[rows]), graph, epochs, lr, eval_every)
        if "sage" not in models:
            return out
        torch.manual_seed(seed)
        sage = build_model("sage", graph.num_features, hidden, graph.num_classes, num_layers=layers,
                           dropout=dropout)
        out["sage"] = _fit(sage, lambda rows: sage([block] * layers, x) if rows is None else
                           sage([block] * layers, x)[rows], graph, epochs, lr, eval_every)
    return out


def main(argv: list[str] | None = None) -> int:
    from hpcgnn.data.graph import read_graph

    p = argparse.ArgumentParser(prog="python -m benchmarks.baselines", description=__doc__.split("\n\n")[0])
    p.add_argument("graph", help="graph file written by `hpcgnn prepare`")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--models", default="mlp,sage", help="which to train: mlp, sage or mlp,sage")
    args = p.parse_args(argv)
    try:
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        graph = read_graph(args.graph)
        res = mlp_vs_sage(graph, hidden=args.hidden, layers=args.layers, dropout=args.dropout, epochs=args.epochs,
                          lr=args.lr, seed=args.seed, models=tuple(m.strip() for m in args.models.split(",")))
    except InputError as exc:
        print(f"benchmarks.baselines: error: {exc}", file=sys.stderr)
        return 2
    for name, acc in res.items():
        print(f"{name:5s} test {100 * acc.test:.1f} % (val {100 * acc.val:.1f} % at epoch {acc.epoch}; "
              f"{acc.seconds:.1f} s)")
    if len(res) == 2:
        print(f"gap   {100 * (res['sage'].test - res['mlp'].test):.1f} points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
