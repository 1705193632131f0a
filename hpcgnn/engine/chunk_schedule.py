"""HongTu chunking, chunk scheduling and the deduplicated transfer plan (one rank).

A rank's partition is split into **chunks**: contiguous ranges of solid
(destination) vertices balanced by ``in-edges + 1`` (Gemini's range rule with
the self row counted), each holding *all* in-edges of its destinations, so a
full-neighbour aggregation (GAT's softmax included) stays inside one chunk.
Chunk sources are local vertex IDs (solid then halo, as in
:class:`hpcgnn.partition.store.Partition`), destinations first.

Chunks are grouped into **batches** of ``batch_chunks`` chunks that are on the
device together, and batches are ordered (HongTu Alg. 4, on one device):
phase 1 groups chunks with the largest source overlap into a batch, phase 2
orders batches as a greedy nearest-neighbour path maximising the overlap of
consecutive batch unions. The volumes of HongTu's Eq. 4, in rows per layer:

* ``v_ori``    = sum over chunks of |N_c|        (no deduplication)
* ``v_batch``  = sum over batches of |U_b|       (one copy per batch)
* ``v_reuse``  = |U_0| + sum |U_b minus U_(b-1)|  (rows kept on the device reused)

:func:`choose_schedule` evaluates Eq. 4 for the greedy and the natural order
and keeps the cheaper. :class:`TransferPlan` assigns device-buffer slots so a
row shared by consecutive batches keeps its slot (reused in place).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hpcgnn.ids import unique_ids

# Default Eq. 4 throughputs (bytes/s): host->device over PCIe 4.0 x16, and
# device-local gathers (the "D2D" and "reuse" terms on one device).
T_HOST_TO_DEVICE = 25e9
T_DEVICE = 1000e9


@dataclass
class Chunk:
    """One chunk: destinations ``[dst_begin, dst_end)`` (local solid IDs) and all their in-edges.

    src      int64 [num_src]      local vertex IDs; ``src[:num_dst] == arange(dst_begin, dst_end)``
    indptr   int64 [num_dst + 1]  CSR over destinations
    indices  int64 [num_edges]    positions into ``src`` of each in-edge's source
    """

    index: int
    dst_begin: int
    dst_end: int
    src: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray

    @property
    def num_dst(self) -> int:
        return self.dst_end - self.dst_begin

    @property
    def num_src(self) -> int:
        return int(self.src.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])


def chunk_bounds(indptr: np.ndarray, num_chunks: int) -> np.ndarray:
    """Boundaries [n+1] of at most ``num_chunks`` non-empty destination ranges.

    Split points balance ``in-degree + 1`` per range (the +1 is the self row).
    Fewer ranges come back when there are fewer destinations than chunks.
    """
    n = int(indptr.shape[0] - 1)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    k = max(1, min(int(num_chunks), n))
    weight = np.diff(indptr).astype(np.float64) + 1.0
    cum = np.concatenate([[0.0], np.cumsum(weight)])
    targets = cum[-1] * np.arange(1, k, dtype=np.float64) / k
    cuts = np.searchsorted(cum, targets, side="left")
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, n - 1) if n > 1 else [], [n]]).astype(np.int64))
    return bounds


def build_chunks(indptr: np.ndarray, local_indices: np.ndarray, bounds: np.ndarray) -> list[Chunk]:
    """Chunks for the ranges ``bounds`` of a local in-edge CSR (sources = local IDs)."""
    chunks = []
    n = int(indptr[int(bounds[-1])]) if bounds.shape[0] else 0
    v = int(np.max(local_indices[:n])) + 1 if n else 0
    slot = np.empty(v, dtype=np.int64)     # a source's position among a chunk's others
    for c in range(bounds.shape[0] - 1):
        b, e = int(bounds[c]), int(bounds[c + 1])
        lo, hi = int(indptr[b]), int(indptr[e])
        edges = np.asarray(local_indices[lo:hi], dtype=np.int64)
        inside = (edges >= b) & (edges < e)
        outside = edges[~inside]
        others = unique_ids(outside, v)
        src = np.concatenate([np.arange(b, e, dtype=np.int64), others])
        pos = np.empty_like(edges)
        pos[inside] = edges[inside] - b
        slot[others] = np.arange(e - b, e - b + others.shape[0], dtype=np.int64)
        pos[~inside] = slot[outside]
        chunks.append(Chunk(index=c, dst_begin=b, dst_end=e, src=src,
                            indptr=np.asarray(indptr[b:e + 1], dtype=np.int64) - lo, indices=pos))
    return chunks


def make_chunks(indptr: np.ndarray, local_indices: np.ndarray, num_chunks: int) -> list[Chunk]:
    """Split a local in-edge CSR into ``num_chunks`` edge-balanced chunks."""
    return build_chunks(indptr, local_indices, chunk_bounds(indptr, num_chunks))


# ---- schedules -------------------------------------------------------------

@dataclass
class Schedule:
    """Chunk IDs per batch, in execution order; ``method`` is 'natural' or 'greedy'."""

    batches: list[list[int]]
    method: str

    def order(self) -> list[int]:
        return [c for batch in self.batches for c in batch]


def natural_schedule(num_chunks: int, batch_chunks: int) -> Schedule:
    """Chunks 0..n-1 in order, ``batch_chunks`` consecutive chunks per batch."""
    b = max(1, int(batch_chunks))
    return Schedule([list(range(s, min(s + b, num_chunks))) for s in range(0, num_chunks, b)], "natural")


def _overlap_counts(mask: np.ndarray, flat: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """|N_a ∩ mask| for every chunk a (flat: concatenated non-empty source lists, starts: the
    offset of each list in it)."""
    return np.add.reduceat(mask[flat], starts, dtype=np.int64)


def _offsets(lists: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([a.shape[0] for a in lists[:-1]])]).astype(np.int64)


def greedy_schedule(chunks: list[Chunk], batch_chunks: int, num_vertices: int) -> Schedule:
    """HongTu Alg. 4 on one device: group by overlap (phase 1), order batches (phase 2).

    Memory beyond the chunks: a mask per vertex and one concatenation of the source lists (of
    the chunks in phase 1, of the batch unions in phase 2; with one chunk a batch the unions
    are the chunks' own lists, and phase 1 has nothing to group)."""
    n = len(chunks)
    if n == 0:
        return Schedule([], "greedy")
    b = max(1, int(batch_chunks))
    mask = np.zeros(num_vertices, dtype=bool)
    if b == 1:
        groups = [[c] for c in range(n)]
        unions = [c.src for c in chunks]               # distinct already; order is not needed
    else:
        flat = np.concatenate([c.src for c in chunks])
        starts = _offsets([c.src for c in chunks])
        # phase 1: seed each batch with the first free chunk, add the chunks sharing most sources
        free = np.ones(n, dtype=bool)
        groups = []
        while free.any():
            seed = int(np.argmax(free))
            group = [seed]
            free[seed] = False
            mask[:] = False
            mask[chunks[seed].src] = True
            while len(group) < b and free.any():
                counts = _overlap_counts(mask, flat, starts)
                counts[~free] = -1
                best = int(np.argmax(counts))
                group.append(best)
                free[best] = False
                mask[chunks[best].src] = True
            groups.append(sorted(group))
        del flat
        unions = [unique_ids(np.concatenate([chunks[c].src for c in g])) for g in groups]
    # phase 2: batch 0 stays first; next = the batch sharing most sources with the last placed
    g = len(groups)
    uflat = np.concatenate(unions)
    ustarts = _offsets(unions)
    placed = np.zeros(g, dtype=bool)
    order = [0]
    placed[0] = True
    for _ in range(1, g):
        mask[:] = False
        mask[unions[order[-1]]] = True
        counts = _overlap_counts(mask, uflat, ustarts)
        counts[placed] = -1
        nxt = int(np.argmax(counts))
        order.append(nxt)
        placed[nxt] = True
    return Schedule([groups[i] for i in order], "greedy")


@dataclass
class Volumes:
    """Eq. 4 volumes of a schedule, in rows per layer pass (see the module docstring)."""

    v_ori: int
    v_batch: int
    v_reuse: int

    def cost(self, row_bytes: int, t_hd: float = T_HOST_TO_DEVICE, t_dev: float = T_DEVICE) -> float:
        """Eq. 4 time (s): host rows at ``t_hd``, batch-shared and reused rows at ``t_dev``."""
        return row_bytes * (self.v_reuse / t_hd + (self.v_ori - self.v_batch) / t_dev
                            + (self.v_batch - self.v_reuse) / t_dev)


def batch_unions(chunks: list[Chunk], schedule: Schedule) -> list[np.ndarray]:
    """Sorted union of the source sets of each batch."""
    return [unique_ids(np.concatenate([chunks[c].src for c in batch])) if batch
            else np.zeros(0, np.int64) for batch in schedule.batches]


def schedule_volumes(chunks: list[Chunk], schedule: Schedule) -> Volumes:
    """V_ori, V_batch and V_reuse of ``schedule`` (rows per layer pass)."""
    unions = batch_unions(chunks, schedule)
    v_ori = sum(c.num_src for c in chunks)
    v_batch = sum(u.shape[0] for u in unions)
    v_reuse = unions[0].shape[0] if unions else 0
    for prev, cur in zip(unions[:-1], unions[1:]):
        v_reuse += cur.shape[0] - np.intersect1d(prev, cur, assume_unique=True).shape[0]
    return Volumes(int(v_ori), int(v_batch), int(v_reuse))


def choose_schedule(chunks: list[Chunk], batch_chunks: int, order: str, num_vertices: int,
                    row_bytes: int = 4) -> tuple[Schedule, dict]:
    """The schedule to run and the volumes of the candidates considered.

    ``order='natural'`` keeps chunk order; ``'cost'`` builds the greedy schedule
    and keeps it only when its Eq. 4 cost is lower than the natural order's (ties:
    the smaller total batch size, i.e. smaller device buffers).
    Returns ``(schedule, {'natural': Volumes, 'greedy': Volumes?})``.
    """
    natural = natural_schedule(len(chunks), batch_chunks)
    volumes = {"natural": schedule_volumes(chunks, natural)}
    if order == "natural" or len(chunks) <= 1:
        return natural, volumes
    greedy = greedy_schedule(chunks, batch_chunks, num_vertices)
    volumes["greedy"] = schedule_volumes(chunks, greedy)
    key = {k: (v.cost(row_bytes), v.v_batch) for k, v in volumes.items()}
    if key["greedy"] < key["natural"]:
        return greedy, volumes
    return natural, volumes


# ---- the deduplicated transfer plan ------------------------------------------

@dataclass
class TransferUnit:
    """Chunks that share one device-buffer fill.

    vertices     sorted local IDs resident in the buffer while the unit runs (U_b)
    slots        buffer slot of each of ``vertices``
    enter        indices into ``vertices`` of rows not resident in the previous unit
                 (forward: loaded from the host; backward: flushed after the unit)
    leave        indices into ``vertices`` of rows not resident in the next unit
                 (forward: dropped; backward: loaded / zeroed before the unit)
    chunk_slots  per chunk of the unit: buffer slot of every entry of ``chunk.src``
    """

    chunks: list[int]
    vertices: np.ndarray
    slots: np.ndarray
    enter: np.ndarray
    leave: np.ndarray
    chunk_slots: list[np.ndarray] = field(default_factory=list)


@dataclass
class TransferPlan:
    """Buffer slots for every unit; ``capacity`` = rows of the device buffer.

    With ``dedup`` the units are the schedule's batches and rows shared by
    consecutive batches stay in their slots; without it every chunk is its own
    unit and loads its whole source set (the DeepSpeed-style baseline).
    """

    units: list[TransferUnit]
    capacity: int
    dedup: bool

    def rows_loaded(self) -> int:
        """Host->device rows per layer pass (= V_reuse with dedup, V_ori without)."""
        return int(sum(u.enter.shape[0] for u in self.units))


def build_transfer_plan(chunks: list[Chunk], schedule: Schedule, num_vertices: int,
                        dedup: bool = True) -> TransferPlan:
    """Assign buffer slots: rows shared by consecutive units keep their slot (vectorised)."""
    if dedup:
        groups = [list(b) for b in schedule.batches if b]
    else:
        groups = [[c] for c in schedule.order()]
    sets = [unique_ids(np.concatenate([chunks[c].src for c in g]), num_vertices) for g in groups]
    capacity = max((s.shape[0] for s in sets), default=0)
    slot_of = np.full(num_vertices, -1, dtype=np.int64)
    occupied = np.zeros(capacity, dtype=bool)
    units: list[TransferUnit] = []
    prev = None
    for g, verts in zip(groups, sets):
        if prev is not None:
            leaving = np.setdiff1d(prev, verts, assume_unique=True) if dedup else prev
            occupied[slot_of[leaving]] = False
            slot_of[leaving] = -1
        cur = slot_of[verts]
        enter = np.flatnonzero(cur < 0)
        free = np.flatnonzero(~occupied)[:enter.shape[0]]
        slot_of[verts[enter]] = free
        occupied[free] = True
        slots = slot_of[verts]
        chunk_slots = [slots[np.searchsorted(verts, chunks[c].src)] for c in g]
        units.append(TransferUnit(chunks=g, vertices=verts, slots=slots, enter=enter,
                                  leave=np.zeros(0, np.int64), chunk_slots=chunk_slots))
        prev = verts
    for u, nxt in zip(units, units[1:] + [None]):
        if nxt is None or not dedup:
            u.leave = np.arange(u.vertices.shape[0], dtype=np.int64)
        else:
            u.leave = np.flatnonzero(~np.isin(u.vertices, nxt.vertices, assume_unique=True))
    return TransferPlan(units=units, capacity=int(capacity), dedup=dedup)
