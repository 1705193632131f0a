"""Counter-based random keys and DistGNN-MB's degree-biased choice (AEP ``nc`` cap)."""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.native import sampler as _native


def sample_key(*parts: int) -> int:
    """64-bit key from integers (e.g. ``sample_key(seed, epoch, step, layer, dest)``), splitmix64 chain.

    Equal parts give equal keys on every machine and thread count; any change of a part
    gives an unrelated key.
    """
    return int(_native.mix_key([int(p) for p in parts]))


def _as_int64_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu")
        return np.ascontiguousarray(x.numpy(), dtype=np.int64)
    return np.ascontiguousarray(np.asarray(x), dtype=np.int64)


def degree_biased_choice(candidates, degrees, max_count: int, rng_key: int,
                         max_degree: int | None = None) -> torch.Tensor:
    """Positions (int64, increasing) of the candidates kept by DistGNN-MB's degree-biased cap.

    If ``len(candidates) <= max_count`` every position is returned (the paper samples only
    when there are more than ``nc`` candidates). Otherwise, with
    ``hil = floor(log2(max_degree))`` (``max_degree`` defaults to ``degrees.max()``; pass
    the all-reduced global maximum to match the paper), candidate ``i`` draws
    ``r = hash(rng_key, candidates[i]) mod 2**hil`` and is accepted iff ``r < degrees[i]``;
    the first ``max_count`` accepted candidates (in candidate order) are returned, possibly
    fewer. The draw depends only on the key and the candidate's value, so the result is
    a deterministic function of ``(candidates, degrees, max_count, rng_key, max_degree)``.
    Use ``candidates[positions]`` for the chosen IDs.
    """
    cand = _as_int64_numpy(candidates)
    deg = _as_int64_numpy(degrees)
    if cand.ndim != 1 or deg.shape != cand.shape:
        raise ValueError(f"degree_biased_choice: candidates {cand.shape} and degrees {deg.shape} "
                         "must be 1-D of equal length")
    if max_count < 0:
        raise ValueError(f"degree_biased_choice: max_count must be >= 0, got {max_count}")
    n = cand.shape[0]
    if n <= max_count:
        return torch.arange(n, dtype=torch.int64)
    top = int(deg.max()) if max_degree is None else int(max_degree)
    hil = int(top).bit_length() - 1 if top >= 1 else 0   # floor(log2(top)); 0 when top < 1
    key = int(rng_key) & 0xFFFFFFFFFFFFFFFF
    return torch.from_numpy(_native.degree_biased_choice(cand, deg, int(max_count), key, hil))
