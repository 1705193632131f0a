"""One bipartite layer of a sampled minibatch (DGL message-flow-graph convention).

A :class:`Block` maps the rows of a source frontier (``num_src`` rows) to the rows of a
destination frontier (``num_dst`` rows). Destination vertices are the first ``num_dst``
source vertices (prefix), so ``h_src[:num_dst]`` are the destinations' own inputs.
Edges are stored as a CSR over destinations: the sources of destination ``i`` are
``indices[indptr[i]:indptr[i+1]]``, positions in ``[0, num_src)``. Edge id = position in
``indices``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from hpcgnn.native import spmm as _spmm


# key of a Block's cache entry: a loader of its transpose from a host block (Block.transpose);
# not a str, so Block.to() leaves it behind like the other per-device entries
TRANSPOSE_FROM = ("transpose_from",)


def _each(parts: tuple, fn) -> tuple:
    """``fn`` of every tensor of ``parts`` (a CSR or a transpose), keeping a dropped part
    (None: the edge ids after :meth:`Block.drop_edge_ids`) as None."""
    return tuple(None if t is None else fn(t) for t in parts)


@dataclass(eq=False)
class Block:
    """CSR over destinations of one layer; see the module docstring for the conventions."""

    num_src: int
    num_dst: int
    indptr: torch.Tensor    # int64 [num_dst + 1]
    indices: torch.Tensor   # int64 [nnz], source positions in [0, num_src)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.num_dst > self.num_src:
            raise ValueError(f"Block: num_dst={self.num_dst} > num_src={self.num_src} "
                             "(destinations must be a prefix of the sources)")
        if tuple(self.indptr.shape) != (self.num_dst + 1,):
            raise ValueError(f"Block: indptr has shape {tuple(self.indptr.shape)}, "
                             f"expected ({self.num_dst + 1},)")

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def in_degree(self) -> torch.Tensor:
        """int64 [num_dst]: number of (kept) in-edges of each destination."""
        return self.indptr[1:] - self.indptr[:-1]

    def edge_dst(self) -> torch.Tensor:
        """int64 [nnz]: destination position of every edge (cached)."""
        if "edge_dst" not in self._cache:
            self._cache["edge_dst"] = torch.repeat_interleave(
                torch.arange(self.num_dst, device=self.device), self.in_degree(),
                output_size=self.num_edges)
        return self._cache["edge_dst"]

    def transpose(self, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(t_indptr [num_src+1], t_indices [nnz] destination positions, t_eid [nnz]) (cached;
        ``t_eid`` None after :meth:`drop_edge_ids`).

        Rows are sources; within a row, edges in increasing edge id (a stable sort by
        source), so ``t_indices == edge_dst()[t_eid]`` and ``indices[t_eid]`` is sorted.
        CPU blocks use the OpenMP counting sort ``spmm.csr_transpose``; other devices use torch ops (same result).
        A device copy of a host block that was given a loader (``_cache[TRANSPOSE_FROM]``: a callable
        of the device returning the three tensors there) takes the host block's transpose,
        built once there, instead of sorting again (the tensor engine's streamed chunks).
        ``pin`` (a host block, CUDA available): the cached transpose is page-locked (once), so
        that its copies to the device can be asynchronous.
        """
        if "transpose" not in self._cache:
            load = self._cache.get(TRANSPOSE_FROM)
            if load is not None:
                out = tuple(load(self.device))
            elif self.device.type == "cpu":
                t_indptr, t_indices, t_eid = _spmm.csr_transpose(
                    self.indptr.contiguous().numpy(), self.indices.contiguous().numpy(), int(self.num_src))
                out = (torch.from_numpy(t_indptr), torch.from_numpy(t_indices), torch.from_numpy(t_eid))
            else:
                out = _transpose_torch(self.indptr, self.indices, self.num_src, self.edge_dst())
            self._cache["transpose"] = out
        if pin and self.device.type == "cpu" and not self._cache["transpose"][0].is_pinned():
            self._cache["transpose"] = _each(self._cache["transpose"], torch.Tensor.pin_memory)
        return self._cache["transpose"]

    def device_csr(self, device, transpose: bool = False) -> tuple:
        """The structure on ``device`` (cached per device): ``(indptr, indices)``, or with
        ``transpose`` the transpose's ``(t_indptr, t_indices, t_eid)`` (:meth:`transpose`,
        computed once on the block's own device and copied)."""
        device = torch.device(device)
        key = ("csr_t" if transpose else "csr", str(device))
        if key not in self._cache:
            parts = self.transpose() if transpose else (self.indptr, self.indices)
            self._cache[key] = _each(parts, lambda t: t.to(device))
        return self._cache[key]

    def sparse_csr(self, device, dtype, transpose: bool = False) -> torch.Tensor:
        """The unweighted adjacency as a torch sparse CSR tensor on ``device`` (cached per device
        and dtype; values 1): ``[num_dst, num_src]``, or its transpose ``[num_src, num_dst]``.
        Built once and reused while the block's topology lives (the torch kernels of
        :mod:`hpcgnn.nn.aggregate`). Both directions share one values tensor of ones (read
        only): 4 bytes an edge in float32, not 8."""
        device = torch.device(device)
        key = ("sparse_t" if transpose else "sparse", str(device), dtype)
        if key not in self._cache:
            parts = self.device_csr(device, transpose)
            ones_key = ("ones", str(device), dtype)
            if ones_key not in self._cache:
                self._cache[ones_key] = torch.ones(self.num_edges, dtype=dtype, device=device)
            ones = self._cache[ones_key]
            self._cache[key] = sparse_csr(parts[0], parts[1], ones,
                                          (self.num_src, self.num_dst) if transpose else (self.num_dst, self.num_src))
        return self._cache[key]

    def drop_sources(self, keep_src_mask: torch.Tensor) -> "Block":
        """New block without the edges whose source has ``keep_src_mask[src] == False``.

        ``keep_src_mask`` is bool [num_src]. Shapes (num_src, num_dst) are unchanged: a
        dropped source keeps its row in the input frontier, it just sends no messages.
        The surviving edges keep their relative order.
        """
        mask = torch.as_tensor(keep_src_mask, device=self.device)
        if mask.dtype != torch.bool or tuple(mask.shape) != (self.num_src,):
            raise ValueError(f"drop_sources: keep_src_mask must be bool [{self.num_src}], "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        keep_edge = mask[self.indices]
        kept_before = torch.zeros(self.num_edges + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(keep_edge, 0, out=kept_before[1:])
        return Block(self.num_src, self.num_dst, kept_before[self.indptr], self.indices[keep_edge])

    def streamed_copy(self, device, pin: bool = False, count=None, copy=None) -> "Block":
        """A copy of this host block on ``device`` for one use (chunks streamed through PCIe,
        sampled blocks) whose transpose, when asked for, is this block's: built once here (the
        native counting sort, page-locked when ``pin``, cached on this block) and copied, instead
        of sorted on the device every use (on CUDA a sort and a ``bincount``, which waits for the
        device). ``copy(t)``: how a host tensor goes to the device, default
        ``t.to(device, non_blocking=True)`` (the host tensors should then be page-locked);
        ``count(nbytes)`` is told the bytes of each copy: the CSR now, the transpose when it is
        copied."""
        if copy is None:
            def copy(t):
                return t.to(device, non_blocking=True)

        def load_transpose(dev):
            parts = self.transpose(pin=pin)
            if count is not None:
                count(sum(int(t.nbytes) for t in parts if t is not None))
            return _each(parts, copy)

        if count is not None:
            count(int(self.indptr.nbytes + self.indices.nbytes))
        b = Block(self.num_src, self.num_dst, copy(self.indptr), copy(self.indices))
        b._cache[TRANSPOSE_FROM] = load_transpose
        return b

    def to(self, device) -> "Block":
        """The block with its tensors (and cached transpose) on ``device``."""
        device = torch.device(device)
        if device == self.device:
            return self
        b = Block(self.num_src, self.num_dst, self.indptr.to(device), self.indices.to(device))
        for key, val in self._cache.items():
            if not isinstance(key, str):
                continue   # per-device entries (device_csr, sparse_csr): the new block builds its own
            b._cache[key] = _each(val, lambda t: t.to(device)) if isinstance(val, tuple) else val.to(device)
        return b

    def drop_edge_ids(self) -> None:
        """Build the transpose (once, :meth:`transpose`) and forget its edge ids ``t_eid`` (8
        bytes an edge), for a block on which no edge-weighted aggregation runs (SAGE, GCN: their
        transposed products read ``t_indptr`` and ``t_indices`` only). The transpose's third
        element is None afterwards, in copies made by :meth:`to` too; an edge-weighted op then
        stops with a RuntimeError (:func:`hpcgnn.nn.aggregate.edge_ids`) instead of guessing."""
        t_indptr, t_indices, _ = self.transpose()
        self._cache["transpose"] = (t_indptr, t_indices, None)
        for key, val in list(self._cache.items()):
            if isinstance(key, tuple) and key[:1] == ("csr_t",):
                self._cache[key] = (val[0], val[1], None)


def _transpose_torch(indptr: torch.Tensor, indices: torch.Tensor, num_src: int,
                     edge_dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-agnostic transpose (stable sort of the edges by source)."""
    t_eid = torch.sort(indices, stable=True).indices
    t_indptr = torch.zeros(num_src + 1, dtype=torch.int64, device=indices.device)
    torch.cumsum(torch.bincount(indices, minlength=num_src), 0, out=t_indptr[1:])
    return t_indptr, edge_dst[t_eid], t_eid


def sparse_csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: tuple) -> torch.Tensor:
    """``torch.sparse_csr_tensor`` over existing index tensors (no copy, no invariant check; the
    "sparse CSR support is in beta" warning silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)
