"""DistGNN-MB engine on 3 real MPI ranks: AEP/HEC invariants from the debug record.

One launch (tiny graph, 3 contiguous partitions, HEC mode, delay d = 2, nc = 4 so the cap
binds, life span ls = 2) checks: identical parameters on all ranks after every step; pushed IDs
are solid on the sender, halo on the receiver and in the sender's frontier; at most nc rows per
destination per layer per iteration; layer-0 pushed rows are the raw features (bitwise); each
message arrives exactly d iterations later with exactly the sent contents; layer-0 halo inputs
are either the exact features (HEC hit of a vertex received earlier in the epoch) or dropped
(zero row); every halo row a receiver's layer >= 1 consumed from its HEC is bitwise the owner's
own layer input for that vertex at the iteration of its freshest push (two computations on two
ranks: the owner's forward and the receiver's cache lookup); nothing is outstanding.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import mb_support as mb  # noqa: E402
from mpiutil import debug_env  # noqa: E402

from hpcgnn.partition.store import load_partition  # noqa: E402
from hpcgnn.run.runfile import read_run  # noqa: E402

P, D, NC, L, LS = 3, 2, 4, 2, 2
CONFIG = f"""
[model]
arch = "sage"
hidden = 8
layers = {L}
dropout = 0.3
[train]
epochs = 2
lr = 0.01
eval_every = 0
[minibatch]
batch_size = 6
fanouts = [4, 10]
halo = "hec"
delay = {D}
nc = {NC}
cs = 64
ls = {LS}
"""


@pytest.fixture(scope="module")
def hec_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aep")
    graph = mb.tiny_graph()
    parts = mb.tiny_store(tmp / "parts", graph, P)
    cfg = mb.write_config(tmp / "cfg.toml", CONFIG)
    proc = mb.train(P, cfg, parts, tmp / "run", timeout=120, env=debug_env(record=True))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"parts": [load_partition(parts, p) for p in range(P)], "run": tmp / "run",
            "debug": [mb.read_debug(tmp / "run", p) for p in range(P)], "stdout": proc.stdout}


def test_same_iterations_and_parameters_on_all_ranks(hec_run):
    r = read_run(hec_run["run"])
    it = r["counters"]["iterations"]
    assert (it == it[:, :1]).all() and it.min() >= D + 2
    steps = [d["steps"] for d in hec_run["debug"]]
    assert all(len(s) == len(steps[0]) for s in steps)
    for rows in zip(*steps):
        assert len({(int(x["epoch"]), int(x["step"])) for x in rows}) == 1
        assert len({bytes(x["checksum"]) for x in rows}) == 1, "parameters differ between ranks"
    assert len({bytes(x["checksum"]) for x in steps[0]}) == len(steps[0])   # they do change
    assert sum(l.startswith("epoch ") for l in hec_run["stdout"].splitlines()) == 2                           # rank 0 prints only


def test_pushed_rows_are_sender_embeddings(hec_run):
    parts, debug = hec_run["parts"], hec_run["debug"]
    capped = False
    for p, dbg in enumerate(debug):
        inputs = {(x["epoch"], x["iteration"], x["layer"]): x for x in dbg["inputs"]}
        m = {int(e): int(n) for e, n in zip(read_run(hec_run["run"])["metrics"]["epoch"],
                                           read_run(hec_run["run"])["counters"]["iterations"][:, p])}
        for push in dbg["pushes"]:
            e, k, l = push["epoch"], push["iteration"], push["layer"]
            assert k < m[e] - D
            ids, dest, rows = push["ids"], push["ranks"], push["rows"]
            assert ((ids >= parts[p].solid_begin) & (ids < parts[p].solid_end)).all()
            counts = np.bincount(dest, minlength=P)
            assert counts.max(initial=0) <= NC and counts[p] == 0
            capped |= counts.max(initial=0) == NC
            for q in range(P):
                assert np.isin(ids[dest == q], parts[q].halo_ids).all()
            seen = inputs[(e, k, l)]
            order = np.argsort(seen["ids"])
            at = order[np.searchsorted(seen["ids"], ids, sorter=order)]
            assert np.array_equal(seen["ids"][at], ids), "pushed vertex not in the sender's frontier"
            if l == 0:              # rows of layers >= 1: test_halo_rows_are_the_owners_rows
                ref = parts[p].features[ids - parts[p].solid_begin]
                assert np.array_equal(ref.view(np.uint32), rows.view(np.uint32))
    assert capped, "the nc cap never bound; the test graph is too small"


def test_messages_arrive_exactly_d_iterations_later(hec_run):
    debug = hec_run["debug"]
    sent = {}
    for p, dbg in enumerate(debug):
        for push in dbg["pushes"]:
            for q in range(P):
                sel = push["ranks"] == q
                sent[(p, q, push["epoch"], push["iteration"], push["layer"])] = (push["ids"][sel], push["rows"][sel])
    r = read_run(hec_run["run"])
    m = r["counters"]["iterations"][:, 0].astype(int)
    for dbg in debug:                               # L pushes and receives per iteration k < M-d, k >= d
        for e, me in zip(r["metrics"]["epoch"], m):
            assert sum(x["epoch"] == e for x in dbg["pushes"]) == L * (me - D)
            assert sum(x["epoch"] == e for x in dbg["receives"]) == L * (me - D)
    for q, dbg in enumerate(debug):
        for rec in dbg["receives"]:
            e, k, l = rec["epoch"], rec["iteration"], rec["layer"]
            assert k >= D
            want_ids = np.concatenate([sent[(p, q, e, k - D, l)][0] for p in range(P)])
            want_rows = np.concatenate([sent[(p, q, e, k - D, l)][1] for p in range(P)])
            assert np.array_equal(rec["ids"], want_ids)
            assert np.array_equal(rec["rows"].view(np.uint32), want_rows.view(np.uint32))
            assert np.array_equal(rec["ranks"], np.repeat(np.arange(P), [
                sent[(p, q, e, k - D, l)][0].size for p in range(P)]))


def test_layer0_halo_inputs_are_hits_or_dropped(hec_run):
    parts, debug = hec_run["parts"], hec_run["debug"]
    feats = {}
    for part in parts:
        for i in range(part.num_solid):
            feats[part.solid_begin + i] = part.features[i]
    hits = misses = 0
    for q, dbg in enumerate(debug):
        part = parts[q]
        by_iter = defaultdict(list)
        for rec in dbg["receives"]:
            if rec["layer"] == 0:
                by_iter[(rec["epoch"], rec["iteration"])].append(rec["ids"])
        for x in dbg["inputs"]:
            if x["layer"] != 0:
                continue
            e, k = x["epoch"], x["iteration"]
            got = set()
            for j in range(k + 1):
                for ids in by_iter.get((e, j), []):
                    got.update(ids.tolist())
            halo = ~((x["ids"] >= part.solid_begin) & (x["ids"] < part.solid_end))
            for gid, row in zip(x["ids"][halo], x["rows"][halo]):
                if np.any(row != 0):
                    hits += 1
                    assert gid in got, "HEC hit for a vertex never received this epoch"
                    assert np.array_equal(row, feats[int(gid)])
                else:
                    misses += 1     # not received yet, or evicted by the ring (cs = 64)
    assert hits > 0 and misses > 0


def test_halo_rows_are_the_owners_rows(hec_run):
    """End to end, receiver against owner: every nonzero halo row (a HEC hit; a miss leaves a
    zero row) that rank q's layer l >= 1 consumed at iteration k is bitwise the row the owner's
    own forward fed to its layer l for that vertex at iteration j, the freshest push of that
    vertex to q with j + d <= k (only the freshest copy is found), and k - (j + d) <= ls (the
    line has not expired). The push records give only which vertices were pushed when, never
    the rows."""
    parts, debug = hec_run["parts"], hec_run["debug"]
    ends = np.array([part.solid_end for part in parts])
    own = {}                 # (owner, epoch, iteration, layer) -> {vertex: the owner's input row}
    for p, dbg in enumerate(debug):
        for x in dbg["inputs"]:
            solid = (x["ids"] >= parts[p].solid_begin) & (x["ids"] < parts[p].solid_end)
            own[(p, x["epoch"], x["iteration"], x["layer"])] = dict(zip(x["ids"][solid].tolist(), x["rows"][solid]))
    pushed = defaultdict(list)   # (receiver, epoch, layer, vertex) -> iterations pushed
    for dbg in debug:
        for push in dbg["pushes"]:
            for gid, q in zip(push["ids"].tolist(), push["ranks"].tolist()):
                pushed[(q, push["epoch"], push["layer"], gid)].append(push["iteration"])
    hits = np.zeros(L, dtype=int)
    ages = set()
    for q, dbg in enumerate(debug):
        part = parts[q]
        for x in dbg["inputs"]:
            e, k, l = x["epoch"], x["iteration"], x["layer"]
            if l == 0:
                continue
            halo = ~((x["ids"] >= part.solid_begin) & (x["ids"] < part.solid_end))
            for gid, row in zip(x["ids"][halo].tolist(), x["rows"][halo]):
                if not row.any():
                    continue
                js = [j for j in pushed[(q, e, l, gid)] if j + D <= k]
                assert js, f"rank {q} epoch {e} iteration {k} layer {l}: HEC hit of {gid}, never pushed to it"
                j = max(js)
                ages.add(k - (j + D))
                assert k - (j + D) <= LS, f"vertex {gid}: a line of age {k - (j + D)} > ls = {LS} hit"
                owner = int(np.searchsorted(ends, gid, side="right"))
                want = own[(owner, e, j, l)][gid]
                assert np.array_equal(row.view(np.uint32), want.view(np.uint32)), \
                    f"rank {q} epoch {e} iteration {k} layer {l} vertex {gid}: {row} != owner {owner}'s {want} (iteration {j})"
                hits[l] += 1
    assert hits[1:].min() >= 20 and len(ages) > 1, (hits, ages)
