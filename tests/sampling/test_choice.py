"""degree_biased_choice (AEP nc cap) and sample_key against a Python reference."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampling_reference import combine, mix_key  # noqa: E402

from hpcgnn.sampling.choice import degree_biased_choice, sample_key  # noqa: E402


def reference_choice(cand, deg, max_count, key, max_degree):
    if len(cand) <= max_count:
        return list(range(len(cand)))
    hil = int(np.floor(np.log2(max_degree))) if max_degree >= 1 else 0
    out = []
    for i, (c, d) in enumerate(zip(cand, deg)):
        r = combine(key, int(c) & ((1 << 64) - 1)) % (1 << hil)
        if r < d and len(out) < max_count:
            out.append(i)
    return out


def test_rng_key_matches_reference_and_differs():
    assert sample_key(1, 2, 3) == mix_key(1, 2, 3)
    assert sample_key(0) == mix_key(0)
    assert len({sample_key(1, 2, 3), sample_key(1, 2, 4), sample_key(1, 3, 3), sample_key(2, 2, 3)}) == 4


def test_choice_matches_reference_and_contract():
    rng = np.random.default_rng(0)
    cand = rng.choice(10**9, 3000, replace=False)
    deg = rng.zipf(1.8, size=3000).clip(1, 5000)
    key = sample_key(7, 1, 2)
    pos = degree_biased_choice(torch.from_numpy(cand), torch.from_numpy(deg), 500, key, max_degree=5000)
    assert pos.dtype == torch.int64
    assert pos.tolist() == reference_choice(cand, deg, 500, key, 5000)
    assert 0 < pos.numel() <= 500
    assert torch.all(pos[1:] > pos[:-1]) and int(pos.max()) < 3000       # subset, candidate order
    again = degree_biased_choice(cand, deg, 500, key, max_degree=5000)
    assert torch.equal(pos, again)                                          # deterministic per key
    other = degree_biased_choice(cand, deg, 500, sample_key(7, 1, 3), max_degree=5000)
    assert not torch.equal(pos, other)
    # degree bias: mean degree of the chosen > mean degree of all candidates
    chosen = deg[pos.numpy()]
    assert chosen.mean() > 1.5 * deg.mean(), (chosen.mean(), deg.mean())
    # default max_degree = degrees.max()
    assert degree_biased_choice(cand, deg, 500, key).tolist() == reference_choice(
        cand, deg, 500, key, int(deg.max()))


def test_choice_acceptance_rate_follows_degree():
    # degrees 1..8 with max_degree 8 -> hil 3 -> keep probability min(d, 8) / 8
    n = 80_000
    cand = np.arange(n, dtype=np.int64)
    deg = (cand % 8) + 1
    pos = degree_biased_choice(cand, deg, n - 1, sample_key(3), max_degree=8).numpy()
    kept = np.bincount(deg[pos], minlength=9)[1:] / (n / 8)
    assert np.allclose(kept, np.arange(1, 9) / 8, atol=0.02), kept


def test_choice_small_and_edge_cases():
    assert degree_biased_choice([5, 6, 7], [1, 1, 1], 3, 1).tolist() == [0, 1, 2]   # no cap needed
    assert degree_biased_choice([5, 6, 7], [1, 1, 1], 0, 1).tolist() == []
    zero = degree_biased_choice([5, 6, 7, 8], [0, 0, 0, 0], 2, 1)                   # nothing accepted
    assert zero.tolist() == []
    with pytest.raises(ValueError):
        degree_biased_choice([1, 2], [1], 1, 1)
    with pytest.raises(ValueError):
        degree_biased_choice([1, 2], [1, 1], -1, 1)
