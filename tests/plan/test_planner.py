"""`hpcgnn plan`: the planner's logic with a calibration given explicitly (nothing measured here).

Rejection with the reason, ordering from given rates, the written TOML (loads with
hpcgnn.run.config, is the top candidate), one-line errors with exit code 2.
"""
from __future__ import annotations

import json
import math
import socket

import pytest

from hpcgnn.cli import main
from hpcgnn.errors import InputError
from hpcgnn.plan.calibrate import FORMAT, VERSION, Calibration, read_file, write_file
from hpcgnn.plan.estimator import scaled_shapes, store_shapes
from hpcgnn.plan.planner import make_plan, write_recommended
from hpcgnn.plan.topology import Topology
from hpcgnn.run.config import load_config

CONFIG = """
[model]
arch = "gcn"
hidden = 32
layers = 2
[train]
engine = "minibatch"
epochs = 2
[minibatch]
fanouts = [5, 5]
batch_size = 64
"""

RATES = dict(agg={16: 1e9, 48: 2e9, 128: 3e9, 256: 3e9}, gemm_flops=2e10, stream=1e10, gather=5e9,
             op_overhead_s=0.0, alltoall=1e9, alltoall_latency_s=0.0, alltoall_source="test",
             baseline_rss=200 << 20)


def calibration(**changes) -> Calibration:
    d = {**RATES, **changes}
    return Calibration(host=socket.gethostname(), cores=2, **d)


def topology(ranks=2, host_memory=64 << 30, device="cpu", device_memory=0) -> Topology:
    return Topology(host="test", ranks=ranks, ranks_per_node=ranks, cores=2, host_memory=host_memory,
                    host_memory_source="test", device=device, device_memory=device_memory)


