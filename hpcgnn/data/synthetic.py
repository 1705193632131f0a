"""Synthetic graphs: R-MAT and a planted-class stochastic block model (SBM).

Both stream their edges in blocks of :data:`EDGE_BLOCK` draws into the
native CSR builder, so a products-sized graph (62M undirected draws) needs
about 1.5 GB for the edges plus the output. Every random stream is derived
from ``seed`` and a fixed (stream, chunk) key, so the same parameters give
bit-identical arrays on any machine and thread count.

R-MAT (Chakrabarti et al. 2004, Graph500 parameters a,b,c,d = .57,.19,.19,.05):
each edge descends ``ceil(log2 N)`` levels of the adjacency matrix choosing a
quadrant with probabilities (a, b, c, d); ``noise`` perturbs them per level
as in NSKG (Seshadhri et al. 2013). The 2^scale IDs are folded onto [0, N)
by ``id * N >> scale`` and then relabelled by a random permutation. Classes
are random and balanced, so the structure carries no label signal.

SBM (planted classes): vertices get balanced random classes. An edge's source
is drawn with probability proportional to a per-vertex weight; with
probability ``p_in`` its destination is drawn (by weight) from the source's
class, otherwise from the other classes. Weights follow a Zipf law over a
random rank within the class, ``w = (rank+1)^-degree_skew`` (0 = uniform),
which gives a power-law degree tail with exponent about 1 + 1/degree_skew and
is sampled in closed form (inverse CDF), no per-vertex tables beyond the
class membership.

Features (both): ``centroid[class] + feature_noise * N(0, 1)`` with centroid
entries drawn from N(0, 2/F) (expected distance 2 between centroids), so
features alone give a moderate accuracy and neighbourhood aggregation helps.

Flips (SBM): the features of a random ``feature_flip`` fraction of the vertices,
and independently the edges of a random ``edge_flip`` fraction, follow the class
of another random vertex instead of their own label (:func:`profile_classes`: a
permutation among the chosen, so class sizes stay balanced). Features then
identify the label for at most about ``1 - feature_flip`` of the vertices and
neighbourhoods for ``1 - edge_flip``, however much training data there is:
products-like uses this (:data:`PRODUCTS_DIFFICULTY`) for ogbn-products'
difficulty. With both at 0 nothing is drawn and the output is as without flips.

Splits: a random permutation cut into train/val/test of the requested sizes.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from hpcgnn.data.build import GraphSource, materialize
from hpcgnn.data.graph import Graph
from hpcgnn.errors import InputError
from hpcgnn.progress import Progress

EDGE_CHUNK = 8 << 20          # undirected draws per random stream (fixed: part of the output)
EDGE_BLOCK = 1 << 18          # draws per vectorised block within a stream (fixed: part of the output);
                              # small blocks keep numpy temporaries cache- and allocator-friendly
FEATURE_CHUNK_ROWS = 1 << 18  # feature rows per random stream (fixed: part of the output)
FEATURE_BLOCK_ROWS = 1 << 13  # rows per centroid gather (memory only)
MAX_NODES = (1 << 31) - 1

# Random stream keys (SeedSequence spawn keys).
_S_CLASSES, _S_RMAT_NOISE, _S_EDGES, _S_FEATURES, _S_CENTROIDS, _S_SPLIT, _S_PROFILE = range(7)

# ogbn-products (Hu et al. 2020): vertices, undirected edges, features, classes, split sizes.
PRODUCTS_SHAPE = {"nodes": 2_449_029, "edges": 61_859_140, "features": 100, "classes": 47,
                  "train": 196_615, "val": 39_323, "test": 2_213_091}
# products-like's label signal (SbmParams fields), chosen so that a feature-only MLP and
# full-neighbour GraphSAGE land near ogbn-products' (OGB leaderboard: MLP 61 %, SAGE 78-79 %);
# measured figures in README.md. The earlier, easy preset: p_in 0.7, feature_noise 1, no flips.
PRODUCTS_DIFFICULTY = {"p_in": 0.6, "degree_skew": 0.6, "feature_noise": 0.3, "feature_flip": 0.36,
                       "edge_flip": 0.19}


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=tuple(key))))


@dataclass(frozen=True)
class SyntheticParams:
    """Parameters shared by the generators. ``train``/``val``/``test`` are vertex
    counts (ints) or fractions of ``nodes`` (floats in [0, 1])."""

    nodes: int
    edges: int
    features: int
    classes: int
    train: float | int = 0.1
    val: float | int = 0.1
    test: float | int = 0.8
    feature_noise: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise InputError(f"--nodes is {self.nodes}, expected 1 .. {MAX_NODES}")
        if self.edges < 0:
            raise InputError(f"--edges is {self.edges}, expected >= 0")
        if self.features < 1:
            raise InputError(f"--features is {self.features}, expected >= 1")
        if not 1 <= self.classes <= self.nodes:
            raise InputError(f"--classes is {self.classes}, expected 1 .. --nodes ({self.nodes})")
        if not (math.isfinite(self.feature_noise) and self.feature_noise >= 0):
            raise InputError(f"--feature-noise is {self.feature_noise}, expected a finite value >= 0")
        split_counts(self.nodes, self.train, self.val, self.test)


@dataclass(frozen=True)
class SbmParams(SyntheticParams):
    p_in: float = 0.7
    degree_skew: float = 0.6
    feature_flip: float = 0.0
    edge_flip: float = 0.0

    def check(self) -> None:
        super().check()
        for flag, v in (("--feature-flip", self.feature_flip), ("--edge-flip", self.edge_flip)):
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise InputError(f"{flag} is {v}, expected a fraction in [0, 1]")
        if not 0.0 <= self.p_in <= 1.0:
            raise InputError(f"--p-in is {self.p_in}, expected a probability in [0, 1]")
        if self.classes < 2 and self.p_in < 1.0:
            raise InputError(f"--classes is {self.classes}: the SBM needs >= 2 classes unless --p-in is 1")
        if not 0.0 <= self.degree_skew < 1.0:
            raise InputError(f"--degree-skew is {self.degree_skew}, expected 0 <= skew < 1")


@dataclass(frozen=True)
class RmatParams(SyntheticParams):
    a: float = 0.57
    b: float = 0.19
    c: float = 0.19
    d: float = 0.05
    noise: float = 0.0

    def check(self) -> None:
        super().check()
        probs = (self.a, self.b, self.c, self.d)
        if min(probs) < 0 or abs(sum(probs) - 1.0) > 1e-9:
            raise InputError(f"R-MAT probabilities a,b,c,d = {probs} must be >= 0 and sum to 1")
        limit = min((self.a + self.d) / 2, self.b, self.c)
        if not 0.0 <= self.noise <= limit:
            raise InputError(f"--noise is {self.noise}, expected 0 .. {limit:g} (NSKG bound min((a+d)/2, b, c))")


def split_counts(n: int, train, val, test) -> tuple[int, int, int]:
    """Vertex counts of the three splits from counts (int) or fractions (float)."""
    out = []
    for name, v in (("train", train), ("val", val), ("test", test)):
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            if not 0 <= v <= n:
                raise InputError(f"--{name} is {v} vertices, expected 0 .. {n}")
            out.append(int(v))
        else:
            v = float(v)
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise InputError(f"--{name} is {v}, expected a fraction in [0, 1]")
            out.append(int(round(v * n)))
    if sum(out) > n:
        if sum(out) - n <= 2 and all(isinstance(v, float) for v in (train, val, test)):
            out[2] = n - out[0] - out[1]  # rounding of fractions summing to 1
        else:
            raise InputError(f"--train/--val/--test select {sum(out)} vertices, more than --nodes ({n})")
    return out[0], out[1], out[2]


def split_masks(n: int, counts: tuple[int, int, int], seed: int):
    """Disjoint random train/val/test masks of the given sizes."""
    order = _rng(seed, _S_SPLIT).permutation(n)
    masks = []
    start = 0
    for k in counts:
        m = np.zeros(n, dtype=bool)
        m[order[start:start + k]] = True
        masks.append(m)
        start += k
    return masks


def balanced_classes(n: int, num_classes: int, seed: int) -> np.ndarray:
    """int64 labels: class sizes differ by at most one, assignment random."""
    labels = np.empty(n, dtype=np.int64)
    labels[_rng(seed, _S_CLASSES).permutation(n)] = np.arange(n, dtype=np.int64) % num_classes
    return labels


def profile_classes(labels: np.ndarray, fraction: float, seed: int, stream: int) -> np.ndarray:
    """The classes some property (features: ``stream`` 0, edges: 1) follows: each vertex's
    label, except for a random ``round(fraction * N)`` vertices that take the labels of one
    another (a random permutation among them, so every class keeps its size and a chosen
    vertex keeps its own class with probability about 1/C). ``labels`` itself when that is 0."""
    n = labels.shape[0]
    k = int(round(fraction * n))
    if k == 0:
        return labels
    rng = _rng(seed, _S_PROFILE, stream)
    chosen = rng.choice(n, size=k, replace=False)
    profile = labels.copy()
    profile[chosen] = labels[chosen[rng.permutation(k)]]
    return profile


def class_feature_blocks(labels: np.ndarray, num_features: int, num_classes: int, noise: float, seed: int,
                         rows: int = FEATURE_BLOCK_ROWS):
    """Yield the rows of :func:`class_features` in order, in blocks of at most ``rows`` rows
    (float32 [<= rows, F]); the values do not depend on ``rows``."""
    n = labels.shape[0]
    centroids = _rng(seed, _S_CENTROIDS).normal(0.0, math.sqrt(2.0 / num_features),
                                                (num_classes, num_features)).astype(np.float32)
    rows = max(1, int(rows))
    for k, lo in enumerate(range(0, n, FEATURE_CHUNK_ROWS)):
        hi = min(n, lo + FEATURE_CHUNK_ROWS)
        rng = _rng(seed, _S_FEATURES, k)
        for a in range(lo, hi, rows):
            b = min(hi, a + rows)
            block = rng.standard_normal((b - a, num_features), dtype=np.float32)
            block *= np.float32(noise)
            block += centroids[labels[a:b]]
            yield block


def class_features(labels: np.ndarray, num_features: int, num_classes: int, noise: float, seed: int,
                   progress: bool = False) -> np.ndarray:
    """float32 [N, F] = centroid[label] + noise * N(0, 1), generated in row chunks."""
    n = labels.shape[0]
    out = np.empty((n, num_features), dtype=np.float32)
    at = 0
    with Progress("features", total=n, enabled=progress) as bar:
        for block in class_feature_blocks(labels, num_features, num_classes, noise, seed):
            out[at:at + block.shape[0]] = block
            at += block.shape[0]
            bar.update(block.shape[0])
    return out


# ---------------------------------------------------------------- R-MAT

def _rmat_levels(p: RmatParams, scale: int) -> np.ndarray:
    """Per-level quadrant probabilities (scale, 4), NSKG-perturbed when noise > 0."""
    base = np.array([p.a, p.b, p.c, p.d], dtype=np.float64)
    levels = np.tile(base, (scale, 1))
    if p.noise > 0:
        mu = _rng(p.seed, _S_RMAT_NOISE).uniform(-p.noise, p.noise, scale)
        ad = p.a + p.d
        levels[:, 0] = p.a - 2 * mu * p.a / ad
        levels[:, 1] = p.b + mu
        levels[:, 2] = p.c + mu
        levels[:, 3] = p.d - 2 * mu * p.d / ad
    return levels


def edge_blocks(total: int, seed: int):
    """Yield ``(rng, m)`` for consecutive blocks of ``total`` draws.

    Every EDGE_CHUNK draws get their own random stream (seed, chunk index);
    within it, blocks of EDGE_BLOCK draws are generated in order.
    """
    for k, lo in enumerate(range(0, total, EDGE_CHUNK)):
        rng = _rng(seed, _S_EDGES, k)
        size = min(EDGE_CHUNK, total - lo)
        for b in range(0, size, EDGE_BLOCK):
            yield rng, min(EDGE_BLOCK, size - b)


def rmat_block(rng: np.random.Generator, m: int, scale: int, levels: np.ndarray):
    """``m`` R-MAT edges with IDs in [0, 2^scale): (src, dst) int64."""
    src = np.zeros(m, dtype=np.int64)
    dst = np.zeros(m, dtype=np.int64)
    r = np.empty(m, dtype=np.float32)
    for a, b, c, _ in levels:
        rng.random(out=r, dtype=np.float32)
        s_bit = r >= np.float32(a + b)
        d_bit = (r >= np.float32(a)) & ~s_bit | (r >= np.float32(a + b + c))
        src <<= 1
        dst <<= 1
        src |= s_bit
        dst |= d_bit
    return src, dst


def rmat_source(p: RmatParams, name: str = "rmat") -> GraphSource:
    """The R-MAT graph of ``p`` as a :class:`~hpcgnn.data.build.GraphSource` (edges and features
    generated block by block when streamed)."""
    p.check()
    n = p.nodes
    scale = max(1, math.ceil(math.log2(n)))
    levels = _rmat_levels(p, scale)

    def vertex_data():
        return (balanced_classes(n, p.classes, p.seed),
                *split_masks(n, split_counts(n, p.train, p.val, p.test), p.seed))

    def edges():
        perm = _rng(p.seed, _S_CLASSES, 1).permutation(n).astype(np.int64)
        for rng, m in edge_blocks(p.edges, p.seed):
            src, dst = rmat_block(rng, m, scale, levels)
            src *= n
            src >>= scale
            dst *= n
            dst >>= scale
            yield perm[src], perm[dst]

    def features(rows: int):
        return class_feature_blocks(balanced_classes(n, p.classes, p.seed), p.features, p.classes,
                                    p.feature_noise, p.seed, rows)

    meta = {"name": name, "source": {"generator": "rmat", "scale": scale, **asdict(p)}}
    return GraphSource(name, n, p.features, p.classes, vertex_data, edges, features, meta=meta,
                       vertex_bytes=8, input_edges=p.edges, where=f"--dataset {name}")


def generate_rmat(p: RmatParams, name: str = "rmat", progress: bool = False) -> Graph:
    """An R-MAT graph with ``p.edges`` undirected edge draws (before cleaning)."""
    return materialize(rmat_source(p, name), progress)


# ---------------------------------------------------------------- SBM

class _ClassSampler:
    """Draw vertices by Zipf weight, within a class or over all or other classes."""

    def __init__(self, labels: np.ndarray, num_classes: int, skew: float, seed: int, ranking: int = 2):
        # Members grouped by class; within a class the order is random (it is
        # the weight rank), so vertex IDs do not correlate with degree. ``ranking``
        # keys the random order: samplers with different keys rank independently.
        order = _rng(seed, _S_CLASSES, ranking).permutation(labels.shape[0])
        self.members = order[np.argsort(labels[order], kind="stable")].astype(np.int64)
        self.sizes = np.bincount(labels, minlength=num_classes).astype(np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.sizes)[:-1])).astype(np.int64)
        self.skew = float(skew)
        if self.skew == 0.0:
            self.span = self.sizes.astype(np.float64)
            self.weight = self.span.copy()
        else:
            e = 1.0 - self.skew
            self.span = (self.sizes + 1.0) ** e - 1.0        # inverse-CDF range per class
            self.weight = self.span / e                       # integral of x^-skew over [1, n+1]
        self.cum = np.concatenate(([0.0], np.cumsum(self.weight)))
        self.total = float(self.cum[-1])
        self.num_classes = num_classes

    def classes_by_weight(self, u: np.ndarray) -> np.ndarray:
        c = np.searchsorted(self.cum[1:], u * self.total, side="right")
        return np.minimum(c, self.num_classes - 1)

    def other_classes(self, own: np.ndarray, u: np.ndarray) -> np.ndarray:
        """A class != own, drawn by weight among the others."""
        w_own = self.weight[own]
        v = u * (self.total - w_own)
        v += (v >= self.cum[own]) * w_own     # skip over the own class' interval
        c = np.minimum(np.searchsorted(self.cum[1:], v, side="right"), self.num_classes - 1)
        clash = c == own                      # only through rounding at interval ends
        c[clash] = (own[clash] + 1) % self.num_classes
        return c

    def vertices(self, cls: np.ndarray, u: np.ndarray) -> np.ndarray:
        """A vertex of each class ``cls[i]``, drawn by Zipf weight over its in-class rank."""
        size = self.sizes[cls]
        if self.skew == 0.0:
            rank = (u * size).astype(np.int64)
        else:
            x = np.power(1.0 + u * self.span[cls], 1.0 / (1.0 - self.skew))
            rank = x.astype(np.int64) - 1
        np.clip(rank, 0, size - 1, out=rank)
        return self.members[self.starts[cls] + rank]


def sbm_block(rng: np.random.Generator, m: int, sampler: _ClassSampler, p_in: float):
    """``m`` SBM edge draws: (src, dst) int64."""
    src_class = sampler.classes_by_weight(rng.random(m))
    src = sampler.vertices(src_class, rng.random(m))
    inside = rng.random(m) < p_in
    dst_class = src_class.copy()
    cross = ~inside
    if sampler.num_classes > 1 and cross.any():
        dst_class[cross] = sampler.other_classes(src_class[cross], rng.random(int(cross.sum())))
    dst = sampler.vertices(dst_class, rng.random(m))
    return src, dst


def sbm_source(p: SbmParams, name: str = "sbm") -> GraphSource:
    """The planted-class SBM graph of ``p`` as a :class:`~hpcgnn.data.build.GraphSource`."""
    p.check()
    n = p.nodes

    def vertex_data():
        return (balanced_classes(n, p.classes, p.seed),
                *split_masks(n, split_counts(n, p.train, p.val, p.test), p.seed))

    def edges():
        labels = balanced_classes(n, p.classes, p.seed)
        sampler = _ClassSampler(profile_classes(labels, p.edge_flip, p.seed, 1), p.classes, p.degree_skew, p.seed)
        del labels
        for rng, m in edge_blocks(p.edges, p.seed):
            yield sbm_block(rng, m, sampler, p.p_in)

    def features(rows: int):
        profile = profile_classes(balanced_classes(n, p.classes, p.seed), p.feature_flip, p.seed, 0)
        return class_feature_blocks(profile, p.features, p.classes, p.feature_noise, p.seed, rows)

    meta = {"name": name, "source": {"generator": "sbm", **asdict(p)}}
    # the sampler's members (8) and edge profile (8), its set-up's labels, permutation and sort (32)
    return GraphSource(name, n, p.features, p.classes, vertex_data, edges, features, meta=meta,
                       vertex_bytes=48, input_edges=p.edges, where=f"--dataset {name}")


def generate_sbm(p: SbmParams, name: str = "sbm", progress: bool = False) -> Graph:
    """A planted-class SBM graph with ``p.edges`` undirected edge draws (before cleaning)."""
    return materialize(sbm_source(p, name), progress)


def products_like_params(scale: float = 1.0, seed: int = 0, **overrides) -> SbmParams:
    """SbmParams with the ogbn-products shape, every size multiplied by ``scale``, and the
    :data:`PRODUCTS_DIFFICULTY` label signal (``overrides`` replace any SbmParams field)."""
    if not (math.isfinite(scale) and 0 < scale <= 1):
        raise InputError(f"--scale is {scale}, expected 0 < scale <= 1")
    s = PRODUCTS_SHAPE
    nodes = max(s["classes"], int(round(s["nodes"] * scale)))
    train = int(round(s["train"] * scale))
    val = int(round(s["val"] * scale))
    return SbmParams(nodes=nodes, edges=int(round(s["edges"] * scale)), features=s["features"],
                     classes=s["classes"], train=train, val=val, test=max(0, nodes - train - val),
                     seed=seed, **{**PRODUCTS_DIFFICULTY, **overrides})


# ---------------------------------------------------------------- papers-like

# ogbn-papers100M (Hu et al. 2020): vertices, undirected edges, features, classes, split sizes.
PAPERS_SHAPE = {"nodes": 111_059_956, "edges": 1_615_685_872, "features": 128, "classes": 172,
                "train": 1_207_179, "val": 125_265, "test": 214_338}
# papers-like's structure and label signal. Citations: a citing paper is drawn by a Zipf
# "activity" weight (out_skew) and the cited paper by an independent Zipf "popularity" weight
# (in_skew, more concentrated), within the citing paper's class with probability p_in. Signal
# aimed at ogbn-papers100M's (OGB leaderboard: MLP 47 %, GraphSAGE 67 %, from 7,000 training
# vertices per class): features follow the label for half of the vertices, edges for 70 %, so a
# feature-only MLP reaches at most 1 - feature_flip * (1 - 1/C) (50.3 %) and full-neighbour
# GraphSAGE 20-30 points more, given tens of training vertices per class or more
# (tests/data/test_papers_like_difficulty.py checks >= 22 points at 93 per class; figures in
# docs/benchmarks.md). The preset's own splits have 7,000 x scale training vertices per class:
# at small scales both models sit lower.
PAPERS_DIFFICULTY = {"p_in": 0.6, "out_skew": 0.5, "in_skew": 0.9, "feature_noise": 0.3,
                     "feature_flip": 0.5, "edge_flip": 0.3}


@dataclass(frozen=True)
class PapersParams:
    """papers-like: the :data:`PAPERS_SHAPE` times ``scale`` with :data:`PAPERS_DIFFICULTY`."""

    scale: float = 1.0
    seed: int = 0
    nodes: int = 0
    edges: int = 0
    features: int = 0
    classes: int = 0
    train: int = 0
    val: int = 0
    test: int = 0
    p_in: float = PAPERS_DIFFICULTY["p_in"]
    out_skew: float = PAPERS_DIFFICULTY["out_skew"]
    in_skew: float = PAPERS_DIFFICULTY["in_skew"]
    feature_noise: float = PAPERS_DIFFICULTY["feature_noise"]
    feature_flip: float = PAPERS_DIFFICULTY["feature_flip"]
    edge_flip: float = PAPERS_DIFFICULTY["edge_flip"]


def papers_like_params(scale: float = 1.0, seed: int = 0) -> PapersParams:
    """PapersParams with every size of :data:`PAPERS_SHAPE` multiplied by ``scale`` (0 < scale <= 1)."""
    if not (math.isfinite(scale) and 0 < scale <= 1):
        raise InputError(f"--scale is {scale}, expected 0 < scale <= 1")
    s = PAPERS_SHAPE
    nodes = max(s["classes"] * 4, int(round(s["nodes"] * scale)))
    sizes = {k: max(1, int(round(s[k] * scale))) for k in ("train", "val", "test")}
    return PapersParams(scale=float(scale), seed=int(seed), nodes=nodes, edges=int(round(s["edges"] * scale)),
                        features=s["features"], classes=s["classes"], **sizes)


def papers_block(rng: np.random.Generator, m: int, citing: _ClassSampler, cited: _ClassSampler, p_in: float):
    """``m`` citation draws: (citing, cited) int64."""
    src_class = citing.classes_by_weight(rng.random(m))
    src = citing.vertices(src_class, rng.random(m))
    dst_class = src_class.copy()
    cross = rng.random(m) >= p_in
    if cross.any():
        dst_class[cross] = cited.other_classes(src_class[cross], rng.random(int(cross.sum())))
    return src, cited.vertices(dst_class, rng.random(m))


def papers_like_source(scale: float = 1.0, seed: int = 0, name: str = "papers-like") -> GraphSource:
    """The papers-like graph (:data:`PAPERS_SHAPE` x ``scale``, :data:`PAPERS_DIFFICULTY` and the
    difficulty stated there) as a :class:`~hpcgnn.data.build.GraphSource`. Every vertex has a
    class (:func:`balanced_classes` of ``seed``); as in ogbn-papers100M only the train/val/test
    vertices are labelled, the rest have label -1."""
    p = papers_like_params(scale, seed)
    n, c = p.nodes, p.classes

    def vertex_data():
        classes = balanced_classes(n, c, p.seed)
        train, val, test = split_masks(n, (p.train, p.val, p.test), p.seed)
        labels = np.where(train | val | test, classes, -1)
        return labels, train, val, test

    def edges():
        profile = profile_classes(balanced_classes(n, c, p.seed), p.edge_flip, p.seed, 1)
        citing = _ClassSampler(profile, c, p.out_skew, p.seed, ranking=2)
        cited = _ClassSampler(profile, c, p.in_skew, p.seed, ranking=3)
        del profile
        for rng, m in edge_blocks(p.edges, p.seed):
            yield papers_block(rng, m, citing, cited, p.p_in)

    def features(rows: int):
        profile = profile_classes(balanced_classes(n, c, p.seed), p.feature_flip, p.seed, 0)
        return class_feature_blocks(profile, p.features, c, p.feature_noise, p.seed, rows)

    meta = {"name": name, "source": {"generator": "papers-like", **asdict(p)}}
    # two samplers' members (16), the edge profile and its set-up's labels, permutation, sort (32)
    return GraphSource(name, n, p.features, c, vertex_data, edges, features, meta=meta, vertex_bytes=48,
                       input_edges=p.edges, where=f"--dataset {name}")
