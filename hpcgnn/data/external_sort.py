"""The canonical symmetric CSR of an edge stream in bounded memory, by external sorting.

:class:`SymmetricEdgeSorter` takes undirected edges in blocks (``add``) and gives the same CSR
as :func:`hpcgnn.data.clean.build_symmetric_csr` of all of them (rows = destinations, sources
sorted within a row, no self-loops, no duplicate edges, every edge in both directions) and the
same ``self_loops_removed`` / ``duplicates_removed`` counts, holding at most ``budget_bytes`` of
edge data in memory whatever the edge count:

1. Runs. Every non-loop edge u-v becomes two 64-bit keys ``v << 32 | u`` and ``u << 32 | v``
   (destination in the high half, so key order is CSR order). Keys fill a buffer of
   :attr:`SortPlan.run_keys`; a full buffer is sorted (numpy's in-place sort), its duplicates
   dropped, and written as one run: a raw file of sorted unique uint64 keys in ``scratch``.
2. Merges. While there are more runs than :attr:`SortPlan.fan_in`, groups of ``fan_in`` runs are
   merged into one (a pass); the last ``fan_in`` or fewer are merged straight into the output.
   A merge holds one block of :attr:`SortPlan.block_keys` keys per input: every key at or
   below the smallest last key of the blocks whose runs are not exhausted is final, so those
   keys are taken from every block, sorted together, de-duplicated (also against the last key
   emitted) and emitted, and every block emptied is refilled from its run.
3. Output. Merged keys become the CSR: the per-destination counts (one int64 array of N) and
   the sources, written as ``indices`` (int32 or int64) to a raw file in ``scratch``, read back
   in blocks through :class:`RawArray`.

All edges fitting one run, nothing is written but the output. Vertex IDs must fit 32 bits
(N <= 2**32). The caller owns ``scratch`` (a directory beside the output) and removes it on
success and on failure; an OSError while writing a run (a full disk) propagates unchanged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcgnn.data.clean import as_ids, check_ids
from hpcgnn.errors import InputError

MAX_NODES = 1 << 32               # vertex IDs are packed into 32-bit halves of a key
MIN_RUN_KEYS = 1 << 10            # the smallest sort buffer
MIN_BLOCK_KEYS = 1 << 9           # the smallest merge block per run
MAX_BLOCK_KEYS = 1 << 19          # larger merge blocks gain nothing (4 MB reads)
MAX_FAN_IN = 64
OUTPUT_BLOCK_KEYS = 1 << 20       # keys per step of the CSR output
RUN_BYTES_PER_KEY = 24            # buffer (8) + the sorted run's copy and mask while spilling (9) + slack
MERGE_BYTES_PER_KEY = 40          # per key of a merge block: block, slab, sorted slab, mask, output
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


@dataclass(frozen=True)
class SortPlan:
    """Buffer sizes of an external sort within ``budget`` bytes (see the module docstring)."""

    budget: int
    run_keys: int
    block_keys: int
    fan_in: int


def min_sort_bytes() -> int:
    """The smallest budget :func:`sort_plan` accepts."""
    return max(MIN_RUN_KEYS * RUN_BYTES_PER_KEY, 2 * MIN_BLOCK_KEYS * MERGE_BYTES_PER_KEY)


def sort_plan(budget: int) -> SortPlan:
    """The run, block and fan-in sizes for ``budget`` bytes of edge data (>= :func:`min_sort_bytes`)."""
    budget = int(budget)
    if budget < min_sort_bytes():
        raise ValueError(f"sort budget {budget} bytes is below the minimum {min_sort_bytes()}")
    run_keys = budget // RUN_BYTES_PER_KEY
    block = min(MAX_BLOCK_KEYS, max(MIN_BLOCK_KEYS, budget // (MERGE_BYTES_PER_KEY * MAX_FAN_IN)))
    fan_in = int(max(2, min(MAX_FAN_IN, budget // (MERGE_BYTES_PER_KEY * block))))
    return SortPlan(budget=budget, run_keys=int(run_keys), block_keys=int(block), fan_in=fan_in)


class RawArray:
    """A 1-D array in a raw binary file, read by slices (``a[lo:hi]`` is a fresh ndarray): for
    passes over arrays larger than memory without a memory map's resident pages."""

    def __init__(self, path: str | os.PathLike, dtype, count: int, offset: int = 0):
        self.path, self.dtype, self.offset = Path(path), np.dtype(dtype), int(offset)
        self.shape = (int(count),)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("RawArray takes contiguous slices only")
        lo, hi, _ = key.indices(self.shape[0])
        if hi <= lo:
            return np.empty(0, dtype=self.dtype)
        with open(self.path, "rb") as fh:
            fh.seek(self.offset + lo * self.dtype.itemsize)
            out = np.fromfile(fh, dtype=self.dtype, count=hi - lo)
        if out.shape[0] != hi - lo:
            raise OSError(f"{self.path}: short read ({out.shape[0]} of {hi - lo} entries)")
        return out


