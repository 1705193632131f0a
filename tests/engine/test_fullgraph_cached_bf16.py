"""bfloat16 hidden-layer halo rows (``fullgraph.halo_precision = "bf16"``) on 4 real MPI ranks
(toy graph, GCN 3 layers): training equals, bit for bit, a float32 reference whose owners round
the hidden rows they send to bfloat16 themselves (numpy bit arithmetic, independent of torch's
conversion), for the exact exchange, the cache with S = 0 and the cache with S = 2 + pipeline;
hidden-layer row bytes are exactly half of float32's, layer 0 unchanged;
evaluation stays float32; a bad value is refused with one line and exit 2 on every rank."""
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

EPOCHS = 6
F, HIDDEN, LAYERS = 10, 8, 3

SCRIPT = r'''
import hashlib, json, sys
import numpy as np, torch
from mpi4py import MPI
from hpcgnn.partition.store import read_meta, load_partition
from hpcgnn.comm.halo import ExactHalo
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


def round_bf16(x):
    """float32 -> nearest bfloat16 (ties to even), kept as float32: bit arithmetic on the words."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


class RefExact(ExactHalo):
    """float32 wire; the owner rounds its hidden-layer training rows to bfloat16 values first."""
    def fetch_tensor(self, layer, h_solid):
        if layer > 0 and not self._eval:
            h_solid = torch.from_numpy(round_bf16(h_solid.numpy()))
        return super().fetch_tensor(layer, h_solid)


class RefCached(CachedHalo):
    def fetch(self, layer, solid_rows):
        if layer > 0 and not self._exact:
            solid_rows = round_bf16(solid_rows)
        return super().fetch(layer, solid_rows)


def cached(s, pipe, prec, cls=CachedHalo):
    return lambda lg: cls(plane, lg.halo, CacheSettings(cache=True, staleness=s, pipeline=pipe, precision=prec),
                          widths, "cpu")


cases = {"exact": (lambda lg: ExactHalo(plane, lg.halo), True),
         "exact-bf16": (lambda lg: ExactHalo(plane, lg.halo, precision="bf16"), True),
         "exact-ref": (lambda lg: RefExact(plane, lg.halo), True),
         "S0-bf16": (cached(0, False, "bf16"), False),
         "S0-ref": (cached(0, False, "fp32", RefCached), False),
         "S2-pipe": (cached(2, True, "fp32"), False),
         "S2-pipe-bf16": (cached(2, True, "bf16"), False),
         "S2-pipe-ref": (cached(2, True, "fp32", RefCached), False)}
report = {}
for name, (make, fetch_x0) in cases.items():
    lg = build_local_graph(part, plane, fetch_halo=fetch_x0)
    n_train = float(comm.allreduce(int(lg.masks["train"].sum())))
    model = build_model("gcn", meta.num_features, HIDDEN, meta.num_classes, LAYERS, dropout=0.0, seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    # evaluation (fp32) before training, by a runner of its own (a cache's evaluation would
    # prefetch layer 0)
    model.eval()
    ev = InMemoryFullGraph(model, lg, plane, "cpu", halo=make(build_local_graph(part, plane, fetch_x0)))
    before = hashlib.sha256(ev.predict().numpy().tobytes()).hexdigest()
    ev.close()
    model.train()
    runner = InMemoryFullGraph(model, lg, plane, "cpu", halo=make(lg))
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
        reps.append({"counters": runner.counters(),
                     "per_layer": {k: v.tolist() for k, v in runner.per_layer().items()}})
    runner.close()
    report[name] = {"loss": losses, "reps": comm.gather(reps, root=0),
                    "predict_before": comm.gather(before, root=0)}
if r == 0:
    json.dump(report, open(out, "w"))
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_report(tmp_path_factory.mktemp("fgbf16"), SCRIPT, EPOCHS, F, HIDDEN, LAYERS)



def test_bf16_training_equals_a_reference_that_rounds_the_rows_itself(report):
    ref = report["exact-ref"]["loss"]
    assert report["exact-bf16"]["loss"] == ref                     # bitwise, every epoch
    assert report["S0-bf16"]["loss"] == report["S0-ref"]["loss"]   # the cache with S = 0 too
    assert report["S2-pipe-bf16"]["loss"] == report["S2-pipe-ref"]["loss"]
    # the rounding is real: float32 rows give other losses
    assert report["exact-bf16"]["loss"] != report["exact"]["loss"]
    assert report["S2-pipe-bf16"]["loss"] != report["S2-pipe"]["loss"]
    # and small: the training loss stays within 1 % of float32 training
    exact, got = np.array(report["exact"]["loss"]), np.array(report["exact-bf16"]["loss"])
    assert np.abs(got - exact).max() < 0.01 * exact.max()
    # the staleness bound holds with bf16 rows
    assert (per_layer(report, "S2-pipe-bf16", "halo_age_max") <= 2).all()
    assert (per_layer(report, "S2-pipe-bf16", "halo_age_over_bound") == 0).all()


def test_evaluation_stays_fp32(report):
    # the same logits as float32 providers of the same kind (the exact engine may aggregate
    # layer 0 in another order than the cached one, so kinds are compared apart)
    assert report["exact-bf16"]["predict_before"] == report["exact"]["predict_before"]
    for case in ("S0-bf16", "S2-pipe-bf16"):
        assert report[case]["predict_before"] == report["S2-pipe"]["predict_before"], case


def test_bf16_halves_the_hidden_row_bytes_and_leaves_layer0_alone(report):
    fp32 = counter(report, "exact", "halo_fwd_bytes")
    bf16 = counter(report, "exact-bf16", "halo_fwd_bytes")
    assert fp32.min() > 0 and (2 * bf16 == fp32).all()             # every epoch, every rank
    a, b = "S2-pipe", "S2-pipe-bf16"
    fwd_a, fwd_b = per_layer(report, a, "halo_fwd_bytes"), per_layer(report, b, "halo_fwd_bytes")
    rows_a, rows_b = per_layer(report, a, "halo_rows_sent"), per_layer(report, b, "halo_rows_sent")
    assert np.array_equal(rows_a, rows_b)                           # the same rows on the same schedule
    assert np.array_equal(fwd_a[:, :, 0], fwd_b[:, :, 0]) and fwd_a[0, :, 0].sum() > 0  # layer 0: fp32
    # the rows alone (no positions): GCN's source rows, 8 -> 8 and 8 -> 4 classes wide
    assert np.array_equal(2 * fwd_b[:, :, 1:], fwd_a[:, :, 1:]) and fwd_a[:, :, 1:].sum() > 0
    assert np.array_equal(fwd_a[:, :, 1:], 4 * np.array([HIDDEN, min(HIDDEN, 4)]) * rows_a[:, :, 1:])
    noc_a = per_layer(report, a, "halo_fwd_nocache_bytes")
    noc_b = per_layer(report, b, "halo_fwd_nocache_bytes")
    assert (noc_a[:, :, 0] == 0).all() and (noc_b[:, :, 0] == 0).all()   # exact sends layer 0 at start-up
    assert np.array_equal(2 * noc_b[:, :, 1:], noc_a[:, :, 1:])
    # "without the cache" is what the exact exchange sends, in either wire format
    assert np.array_equal(counter(report, a, "halo_fwd_nocache_bytes"), fp32)
    assert np.array_equal(counter(report, b, "halo_fwd_nocache_bytes"), bf16)


BAD_DRIVER = r'''
import sys
from hpcgnn.cli import main
from hpcgnn.supervisor import launcher_rank
try:
    rc = main(sys.argv[2:])