@pytest.fixture(scope="module")
def setup(cora_parts, tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    cfg = d / "cfg.toml"
    cfg.write_text(CONFIG)
    cal = d / "cal.json"
    write_file(cal, {socket.gethostname(): calibration().to_json()})
    return cora_parts(2), cfg, cal, d


def _plan(setup, **kw):
    store, cfg, _, _ = setup
    cal = kw.pop("cal", calibration())
    topo = kw.pop("topo", topology())
    return make_plan(cfg, kw.pop("sets", []), store, topo, cal, (2, 4), None, kw.pop("any_model", False))


def test_every_engine_proposed_and_ranked_by_predicted_time(setup):
    plan = _plan(setup)
    labels = [r.candidate.label for r in plan.rows]
    for want in ("minibatch hec", "minibatch exact", "fullgraph in-memory", "fullgraph offload k=2",
                 "fullgraph offload k=4", "tensor decoupled", "tensor coupled"):
        assert want in labels
    ranked = sorted((r for r in plan.rows if r.order), key=lambda r: r.order)
    assert [r.order for r in ranked] == list(range(1, len(ranked) + 1))
    times = [r.pred.epoch_s for r in ranked]
    assert times == sorted(times) and all(t > 0 for t in times)
    # the recommendation trains the configured model unless any_model: the decoupled tensor
    # mode is ranked, marked, and recommended only with any_model
    assert plan.best is next(r for r in ranked if not r.candidate.model_change)
    dec = next(r for r in plan.rows if r.candidate.label == "tensor decoupled")
    assert dec.candidate.model_change and "decoupled model" in dec.reason and "--any-model" in dec.reason
    assert not any(r.candidate.model_change for r in plan.rows if r.candidate.label != "tensor decoupled")
    fast_agg = _plan(setup, cal=calibration(gemm_flops=1e15, agg={16: 1e15, 256: 1e15}), any_model=True)
    assert fast_agg.best.order == 1
    # the memory is the project's estimate with the calibrated baseline
    for r in ranked:
        assert r.pred.terms["baseline"] == 200 << 20
        assert r.pred.host_peak == sum(r.pred.terms.values())
        assert r.pred.host_node >= r.pred.host_peak


def test_rates_scale_times_and_slow_network_ranks_by_bytes(setup):
    base = {r.candidate.label: r.pred for r in _plan(setup).rows if r.pred}
    fast = {k: v * 2 if not isinstance(v, (dict, str)) else {w: x * 2 for w, x in v.items()}
            for k, v in RATES.items() if k in ("agg", "gemm_flops", "stream", "gather", "alltoall")}
    doubled = {r.candidate.label: r.pred for r in _plan(setup, cal=calibration(**fast)).rows if r.pred}
    for k, p in base.items():      # no latency or op overhead: every time halves exactly
        assert doubled[k].epoch_s == pytest.approx(p.epoch_s / 2, rel=1e-9)
        assert doubled[k].bytes_per_epoch == p.bytes_per_epoch
    # a network of 1 kB/s: communication dominates, so the order is the order of bytes sent
    # (blocking exchanges: a pipelined halo, where the engine has one, overlaps its bytes)
    slow = _plan(setup, cal=calibration(alltoall=1e3))
    ranked = sorted((r for r in slow.rows if r.order and "pipelined" not in r.candidate.label),
                    key=lambda r: r.order)
    sent = [r.pred.bytes_per_epoch for r in ranked]
    assert sent == sorted(sent)
    assert ranked[0].pred.parts["comm"] > 0.9 * ranked[0].pred.epoch_s or sent[0] == 0
    # one rank: nothing is sent and the halo modes cost the same
    one = {r.candidate.label: r.pred for r in _plan(setup, topo=topology(ranks=1)).rows if r.pred}
    assert all(p.bytes_per_epoch == 0 for p in one.values())
    assert one["minibatch hec"].epoch_s == pytest.approx(one["minibatch exact"].epoch_s)


def test_rejects_what_does_not_fit_with_the_reason(setup):
    plan = _plan(setup)
    needs = sorted(r.pred.host_node for r in plan.rows if r.pred)
    limit = (needs[0] + needs[-1]) // 2
    assert needs[0] < limit < needs[-1]
    small = _plan(setup, topo=topology(host_memory=limit))
    by = {r.candidate.label: r for r in plan.rows}
    for r in small.rows:
        if not r.pred:
            continue
        if by[r.candidate.label].pred.host_node > limit:
            assert not r.fits and r.order == 0
            assert r.reason.startswith("host memory: 2 rank(s) per node need")
            assert r.pred.largest[0] in r.reason and "shrink with" in r.reason
        else:
            assert r.fits and r.order > 0
    # a device budget below the CUDA context rejects every GPU candidate, naming the largest term
    gpu = _plan(setup, topo=topology(device="cuda", device_memory=64 << 20))
    for r in gpu.rows:
        assert not r.fits
        assert r.reason.startswith("device memory:") and "largest term" in r.reason, r.reason
    # nothing fits: no recommendation, and writing one is refused in one line
    none = _plan(setup, topo=topology(host_memory=1 << 20))
    assert none.best is None
    with pytest.raises(InputError, match="no candidate fits"):
        write_recommended(setup[3] / "never.toml", none)
    assert not (setup[3] / "never.toml").exists()


def test_invalid_combinations_are_listed_not_ranked(setup):
    plan = _plan(setup, sets=["model.arch=gat", "model.heads=2"])
    coupled = next(r for r in plan.rows if r.candidate.label == "tensor coupled")
    assert not coupled.fits and coupled.order == 0
    assert coupled.reason.startswith("invalid:") and "tensor.mode = 'coupled'" in coupled.reason


def test_command_writes_the_top_candidate(setup, capsys):
    store, cfg, cal, d = setup
    out = d / "recommended.toml"
    rc = main(["plan", str(store), "--config", str(cfg), "--calibration", str(cal), "--no-calibrate",
               "--chunks", "2,4", "--host-memory", "64GiB", "--out", str(out), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    top = next(c for c in res["candidates"] if c["order"] == 1)
    assert res["recommended"] == top["label"] and res["written"] == str(out)
    loaded = load_config(out)
    assert loaded.train.engine == top["engine"]
    for key, value in top["overrides"].items():
        section, name = key.split(".")
        assert getattr(getattr(loaded, section), name) == value
    assert loaded.data.partitions == str(store)
    assert loaded.model.hidden == 32 and loaded.minibatch.fanouts == [5, 5]   # the user's settings kept
    # the text table names every candidate with its reason
    rc = main(["plan", str(store), "--config", str(cfg), "--calibration", str(cal), "--no-calibrate",
               "--host-memory", "64GiB"])
    text = capsys.readouterr().out
    assert rc == 0 and "recommended:" in text and "fullgraph offload k=16" in text


def test_scaled_shapes(setup):
    from hpcgnn.partition.store import read_meta

    meta = read_meta(setup[0])
    shapes = store_shapes(meta)
    assert scaled_shapes(meta, shapes, 2) is shapes
    four = scaled_shapes(meta, shapes, 4)
    assert len(four) == 4
    s = four[0]
    assert meta.num_nodes / 4 <= s["num_solid"] <= meta.num_nodes / 4 * 1.2
    assert 0 < s["num_halo"] <= meta.num_nodes - s["num_solid"]
    assert s["num_halo"] > min(x["num_halo"] for x in shapes) / 2      # more parts, more cut per vertex
    plan = _plan(setup, topo=topology(ranks=4))
    assert plan.notes and "--parts 4" in plan.notes[0]


def test_calibration_file_round_trip_and_interpolation(tmp_path):
    c = calibration()
    path = tmp_path / "c.json"
    write_file(path, {"h1": c.to_json()})
    back = Calibration.from_json(read_file(path)["h1"], "x")
    assert back == c
    assert back.agg_rate(16) == 1e9 and back.agg_rate(128) == 3e9 and back.agg_rate(4) == 1e9
    assert 1e9 < back.agg_rate(30) < 2e9 and back.agg_rate(1000) == 3e9
    assert back.agg_rate(math.sqrt(16 * 48)) == pytest.approx(math.sqrt(1e9 * 2e9))


@pytest.mark.parametrize("args, fragment", [
    (["--ranks", "0"], "--ranks 0"),
    (["--host-memory", "lots"], "--host-memory"),
    (["--chunks", "2,x"], "--chunks"),
    (["--device-memory", "8GiB"], "--device-memory"),
    (["--engines", "magic"], "--engines 'magic'"),
])
def test_bad_input_one_line_exit_2(setup, capsys, args, fragment):
    store, cfg, cal, _ = setup
    rc = main(["plan", str(store), "--config", str(cfg), "--calibration", str(cal), "--no-calibrate", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("hpcgnn: error:") and fragment in err


def test_bad_files_one_line_exit_2(setup, capsys, tmp_path):
    store, cfg, cal, _ = setup
    bad_cal = tmp_path / "bad.json"
    bad_cal.write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                   "hosts": {socket.gethostname(): {"host": "x"}}}))
    cases = [
        ([str(tmp_path / "nostore"), "--config", str(cfg), "--calibration", str(cal)], "not a partition directory"),
        ([str(store), "--config", str(tmp_path / "none.toml"), "--calibration", str(cal)], "config file not found"),
        ([str(store), "--config", str(cfg), "--calibration", str(bad_cal)], "calibration entry lacks"),
        ([str(store), "--config", str(cfg), "--calibration", str(tmp_path / "empty.json"), "--no-calibrate"],
         "no calibration for host"),
        ([str(store), "--config", str(cfg), "--calibration", str(cal), "--out", str(tmp_path / "no" / "x.toml")],
         "does not exist"),
    ]
    for args, fragment in cases:
        rc = main(["plan", *args])
        err = capsys.readouterr().err
        assert rc == 2, args
        assert err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "no").exists()


def test_cuda_plan_ranks_the_tensor_engine_and_drops_what_the_device_cannot_hold(setup):
    """With --device cuda the tensor engine is estimated and ranked like the others; a GPU
    smaller than a candidate's device estimate (hpcgnn.engine.estimate.estimate_device_memory, the
    figure train's pre-run check uses) drops exactly the candidates above it."""
    big = _plan(setup, topo=topology(device="cuda", device_memory=80 << 30))
    tensor = [r for r in big.rows if r.candidate.engine == "tensor" and not r.candidate.invalid]
    assert tensor and all(r.fits and r.order > 0 for r in tensor), [r.reason for r in tensor]
    assert all(r.pred.device_peak > (600 << 20) for r in tensor)         # the context and more
    peaks = sorted(r.pred.device_peak for r in big.rows if r.pred)
    # a GPU between the smallest and the largest device estimate: the smaller fit, the larger not
    limit = (peaks[0] + peaks[-1]) // 2
    assert peaks[0] < limit < peaks[-1]
    mid = _plan(setup, topo=topology(device="cuda", device_memory=limit))
    by = {r.candidate.label: r for r in big.rows}
    for r in mid.rows:
        if not r.pred:
            continue
        # 'auto' stores are sized to the GPU: a smaller GPU never raises a candidate's estimate
        assert r.pred.device_peak <= by[r.candidate.label].pred.device_peak
        if r.pred.device_peak > limit:
            assert not r.fits and r.reason.startswith("device memory:")
        else:
            assert r.fits and r.order > 0
    assert any(not r.fits for r in mid.rows if r.pred) and any(r.fits for r in mid.rows)
