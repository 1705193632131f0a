"""Benchmark peers in their own interpreters (benchmarks/peers.py): fake peer scripts print
JSON, fail, hang or print garbage; the benchmark side gets the figures or a one-line reason and
goes on. No DGL needed; the last test runs the real DGL peer only where `make peer-dgl` made
.venv-dgl."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import peers

ROOT = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path, body: str, name: str = "peer.py") -> Path:
    p = tmp_path / name
    p.write_text("import json, os, sys, time\n" + body)
    return p


def test_peer_json_is_returned_and_the_child_is_isolated_with_huge_pages(tmp_path, monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    script = _script(tmp_path, "print('progress line')\n"
                               "print(json.dumps({'argv': sys.argv[1:], 'thp': os.environ.get('THP_MEM_ALLOC_ENABLE'),\n"
                               "                  'script_dir_on_path': os.path.dirname(os.path.abspath(__file__)) in sys.path,\n"
                               "                  'cwd': os.getcwd(), 'epoch_s': 0.5}))\n")
    out = peers.run_peer(sys.executable, script, ["fullgraph", "--epochs", 3], timeout=60, name="fake")
    assert out["argv"] == ["fullgraph", "--epochs", "3"]
    assert out["thp"] == "1"                      # as hpcgnn runs
    assert out["script_dir_on_path"] is False     # -I: nothing beside the script shadows the peer's imports
    assert Path(out["cwd"]) == ROOT
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # the user's choice is passed on
    assert peers.run_peer(sys.executable, script, [], timeout=60)["thp"] == "0"


@pytest.mark.parametrize("body, expected", [
    ("print('x', file=sys.stderr)\nprint('dgl import failed: no module named dgl', file=sys.stderr)\nsys.exit(3)\n",
     "failed (exit 3): x | dgl import failed: no module named dgl"),
    ("print('epoch 0 1.0 s')\n", "printed no JSON object on its last line (got 'epoch 0 1.0 s')"),
    ("print(json.dumps([1, 2]))\n", "printed no JSON object"),
    ("time.sleep(30)\n", "ran past its 1 s timeout"),
])
def test_peer_failures_give_one_line_and_the_benchmark_goes_on(tmp_path, capsys, body, expected):
    script = _script(tmp_path, body)
    with pytest.raises(peers.PeerError) as err:
        peers.run_peer(sys.executable, script, ["minibatch"], timeout=1, name="DGL peer")
    msg = str(err.value)
    assert msg.startswith("DGL peer: ") and expected in msg and "\n" not in msg
    assert peers.try_peer(sys.executable, script, ["minibatch"], timeout=1, name="DGL peer") is None
    assert "going on without it" in capsys.readouterr().out


def test_missing_or_unusable_interpreter(tmp_path):
    with pytest.raises(peers.PeerError, match="interpreter .*nope/bin/python not found .make peer-dgl"):
        peers.run_peer(tmp_path / "nope" / "bin" / "python", tmp_path / "x.py", [], timeout=10, name="DGL peer")
    plain = tmp_path / "python"
    plain.write_text("not a program")
    with pytest.raises(peers.PeerError, match="not executable"):
        peers.run_peer(plain, tmp_path / "x.py", [], timeout=10)


def test_dgl_python_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.DGL_ENV, "")
    assert peers.dgl_python() is None
    monkeypatch.setenv(peers.DGL_ENV, str(tmp_path / "py"))
    assert peers.dgl_python() == tmp_path / "py"
    monkeypatch.delenv(peers.DGL_ENV)
    venv_python = peers.DGL_VENV / "bin" / "python"
    assert peers.dgl_python() == (venv_python if venv_python.exists() else None)


def test_alternate_keeps_the_fastest_round_of_each_and_survives_a_failing_peer():
    ours_times, theirs_times, calls = [0.9, 0.7, 0.8], [1.2, 1.0, 1.1], []

    def ours(i):
        calls.append(("ours", i))
        return {"epoch_s": ours_times[i], "epoch_mean_s": ours_times[i] + 0.1}

    def theirs(i):
        calls.append(("theirs", i))
        return {"epoch_s": theirs_times[i], "epoch_mean_s": theirs_times[i] + 0.1}

    a, b, log = peers.alternate(3, ours, theirs)
    assert calls == [("ours", 0), ("theirs", 0), ("ours", 1), ("theirs", 1), ("ours", 2), ("theirs", 2)]
    assert a["epoch_s"] == 0.7 and b["epoch_s"] == 1.0
    assert [r["peer_epoch_s"] for r in log] == theirs_times
    calls.clear()
    a, b, log = peers.alternate(3, ours, lambda i: calls.append(("theirs", i)))  # the peer fails: None
    assert b is None and a["epoch_s"] == 0.7
    assert calls == [("ours", 0), ("theirs", 0), ("ours", 1), ("ours", 2)]   # tried once, then left out
    assert np.isnan(log[2]["peer_epoch_s"])


def _fake_dgl(tmp_path: Path, ok: bool) -> Path:
    """An executable standing in for .venv-dgl/bin/python: it echoes its arguments as JSON."""
    py = tmp_path / "fake-python"
    if ok:
        py.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      "print(json.dumps({'argv': sys.argv[1:], 'epoch_s': 2.0, 'epoch_mean_s': 2.5, 'dgl': '9.9',\n"
                      "                  'torch': '2.2.1', 'phases_min_s': {'sample': 1.0}}))\n")
    else:
        py.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named dgl' >&2\nexit 1\n")
    py.chmod(0o755)
    return py


def test_minibatch_comparison_passes_the_config_and_reports_the_ratio(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peers.DGL_ENV, str(_fake_dgl(tmp_path, ok=True)))
    rounds = []

    def ours(i):
        rounds.append(i)
        return {"epoch_s": 1.0 + i, "epoch_mean_s": 1.2 + i, "phases_min_s": {"sample": 0.3}}

    c = peers.minibatch_vs_dgl(tmp_path / "g.h5", ROOT / "inputs" / "products-sage.toml",
                               ["minibatch.batch_size=500"], 5, 7, 2, ours, timeout=60)
    assert rounds == [0, 1]
    assert c["hpcgnn_epoch_s"] == 1.0 and c["dgl_epoch_s"] == 2.0 and c["hpcgnn_over_dgl"] == 0.5
    assert c["hpcgnn_over_dgl_mean"] == pytest.approx(1.2 / 2.5)
    assert c["rounds_hpcgnn_epoch_s"] == [1.0, 2.0] and c["dgl_version"] == "9.9"
    assert "hpcgnn/DGL 0.50x" in capsys.readouterr().out


def test_minibatch_peer_arguments_follow_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.DGL_ENV, str(_fake_dgl(tmp_path, ok=True)))
    seen = {}
    real = peers.try_peer

    def spy(*a, **k):
        out = real(*a, **k)
        seen["argv"] = out["argv"]
        return out
    monkeypatch.setattr(peers, "try_peer", spy)
    peers.minibatch_vs_dgl(tmp_path / "g.h5", ROOT / "inputs" / "products-sage.toml",
                           ["minibatch.batch_size=500", "model.hidden=64"], 5, 7, 1,
                           lambda i: {"epoch_s": 1.0, "epoch_mean_s": 1.0}, timeout=60)
    argv = seen["argv"][2:]
    opts = dict(zip(argv[1::2], argv[2::2]))
    assert argv[0] == "minibatch" and opts["--graph"] == str(tmp_path / "g.h5")
    assert (opts["--hidden"], opts["--layers"], opts["--dropout"], opts["--lr"], opts["--fanouts"],
            opts["--batch-size"], opts["--epochs"], opts["--seed"]) == \
        ("64", "3", "0.5", "0.006", "5,10,15", "500", "5", "7")


def test_fullgraph_comparison_without_a_working_peer_returns_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peers.DGL_ENV, str(_fake_dgl(tmp_path, ok=False)))
    rounds = []
    model_args = dict(arch="sage", in_dim=8, hidden=16, num_classes=3, num_layers=3, dropout=0.0, seed=0)
    c = peers.fullgraph_vs_dgl(tmp_path / "g.h5", model_args, 1, 3, 2,
                               lambda i: rounds.append(i) or {"epoch_s": 1.0, "epoch_mean_s": 1.0}, timeout=60)
    assert c is None and rounds == [0, 1]
    out = capsys.readouterr().out
    assert "DGL peer: peer_dgl.py failed (exit 1): ModuleNotFoundError: No module named dgl; going on" in out
    monkeypatch.setenv(peers.DGL_ENV, "")
    assert peers.fullgraph_vs_dgl(tmp_path / "g.h5", model_args, 1, 3, 2, lambda i: 1 / 0) is None


def _load_peer_dgl():
    spec = importlib.util.spec_from_file_location("peer_dgl_under_test", peers.DGL_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peer_reads_the_graph_file_as_hpcgnn_does(cora_graph, tmp_path):
    from hpcgnn.data.graph import read_graph

    mod = _load_peer_dgl()
    d = mod.read_graph_h5(str(cora_graph))
    g = read_graph(cora_graph)
    for key, ref in (("indptr", g.indptr), ("indices", g.indices), ("features", g.features),
                     ("labels", g.labels), ("train_mask", g.train_mask)):
        assert np.array_equal(d[key], ref), key
    assert d["num_classes"] == g.num_classes
    import h5py

    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        f.attrs["format"] = "hpcgnn-partitions"
    with pytest.raises(ValueError, match=r"bad.h5: format attribute is 'hpcgnn-partitions', expected 'hpcgnn-graph'"):
        mod.read_graph_h5(str(bad))


DGL_PYTHON = peers.DGL_VENV / "bin" / "python"


@pytest.mark.skipif(not (peers.DGL_VENV / ".peer-dgl-stamp").exists(), reason="no .venv-dgl (make peer-dgl)")
def test_real_dgl_peer_on_cora(cora_graph):
    mode = "minibatch"  # one run (importing torch 2.2 + DGL takes 5-40 s); the benchmarks run both modes
    args = [mode, "--graph", cora_graph, "--epochs", 2, "--hidden", 16, "--threads", 1, "--batch-size", 500]
    out = peers.run_peer(DGL_PYTHON, peers.DGL_SCRIPT, args, timeout=240, name="DGL peer")
    assert out["peer"] == "dgl" and out["mode"] == mode and out["dgl"].startswith("2.1")
    assert out["num_nodes"] == 2708 and out["epoch_s"] > 0 and len(out["epochs_s"]) == 2
    assert out["thp"] == "1" and out["dims"] == [1433, 16, 16, 7]
    assert out["iterations"] == 1  # Cora: 140 training vertices, batch 500


def test_aggregate_comparison_times_hpcgnn_and_keeps_the_peers_fastest(cora_graph, cora_parts, tmp_path, monkeypatch):
    py = tmp_path / "fake-python"
    py.write_text(f"#!{sys.executable}\nimport json, sys\n"
                  "a = sys.argv[sys.argv.index('--widths') + 1].split(',')\n"
                  "print(json.dumps({'argv': sys.argv[1:], 'widths': {w: {'fwd_s': 0.5 * int(w), 'bwd_s': 0.25}\n"
                  "                                                    for w in a}}))\n")
    py.chmod(0o755)
    monkeypatch.setenv(peers.DGL_ENV, str(py))
    store = cora_parts(1)
    agg = peers.aggregate_vs_dgl(cora_graph, store, [8, 16], reps=2, rounds=2, timeout=60)
    assert set(agg) == {"8", "16"}
    for w, r in agg.items():
        assert r["dgl_fwd_s"] == 0.5 * int(w) and r["dgl_bwd_s"] == 0.25
        assert 0 < r["hpcgnn_fwd_s"] < 10 and 0 < r["hpcgnn_bwd_s"] < 10
    monkeypatch.setenv(peers.DGL_ENV, str(_fake_dgl(tmp_path, ok=False)))
    assert peers.aggregate_vs_dgl(cora_graph, store, [8], reps=2, rounds=1, timeout=60) is None


def test_targets_are_printed_and_written_with_the_figures(tmp_path, capsys):
    import h5py
    c = {"hpcgnn_epoch_s": 1.0, "hpcgnn_epoch_mean_s": 1.4, "dgl_epoch_s": 2.0, "dgl_epoch_mean_s": 2.5,
         "hpcgnn_over_dgl": 0.5, "hpcgnn_over_dgl_mean": 0.56, "rounds_hpcgnn_epoch_s": [1.0, 1.1],
         "rounds_dgl_epoch_s": [2.0, 2.1], "dgl_version": "2.1.0", "dgl_torch": "2.2.1",
         "dgl_phases_min_s": {"forward": 0.9}, "hpcgnn_phases_min_s": {}, "dgl_top_ops": [], "hpcgnn_top_ops": []}
    out = {"fullgraph": dict(c), "minibatch": dict(c)}
    peers.print_targets(out, 0.25, "bf16")
    lines = capsys.readouterr().out.splitlines()
    assert "scale 0.25" in lines[0] and "train.precision=bf16" in lines[0]
    full, mini = (next(x for x in lines if x.strip().startswith(w)) for w in ("fullgraph", "minibatch"))
    assert full.endswith("<= 0.67 | yes / yes")          # 0.50x and 0.56x against 0.67
    assert mini.endswith("<= 0.50 | yes / no")           # 0.50x meets 0.5, the means (0.56x) do not
    path = tmp_path / "dgl.h5"
    peers.write_comparisons(path, out, {"scale": 0.25, "precision": "bf16"})
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "hpcgnn-bench-peers" and f.attrs["precision"] == "bf16"
        m = f["minibatch"]
        assert m.attrs["target"] == 0.5 and m.attrs["met_fastest"] and not m.attrs["met_mean"]
        assert list(m["rounds_dgl_epoch_s"][:]) == [2.0, 2.1] and m["dgl_phases_min_s"].attrs["forward"] == 0.9
        assert bool(f["fullgraph"].attrs["met_mean"]) and "hpcgnn_top_ops" not in f["fullgraph"]
