"""Expected minibatch frontiers of a partitioned store, per rank: the pre-run facts behind the
plan's AEP and exact-fetch halo bytes (:func:`hpcgnn.plan.estimator.minibatch_time`).

They are measured by a pre-sampling pass (as :mod:`hpcgnn.store.hotness` measures row
accesses): minibatches drawn like the engine's (each epoch a permutation of the rank's training
vertices split into ``M`` equalised batches, ``M`` the largest rank's batch count; see
:mod:`hpcgnn.engine.minibatch`) are sampled with the engine's own uniform sampler
(:class:`~hpcgnn.sampling.neighbor.NeighborSampler`) on seeded streams of their own, and the
frontiers are counted:

* local sampling (the HEC/AEP mode): the rank's partition CSR (halo vertices are leaves); per
  layer ``l`` the rows pushed (frontier ``l``'s solid vertices in each destination's send list,
  :class:`~hpcgnn.comm.aep.DestinationMap`, at most ``push_limit`` per destination and batch);
* the exact fetch (:mod:`hpcgnn.comm.exact_fetch`): the whole graph's CSR; per hop ``k`` the
  frontier's vertices owned by other ranks and the neighbour IDs drawn for them (``min(f,
  deg)`` each), and after the last hop the remote input rows.

A closed form over the edges (independent draws per edge) does not do: two paths from one seed
to a vertex are not independent (clustered graphs have many), and a minibatch's draws are not
rare (a small graph's batch holds a large share of its training vertices), so such a form is
off by more than 10 % on citation graphs. A pass draws batches until the mean per batch of every
count that is at least a tenth of the largest has a relative standard error of at most
:data:`REL_ERROR` (at least
:data:`MIN_BATCHES` batches, at most :data:`MAX_BATCHES` or :data:`MAX_VERTICES` frontier
vertices per rank and mode): small graphs draw thousands of cheap batches, large ones few.

Reads every partition's CSR, training mask and send lists (the store's edges as int64 global
IDs, and the exact mode's whole-graph CSR: about 16 bytes an edge of host memory while it
runs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REL_ERROR = 0.01          # target relative standard error of each per-batch mean
MIN_BATCHES = 16          # batches drawn at least, per rank and mode
MAX_BATCHES = 4096        # batches drawn at most, per rank and mode
MAX_VERTICES = 20_000_000  # frontier vertices sampled at most, per rank and mode
_PLAN_SEEDS, _PLAN_SAMPLER = 11, 12   # stream tags (hpcgnn.seeding.stream_seed) of the pass
PLAN_EPOCH = 1 << 41      # sampler epoch of the pass's first batches (training epochs are small)


@dataclass
class RankFrontiers:
    """One rank's expected frontiers for an average batch (see the module text).

    ``push_rows[l]``: AEP rows pushed at layer ``l`` per iteration (capped at ``push_limit`` per
    destination); ``remote[k]``: remote vertices of the exact fetch's frontier after ``k`` hops
    (``k = 0 .. L``, ``remote[L]`` the input rows fetched); ``remote_draws[k]``: neighbour IDs
    drawn for the remote vertices of hop ``k``'s frontier (``k < L``); ``iterations``: the
    iterations of an epoch, the same on every rank (``M``, the largest rank's batch count);
    ``batches``: batches the pass drew for each mode computed (local, exact)."""
    iterations: int
    push_rows: list[float]
    remote: list[float]
    remote_draws: list[float]
    batches: tuple = (0, 0)


@dataclass
class _Part:
    solid_begin: int
    indptr: np.ndarray        # [num_solid + 1]
    indices: np.ndarray       # global source IDs
    halo_ids: np.ndarray
    train: np.ndarray         # bool [num_solid]
    send_indptr: np.ndarray
    send_ids: np.ndarray      # global IDs

    @property
    def num_solid(self) -> int:
        return int(self.indptr.shape[0] - 1)


def _read_parts(store: Path, parts: int) -> tuple[list[_Part], int]:
    """Every partition's topology, training mask and send lists (in global ID order), and the
    feature rows' bytes a value."""
    import h5py

    from hpcgnn.partition.store import part_file_name

    out, itemsize = [], 4
    for p in range(parts):
        with h5py.File(store / part_file_name(p), "r") as f:
            out.append(_Part(int(f.attrs["solid_begin"]), f["indptr"][()].astype(np.int64),
                             f["indices"][()].astype(np.int64), f["halo_ids"][()].astype(np.int64),
                             f["train_mask"][()].astype(bool), f["send_indptr"][()].astype(np.int64),
                             f["send_ids"][()].astype(np.int64)))
            itemsize = f["features"].dtype.itemsize
    return out, itemsize


def _batch_sizes(train: int, iterations: int) -> list[int]:
    """The engine's equalised batch sizes (:func:`hpcgnn.engine.batches.equalised_batches`)."""
    base, extra = divmod(train, iterations)
    return [base + (1 if k < extra else 0) for k in range(iterations)]


def _pass(draw, train_ids: np.ndarray, sizes: list[int], rng, width: int) -> tuple[np.ndarray, int]:
    """Mean per batch of the counts ``draw(seeds, epoch, step)`` returns (a float vector of
    ``width``; its last entry the frontier vertices sampled), over batches drawn epoch by epoch
    until the stopping rule of the module text; (mean, batches)."""
    rows, epoch, vertices = [], 0, 0
    while True:
        order = rng.permutation(train_ids)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        for k in range(len(sizes)):
            seeds = order[bounds[k]:bounds[k + 1]]
            got = draw(seeds, PLAN_EPOCH + epoch, k) if seeds.size else np.zeros(width)
            rows.append(got)
            vertices += int(got[-1])
        epoch += 1
        n = len(rows)
        if n >= MAX_BATCHES or vertices >= MAX_VERTICES:
            break
        if n >= MIN_BATCHES:
            a = np.asarray(rows)[:, :-1]
            mean = a.mean(axis=0)
            se = a.std(axis=0, ddof=1) / math.sqrt(n)
            big = mean >= 0.1 * mean.max(initial=0.0)
            if np.all(se[big] <= REL_ERROR * mean[big]):
                break
    return np.asarray(rows).mean(axis=0), len(rows)


def expected_frontiers(store, parts: int, fanouts: list[int], batch_size: int, push_limit: int,
                       local: bool = True, exact: bool = True, seed: int = 0) -> tuple[list[RankFrontiers], int]:
    """Every rank's :class:`RankFrontiers` for the store at ``store`` (``parts`` partitions, one
    rank each) and the minibatch settings, and the feature rows' bytes a value. ``local``/``exact``:
    measure the AEP (local sampling) / exact-fetch figures (the others stay zero). ``seed`` fixes
    the pass's draws."""
    import torch

    from hpcgnn.comm.aep import DestinationMap
    from hpcgnn.partition.store import local_ids
    from hpcgnn.sampling.neighbor import NeighborSampler
    from hpcgnn.seeding import numpy_rng, stream_seed

    store = Path(store)
    pts, itemsize = _read_parts(store, parts)
    layers = len(fanouts)
    per_train = [int(p.train.sum()) for p in pts]
    iters = max(max(-(-t // max(batch_size, 1)) for t in per_train), 1)
    begins = np.array([p.solid_begin for p in pts], dtype=np.int64)
    order = np.argsort(begins)
    whole = None
    if exact:
        degree = np.concatenate([np.diff(pts[p].indptr) for p in order])
        indptr = np.zeros(degree.shape[0] + 1, np.int64)
        np.cumsum(degree, out=indptr[1:])
        whole = NeighborSampler(indptr, np.concatenate([pts[p].indices for p in order]), degree.shape[0],
                                fanouts, seed=stream_seed(seed, _PLAN_SAMPLER, -1))
        hop_fanouts = np.array(list(reversed(fanouts)), dtype=np.int64)
    out = []
    for p, part in enumerate(pts):
        ns, begin = part.num_solid, part.solid_begin
        train_ids = np.flatnonzero(part.train).astype(np.int64)
        sizes = _batch_sizes(train_ids.size, iters)
        push_rows, remote, remote_draws, drawn = [0.0] * layers, [0.0] * (layers + 1), [0.0] * layers, [0, 0]
        if local and train_ids.size:
            end = begin + ns
            li = local_ids(part.indices, begin, end, part.halo_ids)
            sampler = NeighborSampler(part.indptr, li, ns, fanouts, seed=stream_seed(seed, _PLAN_SAMPLER, p),
                                      num_local=ns + part.halo_ids.shape[0])
            dests = DestinationMap(SimpleNamespace(num_parts=parts, send_indptr=part.send_indptr,
                                                 send_ids=part.send_ids, solid_begin=begin, num_solid=ns,
                                                 num_halo=int(part.halo_ids.shape[0])))

            def draw_local(seeds, epoch, step):
                b = sampler.sample(torch.from_numpy(seeds), epoch=epoch, step=step)
                got = np.zeros(layers + 1)
                for l in range(layers):
                    _, ranks = dests.expand(b.frontiers[l].numpy())
                    got[l] = np.minimum(np.bincount(ranks, minlength=parts), push_limit).sum()
                got[layers] = sum(int(f.shape[0]) for f in b.frontiers)
                return got

            mean, drawn[0] = _pass(draw_local, train_ids, sizes, numpy_rng(seed, _PLAN_SEEDS, p, 0), layers + 1)
            push_rows = [float(x) for x in mean[:layers]]
        if exact and train_ids.size:
            def draw_exact(seeds, epoch, step):
                b = whole.sample(torch.from_numpy(seeds + begin), epoch=epoch, step=step)
                got = np.zeros(2 * layers + 2)
                for k in range(layers + 1):
                    f = b.frontiers[layers - k].numpy()
                    away = (f < begin) | (f >= begin + ns)
                    got[k] = away.sum()
                    if k < layers:
                        deg = indptr[f[away] + 1] - indptr[f[away]]
                        fan = hop_fanouts[k]
                        got[layers + 1 + k] = (deg if fan < 0 else np.minimum(deg, fan)).sum()
                got[-1] = sum(int(f.shape[0]) for f in b.frontiers)
                return got

            mean, drawn[1] = _pass(draw_exact, train_ids, sizes, numpy_rng(seed, _PLAN_SEEDS, p, 1), 2 * layers + 2)
            remote = [float(x) for x in mean[:layers + 1]]
            remote_draws = [float(x) for x in mean[layers + 1:2 * layers + 1]]
        out.append(RankFrontiers(iters, push_rows, remote, remote_draws, tuple(drawn)))
    return out, itemsize
