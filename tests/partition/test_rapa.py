"""RAPA: `partition --rank-speed` (METIS target part weights), halo trimming, inspect's prediction."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from hpcgnn.cli import main
from hpcgnn.data.graph import read_graph
from hpcgnn.errors import InputError
from hpcgnn.partition import rapa
from hpcgnn.partition.store import load_partition, read_meta
from hpcgnn.run.runfile import RUN_FILE, RUN_FORMAT, RUN_VERSION


def partition(graph, out, *extra) -> int:
    return main(["partition", str(graph), "--out", str(out), "--quiet", *map(str, extra)])


def assignment(store) -> np.ndarray:
    """Original vertex -> partition of a store."""
    meta = read_meta(store)
    part = np.empty(meta.num_nodes, dtype=np.int64)
    part[meta.new_to_orig()] = np.searchsorted(meta.part_offsets, np.arange(meta.num_nodes), side="right") - 1
    return part


@pytest.fixture(scope="module")
def stores(graph_files, tmp_path_factory):
    d = tmp_path_factory.mktemp("rapa")
    g = graph_files["plain"]
    out = {"plain": d / "plain", "equal": d / "equal", "12": d / "12", "12trim": d / "12trim"}
    assert partition(g, out["plain"], "--parts", 2) == 0
    assert partition(g, out["equal"], "--parts", 2, "--rank-speed", "1,1") == 0
    assert partition(g, out["12"], "--parts", 2, "--rank-speed", "1,2") == 0
    assert partition(g, out["12trim"], "--parts", 2, "--rank-speed", "1,2", "--halo-trim") == 0
    return out


def test_equal_speeds_give_todays_partition(stores):
    a, b = read_meta(stores["plain"]), read_meta(stores["equal"])
    assert a.content_hash == b.content_hash
    assert np.array_equal(a.new_to_orig(), b.new_to_orig())
    assert np.array_equal(a.part_offsets, b.part_offsets)
    assert json.loads(b.attrs["rank_speed"]) == [1.0, 1.0]
    assert json.loads(b.attrs["target_fractions"]) == [0.5, 0.5]
    assert "rank_speed" not in a.attrs


def test_speeds_1_2_size_parts_one_third_two_thirds(stores, graph_files):
    g = read_graph(graph_files["plain"])
    part = assignment(stores["12"])
    deg = g.degree()
    for name, w in (("train", g.train_mask.astype(np.int64)), ("edges", deg), ("vertices", np.ones_like(deg))):
        share = np.bincount(part, weights=w, minlength=2) / w.sum()
        # METIS' contract: no part above its target by more than ufactor (3 %); the light part
        # takes the heavy part's slack, so it may be 2 points (6 % of 1/3) short
        assert np.all(share <= np.array([1 / 3, 2 / 3]) * 1.03 + 1e-9), (name, share)
        assert share == pytest.approx([1 / 3, 2 / 3], abs=0.021), (name, share)
    meta = read_meta(stores["12"])
    assert json.loads(meta.attrs["rank_speed"]) == [1.0, 2.0]
    assert json.loads(meta.attrs["target_fractions"]) == pytest.approx([1 / 3, 2 / 3])
    assert meta.attrs["rank_speed_source"] == "list"


def test_metis_target_weights_directly(graph_files):
    from hpcgnn.partition.metis import LIBRARIES, load_library, part_graph_kway

    g = read_graph(graph_files["plain"])
    for name in LIBRARIES:
        lib = load_library(name)
        vw = np.ones((g.num_nodes, 1), dtype=lib.idx_dtype)
        part, _ = part_graph_kway(g.indptr, g.indices, 3, vw, seed=0, library=lib,
                                  tpwgts=np.array([[0.2], [0.3], [0.5]]))
        share = np.bincount(part, minlength=3) / g.num_nodes
        assert share == pytest.approx([0.2, 0.3, 0.5], rel=0.04), (name, share)
        with pytest.raises(ValueError, match="tpwgts"):
            part_graph_kway(g.indptr, g.indices, 3, vw, library=lib, tpwgts=np.array([[0.5], [0.5], [0.5]]))


# ---- halo trimming --------------------------------------------------------------------------
def reference_trim(indptr, indices, part, k, speeds, threshold):
    """The note's loop (capgnn.md 4.2) one halo vertex at a time, from scratch."""
    n = indptr.shape[0] - 1
    deg = np.diff(indptr)
    halos = [dict() for _ in range(k)]   # partition -> {u: [edges into it, score sum]}
    for v in range(n):
        for u in indices[indptr[v]:indptr[v + 1]]:
            u = int(u)
            if part[u] != part[v]:
                e = halos[part[v]].setdefault(u, [0, 0.0])
                e[0] += 1
                e[1] += 1 / np.sqrt(deg[u] * deg[v])
    dup = np.zeros(n, dtype=np.int64)
    for h in halos:
        for u in h:
            dup[u] += 1
    E = [float(deg[part == i].sum()) for i in range(k)]
    V = [float((part == i).sum()) for i in range(k)]
    removed = [set() for _ in range(k)]

    def lam(i, e_i, h_i):
        return (e_i + V[i] + h_i) / speeds[i]

    def costs():
        return np.array([lam(i, E[i], len(halos[i]) - len(removed[i])) for i in range(k)])

    while True:
        c = costs()
        if np.std(c) < threshold * c.mean():
            break
        changed = False
        for i in sorted(range(k), key=lambda i: (speeds[i], i)):
            c = costs()
            mu = c.mean()
            if c[i] <= mu:
                continue
            target = (c[i] + mu) / 2
            cands = sorted((u for u in halos[i] if u not in removed[i]),
                           key=lambda u: (2 * halos[i][u][1] * dup[u], u))
            e_i, h_i, take = E[i], len(halos[i]) - len(removed[i]), []
            for u in cands:
                e_i -= halos[i][u][0]
                h_i -= 1
                if lam(i, e_i, h_i) <= target:
                    break
                take.append(u)
            if take:
                removed[i].update(take)
                E[i] -= sum(halos[i][u][0] for u in take)
                changed = True
        if not changed:
            break
    return [sorted(r) for r in removed], costs(), halos


