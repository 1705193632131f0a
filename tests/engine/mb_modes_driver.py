"""MPI driver for test_minibatch_modes.py: one launch, several engine runs and an exact-fetch check.

usage: mb_modes_driver.py PARTS RUN_ROOT CONFIG
Trains with minibatch.halo = hec, off and exact (exact with sampled evaluation), then checks
ExactFetch against the whole graph (read from every partition file) and prints one
``EXACT-OK <rank> <edges>`` line per rank.
"""
import sys

import numpy as np

from hpcgnn.cli import main

parts, root, config = sys.argv[1:4]
for mode in ("hec", "off", "exact"):
    rc = main(["train", "--config", config, "--set", f"data.partitions={parts}",
               "--set", f"output.dir={root}/{mode}", "--set", f"minibatch.halo={mode}",
               "--set", "minibatch.eval=" + ("sampled" if mode == "exact" else "full")])
    if rc != 0:
        raise SystemExit(rc)

from hpcgnn.comm.exact_fetch import ExactFetch  # noqa: E402
from hpcgnn.partition.store import load_partition, read_meta  # noqa: E402
from hpcgnn.runtime import Runtime  # noqa: E402

rt = Runtime.start(threads=1)
with rt.guard():  # a failed check on one rank aborts the job instead of hanging it
    meta = read_meta(parts)
    all_parts = [load_partition(parts, p, meta) for p in range(meta.num_parts)]
    part = all_parts[rt.rank]
    n = meta.num_nodes
    deg = np.zeros(n, np.int64)
    nbrs = {}
    feats = np.zeros((n, meta.num_features), np.float32)
    for p in all_parts:
        for i in range(p.num_solid):
            row = p.indices[p.indptr[i]:p.indptr[i + 1]]
            nbrs[p.solid_begin + i] = set(row.tolist())
            deg[p.solid_begin + i] = row.size
        feats[p.solid_begin:p.solid_end] = p.features

    fanouts = [3, 2]
    from hpcgnn.comm.communicator_mpi import MpiCommunicator

    fetch = ExactFetch(MpiCommunicator(rt.comm), part, meta.part_offsets, fanouts, seed=5)
    # the last rank asks for nothing but must take part in every collective
    seeds = np.arange(max(part.solid_begin, part.solid_end - 9), part.solid_end) if rt.rank != rt.size - 1 \
        else np.zeros(0, np.int64)
    batch = fetch.sample(seeds, epoch=1, step=0)
    again = fetch.sample(seeds, epoch=1, step=0)
    assert all(np.array_equal(a, b) for a, b in zip(batch.frontiers, again.frontiers)), "not deterministic"
    assert np.array_equal(batch.frontiers[-1], seeds)
    edges = 0
    for l, blk in enumerate(batch.blocks):
        src, dst = batch.frontiers[l], batch.frontiers[l + 1]
        assert np.array_equal(src[:dst.size], dst), "destinations are not a prefix of the sources"
        assert np.unique(src).size == src.size
        ip, ix = blk.indptr.numpy(), blk.indices.numpy()
        for i, v in enumerate(dst):
            s = src[ix[ip[i]:ip[i + 1]]]
            assert np.unique(s).size == s.size, "a neighbour sampled twice"
            assert set(s.tolist()) <= nbrs[int(v)], "sampled a non-neighbour"
            assert s.size == min(fanouts[l], deg[v]), (s.size, fanouts[l], deg[v])
            edges += s.size
    x = fetch.fetch_features(batch.frontiers[0])
    assert np.array_equal(x, feats[batch.frontiers[0]]), "fetched features differ from the owners' rows"
    remote = ((batch.frontiers[0] < part.solid_begin) | (batch.frontiers[0] >= part.solid_end)).sum()
    assert rt.rank == rt.size - 1 or remote > 0, "the test graph gives no remote inputs"
    assert fetch.counters.feature_bytes_sent >= 0 and fetch.counters.bytes_received >= remote * 4 * meta.num_features
    rt.comm.Barrier()
    print(f"EXACT-OK {rt.rank} {edges}", flush=True)
