"""The store interface (XGNN's Global GNN Memory Store on one rank), in the spirit of PyG's
FeatureStore / GraphStore.

A :class:`FeatureStore` holds a rank's vertex feature rows ``[num_rows, dim]`` over two tiers,
the *device* tier (fast memory of the compute device) and the *host* tier (pinned host memory on
a GPU machine). ``gather(ids)`` returns the rows of local ids on :attr:`FeatureStore.device`;
ids ``>= num_rows`` (a partition's halo vertices, which have no feature row here) give zero rows
and are not counted. A gather is split in two so that the slow part can overlap compute
(:mod:`hpcgnn.store.prefetch`):

* :meth:`FeatureStore.plan` (cheap, main thread): which rows are device hits, which host misses;
* :meth:`FeatureStore.read_misses` (any thread): the host rows of the misses, moved towards the
  device (on a GPU: a pinned staging buffer and a copy on a side stream);
* :meth:`FeatureStore.assemble` (main thread): the device hits plus the moved misses in id order.

``gather(ids) == assemble(plan(ids), read_misses(plan(ids)))`` bit for bit, in any tier layout:
training through any store gives the same numbers.

Rows are held in the dtype the partition store keeps them in (:attr:`FeatureStore.dtype`:
float32, float16 or bfloat16; both tiers, and the bytes that cross host -> device) and are
cast to :attr:`FeatureStore.compute_dtype` (float32) after the gather, on the device: every
gathered row (``gather``, ``assemble``, ``gather_all``) is float32, while :meth:`full_rows`
returns the rows as held (its callers cast the chunks they compute on). The cast is exact
(every float16 and bfloat16 value is a float32 value).

A :class:`GraphStore` holds the in-edge CSR of the rank's solid vertices (local source ids):
``neighbors(ids)`` (counts and concatenated neighbour ids), ``degree(ids)`` and ``csr()``, the
arrays the native sampler reads in place.

Counters (:class:`StoreCounters`, per data type ``feature`` / ``hec`` / ``topology`` /
``blocks``): rows looked up, rows served by the device tier, bytes that crossed host->device,
and the seconds the training loop waited on the store. On a CPU-only machine the device tier is
a separately budgeted host buffer: the same logic runs and the counters say what would cross
the link on a GPU.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

KINDS = ("feature", "hec", "topology", "blocks")


def feature_tensor(features) -> torch.Tensor:
    """Feature rows as a tensor of their stored dtype, sharing ``features``' memory (a memory
    map stays one): a tensor as it is; a float32 or float16 numpy array as that dtype; a uint16
    array holds bfloat16 bit patterns (the partition store's encoding of bfloat16,
    :mod:`hpcgnn.data.features`) and is viewed as ``torch.bfloat16``."""
    if isinstance(features, torch.Tensor):
        return features
    a = np.asarray(features)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    if a.dtype not in (np.float32, np.float16, np.uint16):
        raise TypeError(f"feature rows: dtype {a.dtype}, expected float32, float16 or uint16 (bfloat16 bits)")
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if a.dtype == np.uint16 else t


@dataclass
class TierCounters:
    """One data type's counters: ``lookups`` rows asked for, ``device_hits`` rows served by the
    device tier, ``h2d_bytes`` bytes moved host -> device."""

    lookups: int = 0
    device_hits: int = 0
    h2d_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.device_hits / self.lookups if self.lookups else float("nan")


@dataclass
class StoreCounters:
    """Counters of one epoch (reset by the engine at every epoch start)."""

    kinds: dict = field(default_factory=lambda: {k: TierCounters() for k in KINDS})
    wait_seconds: float = 0.0       # training loop blocked on the store (gathers not hidden)

    def __getitem__(self, kind: str) -> TierCounters:
        return self.kinds[kind]

    @property
    def h2d_bytes(self) -> int:
        return int(sum(c.h2d_bytes for c in self.kinds.values()))

    def as_dict(self) -> dict:
        """Flat ``store_*`` counters for the run file (see docs/store.md)."""
        out = {"store_h2d_bytes": self.h2d_bytes}
        for k, c in self.kinds.items():
            out[f"store_{k}_lookups"] = c.lookups
            out[f"store_{k}_device_hits"] = c.device_hits
            out[f"store_{k}_h2d_bytes"] = c.h2d_bytes
        return out


@dataclass
class GatherPlan:
    """Where the rows of one ``gather(ids)`` come from (all int64 CPU tensors).

    ``num``: len(ids); ``hit_pos`` / ``hit_slots``: output positions served by the device tier
    and their rows in it; ``miss_pos`` / ``miss_ids``: output positions read from the host tier
    and their row ids; ``zero_pos``: positions of ids >= num_rows (zero rows)."""

    num: int
    hit_pos: torch.Tensor
    hit_slots: torch.Tensor
    miss_pos: torch.Tensor
    miss_ids: torch.Tensor
    zero_pos: torch.Tensor
    ids: torch.Tensor | None = None   # the ids themselves (host-only fast path)


class FeatureStore(ABC):
    """Feature rows of one rank over a device and a host tier (see the module docstring)."""

    name = "abstract"
    num_rows: int
    dim: int
    dtype: torch.dtype                      # the rows as held (the partition store's dtype)
    compute_dtype = torch.float32           # every gathered row (see the module docstring)
    device: torch.device
    reads_on_thread = True   # read_misses does work worth a gather thread (prefetch.Prefetcher)

    def __init__(self):
        self.counters = StoreCounters()

    @abstractmethod
    def plan(self, ids: torch.Tensor) -> GatherPlan:
        """Split local ids (int64, CPU) into device hits, host misses and zero rows; counts them."""

    @abstractmethod
    def read_misses(self, plan: GatherPlan):
        """The host rows of ``plan``'s misses on their way to the device (thread-safe)."""

    @abstractmethod
    def assemble(self, plan: GatherPlan, misses) -> torch.Tensor:
        """Rows [plan.num, dim] on :attr:`device` in id order: device hits plus ``misses``."""

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of local ``ids`` on :attr:`device` in :attr:`compute_dtype` (zeros for ids >=
        num_rows), synchronously."""
        p = self.plan(ids)
        return self.assemble(p, self.read_misses(p))

    def gather_all(self) -> torch.Tensor:
        """All rows in id order in :attr:`compute_dtype`, counted as ``gather(arange(num_rows))``.
        A store whose rows already live on :attr:`device` in that order (host-only on the CPU,
        device-only) returns them without a copy when they are held in the compute dtype (cast
        on the device otherwise): callers must not modify the result in place. Full-pass engines
        read their solid rows this way (no second copy of float32 features per pass)."""
        if self.rows_on_device_in_order():
            self._count_features(self.device_rows, self.num_rows - self.device_rows)
            return self.full_rows().to(self.compute_dtype)
        return self.gather(torch.arange(self.num_rows, dtype=torch.int64))

    def rows_on_device_in_order(self) -> bool:
        """Whether :meth:`full_rows` is every row, in id order, on :attr:`device`."""
        return False

    @abstractmethod
    def full_rows(self) -> torch.Tensor:
        """All rows [num_rows, dim] as held (:attr:`dtype`: the host tier, or the device tier
        when it holds them all), without a copy; for layer-wise evaluation, which casts the
        chunks it computes on."""

    @property
    def device_rows(self) -> int:
        """Rows held by the device tier."""
        return 0

    @property
    def device_bytes(self) -> int:
        """Bytes of the device tier (rows and lookup table)."""
        return 0

    def reset_counters(self) -> None:
        self.counters = StoreCounters()

    def _count_features(self, hits: int, misses: int) -> None:
        c = self.counters["feature"]
        c.lookups += hits + misses
        c.device_hits += hits
        c.h2d_bytes += misses * self.dim * torch.empty(0, dtype=self.dtype).element_size()


class GraphStore(ABC):
    """In-edge CSR of the rank's solid vertices (local source ids; see the module docstring)."""

    name = "abstract"

    @abstractmethod
    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """(indptr int64 [num_solid + 1], indices int64 [E]), used in place by the sampler."""

    @property
    @abstractmethod
    def num_solid(self) -> int:
        ...

    @property
    @abstractmethod
    def num_local(self) -> int:
        ...

    def degree(self, ids) -> np.ndarray:
        """In-degree (edges stored here) of solid local ids."""
        ip, _ = self.csr()
        ids = np.asarray(ids, dtype=np.int64)
        return ip[ids + 1] - ip[ids]

    def neighbors(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(counts [n], concatenated in-neighbour local ids) of solid local ids, vectorised."""
        from hpcgnn.comm.exact_fetch import gather_segments

        ip, ix = self.csr()
        return gather_segments(ip, ix, np.asarray(ids, dtype=np.int64))