@pytest.mark.parametrize("speeds, threshold", [((1.0, 2.0), 0.01), ((1.0, 1.0, 1.0), 0.01), ((3.0, 1.0, 2.0), 0.002)])
def test_trim_follows_the_note(graph_files, speeds, threshold):
    g = read_graph(graph_files["plain"])
    k = len(speeds)
    part = np.random.default_rng(k).integers(0, k, g.num_nodes)   # unbalanced enough to trim
    part[: g.num_nodes // 3] = 0
    res = rapa.trim_halos(g.indptr, g.indices, part, k, np.array(speeds), threshold)
    ref, ref_cost, halos = reference_trim(g.indptr, g.indices, part, k, np.array(speeds), threshold)
    assert [d.tolist() for d in res.dropped] == ref
    assert res.cost_after == pytest.approx(ref_cost)
    assert sum(len(d) for d in ref) > 0
    for i, d in enumerate(res.dropped):
        assert set(d.tolist()) <= set(halos[i])                    # only halo vertices of i
        assert res.removed_edges[i] == sum(halos[i][u][0] for u in d.tolist())
    cv = lambda c: np.std(c) / np.mean(c)  # noqa: E731
    assert cv(res.cost_after) <= cv(res.cost_before)
    # only partitions above the mean cost were trimmed
    above = res.cost_before > res.cost_before.mean()
    assert all(above[i] for i, d in enumerate(res.dropped) if d.size)


def test_trim_does_nothing_when_balanced_within_threshold(graph_files):
    g = read_graph(graph_files["plain"])
    part = np.arange(g.num_nodes) % 2
    res = rapa.trim_halos(g.indptr, g.indices, part, 2, np.ones(2), threshold=0.5)
    assert all(d.size == 0 for d in res.dropped) and res.passes == 0
    again = rapa.trim_halos(g.indptr, g.indices, part, 2, np.array([1.0, 1.5]), 0.01)
    again2 = rapa.trim_halos(g.indptr, g.indices, part, 2, np.array([1.0, 1.5]), 0.01)
    assert [d.tolist() for d in again.dropped] == [d.tolist() for d in again2.dropped]   # deterministic


def test_trimmed_store_is_consistent(stores, graph_files):
    g = read_graph(graph_files["plain"])
    meta = read_meta(stores["12trim"])
    trim = json.loads(meta.attrs["halo_trim"])
    assert sum(trim["removed_halos"]) > 0
    assert np.array_equal(assignment(stores["12trim"]), assignment(stores["12"]))   # inner sets unchanged
    untrimmed = [load_partition(stores["12"], p) for p in range(2)]
    parts = [load_partition(stores["12trim"], p) for p in range(2)]
    n2o = meta.new_to_orig()
    deg = g.degree()
    for p, (a, b) in enumerate(zip(untrimmed, parts)):
        dropped = np.setdiff1d(a.halo_ids, b.halo_ids)
        assert dropped.size == trim["removed_halos"][p]
        assert np.all(np.isin(b.halo_ids, a.halo_ids))
        # remaining in-edges = the untrimmed ones minus those from dropped halos, in order
        keep = ~np.isin(a.indices, dropped)
        assert np.array_equal(b.indices, a.indices[keep])
        assert a.indices.size - b.indices.size == trim["removed_edges"][p]
        rows = np.repeat(np.arange(a.num_solid), np.diff(a.indptr))
        assert np.array_equal(np.diff(b.indptr), np.bincount(rows[keep], minlength=a.num_solid))
        # halo vertices = exactly the remaining non-solid sources; degrees stay the full graph's
        srcs = np.unique(b.indices)
        assert np.array_equal(b.halo_ids, srcs[(srcs < b.solid_begin) | (srcs >= b.solid_end)])
        assert np.array_equal(b.degree, deg[n2o[b.solid_begin:b.solid_end]])
        assert np.array_equal(b.halo_degree, deg[n2o[b.halo_ids]])
    for p in range(2):          # owners' send lists = receivers' halo rows
        for q in range(2):
            if p != q:
                assert np.array_equal(parts[p].send_list(q), parts[q].halo_ids[parts[q].halo_owner == p])


# ---- speeds from files and runs; bad input -----------------------------------------------------
def test_speed_files(tmp_path):
    (tmp_path / "s.txt").write_text("1.5 3\n")
    (tmp_path / "s.json").write_text('{"speeds": [2, 4]}')
    (tmp_path / "l.json").write_text("[1, 2]")
    assert rapa.read_rank_speed(str(tmp_path / "s.txt"), 2)[0].tolist() == [1.5, 3.0]
    assert rapa.read_rank_speed(str(tmp_path / "s.json"), 2)[0].tolist() == [2.0, 4.0]
    assert rapa.read_rank_speed(str(tmp_path / "l.json"), 2)[0].tolist() == [1.0, 2.0]
    assert rapa.read_rank_speed("1, 2,3", 3)[0].tolist() == [1.0, 2.0, 3.0]


def _fake_run(path, store, compute, halo, status="finished"):
    """A run file with the layout of hpcgnn.run.runfile: forward + backward - halo = compute."""
    meta = read_meta(store)
    compute, halo = np.asarray(compute, float), np.asarray(halo, float)
    path.mkdir()
    with h5py.File(path / RUN_FILE, "w") as f:
        f.attrs.update({"format": RUN_FORMAT, "version": RUN_VERSION, "status": status,
                        "partition_dir": str(store), "partition_hash": meta.content_hash,
                        "num_ranks": meta.num_parts})
        f.create_dataset("metrics/epoch", data=np.arange(1, compute.shape[0] + 1))
        f.create_dataset("metrics/loss", data=np.ones(compute.shape[0]))
        f.create_dataset("timings/forward", data=0.25 * compute + halo)
        f.create_dataset("timings/backward", data=0.75 * compute)
        f.create_dataset("timings/halo", data=halo)
        f.create_dataset("timings/epoch", data=compute + 2 * halo)
    return path


def test_speeds_from_a_run_are_work_over_compute_time(stores, tmp_path):
    store = stores["plain"]
    # epoch 1 is warm-up and not used; then rank 0 takes 2 s, rank 1 1 s per epoch
    run = _fake_run(tmp_path / "run", store, [[9.0, 9.0], [2.0, 1.0], [2.0, 1.0]], np.full((3, 2), 0.5))
    speeds, how = rapa.read_rank_speed(str(run), 2)
    work = rapa.part_work_of_store(read_meta(store))
    assert speeds == pytest.approx(work / np.array([2.0, 1.0]))
    assert "part work / compute seconds" in how
    assert rapa.read_rank_speed(str(run / RUN_FILE), 2)[0] == pytest.approx(speeds)
    # partition from the run: rank 1 (twice as fast per unit of work) gets about 2/3
    out = tmp_path / "from-run"
    assert partition(read_meta(store).attrs["source_graph"], out, "--parts", 2, "--rank-speed", run) == 0
    frac = json.loads(read_meta(out).attrs["target_fractions"])
    assert frac == pytest.approx((speeds / speeds.sum()).tolist())
    assert str(run) in read_meta(out).attrs["rank_speed_source"]


@pytest.mark.parametrize("spec, message", [
    ("1,2,3", "3 rank speeds for --parts 2, expected 2"),
    ("1,0", "rank 1 has speed"),
    ("1,-2", "rank 1 has speed"),
    ("1,fast", "'fast' is not a number"),
    ("nan,1", "rank 0 has speed"),
    ("missing/speeds.txt", "file not found"),
])
def test_bad_rank_speed_exits_2(graph_files, tmp_path, capsys, spec, message):
    out = tmp_path / "s"
    assert partition(graph_files["plain"], out, "--parts", 2, "--rank-speed", spec) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcgnn: error: --rank-speed") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_bad_rank_speed_files_exit_2(graph_files, stores, tmp_path, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("[1, 2")
    unreadable = tmp_path / "dir.txt"
    unreadable.mkdir()
    running = _fake_run(tmp_path / "running", stores["plain"], np.ones((2, 2)), np.zeros((2, 2)), "running")
    negative = _fake_run(tmp_path / "neg", stores["plain"], -np.ones((2, 2)), np.zeros((2, 2)))
    binary = tmp_path / "speeds.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    for spec, message in [(bad_json, "not valid JSON"), (unreadable, "run.h5: file not found"),
                          (binary, "cannot read the file"),
                          (running, "expected a finished (or stopped) run"), (negative, "non-positive mean compute")]:
        out = tmp_path / "s"
        assert partition(graph_files["plain"], out, "--parts", 2, "--rank-speed", spec) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(spec) in err and message in err, err
        assert not out.exists()
    assert partition(graph_files["plain"], tmp_path / "s", "--parts", 2, "--method", "random",
                     "--rank-speed", "1,2") == 2
    assert "needs --method metis" in capsys.readouterr().err
    assert partition(graph_files["plain"], tmp_path / "s", "--parts", 2, "--trim-threshold", "0.1") == 2
    assert "--trim-threshold needs --halo-trim" in capsys.readouterr().err


# ---- inspect's prediction ---------------------------------------------------------------------
def test_inspect_predicts_the_straggler(stores, capsys):
    for key, speeds in (("12", [1.0, 2.0]), ("plain", [1.0, 1.0])):
        assert main(["inspect", str(stores[key]), "--json"]) == 0
        w = json.loads(capsys.readouterr().out)["rank_work"]
        parts = [load_partition(stores[key], p) for p in range(2)]
        work = np.array([pt.indptr[-1] + pt.num_solid + pt.num_halo for pt in parts], dtype=float)
        assert w["work"] == work.tolist() and w["speeds"] == speeds
        t = work / np.array(speeds)
        assert w["relative_time"] == pytest.approx((t / t.mean()).tolist())
        assert w["predicted_straggler"] == int(np.argmax(t))
    # equal parts run by ranks of speed 1 and 3: rank 0 is the straggler, by about 3 / 2
    assert main(["inspect", str(stores["plain"]), "--json", "--rank-speed", "1,3"]) == 0
    w = json.loads(capsys.readouterr().out)["rank_work"]
    assert w["predicted_straggler"] == 0 and w["max_over_mean"] == pytest.approx(1.5, rel=0.05)
    assert main(["inspect", str(stores["plain"]), "--rank-speed", "3,1"]) == 0
    text = capsys.readouterr().out
    assert "predicted straggler: rank 1" in text and "rank speeds 3, 1 (list)" in text
    assert main(["inspect", str(stores["plain"]), "--rank-speed", "1,2,3"]) == 2
    assert "3 rank speeds for --parts 2" in capsys.readouterr().err


def test_read_rank_speed_errors_are_input_errors():
    with pytest.raises(InputError, match="expected 2"):
        rapa.read_rank_speed("1", 2)
