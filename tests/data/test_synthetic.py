"""R-MAT and SBM generators: determinism, sizes, canonical CSR, homophily, streaming = one shot."""
from __future__ import annotations

import numpy as np
import pytest

import hpcgnn.data.synthetic as synthetic
from hpcgnn.data.clean import build_symmetric_csr
from hpcgnn.data.synthetic import (RmatParams, SbmParams, generate_rmat, generate_sbm, products_like_params,
                                   rmat_block)
from hpcgnn.errors import InputError

ARRAYS = ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask")


def assert_canonical(g):
    g.validate()
    n = g.num_nodes
    rows = np.repeat(np.arange(n), g.degree())
    key = rows * n + g.indices
    assert not np.any(rows == g.indices)                               # no self-loops
    assert np.all(np.diff(key) > 0)                                    # sorted, no duplicates
    np.testing.assert_array_equal(np.sort(g.indices * n + rows), key)  # symmetric


def assert_identical(a, b):
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


SBM = SbmParams(nodes=3000, edges=30000, features=16, classes=5, train=0.2, val=0.1, test=0.3, seed=4)
RMAT = RmatParams(nodes=3000, edges=30000, features=8, classes=3, train=100, val=50, test=500, seed=4, noise=0.1)


@pytest.mark.parametrize("params,gen", [(SBM, generate_sbm), (RMAT, generate_rmat)])
def test_deterministic_sizes_and_canonical(params, gen):
    g = gen(params)
    assert_identical(g, gen(params))
    other = gen(type(params)(**{**params.__dict__, "seed": 5}))
    assert not np.array_equal(g.indices[:100], other.indices[:100])
    assert g.num_nodes == params.nodes and g.num_features == params.features and g.num_classes == params.classes
    counts = synthetic.split_counts(params.nodes, params.train, params.val, params.test)
    assert (g.train_mask.sum(), g.val_mask.sum(), g.test_mask.sum()) == counts
    sizes = np.bincount(g.labels, minlength=params.classes)
    assert sizes.max() - sizes.min() <= 1
    assert_canonical(g)
    removed = g.meta["self_loops_removed"] + g.meta["duplicates_removed"]
    assert g.num_edges + removed == 2 * params.edges                    # every draw accounted for
    assert g.num_edges > 1.4 * params.edges                             # and most survive cleaning


def test_streaming_in_chunks_equals_one_shot(monkeypatch):
    monkeypatch.setattr(synthetic, "EDGE_CHUNK", 7000)
    monkeypatch.setattr(synthetic, "EDGE_BLOCK", 3000)
    blocks = [m for _, m in synthetic.edge_blocks(SBM.edges, SBM.seed)]
    assert sum(blocks) == SBM.edges and blocks[:4] == [3000, 3000, 1000, 3000]
    g = generate_sbm(SBM)
    sampler = synthetic._ClassSampler(g.labels, SBM.classes, SBM.degree_skew, SBM.seed)
    parts = [synthetic.sbm_block(rng, m, sampler, SBM.p_in) for rng, m in synthetic.edge_blocks(SBM.edges, SBM.seed)]
    indptr, indices, stats = build_symmetric_csr(np.concatenate([p[0] for p in parts]),
                                                 np.concatenate([p[1] for p in parts]), SBM.nodes)
    np.testing.assert_array_equal(g.indptr, indptr)
    np.testing.assert_array_equal(g.indices, indices)
    assert g.meta["duplicates_removed"] == stats["duplicates_removed"]


@pytest.mark.parametrize("p_in", [0.3, 0.8])
def test_sbm_homophily_and_degree_skew(p_in):
    params = SbmParams(nodes=20000, edges=100000, features=4, classes=8, p_in=p_in, seed=1)
    g = generate_sbm(params)
    rows = np.repeat(np.arange(g.num_nodes), g.degree())
    intra = float(np.mean(g.labels[rows] == g.labels[g.indices]))
    assert abs(intra - p_in) < 0.02, intra
    deg = g.degree()
    assert deg.max() > 15 * deg.mean()                                   # skewed degrees (hubs)
    uniform = generate_sbm(SbmParams(**{**params.__dict__, "degree_skew": 0.0}))
    assert uniform.degree().max() < 4 * uniform.degree().mean()


