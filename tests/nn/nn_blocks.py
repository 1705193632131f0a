"""Random test blocks for the nn tests (imported by path: tests use --import-mode=importlib)."""
from __future__ import annotations

import torch

from hpcgnn.sampling.block import Block


def random_block(num_src: int, num_dst: int, nnz: int, seed: int, zero_rows: int = 0,
                 duplicates: bool = True) -> Block:
    """CSR block with ``nnz`` edges (sources uniform, duplicates allowed) and the first
    ``zero_rows`` destinations given no in-edges."""
    gen = torch.Generator().manual_seed(seed)
    lo = min(zero_rows, num_dst)
    if num_dst - lo <= 0 or num_src == 0:
        nnz = 0
    dst = torch.sort(torch.randint(lo, max(num_dst, lo + 1), (nnz,), generator=gen)).values
    src = torch.randint(max(num_src, 1), (nnz,), generator=gen)
    if not duplicates and nnz:
        key = torch.unique(dst * num_src + src)
        dst, src = key // num_src, key % num_src
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    if num_dst:
        torch.cumsum(torch.bincount(dst, minlength=num_dst), 0, out=indptr[1:])
    return Block(num_src, num_dst, indptr, src.to(torch.int64))


def edge_dst(block: Block) -> torch.Tensor:
    deg = block.indptr[1:] - block.indptr[:-1]
    return torch.repeat_interleave(torch.arange(block.num_dst), deg)


def dense_adjacency(block: Block, dtype=torch.float64) -> torch.Tensor:
    """[num_dst, num_src] edge counts (a duplicated edge counts twice)."""
    a = torch.zeros(block.num_dst, block.num_src, dtype=dtype)
    a.index_put_((edge_dst(block), block.indices), torch.ones(block.indices.shape[0], dtype=dtype),
                 accumulate=True)
    return a