class _RunReader:
    """Sequential blocks of one run file."""

    def __init__(self, path: Path, block: int):
        self._fh = open(path, "rb")
        self._left = os.fstat(self._fh.fileno()).st_size // 8
        self._block = block

    @property
    def done(self) -> bool:
        return self._left == 0

    def next(self) -> np.ndarray:
        k = min(self._block, self._left)
        out = np.fromfile(self._fh, dtype=np.uint64, count=k)
        if out.shape[0] != k:
            raise OSError(f"{self._fh.name}: short read")
        self._left -= k
        if self._left == 0:
            self._fh.close()
        return out

    def close(self) -> None:
        self._fh.close()


def _unique_sorted(keys: np.ndarray, last) -> np.ndarray:
    """Sorted ``keys`` without repeats and without a leading ``last`` (the previous block's end)."""
    if keys.size == 0:
        return keys
    keep = np.empty(keys.shape[0], dtype=bool)
    keep[0] = last is None or keys[0] != last
    np.not_equal(keys[1:], keys[:-1], out=keep[1:])
    return keys[keep]


def merge_runs(paths: list[Path], block: int):
    """Yield the sorted unique keys of the sorted runs ``paths`` in increasing blocks."""
    readers = [_RunReader(p, block) for p in paths]
    try:
        bufs = [r.next() for r in readers]
        last = None
        while True:
            live = [i for i, b in enumerate(bufs) if b.size]
            if not live:
                return
            bounds = [bufs[i][-1] for i in live if not readers[i].done]
            bound = min(bounds) if bounds else None
            parts = []
            for i in live:
                b = bufs[i]
                k = b.shape[0] if bound is None else int(np.searchsorted(b, bound, side="right"))
                parts.append(b[:k])
                bufs[i] = b[k:]
                if bufs[i].size == 0 and not readers[i].done:
                    bufs[i] = readers[i].next()
            slab = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
            if len(parts) > 1:
                slab.sort()
            out = _unique_sorted(slab, last)
            del slab, parts
            if out.size:
                last = out[-1]
                yield out
    finally:
        for r in readers:
            r.close()


@dataclass
class SortedCsr:
    """The sorter's output: ``indptr`` int64 [N+1] in memory, ``indices`` in a raw file."""

    indptr: np.ndarray
    indices: RawArray
    stats: dict
    runs: int           # runs written (0: the edges fitted one buffer)
    merge_passes: int   # merge passes before the final one