except SystemExit as exc:           # the runtime's failure policy leaves by SystemExit
    rc = exc.code
open(f"{sys.argv[1]}/rank-{launcher_rank()}", "w").write(str(rc))
sys.exit(rc)
'''


def test_bad_precision_exits_2_with_one_line_on_every_rank(tmp_path):
    g = toy_graph(60, 4.0, num_features=F, num_classes=3, seed=1)
    store = toy_store(tmp_path / "p2", g, 2, seed=1)
    script = tmp_path / "bad.py"
    script.write_text(BAD_DRIVER)
    codes = tmp_path / "codes"
    codes.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nengine = "fullgraph"\nepochs = 2\n')
    proc = run_mpi(2, [script, codes, "train", "--config", cfg, "--set",
                       f"data.partitions={store}", "--set", f"output.dir={tmp_path / 'run'}",
                       "--set", "fullgraph.halo_precision=fp16"], timeout=240)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert {p.name: p.read_text() for p in codes.iterdir()} == {"rank-0": "2", "rank-1": "2"}
    lines = set(proc.stderr.strip().splitlines())
    assert lines == {f"hpcgnn: error: {cfg}: fullgraph.halo_precision = 'fp16', expected one of 'fp32', "
                     "'bf16'"}, proc.stderr
    assert not (tmp_path / "run").exists()


def test_train_exact_bf16_through_the_config(tmp_path):
    from hpcgnn.partition.store import load_partition
    from hpcgnn.run.runfile import read_run

    g = toy_graph(120, 5.0, num_features=F, num_classes=3, seed=3)
    store = toy_store(tmp_path / "p2", g, 2, seed=3)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\narch = "sage"\nhidden = 6\nlayers = 3\n[train]\nengine = "fullgraph"\n'
                   'epochs = 2\neval_every = 1\n[fullgraph]\nhalo_precision = "bf16"\n')
    proc = run_mpi(2, ["-m", "hpcgnn", "train", "--config", cfg, "--set", f"data.partitions={store}",
                       "--set", f"output.dir={tmp_path / 'run'}"], timeout=240, env={"HPCGNN_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(tmp_path / "run")
    assert run["attrs"]["fullgraph_halo_precision"] == "bf16" and run["attrs"]["fullgraph_halo"] == "exact"
    rows_sent = [load_partition(store, p).send_ids.shape[0] for p in range(2)]
    # training's forward bytes at 2 bytes a value, every epoch (the evaluation's fp32 exchanges
    # are not training's): layer 1's input rows (6 -> 6, width 6) and layer 2's projection
    # (6 -> 3 classes: the owners project, width 3)
    assert (run["counters"]["halo_fwd_bytes"] == [[r * (6 + 3) * 2 for r in rows_sent]] * 2).all()
    assert np.isfinite(run["metrics"]["test_acc"]).all()


def test_offload_with_bf16_is_refused():
    from hpcgnn.errors import InputError
    from hpcgnn.run.config import load_config

    with pytest.raises(InputError, match="halo_precision = 'bf16': reduced-precision halo rows run in "
                                         "memory only") as e:
        load_config(None, ["train.engine=fullgraph", "data.partitions=x", "fullgraph.offload=true",
                           "fullgraph.halo_precision=bf16"])
    assert "\n" not in str(e.value)
    cfg = load_config(None, ["train.engine=fullgraph", "data.partitions=x"])
    assert cfg.fullgraph.halo_precision == "fp32"                   # default off


def test_bench_case_names_with_bf16():
    from benchmarks.fullgraph_cached import case_overrides, run_dir

    assert case_overrides("S2+pipe+bf16") == ["fullgraph.pipeline=true", "fullgraph.halo_precision=bf16",
                                              "fullgraph.halo=cached", "fullgraph.staleness=2"]
    assert case_overrides("exact+bf16")[:2] == ["fullgraph.pipeline=false", "fullgraph.halo_precision=bf16"]
    assert "fullgraph.halo_precision=fp32" in case_overrides("S2")          # the default, explicitly
    assert run_dir(Path("w"), "S2+pipe+bf16", 1) == Path("w/S2-pipe-bf16-seed1")
    for bad in ("S2+bf16+pipe", "bf16", "S+bf16"):
        with pytest.raises(ValueError, match="bad case"):
            case_overrides(bad)
