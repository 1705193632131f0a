"""Exact minibatch mode (``minibatch.halo = "exact"``): DistDGL-style synchronous fetch of
sampled neighbours and feature rows from their owners (exchanges of the data plane, a
:class:`~hpcgnn.comm.communicator.Communicator`; the sampling itself is
:mod:`hpcgnn.sampling.neighbor`'s).

Definition (the accuracy and communication reference for the HEC mode). A rank's minibatch is
sampled on the **whole** graph, not only inside its partition: at every hop the frontier
vertices it does not own are sent to their owners, which sample their neighbours (the same
uniform sampler and the same random stream as for local vertices) and send the sampled global
IDs back. After the last hop the raw input features of every input vertex of ``S_0`` owned
elsewhere are fetched from its owner. The model then runs on complete sampled blocks with
exact inputs, so a P-rank exact run trains with the same kind of minibatches as a single
process on the whole graph (DistDGL's distributed sampling plus KVStore feature pull). Nothing
is historical, nothing is dropped; every hop and the feature pull are blocking collectives.

Randomness: the neighbours of vertex ``v`` at hop ``h`` (block ``L-1-h``) of step
``(epoch, step)`` are drawn by its owner from the stream keyed by (seed, hop, epoch, step, v),
so they do not depend on which rank asked (two ranks asking at the same step get the same
sample).

Feature rows are served from the owner's feature store (:mod:`hpcgnn.store`, the rank's
in-memory vertex data store; its counters count every row served, own or requested by a peer,
and the device tier's hits); without one, from the partition's array.

Bytes counted (:attr:`ExactFetch.counters`): requests (int64 IDs), replies (int64 neighbour
counts and IDs), feature rows (float32) and the count exchanges, sent and received per rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hpcgnn.comm.communicator import Communicator


@dataclass
class ExactBatch:
    """A sampled minibatch in global IDs: ``blocks[l]`` maps ``frontiers[l]`` -> ``frontiers[l+1]``."""

    frontiers: list[np.ndarray]     # global IDs, frontiers[L] = seeds, each a prefix of the previous
    blocks: list                     # hpcgnn.sampling.block.Block, len L


@dataclass
class FetchCounters:
    bytes_sent: int = 0
    bytes_received: int = 0
    sample_bytes_sent: int = 0
    feature_bytes_sent: int = 0
    seconds: float = 0.0
    remote_inputs: int = 0
    inputs: int = 0
    exchanges: int = 0


def _segments(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment id, offset in segment) of every element of concatenated segments of ``counts``."""
    total = int(counts.sum())
    seg = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    return seg, np.arange(total, dtype=np.int64) - np.repeat(first, counts)


