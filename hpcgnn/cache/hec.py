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

Memory: the ring has ``capacity`` slots (the directory costs O(capacity) host memory, about
40 bytes a slot), but embedding rows are stored only for valid lines: every slot maps to a
storage row, rows of evicted or replaced lines are reused, and the row array grows (doubling)
as lines arrive, up to ``max_rows`` (default ``capacity``). Valid lines never exceed the number
of distinct tags that can arrive, so a cache fed only with the rank's halo vertices is built
with ``max_rows = min(cs, halo vertices)``: its rows never exceed that, however large ``cs``
is; storing more distinct tags than ``max_rows`` raises ValueError. Lookup returns storage rows
(what :meth:`load` reads); :meth:`resident` reports ring slots.

Devices: the directory always lives on the host. Tags may be passed on any device (they
are copied to the CPU); ``lookup`` returns CPU tensors; feature rows live on ``device``
and are moved with index ops (``index_copy_`` / ``index_select``).
"""
from __future__ import annotations

import numpy as np
import torch

from hpcgnn.errors import InputError
from hpcgnn.native import cache as _native
from hpcgnn.upload import upload


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

    INITIAL_ROWS = 1024

    def __init__(self, capacity: int, dim: int, life_span: int, never_expire: bool = False,
                 dtype: torch.dtype = torch.float32, device="cpu", hist_bins: int | None = None,
                 max_rows: int | None = None):
        if int(capacity) < 1:
            raise InputError(f"HEC capacity (cs) must be >= 1, got {capacity}")
        if int(dim) < 1:
            raise InputError(f"HEC embedding dim must be >= 1, got {dim}")
        if int(life_span) < 0:
            raise InputError(f"HEC life_span (ls) must be >= 0, got {life_span}")
        if max_rows is not None and int(max_rows) < 1:
            raise InputError(f"HEC max_rows must be >= 1, got {max_rows}")
        self.dim = int(dim)
        self.never_expire = bool(never_expire)
        # Age histogram: bins 0..B-2 exact, last bin = ages >= B-1.
        bins = int(hist_bins) if hist_bins is not None else max(int(life_span) + 2, 16)
        self._dir = _native.CacheDirectory(int(capacity), int(life_span), self.never_expire, bins,
                                           int(max_rows or 0))
        self.feat = torch.empty(min(self.INITIAL_ROWS, self.max_rows), self.dim, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return int(self._dir.capacity)

    @property
    def max_rows(self) -> int:
        """Most embedding rows the cache will ever hold (``min(capacity, max_rows)``)."""
        return int(self._dir.max_rows)

    @property
    def rows_allocated(self) -> int:
        """Embedding rows allocated now (grows with the lines stored, up to :attr:`max_rows`)."""
        return int(self.feat.shape[0])

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
        try:
            src_rows, _, where = self._dir.store(t)
        except ValueError as exc:
            raise ValueError(f"HEC store: {exc}") from None
        m = int(where.shape[0])
        if m == 0:
            return
        self._reserve(self._dir.rows_used)
        data = upload(rows.detach(), self.feat.device).to(self.feat.dtype)
        if m != data.shape[0]:          # duplicates or capacity cut: keep the chosen rows
            data = data.index_select(0, upload(torch.from_numpy(src_rows), self.feat.device))
        first = int(where[0])
        if int(where[-1]) - first == m - 1 and (m == 1 or bool(np.all(np.diff(where) == 1))):
            self.feat[first:first + m].copy_(data)      # new rows, in order: one contiguous copy
        else:
            self.feat.index_copy_(0, upload(torch.from_numpy(where), self.feat.device), data)

    def _reserve(self, rows: int) -> None:
        """Grow the row array (doubling, at most :attr:`max_rows`) to hold ``rows`` rows."""
        have = self.feat.shape[0]
        if rows <= have:
            return
        new = min(self.max_rows, max(rows, 2 * have))
        grown = torch.empty(new, self.dim, dtype=self.feat.dtype, device=self.feat.device)
        grown[:have].copy_(self.feat)
        self.feat = grown

    def lookup(self, tags) -> tuple[torch.Tensor, torch.Tensor]:
        """(hit_mask bool [n], storage rows int64 [n], -1 on a miss), on the CPU; the rows are what
        :meth:`load` reads. Counts in :meth:`stats`."""
        hit, slots = self._dir.lookup(_tags_numpy(tags))
        return torch.from_numpy(hit), torch.from_numpy(slots)

    def load(self, slots) -> torch.Tensor:
        """Embeddings [len(slots), dim] of the given storage rows (from :meth:`lookup` hits), on the
        cache device."""
        idx = upload(torch.as_tensor(slots, dtype=torch.int64), self.feat.device)
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
        current state; ``max_rows`` / ``rows_used`` / ``rows_allocated``: the bound on embedding
        rows, the rows handed out since the last :meth:`clear`, and the rows allocated.
        """
        s = dict(self._dir.stats())
        s["age_hist"] = list(s["age_hist"])
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s["age_mean"] = s["age_sum"] / s["hits"] if s["hits"] else 0.0
        s["rows_allocated"] = self.rows_allocated
        return s

    def reset_stats(self) -> None:
        self._dir.reset_stats()

    def clear(self) -> None:
        """Empty the cache (all lines, write pointer, clock). The allocated rows are kept."""
        self._dir.clear()
