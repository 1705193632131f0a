"""One-process full-graph epochs, timed, as the full-graph benchmark (:mod:`benchmarks.fullgraph`)
and the DGL comparison (:mod:`benchmarks.peers`) both run them: every partition's local graph
read from a store (:func:`local_graphs`) and the epoch times of the in-memory or offloaded engine
on one rank (:func:`time_hpcgnn`)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA device; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double().cpu()
                      for p in model.parameters()])


def epoch_stats(times: list[float]) -> dict:
    """Epoch time = the fastest epoch after the first (warm-up): robust on a shared machine."""
    timed = times[1:] if len(times) > 1 else times
    return {"epoch_s": float(np.min(timed)), "epoch_mean_s": float(np.mean(timed)), "first_epoch_s": times[0]}


def time_hpcgnn(graph, model_args: dict, device, epochs: int, settings=None, precision: str = "fp32") -> dict:
    """Epoch times of the in-memory (settings None) or offloaded engine on one rank; ``precision``
    as ``train.precision``."""
    from hpcgnn.run.timer import PhaseTimer
    from hpcgnn.engine.fullgraph import InMemoryFullGraph, OffloadedFullGraph
    from hpcgnn.nn.models import build_model
    from hpcgnn.nn.precision import set_precision

    model = set_precision(build_model(**model_args), precision).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    runner = InMemoryFullGraph(model, graph, None, device) if settings is None else \
        OffloadedFullGraph(model, graph, None, device, settings)
    n_train = float(graph.masks["train"].sum())
    times, grad0 = [], None
    for e in range(epochs):
        runner.reset_stats()
        opt.zero_grad(set_to_none=True)
        sync_device(device)
        t0 = time.perf_counter()
        runner.train_step(PhaseTimer(sync_cuda=device.type == "cuda"), n_train)
        if e == 0:
            grad0 = _flat_grad(model)
        opt.step()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    out = dict(epoch_stats(times), grad0=grad0)
    out.update({k: float(v) for k, v in runner.counters().items()})
    if settings is not None:
        out["chunks"] = runner.engine.num_chunks
        out["capacity_rows"] = runner.engine.plan.capacity
    return out


def local_graphs(graph_file: Path, store: Path):
    """Every partition's LocalGraph, halo features taken from the graph file (one process)."""
    from hpcgnn.data.graph import read_graph
    from hpcgnn.engine.fullgraph import build_local_graph
    from hpcgnn.partition.store import load_partition, read_meta

    meta = read_meta(store)
    feats = read_graph(graph_file, validate=False).features
    n2o = meta.new_to_orig()
    out = []
    for p in range(meta.num_parts):
        part = load_partition(store, p, meta)
        lg = build_local_graph(part, None)
        lg.x0[part.num_solid:] = torch.from_numpy(feats[n2o[part.halo_ids]])
        out.append(lg)
    return out