def test_sbm_features_carry_the_class():
    g = generate_sbm(SBM)
    centroids = np.stack([g.features[g.labels == c].mean(axis=0) for c in range(SBM.classes)])
    nearest = np.argmin(((g.features[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    acc = float(np.mean(nearest == g.labels))
    assert 0.3 < acc < 0.95, acc                                         # informative, not trivial
    assert abs(float(g.features.std()) - 1.0) < 0.1                      # noise std 1 dominates


def test_rmat_quadrant_probabilities():
    levels = np.tile([0.57, 0.19, 0.19, 0.05], (1, 1))
    src, dst = rmat_block(np.random.default_rng(0), 200_000, 1, levels)
    freq = np.bincount(src * 2 + dst, minlength=4) / src.size
    np.testing.assert_allclose(freq, [0.57, 0.19, 0.19, 0.05], atol=0.005)
    g = generate_rmat(RmatParams(nodes=4096, edges=40000, features=2, classes=2, seed=0))
    deg = np.sort(g.degree())[::-1]
    assert deg[0] > 20 * deg.mean()                                      # power-law head


def test_products_like_shape():
    full = products_like_params()
    assert (full.nodes, full.edges, full.features, full.classes) == (2_449_029, 61_859_140, 100, 47)
    assert (full.train, full.val, full.test) == (196_615, 39_323, 2_213_091)
    small = products_like_params(scale=0.002, seed=3)
    g = generate_sbm(small, name="products-like")
    assert g.num_nodes == round(2_449_029 * 0.002) and g.num_features == 100 and g.num_classes == 47
    assert int(g.train_mask.sum()) == round(196_615 * 0.002) and int(g.val_mask.sum()) == round(39_323 * 0.002)
    assert int((g.train_mask | g.val_mask | g.test_mask).sum()) == g.num_nodes
    assert_canonical(g)


@pytest.mark.parametrize("kw,msg", [
    (dict(nodes=0), "--nodes is 0"), (dict(classes=11, nodes=10), "--classes is 11"),
    (dict(p_in=1.5), "--p-in is 1.5"), (dict(degree_skew=1.0), "--degree-skew is 1.0"),
    (dict(train=0.7, val=0.5), r"select 20000 vertices, more than --nodes \(10000\)"),
    (dict(train=1.5), "--train is 1.5, expected a fraction"),
    (dict(feature_flip=-0.1), r"--feature-flip is -0.1, expected a fraction in \[0, 1\]"),
    (dict(edge_flip=float("nan")), r"--edge-flip is nan, expected a fraction in \[0, 1\]"),
])
def test_bad_parameters(kw, msg):
    with pytest.raises(InputError, match=msg):
        generate_sbm(SbmParams(**{**dict(nodes=10000, edges=10, features=2, classes=2), **kw}))


def test_flips_keep_class_sizes_and_move_the_requested_fraction():
    labels = synthetic.balanced_classes(20000, 10, seed=2)
    assert synthetic.profile_classes(labels, 0.0, seed=2, stream=0) is labels       # no flip: no draws
    feat = synthetic.profile_classes(labels, 0.3, seed=2, stream=0)
    np.testing.assert_array_equal(feat, synthetic.profile_classes(labels, 0.3, seed=2, stream=0))
    np.testing.assert_array_equal(np.bincount(feat, minlength=10), np.bincount(labels, minlength=10))
    assert abs(float(np.mean(feat != labels)) - 0.3 * 0.9) < 0.01                   # 1/C keep their class
    edge = synthetic.profile_classes(labels, 0.3, seed=2, stream=1)
    assert abs(float(np.mean(edge != feat)) - (1 - (1 - 0.27) ** 2 - 0.27 ** 2 / 9)) < 0.015  # independent


def test_sbm_flips_move_features_and_edges_off_the_label():
    base = dict(nodes=20000, edges=100000, features=16, classes=8, p_in=0.8, feature_noise=0.3, seed=1)
    clean = generate_sbm(SbmParams(**base))
    assert_identical(clean, generate_sbm(SbmParams(**base, feature_flip=0.0, edge_flip=0.0)))
    g = generate_sbm(SbmParams(**base, feature_flip=0.4, edge_flip=0.25))
    np.testing.assert_array_equal(g.labels, clean.labels)

    def nearest_centroid(graph):
        centroids = np.stack([graph.features[graph.labels == c].mean(axis=0) for c in range(8)])
        return float(np.mean(np.argmin(((graph.features[:, None] - centroids[None]) ** 2).sum(-1), 1) == graph.labels))

    assert nearest_centroid(clean) > 0.98
    assert abs(nearest_centroid(g) - (0.6 + 0.4 / 8)) < 0.02                      # flipped rows follow another class
    rows = np.repeat(np.arange(g.num_nodes), g.degree())
    intra = float(np.mean(g.labels[rows] == g.labels[g.indices]))
    q = 0.25 * 7 / 8                                                               # flipped to another class
    assert abs(intra - (0.8 * ((1 - q) ** 2 + q ** 2 / 7) + 0.2 * (2 * q * (1 - q) / 7 + q * q * 6 / 49))) < 0.02


def test_products_like_defaults_are_the_hard_preset_and_easy_is_reachable():
    p = products_like_params(scale=0.01)
    assert (p.feature_flip, p.edge_flip, p.feature_noise, p.p_in) == (0.36, 0.19, 0.3, 0.6)
    easy = products_like_params(scale=0.01, feature_noise=1.0, feature_flip=0.0, edge_flip=0.0, p_in=0.7)
    assert (easy.feature_flip, easy.edge_flip, easy.feature_noise, easy.p_in, easy.degree_skew) == (0, 0, 1, 0.7, 0.6)