def gather_segments(indptr: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts, concatenated values) of CSR rows ``rows`` (vectorised)."""
    start = indptr[rows]
    counts = indptr[rows + 1] - start
    seg, off = _segments(counts)
    return counts, values[start[seg] + off]


class ExactFetch:
    """Distributed sampling and feature pull for one rank (collective methods)."""

    def __init__(self, comm: Communicator, part, part_offsets: np.ndarray, fanouts, seed: int, csr=None,
                 features=None, sampler=None):
        """``comm``: the data plane; ``csr``: the partition's (indptr, local indices) when the
        caller holds them already (the rank's graph store), else computed from ``part``;
        ``features``: the rank's :class:`~hpcgnn.store.base.FeatureStore` of its solid rows
        (None: ``part.features``); ``sampler``: a
        :class:`~hpcgnn.sampling.neighbor.NeighborSampler` over that CSR to draw with (its
        fanouts and seed are not used: every hop draws from its own stream), None: one is made."""
        from hpcgnn.sampling.neighbor import NeighborSampler

        if not isinstance(comm, Communicator):
            raise TypeError(f"exact fetch: comm must be a Communicator, got {type(comm).__name__}")
        self.comm = comm
        self.size = comm.size
        self.part = part
        self.offsets = np.asarray(part_offsets, dtype=np.int64)
        self.features = features
        self.fanouts = list(fanouts)
        indptr, local_indices = csr if csr is not None else part.local_csr()
        # One sampler (its scratch is [num_local]); hop h draws from its own stream.
        self._sampler = sampler if sampler is not None else NeighborSampler(
            indptr, local_indices, part.num_solid, self.fanouts, num_local=part.num_local)
        self._hops = [(f, _mix(seed, 0x45584143, hop)) for hop, f in enumerate(reversed(self.fanouts))]
        self.counters = FetchCounters()

    def reset_counters(self) -> None:
        self.counters = FetchCounters()

    def owner(self, gids: np.ndarray) -> np.ndarray:
        return (np.searchsorted(self.offsets, gids, side="right") - 1).astype(np.int64)

    # ---- exchanges ------------------------------------------------------------
    def _alltoallv(self, send: np.ndarray, counts: np.ndarray, recv_counts=None, kind: str = "sample"):
        if recv_counts is None:
            recv_counts = self.comm.exchange_counts(counts)
            self.counters.bytes_sent += 8 * (self.size - 1)
            self.counters.bytes_received += 8 * (self.size - 1)
        rank = self.comm.rank
        row = send.itemsize * (int(np.prod(send.shape[1:])) if send.ndim > 1 else 1)
        sent = (int(counts.sum()) - int(counts[rank])) * row
        self.counters.bytes_sent += sent
        self.counters.bytes_received += (int(recv_counts.sum()) - int(recv_counts[rank])) * row
        if kind == "sample":
            self.counters.sample_bytes_sent += sent
        else:
            self.counters.feature_bytes_sent += sent
        self.counters.exchanges += 1
        got = self.comm.alltoallv(torch.from_numpy(np.ascontiguousarray(send)), counts, recv_counts)
        return got.numpy(), recv_counts

    def _request(self, gids: np.ndarray, kind: str):
        """Send ``gids`` to their owners: (order, send counts, requests received, their counts)."""
        own = self.owner(gids)
        # a stable sort of 16-bit keys is numpy's radix sort: linear in the request count
        order = np.argsort(own.astype(np.int16) if self.size <= np.iinfo(np.int16).max else own, kind="stable")
        counts = np.bincount(own, minlength=self.size).astype(np.int64)
        req, req_counts = self._alltoallv(gids[order], counts, kind=kind)
        return order, counts, req, req_counts

    # ---- sampling ---------------------------------------------------------------
    def _sample_owned(self, hop: int, gids: np.ndarray, epoch: int, step: int):
        """(counts, neighbour global IDs) for owned vertices ``gids`` (duplicates allowed)."""
        part = self.part
        uniq, inverse = np.unique(gids, return_inverse=True)
        if uniq.shape[0] == 0:
            return np.zeros(gids.shape[0], np.int64), np.zeros(0, np.int64)
        fanout, hop_seed = self._hops[hop]
        batch = self._sampler.sample_hop(uniq - part.solid_begin, fanout, hop_seed, epoch=epoch, step=step)
        blk = batch.blocks[0]
        nbr = part.to_global(batch.frontiers[0].numpy()[blk.indices.numpy()])
        return gather_segments(blk.indptr.numpy(), nbr, inverse.reshape(-1))

    def sample(self, seeds_global: np.ndarray, epoch: int, step: int) -> ExactBatch:
        """Collective: the L blocks of one minibatch sampled over the whole graph."""
        from hpcgnn.sampling.block import Block

        t0 = time.perf_counter()
        dst = np.asarray(seeds_global, dtype=np.int64)
        frontiers = [dst]
        blocks = []
        for hop in range(len(self.fanouts)):
            order, counts, req, req_counts = self._request(dst, "sample")
            # Answer the requests (mine included): neighbour counts per request, then IDs.
            ans_counts, ans_nbrs = self._sample_owned(hop, req, epoch, step)
            seg_of_req = np.repeat(np.arange(self.size), req_counts)
            nbr_per_rank = np.bincount(seg_of_req, weights=ans_counts, minlength=self.size).astype(np.int64)
            got_counts, _ = self._alltoallv(ans_counts, req_counts, counts)
            from_rank = np.bincount(np.repeat(np.arange(self.size), counts), weights=got_counts,
                                    minlength=self.size).astype(np.int64)
            got_nbrs, _ = self._alltoallv(ans_nbrs, nbr_per_rank, from_rank)
            # Back to frontier order.
            deg = np.empty_like(got_counts)
            deg[order] = got_counts
            starts_sorted = np.cumsum(got_counts) - got_counts
            starts = np.empty_like(starts_sorted)
            starts[order] = starts_sorted
            seg, off = _segments(deg)
            nbrs = got_nbrs[starts[seg] + off]
            # New frontier: dst, then new sources in order of first appearance.
            # (the frontier's IDs are distinct: a value's position in src is that of its first
            # occurrence in allv, or len(dst) + the rank of that occurrence among the new ones)
            nd = dst.shape[0]
            allv = np.concatenate([dst, nbrs])
            _, first, inverse = np.unique(allv, return_index=True, return_inverse=True)
            is_new = first >= nd
            new_first = first[is_new]
            rank_of_new = np.empty(new_first.shape[0], dtype=np.int64)
            rank_of_new[np.argsort(new_first)] = np.arange(new_first.shape[0], dtype=np.int64)
            src = np.concatenate([dst, allv[np.sort(new_first)]])
            pos_of_unique = first.astype(np.int64, copy=True)
            pos_of_unique[is_new] = nd + rank_of_new
            pos = pos_of_unique[inverse.reshape(-1)[nd:]]
            indptr = np.zeros(dst.shape[0] + 1, dtype=np.int64)
            np.cumsum(deg, out=indptr[1:])
            blocks.append(Block(int(src.shape[0]), int(dst.shape[0]), torch.from_numpy(indptr),
                                torch.from_numpy(pos.astype(np.int64))))
            frontiers.append(src)
            dst = src
        self.counters.seconds += time.perf_counter() - t0
        return ExactBatch(frontiers[::-1], blocks[::-1])

    # ---- features -----------------------------------------------------------------
    def fetch_features(self, gids: np.ndarray) -> np.ndarray:
        """Collective: raw feature rows [n, F] (float32) of any global IDs (remote ones from
        their owners). Rows travel in the dtype the partition store holds them in (float16, or
        bfloat16 as its bit patterns: half the bytes of float32) and are cast on arrival."""
        t0 = time.perf_counter()
        part = self.part
        gids = np.asarray(gids, dtype=np.int64)
        order, counts, req, req_counts = self._request(gids, "feature")
        rows = self._own_rows(req - part.solid_begin)
        got, _ = self._alltoallv(np.ascontiguousarray(rows), req_counts, counts, kind="feature")
        out = np.empty((gids.shape[0], rows.shape[1]), dtype=np.float32)
        out[order] = _as_float32(got)
        mine = self.owner(gids) == self.comm.rank
        self.counters.inputs += int(gids.shape[0])
        self.counters.remote_inputs += int((~mine).sum())
        self.counters.seconds += time.perf_counter() - t0
        return out


    def _own_rows(self, local_ids: np.ndarray) -> np.ndarray:
        """Feature rows [n, F] (host) of solid local ids, through the feature store if any, in
        the dtype the rows are held in (float32, float16, or uint16 bfloat16 bit patterns)."""
        if self.features is None:
            return np.asarray(self.part.features[local_ids])
        rows = self.features.gather(torch.from_numpy(np.ascontiguousarray(local_ids, dtype=np.int64)))
        held = self.features.dtype                  # the gather's cast back: exact
        rows = rows.to(held).cpu()
        return (rows.view(torch.uint16) if held == torch.bfloat16 else rows).numpy()


def _as_float32(rows: np.ndarray) -> np.ndarray:
    """Feature rows as float32: float16 widened, uint16 read as bfloat16 bit patterns (the
    partition store's encoding; exact either way)."""
    if rows.dtype == np.uint16:
        return (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return rows.astype(np.float32, copy=False)


def _mix(*parts: int) -> int:
    from hpcgnn.seeding import stream_seed

    return stream_seed(*parts)
