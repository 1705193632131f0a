"""The partition store reconstructs the graph exactly and its halo/send lists are right.

Every check compares against a plain numpy reference computed here from the original graph.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.data.graph import MASKS, read_graph
from hpcgnn.partition import balance as bal
from hpcgnn.partition.store import load_partition, read_meta
from hpcgnn.partition.writer import renumber, write_store


def check_store(directory, graph) -> None:
    """Assert every docs/formats.md invariant of the store in ``directory`` for ``graph``."""
    meta = read_meta(directory)
    n, k = graph.num_nodes, meta.num_parts
    new_to_orig = meta.new_to_orig()
    offsets = meta.part_offsets
    # new_to_orig is a permutation; partitions are contiguous ranges in original-ID order.
    assert np.array_equal(np.sort(new_to_orig), np.arange(n))
    assert offsets[0] == 0 and offsets[-1] == n and np.all(np.diff(offsets) >= 0)
    orig_to_new = np.empty(n, dtype=np.int64)
    orig_to_new[new_to_orig] = np.arange(n)
    owner = np.searchsorted(offsets, np.arange(n), side="right") - 1
    for p in range(k):
        assert np.all(np.diff(new_to_orig[offsets[p]:offsets[p + 1]]) > 0)

    # Reference: the whole graph relabelled, as (dst, src) pairs sorted by dst then src.
    deg = graph.degree()
    dst_o = np.repeat(np.arange(n), deg)
    dst_n, src_n = orig_to_new[dst_o], orig_to_new[graph.indices]
    order = np.lexsort((src_n, dst_n))
    dst_n, src_n = dst_n[order], src_n[order]
    ref_indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst_n, minlength=n), out=ref_indptr[1:])

    parts = [load_partition(directory, p, meta) for p in range(k)]
    cut_entries = 0
    for p, part in enumerate(parts):
        b, e = offsets[p], offsets[p + 1]
        rows = new_to_orig[b:e]
        assert (part.solid_begin, part.solid_end) == (b, e)
        # In-edge CSR of the solid vertices, global source IDs, sorted per row.
        assert np.array_equal(part.indptr, ref_indptr[b:e + 1] - ref_indptr[b])
        assert np.array_equal(part.indices, src_n[ref_indptr[b]:ref_indptr[e]])
        assert np.array_equal(part.degree, deg[rows])
        # Halo: exactly the in-neighbours owned elsewhere, sorted; owners and degrees.
        src = part.indices
        outside = src[(src < b) | (src >= e)]
        cut_entries += outside.size
        assert np.array_equal(part.halo_ids, np.unique(outside))
        assert np.array_equal(part.halo_owner, owner[part.halo_ids])
        assert part.halo_owner.dtype == np.int32
        assert np.all(part.halo_owner != p)
        assert np.array_equal(part.halo_degree, deg[new_to_orig[part.halo_ids]])
        assert meta.halo_counts[p] == part.num_halo
        # Vertex data.
        assert np.array_equal(part.features, graph.features[rows])
        assert np.array_equal(part.labels, graph.labels[rows])
        for name in MASKS:
            assert np.array_equal(getattr(part, name), getattr(graph, name)[rows])
        # Local numbering round trip.
        local = np.arange(part.num_local)
        assert np.array_equal(part.to_local(part.to_global(local)), local)
    # db_halo: p's send list to q is exactly q's halo vertices owned by p.
    for p, part in enumerate(parts):
        assert len(part.send_indptr) == k + 1 and part.send_list(p).size == 0
        for q, other in enumerate(parts):
            if q != p:
                expect = other.halo_ids[other.halo_owner == p]
                assert np.array_equal(part.send_list(q), expect), (p, q)
    # Union of partitions = the original graph (mapped back through new_to_orig).
    all_indptr = np.concatenate([[0], np.cumsum(np.concatenate([np.diff(pt.indptr) for pt in parts]))])
    all_src = new_to_orig[np.concatenate([pt.indices for pt in parts])]
    all_dst = new_to_orig[np.repeat(np.arange(n), np.diff(all_indptr))]
    back = np.lexsort((all_src, all_dst))
    assert np.array_equal(all_dst[back], dst_o)
    assert np.array_equal(all_src[back], graph.indices)
    feats = np.empty_like(graph.features)
    feats[new_to_orig] = np.concatenate([pt.features for pt in parts])
    assert np.array_equal(feats, graph.features)
    # Store-level statistics.
    part_of = np.empty(n, dtype=np.int64)
    part_of[new_to_orig] = owner
    assert meta.edge_cut == cut_entries // 2 == bal.edge_cut(graph.indptr, graph.indices, part_of)
    expect_bal = bal.balance(part_of, k, deg, graph.train_mask)
    assert set(meta.balance) == {"vertices", "train", "edges"}
    for key, value in expect_bal.items():
        assert meta.balance[key] == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("method", ["metis", "random", "contiguous"])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_store_reconstructs_graph(graph_files, tmp_path, method, parts):
    out = tmp_path / "store"
    rc = main(["partition", str(graph_files["plain"]), "--parts", str(parts), "--method", method,
               "--seed", "3", "--out", str(out), "--quiet"])
    assert rc == 0
    graph = read_graph(graph_files["plain"])
    check_store(out, graph)
    meta = read_meta(out)
    assert (meta.num_parts, meta.method, meta.seed) == (parts, method, 3)
    assert meta.attrs["source_graph"] == str(graph_files["plain"].resolve())
    expect_constraints = ["vertices", "train", "edges"] if method == "metis" else []
    assert json.loads(meta.attrs["constraints"]) == expect_constraints
    if method == "contiguous":  # equal ranges of original IDs: the identity permutation
        assert np.array_equal(meta.new_to_orig(), np.arange(graph.num_nodes))
        assert np.ptp(np.diff(meta.part_offsets)) <= 1
    if parts == 1:
        assert meta.edge_cut == 0 and meta.halo_counts.tolist() == [0]


def test_store_with_isolated_vertices(graph_files, tmp_path):
    out = tmp_path / "iso"
    assert main(["partition", str(graph_files["isolated"]), "--parts", "3", "--out", str(out), "--quiet"]) == 0
    check_store(out, read_graph(graph_files["isolated"]))


def test_store_with_empty_partition(graph_files, tmp_path):
    """An assignment that leaves a partition empty still gives a valid, loadable store."""
    graph = read_graph(graph_files["plain"])
    part = np.where(np.arange(graph.num_nodes) % 2 == 0, 0, 2)
    summary = write_store(tmp_path / "s", graph, part, 3, method="random", seed=0, constraints=(),
                          source_graph="x", source_hash="0", progress=False)
    assert summary.halo_counts[1] == 0
    check_store(tmp_path / "s", graph)
    empty = load_partition(tmp_path / "s", 1)
    assert empty.num_solid == 0 and empty.indices.size == 0 and empty.send_ids.size == 0


def test_renumber_groups_by_part_keeping_order():
    part = np.array([2, 0, 2, 1, 0, 0, 2])
    new_to_orig, orig_to_new, offsets = renumber(part, 4)
    assert new_to_orig.tolist() == [1, 4, 5, 3, 0, 2, 6]
    assert offsets.tolist() == [0, 3, 4, 7, 7]
    assert np.array_equal(orig_to_new[new_to_orig], np.arange(7))


@pytest.mark.parametrize("parts", [2, 4])
def test_cora_store(cora_graph, cora_parts, parts):
    check_store(cora_parts(parts), read_graph(cora_graph))


def test_native_extract_part_rejects_inconsistent_input(graph_files):
    from hpcgnn.native import partition as native

    g = read_graph(graph_files["plain"])
    part = np.arange(g.num_nodes) % 2
    new_to_orig, orig_to_new, offsets = renumber(part, 2)
    out = native.extract_part(g.indptr, g.indices, new_to_orig[:offsets[1]], orig_to_new, offsets, 0)
    assert out[0].shape == (offsets[1] + 1,)
    with pytest.raises(ValueError, match="rows and orig_to_new disagree"):
        native.extract_part(g.indptr, g.indices, new_to_orig[offsets[1]:], orig_to_new, offsets, 0)
    with pytest.raises(ValueError, match="part_id out of range"):
        native.extract_part(g.indptr, g.indices, new_to_orig[:offsets[1]], orig_to_new, offsets, 2)


def test_local_indices_load_equals_the_converted_global_ones(cora_graph, tmp_path):
    """``load_partition(..., indices="local")`` converts the stored source IDs as it reads them,
    in blocks (here also of 1,000 entries: many blocks): the same local CSR as converting the
    global load, without a copy, and as int32 with ``local_dtype="auto"``; ``to_global`` gives
    the stored IDs back."""
    from hpcgnn.partition import store as st

    out = tmp_path / "p"
    assert main(["partition", str(cora_graph), "--parts", "3", "--out", str(out)]) == 0
    meta = read_meta(out)
    for p in range(3):
        g = load_partition(out, p, meta)
        assert g.index_space == "global"
        ip, want = g.local_csr()
        loc = load_partition(out, p, meta, indices="local")
        assert loc.index_space == "local" and loc.indices.dtype == np.int64
        assert np.array_equal(loc.indices, want) and np.array_equal(loc.local_csr()[1], want)
        assert loc.local_csr()[1] is loc.indices          # no copy
        assert np.array_equal(loc.to_global(loc.indices), g.indices)
        narrow = load_partition(out, p, meta, indices="local", local_dtype="auto")   # every local id fits
        assert narrow.indices.dtype == np.int32 and np.array_equal(narrow.indices, want)
        with st.open_partition_file(out, p, meta) as f:
            small = st.read_indices(f, (g.solid_begin, g.solid_end, g.halo_ids), block=1000)
        assert np.array_equal(small, want)
    with pytest.raises(ValueError, match="indices must be one of"):
        load_partition(out, 0, meta, indices="both")
