"""Historical Embedding Cache (DistGNN-MB HEC): one per layer input per rank.

Lines are ``(tag = global vertex ID, embedding row, age)``. Storage is a ring of
``capacity`` slots written at a moving pointer, so replacement is oldest line first (FIFO
by insertion). The tag directory is a native open-addressing hash table (memory
O(capacity), independent of the number of vertices).

Semantics (the reference implementation's, see the DistGNN-MB notes §3.4):

- :meth:`store` handles one received AEP message for this layer: first every line ages by
  one (a global clock advances; an empty message still ages the lines), then the rows are
  written with age 0. Duplicate tags within one call: the last row wins. A tag already
  resident gets a new slot and its old line is invalidated (only the freshest copy is
  found). If a call brings more than ``capacity`` distinct tags, only the last
  ``capacity`` of them (by position of their last occurrence) are kept.
- :meth:`lookup` hits iff the tag is resident and (``never_expire`` or
  ``age <= life_span``). So a line stored by the j-th store call hits for lookups made
  after store calls j .. j+life_span and misses from j+life_span+1 on. Layer 0 (raw
  input features, exact) uses ``never_expire=True``. Expired lines are not removed; they
  miss until the ring overwrites them.
- :meth:`clear` empties the cache (lines, write pointer and clock); statistics are kept
  until :meth:`reset_stats`.

Devices: the directory always lives on the host. Tags may be passed on any device (they
are copied to the CPU); ``lookup`` returns CPU tensors; feature rows live on ``device``
and are moved with index ops (``index_copy_`` / ``index_select``).
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.errors import InputError
from hpcgnn.native import cache as _native


def _tags_numpy(tags) -> np.ndarray:
    if isinstance(tags, torch.Tensor):
        tags = tags.detach().to("cpu")
        if tags.dtype != torch.int64:
            tags = tags.to(torch.int64)
        arr = tags.contiguous().numpy()
    else:
        arr = np.ascontiguousarray(np.asarray(tags), dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"HEC: tags must be 1-D, got shape {arr.shape}")
    return arr


class HistoricalEmbeddingCache:
    """Per-layer cache of remote vertices' embeddings; see the module docstring."""

    def __init__(self, capacity: int, dim: int, life_span: int, never_expire: bool = False,
                 dtype: torch.dtype = torch.float32, device="cpu", hist_bins: int | None = None):
        if int(capacity) < 1:
            raise InputError(f"HEC capacity (cs) must be >= 1, got {capacity}")
        if int(dim) < 1:
            raise InputError(f"HEC embedding dim must be >= 1, got {dim}")
        if int(life_span) < 0:
            raise InputError(f"HEC life_span (ls) must be >= 0, got {life_span}")
        self.dim = int(dim)
        self.never_expire = bool(never_expire)
        # Age histogram: bins 0..B-2 exact, last bin = ages >= B-1.
        bins = int(hist_bins) if hist_bins is not None else max(int(life_span) + 2, 16)
        self._dir = _native.CacheDirectory(int(capacity), int(life_span), self.never_expire, bins)
        self.feat = torch.empty(int(capacity), self.dim, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return int(self._dir.capacity)

    @property
    def life_span(self) -> int:
        return int(self._dir.life_span)

    @property
    def occupancy(self) -> int:
        """Number of valid resident lines (expired but not yet overwritten lines included)."""
        return int(self._dir.occupancy)

    @property
    def clock(self) -> int:
        """Number of store calls since construction or the last :meth:`clear`."""
        return int(self._dir.clock)

    def store(self, tags, rows: torch.Tensor) -> None:
        """Store one received message: ``rows[i]`` ([n, dim]) is the embedding of ``tags[i]``.

        Rows are converted to the cache dtype/device (bitwise when they already match).
        """
        t = _tags_numpy(tags)
        if rows.dim() != 2 or rows.shape[0] != t.shape[0] or rows.shape[1] != self.dim:
            raise ValueError(f"HEC store: rows must be [{t.shape[0]}, {self.dim}], got {tuple(rows.shape)}")
        src_rows, slots = self._dir.store(t)
        if slots.shape[0] == 0:
            return
        data = rows.detach().to(device=self.feat.device, dtype=self.feat.dtype)
        m = int(slots.shape[0])
        if m != data.shape[0]:          # duplicates or capacity cut: keep the chosen rows
            data = data.index_select(0, torch.from_numpy(src_rows).to(self.feat.device))
        # The slots are consecutive ring positions: at most two contiguous copies.
        first = int(slots[0])
        head = min(m, self.capacity - first)
        self.feat[first:first + head].copy_(data[:head])
        if head < m:
            self.feat[:m - head].copy_(data[head:])

    def lookup(self, tags) -> tuple[torch.Tensor, torch.Tensor]:
        """(hit_mask bool [n], slots int64 [n], -1 on a miss), on the CPU. Counts in :meth:`stats`."""
        hit, slots = self._dir.lookup(_tags_numpy(tags))
        return torch.from_numpy(hit), torch.from_numpy(slots)

    def load(self, slots) -> torch.Tensor:
        """Rows [len(slots), dim] of the given slots (from :meth:`lookup` hits), on the cache device."""
        idx = torch.as_tensor(slots, dtype=torch.int64).to(self.feat.device)
        return self.feat.index_select(0, idx)

    def fetch(self, tags) -> tuple[torch.Tensor, torch.Tensor]:
        """(hit_mask [n] on the CPU, rows of the hits in tag order [hits, dim]): lookup + load."""
        hit, slots = self.lookup(tags)
        return hit, self.load(slots[hit])

    def resident(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tags, slots, ages) of the valid lines, oldest first (the FIFO eviction order)."""
        tags, slots, ages = self._dir.contents()
        return torch.from_numpy(tags), torch.from_numpy(slots), torch.from_numpy(ages)

    def stats(self) -> dict:
        """Counters since construction or :meth:`reset_stats`.

        ``lookups``/``hits``/``hit_rate``; ``age_sum``/``age_max``/``age_mean`` and
        ``age_hist`` (last bin = that age or older) over the lines returned as hits;
        ``stores`` (calls), ``received`` (rows passed), ``lines_stored`` (after de-duplication
        and the capacity cut), ``evictions`` (valid lines overwritten by the ring),
        ``replaced`` (old copies invalidated by a re-store); ``occupancy`` (valid lines),
        ``live`` (valid lines a lookup would hit now), ``capacity`` and ``clock`` are the
        current state.
        """
        s = dict(self._dir.stats())
        s["age_hist"] = list(s["age_hist"])
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s["age_mean"] = s["age_sum"] / s["hits"] if s["hits"] else 0.0
        return s

    def reset_stats(self) -> None:
        self._dir.reset_stats()

    def clear(self) -> None:
        """Empty the cache (all lines, write pointer, clock). Feature memory is kept."""
        self._dir.clear()
