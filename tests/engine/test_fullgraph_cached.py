"""The full-graph engine with the halo cache and the pipeline, on 4 real MPI ranks (toy graph):
layer-0 caching is exact and resends only the uncached rows; with S = 1, 2, 4 (with and without
the pipeline) every recorded age is <= S and the bound is reached; hidden-layer rows are resent
once every S + 1 (pipelined: S) epochs; the loss stays close to exact training."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fg_cached_support import counter, per_layer, run_report  # noqa: E402
from mpiutil import run_mpi  # noqa: E402
from toygraph import toy_graph, toy_store  # noqa: E402

EPOCHS = 9
F, HIDDEN, LAYERS = 10, 8, 3

SCRIPT = r'''
import json, sys
import numpy as np, torch
from mpi4py import MPI
from hpcgnn.partition.store import read_meta, load_partition
from hpcgnn.comm.halo_cached import CacheSettings, CachedHalo
from hpcgnn.run.timer import PhaseTimer
from hpcgnn.engine.fullgraph import InMemoryFullGraph, build_local_graph, halo_layers
from hpcgnn.nn.models import build_model

store, out, epochs, F, HIDDEN, LAYERS = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
torch.set_num_threads(1)
comm = MPI.COMM_WORLD
from hpcgnn.comm.communicator_mpi import MpiCommunicator
plane = MpiCommunicator(comm)   # the data plane (halo exchanges)
r = comm.Get_rank()
meta = read_meta(store)
part = load_partition(store, r, meta)
# what every layer exchanges (exact or cached: GCN's source rows, min(in, out) wide)
widths = [w for _, w in halo_layers(build_model("gcn", meta.num_features, HIDDEN, meta.num_classes, LAYERS))]
row_bytes = 4 * sum(widths)
cases = {"exact": None,
         "layer0-budget": CacheSettings(cache=True, staleness=0, pipeline=False, budget_bytes=5 * row_bytes,
                                        device_bytes=2 * row_bytes),
         # the same forward path with nothing cached: every row sent every epoch
         "layer0-none": CacheSettings(cache=True, staleness=0, pipeline=False, budget_bytes=0)}
for s in (1, 2, 4):
    cases[f"S{s}"] = CacheSettings(cache=True, staleness=s, pipeline=False)
    cases[f"S{s}-pipe"] = CacheSettings(cache=True, staleness=s, pipeline=True, device_bytes=7 * row_bytes)
cases["exact-pipe"] = CacheSettings(cache=False, staleness=1, pipeline=True)
report = {"num_halo": comm.gather(part.num_halo, root=0)}
for name, st in cases.items():
    lg = build_local_graph(part, plane, fetch_halo=st is None or not st.cache)
    n_train = float(comm.allreduce(int(lg.masks["train"].sum())))
    model = build_model("gcn", meta.num_features, HIDDEN, meta.num_classes, LAYERS, dropout=0.0, seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    halo = None if st is None else CachedHalo(plane, lg.halo, st, widths, "cpu")
    runner = InMemoryFullGraph(model, lg, plane, "cpu", halo=halo)
    losses, reps = [], []
    for t in range(1, epochs + 1):
        runner.reset_stats()
        runner.begin_epoch(t)
        opt.zero_grad(set_to_none=True)
        loss = comm.allreduce(runner.train_step(PhaseTimer(), n_train)) / n_train
        for p in model.parameters():
            comm.Allreduce(MPI.IN_PLACE, p.grad.numpy())
        opt.step()
        losses.append(loss)
        if t in (3, epochs):
            model.eval()
            runner.predict()             # exact evaluation between epochs leaves the cache alone
            model.train()
        reps.append({"counters": runner.counters(),
                     "per_layer": {k: v.tolist() for k, v in runner.per_layer().items()}})
    runner.close()
    report[name] = {"loss": losses, "reps": comm.gather(reps, root=0)}
if r == 0:
    json.dump(report, open(out, "w"))
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_report(tmp_path_factory.mktemp("fgcached"), SCRIPT, EPOCHS, F, HIDDEN, LAYERS)



def test_layer0_cache_is_exact_and_resends_only_uncached_rows(report):
    # bitwise: cached layer-0 rows (S = 0) equal rows sent every epoch, through the same forward
    assert report["layer0-budget"]["loss"] == report["layer0-none"]["loss"]
    # and the exact engine's loss (which may aggregate layer 0 in another order: to rounding)
    np.testing.assert_allclose(report["layer0-budget"]["loss"], report["exact"]["loss"], rtol=1e-6, atol=0)
    assert (per_layer(report, "layer0-none", "halo_rows_received")[:, :, 0]
            == np.array(report["num_halo"])[None, :]).all()                 # nothing cached there
    halo = np.array(report["num_halo"])
    assert halo.min() > 5
    uncached = halo - np.minimum(halo, 5)                                    # 5 rows fit the budget
    got0 = per_layer(report, "layer0-budget", "halo_rows_received")[:, :, 0]   # [epoch, rank]
    assert np.array_equal(got0[0], halo)                                     # epoch 1: all of them
    sent_bytes = per_layer(report, "layer0-budget", "halo_fwd_bytes")[:, :, 0].sum(axis=1)
    for e in range(1, EPOCHS):
        assert np.array_equal(got0[e], uncached)                             # then the uncached only
        assert sent_bytes[e] == uncached.sum() * 4 * F                       # the rows alone
    dev = per_layer(report, "layer0-budget", "halo_hits_device")[1:, :, 0]
    host = per_layer(report, "layer0-budget", "halo_hits_host")[1:, :, 0]
    assert (dev == 2).all() and (host == 3).all()                            # tiers: 2 + 3 rows
    # S = 0: hidden layers are sent in full every epoch
    got = per_layer(report, "layer0-budget", "halo_rows_received")[:, :, 1:]
    assert (got == halo[None, :, None]).all()
    # with every row cached, layer 0 costs nothing after epoch 1
    assert (per_layer(report, "S1", "halo_fwd_bytes")[1:, :, 0] == 0).all()


@pytest.mark.parametrize("s", [1, 2, 4])
@pytest.mark.parametrize("pipe", [False, True])
def test_every_recorded_age_is_within_the_bound(report, s, pipe):
    case = f"S{s}-pipe" if pipe else f"S{s}"
    halo = np.array(report["num_halo"])
    used = per_layer(report, case, "halo_rows_used")
    assert (used == halo[None, :, None]).all()
    assert (per_layer(report, case, "halo_age_over_bound") == 0).all()
    ages = per_layer(report, case, "halo_age_max")
    assert ages.max() <= s and (ages[:, :, 0] == 0).all()                  # layer 0 is exact
    assert ages[:, :, 1:].max() == s                                        # the bound is used
    hist = sum(per_layer(report, case, f"halo_age_{a}") for a in range(max(s, 1) + 1))
    assert (hist == used).all()
    sent = per_layer(report, case, "halo_rows_received")[:, :, 1:]
    period = s if pipe else s + 1
    if pipe:      # pipelined: one epoch old at best
        assert (per_layer(report, case, "halo_age_0")[1:, :, 1:] == 0).all()
    # hidden rows arrive in epoch 1 and then once every `period` epochs (pipelined: the rows
    # sent at epochs 1 + kS, k >= 1, arrive one epoch later)
    sends = (sent == halo[None, :, None]).all(axis=(1, 2))
    assert ((sent == 0) | (sent == halo[None, :, None])).all()
    expect = [t == 1 or (t >= s + 2 and (t - 2) % s == 0) if pipe else (t - 1) % period == 0
              for t in range(1, EPOCHS + 1)]
    assert sends.tolist() == expect, (case, sends.tolist())
    dev = per_layer(report, case, "halo_hits_device")
    host = per_layer(report, case, "halo_hits_host")
    if pipe:
        assert (dev <= 7).all() and host.sum() > 0
    else:
        assert host.sum() == 0 and dev.sum() > 0
    # the training loss stays close to exact training
    exact, got = np.array(report["exact"]["loss"]), np.array(report[case]["loss"])
    assert got[0] == exact[0] and abs(got[-1] - exact[-1]) < 0.05 * exact[-1]


def test_nocache_bytes_are_the_exact_runs_and_the_adjoints_match(report):
    """``halo_fwd_nocache_bytes`` of every cached or pipelined case is the exact run's
    ``halo_fwd_bytes`` (same store, seed and model: every epoch, every rank), and the adjoint
    bytes of both modes are the same (gradients of the same rows, never cached)."""
    exact_fwd = counter(report, "exact", "halo_fwd_bytes")
    exact_adj = counter(report, "exact", "halo_adjoint_bytes")
    assert exact_fwd.shape == (EPOCHS, 4) and exact_fwd.min() > 0 and exact_adj.min() > 0
    for case in [c for c in report if c not in ("exact", "num_halo")]:
        assert np.array_equal(counter(report, case, "halo_fwd_nocache_bytes"), exact_fwd), case
        assert np.array_equal(counter(report, case, "halo_adjoint_bytes"), exact_adj), case


@pytest.mark.parametrize("s", [1, 2, 4])
@pytest.mark.parametrize("pipe", [False, True])
def test_steady_state_forward_bytes_per_layer_against_exact(report, s, pipe):
    """Epochs 2-9, every halo row cached: each hidden layer sends exactly 1/S of the exact
    exchange's bytes pipelined (S divides the 8 epochs), at most 1/(S + 1) without the pipeline;
    layer 0 sends nothing (the exact engine sends it once, at start-up)."""
    case = f"S{s}-pipe" if pipe else f"S{s}"
    fwd = per_layer(report, case, "halo_fwd_bytes")[1:].sum(axis=(0, 1))         # [layer]
    exact = per_layer(report, case, "halo_fwd_nocache_bytes")[1:].sum(axis=(0, 1))
    assert fwd[0] == 0 and exact[0] == 0 and (exact[1:] > 0).all()
    if pipe:
        assert np.array_equal(s * fwd[1:], exact[1:]), (fwd, exact)
    else:
        assert ((s + 1) * fwd[1:] <= exact[1:]).all(), (fwd, exact)


def test_pipeline_without_cache_uses_rows_one_epoch_old(report):
    halo = np.array(report["num_halo"])
    ages1 = per_layer(report, "exact-pipe", "halo_age_1")
    assert (ages1[1:, :, 1:] == halo[None, :, None]).all()          # from epoch 2: every row age 1
    assert (per_layer(report, "exact-pipe", "halo_age_0")[0, :, 1:] == halo[:, None]).all()
    assert (per_layer(report, "exact-pipe", "halo_hits_device") == 0).all()
    got = per_layer(report, "exact-pipe", "halo_rows_received")[:, :, 1:]
    assert (got == halo[None, :, None]).all()       # epoch 1 blocking, then the pipelined messages
    sent = per_layer(report, "exact-pipe", "halo_rows_sent")[:, :, 1:].sum(axis=1)
    assert (sent[0] == 2 * halo.sum()).all() and (sent[1:] == halo.sum()).all()


CLI_CONFIG = """
[model]
arch = "gcn"
hidden = 8
layers = 2
dropout = 0.0
[train]
engine = "fullgraph"
epochs = 4
lr = 0.02
seed = 3
eval_every = 2
checkpoint_every = 2
[fullgraph]
halo = "cached"
staleness = 2
pipeline = true
cache_memory = "2KiB"
cache_device_memory = "1KiB"
"""


def test_train_report_and_resume_with_cached_pipelined_halo(tmp_path):
    from mpiutil import run_cli

    from hpcgnn.run.runfile import read_run

    g = toy_graph(200, 6.0, num_features=F, num_classes=4, seed=2)
    store = toy_store(tmp_path / "p2", g, 2, seed=2)
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLI_CONFIG)
    env = {"HPCGNN_THREADS": "1"}

    def train(run, *extra):
        return run_mpi(2, ["-m", "hpcgnn", "train", "--config", cfg, "--set", f"data.partitions={store}",
                           "--set", f"output.dir={run}", *extra], timeout=240, env=env)

    p = train(tmp_path / "b", "--set", "train.epochs=2")
    assert p.returncode == 0, p.stderr[-3000:]
    b = read_run(tmp_path / "b")
    assert b["attrs"]["fullgraph_halo"] == "cached" and bool(b["attrs"]["fullgraph_pipeline"])
    pl = b["per_layer"]
    assert pl["halo_age_max"].shape == (2, 2, 2) and (pl["halo_age_over_bound"] == 0).all()
    assert (pl["halo_age_max"][:, :, 1] == [[0, 0], [1, 1]]).all()   # blocking, then pipelined
    # a row is the features and layer 1's source rows (GCN 8 -> 4 classes: the projection, 4
    # wide, what the exact exchange sends): a 2 KiB budget holds 2048 // (4 * (F + 4)) rows per
    # rank, 1 KiB of them on the device tier
    cap, dev = 2048 // (4 * (F + 4)), 1024 // (4 * (F + 4))
    assert (b["counters"]["halo_cache_device_bytes"] == dev * 4 * (F + 4)).all()
    assert (b["counters"]["halo_cache_host_bytes"] == (cap - dev) * 4 * (F + 4)).all()
    assert (pl["halo_hits_device"][1, :, 0] == dev).all() and (pl["halo_hits_host"][1, :, 0] == cap - dev).all()
    assert np.isfinite(b["metrics"]["test_acc"][1])                   # exact evaluation ran
    rep = run_cli(["report", tmp_path / "b", "--plot", tmp_path / "b.png"], timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert "halo cache: fullgraph.halo cached staleness 2 pipeline True" in rep.stdout
    assert "age_L1" in rep.stdout and "chit_L0%" in rep.stdout
    assert "layers" in rep.stdout.strip().splitlines()[-1] and (tmp_path / "b.png").stat().st_size > 0
    # resume: the cache is soft state (its settings may change); the first epoch after the
    # checkpoint fetches fresh rows
    # (and the wire format: bf16 hidden-layer rows from the resumed epochs on)
    p = train(tmp_path / "b", "--resume", "--set", "fullgraph.staleness=4", "--set", "fullgraph.halo_precision=bf16")
    assert p.returncode == 0, p.stderr[-3000:]
    b = read_run(tmp_path / "b")
    assert b["metrics"]["loss"].shape == (4,) and b["attrs"]["status"] == "finished"
    assert b["attrs"]["fullgraph_halo_precision"] == "bf16"
    ages = b["per_layer"]["halo_age_max"][:, :, 1]
    assert (ages[2] == 0).all() and (ages[3] == 1).all()           # epoch 3 cold (blocking), 4 pipelined
    assert b["metrics"]["loss"][3] < b["metrics"]["loss"][0]
    fwd, sent = b["per_layer"]["halo_fwd_bytes"][:, :, 1], b["per_layer"]["halo_rows_sent"][:, :, 1]
    assert sent.min() > 0
    assert (fwd[:2] == sent[:2] * 4 * 4).all() and (fwd[2:] == sent[2:] * 2 * 4).all()


def test_run_files_nocache_bytes_equal_the_exact_runs_forward_bytes(tmp_path):
    """Through ``hpcgnn train`` (SAGE 3 layers, 2 ranks, same store and seed): the cached run's
    ``counters/halo_fwd_nocache_bytes`` equal the exact run's ``counters/halo_fwd_bytes`` every
    epoch on every rank, and both runs send the same adjoint bytes; the cached run keeps what the
    exact one sends (layer 2, 8 -> 4 classes: its 4-wide projection)."""
    from hpcgnn.run.runfile import read_run

    g = toy_graph(200, 6.0, num_features=F, num_classes=4, seed=5)
    store = toy_store(tmp_path / "p2", g, 2, seed=5)
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLI_CONFIG.replace('arch = "gcn"', 'arch = "sage"').replace("layers = 2", "layers = 3")
                   .replace("epochs = 4", "epochs = 5").replace('cache_memory = "2KiB"', 'cache_memory = "all"')
                   .replace('cache_device_memory = "1KiB"', 'cache_device_memory = "all"'))
    runs = {}
    for name, sets in (("exact", ["fullgraph.halo=exact", "fullgraph.pipeline=false"]), ("cached", [])):
        args = ["-m", "hpcgnn", "train", "--config", cfg, "--set", f"data.partitions={store}",
                "--set", f"output.dir={tmp_path / name}"]
        for x in sets:
            args += ["--set", x]
        p = run_mpi(2, args, timeout=240, env={"HPCGNN_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = read_run(tmp_path / name)
    e, c = runs["exact"]["counters"], runs["cached"]["counters"]
    assert e["halo_fwd_bytes"].shape == (5, 2) and e["halo_fwd_bytes"].min() > 0
    assert np.array_equal(c["halo_fwd_nocache_bytes"], e["halo_fwd_bytes"])
    assert np.array_equal(c["halo_adjoint_bytes"], e["halo_adjoint_bytes"]) and e["halo_adjoint_bytes"].min() > 0
    pl = runs["cached"]["per_layer"]
    # (on 2 ranks one rank sends the rows the other uses)
    assert (pl["halo_fwd_nocache_bytes"][:, :, 2] == 4 * 4 * pl["halo_rows_used"][:, ::-1, 2]).all()
    # S = 2 pipelined, every row cached: epochs 2-5 send half of exact's hidden-layer bytes
    assert 2 * c["halo_fwd_bytes"][1:].sum() == e["halo_fwd_bytes"][1:].sum()


@pytest.mark.parametrize("sets,match", [
    (["fullgraph.offload=true", "fullgraph.halo=cached"], "run in memory only"),
    (["fullgraph.pipeline=true", "fullgraph.staleness=0"], "fullgraph.staleness = 0 with fullgraph.pipeline"),
    (["fullgraph.halo=cached", "fullgraph.cache_memory=lots"], "fullgraph.cache_memory = 'lots'"),
    (["fullgraph.staleness=-1"], "fullgraph.staleness"),
])
def test_bad_cache_settings_are_one_line_errors(sets, match):
    from hpcgnn.errors import InputError
    from hpcgnn.run.config import load_config

    with pytest.raises(InputError, match=match) as e:
        load_config(None, ["train.engine=fullgraph", "data.partitions=x", *sets])
    assert "\n" not in str(e.value)
