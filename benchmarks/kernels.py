"""Kernel micro-benchmarks: the native SpMM's bandwidth against ``torch.sparse.mm`` and a memory
copy (:func:`measure_bandwidth`, used by ``make bench-fullgraph``), and the neighbour sampler's
throughput on a random CSR (:func:`sampler_throughput`)::

    python -m benchmarks.kernels spmm [--nodes 1000000 --edges 10000000 --dim 128 --threads 2]
    python -m benchmarks.kernels sampler [--nodes 1000000 --degree 20 --threads 2]

Each prints its result dict as JSON.
"""
from __future__ import annotations

import argparse
import json
import mmap
import time
import warnings

import numpy as np
import torch

from hpcgnn.native import sampler as _sampler
from hpcgnn.native import spmm as _spmm
from hpcgnn.nn.aggregate import best_time
from hpcgnn.sampling.neighbor import NeighborSampler


# ---- SpMM bandwidth ----------------------------------------------------------------------------

def _spmm_csr(num_nodes: int, num_edges: int, locality: int | None, seed: int):
    """CSR (rows = destinations) of a random graph; sources uniform, or within +-locality of the row."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.sort(torch.randint(num_nodes, (num_edges,), generator=gen)).values
    if locality:
        src = (dst + torch.randint(-locality, locality + 1, (num_edges,), generator=gen)).clamp_(0, num_nodes - 1)
    else:
        src = torch.randint(num_nodes, (num_edges,), generator=gen)
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0, out=indptr[1:])
    return indptr, src


def _empty_pages(rows: int, cols: int, huge: bool) -> tuple[torch.Tensor, object]:
    """float32 [rows, cols] on anonymous memory advised MADV_HUGEPAGE (``huge``; Linux THP in
    "madvise" or "always" mode) or MADV_NOHUGEPAGE (4 KiB pages whatever torch's allocator
    would do); returns (tensor, owner) and the owner must outlive the tensor."""
    nbytes = max(rows * cols * 4, 4)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        mm.madvise(advice)
    return torch.frombuffer(mm, dtype=torch.float32)[:rows * cols].view(rows, cols), mm


def measure_bandwidth(num_nodes: int = 1_000_000, num_edges: int = 10_000_000, dim: int = 128,
                      threads: int = 2, locality: int | None = None, repeats: int = 3,
                      seed: int = 0, hugepages: bool = False) -> dict:
    """Effective bandwidth of the native ``spmm_sum`` vs ``torch.sparse.mm`` (CSR) and a memory copy.

    Graph: ``num_edges`` edges with uniform destinations and uniform sources (``locality``
    None) or sources within ``+-locality`` of the destination. Features float32
    [num_nodes, dim]. Bytes of one SpMM = nnz*dim*4 (gathered rows) + num_nodes*dim*4
    (written) + (nnz + num_nodes + 1)*8 (indices, indptr). Copy bandwidth = 2*bytes/time of
    a ``copy_`` of a float32 tensor of max(64 MiB, X's size), at most 256 MiB (read + write),
    best of max(4 * repeats, 20). The native SpMM's ``repeats`` runs alternate with the copies
    (4 after each), so that both are measured in the same state of a shared machine; its time
    and torch's are the best of ``repeats``. Returns seconds, GB/s (1e9 bytes/s), fractions of the copy bandwidth, and
    the max abs difference between the two SpMM results. Threads are restored afterwards.
    ``hugepages`` puts the features and the output on transparent huge pages (fewer TLB
    misses on the random row gathers), else on 4 KiB pages. hpcgnn's commands run with huge
    pages for torch's large CPU tensors (:func:`hpcgnn.runtime.prefer_huge_pages`).
    """
    if min(num_nodes, num_edges, dim, threads, repeats) < 1:
        raise ValueError("measure_bandwidth: num_nodes, num_edges, dim, threads and repeats must be >= 1")
    old_torch, old_native = torch.get_num_threads(), _spmm.max_threads()
    torch.set_num_threads(threads)
    _spmm.set_threads(threads)
    try:
        indptr, indices = _spmm_csr(num_nodes, num_edges, locality, seed)
        x, x_owner = _empty_pages(num_nodes, dim, hugepages)
        out, out_owner = _empty_pages(num_nodes, dim, hugepages)
        x.copy_(torch.randn(num_nodes, dim, generator=torch.Generator().manual_seed(seed + 1)))
        ip, ix, xn, on = indptr.numpy(), indices.numpy(), x.numpy(), out.numpy()
        src = torch.empty(min(max(num_nodes * dim, 2**24), 2**26)).fill_(1.0)
        dst = torch.empty_like(src).fill_(0.0)
        # the SpMM and the copy alternate, so that both see the same state of a shared machine
        # (its bandwidth drifts by tens of percent within minutes on a busy VM)
        t_native = t_copy = float("inf")
        for _ in range(repeats):
            t_native = min(t_native, best_time(lambda: _spmm.spmm_sum(ip, ix, xn, on), 1))
            t_copy = min(t_copy, best_time(lambda: dst.copy_(src), 4))  # ~20 ms each: cheap to repeat
        t_copy = min(t_copy, best_time(lambda: dst.copy_(src), max(0, 20 - 4 * repeats)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
            a = torch.sparse_csr_tensor(indptr, indices, torch.ones(num_edges), (num_nodes, num_nodes),
                                        check_invariants=False)
        ref = torch.sparse.mm(a, x)
        t_torch = best_time(lambda: torch.sparse.mm(a, x), repeats)
        max_abs_diff = float((ref - out).abs().max())
        ref = a = None                                     # freed before the last figure
        copy_gbs = 2 * src.numel() * 4 / t_copy / 1e9
    finally:
        torch.set_num_threads(old_torch)
        _spmm.set_threads(old_native)
    nbytes = num_edges * dim * 4 + num_nodes * dim * 4 + (num_edges + num_nodes + 1) * 8
    native_gbs, torch_gbs = nbytes / t_native / 1e9, nbytes / t_torch / 1e9
    return {
        "num_nodes": num_nodes, "num_edges": num_edges, "dim": dim, "threads": threads,
        "locality": locality or 0, "hugepages": bool(hugepages), "bytes": nbytes,
        "native_s": t_native, "native_gbs": native_gbs, "native_frac_copy": native_gbs / copy_gbs,
        "torch_csr_s": t_torch, "torch_csr_gbs": torch_gbs, "torch_frac_copy": torch_gbs / copy_gbs,
        "copy_gbs": copy_gbs, "speedup_vs_torch": t_torch / t_native, "max_abs_diff": max_abs_diff,
    }


# ---- sampler throughput ------------------------------------------------------------------------

def random_csr(num_nodes: int, avg_degree: float, seed: int = 0,
               num_halo: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random in-edge CSR for benchmarks: Poisson(avg_degree) row lengths, uniform sources in
    ``[0, num_nodes + num_halo)`` (rows are the first ``num_nodes`` vertices)."""
    rng = np.random.default_rng(seed)
    deg = rng.poisson(avg_degree, size=num_nodes).astype(np.int64)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(deg, out=indptr[1:])
    indices = rng.integers(0, num_nodes + num_halo, size=int(indptr[-1]), dtype=np.int64)
    return indptr, indices


def sampler_throughput(num_nodes: int = 1_000_000, avg_degree: float = 20.0, fanouts=(5, 10, 15),
              batch_size: int = 1000, num_batches: int = 20, threads: int | None = None,
              seed: int = 0) -> dict:
    """Sampler throughput on a random CSR (see :func:`random_csr`).

    Returns a dict with the sampled edges/s and frontier vertices/s (sum over all blocks
    and all frontiers ``S_0..S_{L-1}``), seconds per batch, and the mean sizes. Run it with
    ``python -m benchmarks.kernels sampler``.
    """
    before = int(_sampler.max_threads())
    if threads is not None:
        _sampler.set_threads(int(threads))
    try:
        return _sampler_throughput(num_nodes, avg_degree, fanouts, batch_size, num_batches, seed)
    finally:
        _sampler.set_threads(before)


def _sampler_throughput(num_nodes, avg_degree, fanouts, batch_size, num_batches, seed) -> dict:
    indptr, indices = random_csr(num_nodes, avg_degree, seed)
    sampler = NeighborSampler(indptr, indices, num_nodes, list(fanouts), seed=seed)
    order = np.random.default_rng(seed + 1).permutation(num_nodes)
    batches = [order[i * batch_size:(i + 1) * batch_size] for i in range(num_batches)]
    sampler.sample(batches[0], epoch=0, step=0)   # warm-up (page-in of the CSR)
    edges = verts = inputs = 0
    start = time.perf_counter()
    for step, seeds in enumerate(batches):
        batch = sampler.sample(seeds, epoch=1, step=step)
        edges += batch.num_sampled_edges
        verts += sum(int(f.shape[0]) for f in batch.frontiers[:-1])
        inputs += int(batch.frontiers[0].shape[0])
    elapsed = time.perf_counter() - start
    return {"num_nodes": num_nodes, "num_edges": int(indptr[-1]), "fanouts": list(fanouts),
            "batch_size": batch_size, "num_batches": num_batches,
            "threads": int(_sampler.max_threads()), "seconds_per_batch": elapsed / num_batches,
            "edges_per_s": edges / elapsed, "vertices_per_s": verts / elapsed,
            "mean_edges_per_batch": edges / num_batches, "mean_input_nodes": inputs / num_batches}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="kernel", required=True)
    sp = sub.add_parser("spmm", help="native SpMM bandwidth vs torch.sparse.mm and a copy")
    sp.add_argument("--nodes", type=int, default=1_000_000)
    sp.add_argument("--edges", type=int, default=10_000_000)
    sp.add_argument("--dim", type=int, default=128)
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--locality", type=int, default=None)
    sp.add_argument("--repeats", type=int, default=3)
    sp.add_argument("--hugepages", action="store_true")
    ss = sub.add_parser("sampler", help="neighbour sampler throughput")
    ss.add_argument("--nodes", type=int, default=1_000_000)
    ss.add_argument("--degree", type=float, default=20.0)
    ss.add_argument("--fanouts", type=lambda s: [int(x) for x in s.split(",")], default=[5, 10, 15])
    ss.add_argument("--batch-size", type=int, default=1000)
    ss.add_argument("--batches", type=int, default=20)
    ss.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.kernel == "spmm":
        r = measure_bandwidth(args.nodes, args.edges, args.dim, args.threads, args.locality, args.repeats,
                              hugepages=args.hugepages)
    else:
        r = sampler_throughput(args.nodes, args.degree, args.fanouts, args.batch_size, args.batches, args.threads)
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
