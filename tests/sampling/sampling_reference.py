"""Plain-Python references for the sampler tests (slow, obviously correct, per-vertex loops).

They restate the documented contracts of native/sampler.cpp: splitmix64 keys and
streams, Lemire's unbiased bounded draw, Floyd's k-subset, first-appearance relabelling.
"""
from __future__ import annotations

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix64(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def combine(key: int, x: int) -> int:
    return mix64(key ^ mix64((x + GOLDEN) & M64))


def mix_key(*parts: int) -> int:
    k = 0x6A09E667F3BCC909
    for p in parts:
        k = combine(k, p & M64)
    return k


class Stream:
    def __init__(self, key: int):
        self.state = key

    def next(self) -> int:
        self.state = (self.state + GOLDEN) & M64
        return mix64(self.state)

    def below(self, n: int) -> int:
        x = self.next()
        m = x * n
        low = m & M64
        if low < n:
            threshold = ((1 << 64) - n) % n
            while low < threshold:
                x = self.next()
                m = x * n
                low = m & M64
        return m >> 64


def floyd(rng: Stream, deg: int, k: int) -> list[int]:
    chosen: list[int] = []
    for j in range(deg - k, deg):
        t = rng.below(j + 1)
        chosen.append(j if t in chosen else t)
    return sorted(chosen)


def sample_reference(indptr, indices, num_solid, fanouts, seed, epoch, step, seeds):
    """(frontiers S_0..S_L, blocks [(indptr, indices)] for l = 0..L-1) as python lists."""
    key = mix_key(seed, epoch, step)
    frontier = [int(s) for s in seeds]
    frontiers = [frontier]
    blocks = []
    for layer in range(len(fanouts) - 1, -1, -1):
        layer_key = combine(key, layer)
        pos = {v: i for i, v in enumerate(frontier)}
        new_frontier = list(frontier)
        b_indptr, b_indices = [0], []
        for v in frontier:
            if v < num_solid:
                row = [int(u) for u in indices[indptr[v]:indptr[v + 1]]]
            else:
                row = []
            f = fanouts[layer]
            if f == -1 or f >= len(row):
                picked = row
            else:
                picked = [row[p] for p in floyd(Stream(combine(layer_key, v)), len(row), f)]
            for u in picked:
                if u not in pos:
                    pos[u] = len(new_frontier)
                    new_frontier.append(u)
                b_indices.append(pos[u])
            b_indptr.append(len(b_indices))
        blocks.append((b_indptr, b_indices))
        frontier = new_frontier
        frontiers.append(frontier)
    return frontiers[::-1], blocks[::-1]
