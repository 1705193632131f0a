"""The products-like preset is about as hard as ogbn-products: neighbourhoods add >= 15 points.

OGB leaderboard, ogbn-products: MLP on features ~61 %, GraphSAGE ~78-79 %. A feature-only
MLP and full-neighbour GraphSAGE (hpcgnn.nn's SAGE layers) are trained here, in process, on
a small products-like graph (scale 0.01: 24.5k vertices, 1.97k training vertices). At this
size the MLP has fewer training rows than at the benchmarks' scale 0.04 (measured there:
MLP 60.2 %, SAGE 78.2 %; README.md "Pipeline"), so it sits a few points lower. Measured
here: gap 18.2 points at seed 0, 18.3 at seed 1 (MLP 55.1 / 54.7 %, SAGE 73.3 / 73.1 %), the
same with 1 or 2 torch threads; 10-35 s on the 2-core development VM, by its other load.
"""
from __future__ import annotations

import pytest

from benchmarks.baselines import mlp_vs_sage
from hpcgnn.data.synthetic import generate_sbm, products_like_params

pytestmark = pytest.mark.slow   # trains an MLP and GraphSAGE on a 60k-vertex graph


def test_mlp_is_15_points_below_full_neighbour_sage():
    graph = generate_sbm(products_like_params(scale=0.01, seed=0))
    res = mlp_vs_sage(graph, hidden=128, layers=2, epochs=60, seed=0)
    mlp, sage = res["mlp"].test, res["sage"].test
    assert sage - mlp >= 0.15, (mlp, sage)
    assert 0.45 <= mlp <= 0.66, mlp      # features alone: at most the 64.8 % whose features follow the label
    assert 0.65 <= sage <= 0.83, sage    # not saturated: 19 % of vertices have edges of another class