class SymmetricEdgeSorter:
    """External-sort form of :func:`hpcgnn.data.clean.build_symmetric_csr` (module docstring):
    ``add`` edge blocks, then ``finish`` once."""

    def __init__(self, num_nodes: int, budget: int, scratch: str | os.PathLike, where: str = "edges"):
        self.num_nodes = int(num_nodes)
        if self.num_nodes > MAX_NODES:
            raise InputError(f"{where}: {self.num_nodes:,} vertices: the external sort takes at most "
                             f"{MAX_NODES:,} (32-bit vertex IDs)")
        self.where = where
        self.plan = sort_plan(budget)
        self.scratch = Path(scratch)
        self._buf = np.empty(self.plan.run_keys, dtype=np.uint64)
        self._pos = 0
        self._runs: list[Path] = []
        self._loops = 0
        self._added = 0
        self._serial = 0

    @property
    def num_added(self) -> int:
        return self._added

    def _new_run_path(self) -> Path:
        self._serial += 1
        return self.scratch / f"run-{self._serial:06d}.u64"

    def _spill(self) -> None:
        keys = self._buf[:self._pos]
        keys.sort()
        path = self._new_run_path()
        _unique_sorted(keys, None).tofile(path)
        self._runs.append(path)
        self._pos = 0

    def _push(self, keys: np.ndarray) -> None:
        at = 0
        while at < keys.shape[0]:
            k = min(keys.shape[0] - at, self._buf.shape[0] - self._pos)
            self._buf[self._pos:self._pos + k] = keys[at:at + k]
            self._pos += k
            at += k
            if self._pos == self._buf.shape[0]:
                self._spill()

    def add(self, src, dst) -> None:
        """Edges ``src[i] - dst[i]`` (any integer dtype); IDs outside [0, N) are an InputError
        naming ``where``."""
        src, dst = as_ids(src, self.where), as_ids(dst, self.where)
        check_ids(src, dst, self.num_nodes, self.where)
        self._added += int(src.shape[0])
        loop = src == dst
        nloops = int(np.count_nonzero(loop))
        if nloops:
            self._loops += nloops
            keep = ~loop
            src, dst = src[keep], dst[keep]
        u, v = src.astype(np.uint64), dst.astype(np.uint64)
        half = max(1, self._buf.shape[0] // 8)   # temporaries: 3 x 8 bytes x half
        for lo in range(0, u.shape[0], half):
            a, b = u[lo:lo + half], v[lo:lo + half]
            self._push((b << _SHIFT) | a)
            self._push((a << _SHIFT) | b)

    def _merged_blocks(self):
        """(blocks of the sorted unique keys, merge passes made)."""
        if not self._runs:
            keys = self._buf[:self._pos]
            keys.sort()
            out = _unique_sorted(keys, None)
            self._buf = None
            return iter([out] if out.size else []), 0
        if self._pos:
            self._spill()
        self._buf = None
        runs, passes = list(self._runs), 0
        while len(runs) > self.plan.fan_in:
            merged = []
            for g in range(0, len(runs), self.plan.fan_in):
                group = runs[g:g + self.plan.fan_in]
                if len(group) == 1:
                    merged.append(group[0])
                    continue
                path = self._new_run_path()
                with open(path, "wb") as fh:
                    for block in merge_runs(group, self.plan.block_keys):
                        block.tofile(fh)
                for p in group:
                    p.unlink()
                merged.append(path)
            runs, passes = merged, passes + 1
        self._final = runs
        return merge_runs(runs, self.plan.block_keys), passes

    def finish(self, index_dtype=np.int32) -> SortedCsr:
        """The CSR of every edge added: ``indices`` as ``index_dtype`` in ``scratch/indices.bin``."""
        index_dtype = np.dtype(index_dtype)
        n = self.num_nodes
        runs_written = len(self._runs) + (1 if self._runs and self._pos else 0)
        blocks, passes = self._merged_blocks()
        degree = np.zeros(n, dtype=np.int64)
        path = self.scratch / "indices.bin"
        total = 0
        with open(path, "wb") as fh:
            for merged in blocks:
                for lo in range(0, merged.shape[0], OUTPUT_BLOCK_KEYS):   # cache-sized temporaries
                    keys = merged[lo:lo + OUTPUT_BLOCK_KEYS]
                    dst = (keys >> _SHIFT).astype(np.int64)
                    starts = np.flatnonzero(np.concatenate(([True], dst[1:] != dst[:-1])))
                    degree[dst[starts]] += np.diff(np.append(starts, dst.shape[0]))
                    (keys & _LOW).astype(index_dtype).tofile(fh)
                    total += int(keys.shape[0])
        for p in getattr(self, "_final", []):
            p.unlink(missing_ok=True)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(degree, out=indptr[1:])
        del degree
        kept = self._added - self._loops
        stats = {"self_loops_removed": 2 * self._loops, "duplicates_removed": 2 * kept - total}
        return SortedCsr(indptr, RawArray(path, index_dtype, total), stats, runs_written, passes)
